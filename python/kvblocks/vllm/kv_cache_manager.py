"""kvblocks' KV-cache manager for vLLM 0.33's scheduler: vLLM's ``KVCacheManager`` interface
on kvblocks' Rust allocation engine, for every layout :mod:`kvblocks.vllm.support` allows
(any number of full-attention, MLA, sliding-window and chunked-local groups, and Mamba groups
with or without prefix caching; EAGLE/MTP and other speculative decoding; KV-cache zeroing).

The Rust side (``kvblocks._core.KVCacheManager``) owns what vLLM's block pool, coordinator and
single-type managers own (reference counts, the free queue in eviction order, the
hash-to-block map, and per request and group its block table and how many of its blocks are
registered in the cache). The request's own state stays the request's: each call passes the
request (or its counts and the list ``request.block_hashes``), which Rust reads in place
where the call needs it. Block ids reach Python as int lists inside ``KVCacheBlockIds`` (what
the scheduler gets where vLLM returns ``KVCacheBlocks``: it only calls ``get_block_ids``); no
``KVCacheBlock`` object is made. ``allocate_slots``, the call vLLM makes for every running
request at every step, goes straight to Rust, which reads the request's fields itself.

Events and statistics are vLLM's own classes (``vllm.distributed.kv_events`` and
``vllm.v1.metrics.stats.PrefixCacheStats``), built the way vLLM's block pool builds them, so
vLLM's KV-event publisher and metrics work unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import kvblocks._core as _core
import kvblocks.vllm._state as _state
import kvblocks.vllm.versions as versions
from kvblocks._core import KVCacheBlockIds, KVCacheGroup
from kvblocks.vllm.support import Unsupported, spec_kind, unsupported_manager_arguments

try:  # the vLLM names this module builds on (fingerprinted: kvblocks.vllm.fingerprints)
    from vllm.distributed.kv_events import (
        MEDIUM_GPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVCacheEvent,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        generate_lookahead_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.request import Request, RequestStatus
except ImportError as _error:  # a vLLM that moved one: KVCacheManager refuses to be built
    _VLLM_MISSING: str | None = _state.error_detail(_error)
    VllmKVCacheManager = None
else:
    _VLLM_MISSING = None


class _RequestBlocks(Mapping[str, tuple[Any, ...]]):
    """vLLM's ``req_to_blocks`` of one group, read-only and made when read (the scheduler
    never reads it; connectors' tests and tools do): request id -> the request's blocks in
    this group, each a ``KVCacheBlockView`` (``block_id``, ``is_null``, ``block_hash``), for
    every request holding blocks. As vLLM's (a ``defaultdict``), any other id reads as no
    blocks; unlike vLLM's, reading one adds no entry (vLLM's holds an empty entry for each
    request it only looked up)."""

    def __init__(self, core: _core.KVCacheManager, group_id: int) -> None:
        self._core = core
        self._group_id = group_id

    def __getitem__(self, request_id: str) -> tuple[Any, ...]:
        blocks: tuple[Any, ...] = self._core.get_blocks(request_id, True).blocks[self._group_id]
        return blocks

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._core.request_ids()

    def __iter__(self) -> Iterator[str]:
        return iter(self._core.request_ids())

    def __len__(self) -> int:
        return len(self._core)


class _GroupManager:
    """The part of vLLM's single-type manager that the scheduler and EngineCore read, and
    its ``req_to_blocks`` (a read-only view)."""

    def __init__(self, kv_cache_spec: Any, group_id: int, core: _core.KVCacheManager) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.kv_cache_group_id = group_id
        self.req_to_blocks = _RequestBlocks(core, group_id)


class _Coordinator:
    """The part of vLLM's coordinator that the scheduler and EngineCore read."""

    def __init__(
        self, specs: list[Any], eagle_group_ids: set[int], core: _core.KVCacheManager
    ) -> None:
        self.single_type_managers = tuple(_GroupManager(s, i, core) for i, s in enumerate(specs))
        self.enable_partial_hash_hits = False
        self.eagle_group_ids = eagle_group_ids
        self._core = core

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """vLLM's, as its scheduler asks it with a KV connector (the blocks a prefilling
        request still needs, to reserve them): no new hits, no encoder tokens."""
        if any(new_computed_blocks) or num_encoder_tokens:
            raise ValueError("kvblocks answers get_num_blocks_to_allocate without new hits only")
        blocks: int = self._core.num_blocks_to_allocate(
            request_id,
            num_tokens,
            total_computed_tokens,
            apply_admission_cap,
            num_tokens_main_model,
            prefill_end,
        )
        return blocks


class _BlockPool:
    """The part of vLLM's ``BlockPool`` the scheduler uses with a KV connector: it frees the
    blocks ``pop_blocks_for_free`` handed out (block ids here) once no step in flight reads
    them."""

    def __init__(self, core: _core.KVCacheManager) -> None:
        self._core = core

    def free_blocks(self, ordered_blocks: Any) -> None:
        self._core.free_blocks(ordered_blocks)

    def get_num_free_blocks(self) -> int:
        free: int = self._core.num_free_blocks
        return free


def _engine_group(group: Any, max_in_flight_tokens: int, max_model_len: int) -> KVCacheGroup:
    """The Rust engine's description of one of vLLM's KV-cache groups."""
    spec = group.kv_cache_spec
    kind = spec_kind(spec, group.role)
    cap = None
    if kind in ("sliding_window", "chunked_local"):
        cap = spec.max_admission_blocks_per_request(
            max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
        )
    return KVCacheGroup(
        kind or "",
        spec.block_size,
        sliding_window=spec.sliding_window if kind == "sliding_window" else None,
        extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
        attention_chunk_size=spec.attention_chunk_size if kind == "chunked_local" else None,
        num_speculative_blocks=spec.num_speculative_blocks if kind == "mamba" else 0,
        max_admission_blocks=cap,
        is_eagle_group=group.is_eagle_group,
        # vLLM's has_prefill_checkpoint_blocks (with an alignment, else never valid).
        prefill_checkpoint_alignment=(
            spec.prefill_checkpoint_alignment
            if kind == "mamba" and spec.num_prefill_checkpoint_blocks > 0
            else None
        ),
    )


def _lookup_sets(kv_cache_config: KVCacheConfig) -> list[list[int]]:
    """vLLM's hybrid coordinator's lookup order: groups with equal specs (vLLM's equality)
    and the same manager are looked up together; full attention first."""
    sets: list[tuple[Any, str | None, list[int]]] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = spec_kind(spec, group.role)
        for seen_spec, seen_kind, members in sets:
            if seen_spec == spec and seen_kind == kind:
                members.append(i)
                break
        else:
            sets.append((spec, kind, [i]))
    sets.sort(key=lambda entry: not isinstance(entry[0], FullAttentionSpec))
    return [members for _, _, members in sets]


class KVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` (same constructor, same decisions) on kvblocks' Rust
    allocation engine; :mod:`kvblocks.vllm.scheduler` decides when it applies."""

    def __init__(self, **kwargs: Any) -> None:
        if _VLLM_MISSING is not None:
            raise Unsupported(_state.Reason.VLLM_SOURCES, _VLLM_MISSING)
        try:
            reason = unsupported_manager_arguments(kwargs)
        except Exception as error:  # an unexpected config shape
            raise Unsupported(_state.Reason.GUARD_ERROR, _state.error_detail(error)) from error
        if reason is not None:
            raise Unsupported(reason)
        self._init(**kwargs)

    def _init(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.block_size: int = scheduler_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self._num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not eagle_group_ids:
            eagle_group_ids = set(range(len(groups)))
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids = ()
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec))
            for spec in specs
        )
        lookup_sets = _lookup_sets(kv_cache_config)
        # vLLM's hybrid coordinator's full_attention_group_id, where a connector's lookup
        # searches each group on its own (a model with Mamba layers, prefix caching on).
        first = lookup_sets[0][0] if lookup_sets else 0
        self._connector_reference_group: int | None = (
            first
            if enable_caching
            and len(groups) > 1
            and kv_cache_config.has_mamba_layers
            and isinstance(specs[first], FullAttentionSpec)
            else None
        )
        self._core = _core.KVCacheManager(
            kv_cache_config.num_blocks,
            [_engine_group(g, in_flight, max_model_len) for g in groups],
            lookup_sets=lookup_sets,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_events=enable_kv_cache_events,
            watermark_blocks=self.watermark_blocks,
            use_eagle=use_eagle,
            num_prefill_lookahead=num_prefill_lookahead,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            # Retention only thins out what prefix caching registers.
            retention_interval=(
                kv_cache_config.prefix_cache_retention_interval if enable_caching else None
            ),
            needs_kv_cache_zeroing=kv_cache_config.needs_kv_cache_zeroing,
            waiting_statuses=[RequestStatus.WAITING, RequestStatus.PREEMPTED],
        )
        # Only Mamba groups with prefix caching keep per-step state and offer states.
        self._mamba_prefix_caching = enable_caching and any(
            spec_kind(g.kv_cache_spec, g.role) == "mamba" for g in groups
        )
        self._null_states = 0  # the core's count last seen (new_step_starts)
        # get_blocks gives the blocks' keys too once a KV connector is served.
        self._blocks_with_keys = False
        self.empty_kv_cache_blocks = self._core.empty_kv_cache_blocks
        self.coordinator = _Coordinator(specs, eagle_group_ids, self._core)
        self.block_pool = _BlockPool(self._core)
        self._events: list[KVCacheEvent] = []

    def contain_errors_in(self, scheduler: Any) -> bool:
        """Finishes a request whose allocation fails kvblocks' check with an error, through
        ``scheduler``'s own per-request error channel (``grammar_compile_error_reqs``, which
        its ``update_from_output`` finishes with ``FINISHED_ERROR`` and hands to the client
        as vLLM's ``RequestError``), instead of raising out of ``schedule()``. The request
        keeps a table safe for the worker until then (only its own blocks, null blocks where
        it has none). Where this vLLM has no such channel, the error is raised as before and
        one WARNING says so. Returns whether errors are contained."""
        try:
            from vllm.outputs import RequestError

            if not isinstance(scheduler.grammar_compile_error_reqs, dict):
                raise TypeError("Scheduler.grammar_compile_error_reqs is not a dict")
            # Built once here, so that a vLLM whose RequestError takes other fields turns
            # containment off at start-up instead of raising inside schedule().
            RequestError(code="internal_error", message="kvblocks", retryable=True)
        except Exception as error:
            _state.log_once(
                "contain_unavailable",
                logging.WARNING,
                "kvblocks: an internal error in kvblocks' KV-cache manager will stop the engine "
                "instead of one request: this vLLM has no per-request error channel kvblocks "
                "knows (%s)",
                _state.error_detail(error),
            )
            return False
        owner = weakref.ref(scheduler)
        context = ", ".join(
            [
                f"vllm {versions.installed_vllm_version()}",
                f"kvblocks {_core.__version__}",
                *(f"{part}: {detail}" for part, detail in _state.active.items()),
            ]
        )

        def contained(request_id: str, message: str) -> None:
            held = owner()
            if held is not None:
                held.grammar_compile_error_reqs[request_id] = RequestError(
                    code="internal_error",
                    message=f"kvblocks: {message} (the request was stopped; retry it)",
                    retryable=True,
                )
            # A failing log handler must not reach vLLM's schedule().
            with contextlib.suppress(Exception):
                _state.note_contained(request_id, message, context)

        self._core.contain_errors(contained)
        return True

    # -- what the scheduler calls every step -------------------------------------------------

    def new_step_starts(self) -> None:
        """vLLM's: Mamba states cached before this step may be adopted as hits again (a
        request whose hit was cached during the step waits for the next one). Only Mamba
        groups with prefix caching keep such state; otherwise there is nothing to do and no
        call into Rust. Rust also says how often its allocations have kept a null block in a
        Mamba state column as vLLM's do (counted in ``status()``, logged once)."""
        if self._mamba_prefix_caching:
            null_states = self._core.new_step_starts()
            if null_states != self._null_states:
                _state.note_vllm_defect("mamba_null_state", null_states - self._null_states)
                self._null_states = null_states

    def _lookup_length(self, request: Request, max_cache_hit_length: int | None) -> int | None:
        """How many tokens a lookup may hit, or None where the request looks nothing up.
        vLLM 0.34's rule is the request's own (``Request.get_max_cache_hit_length``: all but
        the last token, within its prefix-cache hit limit and the caller's bound, called here
        as vLLM's manager calls it); vLLM 0.33's: all but the last, or the caller's bound."""
        if not self.prefix_cache_lookup_enabled(request):
            return None
        hit_length = getattr(request, "get_max_cache_hit_length", None)
        if hit_length is not None:
            length: int = hit_length(max_cache_hit_length)
            return length
        return request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlockIds, int, int]:
        limit = self._lookup_length(request, max_cache_hit_length)
        if limit is None:
            return self.empty_kv_cache_blocks, 0, 0
        # With the request's id: a request cache-aware admission just probed resumes that walk.
        hits, num_tokens, num_uncached = self._core.lookup(
            request.block_hashes, limit, request.request_id
        )
        if (
            num_tokens
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            for group, ids in enumerate(hits.get_block_ids() or ()):
                if ids:
                    self._events.append(self._stored_event(request, group, 0, len(ids), None))
        shared_prefix_boundary = num_tokens + num_uncached if num_uncached else 0
        return hits, num_tokens, shared_prefix_boundary

    @functools.cached_property
    def get_num_cached_tokens(self) -> Callable[[Request], int]:
        """vLLM 0.34's cache-aware admission probe (``cache_aware_admission_window``): how
        many of the request's tokens (all but the last, not bounded by its hit limit) are in
        the prefix cache, 0 where vLLM's ``prefix_cache_lookup_enabled`` runs no lookup. It
        only counts: no references, no blocks for Python, no events, no statistics. vLLM's
        scheduler calls it once per waiting request in the window at every step, so it is
        Rust's ``_core.KVCacheManager.probe_request`` itself (the request read in place, no
        Python frame between), looked up once per manager (this property); a probe resumes
        the request's previous walk while nothing cached has been removed since."""
        probe: Callable[[Request], int] = self._core.probe_request
        return probe

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlockIds, int, int, bool]:
        """vLLM's lookup for a KV connector that accepts hybrid hits diverging between groups
        (NIXL): in a model with Mamba layers and a full-attention group, each group is
        searched on its own; the full-attention hit is the local prefix (the connector sends
        the rest, Mamba state included) and the fourth value says whether a group's hit is
        shorter. A group hitting deeper than full attention (whose blocks were evicted), or
        any other model, gets ``get_computed_blocks`` and no divergence. The per-group search
        reports no uncached shared prefix (boundary 0) and no full-report events."""
        reference = self._connector_reference_group
        if reference is None:
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        limit = self._lookup_length(request, max_cache_hit_length)
        if limit is None:
            return self.empty_kv_cache_blocks, 0, 0, False
        blocks, lengths = self._core.lookup_per_group(request.block_hashes, limit)
        num_local = lengths[reference]
        if max(lengths) > num_local:
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        return blocks, num_local, 0, min(lengths) < num_local

    @functools.cached_property
    def allocate_slots(self) -> Callable[..., KVCacheBlockIds | None]:
        """vLLM's ``allocate_slots`` (vLLM's arguments), which vLLM's scheduler calls for every
        running request at every step. Without KV events it is Rust's
        ``_core.KVCacheManager.allocate_for_request`` itself, which reads the request's fields
        in place: looked up once per manager (this property), then vLLM's call goes straight
        to Rust with no Python frame between (a delegating method would add about a third to
        the call). With KV events it is :meth:`_allocate_slots_with_events`."""
        if self.enable_kv_cache_events:
            return self._allocate_slots_with_events
        allocate: Callable[..., KVCacheBlockIds | None] = self._core.allocate_for_request
        return allocate

    def _allocate_slots_with_events(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlockIds | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Any = None,
    ) -> KVCacheBlockIds | None:
        """``allocate_slots`` with KV events: Rust allocates, then the call's events become
        vLLM's event objects."""
        blocks: KVCacheBlockIds | None = self._core.allocate_for_request(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
        if (
            blocks is not None
            and request.num_tokens > self.max_model_len
            and not delay_cache_blocks
        ):
            # vLLM's num_tokens_to_cache (no external tokens: no connector here).
            computed = request.num_computed_tokens + num_new_computed_tokens
            cached = min(min(computed, self.max_model_len) + num_new_tokens, request.num_tokens)
            self._check_outgrown(request, cached)
        self._collect_events(request)
        return blocks

    @functools.cached_property
    def cache_blocks(self) -> Callable[[Request, int], None]:
        """vLLM's ``cache_blocks`` (vLLM's arguments), which vLLM's scheduler calls for every
        running request after every async step. With caching on and no KV events it is
        Rust's ``_core.KVCacheManager.cache_blocks`` itself (no Python frame between, as for
        :attr:`allocate_slots`), which returns after reading the request's id and hashes on
        a step where none of its blocks filled. Otherwise :meth:`_cache_blocks_in_python`."""
        if self.enable_caching and not self.enable_kv_cache_events:
            cache: Callable[[Request, int], None] = self._core.cache_blocks
            return cache
        return self._cache_blocks_in_python

    def _cache_blocks_in_python(self, request: Request, num_computed_tokens: int) -> None:
        """``cache_blocks`` without caching (nothing to do) or with KV events (Rust registers,
        then the call's events become vLLM's event objects)."""
        if self.enable_caching:
            self._core.cache_blocks(request, num_computed_tokens)
            if self.enable_kv_cache_events:
                if request.num_tokens > self.max_model_len:
                    self._check_outgrown(request, num_computed_tokens)
                self._collect_events(request)

    def _check_outgrown(self, request: Request, num_tokens: int) -> None:
        """Where stock vLLM and kvblocks part ways on purpose (docs/vllm.md, "Where kvblocks
        differs"): caching ``num_tokens`` tokens of a request whose tokens outgrew
        ``max_model_len`` (a streaming session) needs more full blocks than the request
        holds. With KV events on, vLLM's block pool then indexes past the request's blocks
        building the ``BlockStored`` event and raises ``IndexError`` out of ``schedule()``;
        kvblocks registers the blocks the request holds and goes on. Says so once (WARNING)."""
        if not self.enable_caching:
            return
        # The fewest tokens vLLM's coordinators cache of num_tokens in any group (an EAGLE
        # group of several may take one block more): the warning never claims a crash that
        # would not happen.
        cacheable = max(0, num_tokens - self._num_reprefillable_tokens)
        full = min(cacheable // self.block_size, len(request.block_hashes))
        for ids in self._core.get_block_ids(request.request_id):
            if full > len(ids):
                _state.log_once(
                    "outgrown_max_model_len",
                    logging.WARNING,
                    "kvblocks: request %r has %d full blocks to cache but holds %d (its tokens "
                    "outgrew max_model_len=%d); kvblocks registers the blocks it holds and goes "
                    "on, where stock vLLM with KV events on would raise IndexError out of "
                    "schedule() (logged once)",
                    request.request_id,
                    full,
                    len(ids),
                    self.max_model_len,
                )
                return

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """vLLM's ``remove_skipped_blocks`` (the prompt length only matters to R-SWA, which
        kvblocks does not implement)."""
        self._core.remove_skipped_blocks(request_id, processed_computed_tokens)

    def free(self, request: Request) -> None:
        self._core.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlockIds:
        """vLLM's: the request's blocks (ids; with their keys too once a KV connector is
        served, ``serve_kv_connector``)."""
        return self._core.get_blocks(request_id, self._blocks_with_keys)

    def serve_kv_connector(self) -> None:
        """Called once a KV connector is set (kvblocks.vllm.scheduler): ``get_blocks`` results
        then also carry each block's prefix-cache key, which connectors read
        (``.blocks[group][i].block_hash``)."""
        self._blocks_with_keys = True

    # -- what the scheduler calls with a KV connector ---------------------------------------

    def pop_blocks_for_free(self, request: Request) -> list[int]:
        """vLLM's: forgets the request and returns its blocks, still held, for the scheduler
        to free through ``block_pool.free_blocks`` once no step in flight reads them."""
        blocks: list[int] = self._core.pop_blocks_for_free(request.request_id)
        return blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM's: the request's blocks from ``start_token`` on are zeroed again (a failed
        asynchronous load left them unwritten)."""
        self._core.record_blocks_for_zeroing(request_id, start_token)

    def evict_blocks(self, block_ids: Any) -> None:
        """vLLM's: the blocks (a set of ids) lose their prefix-cache entries (a connector
        reported them invalid); in use or not, they stay where they are."""
        self._core.evict_blocks(block_ids)
        if self.enable_kv_cache_events:
            self._collect_events(None)

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """Only vLLM's Mamba "align" groups hand partial tails to a connector."""
        return []

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = self._core.get_block_ids(request_id)
        return ids

    def estimate_cached_tokens(self, request: Request) -> int:
        return int(self._core.estimate_cached_tokens(request.request_id))

    def take_new_block_ids(self) -> list[int]:
        """vLLM's ``take_new_block_ids``: the attention groups' blocks allocated since the last
        call, for the worker to zero (when the KV cache needs zeroing: Mamba layers or mixed
        precision)."""
        ids: list[int] = self._core.take_new_block_ids()
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Hits are block-aligned here: no block is copied on write."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM's, called every step: ``{request_id: [(group_id, block_id, num_tokens),
        ...]}``, the Mamba states registered at block boundaries since the last call, which a
        KV connector may offload (vLLM's CPU offloading stores Mamba states only from these).
        Only Mamba groups with prefix caching offer any; otherwise there are none and no call
        into Rust."""
        if not self._mamba_prefix_caching:
            return {}
        offloads: dict[str, list[tuple[int, int, int]]] = self._core.take_boundary_state_offloads()
        return offloads

    # -- vLLM's own methods -------------------------------------------------------------------
    # vLLM's KVCacheManager methods that run unchanged on this class: they only read what it
    # sets as vLLM's manager does (fingerprinted with the rest). Each is defined here only
    # where the installed vLLM's manager has it, so that the class has what vLLM's has (vLLM
    # 0.34 has no get_num_common_prefix_blocks) and this module imports whatever vLLM moved.
    if TYPE_CHECKING:

        def prefix_cache_lookup_enabled(self, request: Request) -> bool: ...

    else:
        if hasattr(VllmKVCacheManager, "get_num_common_prefix_blocks"):
            get_num_common_prefix_blocks = VllmKVCacheManager.get_num_common_prefix_blocks
        if hasattr(VllmKVCacheManager, "get_block_ids_for_computed_tokens"):
            get_block_ids_for_computed_tokens = VllmKVCacheManager.get_block_ids_for_computed_tokens
        if hasattr(VllmKVCacheManager, "prefix_cache_lookup_enabled"):
            prefix_cache_lookup_enabled = VllmKVCacheManager.prefix_cache_lookup_enabled
        if hasattr(VllmKVCacheManager, "record_prefix_cache_stats"):
            record_prefix_cache_stats = VllmKVCacheManager.record_prefix_cache_stats
        if hasattr(VllmKVCacheManager, "make_prefix_cache_stats"):
            make_prefix_cache_stats = VllmKVCacheManager.make_prefix_cache_stats

    # -- statistics and events ---------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self._core.usage

    def reset_prefix_cache(self) -> bool:
        if not self._core.reset_prefix_cache():
            in_use = self._core.num_blocks - 1 - self._core.num_free_blocks
            _state.logger().warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet", in_use
            )
            return False
        _state.logger().info("Successfully reset prefix cache")
        if self.enable_kv_cache_events:
            self._collect_events(None)
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        self._collect_events(None)
        events, self._events = self._events, []
        return events

    def _collect_events(self, request: Request | None) -> None:
        """Turns the Rust side's events of the call just made (for ``request``) into vLLM's."""
        for raw in self._core.take_events():
            kind = raw[0]
            if kind == "removed" and len(raw) == 3:
                _, block_hash, group = raw
                self._events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(block_hash)],
                        medium=MEDIUM_GPU,
                        group_idx=group,
                    )
                )
            elif kind == "stored" and len(raw) == 6 and request is not None:
                _, request_id, group, first, end, skipped = raw
                if request_id != request.request_id:
                    raise RuntimeError(f"kvblocks: blocks of {request_id!r} stored by another call")
                parent = first if first > 0 else None
                self._events.append(
                    self._stored_event(request, group, first, end, parent, frozenset(skipped))
                )
            elif kind == "cleared":
                self._events.append(AllBlocksCleared())
            else:
                raise RuntimeError(f"kvblocks: unexpected KV event {raw!r}")

    def _stored_event(
        self,
        request: Request,
        group: int,
        first: int,
        end: int,
        parent: int | None,
        skipped: frozenset[int] = frozenset(),
    ) -> BlockStored:
        """vLLM's ``BlockStored`` for the request's blocks ``[first, end)`` of ``group`` less
        the ``skipped`` ones, filled as vLLM's block pool fills it; ``parent`` is ``first``
        when the event names the hash before the range (a reused-blocks report has none)."""
        size = self.block_size
        hashes = request.block_hashes
        lookahead = self.num_hash_lookahead_tokens
        stored = [i for i in range(first, end) if i not in skipped]
        extra_keys: list[Any] = []
        lookahead_ids: list[list[int]] | None = [] if lookahead else None
        mm_idx = 0
        for i in stored:
            start, stop = i * size, (i + 1) * size
            if lookahead:
                keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, start, stop, stop + lookahead, mm_idx
                )
                assert lookahead_ids is not None
                lookahead_ids.append(request.all_token_ids[stop : stop + lookahead])
            else:
                keys, mm_idx = generate_block_hash_extra_keys(request, start, stop, mm_idx)
            extra_keys.append(keys)
        lora = request.lora_request
        kind, sliding_window = self.kv_cache_event_metadata[group]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[i]) for i in stored],
            parent_block_hash=(
                None if parent is None else maybe_convert_block_hash(hashes[parent - 1])
            ),
            token_ids=request.all_token_ids[first * size : end * size],
            block_size=size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding_window,
            session_id=request.session_id,
            lookahead_token_ids=lookahead_ids,
        )
