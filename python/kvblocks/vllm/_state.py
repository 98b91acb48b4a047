"""What kvblocks changed in this process's vLLM: the originals it replaced, which parts are
active, and why any part fell back. Shared by the plugin and the parts; imports no vLLM."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

_lock = threading.Lock()
#: (id(target), attribute) -> (target, the vLLM object kvblocks replaced there).
_patched: dict[tuple[int, str], tuple[Any, Any]] = {}
mode = "off"
#: part -> what it runs on ("sha256_cbor", ...), for the parts that are active.
active: dict[str, str] = {}
#: (part, reason) -> how often that part fell back to vLLM's code for that reason.
fallbacks: Counter[tuple[str, str]] = Counter()
_logged: set[tuple[str, str]] = set()

#: Why a part (or one request) goes to vLLM's own code, by short name.
REASONS = {
    "hash_fn": "a prefix-caching hash function kvblocks does not implement",
    "none_hash": "kvblocks' NONE_HASH differs from vllm's kv_cache_utils.NONE_HASH",
    "prompt_embeds": "a request with prompt_embeds",
    "mm_layout": "multimodal items that overlap or are not sorted by position",
    "pickle_identity": "pickle-based hash with extra-key strings shared by identity",
    "bad_field": "a request field or argument kvblocks cannot read (type or range)",
    # the KV-cache manager (see kvblocks.vllm.support)
    "kv_cache_groups": "not exactly one KV-cache group (hybrid or attention-free model)",
    "kv_cache_spec": "a KV-cache spec other than plain full attention (sliding window, MLA, "
    "cross-attention, Mamba, ...)",
    "kv_cache_group_role": "a special KV-cache group (EAGLE, host-resident, HiSparse)",
    "hash_block_size": "hash_block_size differs from the block size (prefix_match_unit, DCP)",
    "kv_connector": "a KV connector (kv_transfer_config)",
    "ec_connector": "an encoder-cache connector (ec_transfer_config)",
    "aux_output": "auxiliary outputs (routed experts) that read the block pool",
    "speculative": "speculative decoding (EAGLE/MTP drafts, lookahead slots or hashing)",
    "context_parallel": "decode or prefill context parallelism",
    "metrics_collector": "the KV-cache metrics collector (--kv-cache-metrics)",
    "zeroing": "KV-cache zeroing (Mamba or mixed-precision KV cache)",
    "retention": "a prefix-cache retention interval",
    "hash_algo": "a prefix-caching hash algorithm other than vLLM's four",
    "scheduler_cls": "a custom scheduler class",
    "encoder_decoder": "an encoder-decoder model",
    "guard_error": "the configuration could not be read",
}


def logger() -> logging.Logger:
    """vLLM's logger (its format and handlers), under the name ``vllm.kvblocks``."""
    try:
        from vllm.logger import init_logger

        vllm_logger: logging.Logger = init_logger("vllm.kvblocks")
        return vllm_logger
    except Exception:  # vllm missing or broken: plain logging
        return logging.getLogger("vllm.kvblocks")


def original_or_current(target: Any, name: str) -> Any:
    """``target.name`` as vLLM defined it, whether or not kvblocks replaced it."""
    entry = _patched.get((id(target), name))
    return entry[1] if entry is not None else getattr(target, name)


def patch(target: Any, name: str, replacement: Any) -> None:
    """Sets ``target.name`` (a module global or a class attribute) to ``replacement``,
    remembering vLLM's own object."""
    with _lock:
        key = (id(target), name)
        if key not in _patched:
            _patched[key] = (target, getattr(target, name))
        setattr(target, name, replacement)


def restore_all() -> None:
    """Puts back every object kvblocks replaced and forgets what was active."""
    with _lock:
        for (_, name), (target, original) in _patched.items():
            setattr(target, name, original)
        _patched.clear()
        active.clear()


def activate(part: str, detail: str) -> None:
    if active.get(part) != detail:
        active[part] = detail
        logger().info("kvblocks: %s runs on kvblocks (%s)", part, detail)


def fall_back(part: str, reason: str) -> None:
    """Counts a fallback to vLLM's own code; the first one of each kind is logged."""
    fallbacks[(part, reason)] += 1
    if (part, reason) not in _logged:
        _logged.add((part, reason))
        logger().info(
            "kvblocks: %s falls back to vLLM's own code: %s", part, REASONS.get(reason, reason)
        )
