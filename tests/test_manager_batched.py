"""Request handles and the batched step: one call per scheduler step must do exactly what the
per-request calls do, and write the paged-attention metadata into int32 arrays."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvblocks
from tests.manager_calls import admit

B = 4


def test_handles(impl: ModuleType) -> None:
    m = impl.BlockManager(10, B)
    a = m.add_request("a", [1, 2, 3])
    b = m.add_request("b", [4, 5])
    assert (a, b) == (0, 1)
    assert m.handle("b") == b
    assert m.handle(b) == b
    m.append_token_ids(a, [6])
    assert m.get_token_ids("a") == [1, 2, 3, 6]
    assert m.allocate_slots(a, 4) == [1]
    assert m.get_block_ids("a") == m.get_block_ids(a) == [1]
    m.remove_request(a)
    with pytest.raises(KeyError):
        m.get_block_ids(a)
    c = m.add_request("c", [7])
    assert c == 1 << 32  # slot 0 again, a new generation: the old handle stays unknown
    with pytest.raises(KeyError):
        m.free(a)
    with pytest.raises(KeyError):
        m.free(-1)
    with pytest.raises(TypeError):
        m.free(1.0)
    with pytest.raises(TypeError):
        m.free(True)
    with pytest.raises(ValueError):
        m.free(2**64)
    assert m.fork(c, "d") == 2
    assert m.debug_state()["handles"] == {"b": 1, "c": 1 << 32, "d": 2}


def per_request_step(
    m: Any, handles: list[int], new: list[int], hits: list[int], tokens: list[list[int]]
) -> dict[str, Any]:
    """The per-request calls a batched step stands for, and the arrays built from them."""
    for h, t in zip(handles, tokens, strict=True):
        if t:
            m.append_token_ids(h, t)
    rows, slots, lens, starts = [], [], [], [0]
    for h, n, k in zip(handles, new, hits, strict=True):
        found = m.get_computed_blocks(h)[0][: k // B] if k else []
        if len(found) < k // B:
            break
        if m.allocate_slots(h, n, num_new_computed_tokens=k, new_computed_blocks=found) is None:
            break
        blocks = m.get_block_ids(h)
        end = m.num_computed_tokens(h)
        rows.append(blocks)
        slots += [blocks[p // B] * B + p % B for p in range(end - n, end)]
        lens.append(end)
        starts.append(starts[-1] + n)
    width = max([len(r) for r in rows], default=0)
    return {
        "num_scheduled": len(rows),
        "block_table": [r + [0] * (width - len(r)) for r in rows],
        "slot_mapping": slots,
        "seq_lens": lens,
        "query_start_loc": starts,
    }


def as_lists(step: Any) -> dict[str, Any]:
    width = max((int(np.count_nonzero(row)) for row in step.block_table), default=0)
    return {
        "num_scheduled": step.num_scheduled,
        "block_table": step.block_table[:, :width].tolist(),
        "slot_mapping": step.slot_mapping.tolist(),
        "seq_lens": step.seq_lens.tolist(),
        "query_start_loc": step.query_start_loc.tolist(),
    }


def test_batched_step_equals_the_per_request_calls(impl: ModuleType) -> None:
    batched, single = impl.BlockManager(64, B), kvblocks.BlockManager(64, B)
    prompts = [list(range(100, 110)), list(range(100, 113)), list(range(300, 305))]
    for m in (batched, single):
        for i, p in enumerate(prompts):
            m.add_request(f"r{i}", p)
        admit(m, "warm", list(range(100, 109)))  # caches two blocks of the shared prefix
    handles = [batched.handle(f"r{i}") for i in range(3)]
    blocks, hit_tokens = batched.lookup_batch(handles)
    assert blocks.dtype == np.int32
    assert blocks.tolist() == [2, 2, 0]
    assert hit_tokens.tolist() == [8, 8, 0]
    new = [len(p) - k for p, k in zip(prompts, hit_tokens.tolist(), strict=True)]
    hits = hit_tokens.tolist()
    step = batched.schedule_step(handles, new, num_new_computed_tokens=hits)
    expected = per_request_step(single, handles, new, hits, [[], [], []])
    assert as_lists(step) == expected
    assert step.num_scheduled_tokens == sum(new)
    assert step.block_table.dtype == np.int32
    for t in range(3):  # decode: one accepted token per request, then one slot each
        toks = [[7 + t], [8 + t], [9 + t]]
        flat = np.array([x for tok in toks for x in tok], dtype=np.uint32)
        offsets = np.array([0, 1, 2, 3], dtype=np.int64)
        step = batched.schedule_step(
            np.array(handles),
            np.ones(3, dtype=np.int32),
            new_token_ids=flat,
            new_token_offsets=offsets,
        )
        assert as_lists(step) == per_request_step(single, handles, [1, 1, 1], [0, 0, 0], toks)
    assert batched.debug_state() == single.debug_state()


def test_step_stops_at_the_first_request_that_does_not_fit(impl: ModuleType) -> None:
    m = impl.BlockManager(6, B)  # five usable blocks
    hs = [m.add_request(f"r{i}", list(range(i * 100, i * 100 + 8))) for i in range(3)]
    step = m.schedule_step(hs, [8, 8, 8])
    assert step.num_scheduled == 2
    assert step.query_start_loc.tolist() == [0, 8, 16]
    assert m.num_computed_tokens(hs[2]) == 0
    assert m.get_block_ids(hs[2]) == []
    assert m.num_free_blocks == 1


def test_out_buffers_are_reused_without_copies(impl: ModuleType) -> None:
    m = impl.BlockManager(32, B)
    hs = [m.add_request(f"r{i}", list(range(i * 50, i * 50 + 6))) for i in range(2)]
    buffers = kvblocks.StepBuffers.allocate(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=8)
    buffers.block_table.fill(-7)  # stale contents must not leak into the result
    step = m.schedule_step(hs, [6, 6], out=buffers)
    for name in ("block_table", "slot_mapping", "seq_lens", "query_start_loc"):
        assert np.shares_memory(getattr(step, name), getattr(buffers, name)), name
    assert step.block_table.shape == (2, 8)
    assert step.block_table.tolist() == [[1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0, 0, 0]]
    assert step.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17]
    m.append_token_ids(hs[0], 1)
    again = m.schedule_step(hs[:1], [1], out=buffers)
    assert again.slot_mapping.tolist() == [10]
    assert again.seq_lens.tolist() == [7]
    assert np.shares_memory(again.block_table, step.block_table)


def test_step_reports_copies_and_evictions(impl: ModuleType) -> None:
    m = impl.BlockManager(4, B)  # three usable blocks
    admit(m, "p", [1, 2, 3, 4, 5, 6])  # blocks 1 (full, cached) and 2 (two tokens)
    child = m.fork("p", "c")
    m.append_token_ids(child, 7)
    step = m.schedule_step([child], [1])
    assert step.block_copies.tolist() == [[2, 3]]
    assert m.take_block_copies().tolist() == []  # the step handed its copies over
    m.remove_request("c")
    m.remove_request("p")
    h = m.add_request("x", list(range(200, 212)))
    step = m.schedule_step([h], [12])
    assert sorted(step.evicted_block_ids.tolist()) == [1]  # block 1 held a cached prefix


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"handles": [0, 0], "num_new_tokens": [1, 1]}, ValueError),
        ({"handles": [0, 9], "num_new_tokens": [1, 1]}, KeyError),
        ({"handles": [0, 1], "num_new_tokens": [1]}, ValueError),
        ({"handles": [0], "num_new_tokens": [-1]}, ValueError),
        ({"handles": [0], "num_new_tokens": [0]}, ValueError),
        ({"handles": [0], "num_new_tokens": [9]}, ValueError),
        ({"handles": [0], "num_new_tokens": [1.5]}, TypeError),
        ({"handles": np.zeros((1, 1), dtype=np.int64), "num_new_tokens": [1]}, ValueError),
        ({"handles": np.zeros(1), "num_new_tokens": [1]}, TypeError),
        ({"handles": [0], "num_new_tokens": [1], "new_token_ids": [5]}, ValueError),
        (
            {
                "handles": [0],
                "num_new_tokens": [1],
                "new_token_ids": [5],
                "new_token_offsets": [0, 2],
            },
            ValueError,
        ),
        ({"handles": [0], "num_new_tokens": [1], "num_new_computed_tokens": [3]}, ValueError),
        ({"handles": [1], "num_new_tokens": [1], "num_new_computed_tokens": [4]}, ValueError),
        (
            {"handles": [0], "num_new_tokens": [8], "out": kvblocks.StepBuffers.allocate(1, 4, 4)},
            ValueError,
        ),
    ],
)
def test_bad_steps_raise_and_change_nothing(
    impl: ModuleType, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    m = impl.BlockManager(16, B)
    m.add_request("a", list(range(8)))
    m.add_request("b", list(range(8)))
    m.allocate_slots("b", 4)
    before = (m.debug_state(), m.get_token_ids("a"), m.get_token_ids("b"))
    kwargs = dict(kwargs)
    args = (kwargs.pop("handles"), kwargs.pop("num_new_tokens"))
    with pytest.raises(error):
        m.schedule_step(*args, **kwargs)
    assert (m.debug_state(), m.get_token_ids("a"), m.get_token_ids("b")) == before


def test_bad_out_buffers(impl: ModuleType) -> None:
    m = impl.BlockManager(16, B)
    h = m.add_request("a", list(range(8)))
    good = kvblocks.StepBuffers.allocate(2, 16, 4)
    wrong_dtype = dataclasses.replace(good, block_table=good.block_table.astype(np.int64))
    with pytest.raises(TypeError):
        m.schedule_step([h], [8], out=wrong_dtype)
    int32_ids = dataclasses.replace(good, input_ids=good.input_ids.astype(np.int32))
    with pytest.raises(TypeError):
        m.schedule_step([h], [8], out=int32_ids)
    read_only = kvblocks.StepBuffers.allocate(2, 16, 4)
    read_only.slot_mapping.setflags(write=False)
    with pytest.raises(ValueError):
        m.schedule_step([h], [8], out=read_only)
    strided = dataclasses.replace(good, block_table=np.zeros((2, 8), dtype=np.int32)[:, ::2])
    with pytest.raises(ValueError):
        m.schedule_step([h], [8], out=strided)
    assert m.get_block_ids(h) == []
    assert m.schedule_step([h], [8], out=good).num_scheduled == 1
