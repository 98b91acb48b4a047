"""Which vLLM source each kvblocks part reproduces: what the fingerprints cover.

A part is exact only while these sources are the ones it was ported from. Granularity:
a whole file where kvblocks ports the file wholesale (an edit anywhere in it may change a
rule kvblocks reproduces); named objects where a large file holds much that kvblocks does
not port (unrelated edits there are common and must not turn kvblocks off); and, for vLLM's
scheduler, the statements that name the manager (kvblocks must answer every call the
scheduler makes, with the arguments it passes, but the scheduler's own decisions around those
calls are vLLM's code in both cases). What a part only calls, as vLLM's own manager would
call it (``generate_block_hash_extra_keys`` for events, ``get_kv_cache_spec_kind``), is not
covered: a change there reaches both sides alike.

A source may belong to some releases only (``releases``): a file or an object a later vLLM
added, which kvblocks reproduces there. The sources of one part in one release are those that
apply to it, one per file (:func:`sources`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Source:
    """One source file of the vllm package, and what of it a part depends on."""

    #: Relative to the directory holding the ``vllm`` package, e.g. ``vllm/v1/request.py``.
    path: str
    #: Objects (``"name"`` or ``"Class.name"``); empty with no ``mentions``: the whole file.
    objects: tuple[str, ...] = ()
    #: Words: the statements of each function or method that name one of them.
    mentions: tuple[str, ...] = ()
    #: The releases (``"0.34"``: major.minor) whose sources hold this; empty: every release.
    releases: tuple[str, ...] = ()

    def applies(self, version: str) -> bool:
        return not self.releases or release(version) in self.releases

    @property
    def whole_file(self) -> bool:
        return not self.objects and not self.mentions


_KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
_REQUEST = "vllm/v1/request.py"

#: part -> the sources it reproduces. The parts are those of ``kvblocks.vllm.status()``.
PORTED: dict[str, tuple[Source, ...]] = {
    "hasher": (
        # The four hash functions, whose serialization kvblocks' Rust encoders reproduce
        # byte for byte; a small file.
        Source("vllm/utils/hashing.py"),
        # The chained block hash, NONE_HASH and its seed, the extra keys (with EAGLE/MTP
        # lookahead too): the hashing half of a file whose other half is the block pool's
        # data structures.
        Source(
            _KV_CACHE_UTILS,
            objects=(
                "NONE_HASH",
                "DEFAULT_NONE_HASH_SEED",
                "_NON_CRYPTO_HASH_FUNCTIONS",
                "_NONE_HASH_SEED",
                "resolve_none_hash_seed",
                "get_none_hash_seed",
                "init_none_hash",
                "hash_block_tokens",
                "get_request_block_hasher",
                "generate_block_hash_extra_keys",
                "generate_lookahead_block_hash_extra_keys",
                "_gen_mm_extra_hash_keys",
                "_gen_lora_extra_hash_keys",
                "_gen_prompt_embeds_extra_hash_keys",
            ),
        ),
        # Where vLLM resumes the multimodal scan of a partly hashed request.
        Source("vllm/multimodal/utils.py", objects=("get_mm_features_in_window",)),
        # What the hasher reads of a request and when vLLM calls it: the token list behind
        # ``all_token_ids``, ``num_tokens``, and ``block_hashes`` extended by its result.
        Source(
            _REQUEST,
            objects=(
                "Request.__init__",
                "Request.append_output_token_ids",
                "Request.update_block_hashes",
                "Request.num_tokens",
            ),
        ),
        # How EngineCore seeds NONE_HASH and builds the hasher.
        Source("vllm/v1/engine/core.py", mentions=("get_request_block_hasher", "init_none_hash")),
        # vLLM 0.34: the request's tokens are an int32 TokenBuffer, which kvblocks reads in
        # place through the buffer protocol (the stock hasher slices it with token_slice).
        Source("vllm/v1/token_buffer.py", releases=("0.34",)),
        # vLLM 0.34: a frontend may send the prompt's block hashes (EngineCoreRequest.
        # block_hashes, computed with the engine's PrefixHashConfig); EngineCore keeps them
        # when their count matches, the request starts with them, and the hasher continues
        # from the first block they do not cover.
        Source(_KV_CACHE_UTILS, objects=("frontend_block_hashes",), releases=("0.34",)),
        Source(_REQUEST, objects=("Request.from_engine_core_request",), releases=("0.34",)),
        Source(
            "vllm/v1/engine/core.py",
            mentions=("frontend_block_hashes", "prefix_hash_config"),
            releases=("0.34",),
        ),
        Source("vllm/v1/engine/__init__.py", objects=("PrefixHashConfig",), releases=("0.34",)),
    ),
    "kv_cache_manager": (
        # kvblocks' manager replaces this file's KVCacheManager (and its KVCacheBlocks)
        # wholesale, borrowing four of its methods.
        Source("vllm/v1/core/kv_cache_manager.py"),
        # The pool's rules (free queue order, lazy eviction, the hash map, events), ported
        # wholesale to Rust.
        Source("vllm/v1/core/block_pool.py"),
        # The coordinators (unitary, hybrid, no prefix cache) and the replay boundaries:
        # ported wholesale.
        Source("vllm/v1/core/kv_cache_coordinator.py"),
        # The managers of the kinds kvblocks implements, of a file with a dozen managers.
        Source(
            "vllm/v1/core/single_type_kv_cache_manager.py",
            objects=(
                "SingleTypeKVCacheManager",
                "FullAttentionManager",
                "SlidingWindowManager",
                "ChunkedLocalAttentionManager",
                "MambaManager",
                "get_manager_for_kv_cache_spec",
                "register_all_kvcache_specs",
            ),
        ),
        # Which manager vLLM gives a spec (the guard asks it).
        Source("vllm/v1/kv_cache_spec_registry.py"),
        # The block, the free queue and the block-hash helpers.
        Source(
            _KV_CACHE_UTILS,
            objects=(
                "BlockHash",
                "BlockHashWithGroupId",
                "make_block_hash_with_group_id",
                "get_block_hash",
                "get_group_id",
                "maybe_convert_block_hash",
                "KVCacheBlock",
                "null_head_len",
                "trim_null_head",
                "FreeKVCacheBlockQueue",
                "resolve_block_hashes",
                "BlockHashListWithBlockSize",
                "eagle_proof_margin",
                "partial_hash_hits_enabled",
            ),
        ),
        # The events kvblocks builds, field by field.
        Source(
            "vllm/distributed/kv_events.py",
            objects=(
                "KVCacheEvent",
                "MEDIUM_GPU",
                "BlockStored",
                "BlockRemoved",
                "AllBlocksCleared",
            ),
        ),
        # The statistics kvblocks records.
        Source("vllm/v1/metrics/stats.py", objects=("BaseCacheStats", "PrefixCacheStats")),
        # The configuration the guard reads (a new field there may be a rule it ignores), and
        # the Mamba checkpoint rules the engine ports.
        Source(
            "vllm/v1/kv_cache_interface.py",
            objects=(
                "get_mamba_prefill_checkpoint_position",
                "is_mamba_prefill_checkpoint_valid",
                "KVCacheSpec",
                "AttentionSpec",
                "FullAttentionSpec",
                "MLAAttentionSpec",
                "SlidingWindowSpec",
                "SlidingWindowMLASpec",
                "ChunkedLocalAttentionSpec",
                "MambaSpec",
                "KVCacheGroupRole",
                "KVCacheGroupSpec",
                "KVCacheConfig",
            ),
        ),
        # Every call the scheduler makes into its manager, and how it builds it.
        Source("vllm/v1/core/sched/scheduler.py", mentions=("kv_cache_manager", "KVCacheManager")),
        Source("vllm/v1/core/sched/async_scheduler.py"),
        # What EngineCore reads of the manager.
        Source(
            "vllm/v1/engine/core.py",
            objects=(
                "EngineCore._initialize_effective_attention_block_size",
                "EngineCore.get_kv_cache_group_metadata",
            ),
        ),
        # The request fields the manager reads, and the statuses it admits.
        Source(_REQUEST, objects=("Request.__init__", "Request.num_tokens", "RequestStatus")),
        # The prefix-cache hit limit both lookups take: vLLM 0.33's skip_reading_prefix_cache
        # (set in Request.__init__), 0.34's methods of the request, which kvblocks' manager
        # calls, and the hashes NIXL and Mooncake truncate with a prefill's tokens.
        Source(_REQUEST, objects=("Request.get_skip_reading_prefix_cache",), releases=("0.33",)),
        Source(
            _REQUEST,
            objects=(
                "Request.get_prefix_cache_hit_limit",
                "Request.get_max_cache_hit_length",
                "Request.skip_reading_external_kv",
                "Request.truncate_block_hashes",
            ),
            releases=("0.34",),
        ),
        # vLLM 0.34: the int32 TokenBuffer that the manager's view of a request reads in place.
        Source("vllm/v1/token_buffer.py", releases=("0.34",)),
        # When vLLM hashes blocks with lookahead (the manager's num_hash_lookahead_tokens, whose
        # range the guard checks): 0.33 with prefix caching and no connector; 0.34 also with
        # the connectors that declare it, resolved once.
        Source(
            "vllm/config/vllm.py",
            objects=("VllmConfig.num_hash_lookahead_tokens",),
            releases=("0.33",),
        ),
        Source(
            "vllm/config/vllm.py",
            objects=("VllmConfig._resolve_num_hash_lookahead_tokens",),
            releases=("0.34",),
        ),
        # The KV connectors kvblocks' manager serves, the OffloadingConnector and NIXL's pull
        # and push connectors: what they read of the manager (the block pool at binding, each
        # block of a request's table at admission, the unhashed blocks, the ids of finished
        # requests).
        Source("vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py"),
        Source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py"),
        Source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py"),
        Source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py"),
        # The MultiConnector, which hands its children what the scheduler hands it, and the
        # DecodeBenchConnector (each block of a request's table at admission).
        Source("vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"),
        Source("vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py"),
        # Mooncake's connector: its scheduler side (the unhashed blocks, finished requests' ids).
        Source(
            "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
            objects=(
                "MooncakeConnector",
                "MooncakeConnectorScheduler",
                "MooncakeConnectorMetadata",
            ),
        ),
        Source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py"),
        Source(
            "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
            objects=("OffloadingConnectorScheduler.update_state_after_alloc",),
        ),
        Source(
            "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
            objects=("KVConnectorBase_V1.bind_kv_cache_manager",),
        ),
    ),
}


def release(version: str) -> str:
    """A version's release, ``major.minor``: ``0.34.1+cu130`` -> ``0.34``."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def sources(part: str, version: str) -> tuple[Source, ...]:
    """The sources ``part`` reproduces in vLLM ``version``: those of :data:`PORTED` that apply
    to it, one per file (the objects and mentions of the entries of one file merged; a whole
    file stays whole)."""
    merged: dict[str, Source] = {}
    for source in PORTED[part]:
        if not source.applies(version):
            continue
        known = merged.get(source.path)
        if known is None:
            merged[source.path] = replace(source, releases=())
        elif not (known.whole_file or source.whole_file):
            merged[source.path] = replace(
                known,
                objects=tuple(dict.fromkeys(known.objects + source.objects)),
                mentions=tuple(dict.fromkeys(known.mentions + source.mentions)),
            )
        else:
            merged[source.path] = Source(source.path)
    return tuple(merged.values())
