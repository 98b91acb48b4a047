"""kvblocks.router against real vLLM schedulers: several replicas (vLLM's own ``Scheduler``
and KV-cache manager, stock or kvblocks', driven by the fake model), each publishing its KV
event batches into one :class:`~kvblocks.router.RoutingIndex`. Before each request is routed,
the index predicts the prefix every replica would find cached; the replica it goes to then
schedules it, and the hit vLLM's scheduler takes (the computed tokens it first schedules the
request with) must be the one predicted: random traces over shared prefixes, with eviction
(small pools), LoRA and cache salts, and a replica's ``reset_prefix_cache()``
(``AllBlocksCleared``). Requests run one at a time on their replica, so no step of another
request moves the pool between the prediction and the lookup."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.core import kv_cache_utils

from kvblocks.router import ReplicaLayout, RoutingIndex
from kvblocks.vllm.bench.config import make_kv_cache_config
from tests.vllm_driver import SchedulerSpec, block_hasher, make_request, make_scheduler
from tests.vllm_driver.speculative import Speculation
from tests.vllm_tier.simulation import implementation, run


class IndexPublisher:
    """vLLM's ``EventPublisher`` interface, applying each batch to the index in order."""

    def __init__(self, index: RoutingIndex, name: str) -> None:
        self.index, self.name, self.batches = index, name, 0

    def publish(self, batch: Any) -> None:
        self.index.apply(self.name, batch)
        self.batches += 1

    def shutdown(self) -> None:
        pass


def prefix_hash_config(algo: str, block_size: int) -> SimpleNamespace:
    """What vLLM 0.34's ``PrefixHashConfig`` reports of an engine (0.33 has no such class):
    its algorithm, hash block size, NONE_HASH (``block_hasher`` has just set it) and lookahead."""
    return SimpleNamespace(
        hash_algo=algo,
        hash_block_size=block_size,
        none_hash=bytes(kv_cache_utils.NONE_HASH),
        num_lookahead_tokens=0,
    )


#: Hybrid layouts (``SchedulerSpec.layout``) on 16-token blocks, windows and chunks a few
#: blocks long so that prompts reach past them: gpt-oss's (full attention and a sliding
#: window), Gemma 3's (five windows to one full group), Llama 4's (chunked local attention
#: and full) and Qwen3.5's (full attention and Mamba groups, prefix caching on: vLLM's
#: "align" mode, checkpoints on the block grid).
HYBRID_LAYOUTS: dict[str, list[tuple[str, int]]] = {
    "gpt-oss": [("full", 0), ("sliding_window", 48)],
    "gemma3": [("sliding_window", 40)] * 5 + [("full", 0)],
    "llama4": [("chunked_local", 64), ("full", 0)],
    "qwen3.5": [("full", 0)] + [("mamba", 0)] * 3,
    # EAGLE's last-block drop (lookahead block hashes off), the draft's layers in the first
    # full-attention group (vLLM's is_eagle_group): on one group, and beside a window
    "llama, EAGLE": [("full", 0)],
    "gpt-oss, EAGLE": [("full", 0), ("sliding_window", 48)],
}


#: Pools small enough that each hybrid trace evicts (the copies vLLM caches of blocks it
#: computed again among them), large enough for hits: six groups share gemma3's.
HYBRID_POOLS = {
    "gpt-oss": 200,
    "gemma3": 400,
    "llama4": 200,
    "qwen3.5": 300,
    "llama, EAGLE": 60,
    "gpt-oss, EAGLE": 200,
}


def fleet(
    model_dir: Path,
    impl: str,
    num_replicas: int,
    num_blocks: int,
    algo: str = "sha256",
    layout: str | None = None,
) -> tuple[RoutingIndex, dict[str, Any], Any, SimpleNamespace]:
    spec = SchedulerSpec(
        block_size=16,
        num_blocks=num_blocks,
        hash_algo=algo,
        kv_events=True,
        max_num_seqs=4,
        layout=HYBRID_LAYOUTS[layout] if layout else "llama",
        mamba_checkpoint_alignment=16 if layout == "qwen3.5" else None,
        speculative=(
            Speculation("eagle", 3, disable_lookahead_block_hashes=True)
            if layout and layout.endswith("EAGLE")
            else None
        ),
    )
    index = RoutingIndex()
    replicas = {}
    with implementation(impl) as manager:
        for i in range(num_replicas):
            replicas[f"replica-{i}"] = make_scheduler(model_dir, spec)
            # the replica really runs the manager it is meant to (no fallback to vLLM's)
            assert type(replicas[f"replica-{i}"].kv_cache_manager) is manager
    hasher = block_hasher(algo, 16)
    config = prefix_hash_config(algo, 16)
    for name, scheduler in replicas.items():
        manager = scheduler.kv_cache_manager
        replica_layout = ReplicaLayout.from_kv_cache_config(
            manager.kv_cache_config, use_eagle=manager.use_eagle
        )
        index.add_replica(name, config, replica_layout)
    return index, replicas, hasher, config


def full_attention_prefix(index: RoutingIndex, name: str, prompt: list[int], **request: Any) -> int:
    """What a router reading only the replica's first full-attention group would predict:
    the longest prefix of its blocks the replica holds there, in the GPU table (hybrid layouts
    hit less)."""
    replica = index._replicas[name]
    group = next(g for g, kind in enumerate(replica.kinds) if kind == "full_attention")
    hashes = replica.hasher.block_hashes(prompt, **request)
    usable = hashes[: (len(prompt) - 1) // replica.hash_block_size]
    return index.group_prefix(name, usable, group) * replica.hash_block_size


def first_hit(records: list[Any], request_id: str) -> int:
    """The computed tokens the scheduler first scheduled the request with (its prefix hit)."""
    for record in records[:-1]:
        if record[0] is not None:
            for rid, _, computed in record[0][1]:
                if rid == request_id:
                    return int(computed)
    raise AssertionError(f"{request_id} was never scheduled")


def trace(seed: int, n: int) -> list[dict[str, Any]]:
    """Requests over a few shared prefixes of several lengths, some with LoRA or a salt."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randrange(20, 200))] for _ in range(5)]
    requests = []
    for _ in range(n):
        prefix = rng.choice(prefixes)
        cut = rng.randrange(len(prefix) + 1)
        prompt = prefix[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 60))]
        requests.append(
            {
                "prompt": prompt,
                "lora": rng.choice([None, None, None, 1, 2]),
                "salt": rng.choice([None, None, None, "tenant-a"]),
                "max_tokens": rng.randrange(1, 12),
            }
        )
    return requests


@pytest.mark.parametrize("impl", ["vllm", "kvblocks"])
@pytest.mark.parametrize(
    ("layout", "num_blocks", "seed"),
    [
        (None, 2048, 1),
        (None, 40, 2),
        (None, 24, 3),
        *[(layout, n, 4 + i) for i, (layout, n) in enumerate(HYBRID_POOLS.items())],
    ],
)
def test_predicted_hits_are_the_schedulers(
    model_dir: Path, impl: str, layout: str | None, num_blocks: int, seed: int
) -> None:
    index, replicas, hasher, _ = fleet(model_dir, impl, 3, num_blocks, layout=layout)
    publishers = {name: IndexPublisher(index, name) for name in replicas}
    rng = random.Random(seed)
    hits = []
    cut_short = 0  # hybrid predictions shorter than the full-attention group's prefix
    for i, r in enumerate(trace(seed, 60)):
        lora = LoRARequest(f"adapter-{r['lora']}", r["lora"], "/lora") if r["lora"] else None
        predicted = index.score(r["prompt"], lora_request=lora, cache_salt=r["salt"])
        # Mostly the best replica, sometimes another, so that every replica's state matters.
        name = index.best(r["prompt"], lora_request=lora, cache_salt=r["salt"])
        if rng.random() < 0.3:
            name = rng.choice(list(replicas))
        assert name is not None
        if i == 30:  # one replica drops its whole cache: AllBlocksCleared
            reset = next(n for n in replicas if n != name)
            with implementation(impl):
                assert replicas[reset].reset_prefix_cache()
            # its events, as the replica's next step would publish them
            index.apply_events(reset, replicas[reset].kv_cache_manager.take_events())
            assert index.held(reset) == 0
            predicted = index.score(r["prompt"], lora_request=lora, cache_salt=r["salt"])
        request = make_request(
            f"q{i}",
            r["prompt"],
            hasher,
            max_tokens=r["max_tokens"],
            lora_request=lora,
            cache_salt=r["salt"],
        )
        with implementation(impl):
            records = run(replicas[name], [(0, request)], publisher=publishers[name])
        if layout is not None:
            full = full_attention_prefix(
                index, name, r["prompt"], lora_request=lora, cache_salt=r["salt"]
            )
            cut_short += predicted[name] < full
        assert first_hit(records, f"q{i}") == predicted[name], (i, name, predicted)
        hits.append(predicted[name])
    # Not vacuous: hits happened, and with small pools blocks were evicted; on hybrid layouts
    # the other groups' rules decided some hits (vLLM then caches the recomputed blocks of
    # the full-attention group again, in second copies the index counts).
    assert sum(1 for h in hits if h) > (10 if layout is None else 5)
    if layout is not None:
        assert cut_short > 0
    counts = index.counts()
    assert counts["stored"] > 0
    if num_blocks < 100 or layout is not None:
        assert counts["removed"] > 0
    if layout in ("gpt-oss", "gemma3", "qwen3.5"):
        assert counts["repeated_removals"] > 0
    assert counts["unknown_removals"] == 0
    assert counts["skipped_events"] == 0


def test_a_layout_it_cannot_reproduce_scores_none(model_dir: Path) -> None:
    index, _, _, config = fleet(model_dir, "kvblocks", 1, 64)
    index.add_replica("sink", config, ReplicaLayout(("full_attention", "sink_full_attention")))
    index.add_replica("coarse", config, ReplicaLayout(block_size=64))
    # Mamba groups without prefix caching (vLLM's "none" mode, one block per request):
    # neither their rule nor their block size is the one kvblocks reproduces
    spec = SchedulerSpec(block_size=16, layout=HYBRID_LAYOUTS["qwen3.5"], enable_caching=False)
    layout = ReplicaLayout.from_kv_cache_config(make_kv_cache_config(spec))
    assert layout.kinds == ("unknown",) * 4
    index.add_replica("no-mamba-caching", config, layout)
    scores = index.score(list(range(100)))
    assert scores == {"replica-0": 0, "sink": None, "coarse": None, "no-mamba-caching": None}
    assert index.best(list(range(100))) == "replica-0"


def test_hostile_events_are_counted_and_change_nothing(model_dir: Path) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    index, _, _, config = fleet(model_dir, "kvblocks", 2, 64)
    stored = BlockStored(
        block_hashes=[1, 2, 3],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    index.apply_events("replica-0", [stored, stored, object()])
    index.apply_events("replica-1", [BlockRemoved(block_hashes=[1, 9], medium=None)])
    counts = index.counts()
    assert (counts["stored"], counts["repeated_stores"], counts["skipped_events"]) == (3, 3, 1)
    assert counts["unknown_removals"] == 2
    assert (index.held("replica-0"), index.held("replica-1")) == (3, 0)
    with pytest.raises(KeyError, match="no replica 'nope'"):
        index.apply_events("nope", [stored])
    with pytest.raises(TypeError, match="block hash must be bytes or an int"):
        index.apply_events("replica-0", [BlockRemoved(block_hashes=["x"], medium=None)])
    with pytest.raises(ValueError, match="already in the index"):
        index.add_replica("replica-0", config)
    index.apply_events("replica-0", [AllBlocksCleared()])
    assert index.held("replica-0") == 0
    assert index.remove_replica("replica-1") == 0
    assert index.replicas == ["replica-0"]
