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
(e) both cores: the fleet's replicas split between two processes (a router that follows
    half the event streams in each), each applying its replicas' event batches and answering
    every lookup for its replicas (the answers merged are the whole index's), against one
    process with the whole index: aggregate block events per second and lookups per second;
(f) ``RoutingIndex.route`` end to end (the prompt hashed, every replica scored, the best
    chosen) for a 2,000-token prompt over 32 replicas, on one full-attention group and on
    gpt-oss's layout (full attention and a 128-token sliding window, scored by vLLM's hybrid
    rule), with p50 and p99;
(d) bytes per indexed block (printed: the table's allocation over its keys, and over the
    (replica, block) pairs it answers for), grown on demand and reserved for the fleet, and
    at fleet scale (48 replicas, 4.8 million (replica, block) pairs).

Where NVIDIA Dynamo's Python package is installed (``pip install ai-dynamo-runtime``), its
KV router's index (``dynamo.llm.RadixTree``, a radix tree of block hashes per worker, Rust)
runs (a), (b) and (d) on the same trace as a third implementation: its events as it takes
them (JSON ``stored`` / ``removed`` events, serialized before the timing; serializing costs
apart), its lookup ``find_matches`` on the same 125 hashes, its memory as the process's
resident-set growth while it is built. Without the package those cases skip, saying so.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvblocks._core import BlockHasher
from kvblocks._core import RouterIndex as RustIndex
from kvblocks.reference.router import RouterIndex as ReferenceIndex
from kvblocks.router import ReplicaLayout, RoutingIndex
from kvblocks.vllm.frontend import PromptBlockHasher

IMPLS = {"rust": RustIndex, "reference": ReferenceIndex}


class BlockStored(SimpleNamespace):
    """Stands in for vLLM's event class of that name (the index reads its type's name)."""


REPLICAS = 32
BLOCKS_PER_PROMPT = 125  # a 2,000-token prompt in 16-token blocks
PROMPTS_PER_REPLICA = 250
MASK = (1 << 64) - 1


def _dynamo_tree() -> Any:
    """An empty ``dynamo.llm.RadixTree`` (NVIDIA Dynamo's KV router index), or a skip."""
    llm = pytest.importorskip(
        "dynamo.llm", reason="NVIDIA Dynamo's index as a baseline: pip install ai-dynamo-runtime"
    )
    return llm.RadixTree()


def _dynamo_stored(event_id: int, parent: int | None, hashes: list[int]) -> bytes:
    """Dynamo's ``stored`` event: the block chain from ``parent``. The trace's hashes are
    already vLLM's chained block hashes, so each is both Dynamo's per-block ``tokens_hash``
    (what ``find_matches`` takes) and its sequence ``block_hash``."""
    blocks = [{"block_hash": h, "tokens_hash": h} for h in hashes]
    data = {"stored": {"parent_hash": parent, "blocks": blocks}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


def _dynamo_removed(event_id: int, hashes: list[int]) -> bytes:
    data = {"removed": {"block_hashes": hashes}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


def _p50_p99(call: Any, items: list[Any]) -> tuple[float, float]:
    """The median and 99th percentile of ``call(item)`` over ``items``, one call each, in us."""
    latencies = []
    for item in items:
        start = time.perf_counter_ns()
        call(item)
        latencies.append(time.perf_counter_ns() - start)
    latencies.sort()
    return latencies[len(latencies) // 2] / 1e3, latencies[len(latencies) * 99 // 100] / 1e3


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _shard(fleet: dict[str, Any], replicas: list[int]) -> Any:
    """kvblocks' index of ``replicas``' blocks only."""
    index = RustIndex(11)
    for r in replicas:
        index.add_replica(r)
        for hashes in fleet["held"][r]:
            index.store(r, hashes, 0, 0)
    return index


def _run_shard(
    fleet: dict[str, Any], replicas: list[int], rounds: int, barrier: Any, results: Any
) -> None:
    """(e) in one process: ``rounds`` event batches on one of its replicas, then ``rounds``
    lookups, each phase started with the other processes' (``barrier``)."""
    index = _shard(fleet, replicas)
    rng = random.Random(7)
    batches = [[rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT)] for _ in range(64)]
    queries, replica = fleet["queries"], replicas[0]
    barrier.wait()
    start = time.perf_counter()
    for i in range(rounds):
        hashes = batches[i % len(batches)]
        index.store(replica, hashes, 0, 0)
        index.remove(replica, hashes, 0, 0)
    events = time.perf_counter() - start
    barrier.wait()
    start = time.perf_counter()
    for i in range(rounds):
        index.prefix_blocks(queries[i % len(queries)], 0, 0)
    lookups = time.perf_counter() - start
    results.put((events, lookups))


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
    # Per replica, each prompt's stored chain as (parent hash or None, new hashes).
    chains: dict[int, list[tuple[int | None, list[int]]]] = {}
    for r in range(REPLICAS):
        # A replica stores only the blocks it does not cache yet (vLLM hits the others): a
        # store of a block it holds would be a second copy. What it holds of a prompt is a
        # prefix of it (a shared prefix's blocks come cut from the front).
        seen: set[int] = set()
        held[r], chains[r] = [], []
        for _ in range(PROMPTS_PER_REPLICA):
            prompt = _prompt_hashes(rng, prefixes)
            first = next((i for i, h in enumerate(prompt) if h not in seen), len(prompt))
            new = prompt[first:]
            assert not seen.intersection(new)
            seen.update(new)
            held[r].append(new)
            chains[r].append((prompt[first - 1] if first else None, new))
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
    return {"indexes": indexes, "held": held, "chains": chains, "queries": queries, "rng": rng}


@pytest.fixture(scope="module")
def dynamo(fleet: dict[str, Any]) -> dict[str, Any]:
    """Dynamo's index fed the fleet's stores (one event per prompt's chain), with the
    process's resident-set growth while it was built."""
    tree = _dynamo_tree()
    events = [
        (r, _dynamo_stored(i, parent, new))
        for r, chains in fleet["chains"].items()
        for i, (parent, new) in enumerate(chains)
        if new
    ]
    before = _rss_bytes()
    for worker, event in events:
        tree.apply_event(worker, event)
    grown = _rss_bytes() - before
    # The same answers as kvblocks' index on the trace (a baseline that answered otherwise
    # would be timed on other work).
    ours = fleet["indexes"]["rust"]
    for hashes in fleet["queries"][:200]:
        theirs = {worker: n for (worker, _), n in tree.find_matches(hashes).scores.items()}
        expected = {r: n for r, n in ours.prefix_blocks(hashes, 0, 0).items() if n}
        assert theirs == expected
    return {"tree": tree, "rss_grown": grown}


def _info(benchmark: Any, case: str, impl: str, **extra: Any) -> None:
    benchmark.group = case
    baselines = [[case, "reference"], [case, "dynamo"]] if impl == "rust" else []
    benchmark.extra_info.update(case=case, impl=impl, baselines=baselines, **extra)


EVENTS_CASE = "apply a batch of 250 block events (32 replicas, 600k blocks)"
LOOKUP_CASE = "look up a 2,000-token prompt over 32 replicas (~1M blocks)"


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

    _info(benchmark, EVENTS_CASE, impl)
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
    p50, p99 = _p50_p99(lambda hashes: index.prefix_blocks(hashes, 0, 0), queries)
    turn = [0]

    def lookup() -> None:
        index.prefix_blocks(queries[turn[0] % len(queries)], 0, 0)
        turn[0] += 1

    _info(benchmark, LOOKUP_CASE, impl)
    benchmark(lookup)
    print(f"\n{impl}: lookup p50 {p50:.1f} us, p99 {p99:.1f} us (2,000 prompts)")


def test_apply_events_dynamo(benchmark: Any, dynamo: dict[str, Any]) -> None:
    """(a) on Dynamo's index: the same batch, as its two events (a stored chain and a
    removal), serialized before the timing."""
    tree = dynamo["tree"]
    rng = random.Random(7)
    batches = []
    for i in range(64):
        hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT)]
        event_id = 1_000_000 + 2 * i
        batches.append(
            (_dynamo_stored(event_id, None, hashes), _dynamo_removed(event_id + 1, hashes))
        )
    turn = [0]

    def batch() -> None:
        stored, removed = batches[turn[0] % len(batches)]
        turn[0] += 1
        tree.apply_event(3, stored)
        tree.apply_event(3, removed)

    _info(benchmark, EVENTS_CASE, "dynamo")
    benchmark(batch)
    seconds = benchmark.stats.stats.median if benchmark.stats else None
    if seconds:
        print(f"\ndynamo: {2 * BLOCKS_PER_PROMPT / seconds / 1e6:.2f} million block events/s")


def test_lookup_dynamo(benchmark: Any, fleet: dict[str, Any], dynamo: dict[str, Any]) -> None:
    """(b) on Dynamo's index: ``find_matches`` on the same queries."""
    tree = dynamo["tree"]
    queries = fleet["queries"]
    p50, p99 = _p50_p99(lambda hashes: tree.find_matches(hashes), queries)
    turn = [0]

    def lookup() -> None:
        tree.find_matches(queries[turn[0] % len(queries)])
        turn[0] += 1

    _info(benchmark, LOOKUP_CASE, "dynamo")
    benchmark(lookup)
    print(f"\ndynamo: lookup p50 {p50:.1f} us, p99 {p99:.1f} us (2,000 prompts)")


def test_bytes_per_block_dynamo(fleet: dict[str, Any], dynamo: dict[str, Any]) -> None:
    """(d) on Dynamo's index: the process's resident set grown while it was built, over the
    same (replica, block) pairs (its allocations are not visible otherwise)."""
    pairs = sum(len(new) for chains in fleet["chains"].values() for _, new in chains)
    assert pairs == sum(fleet["indexes"]["rust"].held(r) for r in range(REPLICAS))
    grown = dynamo["rss_grown"]
    print(
        f"\ndynamo: resident set grown by {grown / 2**20:.1f} MiB building its index of "
        f"{pairs:,} (replica, block) pairs: {grown / pairs:.1f} bytes per pair"
    )
    assert grown > 0


def test_both_cores(fleet: dict[str, Any]) -> None:
    """(e): the replicas split between two processes, against one process with them all."""
    halves = [list(range(0, REPLICAS, 2)), list(range(1, REPLICAS, 2))]
    whole = fleet["indexes"]["rust"]
    shards = [_shard(fleet, half) for half in halves]
    for hashes in fleet["queries"][:100]:  # the shards' answers merged are the whole index's
        merged = {**shards[0].prefix_blocks(hashes, 0, 0), **shards[1].prefix_blocks(hashes, 0, 0)}
        assert merged == whole.prefix_blocks(hashes, 0, 0)
    rounds = 20_000
    context = multiprocessing.get_context("fork")
    measured = {}
    for name, parts in (("one process, 32 replicas", [list(range(REPLICAS))]), ("two", halves)):
        barrier, results = context.Barrier(len(parts)), context.Queue()
        workers = [
            context.Process(target=_run_shard, args=(fleet, part, rounds, barrier, results))
            for part in parts
        ]
        for worker in workers:
            worker.start()
        timings = [results.get(timeout=600) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0
        events = len(parts) * rounds * 2 * BLOCKS_PER_PROMPT / max(t[0] for t in timings)
        lookups = rounds / max(t[1] for t in timings)  # each lookup answered by every shard
        measured[name] = (events, lookups)
    (one_events, one_lookups), (two_events, two_lookups) = measured.values()
    print(
        f"\nboth cores: {two_events / 1e6:.1f} million block events/s "
        f"({two_events / one_events:.2f}x one process's {one_events / 1e6:.1f} million), "
        f"{two_lookups / 1e3:.0f}k lookups/s over 32 replicas "
        f"({two_lookups / one_lookups:.2f}x one process's {one_lookups / 1e3:.0f}k)"
    )


ROUTE_LAYOUTS = {
    "full attention": ReplicaLayout(),
    "gpt-oss": ReplicaLayout(("full_attention", "sliding_window"), sliding_window=128),
}


@pytest.mark.parametrize("layout", list(ROUTE_LAYOUTS))
def test_route(benchmark: Any, layout: str) -> None:
    """(f): 32 replicas each caching 8 prompts cut from 8 shared 1,600-token prefixes (in
    every group), asked for 2,000-token prompts that extend those prefixes."""
    hasher = BlockHasher("sha256", block_size=16)
    config = SimpleNamespace(
        hash_algo="sha256", hash_block_size=16, none_hash=hasher.none_hash, num_lookahead_tokens=0
    )
    prompt_hasher = PromptBlockHasher(config)
    rng = random.Random(9)
    prefixes = [[rng.randrange(50_000) for _ in range(1_600)] for _ in range(8)]
    index = RoutingIndex()
    groups = len(ROUTE_LAYOUTS[layout].kinds)
    for r in range(REPLICAS):
        index.add_replica(f"r{r}", config, ROUTE_LAYOUTS[layout])
        for _ in range(8):
            cached = prompt_hasher.block_hashes(rng.choice(prefixes)[: rng.randrange(1_600)])
            assert cached is not None
            ints = [int.from_bytes(h[-8:], "big") for h in cached]
            for group in range(groups):
                event = BlockStored(block_hashes=ints, medium=None, group_idx=group)
                index.apply_events(f"r{r}", [event])
    queries = [rng.choice(prefixes)[: rng.randrange(1_000, 1_600)] for _ in range(500)]
    queries = [q + [rng.randrange(50_000) for _ in range(2_000 - len(q))] for q in queries]
    assert sum(bool(index.route(q).scores["r0"]) for q in queries) > 10  # hits to score
    p50, p99 = _p50_p99(lambda prompt: index.route(prompt), queries)
    turn = [0]

    def route() -> None:
        index.route(queries[turn[0] % len(queries)])
        turn[0] += 1

    benchmark.group = "RoutingIndex.route: a 2,000-token prompt over 32 replicas, hashed"
    benchmark(route)
    print(f"\nroute, {layout}: p50 {p50:.1f} us, p99 {p99:.1f} us (hashing included)")


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
    """The table grown on demand (at most 7/8 full, growing by an eighth), and one reserved for
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
    assert index.table_bytes / index.num_keys <= 12 * 9 / 7  # at least 7/9 full as it grows
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
    assert index.table_bytes / index.num_keys <= 16 * 9 / 7
