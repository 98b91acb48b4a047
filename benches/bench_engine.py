"""The seed's measurement (vLLM PR #4696): generate repeatedly from one long prompt with prefix
caching on, so every prefix block is a hit, and report the share of engine time spent in
bookkeeping (hashing, block management and scheduling) with the Python twin and with the Rust
core, in the same run, plus the end-to-end speed-up.

    pytest benches/bench_engine.py -s --benchmark-columns=median,rounds [--ratios-md FILE]
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the engine needs the kvblocks[torch] extra")

from kvblocks.engine import LLM, SamplingParams  # noqa: E402
from kvblocks.model import LlamaConfig  # noqa: E402
from kvblocks.workloads import random_prompt, shared_prefix_prompts  # noqa: E402

PARAMS = SamplingParams(max_tokens=16)
SHARES: dict[tuple[int, str], float] = {}


@pytest.mark.parametrize("backend", ["rust", "python"])
@pytest.mark.parametrize("prompt_len", [8192, 32768])
def test_generate_with_every_prefix_block_cached(
    benchmark: Any, prompt_len: int, backend: str
) -> None:
    llm = LLM(
        backend=backend,
        num_blocks=prompt_len // 16 + 64,
        max_num_batched_tokens=prompt_len + 16,
    )
    prompt = random_prompt(prompt_len, seed=7, vocab_size=LlamaConfig().vocab_size)
    first = llm.generate([prompt], PARAMS)  # computes and caches the prefix
    book, model = llm.stats.bookkeeping_s, llm.stats.model_s
    case = f"generate 16 tokens from a cached {prompt_len // 1024}k-token prompt"
    impl = "rust" if backend == "rust" else "twin"
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "twin"]] if impl == "rust" else []
    )
    result = benchmark.pedantic(lambda: llm.generate([prompt], PARAMS), rounds=5, warmup_rounds=1)
    assert result[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert result[0].num_cached_tokens == prompt_len - 16  # every block but the capped last one
    share = (llm.stats.bookkeeping_s - book) / (
        llm.stats.bookkeeping_s - book + llm.stats.model_s - model
    )
    SHARES[(prompt_len, impl)] = share
    benchmark.extra_info["bookkeeping_share"] = share
    print(f"\n{case}, {impl}: bookkeeping {share:.1%} of engine time")


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_shared_prefix_workload(benchmark: Any, backend: str) -> None:
    """The default ``kvblocks bench`` workload: 32 requests, a 1,024-token shared prefix and 64
    tokens of their own, 32 output tokens."""
    prompts = shared_prefix_prompts(32, 1024, 64, vocab_size=LlamaConfig().vocab_size)
    params = SamplingParams(max_tokens=32)
    case = "kvblocks bench workload: 32 requests, 1k shared prefix, 32 output tokens"
    impl = "rust" if backend == "rust" else "twin"
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "twin"]] if impl == "rust" else []
    )
    engines: list[LLM] = []

    def run() -> None:
        engines.append(LLM(backend=backend, max_num_seqs=32, max_num_batched_tokens=4096))
        engines[-1].generate(prompts, params)

    benchmark.pedantic(run, rounds=2, warmup_rounds=0)
    stats = engines[-1].stats
    assert stats.prefix_hit_rate > 0.9
    benchmark.extra_info["bookkeeping_share"] = stats.bookkeeping_share
    print(f"\n{case}, {impl}: bookkeeping {stats.bookkeeping_share:.1%} of engine time")
