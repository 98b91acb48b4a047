"""Which vLLM configurations kvblocks' KV-cache manager reproduces exactly: an allowlist.

Decided before the manager is built, from the ``VllmConfig``, the ``KVCacheConfig`` and the
manager's own arguments. What is allowed is what kvblocks implements; anything else, a vLLM
option it does not know included, falls back to vLLM's own manager:

- KV-cache groups whose spec is, by exact type, one kvblocks implements (:data:`SPEC_KINDS`:
  full attention and MLA, sliding window and sliding-window MLA, chunked local attention,
  Mamba and linear attention), prefix-cacheable, in the default role; with prefix caching
  all with the hash block size (the scheduler's block size), without it any size that
  divides the scheduler's;
- Mamba groups in vLLM's ``mamba_cache_mode="none"`` without prefix caching and in its
  "align" mode with it (the Mamba block size then the hash block size, as vLLM sets it; not
  with lookahead hashing of two or more tokens), and KV-cache
  zeroing (which Mamba layers and mixed-precision caches need) as vLLM does it;
- vLLM's unitary, hybrid and no-prefix-cache coordinators (any number of such groups, prefix
  caching on or off);
- speculative decoding by n-gram (``ngram``, ``ngram_gpu``), suffix, EAGLE, EAGLE-3, MTP, a
  separate draft model, DFlash or DSpark (the EAGLE block drop, lookahead slots, prefill
  lookahead, lookahead hashing: :data:`SPECULATIVE_METHODS`);
- vLLM's retention interval (passed to ``_core.KVCacheManager`` with caching on) where vLLM's own
  coordinator accepts it (its check decides; a refused one is ``vllm_rejects``);
- vLLM's native CPU offloading (the ``OffloadingConnector``, ``--kv-offloading-size``),
  NIXL's connector in pull or push mode and Mooncake's (disaggregated prefill) and the
  DecodeBenchConnector, alone or in vLLM's MultiConnector, and none of: another KV
  connector, an encoder-cache connector, auxiliary outputs, context parallelism, the KV-cache
  metrics collector, an encoder-decoder model, a custom scheduler class, lookahead hashing of
  two or more tokens with prefix caching but no full-attention group; one of vLLM's four hash
  algorithms;
- only the ``KVCacheManager`` arguments vLLM 0.33 passes.

Each function returns ``None`` when supported, else the first :class:`~kvblocks.vllm._state.Reason`.
"""

from __future__ import annotations

from typing import Any

from kvblocks.vllm._state import Reason
from kvblocks.vllm.block_hasher import ALGORITHMS

#: vLLM's spec classes kvblocks implements, by exact type, with the engine's kind for each.
SPEC_KINDS = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MambaSpec": "mamba",
}
#: The name of vLLM's single-type manager class for each kind (in
#: ``vllm.v1.core.single_type_kv_cache_manager``): the class vLLM's registry must pick.
KIND_MANAGERS = {
    "full": "FullAttentionManager",
    "sliding_window": "SlidingWindowManager",
    "chunked_local": "ChunkedLocalAttentionManager",
    "mamba": "MambaManager",
}
#: The speculative-decoding methods kvblocks runs. vLLM's scheduler is vLLM's own code; what
#: reaches the manager of a method is only what vLLM derives from its ``SpeculativeConfig``
#: (the EAGLE block drop and lookahead hashing, ``use_eagle_block_drop()``; prefill
#: lookahead; lookahead slots, ``VllmConfig.num_lookahead_tokens``) and the KV-cache groups
#: its draft layers join, each checked as any other. Per method (vLLM 0.33):
#: n-gram on the CPU or the GPU (``ngram_gpu``, which keeps async scheduling on the V1 model
#: runner) and suffix decoding: none of them; EAGLE and EAGLE-3: the drop or lookahead
#: hashing, one prefill-lookahead token, k slots; MTP: the same with a prefill lookahead of k
#: for several modules; a separate draft model (``draft_model``, PARD too): k slots;
#: DFlash: one prefill-lookahead token, k + 1 slots, no drop; DSpark (V2 model runner): as
#: DFlash, k slots when it samples from the anchor. Not run: ``extract_hidden_states``
#: (it drafts nothing; its hidden-state cache is a spec kvblocks does not implement) and
#: ``custom_class`` (a user's proposer class), a speculator registered with vLLM 0.34's
#: ``register_speculative_method`` (its ``custom_method`` is set), and any method vLLM may add.
SPECULATIVE_METHODS = frozenset(
    {"ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark"}
)
#: The keyword arguments vLLM 0.33's scheduler passes to ``KVCacheManager``.
MANAGER_ARGUMENTS = frozenset(
    {
        "kv_cache_config",
        "max_model_len",
        "scheduler_block_size",
        "hash_block_size",
        "max_in_flight_tokens",
        "enable_caching",
        "use_eagle",
        "num_hash_lookahead_tokens",
        "num_prefill_lookahead",
        "log_stats",
        "enable_kv_cache_events",
        "dcp_world_size",
        "pcp_world_size",
        "metrics_collector",
        "watermark",
        "enable_mamba_shared_prefix_checkpoint",
    }
)


class Unsupported(ValueError):
    """kvblocks' ``KVCacheManager`` refused its arguments; ``reason`` says why and ``detail``
    what the reason's text leaves out (for :attr:`Reason.GUARD_ERROR`, the error)."""

    def __init__(self, reason: Reason, detail: str | None = None) -> None:
        message = f"kvblocks' KVCacheManager does not support {reason.text}"
        super().__init__(f"{message} ({detail})" if detail else message)
        self.reason = reason
        self.detail = detail


def spec_kind(spec: Any, role: Any) -> str | None:
    """The engine's kind for a group's spec, or ``None`` when kvblocks does not implement
    it: the spec type must be allowed exactly and vLLM's registry must manage it with the
    kind's manager (so a spec registered elsewhere, or a role manager, is refused)."""
    from vllm.v1 import kv_cache_interface
    from vllm.v1.core import single_type_kv_cache_manager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    name = type(spec).__name__
    kind = SPEC_KINDS.get(name)
    if kind is None or type(spec) is not getattr(kv_cache_interface, name, None):
        return None
    manager = KVCacheSpecRegistry.get_manager_class(spec, role)
    if manager is not getattr(single_type_kv_cache_manager, KIND_MANAGERS[kind]):
        return None  # exactly vLLM's class, not a subclass or namesake registered elsewhere
    return kind


def unsupported_manager_arguments(kwargs: dict[str, Any]) -> Reason | None:
    """What the arguments of ``KVCacheManager(**kwargs)`` show."""
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    if not MANAGER_ARGUMENTS.issuperset(kwargs):
        return Reason.MANAGER_ARGUMENT
    config = kwargs["kv_cache_config"]
    scheduler_block_size = kwargs["scheduler_block_size"]
    hash_block_size = kwargs.get("hash_block_size") or scheduler_block_size
    use_eagle = kwargs.get("use_eagle", False)
    caching = kwargs.get("enable_caching", True)
    groups = config.kv_cache_groups
    if not groups:
        return Reason.KV_CACHE_GROUPS
    for group in groups:
        spec = group.kv_cache_spec
        if spec_kind(spec, group.role) == "mamba" and (
            spec.mamba_cache_mode != ("align" if caching else "none")
            or (caching and kwargs.get("num_hash_lookahead_tokens", 0) >= 2)
        ):
            # vLLM keeps a second key on a state block with two or more lookahead tokens
            # (kvblocks' pool keeps one per block).
            return Reason.MAMBA_PREFIX_CACHING
    for group in groups:
        if group.host_resident or group.role != KVCacheGroupRole.DEFAULT:
            return Reason.KV_CACHE_GROUP_ROLE
        spec = group.kv_cache_spec
        kind = spec_kind(spec, group.role)
        if kind is None or not spec.prefix_cacheable or spec.prefix_replay_tokens:
            return Reason.KV_CACHE_SPEC
        if not caching:
            # vLLM's coordinator asserts that every group's block size divides the
            # scheduler's (the hashes are then unused).
            if scheduler_block_size % spec.block_size or scheduler_block_size % hash_block_size:
                return Reason.VLLM_REJECTS
        elif not spec.block_size == hash_block_size == scheduler_block_size:
            return Reason.HASH_BLOCK_SIZE
    if kwargs.get("dcp_world_size", 1) != 1 or kwargs.get("pcp_world_size", 1) != 1:
        return Reason.CONTEXT_PARALLEL
    if kwargs.get("metrics_collector") is not None:
        return Reason.METRICS_COLLECTOR
    if _vllm_rejects_retention(config, scheduler_block_size):
        return Reason.VLLM_REJECTS
    if config.hisparse_host_num_blocks is not None:
        return Reason.KV_CACHE_GROUP_ROLE
    eagle_groups = any(g.is_eagle_group for g in groups) or use_eagle
    if caching and eagle_groups and scheduler_block_size < kwargs.get("num_prefill_lookahead", 0):
        return Reason.VLLM_REJECTS
    if use_eagle and any(spec_kind(g.kv_cache_spec, g.role) == "chunked_local" for g in groups):
        # vLLM's chunked-local hit search refuses the EAGLE drop (it asserts).
        return Reason.KV_CACHE_SPEC
    if kwargs.get("watermark", 0.0) < 0.0:
        return Reason.VLLM_REJECTS
    if (
        caching
        and kwargs.get("num_hash_lookahead_tokens", 0) >= 2
        and not any(spec_kind(g.kv_cache_spec, g.role) == "full" for g in groups)
    ):
        # A request then has fewer block hashes than full blocks, and vLLM's sliding-window
        # and chunked-local hit searches index past them (IndexError); kvblocks' would stop
        # at the last hash. With a full-attention group, its hit bounds the others' first.
        return Reason.LOOKAHEAD_WITHOUT_FULL
    return None


def _vllm_rejects_retention(config: Any, scheduler_block_size: int) -> bool:
    """Whether vLLM's coordinator refuses the config's prefix-cache retention interval (one
    set without a sliding-window or Mamba group, a negative one, or one that is not a
    multiple of the scheduler's block size): vLLM's own check decides."""
    from vllm.v1.core.kv_cache_coordinator import _validate_prefix_cache_retention_interval

    try:
        _validate_prefix_cache_retention_interval(
            config.prefix_cache_retention_interval, scheduler_block_size, config
        )
    except ValueError:
        return True
    return False


def unsupported_config(
    vllm_config: Any, *, allowed_scheduler_cls: tuple[Any, ...] = ()
) -> Reason | None:
    """What the engine's ``VllmConfig`` shows (the manager's arguments do not carry it)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and not _is_served_connector(transfer):
        return Reason.KV_CONNECTOR
    cache = vllm_config.cache_config
    if vllm_config.ec_transfer_config is not None:
        return Reason.EC_CONNECTOR
    if vllm_config.aux_output_config.enabled:
        return Reason.AUX_OUTPUT
    speculative = vllm_config.speculative_config
    if speculative is not None and (
        getattr(speculative, "method", None) not in SPECULATIVE_METHODS
        # vLLM 0.34's registered speculators report the built-in method they are based on and
        # keep their own name in custom_method: their scheduler side is theirs, not the base's.
        or getattr(speculative, "custom_method", None) is not None
    ):
        return Reason.SPECULATIVE
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        return Reason.CONTEXT_PARALLEL
    if vllm_config.observability_config.kv_cache_metrics:
        return Reason.METRICS_COLLECTOR
    if cache.enable_prefix_caching and cache.prefix_caching_hash_algo not in ALGORITHMS:
        return Reason.HASH_ALGO
    if cache.prefix_match_unit not in (None, cache.block_size):
        return Reason.HASH_BLOCK_SIZE
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return Reason.KV_CACHE_GROUP_ROLE
    model = vllm_config.model_config
    if model is not None and model.is_encoder_decoder:
        return Reason.ENCODER_DECODER
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls is not None and not _is_allowed(scheduler_cls, allowed_scheduler_cls):
        return Reason.SCHEDULER_CLS
    return None


#: The KV connectors whose scheduler side kvblocks' manager serves, by vLLM's registry name:
#: vLLM's native CPU offloading (``--kv-offloading-size``), NIXL's pull and push connectors
#: and Mooncake's (disaggregated prefill) and the DecodeBenchConnector (decode benchmarks:
#: dummy KV for every prompt), which read of the manager only what kvblocks gives as vLLM does
#: (block ids, whether each block of a request's table is registered, deferred frees). Not
#: vLLM's ExampleConnector, although it reads nothing of the manager: it reports a negative
#: number of external tokens when a request's local hit is longer than the prompt prefix it
#: checks, which vLLM's manager takes as it is (the request recomputes those tokens) and
#: kvblocks' refuses.
CONNECTORS = frozenset(
    {
        "OffloadingConnector",
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "DecodeBenchConnector",
        "MooncakeConnector",
    }
)


#: vLLM's connector that runs several connectors side by side (``kv_connector_extra_config``
#: ``{"connectors": [...]}``, each a ``KVTransferConfig`` as a dict): it reads nothing of the
#: manager itself, and hands its children what the scheduler hands it.
MULTI_CONNECTOR = "MultiConnector"


def _field(transfer: Any, name: str) -> Any:
    """A ``kv_transfer_config`` field, of the config object or of a child's dict."""
    return transfer.get(name) if isinstance(transfer, dict) else getattr(transfer, name, None)


def _children(transfer: Any) -> list[Any] | None:
    """A MultiConnector's child configs (dicts), or None where they are not a list."""
    extra = _field(transfer, "kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, dict) else None
    return children if isinstance(children, list) else None


def connector_name(transfer: Any) -> str | None:
    """The KV connector a ``kv_transfer_config`` names (with its module path when it has one;
    a MultiConnector with its children's), for the line that says why kvblocks steps aside;
    ``None`` without one."""
    if transfer is None:
        return None
    name = _field(transfer, "kv_connector") or type(transfer).__name__
    path = _field(transfer, "kv_connector_module_path")
    named = f"{name} from {path}" if path else str(name)
    children = _children(transfer) if name == MULTI_CONNECTOR and not path else None
    if children:
        named += f" of {', '.join(str(connector_name(c)) for c in children)}"
    return named


def _is_served_connector(transfer: Any) -> bool:
    """One of :data:`CONNECTORS` (by name, from vLLM's registry, not a module path of the
    user's), or vLLM's MultiConnector of such connectors; HiSparse, whose connector reads
    vLLM's coordinator, is refused apart."""
    name = _field(transfer, "kv_connector")
    if _field(transfer, "kv_connector_module_path") is not None:
        return False
    if name == MULTI_CONNECTOR:
        children = _children(transfer) or []
        return bool(children) and all(
            isinstance(c, dict) and _is_served_connector(c) for c in children
        )
    return name in CONNECTORS


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
#: manager kvblocks refuses: KV connectors other than :data:`CONNECTORS`
#: (``bind_kv_cache_manager``) and custom schedulers. (The OffloadingConnector's paths are
#: implemented: deferred frees, the async-load reservation, finished requests' blocks.)
UNREACHABLE: dict[str, tuple[str, ...]] = {
    # The scheduler's paths for other connectors: sub-block hits.
    "KVCacheManager.truncate_computed_blocks": ("kv_connector",),
    "KVCacheManager.create_kv_cache_blocks": ("kv_connector", "scheduler_cls"),
    # What connectors read of the blocks they are handed (and the scheduler, for a connector's
    # in-flight loads).
    "KVCacheBlocks.new_empty": ("kv_connector", "scheduler_cls"),
    "KVCacheBlocks.__add__": ("kv_connector", "scheduler_cls"),
    # The coordinator: HiSparse.
    "coordinator.num_reprefillable_tokens": ("kv_connector",),
    "coordinator.find_longest_cache_hit_per_group": ("kv_connector",),
    # A group's block pool: the UMBP connector and the auxiliary-output connector.
    "single_type_manager.block_pool": ("kv_connector", "aux_output"),
}
