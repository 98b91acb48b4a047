"""What kvblocks changed in this process's vLLM: the originals it replaced, which parts are
active, and why any part fell back. Shared by the plugin and the parts; imports no vLLM."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from enum import StrEnum
from typing import Any

#: The environment variable the plugin entry point (``kvblocks.vllm.register``) reads.
ENV_VAR = "KVBLOCKS_VLLM"

_lock = threading.Lock()
#: (id(target), attribute) -> (target, the vLLM object kvblocks replaced there, the part that
#: replaced it).
_patched: dict[tuple[int, str], tuple[Any, Any, str]] = {}
mode = "off"
#: Whether vLLM has loaded the plugin (``register``) or ``install``/``uninstall`` ran in this
#: process: until then ``mode`` is "off" only because nothing happened yet.
loaded = False
#: Whether ``install``/``uninstall`` was called explicitly (a notebook, a test, a benchmark):
#: then the plugin entry point (``register``) leaves the mode it chose alone.
explicit = False
#: part -> what it runs on ("sha256_cbor", ...), for the parts that are active.
active: dict[str, str] = {}
#: (part, reason) -> how often that part fell back to vLLM's code for that reason.
fallbacks: Counter[tuple[str, str]] = Counter()
#: (part, reason) -> what the reason's text leaves out (e.g. which vLLM files changed).
details: dict[tuple[str, str], str] = {}
#: defect -> how often kvblocks saw vLLM's own rules do something a worker cannot run
#: soundly, which kvblocks keeps as vLLM has it (its outputs stay identical to stock vLLM's);
#: the texts are :data:`DEFECTS`.
vllm_defects: Counter[str] = Counter()
#: How many requests kvblocks finished with an error because its own check found their
#: allocation unsound (the engine went on; see :func:`note_contained`).
contained_errors = 0
#: What was logged once already: (part, reason) of a fallback, or a :func:`log_once` key.
_logged: set[tuple[str, str] | str] = set()


class Reason(StrEnum):
    """Why a part (or one request) goes to vLLM's own code. The value is the short name
    ``status()`` counts; :attr:`text` says it in words."""

    # the request block hasher (see kvblocks.vllm.block_hasher)
    HASH_FN = "hash_fn"
    NONE_HASH = "none_hash"
    PROMPT_EMBEDS = "prompt_embeds"
    MM_LAYOUT = "mm_layout"
    PICKLE_IDENTITY = "pickle_identity"
    BAD_FIELD = "bad_field"
    # the KV-cache manager (see kvblocks.vllm.support)
    KV_CACHE_GROUPS = "kv_cache_groups"
    KV_CACHE_SPEC = "kv_cache_spec"
    KV_CACHE_GROUP_ROLE = "kv_cache_group_role"
    HASH_BLOCK_SIZE = "hash_block_size"
    KV_CONNECTOR = "kv_connector"
    EC_CONNECTOR = "ec_connector"
    AUX_OUTPUT = "aux_output"
    SPECULATIVE = "speculative"
    CONTEXT_PARALLEL = "context_parallel"
    METRICS_COLLECTOR = "metrics_collector"
    MAMBA_PREFIX_CACHING = "mamba_prefix_caching"
    HASH_ALGO = "hash_algo"
    SCHEDULER_CLS = "scheduler_cls"
    ENCODER_DECODER = "encoder_decoder"
    MANAGER_ARGUMENT = "manager_argument"
    LOOKAHEAD_WITHOUT_FULL = "lookahead_without_full"
    VLLM_REJECTS = "vllm_rejects"
    GUARD_ERROR = "guard_error"
    # either part (see kvblocks.vllm.fingerprints and kvblocks.vllm.versions)
    VLLM_VERSION = "vllm_version"
    VLLM_SOURCES = "vllm_sources"
    VLLM_UNKNOWN = "vllm_unknown"
    NOT_PORTED = "not_ported"

    @property
    def text(self) -> str:
        return _TEXTS[self]


_TEXTS = {
    Reason.HASH_FN: "a prefix-caching hash function kvblocks does not implement",
    Reason.NONE_HASH: "kvblocks' NONE_HASH differs from vllm's kv_cache_utils.NONE_HASH",
    Reason.PROMPT_EMBEDS: "a request with prompt_embeds",
    Reason.MM_LAYOUT: "multimodal items whose ends are not sorted (an item ends before the "
    "one listed before it)",
    Reason.PICKLE_IDENTITY: "pickle-based hash with extra-key strings shared by identity",
    Reason.BAD_FIELD: "a request field or argument kvblocks cannot read (type or range)",
    Reason.KV_CACHE_GROUPS: "no KV-cache group (an attention-free model)",
    Reason.KV_CACHE_SPEC: "a KV-cache spec kvblocks does not implement (cross-attention, sink, "
    "R-SWA, circular buffer, bounded-replay sliding window, hidden-state cache, ...)",
    Reason.KV_CACHE_GROUP_ROLE: "a special KV-cache group (host-resident, HiSparse)",
    Reason.HASH_BLOCK_SIZE: "KV-cache groups whose block sizes differ from the hash block size "
    "(prefix_match_unit, mixed page sizes, DCP)",
    Reason.KV_CONNECTOR: "a KV connector other than vLLM's native CPU offloading "
    "(OffloadingConnector), NIXL's (pull and push), Mooncake's and the DecodeBenchConnector, "
    "alone or in a MultiConnector: LMCache, P2P, MoRIIO, ... (kv_transfer_config)",
    Reason.EC_CONNECTOR: "an encoder-cache connector (ec_transfer_config)",
    Reason.AUX_OUTPUT: "auxiliary outputs (routed experts) that read the block pool",
    Reason.SPECULATIVE: "a speculative-decoding method kvblocks does not implement "
    "(it implements n-gram on the CPU and the GPU, suffix, EAGLE, EAGLE-3, MTP, a separate "
    "draft model, DFlash and DSpark; not extract_hidden_states or a custom class)",
    Reason.CONTEXT_PARALLEL: "decode or prefill context parallelism",
    Reason.METRICS_COLLECTOR: "the KV-cache metrics collector (--kv-cache-metrics)",
    Reason.MAMBA_PREFIX_CACHING: "prefix caching with Mamba or linear-attention groups together "
    "with lookahead hashing of two or more tokens, or a mamba_cache_mode "
    'other than vLLM\'s ("align" with prefix caching, "none" without)',
    Reason.HASH_ALGO: "a prefix-caching hash algorithm other than vLLM's four",
    Reason.SCHEDULER_CLS: "a custom scheduler class",
    Reason.ENCODER_DECODER: "an encoder-decoder model",
    Reason.MANAGER_ARGUMENT: "a KVCacheManager argument kvblocks does not know",
    Reason.LOOKAHEAD_WITHOUT_FULL: "lookahead hashing of two or more tokens without a "
    "full-attention group (vLLM's sliding-window and chunked-local hit searches then index "
    "past the request's block hashes and raise)",
    Reason.VLLM_REJECTS: "a configuration vLLM's own manager rejects (vLLM raises its error)",
    Reason.GUARD_ERROR: "an unexpected error in kvblocks' own code or in reading the configuration",
    Reason.VLLM_VERSION: "a vLLM release this version of kvblocks does not support",
    Reason.VLLM_SOURCES: "the vLLM sources it reproduces differ from the release it was ported "
    "from",
    Reason.VLLM_UNKNOWN: "no usable fingerprints of this vLLM release's sources",
    Reason.NOT_PORTED: "kvblocks supports this vLLM release, but this part is not ported to it yet",
}

#: Short name -> text, for every :class:`Reason`.
REASONS = {reason.value: reason.text for reason in Reason}


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


def patch(target: Any, name: str, replacement: Any, part: str) -> None:
    """Sets ``target.name`` (a module global or a class attribute) to ``replacement`` for
    ``part``, remembering vLLM's own object."""
    with _lock:
        key = (id(target), name)
        if key not in _patched:
            _patched[key] = (target, getattr(target, name), part)
        setattr(target, name, replacement)


def restore(part: str) -> None:
    """Puts back what ``part`` replaced (a part that failed to install) and marks it inactive."""
    with _lock:
        for key, (target, original, owner) in list(_patched.items()):
            if owner == part:
                setattr(target, key[1], original)
                del _patched[key]
        active.pop(part, None)


def restore_all() -> None:
    """Puts back every object kvblocks replaced and forgets what was active."""
    with _lock:
        for (_, name), (target, original, _part) in _patched.items():
            setattr(target, name, original)
        _patched.clear()
        active.clear()


def activate(part: str, detail: str) -> None:
    if active.get(part) != detail:
        active[part] = detail
        logger().info("kvblocks: %s runs on kvblocks (%s)", part, detail)


def describe(part: str, reason: str) -> str:
    """The text of a reason, with the details of the part's last fallback for it."""
    text = REASONS.get(reason, reason)
    detail = details.get((part, reason))
    return f"{text} ({detail})" if detail else text


def error_detail(error: BaseException) -> str:
    """What went wrong, for a :attr:`Reason.GUARD_ERROR` fallback: ``"RuntimeError: ..."``."""
    return f"{type(error).__name__}: {error}"


def fall_back(part: str, reason: str, detail: str | None = None, *, quiet: bool = False) -> None:
    """Counts a fallback to vLLM's own code; the first one of each kind is logged (INFO; a
    WARNING for :attr:`Reason.GUARD_ERROR`, an error kvblocks did not expect), unless
    ``quiet`` (the caller logs one line for several parts)."""
    fallbacks[(part, reason)] += 1
    if detail:
        details[(part, reason)] = detail
    if quiet:
        _logged.add((part, reason))
    elif (part, reason) not in _logged:
        _logged.add((part, reason))
        level = logging.WARNING if reason == Reason.GUARD_ERROR else logging.INFO
        logger().log(
            level, "kvblocks: %s falls back to vLLM's own code: %s", part, describe(part, reason)
        )


#: The :func:`log_once` key of the line saying the installed vLLM is not supported (the
#: plugin and ``--scheduler-cls kvblocks.vllm.Scheduler`` say it once between them).
VERSION_LOG_KEY = "vllm_version"
#: The warning that says kvblocks stepped aside on this vLLM, with the reason.
UNCHANGED = "kvblocks: left vLLM unchanged: %s"


def log_once(key: str, level: int, message: str, *args: Any) -> None:
    """Logs ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    logger().log(level, message, *args)


#: The vLLM defects kvblocks reproduces, counts in ``status()`` and logs once (WARNING).
DEFECTS = {
    "mamba_null_state": (
        "vLLM's Mamba manager (prefix caching, mamba_cache_mode='align') kept a table whose "
        "running or draft state column holds the null block after rejected drafts, so the "
        "worker writes that request's state into the null block (vLLM 0.33 and 0.34 do the "
        "same; docs/vllm.md, 'The null block in a Mamba table')"
    ),
}


def note_vllm_defect(defect: str, count: int) -> None:
    """Counts ``count`` occurrences of a vLLM defect (:data:`DEFECTS`); the first is logged."""
    vllm_defects[defect] += count
    log_once(f"defect:{defect}", logging.WARNING, "kvblocks: %s", DEFECTS[defect])


def note_contained(request_id: str, message: str, context: str) -> None:
    """Counts a request kvblocks finished with an error for an unsound allocation; the first
    is logged at ERROR with what a report needs and how to turn kvblocks off."""
    global contained_errors
    contained_errors += 1
    log_once(
        "contained",
        logging.ERROR,
        "kvblocks: %s. Request %s is finished with an error (retryable) and the engine goes "
        "on; this is kvblocks' bug, not vLLM's: please report it with this line (%s). "
        "Further such requests are counted in kvblocks.vllm.status(), not logged. "
        "KVBLOCKS_VLLM=off (or hasher) runs vLLM's own KV-cache manager.",
        message,
        request_id,
        context,
    )
