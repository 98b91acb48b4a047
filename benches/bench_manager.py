"""Block management: kvblocks.BlockManager (Rust) against its pure-Python reference, in one run,
through the per-request API (one Python call per request per operation).

    pytest benches/bench_manager.py --benchmark-columns=median,iqr,rounds [--ratios-md FILE]

(a) A shared-prefix batch: 32 requests with a 2,000-token common prefix (cached) and a
    200-token unique suffix: add, look up, allocate, 32 decode steps (append + allocate), free.
(b) Per-operation medians on the same shapes: prefix lookup, prefill allocation with the
    cached prefix, one decode step (append one token + allocate), free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvblocks
import kvblocks.reference as ref
from kvblocks.workloads import random_prompt

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
PREFIX = random_prompt(2000, seed=1)
BATCH = 32
DECODE_STEPS = 32
IMPLS = {"rust": kvblocks, "reference": ref}


def _suffix(i: int) -> list[int]:
    return random_prompt(200, seed=10_000 + i)


def _manager(impl: str) -> Any:
    m = IMPLS[impl].BlockManager(NUM_BLOCKS, BLOCK_SIZE, hash_seed="bench")
    _admit(m, "warmup", PREFIX + _suffix(-1))  # caches the common prefix
    m.remove_request("warmup")
    return m


def _admit(m: Any, rid: str, tokens: list[int]) -> None:
    m.add_request(rid, tokens)
    hits, n = m.get_computed_blocks(rid)
    m.allocate_slots(rid, len(tokens) - n, num_new_computed_tokens=n, new_computed_blocks=hits)


def _info(benchmark: Any, case: str, impl: str) -> None:
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "reference"]] if impl == "rust" else []
    )


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_shared_prefix_batch(benchmark: Any, impl: str) -> None:
    m = _manager(impl)
    prompts = [PREFIX + _suffix(i) for i in range(BATCH)]
    ids = [f"req-{i}" for i in range(BATCH)]

    def batch() -> None:
        for rid, prompt in zip(ids, prompts, strict=True):
            _admit(m, rid, prompt)
        for step in range(DECODE_STEPS):
            for rid in ids:
                m.append_token_ids(rid, step)
                m.allocate_slots(rid, 1)
        for rid in ids:
            m.free(rid)
            m.remove_request(rid)

    _info(benchmark, "32 requests: 2k shared + 200 own tokens, 32 decode steps", impl)
    benchmark(batch)
    assert m.num_free_blocks == NUM_BLOCKS - 1


def _pedantic(benchmark: Any, fn: Callable[[], object], setup: Callable[[], None]) -> None:
    benchmark.pedantic(fn, setup=setup, rounds=200, warmup_rounds=5)


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_lookup(benchmark: Any, impl: str) -> None:
    m = _manager(impl)
    m.add_request("r", PREFIX + _suffix(0))
    _info(benchmark, "lookup: 2.2k-token request, 2k cached", impl)
    hits, n = benchmark(lambda: m.get_computed_blocks("r"))
    assert n == 2000 // BLOCK_SIZE * BLOCK_SIZE
    assert len(hits) == n // BLOCK_SIZE


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_prefill_allocation(benchmark: Any, impl: str) -> None:
    m = _manager(impl)
    m.add_request("r", PREFIX + _suffix(0))
    hits, n = m.get_computed_blocks("r")

    def allocate() -> None:
        m.allocate_slots("r", 2200 - n, num_new_computed_tokens=n, new_computed_blocks=hits)

    _info(benchmark, "prefill allocation with 125 cached blocks", impl)
    _pedantic(benchmark, allocate, setup=lambda: m.free("r"))
    assert len(m.get_block_ids("r")) == -(-2200 // BLOCK_SIZE)


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_decode_step(benchmark: Any, impl: str) -> None:
    m = _manager(impl)
    _admit(m, "r", PREFIX + _suffix(0))

    def step() -> None:
        m.append_token_ids("r", 7)
        m.allocate_slots("r", 1)

    _info(benchmark, "decode step: append 1 token + allocate", impl)
    # A bounded number of steps, so the request stays within the pool and max length.
    benchmark.pedantic(step, iterations=20, rounds=150, warmup_rounds=5)
    assert len(m.get_block_ids("r")) == -(-m.num_tokens("r") // BLOCK_SIZE)
    assert m.num_computed_tokens("r") == m.num_tokens("r")


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_free(benchmark: Any, impl: str) -> None:
    m = _manager(impl)
    prompt = PREFIX + _suffix(0)
    m.add_request("r", prompt)

    def readmit() -> None:
        hits, n = m.get_computed_blocks("r")
        m.allocate_slots("r", len(prompt) - n, num_new_computed_tokens=n, new_computed_blocks=hits)

    _info(benchmark, "free a 2.2k-token request", impl)
    _pedantic(benchmark, lambda: m.free("r"), setup=readmit)
    assert m.get_block_ids("r") == []
