"""Putting kvblocks' KV-cache manager under vLLM's scheduler.

vLLM 0.33's ``Scheduler.__init__`` builds its manager through the module global
``vllm.v1.core.sched.scheduler.KVCacheManager`` (``AsyncScheduler`` inherits that
``__init__``). kvblocks replaces that global by :func:`kv_cache_manager_factory`, which builds
kvblocks' manager only while a scheduler that asked for it is being constructed, and only
when :mod:`kvblocks.vllm.support` finds the configuration supported; in every other case it
builds vLLM's own manager, with one log line naming the reason. Two ways to ask:

- ``KVBLOCKS_VLLM=all`` (the plugin's default) wraps vLLM's ``Scheduler.__init__``, so every
  vLLM scheduler built in the process asks;
- ``--scheduler-cls kvblocks.vllm.Scheduler`` (or ``kvblocks.vllm.AsyncScheduler``) asks
  explicitly, whatever ``KVBLOCKS_VLLM`` says.

The factory never raises for a configuration or a vLLM release it does not support: vLLM's
start-up goes on with vLLM's manager. Importing this module takes nothing from vLLM but its
two scheduler classes (kvblocks' manager, which builds on more of vLLM, is imported only once
the installed vLLM is one kvblocks supports and its sources are the ones kvblocks was ported
from), so a vLLM release that moved something kvblocks uses cannot break vLLM's start-up here.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import kvblocks.vllm._state as _state
import kvblocks.vllm.fingerprints as fingerprints
import kvblocks.vllm.versions as versions
from kvblocks.vllm._state import Reason
from kvblocks.vllm.support import Unsupported, connector_name, unsupported_config

if TYPE_CHECKING:
    from kvblocks.vllm.kv_cache_manager import KVCacheManager

try:
    from vllm.v1.core.sched import async_scheduler as _async_scheduler_module
    from vllm.v1.core.sched import scheduler as _scheduler_module
except ImportError as _error:  # a vLLM without vLLM 0.33's scheduler modules
    _NO_VLLM_SCHEDULER: str | None = _state.error_detail(_error)
else:
    _NO_VLLM_SCHEDULER = None

#: The part of kvblocks this module installs (the name ``status()`` reports it under).
_PART = "kv_cache_manager"
_building = threading.local()


@contextmanager
def _asking(vllm_config: Any) -> Iterator[None]:
    """Marks the scheduler this thread is constructing as asking for kvblocks' manager."""
    outer = getattr(_building, "vllm_config", None)
    _building.vllm_config = vllm_config
    try:
        yield
    finally:
        _building.vllm_config = outer


def _vllm_manager_class() -> Any:
    return _state.original_or_current(_scheduler_module, "KVCacheManager")


def kv_cache_manager_factory(**kwargs: Any) -> Any:
    """Stands where vLLM's scheduler module names ``KVCacheManager``."""
    vllm_config = getattr(_building, "vllm_config", None)
    if vllm_config is None:
        return _vllm_manager_class()(**kwargs)
    version = versions.installed_vllm_version()
    not_supported = versions.unsupported_vllm(version)
    if not_supported is not None:  # a vLLM release kvblocks does not support
        versions.version_fallback(_PART, version or "unknown")
        _state.log_once(_state.VERSION_LOG_KEY, logging.WARNING, _state.UNCHANGED, not_supported)
        return _vllm_manager_class()(**kwargs)
    stale = fingerprints.check().get(_PART)
    if stale is not None:  # not the vLLM sources kvblocks' manager was ported from
        _state.fall_back(_PART, *stale)
        return _vllm_manager_class()(**kwargs)
    detail = None
    try:
        reason = unsupported_config(vllm_config, allowed_scheduler_cls=(Scheduler, AsyncScheduler))
        if reason is Reason.KV_CONNECTOR:
            detail = connector_name(vllm_config.kv_transfer_config)
    except Exception as error:  # an unexpected config shape: never break vLLM's start-up
        reason, detail = Reason.GUARD_ERROR, _state.error_detail(error)
    if reason is None:
        try:  # the manager checks its own arguments
            from kvblocks.vllm.kv_cache_manager import KVCacheManager

            manager = KVCacheManager(**kwargs)
            if vllm_config.kv_transfer_config is not None:  # an allowed connector
                manager.serve_kv_connector()
        except Unsupported as refusal:
            reason, detail = refusal.reason, refusal.detail
        except Exception as error:  # a bug of ours must not stop vLLM: use vLLM's manager
            reason, detail = Reason.GUARD_ERROR, _state.error_detail(error)
    if reason is not None:
        _state.fall_back(_PART, reason, detail)
        return _vllm_manager_class()(**kwargs)
    _state.activate(_PART, _describe(manager, vllm_config))
    return manager


def _describe(manager: KVCacheManager, vllm_config: Any) -> str:
    """e.g. ``2 groups (full, sliding_window), 16-token blocks, prefix caching on``; each
    group's block size where they differ (``4/512-token blocks``)."""
    kinds = [kind for kind, _ in manager.kv_cache_event_metadata]
    groups = f"{len(kinds)} groups ({', '.join(kinds)}), " if len(kinds) > 1 else ""
    sizes = [str(m.block_size) for m in manager.coordinator.single_type_managers]
    size = sizes[0] if len(set(sizes)) == 1 else "/".join(sizes)
    caching = "prefix caching on" if manager.enable_caching else "prefix caching off"
    eagle = ", EAGLE block drop" if manager.use_eagle else ""
    transfer = vllm_config.kv_transfer_config
    connector = f", {connector_name(transfer)}" if transfer is not None else ""
    return f"{groups}{size}-token blocks, {caching}{eagle}{connector}"


def _contain_errors(scheduler: Any) -> None:
    """A scheduler on kvblocks' manager finishes a request whose allocation fails kvblocks'
    check with an error instead of stopping (``KVCacheManager.contain_errors_in``)."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    contain = getattr(manager, "contain_errors_in", None)
    if contain is not None and type(manager).__module__ == "kvblocks.vllm.kv_cache_manager":
        try:
            contain(scheduler)
        except Exception as error:  # never break vLLM's start-up
            _state.fall_back(_PART, Reason.GUARD_ERROR, _state.error_detail(error))


def _asking_init(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        with _asking(vllm_config):
            init(self, vllm_config, *args, **kwargs)
        _contain_errors(self)

    __init__.__kvblocks_wrapped__ = True  # type: ignore[attr-defined]
    return __init__


def install_factory() -> None:
    """Puts the factory where vLLM's scheduler module names its manager (harmless alone:
    the factory builds vLLM's manager unless a scheduler asks)."""
    if _NO_VLLM_SCHEDULER is not None or not hasattr(_scheduler_module, "KVCacheManager"):
        return  # nowhere to put it: vLLM's scheduler is not vLLM 0.33's (it says so if built)
    if _scheduler_module.KVCacheManager is not kv_cache_manager_factory:
        _state.patch(_scheduler_module, "KVCacheManager", kv_cache_manager_factory, _PART)


def install() -> None:
    """``KVBLOCKS_VLLM=all``: every vLLM scheduler built from now on asks."""
    install_factory()
    vllm_scheduler = _scheduler_module.Scheduler
    if not getattr(vllm_scheduler.__init__, "__kvblocks_wrapped__", False):
        _state.patch(vllm_scheduler, "__init__", _asking_init(vllm_scheduler.__init__), _PART)


def _vllm_scheduler_class(name: str) -> Any:
    """vLLM's ``Scheduler`` or ``AsyncScheduler``: the base of kvblocks' class of that name.
    A vLLM without it gets a base that says so when built (``--scheduler-cls`` names a class
    that cannot exist there), instead of an import error."""
    missing = _NO_VLLM_SCHEDULER
    if missing is None:
        module = _scheduler_module if name == "Scheduler" else _async_scheduler_module
        found = getattr(module, name, None)
        if isinstance(found, type):
            return found
        missing = f"{module.__name__} has no class {name}"

    class Missing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                f"kvblocks.vllm.{name} stands in for vLLM's {name}, which this vLLM does not "
                f"have where vLLM 0.33 has it ({missing}); drop --scheduler-cls "
                f"(the plugin, {_state.ENV_VAR}=all, needs no scheduler class)"
            )

    return Missing


class Scheduler(_vllm_scheduler_class("Scheduler")):  # type: ignore[misc]
    """vLLM's ``Scheduler`` on kvblocks' KV-cache manager wherever it is exact
    (``--scheduler-cls kvblocks.vllm.Scheduler``)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        install_factory()
        with _asking(vllm_config):
            super().__init__(vllm_config, *args, **kwargs)
        _contain_errors(self)


class AsyncScheduler(_vllm_scheduler_class("AsyncScheduler")):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` on kvblocks' KV-cache manager wherever it is exact
    (``--scheduler-cls kvblocks.vllm.AsyncScheduler``)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        install_factory()
        with _asking(vllm_config):
            super().__init__(vllm_config, *args, **kwargs)
        _contain_errors(self)
