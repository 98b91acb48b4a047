"""Which vLLM configurations kvblocks' KV-cache manager reproduces exactly.

Decided before the manager is built, from the ``VllmConfig``, the ``KVCacheConfig`` and the
manager's own arguments: exactly one KV-cache group with a plain ``FullAttentionSpec``, block
hashes at the block size, prefix caching on or off, no KV or encoder-cache connector, no
speculative decoding (EAGLE/MTP drafts, lookahead slots or hashing), no decode or prefill
context parallelism, no KV-cache metrics collector, no KV-cache zeroing, no Mamba, and one of
vLLM's four hash algorithms. Each function returns ``None`` when supported, else the short
name of the first reason (its text is in ``kvblocks.vllm._state.REASONS``).
"""

from __future__ import annotations

from typing import Any

from kvblocks.vllm.block_hasher import ALGORITHMS


class Unsupported(ValueError):
    """kvblocks' ``KVCacheManager`` refused its arguments; ``reason`` is the short name."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"kvblocks' KVCacheManager does not support {reason}")
        self.reason = reason


def unsupported_manager_arguments(
    kv_cache_config: Any,
    *,
    scheduler_block_size: int,
    hash_block_size: int | None,
    use_eagle: bool,
    num_hash_lookahead_tokens: int,
    num_prefill_lookahead: int,
    dcp_world_size: int,
    pcp_world_size: int,
    metrics_collector: Any,
) -> str | None:
    """What the arguments of ``KVCacheManager(...)`` show."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupRole

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return "kv_cache_groups"
    group = groups[0]
    spec = group.kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        return "kv_cache_spec"
    if group.is_eagle_group or group.host_resident or group.role != KVCacheGroupRole.DEFAULT:
        return "kv_cache_group_role"
    if hash_block_size is None:
        hash_block_size = scheduler_block_size
    if not hash_block_size == scheduler_block_size == spec.block_size:
        return "hash_block_size"
    if use_eagle or num_hash_lookahead_tokens or num_prefill_lookahead:
        return "speculative"
    if dcp_world_size != 1 or pcp_world_size != 1:
        return "context_parallel"
    if metrics_collector is not None:
        return "metrics_collector"
    if kv_cache_config.has_mamba_layers or kv_cache_config.needs_kv_cache_zeroing:
        return "zeroing"
    if kv_cache_config.prefix_cache_retention_interval:
        return "retention"
    if kv_cache_config.hisparse_host_num_blocks is not None:
        return "kv_cache_group_role"
    return None


def unsupported_config(
    vllm_config: Any, *, allowed_scheduler_cls: tuple[Any, ...] = ()
) -> str | None:
    """What the engine's ``VllmConfig`` shows (the manager's arguments do not carry it)."""
    if vllm_config.kv_transfer_config is not None:
        return "kv_connector"
    if vllm_config.ec_transfer_config is not None:
        return "ec_connector"
    if vllm_config.aux_output_config.enabled:
        return "aux_output"
    if vllm_config.speculative_config is not None:
        return "speculative"
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        return "context_parallel"
    if vllm_config.observability_config.kv_cache_metrics:
        return "metrics_collector"
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and cache.prefix_caching_hash_algo not in ALGORITHMS:
        return "hash_algo"
    if cache.prefix_match_unit not in (None, cache.block_size):
        return "hash_block_size"
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return "kv_cache_group_role"
    model = vllm_config.model_config
    if model is not None and model.is_encoder_decoder:
        return "encoder_decoder"
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not _is_allowed(scheduler_cls, allowed_scheduler_cls):
        return "scheduler_cls"
    return None


def _is_allowed(scheduler_cls: Any, allowed: tuple[Any, ...]) -> bool:
    if isinstance(scheduler_cls, str):
        return scheduler_cls in {f"{c.__module__}.{c.__qualname__}" for c in allowed} | {
            f"kvblocks.vllm.{c.__qualname__}" for c in allowed
        }
    return scheduler_cls in allowed


#: Members of vLLM's KV-cache manager objects that kvblocks' manager does not have, each with
#: the refused configurations (keys of ``kvblocks.vllm._state.REASONS``) under which vLLM code
#: reads it; in every configuration kvblocks accepts, nothing reads them.
#: ``tests/vllm_tier/test_completeness.py`` walks vLLM's ``KVCacheManager`` and
#: ``KVCacheBlocks`` and what vLLM reads of the coordinator and its single-type managers, and
#: requires each member to be implemented or listed here (and no listed one implemented).
#: Members no vLLM code outside the manager calls are listed under the two holders of a
#: manager kvblocks refuses: KV connectors (``bind_kv_cache_manager``) and custom schedulers.
UNREACHABLE: dict[str, tuple[str, ...]] = {
    # The block pool: connectors bind it; the auxiliary-output connector reads it; the
    # scheduler frees deferred (connector) and copy-on-write blocks into it.
    "KVCacheManager.block_pool": ("kv_connector", "aux_output"),
    # The scheduler's KV-connector paths: connector-side hits, deferred frees, finished
    # requests handed to the connector, failed loads.
    "KVCacheManager.get_computed_blocks_for_connector": ("kv_connector",),
    "KVCacheManager.truncate_computed_blocks": ("kv_connector",),
    "KVCacheManager.pop_blocks_for_free": ("kv_connector",),
    "KVCacheManager.remove_skipped_blocks": ("kv_connector",),
    "KVCacheManager.get_block_ids_for_computed_tokens": ("kv_connector",),
    "KVCacheManager.finalize_partial_tail_offloads": ("kv_connector",),
    "KVCacheManager.record_blocks_for_zeroing": ("kv_connector",),
    "KVCacheManager.evict_blocks": ("kv_connector",),
    "KVCacheManager.create_kv_cache_blocks": ("kv_connector", "scheduler_cls"),
    # What connectors read of the blocks they are handed (and the scheduler, for a connector's
    # in-flight loads).
    "KVCacheBlocks.blocks": ("kv_connector",),
    "KVCacheBlocks.get_unhashed_block_ids": ("kv_connector",),
    "KVCacheBlocks.get_unhashed_block_ids_all_groups": ("kv_connector",),
    "KVCacheBlocks.new_empty": ("kv_connector", "scheduler_cls"),
    "KVCacheBlocks.__add__": ("kv_connector", "scheduler_cls"),
    # The coordinator: the scheduler's reservation for in-flight async loads, the HiSparse
    # and offloading connectors.
    "coordinator.get_num_blocks_to_allocate": ("kv_connector",),
    "coordinator.num_reprefillable_tokens": ("kv_connector",),
    "coordinator.find_longest_cache_hit_per_group": ("kv_connector",),
    # A group's block pool: the UMBP connector and the auxiliary-output connector.
    "single_type_manager.block_pool": ("kv_connector", "aux_output"),
}
