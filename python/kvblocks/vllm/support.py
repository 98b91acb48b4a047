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
