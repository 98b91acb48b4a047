"""The seed's measurement (vLLM PR #4696): generate repeatedly from one long prompt with prefix
caching on, so every prefix block is a hit, and report the share of engine time spent in
bookkeeping (hashing, block management and scheduling) with the Python reference and with the Rust
core, in the same run, plus the end-to-end speed-up.

    pytest benches/bench_engine.py -s --benchmark-columns=median,rounds [--ratios-md FILE]

And the engine's bookkeeping per decode step (``Scheduler.schedule`` and handing over the
sampled tokens) at 64 and 256 running requests, against the bare ``schedule_step`` call it
wraps and against the same scheduler on the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvblocks
import kvblocks.reference
from kvblocks.scheduler import Scheduler, Sequence
from kvblocks.workloads import random_prompt

torch = pytest.importorskip("torch", reason="the engine needs the kvblocks[torch] extra")

from kvblocks.engine import LLM, SamplingParams  # noqa: E402
from kvblocks.model import LlamaConfig  # noqa: E402
from kvblocks.workloads import shared_prefix_prompts  # noqa: E402

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
    impl = "rust" if backend == "rust" else "reference"
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "reference"]] if impl == "rust" else []
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
    impl = "rust" if backend == "rust" else "reference"
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "reference"]] if impl == "rust" else []
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


class DecodeBatch:
    """``num_reqs`` sequences of 500 to 2,000 prompt tokens, prefilled through a
    :class:`~kvblocks.scheduler.Scheduler`, ready for decode steps (one sampled token each)."""

    def __init__(self, module: Any, num_reqs: int, rounds: int) -> None:
        rng = np.random.default_rng(num_reqs)
        lengths = rng.integers(500, 2001, size=num_reqs).tolist()
        capacity = sum(lengths) + num_reqs * (rounds + 2 * BLOCK_SIZE)
        self.manager = module.BlockManager(capacity // BLOCK_SIZE + 2 * num_reqs, BLOCK_SIZE)
        self.budget = sum(lengths)
        self.scheduler = Scheduler(
            self.manager, max_num_seqs=num_reqs, max_num_batched_tokens=self.budget
        )
        for i, n in enumerate(lengths):
            self.scheduler.add(Sequence(f"req-{i}", random_prompt(n, seed=i), rounds + 10))
        self.sampled = np.full(num_reqs, 7, dtype=np.int64)
        self.step()  # the prefill: every prompt in one step
        assert len(self.scheduler.running) == num_reqs

    def step(self) -> None:
        """What the engine's bookkeeping does in a decode step: schedule, hand over the
        sampled tokens."""
        out = self.scheduler.schedule()
        assert out is not None
        assert out.step.num_scheduled == len(self.sampled)
        self.scheduler.update(self.sampled)

    def bare_step(self) -> None:
        """The one manager call inside :meth:`step`, with the same arguments."""
        s = self.scheduler
        step = self.manager.schedule_step(
            s._running_handles,
            sampled_token_ids=self.sampled,
            token_budget=self.budget,
            preempt=True,
            out=s._buffers,
        )
        assert step.num_scheduled == len(self.sampled)


BLOCK_SIZE = 16
DECODE_ROUNDS = 300


@pytest.mark.parametrize("impl", ["bare-schedule_step", "scheduler", "reference-scheduler"])
@pytest.mark.parametrize("num_reqs", [64, 256])
def test_decode_step_bookkeeping(benchmark: Any, num_reqs: int, impl: str) -> None:
    """Engine bookkeeping per decode step (``Scheduler.schedule`` + ``update``) against the
    bare ``schedule_step`` call it wraps (the floor: target at most 1.5x) and against the same
    scheduler on the reference."""
    module = kvblocks.reference if impl.startswith("reference") else kvblocks
    rounds = DECODE_ROUNDS if module is kvblocks else 20
    batch = DecodeBatch(module, num_reqs, rounds + 5)
    case = f"decode step bookkeeping, {num_reqs} running requests"
    benchmark.group = case
    info: dict[str, Any] = {"case": case, "impl": impl}
    if impl == "scheduler":
        info["baselines"] = [[case, "reference-scheduler"]]
        info["floors"] = [[case, "bare-schedule_step"]]
    benchmark.extra_info.update(info)
    fn = batch.bare_step if impl == "bare-schedule_step" else batch.step
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=3)


@pytest.mark.parametrize("impl", ["warm", "cold"])
def test_step_after_a_forward_pass(benchmark: Any, impl: str) -> None:
    """The engine calls the scheduler right after a forward pass, which has streamed the model
    and the KV cache through the CPU caches. ``cold`` streams 64 MB (untimed) before each
    scheduler step of one running request; ``warm`` does not. The ratio says how much of the
    seed setup's bookkeeping is cache misses rather than work."""
    batch = DecodeBatch(kvblocks, 1, DECODE_ROUNDS + 5)
    flood = np.ones(64 * 2**20 // 8)
    case = "scheduler step, 1 running request, after streaming 64 MB"
    benchmark.group = case
    info: dict[str, Any] = {"case": case, "impl": impl}
    if impl == "cold":
        info["floors"] = [[case, "warm"]]
    benchmark.extra_info.update(info)

    def evict_caches() -> None:
        flood.sum()

    setup = evict_caches if impl == "cold" else None
    benchmark.pedantic(batch.step, setup=setup, rounds=DECODE_ROUNDS, warmup_rounds=3)
