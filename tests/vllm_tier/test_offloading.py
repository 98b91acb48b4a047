"""vLLM's native CPU offloading (the ``OffloadingConnector``, ``--kv-offloading-size``):
vLLM's scheduler with the connector on vLLM's own KV-cache manager against the same on
kvblocks', step by step (the driver: ``tests.vllm_driver.offloading``, vLLM's real
CPU tier with a worker side that completes every transfer). Every ``SchedulerOutput`` with
the connector's load, store and flush jobs, request output, statistic, usage figure, KV-event
batch (GPU and CPU) and block table must be identical, and kvblocks' manager must have run
(``both`` asserts it): external tokens, asynchronous loads, deferred frees under async
scheduling, the async-load reservation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblocks.vllm.bench import mamba_checkpoint_alignment_for
from tests.vllm_driver import SchedulerSpec
from tests.vllm_tier.harness import (
    RequestSpec,
    Script,
    assert_same,
    both,
    draw_aborts_and_resets,
    featured_script,
    served_scheduler,
    shared_prefix_script,
    soak_script,
)

#: Fields of a step's record: the snapshot's preemptions and the connector's jobs.
PREEMPTED, LOADS, STORES, FLUSHED = 5, 9, 10, 11
LAYOUTS: dict[str, list[tuple[str, int]]] = {
    "llama": [("full", 0)],
    "gpt-oss": [("full", 0), ("sliding_window", 16)],
    "llama4": [("chunked_local", 32), ("full", 0)],
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
}


def spec_for(layout: str, **kwargs: Any) -> SchedulerSpec:
    kwargs = {
        "block_size": 4,
        "num_blocks": 40 * len(LAYOUTS[layout]) + 1,
        "kv_offloading": 48,
        "kv_events": True,
        "max_num_batched_tokens": 48,
        "mamba_checkpoint_alignment": mamba_checkpoint_alignment_for(layout, 4),
        **kwargs,
    }
    return SchedulerSpec(layout=LAYOUTS[layout], **kwargs)


def steps(stock: list[Any]) -> list[Any]:
    return [record[0] for record in stock[:-1] if record[0] is not None]


def jobs(stock: list[Any], field: int) -> list[Any]:
    return [job for snap in steps(stock) for job in snap[field]]


def cpu_events(stock: list[Any]) -> list[str]:
    return [
        kind
        for record in stock[:-1]
        for batch in record[3]
        for kind, event in batch
        if event.get("medium") == "CPU"
    ]


def reset_then_repeat(spec: SchedulerSpec, seed: int) -> Script:
    """Shared-prefix requests, a GPU prefix-cache reset once they are done (step 150), then
    the same prompts again: they hit the CPU tier and load asynchronously."""
    script = shared_prefix_script(spec, 12, seed=seed, prefix_lens=(8, 60), arrival_steps=10)
    again = [RequestSpec(r.prompt, r.max_tokens, 160 + i) for i, r in enumerate(script.requests)]
    script.requests += again
    script.resets = [150]
    return script


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_hits_after_a_gpu_reset(model_dir: Path, layout: str, async_scheduling: bool) -> None:
    spec = spec_for(layout, async_scheduling=async_scheduling)
    stock, ours = both(model_dir, reset_then_repeat(spec, seed=list(LAYOUTS).index(layout)))
    assert_same(stock, ours)
    assert jobs(stock, STORES), "blocks are stored to the CPU tier"
    assert jobs(stock, LOADS), "and loaded back after the reset"
    assert "BlockStored" in cpu_events(stock)
    mamba = [g for g, (kind, _) in enumerate(LAYOUTS[layout]) if kind == "mamba"]
    if mamba:
        # Mamba states reach the CPU tier only as the manager's boundary-state offers.
        assert all(any(job[2][1][g] for job in jobs(stock, STORES)) for g in mamba)
        assert all(any(job[2][1][g] for job in jobs(stock, LOADS)) for g in mamba)


@pytest.mark.parametrize("layout", ["llama", "gpt-oss", "qwen3.5"])
def test_small_pools_preempt_and_evict(
    model_dir: Path, layout: str, async_scheduling: bool
) -> None:
    """A GPU pool that preempts (the longest request needs 33 of its 36 blocks per group; a
    Mamba group holds a few blocks per request, so qwen3.5 gets 80 in all) and a CPU tier that
    evicts."""
    num_blocks = 80 if layout == "qwen3.5" else 36 * len(LAYOUTS[layout]) + 1
    spec = spec_for(
        layout, num_blocks=num_blocks, kv_offloading=10, async_scheduling=async_scheduling
    )
    script = reset_then_repeat(spec, seed=4)
    script.resets = [60, 150]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(snap[PREEMPTED] for snap in steps(stock)), "must preempt"
    assert "BlockRemoved" in cpu_events(stock), "the CPU tier must evict"


def test_featured_script(model_dir: Path, async_scheduling: bool) -> None:
    """Aborts, salts, LoRA, full-report mode, skip_reading_prefix_cache, failed and idle
    resets, with the connector."""
    spec = spec_for("gpt-oss", async_scheduling=async_scheduling, watermark=0.05)
    stock, ours = both(model_dir, featured_script(spec, prefix_lens=(5, 80)))
    assert_same(stock, ours)
    assert jobs(stock, STORES)


#: Per soaked layout, the GPU pool (blocks) and the CPU tier (chunks): sizes that preempt,
#: evict and load back (the Mamba states take a chunk each).
SOAK_SIZES = {"llama": (41, 30), "gpt-oss": (81, 30), "qwen3.5": (81, 120)}


@pytest.mark.parametrize("layout", list(SOAK_SIZES))
def test_soak(model_dir: Path, layout: str, async_scheduling: bool) -> None:
    num_blocks, cpu_chunks = SOAK_SIZES[layout]
    spec = spec_for(
        layout,
        num_blocks=num_blocks,
        kv_offloading=cpu_chunks,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
    )
    stock, ours = both(model_dir, soak_script(spec, seed=99))
    assert len(stock) > 1000
    assert_same(stock, ours)
    assert jobs(stock, LOADS)
    assert jobs(stock, FLUSHED)


@pytest.mark.parametrize("layout", ["gpt-oss", "qwen3.5"])
def test_the_connector_runs_on_kvblocks(model_dir: Path, layout: str) -> None:
    """What status() says, and that the connector got kvblocks' manager and its blocks
    (with Mamba prefix caching too)."""
    described = "4-token blocks, prefix caching on, OffloadingConnector"
    served_scheduler(model_dir, spec_for(layout), "OffloadingConnector", described)


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """Random shared-prefix requests, aborts and GPU resets with a random CPU tier size."""
    layout = draw(st.sampled_from(list(LAYOUTS)))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 999), min_size=4, max_size=60), min_size=1, max_size=3)
    )
    n = draw(st.integers(1, 12))
    requests = [
        RequestSpec(
            prompt=draw(st.sampled_from(prefixes))
            + draw(st.lists(st.integers(0, 999), max_size=20)),
            max_tokens=draw(st.integers(1, 16)),
            step=draw(st.integers(0, 40)),
        )
        for _ in range(n)
    ]
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    per_group = -(-longest // 4) + 2
    spec = spec_for(
        layout,
        num_blocks=draw(st.integers(per_group, per_group + 30)) * len(LAYOUTS[layout]) + 1,
        kv_offloading=draw(st.sampled_from([4, 16, 64])),
        max_num_seqs=draw(st.sampled_from([1, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64])),
        async_scheduling=draw(st.booleans()),
        kv_events=draw(st.booleans()),
    )
    aborts, resets = draw_aborts_and_resets(draw, n, max_resets=3)
    return Script(spec, requests, aborts, resets)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
