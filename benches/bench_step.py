"""Decode steps through the batched API: one ``schedule_step`` call per step (Rust), the same
work as per-request Rust calls, and the reference's ``schedule_step``, in one run.

    pytest benches/bench_step.py --benchmark-columns=median,iqr,rounds [--ratios-md FILE]

Each round is one decode step for every running request (block size 16, prompts of 500 to
2,000 tokens, one accepted token appended and one slot allocated per request). The batched
variants also write the block table, slot mapping, sequence lengths, query start offsets,
input ids, positions, row indices and per-row counts; the per-request variant only makes the
two calls per request (it builds no arrays).
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

import kvblocks
import kvblocks.reference as ref
from kvblocks.workloads import random_prompt

BLOCK_SIZE = 16
ROUNDS = 100
SIZES = [64, 256, 1024]


class Running:
    """``num_reqs`` running requests (prefilled) in one manager, ready for decode steps."""

    def __init__(self, module: Any, num_reqs: int) -> None:
        rng = np.random.default_rng(num_reqs)
        lengths = rng.integers(500, 2001, size=num_reqs).tolist()
        capacity = sum(lengths) + num_reqs * (ROUNDS + 20)
        self.m = module.BlockManager(capacity // BLOCK_SIZE + 2 * num_reqs, BLOCK_SIZE)
        self.handles = []
        for i, n in enumerate(lengths):
            h = self.m.add_request(f"req-{i}", random_prompt(n, seed=i))
            self.m.allocate_slots(h, n)
            self.handles.append(h)
        self.handle_array = np.array(self.handles, dtype=np.int64)
        self.ones = np.ones(num_reqs, dtype=np.int64)
        self.offsets = np.arange(num_reqs + 1, dtype=np.int64)
        self.tokens = np.full(num_reqs, 7, dtype=np.uint32)
        width = (max(lengths) + ROUNDS + 60) // BLOCK_SIZE + 1
        self.out = kvblocks.StepBuffers.allocate(num_reqs, num_reqs, width)

    def batched(self) -> Any:
        return self.m.schedule_step(
            self.handle_array,
            self.ones,
            new_token_ids=self.tokens,
            new_token_offsets=self.offsets,
            out=self.out,
        )

    def per_request(self) -> list[Any]:
        results = []
        for h in self.handles:
            self.m.append_token_ids(h, 7)
            results.append(self.m.allocate_slots(h, 1))
        return results


def _run(benchmark: Any, case: str, impl: str, fn: Any) -> None:
    benchmark.group = case
    baselines = [[case, "reference"]] if impl != "reference" else []
    benchmark.extra_info.update(case=case, impl=impl, baselines=baselines)
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=10)


@pytest.mark.parametrize("impl", ["rust-batched", "rust-per-request", "reference"])
@pytest.mark.parametrize("num_reqs", SIZES)
def test_decode_step(benchmark: Any, num_reqs: int, impl: str) -> None:
    state = Running(ref if impl == "reference" else kvblocks, num_reqs)
    fn = state.per_request if impl == "rust-per-request" else state.batched
    _run(benchmark, f"decode step, {num_reqs} running requests", impl, fn)
    if impl != "rust-per-request":
        step = state.batched()
        assert step.num_scheduled == num_reqs
        assert step.query_start_loc[-1] == num_reqs


def objects_kept_per_step(state: Running, fn: Any) -> int:
    """Python memory blocks allocated by one step and still alive, with its results kept
    (tracemalloc): what a step hands to Python, plus any Python state it grows."""
    fn()  # warm caches (imports, buffers)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    result = fn()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    del result
    return sum(
        stat.count_diff for stat in after.compare_to(before, "lineno") if stat.count_diff > 0
    )


@pytest.mark.parametrize("impl", ["rust-batched", "rust-per-request", "reference"])
def test_python_objects_per_step(impl: str, capsys: Any) -> None:
    """The batched Rust step keeps O(1) Python objects per step; the others O(requests)."""
    counts = {}
    for n in (64, 256):
        state = Running(ref if impl == "reference" else kvblocks, n)
        fn = state.per_request if impl == "rust-per-request" else state.batched
        counts[n] = objects_kept_per_step(state, fn)
    with capsys.disabled():
        print(f"\n{impl}: Python blocks kept per decode step: {counts}")
    if impl == "rust-batched":  # a handful, whatever the batch (ints > 256 are not cached)
        assert abs(counts[256] - counts[64]) <= 2
        assert counts[256] < 32
    else:
        assert counts[256] > 2 * counts[64] > 0
