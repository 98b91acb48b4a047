"""vLLM's MooncakeConnector (disaggregated prefill and decode over Mooncake's transfer engine)
on vLLM's scheduler, with vLLM's own KV-cache manager and with kvblocks', step by step. As
in ``test_nixl.py``, one scheduler plays both roles: prefill requests keep their blocks after
they finish until the (fake) transfer engine has sent them; decode requests get their
prompt's KV asynchronously into the blocks allocated for them. Every ``SchedulerOutput``, the
connector's decisions of every step (the transfers into decode requests' blocks, the
prefills handed over with their blocks, the transfers dropped), every request output,
statistic, KV event and block table must be identical, and kvblocks' manager must have run
(``both`` asserts it)."""

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
    disaggregated_script,
    draw_disaggregated_script,
    draw_sizes,
    records_of,
    served_scheduler,
)

#: Fields of a step's record (``vllm_driver.snapshot``): preempted requests, then the
#: connector's transfers into decode requests, hand-overs and dropped transfers.
PREEMPTED, RECV, SEND, DROPPED = 5, 9, 10, 11
LAYOUTS = CONNECTOR_LAYOUTS


def spec_for(layout: str, **kwargs: Any) -> SchedulerSpec:
    return connector_spec(layout, **{"mooncake": True, **kwargs})


def test_the_scheduler_gets_mooncake_and_kvblocks_serves_it(model_dir: Path) -> None:
    described = "prefix caching on, MooncakeConnector"
    served_scheduler(model_dir, spec_for("llama"), "MooncakeConnector", described)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_disaggregated_prefill_and_decode(
    model_dir: Path, layout: str, async_scheduling: bool
) -> None:
    spec = spec_for(layout, async_scheduling=async_scheduling)
    script = disaggregated_script(spec, 24, seed=3)
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    records = records_of(stock)
    recv = [r for record in records for r in record[0][RECV]]
    assert any(any(blocks) for _, _, blocks in recv), "KV into decode requests' blocks"
    sends = [s for record in records for s in record[0][SEND]]
    assert any(any(blocks) for _, _, blocks in sends), "finished prefills' blocks handed over"
    assert any(not any(blocks) for _, _, blocks in sends), "prefills registered at admission"
    if not layout.endswith("prefix caching off"):
        # decode requests whose prompt is partly cached locally get only the rest
        block_size = spec.block_size
        prompt_blocks = {
            f"r{i}": len(r.prompt) // block_size for i, r in enumerate(script.requests)
        }
        assert any(0 < len(blocks[0]) < prompt_blocks[rid] for rid, _, blocks in recv)


def test_small_pool_preempts_identically(model_dir: Path) -> None:
    spec = spec_for("llama", num_blocks=28, max_num_batched_tokens=64)
    stock, ours = both(model_dir, disaggregated_script(spec, 30, seed=7))
    assert_same(stock, ours)
    assert any(record[0][PREEMPTED] for record in records_of(stock)), "must preempt"


def test_aborts_and_resets(model_dir: Path) -> None:
    """Prefill requests aborted as they arrive (their transfers dropped), decode requests
    aborted one step after they arrive, resets."""
    script = disaggregated_script(spec_for("gpt-oss"), 24, seed=5)
    step = [r.step for r in script.requests]
    script.aborts = sorted([(step[0], 0), (step[3], 3), (step[1] + 1, 1), (step[4] + 1, 4)])
    script.resets = [2, 25, 299]
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(record[0][DROPPED] for record in records_of(stock)), "dropped transfers"


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    spec = spec_for(draw(st.sampled_from(list(LAYOUTS))), **draw_sizes(draw))
    return draw_disaggregated_script(draw, spec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
