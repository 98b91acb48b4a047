"""kvblocks inside vLLM (0.33; on 0.34 the hasher so far): a vLLM general plugin.

Installed with ``pip install ".[vllm]"`` in a kvblocks checkout, vLLM loads it through the
entry point ``vllm.general_plugins`` (``kvblocks = "kvblocks.vllm:register"``) in every process
it starts.
It replaces vLLM's request block hasher by kvblocks' (byte-identical hashes, falling back to
vLLM's own per request wherever kvblocks would not be exact) and, for the configurations where
it is exact, the KV-cache manager under vLLM's scheduler by one on kvblocks' Rust block pool
(:mod:`kvblocks.vllm.scheduler`; vLLM keeps its own elsewhere, with one log line saying why).

Control: the environment variable ``KVBLOCKS_VLLM`` = ``all`` (the default: every part that
supports the configuration), ``hasher`` (only the block hasher) or ``off``; or, in a notebook
or a test, :func:`install` / :func:`uninstall`; or ``--scheduler-cls kvblocks.vllm.Scheduler``
(``AsyncScheduler``) for the manager explicitly. :func:`status` says what is active in this
process and why anything fell back. Each part runs only on the exact vLLM sources it was
ported from (:mod:`kvblocks.vllm.fingerprints`). Importing this module does not import vLLM.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import kvblocks.vllm._state as _state
import kvblocks.vllm.versions as versions
from kvblocks.vllm._state import ENV_VAR, Reason
from kvblocks.vllm.versions import (
    SUPPORTED_VLLM,
    unsupported_vllm,
    version_fallback,
)

__all__ = [
    "MODES",
    "SUPPORTED_VLLM",
    "AsyncScheduler",
    "KVCacheManager",
    "PromptBlockHasher",
    "Scheduler",
    "Status",
    "install",
    "register",
    "status",
    "uninstall",
    "unsupported_vllm",
]


def __getattr__(name: str) -> object:
    # These import vLLM: only when asked for (e.g. by --scheduler-cls kvblocks.vllm.Scheduler).
    if name in ("Scheduler", "AsyncScheduler"):
        import kvblocks.vllm.scheduler as scheduler

        return getattr(scheduler, name)
    if name == "PromptBlockHasher":
        from kvblocks.vllm.frontend import PromptBlockHasher

        return PromptBlockHasher
    if name == "KVCacheManager":
        from kvblocks.vllm.kv_cache_manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(f"module 'kvblocks.vllm' has no attribute {name!r}")


#: The values of ``KVBLOCKS_VLLM`` and of :func:`install`'s ``mode``.
MODES = ("all", "hasher", "off")


@dataclass(frozen=True)
class Status:
    """What kvblocks changed in this process's vLLM."""

    #: The mode installed (``"off"`` when nothing is).
    mode: str
    #: The installed vLLM version, or None when vLLM cannot be imported.
    vllm_version: str | None
    #: Active part -> what it runs on, e.g. ``{"hasher": "sha256_cbor", "kv_cache_manager":
    #: "16-token blocks, prefix caching on"}``.
    active: dict[str, str] = field(default_factory=dict)
    #: ``"part: reason" -> count`` of fallbacks to vLLM's own code.
    fallbacks: dict[str, int] = field(default_factory=dict)
    #: ``"defect" -> count`` of vLLM defects kvblocks saw and kept as vLLM has them (its
    #: outputs stay identical to stock vLLM's), e.g. ``mamba_null_state``.
    vllm_defects: dict[str, int] = field(default_factory=dict)
    #: Requests finished with an error because kvblocks' own check found their allocation
    #: unsound (kvblocks' bug; the engine went on: docs/vllm.md, "When kvblocks fails").
    contained_errors: int = 0
    #: Until vLLM loads the plugin in this process (an engine starting, or :func:`install`):
    #: the mode ``KVBLOCKS_VLLM`` will install then; None once loaded.
    pending_mode: str | None = None

    def __str__(self) -> str:
        vllm = f"vllm {self.vllm_version}" if self.vllm_version else "vLLM not installed"
        if self.pending_mode is not None:
            return (
                "kvblocks.vllm: not loaded yet: vLLM loads kvblocks when an engine starts; "
                f"{ENV_VAR}={self.pending_mode}, {vllm}"
            )
        parts = ", ".join(f"{k} on {v}" for k, v in self.active.items()) or "nothing active"
        text = f"kvblocks.vllm: mode={self.mode}, {vllm}: {parts}"
        for reason, count in self.fallbacks.items():
            text += f"\n  fallback x{count}: {reason}"
        for defect, count in self.vllm_defects.items():
            text += f"\n  vLLM defect kept x{count}: {defect}"
        if self.contained_errors:
            text += (
                f"\n  requests finished with an error by kvblocks' check (its bug): "
                f"{self.contained_errors}"
            )
        return text


def status() -> Status:
    """What is active in this process, and every reason a part fell back so far."""
    return Status(
        mode=_state.mode,
        vllm_version=versions.installed_vllm_version(),
        active=dict(_state.active),
        fallbacks={
            f"{part}: {_state.describe(part, reason)}": count
            for (part, reason), count in _state.fallbacks.items()
        },
        vllm_defects=dict(_state.vllm_defects),
        contained_errors=_state.contained_errors,
        pending_mode=None if _state.loaded else _configured_mode(),
    )


def _configured_mode() -> str:
    return os.environ.get(ENV_VAR, "all").strip().lower() or "all"


def install(mode: str = "all") -> Status:
    """Installs kvblocks' parts into this process's vLLM (``mode`` as ``KVBLOCKS_VLLM``).

    Replaces what a previous call installed. Raises ``ValueError`` for an unknown mode and
    ``ImportError`` when vLLM is missing or outside :data:`SUPPORTED_VLLM` (the message says
    what to do; :func:`status` then lists each part's ``vllm_version`` fallback). A part whose vLLM
    sources differ from those it was ported from (:mod:`kvblocks.vllm.fingerprints`) is not
    installed: it falls back, with one log line naming the files, and :func:`status` says so;
    so does a part whose installation fails (``guard_error``, with the error), the other
    parts staying installed.

    An explicit call (this, or :func:`uninstall`) wins over the plugin entry point: once it
    ran, :func:`register` (an engine starting in this process) leaves the mode it chose.
    """
    status_now = _install(mode)
    _state.explicit = True
    return status_now


def _install(mode: str) -> Status:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    _uninstall()
    if mode == "off":
        return status()
    parts = [("hasher", _install_hasher)]
    if mode == "all":
        parts.append(("kv_cache_manager", _install_manager))
    version = versions.installed_vllm_version()
    refusal = unsupported_vllm(version)
    if refusal is not None:
        if version is not None:  # a refusal by version is a fallback status() reports
            for part, _ in parts:
                version_fallback(part, version)
        raise ImportError(refusal)
    assert version is not None
    import kvblocks.vllm.fingerprints as fingerprints

    # A part whose vLLM sources are not the ones it was ported from leaves vLLM's code in place.
    stale = fingerprints.check(version)
    for part, install_part in parts:
        if part in stale:
            _state.fall_back(part, *stale[part])
            continue
        try:
            install_part()
        except Exception as error:  # one part failing leaves the others (and vLLM) working
            _state.restore(part)
            _state.fall_back(part, Reason.GUARD_ERROR, _state.error_detail(error))
    _state.mode = mode
    _state.logger().info("kvblocks: installed into vLLM %s (mode=%s)", version, mode)
    return status()


def _install_hasher() -> None:
    from vllm.v1.core import kv_cache_utils

    from kvblocks.vllm.block_hasher import get_request_block_hasher

    _state.patch(kv_cache_utils, "get_request_block_hasher", get_request_block_hasher, "hasher")
    # vllm.v1.engine.core imports the name itself; a later import of it picks up the patched
    # attribute of kv_cache_utils, an earlier one is patched here.
    engine_core = sys.modules.get("vllm.v1.engine.core")
    if engine_core is not None:
        _state.patch(engine_core, "get_request_block_hasher", get_request_block_hasher, "hasher")


def _install_manager() -> None:
    import kvblocks.vllm.scheduler as scheduler

    scheduler.install()


def uninstall() -> Status:
    """Puts vLLM's own objects back. Hashers already built stay as they are. Like
    :func:`install`, an explicit call wins over the plugin entry point (:func:`register`)."""
    _uninstall()
    _state.explicit = True
    return status()


def _uninstall() -> None:
    _state.restore_all()
    _state.mode = "off"
    _state.loaded = True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the mode ``KVBLOCKS_VLLM`` names.

    Cheap, idempotent, and silent when the mode is ``off``. It never raises: vLLM calls it
    during start-up, so any problem becomes one warning and vLLM runs unchanged. After an
    explicit :func:`install` or :func:`uninstall` in this process it changes nothing (one
    INFO line says so when ``KVBLOCKS_VLLM`` asks for another mode).
    """
    _state.loaded = True
    mode = _configured_mode()
    if mode == _state.mode:
        return
    if _state.explicit:
        _state.log_once(
            "register:explicit",
            logging.INFO,
            "kvblocks: %s=%s not applied: install()/uninstall() chose mode=%s in this process",
            ENV_VAR,
            mode,
            _state.mode,
        )
        return
    try:
        _install(mode)
    except Exception as error:  # never break vLLM's start-up
        _state.restore_all()
        _state.mode = "off"
        key = (
            _state.VERSION_LOG_KEY
            if unsupported_vllm(versions.installed_vllm_version())
            else repr(error)
        )
        _state.log_once(key, logging.WARNING, _state.UNCHANGED, error)
