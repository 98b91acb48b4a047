"""kvblocks' KV-cache manager for vLLM 0.33's scheduler: vLLM's ``KVCacheManager`` interface
for one full-attention group, on kvblocks' Rust block pool.

The Rust side (``kvblocks._core.KVCacheCore``) owns what vLLM's block pool owns (reference
counts, the free queue in eviction order, the hash-to-block map) and, per request, its block
table and how many of its blocks are registered in the cache. The request's own state stays
the request's: each call passes ``request.num_tokens``, ``request.num_computed_tokens`` and
the list ``request.block_hashes`` itself, which Rust reads in place only where the call needs
hashes. Block ids reach Python as int lists inside ``KVCacheBlockIds`` (what the scheduler
gets where vLLM returns ``KVCacheBlocks``: it only calls ``get_block_ids``); no
``KVCacheBlock`` object is made. ``allocate_slots``, the call vLLM makes for every running
request at every step, goes straight to Rust, which reads the request's fields itself.

Events and statistics are vLLM's own classes (``vllm.distributed.kv_events`` and
``vllm.v1.metrics.stats.PrefixCacheStats``), built the way vLLM's block pool builds them, so
vLLM's KV-event publisher and metrics work unchanged.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvblocks._core import KVCacheBlockIds, KVCacheCore
from kvblocks.vllm import _state

_MEDIUM = "GPU"


class _GroupManager:
    """The part of vLLM's single-type manager that the scheduler and EngineCore read."""

    def __init__(self, kv_cache_spec: Any) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.kv_cache_group_id = 0


class _Coordinator:
    """The part of vLLM's coordinator that the scheduler and EngineCore read."""

    def __init__(self, kv_cache_spec: Any) -> None:
        self.single_type_managers = (_GroupManager(kv_cache_spec),)
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: frozenset[int] = frozenset()


class KVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` (same constructor, same decisions) for one
    full-attention group; :mod:`kvblocks.vllm.scheduler` decides when it applies."""

    def __init__(
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
        from kvblocks.vllm.support import Unsupported, unsupported_manager_arguments

        try:
            reason = unsupported_manager_arguments(
                kv_cache_config,
                scheduler_block_size=scheduler_block_size,
                hash_block_size=hash_block_size,
                use_eagle=use_eagle,
                num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                num_prefill_lookahead=num_prefill_lookahead,
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
                metrics_collector=metrics_collector,
            )
        except Exception as error:  # an unexpected config shape
            raise Unsupported("guard_error") from error
        if reason is not None:
            raise Unsupported(reason)
        if watermark < 0.0:
            raise ValueError("watermark must be non-negative")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = False
        self.log_stats = log_stats
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = 1
        self.block_size: int = spec.block_size
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.coordinator = _Coordinator(spec)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids = ()
        self.kv_cache_event_metadata = (
            (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)),
        )
        self._core = KVCacheCore(
            kv_cache_config.num_blocks,
            self.block_size,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_events=enable_kv_cache_events,
            watermark_blocks=self.watermark_blocks,
            admitted_statuses=[RequestStatus.WAITING, RequestStatus.PREEMPTED],
        )
        self.empty_kv_cache_blocks = self._core.empty_kv_cache_blocks
        self._events: list[KVCacheEvent] = []
        if not enable_kv_cache_events:
            # The hot path: vLLM's scheduler calls Rust directly (no Python frame here).
            setattr(self, "allocate_slots", self._core.allocate_for_request)  # noqa: B010

    # -- what the scheduler calls every step -------------------------------------------------

    def new_step_starts(self) -> None:
        """Full attention keeps no per-step state."""

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlockIds, int, int]:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        hits = self._core.lookup(request.block_hashes, max_cache_hit_length // self.block_size)
        num_hits = len(hits)
        if (
            num_hits
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            self._events.append(self._stored_event(request, 0, num_hits, reused=True))
        return hits, num_hits * self.block_size, 0

    def allocate_slots(self, request: Request, *args: Any, **kwargs: Any) -> KVCacheBlockIds | None:
        """vLLM's ``allocate_slots`` (its arguments: ``KVCacheCore.allocate_for_request``), with
        KV events: Rust allocates, then the call's events become vLLM's event objects. Without
        events the instance attribute set in ``__init__`` sends vLLM's call to Rust directly."""
        blocks: KVCacheBlockIds | None = self._core.allocate_for_request(request, *args, **kwargs)
        if blocks is not None:
            self._collect_events(request)
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self._core.cache_blocks(request.request_id, request.block_hashes, num_computed_tokens)
            if self.enable_kv_cache_events:
                self._collect_events(request)

    def free(self, request: Request) -> None:
        self._core.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlockIds:
        return self._core.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self._core.get_block_ids(request_id),)

    def estimate_cached_tokens(self, request: Request) -> int:
        return int(self._core.estimate_cached_tokens(request.request_id))

    def take_new_block_ids(self) -> list[int]:
        """No KV-cache zeroing in the supported configurations."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Full attention never copies a block on write."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, Any]:
        return {}

    # vLLM's own code where it only reads what this class sets the same way.
    get_num_common_prefix_blocks = VllmKVCacheManager.get_num_common_prefix_blocks
    prefix_cache_lookup_enabled = VllmKVCacheManager.prefix_cache_lookup_enabled
    record_prefix_cache_stats = VllmKVCacheManager.record_prefix_cache_stats
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
        events, self._events = self._events, []
        return events

    def _collect_events(self, request: Request | None) -> None:
        """Turns the Rust side's events of the call just made (for ``request``) into vLLM's."""
        for raw in self._core.take_events():
            if raw[0] == "removed" and len(raw) == 2:
                self._events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(raw[1])],
                        medium=_MEDIUM,
                        group_idx=0,
                    )
                )
            elif raw[0] == "stored" and len(raw) == 4 and request is not None:
                _, request_id, first, end = raw
                if request_id != request.request_id:
                    raise RuntimeError(f"kvblocks: blocks of {request_id!r} stored by another call")
                self._events.append(self._stored_event(request, first, end))
            elif raw[0] == "cleared":
                self._events.append(AllBlocksCleared())
            else:
                raise RuntimeError(f"kvblocks: unexpected KV event {raw!r}")

    def _stored_event(
        self, request: Request, first: int, end: int, *, reused: bool = False
    ) -> BlockStored:
        """vLLM's ``BlockStored`` for the request's blocks ``[first, end)``, filled as vLLM's
        block pool fills it (a reused-blocks report has no parent)."""
        size = self.block_size
        hashes = request.block_hashes
        extra_keys, mm_idx = [], 0
        for i in range(first, end):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * size, (i + 1) * size, mm_idx)
            extra_keys.append(keys)
        lora = request.lora_request
        kind, sliding_window = self.kv_cache_event_metadata[0]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:end]],
            parent_block_hash=(
                None if reused or first == 0 else maybe_convert_block_hash(hashes[first - 1])
            ),
            token_ids=request.all_token_ids[first * size : end * size],
            block_size=size,
            lora_id=lora.adapter_id if lora else None,
            medium=_MEDIUM,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding_window,
            session_id=request.session_id,
            lookahead_token_ids=None,
        )
