"""The routing index (``kvblocks.router``'s ``RouterIndex``, Rust) against its pure-Python
reference (``kvblocks.reference.router``), in one run, on a replayed trace of a fleet:

    pytest benches/bench_router.py -s --benchmark-columns=median,rounds [--ratios-md FILE]

32 replicas, each holding prompts of 2,000 tokens (125 blocks of 16) drawn from shared
prefixes: about 600,000 distinct blocks in the index, 700,000 (replica, block) pairs:

(a) events: one replica's batch of stores and removals (125 + 125 block operations, vLLM's
    int hashes as its KV events publish them by default), applied to the index;
(b) a lookup: each replica's cached prefix of a 2,000-token prompt's 125 block hashes (the
    hashes computed apart, as a router reuses them for the request it forwards), with p50
    and p99 latency over 2,000 lookups;
(c) hashing a 2,000-token prompt as the replica's engine would (``PromptBlockHasher``),
    reported apart from the lookup;
(d) bytes per indexed block (printed: the table's allocation over its keys, and over the
    (replica, block) pairs it answers for), grown on demand and reserved for the fleet, and
    at fleet scale (48 replicas, 4.8 million (replica, block) pairs).
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvblocks._core import BlockHasher
from kvblocks._core import RouterIndex as RustIndex
from kvblocks.reference.router import RouterIndex as ReferenceIndex
from kvblocks.vllm.frontend import PromptBlockHasher

IMPLS = {"rust": RustIndex, "reference": ReferenceIndex}
REPLICAS = 32
BLOCKS_PER_PROMPT = 125  # a 2,000-token prompt in 16-token blocks
PROMPTS_PER_REPLICA = 250
MASK = (1 << 64) - 1


def _prompt_hashes(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A prompt's block hashes: a shared prefix's first blocks, then blocks of its own."""
    prefix = rng.choice(prefixes)
    keep = rng.randrange(len(prefix) + 1)
    return prefix[:keep] + [rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT - keep)]


@pytest.fixture(scope="module")
def fleet() -> dict[str, Any]:
    rng = random.Random(5)
    prefixes = [[rng.getrandbits(64) for _ in range(100)] for _ in range(40)]
    held: dict[int, list[list[int]]] = {}
    for r in range(REPLICAS):
        # A replica stores only the blocks it does not cache yet (vLLM hits the others): a
        # store of a block it holds would be a second copy.
        seen: set[int] = set()
        held[r] = []
        for _ in range(PROMPTS_PER_REPLICA):
            new = [h for h in _prompt_hashes(rng, prefixes) if h not in seen]
            seen.update(new)
            held[r].append(new)
    indexes = {}
    for impl, cls in IMPLS.items():
        index = cls(11)
        for r, prompts in held.items():
            index.add_replica(r)
            for hashes in prompts:
                index.store(r, hashes, 0, 0)
        assert index.num_copied == 0
        indexes[impl] = index
    queries = [_prompt_hashes(rng, prefixes) for _ in range(2_000)]
    return {"indexes": indexes, "held": held, "queries": queries, "rng": rng}


def _info(benchmark: Any, case: str, impl: str, **extra: Any) -> None:
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "reference"]] if impl == "rust" else [], **extra
    )


@pytest.mark.parametrize("impl", list(IMPLS))
def test_apply_events(benchmark: Any, fleet: dict[str, Any], impl: str) -> None:
    """A batch of 125 stores (a new prompt's blocks) and 125 removals (an evicted one's)."""
    index = fleet["indexes"][impl]
    rng = random.Random(7)
    batches = [[rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT)] for _ in range(64)]
    turn = [0]

    def batch() -> None:
        hashes = batches[turn[0] % len(batches)]
        turn[0] += 1
        index.store(3, hashes, 0, 0)
        index.remove(3, hashes, 0, 0)

    _info(benchmark, "apply a batch of 250 block events (32 replicas, 600k blocks)", impl)
    benchmark(batch)
    seconds = benchmark.stats.stats.median if benchmark.stats else None
    if seconds:
        print(f"\n{impl}: {2 * BLOCKS_PER_PROMPT / seconds / 1e6:.2f} million block events/s")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_lookup(benchmark: Any, fleet: dict[str, Any], impl: str) -> None:
    """Every replica's cached prefix of a 2,000-token prompt (hashes given)."""
    index = fleet["indexes"][impl]
    queries = fleet["queries"]
    found = index.prefix_blocks(queries[0], 0, 0)
    assert len(found) == REPLICAS
    # p50 / p99 over every query, one call each
    latencies = []
    for hashes in queries:
        start = time.perf_counter_ns()
        index.prefix_blocks(hashes, 0, 0)
        latencies.append(time.perf_counter_ns() - start)
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2] / 1e3, latencies[len(latencies) * 99 // 100] / 1e3
    turn = [0]

    def lookup() -> None:
        index.prefix_blocks(queries[turn[0] % len(queries)], 0, 0)
        turn[0] += 1

    _info(benchmark, "look up a 2,000-token prompt over 32 replicas (~1M blocks)", impl)
    benchmark(lookup)
    print(f"\n{impl}: lookup p50 {p50:.1f} us, p99 {p99:.1f} us (2,000 prompts)")


def test_hashing_a_prompt_apart(benchmark: Any) -> None:
    """What a router pays before its lookup: the prompt's block hashes, as the engine."""
    hasher = BlockHasher("sha256", block_size=16)
    config = SimpleNamespace(
        hash_algo="sha256", hash_block_size=16, none_hash=hasher.none_hash, num_lookahead_tokens=0
    )
    prompt = list(range(2_000))
    hashes = PromptBlockHasher(config).block_hashes(prompt)
    assert hashes is not None
    assert len(hashes) == BLOCKS_PER_PROMPT
    benchmark.group = "hash a 2,000-token prompt (sha256), apart from the lookup"
    benchmark(PromptBlockHasher(config).block_hashes, prompt)


def test_bytes_per_block(fleet: dict[str, Any]) -> None:
    """The table grown on demand (at most 7/8 full, growing by half), and one reserved for
    the fleet's (replica, block) pairs, as a router that knows its replicas' pools sizes it."""
    index = fleet["indexes"]["rust"]
    pairs = sum(index.held(r) for r in range(REPLICAS))
    reserved = RustIndex(11)
    reserved.reserve(pairs)
    for r, prompts in fleet["held"].items():
        reserved.add_replica(r)
        for hashes in prompts:
            reserved.store(r, hashes, 0, 0)
    for name, table in (("grown", index), ("reserved for the pairs", reserved)):
        print(
            f"\nindex, {name}: {table.num_keys:,} keys, {pairs:,} (replica, block) pairs, "
            f"{table.table_bytes / 2**20:.1f} MiB: {table.table_bytes / table.num_keys:.1f} "
            f"bytes per key, {table.table_bytes / pairs:.1f} per (replica, block)"
        )
    assert index.num_keys > 500_000
    assert reserved.num_keys == index.num_keys
    # 12-byte slots (every replica id below 32), at most 7/8 full
    assert index.table_bytes / index.num_keys < 12 * 8 / 7 * 1.5
    assert reserved.table_bytes / pairs < 12 * 8 / 7 + 0.01


def test_millions_of_blocks_over_dozens_of_replicas() -> None:
    """Memory and build rate at fleet scale: 48 replicas holding 100,000 blocks each, a
    third of each replica's blocks shared with others (4.8 million (replica, block) pairs;
    replica ids past 32 make the replica sets 8 bytes)."""
    rng = random.Random(8)
    shared = [rng.getrandbits(64) for _ in range(200_000)]
    index = RustIndex(3)
    replicas, per_replica = 48, 100_000
    start = time.perf_counter()
    for r in range(replicas):
        index.add_replica(r)
        first = rng.randrange(len(shared) - per_replica // 3)
        own = shared[first : first + per_replica // 3]
        own += [rng.getrandbits(64) for _ in range(per_replica - len(own))]
        index.store(r, own, 0, 0)
    seconds = time.perf_counter() - start
    pairs = sum(index.held(r) for r in range(replicas))
    assert pairs == replicas * per_replica
    print(
        f"\nfleet of {replicas} replicas: {index.num_keys:,} keys, {pairs:,} (replica, block) "
        f"pairs, {index.table_bytes / 2**20:.1f} MiB: {index.table_bytes / index.num_keys:.1f} "
        f"bytes per key, {index.table_bytes / pairs:.1f} per (replica, block); built in "
        f"{seconds:.2f} s with the hashes generated"
    )
    assert index.table_bytes / index.num_keys < 16 * 8 / 7 * 1.5
