"""Mamba and linear-attention groups (Qwen3.5 / Qwen3-Next, Jamba, Nemotron-H): vLLM's
scheduler on vLLM's own manager against the same scheduler on kvblocks', step by step, with
prefix caching off (vLLM's ``mamba_cache_mode="none"``). Every ``SchedulerOutput`` (the
blocks to zero included), request output, statistic, usage figure and block table must be
identical, and kvblocks' manager must have run (``both`` asserts it). With prefix caching on
(vLLM's "align" mode) kvblocks falls back, naming the reason.

Also KV-cache zeroing without Mamba (a mixed-precision cache), with prefix caching on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm.bench_driver import SchedulerSpec, Speculation, make_scheduler
from tests.vllm_tier.harness import (
    RequestSpec,
    Script,
    assert_same,
    both,
    draw_aborts_and_resets,
    featured_script,
    shared_prefix_script,
    soak_script,
)

#: The families' layouts (the Mamba block size is vLLM's default without prefix caching:
#: max_model_len), and a Mamba-only model.
LAYOUTS: dict[str, list[tuple[str, int]]] = {
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
    "jamba": [("full", 0)] + [("mamba", 0)] * 7,
    "gpt-oss + mamba": [("full", 0), ("sliding_window", 16), ("mamba", 0)],
    "mamba only": [("mamba", 0)],
}
MAX_MODEL_LEN = 512
#: Fields of a step's ``SchedulerOutput`` record (``bench_driver.snapshot``).
PREEMPTED, DRAFTS, ZERO = 5, 6, 7


def spec_for(layout: str, num_blocks: int = 200, **kwargs: Any) -> SchedulerSpec:
    kwargs = {
        "block_size": 4,
        "max_num_batched_tokens": 48,
        "max_model_len": MAX_MODEL_LEN,
        "enable_caching": False,
        **kwargs,
    }
    return SchedulerSpec(layout=LAYOUTS[layout], num_blocks=num_blocks, **kwargs)


def records_of(stock: list[Any]) -> list[Any]:
    """The per-step records (the last entry is the run's block hashes)."""
    return [record for record in stock[:-1] if record[0] is not None]


def blocks_to_zero(stock: list[Any]) -> list[int]:
    return [b for record in records_of(stock) for b in record[0][ZERO] or ()]


def preempted(stock: list[Any]) -> bool:
    return any(record[0][PREEMPTED] for record in records_of(stock))


def test_the_scheduler_gets_mamba_groups_and_zeroing(model_dir: Path) -> None:
    """What the layouts give vLLM: Mamba specs in "none" mode with max_model_len-token
    blocks, zeroing on, the scheduler's block size the groups' LCM, vLLM's no-prefix-cache
    coordinator; and kvblocks' manager really runs them."""
    spec = spec_for("qwen3.5", speculative=Speculation("ngram", 3))
    kvblocks.vllm.install("all")
    scheduler = make_scheduler(model_dir, spec)
    assert type(scheduler.kv_cache_manager).__module__ == "kvblocks.vllm.kv_cache_manager"
    described = "4 groups (full_attention, mamba, mamba, mamba), 4/512/512/512-token blocks"
    assert f"kv_cache_manager on {described}, prefix caching off" in str(kvblocks.vllm.status())
    config = scheduler.kv_cache_config
    mamba = [g.kv_cache_spec for g in config.kv_cache_groups[1:]]
    assert all(type(s) is MambaSpec for s in mamba)
    assert {(s.mamba_cache_mode, s.block_size, s.num_speculative_blocks) for s in mamba} == {
        ("none", MAX_MODEL_LEN, 3)
    }
    assert config.needs_kv_cache_zeroing
    assert scheduler.block_size == MAX_MODEL_LEN  # lcm(4, 512)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_prefixes(model_dir: Path, layout: str, async_scheduling: bool) -> None:
    spec = spec_for(layout, async_scheduling=async_scheduling)
    stock, ours = both(model_dir, shared_prefix_script(spec, 24, seed=3, prefix_lens=(1, 90)))
    assert_same(stock, ours)
    zeroed = blocks_to_zero(stock)
    # Only attention groups' blocks are zeroed; a Mamba-only model has none.
    assert bool(zeroed) == (layout != "mamba only")


@pytest.mark.parametrize(
    ("layout", "num_blocks", "prefix_lens"),
    [("qwen3.5", 60, (10, 60)), ("gpt-oss + mamba", 30, (10, 40))],
)
def test_small_pool_preempts_identically(
    model_dir: Path,
    layout: str,
    num_blocks: int,
    prefix_lens: tuple[int, int],
    async_scheduling: bool,
) -> None:
    spec = spec_for(layout, num_blocks=num_blocks, async_scheduling=async_scheduling)
    script = shared_prefix_script(spec, 24, seed=7, prefix_lens=prefix_lens, suffix_lens=(0, 12))
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert preempted(stock), "must preempt"


@pytest.mark.parametrize("layout", ["qwen3.5", "jamba"])
def test_aborts_salts_lora_and_resets(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, watermark=0.05, kv_events=True)
    stock, ours = both(model_dir, featured_script(spec, prefix_lens=(5, 80)))
    assert_same(stock, ours)


@pytest.mark.parametrize("method", ["ngram", "eagle", "mtp"])
def test_speculative_blocks(model_dir: Path, method: str, async_scheduling: bool) -> None:
    """n-gram, EAGLE and MTP (Qwen3.5's own drafter) drafts: each Mamba group also holds
    blocks for the draft tokens' states (``num_speculative_blocks``)."""
    spec = spec_for(
        "qwen3.5",
        num_blocks=90,
        speculative=Speculation(method, 3),
        async_scheduling=async_scheduling,
    )
    script = shared_prefix_script(spec, 20, seed=11, prefix_lens=(4, 50))
    script.aborts = [(5, 2), (12, 9)]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(record[0][DRAFTS] for record in records_of(stock)), "drafts were scheduled"


@pytest.mark.parametrize("layout", ["qwen3.5", "gpt-oss + mamba"])
def test_soak(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, num_blocks=120, max_num_batched_tokens=24, max_num_seqs=8)
    script = soak_script(spec, seed=5)
    stock, ours = both(model_dir, script)
    assert len(stock) > 1000
    assert_same(stock, ours)


def test_mixed_precision_zeroing_with_prefix_caching(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV-cache zeroing without Mamba (vLLM turns it on for mixed-precision caches): every
    attention group's fresh blocks, with prefix hits, windows and events."""
    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))
    spec = SchedulerSpec(
        layout=[("full", 0), ("sliding_window", 16)],
        num_blocks=81,
        block_size=4,
        max_num_batched_tokens=48,
        kv_events=True,
    )
    stock, ours = both(model_dir, shared_prefix_script(spec, 24, seed=2, prefix_lens=(8, 90)))
    assert_same(stock, ours)
    assert blocks_to_zero(stock)
    hits = sum(record[2][1][3] for record in stock[:-1] if record[2] is not None)
    assert hits > 0


def test_prefix_caching_with_mamba_falls_back(model_dir: Path) -> None:
    """vLLM's "align" mode (prefix caching on) is not implemented: vLLM's own manager runs,
    and status() names the reason."""
    kvblocks.vllm.install("all")
    _state.fallbacks.clear()
    scheduler = make_scheduler(model_dir, spec_for("qwen3.5", enable_caching=True))
    assert type(scheduler.kv_cache_manager) is VllmKVCacheManager
    assert _state.fallbacks == {("kv_cache_manager", "mamba_prefix_caching"): 1}
    assert "prefix caching with Mamba or linear-attention groups" in str(kvblocks.vllm.status())


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Random requests, aborts and resets on a random Mamba layout, prefix caching off."""
    layout = draw(st.sampled_from(list(LAYOUTS)))
    n = draw(st.integers(1, 10))
    requests = [
        RequestSpec(
            prompt=draw(st.lists(st.integers(0, 999), min_size=1, max_size=90)),
            max_tokens=draw(st.integers(1, 24)),
            step=draw(st.integers(0, 12)),
        )
        for _ in range(n)
    ]
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    attention_blocks = -(-longest // 4) + 2
    groups = len(LAYOUTS[layout])
    method = draw(st.sampled_from([None, None, "ngram", "eagle"]))
    spec = spec_for(
        layout,
        # room for the longest request: its attention blocks and each Mamba group's states
        num_blocks=draw(st.integers(attention_blocks, attention_blocks + 30)) + 4 * groups,
        max_num_seqs=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64])),
        async_scheduling=draw(st.booleans()),
        kv_events=draw(st.booleans()),
        speculative=Speculation(method, 3) if method else None,
    )
    aborts, resets = draw_aborts_and_resets(draw, n)
    return Script(spec, requests, aborts, resets)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
