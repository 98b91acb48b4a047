"""Several KV-cache groups: vLLM's scheduler on vLLM's own manager against the same scheduler
on kvblocks' manager, step by step, for the layouts of today's model families (small windows
and chunks, so that they matter in short scripts): every ``SchedulerOutput``, request
output, statistic, usage figure, KV-event batch and block table must be identical, and
kvblocks' manager must have run (``both`` asserts it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm_driver import SchedulerSpec, layout_groups
from tests.vllm_tier.harness import (
    RequestSpec,
    Script,
    assert_same,
    both,
    draw_aborts_and_resets,
    featured_script,
    group_tables,
    shared_prefix_script,
    soak_script,
)

#: Small stand-ins for the families' layouts (block size 4): the window and chunk sizes are
#: a few blocks, so that blocks leave windows and chunks within a script.
LAYOUTS: dict[str, list[tuple[str, int]]] = {
    "gpt-oss": [("full", 0), ("sliding_window", 16)],
    "gemma3": [("sliding_window", 24)] * 5 + [("full", 0)],
    "llama4": [("chunked_local", 32), ("full", 0)],
    "mla": [("mla", 0)],
    "sliding-window only": [("sliding_window", 12)],
    "two windows": [("sliding_window", 12), ("full", 0), ("sliding_window", 40)],
    "window of one token": [("full", 0), ("sliding_window", 1)],
}


def spec_for(layout: str, blocks_per_group: int = 40, **kwargs: Any) -> SchedulerSpec:
    groups = LAYOUTS[layout]
    num_blocks = blocks_per_group * len(groups) + 1
    kwargs = {"block_size": 4, "max_num_batched_tokens": 48, "kv_events": True, **kwargs}
    return SchedulerSpec(layout=groups, num_blocks=num_blocks, **kwargs)


def test_the_layouts_are_the_families() -> None:
    """The stand-ins keep each family's group kinds, in its order (only sizes shrink)."""
    for name in ("gpt-oss", "gemma3", "llama4", "mla"):
        kinds = [kind for kind, _ in LAYOUTS[name]]
        assert kinds == [kind for kind, _ in layout_groups(name)]


def has_window(layout: str) -> bool:
    return any(kind == "sliding_window" for kind, _ in LAYOUTS[layout])


CASES = [
    (layout, retention)
    for layout in LAYOUTS
    # vLLM refuses a positive retention interval without a sliding-window group.
    for retention in ([None, 0, 8] if has_window(layout) else [None, 0])
]


@pytest.mark.parametrize(("layout", "retention"), CASES)
def test_shared_prefixes_with_events(model_dir: Path, layout: str, retention: int | None) -> None:
    spec = spec_for(layout, retention_interval=retention)
    seed = list(LAYOUTS).index(layout)
    script = shared_prefix_script(spec, 30, seed=seed, prefix_lens=(1, 90))
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    if retention is None:  # dense: every shared block-aligned prefix can hit
        hits = sum(record[2][1][3] for record in stock[:-1] if record[2] is not None)
        # A one-token window needs no block for a hit, so vLLM registers none: nothing hits.
        assert (hits > 0) == (layout != "window of one token")


@pytest.mark.parametrize("layout", ["gpt-oss", "gemma3", "llama4"])
def test_small_pool_preempts_identically(
    model_dir: Path, layout: str, async_scheduling: bool
) -> None:
    spec = spec_for(layout, blocks_per_group=14, async_scheduling=async_scheduling)
    script = shared_prefix_script(spec, 24, seed=7, prefix_lens=(10, 40), suffix_lens=(0, 12))
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    assert any(record[0] is not None and record[0][5] for record in stock[:-1]), "must preempt"


@pytest.mark.parametrize("layout", ["gpt-oss", "llama4", "two windows"])
def test_salts_lora_aborts_resets_and_report_mode(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, watermark=0.05)
    stock, ours = both(model_dir, featured_script(spec, prefix_lens=(5, 80)))
    assert_same(stock, ours)
    kinds = {kind for record in stock[:-1] for batch in record[3] for kind, _ in batch}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


@pytest.mark.parametrize("layout", ["gpt-oss", "gemma3"])
def test_prefix_caching_off(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, enable_caching=False, max_num_batched_tokens=2048)
    stock, ours = both(model_dir, shared_prefix_script(spec, 20, seed=5))
    assert_same(stock, ours)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_soak_of_over_a_thousand_steps(model_dir: Path, layout: str) -> None:
    spec = spec_for(layout, blocks_per_group=40, max_num_batched_tokens=24, max_num_seqs=8)
    script = soak_script(spec, seed=99)
    stock, ours = both(model_dir, script)
    assert len(stock) > 1000
    assert_same(stock, ours)


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    layout = draw(st.sampled_from(list(LAYOUTS)))
    prefixes = draw(
        st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=60), min_size=1, max_size=3)
    )
    n = draw(st.integers(1, 10))
    requests = []
    for _ in range(n):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 999), max_size=30))
        requests.append(
            RequestSpec(
                prompt=prompt,
                max_tokens=draw(st.integers(1, 24)),
                step=draw(st.integers(0, 12)),
                salt=draw(st.sampled_from([None, None, "a"])),
                lora=draw(st.sampled_from([None, None, 1])),
            )
        )
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    blocks_per_group = -(-longest // 4) + 2
    spec = spec_for(
        layout,
        blocks_per_group=draw(st.integers(blocks_per_group, blocks_per_group + 20)),
        enable_caching=draw(st.sampled_from([True, True, False])),
        max_num_seqs=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64])),
        async_scheduling=draw(st.booleans()),
        kv_events=draw(st.booleans()),
        retention_interval=draw(st.sampled_from([None, 0, 8] if has_window(layout) else [0])),
    )
    aborts, resets = draw_aborts_and_resets(draw, n)
    return Script(spec, requests, aborts, resets)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts())
def test_random_scripts(model_dir: Path, script: Script) -> None:
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)


@pytest.mark.parametrize("layout", ["gpt-oss", "llama4", "mla"])
def test_req_to_blocks_reads_as_vllms(model_dir: Path, layout: str) -> None:
    """Each group manager's ``req_to_blocks`` (which vLLM's connector tests and tools read,
    the scheduler never) reads the same on kvblocks' manager (a view made when read) as on
    vLLM's at every step: the same requests, blocks, null blocks and registered blocks."""
    script = shared_prefix_script(spec_for(layout), 20, seed=4, prefix_lens=(1, 90))
    script.aborts = [(5, 2), (9, 7)]
    script.actions = {step: [group_tables] for step in range(60)}
    stock, ours = both(model_dir, script)
    assert_same(stock, ours)
    tables = [table for record in stock[:-1] for result in record[5] for table in result]
    assert any(rows for rows in tables), "requests held blocks"
    blocks = [b for rows in tables for _, held in rows for b in held]
    assert any(registered for _, _, registered in blocks), "registered blocks"
    assert any(not registered for _, _, registered in blocks), "blocks not yet registered"
    if layout != "mla":  # blocks out of the window or chunk are the null block
        assert any(is_null for _, is_null, _ in blocks)
