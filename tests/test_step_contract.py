"""The step contract (docs/step.md): sampled tokens from the previous rows, a token budget,
preemption by recompute inside the step, and the runtime arrays (input ids, positions, row
indices, per-row counts). Each step is checked against the per-request calls it stands for
(``append_token_ids``, ``get_computed_blocks``, ``allocate_slots``, ``free``) run on a second
manager, and the Rust core against the reference on the same scripts."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
import kvblocks.reference

B = 4


@dataclass
class Expected:
    rows: list[dict[str, Any]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)


def per_request_step(
    m: Any,
    handles: list[int],
    lookup: list[bool],
    sampled: list[tuple[int, int]],
    budget: int,
    preempt: bool,
) -> Expected:
    """What one ``schedule_step(handles, prefix_lookup=lookup, token_budget=budget,
    preempt=preempt)`` stands for, as per-request calls (``sampled``: ``(handle, token)`` of
    the previous rows, already filtered to live requests and real tokens)."""
    for h, token in sampled:
        m.append_token_ids(h, [token])
    out = Expected()
    left, n = budget, len(handles)
    for i, h in enumerate(handles):
        if i in out.preempted:
            continue
        running = bool(m.get_block_ids(h))
        if out.preempted and not running:
            break  # a step that preempted admits nobody
        hits, hit_tokens = m.get_computed_blocks(h) if lookup[i] else ([], 0)
        new = min(m.num_tokens(h) - m.num_computed_tokens(h) - hit_tokens, left)
        if new == 0:
            continue
        while True:
            got = m.allocate_slots(
                h, new, num_new_computed_tokens=hit_tokens, new_computed_blocks=hits
            )
            if got is not None or not (preempt and running):
                break
            victim = max(
                j for j in range(i, n) if j not in out.preempted and m.get_block_ids(handles[j])
            )
            m.free(handles[victim])
            out.preempted.append(victim)
            if victim == i:
                break
        if got is None:
            if out.preempted and out.preempted[-1] == i:
                continue
            break
        blocks, end = m.get_block_ids(h), m.num_computed_tokens(h)
        positions = list(range(end - new, end))
        out.rows.append(
            {
                "blocks": blocks,
                "seq_len": end,
                "req_index": i,
                "num_new_tokens": new,
                "num_new_computed_tokens": hit_tokens,
                "input_ids": m.get_token_ids(h)[end - new : end],
                "positions": positions,
                "slot_mapping": [blocks[p // B] * B + p % B for p in positions],
            }
        )
        left -= new
    return out


def rows_of(step: Any) -> Expected:
    """A step's result in the form of :func:`per_request_step`."""
    out = Expected(preempted=step.preempted.tolist())
    starts = step.query_start_loc.tolist()
    for r in range(step.num_scheduled):
        lo, hi = starts[r], starts[r + 1]
        row = step.block_table[r].tolist()
        out.rows.append(
            {
                "blocks": row[: int(np.count_nonzero(row))],
                "seq_len": int(step.seq_lens[r]),
                "req_index": int(step.req_indices[r]),
                "num_new_tokens": int(step.num_new_tokens[r]),
                "num_new_computed_tokens": int(step.num_new_computed_tokens[r]),
                "input_ids": step.input_ids[lo:hi].tolist(),
                "positions": step.positions[lo:hi].tolist(),
                "slot_mapping": step.slot_mapping[lo:hi].tolist(),
            }
        )
    assert step.num_scheduled_tokens == starts[-1] == sum(r["num_new_tokens"] for r in out.rows)
    return out


class Driver:
    """A tiny scheduler over two managers: ``m`` takes batched steps, ``reference`` the per-request
    calls; every step's rows must agree before the script goes on."""

    def __init__(self, module: ModuleType, num_blocks: int) -> None:
        self.m = module.BlockManager(num_blocks, B, hash_seed="s")
        self.reference = module.BlockManager(num_blocks, B, hash_seed="s")
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.last_rows: list[int] = []
        self.counter = 0

    def add(self, prompt: list[int]) -> None:
        name = f"r{self.counter}"
        self.counter += 1
        h = self.m.add_request(name, prompt)
        assert self.reference.add_request(name, prompt) == h
        self.waiting.append(h)

    def step(self, budget: int, preempt: bool, tokens: list[int], finish: list[bool]) -> Any:
        sampled = [tokens[r % len(tokens)] if tokens else -1 for r in range(len(self.last_rows))]
        live = [
            (h, t) for h, t in zip(self.last_rows, sampled, strict=True) if t != -1 and h in self
        ]
        handles = self.running + self.waiting
        lookup = [False] * len(self.running) + [True] * len(self.waiting)
        step = self.m.schedule_step(
            handles,
            prefix_lookup=lookup,
            sampled_token_ids=np.array(sampled, dtype=np.int64),
            token_budget=budget,
            preempt=preempt,
        )
        expected = per_request_step(self.reference, handles, lookup, live, budget, preempt)
        got = rows_of(step)
        assert got == expected
        assert self.m.debug_state() == self.reference.debug_state()
        for i in got.preempted:
            self.running.remove(handles[i])
            self.waiting.insert(0, handles[i])
        rows = [handles[r["req_index"]] for r in got.rows]
        for h in rows:
            if h in self.waiting:
                self.waiting.remove(h)
                self.running.append(h)
        self.last_rows = rows
        # Finish some requests that reached their end (removed: their samples are dropped).
        for r, h in enumerate(rows):
            done = got.rows[r]["seq_len"] == self.m.num_tokens(h)
            if done and finish[r % len(finish)]:
                self.m.remove_request(h)
                self.reference.remove_request(h)
                self.running.remove(h)
        return step

    def __contains__(self, handle: int) -> bool:
        try:
            self.m.handle(handle)
        except KeyError:
            return False
        return True


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 1], []]


@st.composite
def scripts(draw: Any) -> tuple[int, list[Any]]:
    num_blocks = draw(st.integers(4, 16))
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        if draw(st.booleans()):
            prefix = draw(st.sampled_from(PREFIXES))
            tail = draw(st.lists(st.integers(0, 50), min_size=1, max_size=20))
            ops.append(("add", prefix + tail))
        ops.append(
            (
                "step",
                draw(st.integers(1, 24)),
                draw(st.booleans()),
                draw(
                    st.lists(
                        st.integers(0, 50), min_size=int(draw(st.integers(0, 9)) > 0), max_size=4
                    )
                ),
                draw(st.lists(st.integers(0, 4).map(lambda x: x == 0), min_size=1, max_size=6)),
            )
        )
    return num_blocks, ops


@pytest.mark.parametrize("impl", [kvblocks, kvblocks.reference], ids=["native", "reference"])
@settings(max_examples=60, deadline=None)
@given(script=scripts())
def test_steps_equal_the_per_request_calls(impl: ModuleType, script: Any) -> None:
    num_blocks, ops = script
    d = Driver(impl, num_blocks)
    for op in ops:
        if op[0] == "add":
            d.add(op[1])
        else:
            d.step(*op[1:])


@settings(max_examples=40, deadline=None)
@given(script=scripts())
def test_rust_and_reference_make_the_same_decisions(script: Any) -> None:
    num_blocks, ops = script
    rust, reference = Driver(kvblocks, num_blocks), Driver(kvblocks.reference, num_blocks)
    for op in ops:
        if op[0] == "add":
            rust.add(op[1])
            reference.add(op[1])
            continue
        a, b = rust.step(*op[1:]), reference.step(*op[1:])
        for name in a._fields:
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def running_pair(impl: ModuleType, num_blocks: int, n: int = 3) -> tuple[Any, list[int]]:
    """``n`` running requests of 8 tokens, each holding 2 blocks (block size 4)."""
    m = impl.BlockManager(num_blocks, B)
    hs = [m.add_request(f"r{i}", [10 * i + k for k in range(8)]) for i in range(n)]
    step = m.schedule_step(hs, token_budget=100)
    assert step.num_scheduled == n
    return m, hs


def test_preemption_frees_the_newest_running_request(impl: ModuleType) -> None:
    m, hs = running_pair(impl, 9, n=4)  # 8 usable blocks, all held
    late = m.add_request("late", [99] * 4)
    step = m.schedule_step(
        [*hs, late],
        prefix_lookup=[False] * 4 + [True],
        sampled_token_ids=[5, 6, 7, 8],  # each request grows into a third block
        token_budget=100,
        preempt=True,
    )
    # r0 needs a block: r3 (the newest running one) is preempted, which frees two; r0 and r1
    # take them; r2 then needs one and is itself the newest: it is preempted too.
    assert step.preempted.tolist() == [3, 2]
    assert step.req_indices.tolist() == [0, 1]  # and the admission waits (a preempting step)
    assert m.get_block_ids(hs[2]) == m.get_block_ids(hs[3]) == []
    assert m.get_block_ids(late) == []
    assert m.num_computed_tokens(hs[2]) == 0
    assert m.get_token_ids(hs[3])[-1] == 8  # its sample stays: recompute, not loss
    assert step.input_ids.tolist() == [5, 6]
    assert step.positions.tolist() == [8, 8]


def test_without_preempt_the_step_stops(impl: ModuleType) -> None:
    m, hs = running_pair(impl, 7)
    step = m.schedule_step(hs, sampled_token_ids=[5, 6, 7], token_budget=100)
    assert step.num_scheduled == 0
    assert step.preempted.tolist() == []
    assert [m.num_tokens(h) for h in hs] == [9, 9, 9]  # the samples are in


def test_budget_skips_requests_with_nothing_left(impl: ModuleType) -> None:
    m, hs = running_pair(impl, 20)
    step = m.schedule_step(hs, sampled_token_ids=[5, -1, 7], token_budget=100)
    assert step.req_indices.tolist() == [0, 2]  # r1 got no token: nothing to compute
    assert step.num_new_tokens.tolist() == [1, 1]
    step = m.schedule_step(hs, sampled_token_ids=[1, 2], token_budget=1)
    assert step.req_indices.tolist() == [0]  # the budget runs out after one token
    assert m.num_tokens(hs[2]) == 10
    assert m.num_computed_tokens(hs[2]) == 9


def test_sampled_rows_of_removed_requests_are_dropped(impl: ModuleType) -> None:
    m, hs = running_pair(impl, 20)
    m.remove_request(hs[1])
    step = m.schedule_step([hs[0], hs[2]], sampled_token_ids=[5, 6, 7], token_budget=100)
    assert step.input_ids.tolist() == [5, 7]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"sampled_token_ids": [1, 2]}, ValueError),  # 3 rows last step
        ({"sampled_token_ids": [1, 2, -2]}, ValueError),
        ({"sampled_token_ids": [1, 2, 2**32]}, ValueError),
        ({"token_budget": -1}, ValueError),
        ({"token_budget": None}, ValueError),  # num_new_tokens is then needed
        ({"num_new_tokens": [1, -1, 1]}, ValueError),
        ({"num_new_tokens": [1, 1]}, ValueError),
    ],
)
def test_bad_step_arguments_change_nothing(
    impl: ModuleType, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    m, hs = running_pair(impl, 20)
    before = (m.debug_state(), [m.get_token_ids(h) for h in hs])
    args: dict[str, Any] = {"sampled_token_ids": [5, 6, 7], "token_budget": 10} | kwargs
    new = args.pop("num_new_tokens", None)
    with pytest.raises(error):
        m.schedule_step(hs, new, **args)
    assert (m.debug_state(), [m.get_token_ids(h) for h in hs]) == before
    # and the rows are still the previous step's: the samples go in now
    assert m.schedule_step(hs, sampled_token_ids=[5, 6, 7], token_budget=10).num_scheduled == 3


def test_a_sample_past_max_model_len_is_refused(impl: ModuleType) -> None:
    m = impl.BlockManager(20, B, max_model_len=8)
    h = m.add_request("a", list(range(8)))
    m.schedule_step([h], token_budget=10)
    with pytest.raises(ValueError, match="max_model_len"):
        m.schedule_step([], sampled_token_ids=[3], token_budget=10)
    assert m.num_tokens(h) == 8
