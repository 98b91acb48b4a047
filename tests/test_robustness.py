"""Hostile input, tenants, threads, memory and long random runs (see SECURITY.md)."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvblocks
import kvblocks.reference as ref

B = 4

# Values of every awkward kind; each is thrown at every argument below.
HOSTILE: list[Any] = [
    None,
    True,
    1.5,
    float("nan"),
    -1,
    2**31,
    2**64,
    -(2**70),
    "x",
    b"x",
    [],
    [-1],
    [2**32],
    [1.0],
    [[1]],
    {"a": 1},
    object(),
    np.zeros((2, 2), dtype=np.int64),
    np.array([1.5]),
    np.array([True]),
    np.array([-3], dtype=np.int32),
    np.arange(8, dtype=np.int64)[::2],
    np.array([], dtype=np.uint8),
]


def _manager(impl: ModuleType) -> Any:
    m = impl.BlockManager(12, B, enable_events=True, verify_tokens=True)
    m.add_request("a", list(range(10)))
    m.allocate_slots("a", 10)
    m.add_request("b", list(range(5)))
    m.fork("a", "c")
    return m


def _state(m: Any) -> Any:
    ids = ("a", "b", "c")
    return (
        m.debug_state(),
        [m.get_token_ids(r) for r in ids],
        [m.num_computed_tokens(r) for r in ids],
        m.num_free_blocks,
    )


CALLS: dict[str, Any] = {
    "add_request": lambda m, v: m.add_request(v, v),
    "add_request(id)": lambda m, v: m.add_request("new", v),
    "add_request(salt)": lambda m, v: m.add_request("new", [1], cache_salt=v),
    "add_request(lora)": lambda m, v: m.add_request("new", [1], lora=v),
    "add_request(mm)": lambda m, v: m.add_request("new", [1], mm_features=v),
    "append_token_ids": lambda m, v: m.append_token_ids("b", v),
    "append_token_ids(id)": lambda m, v: m.append_token_ids(v, [1]),
    "allocate_slots(n)": lambda m, v: m.allocate_slots("b", v),
    "allocate_slots(id)": lambda m, v: m.allocate_slots(v, 1),
    "allocate_slots(hits)": lambda m, v: m.allocate_slots(
        "b", 1, num_new_computed_tokens=4, new_computed_blocks=v
    ),
    "allocate_slots(hit tokens)": lambda m, v: m.allocate_slots("b", 1, num_new_computed_tokens=v),
    "allocate_slots(lookahead)": lambda m, v: m.allocate_slots("b", 1, num_lookahead_tokens=v),
    "get_computed_blocks": lambda m, v: m.get_computed_blocks(v),
    "free": lambda m, v: m.free(v),
    "remove_request": lambda m, v: m.remove_request(v),
    "fork(parent)": lambda m, v: m.fork(v, "new"),
    "fork(child)": lambda m, v: m.fork("a", v),
    "get_block_ids": lambda m, v: m.get_block_ids(v),
    "block_hashes": lambda m, v: m.block_hashes(v),
    "handle": lambda m, v: m.handle(v),
    "lookup_batch": lambda m, v: m.lookup_batch(v),
    "schedule_step(handles)": lambda m, v: m.schedule_step(v, [1]),
    "schedule_step(counts)": lambda m, v: m.schedule_step([1], v),
    "schedule_step(hits)": lambda m, v: m.schedule_step([1], [1], num_new_computed_tokens=v),
    "schedule_step(tokens)": lambda m, v: m.schedule_step(
        [1], [1], new_token_ids=v, new_token_offsets=[0, 1]
    ),
    "schedule_step(offsets)": lambda m, v: m.schedule_step(
        [1], [1], new_token_ids=[5], new_token_offsets=v
    ),
    "schedule_step(out)": lambda m, v: m.schedule_step([1], [1], out=v),
}
ALLOWED = (KeyError, ValueError, TypeError, AttributeError)


def _outcome(m: Any, call: Any, value: Any) -> str:
    try:
        call(m, value)
    except ALLOWED as e:
        return type(e).__name__
    return "ok"


@pytest.mark.parametrize("name", list(CALLS))
def test_hostile_arguments(name: str) -> None:
    """Every hostile value at every argument: the same outcome in both implementations, and a
    refused call changes nothing."""
    call = CALLS[name]
    for value in HOSTILE:
        native, reference = _manager(kvblocks), _manager(ref)
        before = _state(native)
        assert before == _state(reference)
        a, b = _outcome(native, call, value), _outcome(reference, call, value)
        assert a == b, (name, value, a, b)
        if a != "ok":
            assert _state(native) == before, (name, value)
            assert _state(reference) == before, (name, value)


def test_count_of_hostile_calls() -> None:
    assert len(CALLS) * len(HOSTILE) >= 600


def test_reset_while_requests_hold_blocks(impl: ModuleType) -> None:
    m = _manager(impl)
    before = _state(m)
    assert m.reset_prefix_cache() is False
    assert _state(m) == before


def test_tenants_with_different_salts_never_share_blocks(impl: ModuleType) -> None:
    m = impl.BlockManager(40, B)
    prompt = list(range(20))
    admit = lambda rid, salt: (  # noqa: E731
        m.add_request(rid, prompt, cache_salt=salt),
        m.get_computed_blocks(rid),
    )[1]
    assert admit("t1", "tenant-1") == ([], 0)
    m.allocate_slots("t1", 20)
    assert admit("t2", "tenant-2") == ([], 0)  # same tokens, another tenant: no hit
    hits, n = admit("t1-again", "tenant-1")  # the same tenant hits its own blocks
    assert (hits, n) == (m.get_block_ids("t1")[:4], 16)
    assert set(m.block_hashes("t1")).isdisjoint(m.block_hashes("t2"))


def test_threads_hammering_one_manager() -> None:
    m = kvblocks.BlockManager(4000, 16)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            rng = random.Random(t)
            for round_ in range(30):
                rid = f"t{t}-{round_}"
                prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 2500))]
                h = m.add_request(rid, np.array(prompt, dtype=np.uint32))
                hits, n = m.get_computed_blocks(h)
                m.allocate_slots(
                    h, len(prompt) - n, num_new_computed_tokens=n, new_computed_blocks=hits
                )
                for _ in range(rng.randrange(5)):
                    m.schedule_step(
                        [h], [1], new_token_ids=[rng.randrange(50)], new_token_offsets=[0, 1]
                    )
                if rng.random() < 0.5:
                    m.remove_request(h)
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    state = m.debug_state()
    held = Counter(b for table in state["block_tables"].values() for b in table)
    refs = state["ref_counts"]
    assert all(refs[b] == held[b] for b in range(1, len(refs)))
    assert all(refs[b] == 0 for b in state["free_block_ids"])
    assert m.num_free_blocks + sum(1 for r in refs[1:] if r > 0) == len(refs) - 1


SOAK_OPS = int(os.environ.get("KVBLOCKS_SOAK_OPS", "20000"))


def _check_invariants(m: Any) -> None:
    state = m.debug_state()
    refs = state["ref_counts"]
    held = Counter(b for table in state["block_tables"].values() for b in table)
    assert all(refs[b] == held[b] for b in range(1, len(refs)))
    free = state["free_block_ids"]
    assert len(set(free)) == len(free)
    assert all(refs[b] == 0 for b in free)
    assert len(free) + sum(1 for r in refs[1:] if r > 0) == len(refs) - 1
    for key, blocks in state["cached"].items():
        assert all(state["block_keys"][b] == key for b in blocks)


class Soak:
    """Seeded random operations on one manager; the same seed drives any implementation."""

    def __init__(self, module: ModuleType, seed: int) -> None:
        self.rng = random.Random(seed)
        self.m = module.BlockManager(
            64, B, enable_events=True, verify_tokens=seed % 2 == 0, max_model_len=400
        )
        self.log: list[Any] = []

    def op(self) -> None:
        rng, m = self.rng, self.m
        rid = f"r{rng.randrange(12)}"
        kind = rng.randrange(9)
        try:
            if kind == 0:
                prefix = [[], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 12][rng.randrange(3)]
                tail = [rng.randrange(20) for _ in range(rng.randrange(12))]
                out: Any = m.add_request(rid, prefix + tail, cache_salt=rng.choice([None, "s"]))
            elif kind == 1:
                hits, n = m.get_computed_blocks(rid)
                todo = m.num_tokens(rid) - m.num_computed_tokens(rid) - n
                if m.num_computed_tokens(rid):
                    hits, n = [], 0
                    todo = m.num_tokens(rid) - m.num_computed_tokens(rid)
                out = m.allocate_slots(
                    rid,
                    min(todo, rng.randrange(1, 20)),
                    num_new_computed_tokens=n,
                    new_computed_blocks=hits,
                )
            elif kind == 2:
                m.append_token_ids(rid, rng.randrange(20))
                out = m.allocate_slots(rid, 1, num_lookahead_tokens=rng.choice([0, 0, 2]))
            elif kind == 3:
                out = m.free(rid)
            elif kind == 4:
                out = m.remove_request(rid)
            elif kind == 5:
                out = m.fork(rid, f"r{rng.randrange(12)}")
            elif kind == 6:
                live = [r for r in (f"r{i}" for i in range(12)) if r in m][: rng.randrange(1, 5)]
                handles = [m.handle(r) for r in live]
                step = m.schedule_step(
                    handles,
                    [1] * len(handles),
                    new_token_ids=[3] * len(handles),
                    new_token_offsets=list(range(len(handles) + 1)),
                )
                out = (step.num_scheduled, step.block_table.tolist(), step.slot_mapping.tolist())
            elif kind == 7:
                out = [type(e).__name__ for e in m.take_events()] + m.take_block_copies().tolist()
            else:
                out = m.reset_prefix_cache()
        except (KeyError, ValueError) as e:
            out = type(e).__name__
        self.log.append(out)


@pytest.mark.parametrize("seed", range(4))
def test_soak(seed: int) -> None:
    """SOAK_OPS random operations on the Rust manager (KVBLOCKS_SOAK_OPS for a long run), with
    the invariants checked every 100 operations, and the first 2,000 replayed on the reference."""
    native, reference = Soak(kvblocks, seed), Soak(ref, seed)
    for i in range(SOAK_OPS // 4):
        native.op()
        if i < 2000:
            reference.op()
            assert native.log[-1] == reference.log[-1], i
            if i % 100 == 0:
                assert native.m.debug_state() == reference.m.debug_state()
        if i % 100 == 0:
            _check_invariants(native.m)
    _check_invariants(native.m)
