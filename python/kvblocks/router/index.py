"""A KV-aware routing index for fleets of vLLM replicas, on vLLM's own block hashes.

A router in front of several vLLM replicas sends each request where most of its prompt is
already cached. Each replica publishes its cache changes as KV events (``--kv-events-config``:
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in ``KVEventBatch``es, per KV-cache
group and medium). :class:`RoutingIndex` applies those batches to a cluster-wide block table
in Rust (``kvblocks._core.RouterIndex``) and, for a request's prompt, computes each replica's
block hashes exactly as that replica's engine does (:class:`kvblocks.vllm.PromptBlockHasher`,
from its ``PrefixHashConfig``) and returns the prefix tokens each replica's scheduler would
find cached.

What it reproduces, and what it refuses to guess:

- the hit of replicas whose KV-cache groups are all full attention (one or several groups,
  MLA included) with the group block size equal to the hash block size: the longest run of
  leading blocks that every group holds, up to vLLM's limit of ``num_tokens - 1`` prompt
  tokens (the last token is always computed); walked for all such replicas at once;
- the hit of hybrid replicas (sliding-window, chunked local attention and Mamba groups
  beside full attention, and the EAGLE drop), described by a :class:`ReplicaLayout`: vLLM's
  coordinator's search (each group's own rule, the groups agreeing on one length), run by
  kvblocks' engine over the blocks the index says the replica holds;
- a replica with a group of another kind, groups whose block size is not the hash block
  size, or a prompt its hasher cannot reproduce byte for byte (prompt embeddings, ...):
  ``None`` for that replica, never a guess.

Index keys are the last 8 bytes of vLLM's block hash (what vLLM publishes by default as an
int) with the group and medium: exact up to a 64-bit key collision (probability 2^-64 per
pair of blocks). A replica that caches a block in two copies (it computed the block again:
two requests sharing a prefix at once, or a hybrid model whose full-attention hit was cut
short by another group) publishes a store and a removal for each copy; the index keeps the
block held until its last copy is removed. The index trusts no publisher: an event for an
unknown replica raises, a removal of a block the replica does not hold is counted
(:meth:`RoutingIndex.counts`) and changes nothing, and an unknown event type is counted and
skipped.

One thing the event stream cannot tell apart: a request with vLLM's
``kv_cache_report_mode="full"`` makes its replica publish a store for every block it reuses
from the cache, with no new copy behind it. The index counts it as a copy, so until the
block's last removal arrives for each such report, it may predict a hit on a block the
replica has evicted. Leave that mode off on replicas behind the index.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvblocks._core import HitRule, KVCacheGroup, RouterIndex
from kvblocks.vllm.frontend import PromptBlockHasher

__all__ = ["GPU", "ReplicaLayout", "Route", "RoutingIndex"]

#: vLLM's medium of the device cache (``vllm.distributed.kv_events.MEDIUM_GPU``); events
#: without a medium are the device's.
GPU = "GPU"
#: The kvblocks engine's group kind for each KV-cache group kind vLLM names in its KV events
#: (``BlockStored.kv_cache_spec_kind``, vLLM's ``KVCacheSpecKind``) whose hit rule kvblocks
#: reproduces (the rule of vLLM's single-type manager for it). Other kinds score None.
_ENGINE_KINDS = {
    "full_attention": "full",
    "mla_attention": "full",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "chunked_local_attention": "chunked_local",
    "mamba": "mamba",
}


@dataclass(frozen=True)
class ReplicaLayout:
    """A replica's KV-cache groups, as its engine has them: one kind per group id (vLLM's
    ``KVCacheSpecKind`` values, as ``BlockStored.kv_cache_spec_kind`` names them:
    ``full_attention``, ``mla_attention``, ``sliding_window``, ``sliding_window_mla``,
    ``chunked_local_attention``, ``mamba``, ...), the groups' block size (default: the
    replica's hash block size), the window of its sliding-window groups and the chunk of its
    chunked-local ones, the sets of groups its coordinator looks up together (default: the
    groups of one kind together, as vLLM's coordinator sets groups with equal specs; full
    attention first) and whether it drops the last hit block for EAGLE (``use_eagle``: in
    ``eagle_groups``, the draft model's groups, vLLM's ``is_eagle_group``; default every
    group).

    :meth:`from_kv_cache_config` reads all of it from the replica's ``KVCacheConfig``."""

    kinds: tuple[str, ...] = ("full_attention",)
    block_size: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    lookup_sets: tuple[tuple[int, ...], ...] | None = None
    use_eagle: bool = False
    eagle_groups: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.kinds or not all(isinstance(k, str) for k in self.kinds):
            raise ValueError(f"kinds must name each KV-cache group, got {self.kinds!r}")
        for name in ("block_size", "sliding_window", "attention_chunk_size"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        engine = {_ENGINE_KINDS.get(k) for k in self.kinds}
        if "sliding_window" in engine and self.sliding_window is None:
            raise ValueError("a layout with a sliding-window group needs its sliding_window")
        if "chunked_local" in engine and self.attention_chunk_size is None:
            raise ValueError(
                "a layout with a chunked local attention group needs its attention_chunk_size"
            )
        if self.eagle_groups is not None and not all(
            type(g) is int and 0 <= g < len(self.kinds) for g in self.eagle_groups
        ):
            raise ValueError(f"eagle_groups must be group ids, got {self.eagle_groups!r}")

    @classmethod
    def from_kv_cache_config(
        cls, kv_cache_config: Any, *, use_eagle: bool = False
    ) -> ReplicaLayout:
        """The layout of a replica whose engine runs ``kv_cache_config`` (vLLM's
        ``KVCacheConfig``, as its engine core builds it; ``use_eagle``: the engine drops the
        last hit block for EAGLE or MTP). A group kvblocks' own KV-cache manager would not run
        exactly (a spec kvblocks does not implement, a Mamba group outside vLLM's "align"
        cache mode) is named ``unknown``, so that the replica scores None; so is every group
        of a config whose groups differ in block size. Needs vllm."""
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        from kvblocks.vllm.kv_cache_manager import _lookup_sets
        from kvblocks.vllm.support import spec_kind

        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        sizes = {spec.block_size for spec in specs}
        kinds = []
        windows, chunks = set(), set()
        for group, spec in zip(groups, specs, strict=True):
            kind = spec_kind(spec, group.role)
            if kind == "sliding_window":
                windows.add(spec.sliding_window)
            elif kind == "chunked_local":
                chunks.add(spec.attention_chunk_size)
            reproducible = (
                len(sizes) == 1
                and kind is not None
                and spec.prefix_cacheable
                and not spec.prefix_replay_tokens
                and (kind != "mamba" or spec.mamba_cache_mode == "align")
            )
            kinds.append(get_kv_cache_spec_kind(spec).value if reproducible else "unknown")
        if len(windows) > 1 or len(chunks) > 1:
            raise ValueError(
                f"kvblocks.router reproduces one sliding window and one attention chunk per "
                f"replica; this config has windows {sorted(windows)} and chunks {sorted(chunks)}"
            )
        return cls(
            kinds=tuple(kinds),
            block_size=min(sizes) if sizes else None,
            sliding_window=next(iter(windows), None),
            attention_chunk_size=next(iter(chunks), None),
            lookup_sets=tuple(tuple(s) for s in _lookup_sets(kv_cache_config)),
            use_eagle=use_eagle,
            eagle_groups=tuple(i for i, g in enumerate(groups) if g.is_eagle_group) or None,
        )

    def hit_rule(self, hash_block_size: int) -> HitRule | None:
        """The engine's hit rule for this layout on ``hash_block_size``-token hashes, or None
        where kvblocks does not reproduce it (a kind it does not know, or groups whose block
        size is not the hash block size)."""
        engine = [_ENGINE_KINDS.get(k, "") for k in self.kinds]
        if (self.block_size or hash_block_size) != hash_block_size:
            return None
        if not all(engine):
            return None
        drafts = self.eagle_groups or ()
        groups = [
            KVCacheGroup(
                kind,
                hash_block_size,
                sliding_window=self.sliding_window if kind == "sliding_window" else None,
                attention_chunk_size=self.attention_chunk_size if kind == "chunked_local" else None,
                is_eagle_group=i in drafts,
            )
            for i, kind in enumerate(engine)
        ]
        if self.lookup_sets is None:
            by_kind: dict[str, list[int]] = {}
            for i, kind in enumerate(engine):
                by_kind.setdefault(kind, []).append(i)
            sets = list(by_kind.values())
        else:
            sets = [list(s) for s in self.lookup_sets]
        return HitRule(groups, lookup_sets=sets, use_eagle=self.use_eagle)


def _config_key(config: Any) -> tuple[Any, ...]:
    """What makes two engines hash a prompt alike (``PrefixHashConfig``'s fields)."""
    return (
        config.hash_algo,
        config.hash_block_size,
        config.none_hash,
        config.num_lookahead_tokens,
    )


class _Replica:
    __slots__ = (
        "config",
        "hash_block_size",
        "hasher",
        "id",
        "kinds",
        "layout",
        "name",
        "plain",
        "rule",
    )

    def __init__(
        self, name: str, rid: int, config: Any, layout: ReplicaLayout, hasher: PromptBlockHasher
    ) -> None:
        self.name = name
        self.id = rid
        self.config = _config_key(config)
        self.hasher = hasher  # shared by the replicas whose engines hash alike
        self.hash_block_size: int = config.hash_block_size
        self.kinds = layout.kinds
        self.layout = layout
        # None where kvblocks does not reproduce the replica's rule: it then scores None.
        self.rule = layout.hit_rule(self.hash_block_size)
        # A plain longest prefix is walked for every such replica at once.
        self.plain = self.rule is not None and self.rule.is_plain_prefix


class _Plan:
    """How :meth:`RoutingIndex.route` scores the replicas whose engines hash alike: the
    plain-prefix ones from one walk per group for them all, the hybrid ones in one call per
    layout."""

    def __init__(self, first: _Replica) -> None:
        self.hasher = first.hasher
        self.block_size = first.hash_block_size
        self.groups = 0  # the most groups a plain-prefix replica has
        self.plain: list[tuple[str, int, int]] = []  # (name, id, groups)
        self.hybrid: dict[ReplicaLayout, tuple[HitRule, list[str], list[int]]] = {}

    def add(self, replica: _Replica) -> None:
        if replica.plain:
            self.plain.append((replica.name, replica.id, len(replica.kinds)))
            self.groups = max(self.groups, len(replica.kinds))
        elif replica.rule is not None:
            _, names, ids = self.hybrid.setdefault(replica.layout, (replica.rule, [], []))
            names.append(replica.name)
            ids.append(replica.id)


class RoutingIndex:
    """Which replica holds which block, fed by each replica's KV event batches."""

    def __init__(self) -> None:
        # One table per medium (index: the medium's id; GPU is 0): vLLM clears a replica's
        # device cache alone (AllBlocksCleared), and its other tiers keep their blocks.
        self._seed = secrets.randbits(64)
        self._cores = [RouterIndex(self._seed)]
        self._replicas: dict[str, _Replica] = {}
        self._media: dict[str, int] = {GPU: 0}
        self._skipped_events = 0
        self._plans: dict[tuple[Any, ...], _Plan] | None = None  # rebuilt on a change

    # -- replicas ------------------------------------------------------------------------

    def add_replica(
        self, name: str, prefix_hash_config: Any, layout: ReplicaLayout | None = None
    ) -> None:
        """Registers a replica: its name, its engine's ``PrefixHashConfig`` (vLLM 0.34's
        ``vllm.v1.engine.PrefixHashConfig``, or any object with its fields ``hash_algo``,
        ``hash_block_size``, ``none_hash`` and ``num_lookahead_tokens``) and its KV-cache
        groups (default: one full-attention group)."""
        if not isinstance(name, str):
            raise TypeError(f"a replica name must be a str, got {type(name).__name__}")
        if name in self._replicas:
            raise ValueError(f"replica {name!r} is already in the index")
        used = {r.id for r in self._replicas.values()}
        free = next((i for i in range(RouterIndex.MAX_REPLICAS) if i not in used), None)
        if free is None:
            raise ValueError(f"the index holds at most {RouterIndex.MAX_REPLICAS} replicas")
        shared = next(
            (
                r.hasher
                for r in self._replicas.values()
                if r.config == _config_key(prefix_hash_config)
            ),
            None,
        )
        hasher = shared or PromptBlockHasher(prefix_hash_config)
        replica = _Replica(name, free, prefix_hash_config, layout or ReplicaLayout(), hasher)
        for core in self._cores:
            core.add_replica(free)
        self._replicas[name] = replica
        self._plans = None

    def remove_replica(self, name: str) -> int:
        """Forgets a replica and its blocks; returns how many blocks it held."""
        replica = self._replica(name)
        dropped = sum(int(core.remove_replica(replica.id)) for core in self._cores)
        del self._replicas[name]
        self._plans = None
        return dropped

    def clear_replica(self, name: str, medium: str | None = None) -> int:
        """Drops a replica's blocks in every medium (a restart, or a gap in its events: what
        it holds is unknown), or in ``medium`` alone; returns how many."""
        rid = self._replica(name).id
        if medium is not None:
            medium_id = self._media.get(medium)
            return 0 if medium_id is None else int(self._cores[medium_id].clear_replica(rid))
        return sum(int(core.clear_replica(rid)) for core in self._cores)

    def replica_blocks(self, name: str) -> dict[str, tuple[bytes, bytes]]:
        """The blocks a replica holds, per medium it holds any in, as the Rust table keeps
        them (keys and copies, :meth:`kvblocks._core.RouterIndex.replica_blocks`): what
        :meth:`restore_replica` takes back, here or in another process (a snapshot)."""
        rid = self._replica(name).id
        out: dict[str, tuple[bytes, bytes]] = {}
        for medium, medium_id in self._media.items():
            keys, copies = self._cores[medium_id].replica_blocks(rid)
            if keys:
                out[medium] = (keys, copies)
        return out

    def group_prefix(
        self, name: str, block_hashes: Sequence[bytes | int], group: int, medium: str = GPU
    ) -> int:
        """The leading blocks of ``block_hashes`` the replica holds in one KV-cache group,
        without its hit rule: what an index reading that group alone would predict (a
        diagnostic; :meth:`score` is the replica's hit)."""
        rid = self._replica(name).id
        medium_id = self._media.get(medium)
        if medium_id is None:
            return 0
        found: dict[int, int] = self._cores[medium_id].prefix_blocks(block_hashes, group, medium_id)
        return found[rid]

    @property
    def media(self) -> list[str]:
        """The media events have named, in the order the index first saw them (a key holds
        its medium's position: a snapshot restores them in this order first)."""
        return list(self._media)

    def restore_replica(
        self, name: str, blocks: Mapping[str, tuple[bytes, bytes]], media: Sequence[str]
    ) -> int:
        """Gives a replica that holds nothing the blocks :meth:`replica_blocks` gave, from an
        index whose :attr:`media` were ``media``; returns how many. A ValueError, the replica
        left holding nothing, where this index numbers a medium otherwise (the keys would
        not match), the replica holds blocks, or the blocks are malformed."""
        ids = dict(self._media)  # as they will be once the media are named in order
        for position, medium in enumerate(media):
            if ids.setdefault(medium, len(ids)) != position:
                raise ValueError(f"medium {medium!r} is not number {position} in this index")
        unknown = set(blocks) - set(media)
        if unknown:
            raise ValueError(f"blocks of media {sorted(unknown)}, which are not in {list(media)}")
        if self.held(name):
            raise ValueError(f"replica {name!r} holds blocks: only an empty replica is restored")
        rid = self._replica(name).id
        for medium in media:
            self._medium(medium)
        restored = 0
        try:
            for medium, (keys, copies) in blocks.items():
                core = self._cores[self._media[medium]]
                restored += int(core.restore_replica(rid, keys, copies))
        except BaseException:
            self.clear_replica(name)
            raise
        return restored

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def _replica(self, name: str) -> _Replica:
        try:
            return self._replicas[name]
        except KeyError:
            raise KeyError(f"no replica {name!r} in the index") from None

    def _medium(self, medium: str | None) -> int:
        if medium is None:
            return 0
        found = self._media.get(medium)
        if found is None:
            if not isinstance(medium, str):
                raise TypeError(f"a medium must be a str, got {type(medium).__name__}")
            found = self._media[medium] = len(self._media)
            core = RouterIndex(self._seed)
            for replica in self._replicas.values():
                core.add_replica(replica.id)
            self._cores.append(core)
        return found

    # -- events --------------------------------------------------------------------------

    def apply(self, name: str, batch: Any) -> None:
        """Applies one of a replica's ``KVEventBatch``es (vLLM's class, decoded from its
        publisher's messages, or anything with an ``events`` list of vLLM's event classes)."""
        self.apply_events(name, batch.events)

    def apply_events(self, name: str, events: Iterable[Any]) -> None:
        """Applies a replica's events in order (see :meth:`apply`). Event types the index does
        not know are counted (:meth:`counts`, ``skipped_events``) and skipped."""
        rid = self._replica(name).id
        cores = self._cores
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                group, medium = event.group_idx or 0, self._medium(event.medium)
                cores[medium].store(rid, event.block_hashes, group, medium)
            elif kind == "BlockRemoved":
                group, medium = event.group_idx or 0, self._medium(event.medium)
                cores[medium].remove(rid, event.block_hashes, group, medium)
            elif kind == "AllBlocksCleared":
                # vLLM's block pool publishes it (reset_prefix_cache): the device's cache.
                # An offloading tier keeps its blocks (and its own reset publishes nothing).
                cores[0].clear_replica(rid)
            else:
                self._skipped_events += 1

    def counts(self) -> dict[str, int]:
        """What the index applied and refused: blocks ``stored`` (first copies), ``removed``
        (last copies), ``cleared``; ``repeated_stores`` and ``repeated_removals`` (further
        copies of a block the replica holds); ``unknown_removals`` (of blocks it did not hold:
        changed nothing); ``skipped_events``."""
        counts: dict[str, int] = {}
        for core in self._cores:
            for key, value in core.counts().items():
                counts[key] = counts.get(key, 0) + value
        counts["skipped_events"] = self._skipped_events
        return counts

    def held(self, name: str) -> int:
        """Blocks the replica holds, over all its groups and media."""
        rid = self._replica(name).id
        return sum(int(core.held(rid)) for core in self._cores)

    @property
    def num_keys(self) -> int:
        """Distinct (block, group, medium) keys in the index."""
        return sum(int(core.num_keys) for core in self._cores)

    @property
    def table_bytes(self) -> int:
        """Bytes the index's table has allocated."""
        return sum(int(core.table_bytes) for core in self._cores)

    # -- scoring -------------------------------------------------------------------------

    def score(self, prompt_token_ids: Sequence[int] | Any, **request: Any) -> dict[str, int | None]:
        """For each replica, the prompt tokens its scheduler would find cached in ``medium``
        (see the module's documentation), or None where kvblocks cannot reproduce that
        replica's rule for this prompt. ``request``: :meth:`route`'s keywords."""
        return self.route(prompt_token_ids, **request).scores

    def best(self, prompt_token_ids: Sequence[int] | Any, **request: Any) -> str | None:
        """The replica with the most cached prefix tokens (the first registered on a tie),
        or None with no replica whose hit kvblocks can reproduce."""
        return self.route(prompt_token_ids, **request).replica

    def route(
        self,
        prompt_token_ids: Sequence[int] | Any,
        *,
        lora_request: Any = None,
        cache_salt: str | None = None,
        mm_features: Sequence[Any] | None = None,
        medium: str = GPU,
    ) -> Route:
        """:meth:`best` and :meth:`score` at once, with the prompt's block hashes as the chosen
        replica's engine computes them: a router forwards them with the request (vLLM 0.34's
        ``EngineCoreRequest.block_hashes``), so that the replica does not hash the prompt
        again. The prompt is hashed once per hash configuration in the fleet, and the index
        walked once per (configuration, group) for every replica."""
        medium_id = self._media.get(medium)
        # vLLM looks up at most num_tokens - 1 tokens: the last is always computed.
        max_length = max(len(prompt_token_ids) - 1, 0)
        scores: dict[str, int | None] = dict.fromkeys(self._replicas)
        hashes_by_config: dict[tuple[Any, ...], list[bytes] | None] = {}
        core = self._cores[0 if medium_id is None else medium_id]
        for key, plan in self._route_plans().items():
            hashes = hashes_by_config[key] = plan.hasher.block_hashes(
                prompt_token_ids,
                lora_request=lora_request,
                cache_salt=cache_salt,
                mm_features=mm_features,
            )
            if hashes is None:
                continue  # not reproducible byte for byte: None for these replicas
            if medium_id is None:  # a medium no event has named: nothing cached there
                for name, *_ in plan.plain:
                    scores[name] = 0
                for _, names, _ in plan.hybrid.values():
                    scores.update(dict.fromkeys(names, 0))
                continue
            if plan.plain:
                usable = hashes[: max_length // plan.block_size]
                found = [core.prefix_blocks(usable, g, medium_id) for g in range(plan.groups)]
                size = plan.block_size
                if plan.groups == 1:  # the usual fleet: one walk answers every replica
                    first = found[0]
                    for name, rid, _ in plan.plain:
                        scores[name] = first[rid] * size
                else:
                    for name, rid, groups in plan.plain:
                        scores[name] = min(found[g][rid] for g in range(groups)) * size
            for rule, names, ids in plan.hybrid.values():
                # Sliding-window, chunked-local or Mamba groups (or the EAGLE drop): the
                # replicas' coordinator's own search, over the blocks each holds.
                found_tokens = core.hit_tokens(ids, hashes, rule, medium_id, max_length)
                scores.update(zip(names, found_tokens, strict=True))
        best, most = None, -1
        for name, score in scores.items():
            if score is not None and score > most:
                best, most = name, score
        chosen = None if best is None else hashes_by_config.get(self._replicas[best].config)
        return Route(best, scores, chosen)

    def _route_plans(self) -> dict[tuple[Any, ...], _Plan]:
        plans = self._plans
        if plans is None:
            plans = {}
            for replica in self._replicas.values():
                if replica.rule is not None:
                    plans.setdefault(replica.config, _Plan(replica)).add(replica)
            self._plans = plans
        return plans


@dataclass(frozen=True)
class Route:
    """:meth:`RoutingIndex.route`'s answer: the replica to send the request to (None when
    no replica's hit can be reproduced), every replica's score, and the prompt's block hashes
    as that replica's engine computes them (None where it has no reproducible hashes)."""

    replica: str | None
    scores: dict[str, int | None]
    block_hashes: list[bytes] | None
