"""vLLM's DecodeBenchConnector (its connector for benchmarking a decode instance: every
prompt's KV but the last token arrives as a synchronous external hit, which its worker side
fills with dummy values) on vLLM's scheduler, with vLLM's own KV-cache manager and with
kvblocks', step by step: every ``SchedulerOutput`` with the connector's fills (the blocks of
each group it fills, and how many tokens), request output, statistic, KV event and block
table identical, and kvblocks' manager active (``both`` asserts it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm_driver import SchedulerSpec
from tests.vllm_tier.harness import (
    CONNECTOR_LAYOUTS,
    Script,
    assert_same,
    both,
    connector_spec,
    draw_aborts_and_resets,
    served_scheduler,
    shared_prefix_script,
)

#: Fields of a step's record (``vllm_driver.snapshot``): preempted requests, the fills.
PREEMPTED, FILLS = 5, 9
LAYOUTS = CONNECTOR_LAYOUTS


def spec_for(layout: str, fill: str = "per request", **kwargs: Any) -> SchedulerSpec:
    return connector_spec(layout, **{"decode_bench": fill, **kwargs})


def fills(stock: list[Any]) -> list[Any]:
    return [f for record in stock[:-1] if record[0] is not None for f in record[0][FILLS]]


def test_the_scheduler_gets_the_connector_and_kvblocks_serves_it(model_dir: Path) -> None:
    described = "prefix caching on, DecodeBenchConnector"
    served_scheduler(model_dir, spec_for("gpt-oss"), "DecodeBenchConnector", described)


@pytest.mark.parametrize("fill", ["per request", "startup"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prompts_arrive_filled(
    model_dir: Path, layout: str, fill: str, async_scheduling: bool
) -> None:
    """Every request is admitted with its prompt but the last token computed (a local hit,
    then the connector's fill); the blocks filled per request are each group's but, with
    vLLM's start-up fill, those of the groups it fills once at start-up (all here but the
    attention group of a model with Mamba layers, whose fresh blocks vLLM zeroes)."""
    spec = spec_for(layout, fill, async_scheduling=async_scheduling)
    script = shared_prefix_script(spec, 24, seed=5, prefix_lens=(8, 90))
    script.aborts = [(3, 2), (10, 9)]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    prompts = {f"r{i}": len(r.prompt) for i, r in enumerate(script.requests)}
    # Each request's first admission: vLLM 0.34 lists a preempted request that resumes among
    # the new ones too, with what it finds then (the connector fills a request only once).
    admitted: dict[str, int] = {}
    for record in stock[:-1]:
        if record[0] is not None:
            for rid, _, computed in record[0][1]:
                admitted.setdefault(rid, computed)
    assert admitted
    assert all(computed == prompts[rid] - 1 for rid, computed in admitted.items())
    filled = fills(stock)
    per_request = fill == "per request" or "qwen" in layout
    assert any(any(groups) for _, groups, _ in filled) == per_request
    if fill == "startup" and per_request:  # only the attention group is filled per request
        assert all(not any(groups[1:]) for _, groups, _ in filled)


def test_small_pool_preempts_identically(model_dir: Path) -> None:
    """(A prompt's blocks are allocated at once when it is admitted with the fill: a pool
    smaller than one prompt would leave it waiting forever, on either manager.)"""
    spec = spec_for("llama", num_blocks=34, max_num_batched_tokens=64)
    stock, ours = both(model_dir, shared_prefix_script(spec, 30, seed=7, prefix_lens=(8, 60)))
    assert_same(stock, ours)
    assert any(record[0][PREEMPTED] for record in stock[:-1] if record[0] is not None)


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    layout = draw(st.sampled_from(list(LAYOUTS)))
    spec = spec_for(
        layout,
        draw(st.sampled_from(["per request", "startup"])),
        # room for the longest prompt (130 tokens) in every group, allocated at admission
        num_blocks=draw(st.integers(36, 100)) * len(LAYOUTS[layout]),
        max_num_seqs=draw(st.sampled_from([2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([16, 48])),
        async_scheduling=draw(st.booleans()),
    )
    n = draw(st.integers(1, 12))
    script = shared_prefix_script(spec, n, seed=draw(st.integers(0, 1000)), prefix_lens=(1, 90))
    script.aborts, script.resets = draw_aborts_and_resets(draw, n)
    return script


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
