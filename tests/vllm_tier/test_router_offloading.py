"""kvblocks.router's CPU tier against vLLM's real ``OffloadingConnector``: one vLLM scheduler
(vLLM's own KV-cache manager, or kvblocks' with ``kvblocks.vllm.install("all")``) with the
connector's real scheduler side (``tests.vllm_driver.offloading``: vLLM's CPU manager, LRU,
and its KV events; a fake worker side completes every transfer within its step) and KV events
on. Every batch the scheduler publishes, GPU and CPU media alike, is applied to a
:class:`~kvblocks.router.RoutingIndex`, and at chosen moments the index's answers are checked
against truths read from vLLM itself:

- GPU: ``score(prompt)`` is the hit the scheduler's KV-cache manager finds
  (``get_computed_blocks`` on a fresh request with the prompt);
- CPU, without side effects: the chunks of the prompt the CPU tier holds, by the connector's
  offloading manager (``lookup`` on the prompt's offload keys, the key vLLM builds for each of
  its whole chunks: the chunk's last block hash and the group);
- CPU, as vLLM then uses it: the prompt is scheduled on an empty GPU cache, and the tokens the
  connector reports external (``num_external_cached_tokens``) and those the scheduler first
  schedules the request with are read off the run.

The moments are the ones the index's per-medium tables exist for: right after
``reset_prefix_cache()`` (vLLM's block pool publishes ``AllBlocksCleared``: the GPU cache is
empty, the CPU tier keeps every block) the index must predict 0 on the GPU for every prompt
and, before anything is stored again, exactly what it predicted on the CPU before the reset (an
index that clears every medium on ``AllBlocksCleared`` fails here); each prompt is then
scheduled on that empty GPU cache, loading from the CPU tier.

What the index predicts for the CPU tier, and what vLLM loads. For a prompt of ``n`` tokens the
index answers with the device's hit rule (the coordinator's, on hybrid layouts) over the
blocks the connector announced: P, the tokens of the leading whole blocks the tier holds, up to
vLLM's GPU limit of ``n - 1`` tokens, in blocks of ``block_size`` tokens. vLLM's connector loads
whole chunks (``blocks_per_chunk`` blocks: ``tpc`` tokens) of the prompt, up to all of it (up
to ``n - 1`` tokens on a layout with a sliding window), and the scheduler computes at least the
last prompt token. With ``P_n`` the index's answer with the limit lifted to ``n`` (asked for the
prompt followed by a token no request has: the same blocks, one more token allowed), vLLM's hit
from the CPU tier on an empty GPU cache, the tokens the scheduler does not compute, is exactly::

    H = min(n - 1, tpc * (P_n // tpc))

The connector reports ``E = tpc * (P_n // tpc)`` external tokens on full attention and
``E = H`` with a sliding window; the scheduler starts the request at ``min(E, n - 1)``. So, with
one block per chunk, the index is exact (``P == H``) for a prompt that does not end on a block
boundary. For one that does, with its blocks held, the CPU tier serves its last block and the
GPU cache never does: on llama P is ``n - block_size`` where vLLM hits ``n - 1`` tokens, and on
gpt-oss the window the device's rule needs at the shorter length ends a block earlier than the
window the tier holds, so P may be 0 where vLLM loads ``n - 1`` tokens. With chunks of several
blocks P also counts blocks of a chunk the prompt does not fill (stored by a longer request),
which vLLM does not load, and misses the last block as above: P differs from H both ways by
less than a chunk. Those blocks are announced only with vLLM's ``self_describing_kv_events``:
without it a chunk's ``BlockStored`` carries its last block hash alone, so the index, walking
blocks from the first, sees no CPU hit at all (:func:`test_chunks_announced_by_their_last_block`
asserts that gap). vLLM's sliding-window chunks always carry their last hash alone, so gpt-oss
runs on one-block chunks only.

The connector's own ``reset_cache`` (``reset_prefix_cache(reset_connector=True)``) empties the
CPU tier and publishes nothing (only the GPU pool's ``AllBlocksCleared``, which the index
applies to the GPU alone): the index goes on predicting the CPU blocks, and vLLM's tier misses
them and loads nothing. The test asserts that known gap, and that no CPU event came with the
reset, so that a vLLM that starts announcing it is noticed; a router that resets a replica's
connector itself clears the tier in the index (``clear_replica(name, medium="CPU")``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import KVEventBatch
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.metrics.stats import PrefillStats
from vllm.v1.request import Request

from kvblocks.router import ReplicaLayout, RoutingIndex
from kvblocks.vllm import _state
from tests.vllm_driver import VOCAB_SIZE, SchedulerSpec, block_hasher, make_request, make_scheduler
from tests.vllm_tier.harness import HASHER_MODULES, served_scheduler
from tests.vllm_tier.simulation import implementation, run
from tests.vllm_tier.test_offloading import spec_for
from tests.vllm_tier.test_router import first_hit, prefix_hash_config

REPLICA = "replica"
#: A token no prompt here has and the fake model never samples (it samples below VOCAB_SIZE):
#: appended to a prompt, it asks the index about the same blocks with one more token allowed.
UNSEEN = VOCAB_SIZE
#: Where ``simulation.run`` records vLLM's ``PrefillStats`` as a tuple: the tokens the
#: connector reported external when the request was first scheduled.
EXTERNAL = [f.name for f in dataclasses.fields(PrefillStats)].index("num_external_cached_tokens")

#: (a layout of test_offloading's ``spec_for``, GPU blocks per CPU chunk, the CPU tier in
#: chunks): tiers small enough that the warm-up evicts from them.
CASES: dict[str, tuple[str, int, int]] = {
    "llama": ("llama", 1, 40),
    "gpt-oss": ("gpt-oss", 1, 56),
    "llama, 2-block chunks": ("llama", 2, 20),
}


class Feed:
    """vLLM's ``EventPublisher`` interface: applies each batch to the index, in order, and
    counts its events by (type, medium)."""

    def __init__(self, index: RoutingIndex) -> None:
        self.index = index
        self.seen: Counter[tuple[str, str | None]] = Counter()

    def publish(self, batch: Any) -> None:
        self.index.apply(REPLICA, batch)
        self.seen.update((type(e).__name__, getattr(e, "medium", None)) for e in batch.events)

    def shutdown(self) -> None:
        pass


class Replica:
    """A scheduler with the OffloadingConnector, the index its events feed, and vLLM's
    truths about its two tiers."""

    def __init__(self, scheduler: Any, spec: SchedulerSpec) -> None:
        self.scheduler = scheduler
        self.hasher: Callable[[Request], list[bytes]] = block_hasher("sha256", spec.block_size)
        self.block_size = spec.block_size
        self.layout = ReplicaLayout.from_kv_cache_config(scheduler.kv_cache_manager.kv_cache_config)
        self.index = RoutingIndex()
        self.index.add_replica(REPLICA, prefix_hash_config("sha256", spec.block_size), self.layout)
        self.feed = Feed(self.index)
        self.offloading = scheduler.connector.connector_scheduler
        # tokens per CPU chunk, the same in every group here
        (self.tpc,) = {g.tokens_per_chunk for g in self.offloading.config.kv_group_configs}
        self._probes = 0

    def request(self, request_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        return make_request(request_id, prompt, self.hasher, max_tokens=max_tokens)

    def serve(self, arrivals: list[tuple[int, Request]]) -> list[Any]:
        """Runs the requests to the end, every event batch into the index."""
        return run(self.scheduler, arrivals, publisher=self.feed)

    def publish_pending(self) -> list[Any]:
        """Publishes the events the manager and the connector hold now, as the scheduler's
        next ``update_from_output`` would (one batch: the manager's, then the connector's)."""
        events = list(self.scheduler.kv_cache_manager.take_events() or ())
        events += list(self.scheduler.connector.take_events())
        if events:
            self.feed.publish(KVEventBatch(ts=time.time(), events=events))
        return events

    # -- the index ----------------------------------------------------------------------

    def predicted(self, prompt: list[int], medium: str = "GPU") -> int:
        score = self.index.score(prompt, medium=medium)[REPLICA]
        assert score is not None, "kvblocks reproduces this layout's rule"
        return score

    def predicted_to_n(self, prompt: list[int]) -> int:
        """``P_n``: the index's CPU answer with vLLM's limit of ``n - 1`` tokens lifted to
        ``n`` (the prompt and one more token, which no block holds)."""
        return self.predicted([*prompt, UNSEEN], "CPU")

    # -- vLLM's truths ------------------------------------------------------------------

    def _probe(self, prompt: list[int]) -> Request:
        self._probes += 1  # a fresh request id each time: nothing of an earlier lookup
        return self.request(f"probe-{self._probes}", prompt)

    def gpu_hit(self, prompt: list[int]) -> int:
        """The prefix the KV-cache manager finds for a fresh request with the prompt."""
        manager = self.scheduler.kv_cache_manager
        _, num_tokens, *_ = manager.get_computed_blocks(self._probe(prompt))
        return int(num_tokens)

    def cpu_chunks(self, prompt: list[int]) -> dict[int, list[bool]]:
        """Per KV-cache group (by id) the connector offloads, whether the CPU tier holds each of the
        prompt's whole chunks: the offloading manager's ``lookup`` (which changes nothing) on
        vLLM's offload key for it, the chunk's last block hash with the group. A chunk still
        being written (``HIT_PENDING``) would make the moment ambiguous: none is."""
        request = self._probe(prompt)
        context = ReqContext(req_id=request.request_id)
        held = {}
        for group in self.offloading.config.kv_group_configs:
            stride = group.hashes_per_chunk
            found = [
                self.offloading.manager.lookup(make_offload_key(h, group.group_idx), context)
                for h in request.block_hashes[stride - 1 :: stride]
            ]
            assert LookupResult.HIT_PENDING not in found, "a store is still in flight"
            held[group.group_idx] = [result is LookupResult.HIT for result in found]
        return held

    # -- the checks ---------------------------------------------------------------------

    def check(self, prompts: list[list[int]]) -> None:
        """For every prompt: the GPU prediction is the manager's hit. On the CPU, ``P_n``'s
        whole chunks are chunks the tier holds by every group's rule (full attention's
        leading chunks; a sliding window's chunks before the hit, one block each here), and
        on a full-attention layout exactly the tier's leading chunks; P is the same search
        with the lower limit (on full attention, ``P_n`` capped at ``n - 1`` in blocks)."""
        for prompt in prompts:
            assert self.predicted(prompt) == self.gpu_hit(prompt), prompt
            predicted, to_n = self.predicted(prompt, "CPU"), self.predicted_to_n(prompt)
            chunks, held = to_n // self.tpc, self.cpu_chunks(prompt)
            assert predicted <= to_n
            if self.layout.kinds == ("full_attention",):
                limit = (len(prompt) - 1) // self.block_size * self.block_size
                assert predicted == min(to_n, limit), (prompt, predicted, to_n)
            assert sorted(held) == list(range(len(self.layout.kinds))), "every group offloaded"
            for group_id, group in held.items():
                kind = self.layout.kinds[group_id]
                leading = next((i for i, h in enumerate(group) if not h), len(group))
                if kind == "full_attention":
                    assert chunks <= leading, (prompt, held, to_n)
                    if len(self.layout.kinds) == 1:
                        assert chunks == leading, (prompt, held, to_n)
                else:
                    window = self.layout.sliding_window
                    assert window is not None
                    assert self.tpc == self.block_size
                    needed = -(-(window - 1) // self.block_size)  # vLLM's contiguous blocks
                    assert all(group[max(chunks - needed, 0) : chunks]), (prompt, held, to_n)


def replica(model_dir: Path, impl: str, spec: SchedulerSpec) -> Replica:
    """A scheduler for ``spec`` on ``impl``'s KV-cache manager, checked to run the manager
    and the request hasher it should (kvblocks': bound to the connector, in status(),
    nothing fallen back)."""
    if impl == "kvblocks":
        described = "4-token blocks, prefix caching on, OffloadingConnector"
        scheduler = served_scheduler(model_dir, spec, "OffloadingConnector", described)
    else:
        with implementation(impl):
            scheduler = make_scheduler(model_dir, spec)
        assert type(scheduler.kv_cache_manager) is VllmKVCacheManager
    r = Replica(scheduler, spec)
    assert r.hasher.__module__ == HASHER_MODULES[impl]
    return r


def warmed_up(r: Replica, seed: int) -> list[list[int]]:
    """Serves a warm-up of 14 requests over three shared prefixes (a tail of their own,
    arrivals over 12 steps, a few output tokens each) and returns the prompts to probe: the
    prefixes whole, cut on a block, a chunk or neither, and extended; two warm-up prompts;
    one nobody sent."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    a, b, c = tokens(48), tokens(30), tokens(64)
    warm_up = [
        (rng.randrange(12), rng.choice([a, b, c]) + tokens(rng.randrange(11)), rng.randrange(1, 7))
        for _ in range(14)
    ]
    r.serve(
        [
            (step, r.request(f"w{i}", prompt, max_tokens))
            for i, (step, prompt, max_tokens) in enumerate(warm_up)
        ]
    )
    cut = [a[:44], b[:23], c[:40], c[:37] + tokens(9)]
    return [a, b, c, *cut, a + tokens(3), warm_up[0][1], warm_up[1][1], tokens(33)]


@pytest.mark.parametrize("impl", ["vllm", "kvblocks"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_predictions_after_gpu_resets(
    model_dir: Path, case: str, impl: str, async_scheduling: bool
) -> None:
    layout, blocks_per_chunk, cpu_chunks = CASES[case]
    extra: dict[str, Any] = {}
    if blocks_per_chunk > 1:  # every block hash of a chunk in its BlockStored
        extra = {"blocks_per_chunk": blocks_per_chunk, "self_describing_kv_events": True}
    spec = spec_for(
        layout,
        kv_offloading=cpu_chunks,
        kv_offloading_config=extra,
        async_scheduling=async_scheduling,
    )
    r = replica(model_dir, impl, spec)
    assert r.tpc == blocks_per_chunk * r.block_size
    probes = warmed_up(r, seed=list(CASES).index(case))
    r.check(probes)

    cpu_hits = exact = short = 0
    for i, prompt in enumerate(probes):
        before = [r.predicted(p, "CPU") for p in probes]
        # The GPU pool's reset: its AllBlocksCleared empties the device's table alone.
        assert r.scheduler.reset_prefix_cache()
        assert [type(e).__name__ for e in r.publish_pending()] == ["AllBlocksCleared"]
        for p in probes:
            assert r.predicted(p) == r.gpu_hit(p) == 0
        assert [r.predicted(p, "CPU") for p in probes] == before, "the CPU tier keeps its blocks"
        r.check(probes)

        # The prompt alone on the empty GPU cache: what vLLM takes from the CPU tier.
        n, predicted, to_n = len(prompt), before[i], r.predicted_to_n(prompt)
        records = r.serve([(0, r.request(f"p{i}", prompt))])
        hit = first_hit(records, f"p{i}")
        (stats,) = [o[3] for rec in records[:-1] for o in rec[1] if o[0] == f"p{i}" and o[3]]
        external, chunked = stats[EXTERNAL], r.tpc * (to_n // r.tpc)
        # vLLM's CPU hit is the index's blocks in whole chunks, at most n - 1 tokens...
        assert hit == min(n - 1, chunked), (i, stats, predicted, to_n)
        # ...the connector loading up to the whole prompt on full attention and up to n - 1
        # tokens beside a sliding window, the scheduler computing at least the last token.
        assert external == (chunked if layout == "llama" else hit), (i, stats, to_n)
        assert hit == min(external, n - 1), (i, stats)
        if blocks_per_chunk == 1 and n % r.block_size:
            assert predicted == hit, (i, predicted, hit)  # exact off block boundaries
        if layout == "llama":
            assert abs(predicted - hit) < r.tpc, (i, predicted, hit)
        cpu_hits += hit > 0
        exact += predicted == hit > 0
        short += predicted < hit  # a prompt ending on a held block
        r.check(probes)  # after what the prompt stored and evicted

    # Not vacuous: the tier served hits, some predicted exactly and some beyond the index's
    # limit of n - 1 tokens; both media stored and evicted.
    assert cpu_hits >= 4, cpu_hits
    assert exact >= 2, exact
    assert short >= 1, short
    seen = r.feed.seen
    assert all(
        seen[kind, medium] for kind in ("BlockStored", "BlockRemoved") for medium in ("GPU", "CPU")
    ), seen
    counts = r.index.counts()
    assert (counts["unknown_removals"], counts["skipped_events"]) == (0, 0), counts

    # The connector's own reset empties the tier, and nothing says so. A vLLM that announces
    # it fails here: the index may then follow the tier (and this test should check it).
    predicted_before = [r.predicted(p, "CPU") for p in probes]
    assert r.scheduler.reset_prefix_cache(reset_connector=True)
    assert [type(e).__name__ for e in r.publish_pending()] == ["AllBlocksCleared"]
    assert [r.predicted(p, "CPU") for p in probes] == predicted_before
    for p in probes:
        assert not any(map(any, r.cpu_chunks(p).values())), "vLLM's tier holds nothing now"
    best = max(range(len(probes)), key=predicted_before.__getitem__)
    assert predicted_before[best] > 0, "the index predicts a CPU hit that vLLM no longer has"
    records = r.serve([(0, r.request("after-connector-reset", probes[best]))])
    assert first_hit(records, "after-connector-reset") == 0
    if impl == "kvblocks":
        assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"


@pytest.mark.parametrize("impl", ["vllm", "kvblocks"])
def test_chunks_announced_by_their_last_block(model_dir: Path, impl: str) -> None:
    """The known gap of chunks of several blocks without vLLM's
    ``self_describing_kv_events`` (off by default): each chunk's ``BlockStored``
    (``medium="CPU"``) carries its last block hash alone, so the index holds no chunk's first
    block and predicts no CPU hit while vLLM's tier holds the prompt's chunks and loads them.
    A vLLM whose default announces every block fails this test: the index then follows the
    tier (and :func:`test_cpu_predictions_after_gpu_resets` should run that default)."""
    spec = spec_for("llama", kv_offloading=40, kv_offloading_config={"blocks_per_chunk": 2})
    r = replica(model_dir, impl, spec)
    prompt = warmed_up(r, seed=0)[0]
    assert r.scheduler.reset_prefix_cache()
    r.publish_pending()
    assert r.feed.seen["BlockStored", "CPU"], "the tier announced its chunks"
    held = r.cpu_chunks(prompt)[0]
    assert held == [True] * (len(prompt) // r.tpc)
    assert r.predicted(prompt, "CPU") == r.predicted_to_n(prompt) == 0
    records = r.serve([(0, r.request("p", prompt))])
    assert first_hit(records, "p") == len(prompt) - 1  # vLLM loads the whole prompt
