"""An investigation aid for expected_failures.txt, not part of the tier's verdict.

Most listed tests fail with kvblocks only because they read vLLM's manager internals
(``block_pool``, ``num_cached_block``) or attach vLLM components that do. Loaded with
``-p probe_internals`` (``run.py --probe``), this plugin lets those tests run on kvblocks'
manager to see whether their *decisions* agree:

- kvblocks' manager gets read-only stand-ins computed from kvblocks' own pool:
  ``block_pool.get_num_free_blocks()``, ``block_pool.free_block_queue.num_free_blocks``,
  ``block_pool.num_gpu_blocks``, and ``len()`` of ``num_cached_block`` (the number of
  requests holding blocks; ``req_to_blocks`` is kvblocks' own read-only view).
  ``block_pool.blocks`` is empty: ref counts are not exposed, and "every block free" is
  already the free-block count;
- ``test_scheduler_reset_prefix_cache`` gets a stub aux-output connector (vLLM's reads the
  block pool) that caps nothing and records nothing.

A listed test that passes under the probe reads internals only; one that still fails needs a
closer look (it may be a real difference, or a vLLM path kvblocks never reaches).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest


class _PoolView:
    """Read-only answers to what the tests ask vLLM's block pool, from kvblocks' pool."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def get_num_free_blocks(self) -> int:
        return int(self._core.num_free_blocks)

    @property
    def free_block_queue(self) -> SimpleNamespace:
        return SimpleNamespace(num_free_blocks=self._core.num_free_blocks)

    @property
    def num_gpu_blocks(self) -> int:
        return int(self._core.num_blocks)

    @property
    def blocks(self) -> list[Any]:
        return []


class _RequestCount:
    """``len()`` = the number of requests holding blocks in kvblocks' manager."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def __len__(self) -> int:
        return len(self._core)


class _AuxOutputStub:
    """In place of vLLM's AuxOutputSchedulerConnector: every call answers None (no cap)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    from vllm.v1.core.sched import scheduler as scheduler_module

    from kvblocks.vllm.kv_cache_manager import KVCacheManager

    init = scheduler_module.Scheduler.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        manager = self.kv_cache_manager
        if isinstance(manager, KVCacheManager):
            setattr(manager, "block_pool", _PoolView(manager._core))  # noqa: B010
            group = manager.coordinator.single_type_managers[0]
            setattr(group, "num_cached_block", _RequestCount(manager._core))  # noqa: B010

    scheduler_module.Scheduler.__init__ = __init__


#: test name -> (module attribute, stand-in), set for that test only
_STAND_INS = {
    "test_scheduler_reset_prefix_cache": ("AuxOutputSchedulerConnector", _AuxOutputStub),
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    module = getattr(item, "module", None)
    name = getattr(item, "originalname", item.name)
    if module is None or name not in _STAND_INS:
        yield
        return
    attribute, stand_in = _STAND_INS[name]
    original = getattr(module, attribute)
    setattr(module, attribute, stand_in)
    try:
        yield
    finally:
        setattr(module, attribute, original)
