"""The pytest plugin of the vLLM-suite tier (loaded with ``-p kvblocks_suite_plugin``).

vLLM loads kvblocks through ``load_general_plugins()`` in ``EngineCore``; a bare pytest run of
vLLM's unit tests never calls it. This plugin installs the mode ``KVBLOCKS_VLLM`` names before
any conftest or test module is imported (test modules bind ``get_request_block_hasher`` at
import), records every vLLM scheduler built during each test and which KV-cache manager it got,
and the request blocks kvblocks' hasher hashed itself (not handed to vLLM's), and writes one
JSON report at the end: each test's outcome, schedulers and hashed blocks, the vLLM it ran
on, and kvblocks' status.

TEST ONLY, where run.py asks for it (``KVBLOCKS_SUITE_CPU_TRITON=1``, vLLM 0.34): vLLM's CPU
platform is told Triton is there while it checks a ``VllmConfig``, and only then (see
:func:`tell_cpu_platform_triton_is_there`).
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

MODE_VAR = "KVBLOCKS_VLLM"
REPORT_VAR = "KVBLOCKS_SUITE_REPORT"
CPU_TRITON_VAR = "KVBLOCKS_SUITE_CPU_TRITON"

# nodeid -> {"outcome": ..., "kvblocks": n, "vllm": n, "hashed": n,
# "fallbacks": {"part: reason": n}}; "kvblocks" / "vllm": the schedulers built during the test
# on each KV-cache manager; "hashed": the request blocks kvblocks' hasher hashed
_tests: dict[str, dict[str, Any]] = {}
_current: list[str] = []  # the test running now (schedulers built at import go to "")
_session: dict[str, Any] = {}


def _record(nodeid: str) -> dict[str, Any]:
    return _tests.setdefault(
        nodeid, {"outcome": None, "kvblocks": 0, "vllm": 0, "hashed": 0, "fallbacks": Counter()}
    )


def _watch_schedulers() -> None:
    """Wraps vLLM's ``Scheduler.__init__`` (outside kvblocks' wrapper, when installed) to see
    which manager each scheduler ends up with. It only observes: arguments and results pass
    through unchanged."""
    from vllm.v1.core.sched import scheduler as scheduler_module

    from kvblocks.vllm.kv_cache_manager import KVCacheManager as KvblocksManager

    init = scheduler_module.Scheduler.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        manager = getattr(self, "kv_cache_manager", None)
        entry = _record(_current[-1] if _current else "")
        entry["kvblocks" if isinstance(manager, KvblocksManager) else "vllm"] += 1

    scheduler_module.Scheduler.__init__ = __init__


def _watch_hasher() -> None:
    """Wraps each request block hasher kvblocks' hasher factory makes, to count the blocks it
    hashed itself: a call that returns hashes without counting a fallback of the hasher part
    (kvblocks then handed the request to vLLM's hasher) returned kvblocks' own. It only
    observes: arguments and results pass through unchanged. A hasher factory that fell back
    as a whole never makes one, so its requests count nothing."""
    from kvblocks.vllm import _state, block_hasher

    make = block_hasher._make_hasher

    def hasher_fallbacks() -> int:
        return sum(n for (part, _), n in _state.fallbacks.items() if part == block_hasher._PART)

    @functools.wraps(make)
    def watched(*args: Any, **kwargs: Any) -> Any:
        request_block_hasher = make(*args, **kwargs)

        @functools.wraps(request_block_hasher)
        def counted(request: Any) -> Any:
            before = hasher_fallbacks()
            hashes = request_block_hasher(request)
            if hashes and hasher_fallbacks() == before:
                _record(_current[-1] if _current else "")["hashed"] += len(hashes)
            return hashes

        return counted

    block_hasher._make_hasher = watched


def tell_cpu_platform_triton_is_there(platform: Any, triton_utils: Any) -> bool:
    """TEST ONLY: vLLM 0.34's ``CpuPlatform.check_and_update_config`` refuses x86 CPUs
    without Triton ("vLLM on x86 CPUs requires Triton (triton-cpu)"); PyPI has no triton-cpu,
    and PyPI's triton finds no active driver without a GPU. The tests run no model runner (the
    part that needs Triton), only schedulers and managers. The check is wrapped to see
    ``triton_utils.HAS_TRITON`` true while it runs, and the real value is back afterwards:
    nothing else sees the flag changed. Returns False (and changes nothing) where the platform
    has no such classmethod. Only this tier's child processes do this, never kvblocks."""
    check = vars(platform).get("check_and_update_config")
    if not isinstance(check, classmethod):
        return False

    def told_triton_is_there(cls: Any, vllm_config: Any) -> None:
        has_triton = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            check.__func__(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    platform.check_and_update_config = classmethod(told_triton_is_there)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Runs before vLLM's conftest.py files and before any test module is imported.
    mode = os.environ.get(MODE_VAR)
    if mode not in ("off", "hasher", "all"):
        raise pytest.UsageError(f"{MODE_VAR} must be off, hasher or all (got {mode!r})")
    import vllm

    import kvblocks.vllm

    status = kvblocks.vllm.install(mode)  # raises when vLLM is missing or unsupported
    _session["mode"] = mode
    _session["installed"] = str(status)
    _session["vllm"] = {"version": vllm.__version__, "file": vllm.__file__}
    _watch_schedulers()
    _watch_hasher()
    if os.environ.get(CPU_TRITON_VAR) == "1":
        import vllm.triton_utils
        from vllm.platforms.cpu import CpuPlatform

        if not tell_cpu_platform_triton_is_there(CpuPlatform, vllm.triton_utils):
            raise pytest.UsageError(f"{CPU_TRITON_VAR}=1: CpuPlatform has no such check")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # vLLM's root conftest tears down the distributed state, collects garbage and resets
    # dynamo after every test (about a second each on the CPU). Its conftest lets tests opt
    # out with this marker; these unit tests start neither torch.distributed nor a model.
    if os.environ.get("KVBLOCKS_SUITE_GLOBAL_CLEANUP") != "1":
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Any:
    from kvblocks.vllm import _state

    _current.append(item.nodeid)
    before = Counter(_state.fallbacks)
    try:
        yield
    finally:
        _current.pop()
        # The reasons kvblocks handed work to vLLM's code during this test ("part: reason").
        for (part, reason), count in (Counter(_state.fallbacks) - before).items():
            _record(item.nodeid)["fallbacks"][f"{part}: {reason}"] += count


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _record(report.nodeid)
    entry["seconds"] = round(entry.get("seconds", 0.0) + report.duration, 4)
    if report.when == "call" or report.outcome != "passed":
        entry["outcome"] = _outcome(report, entry["outcome"])
    if report.outcome != "passed" and "message" not in entry:
        entry["message"] = _message(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A test module that cannot be imported has no tests: it counts as one error.
    if report.failed:
        entry = _record(report.nodeid)
        entry["outcome"] = "error"
        entry["message"] = _message(report)


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The first line of the exception (or skip reason), for the runner's summary."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = str(crash.message)
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def _outcome(report: pytest.TestReport, previous: str | None) -> str:
    if previous in ("error", "failed"):
        return previous  # a teardown error after a failure keeps the failure
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    if report.skipped:
        return "skipped"
    return "passed"


def _hasher_bindings() -> dict[str, str]:
    """Which request block hasher each imported test module bound at import ("kvblocks" or
    "vllm"): proof that the mode was installed before vLLM's tests imported the name."""
    import sys

    from kvblocks.vllm.block_hasher import get_request_block_hasher as ours

    bindings = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("tests.") or module is None:
            continue
        bound = vars(module).get("get_request_block_hasher")  # no module __getattr__
        if bound is not None:
            bindings[name] = "kvblocks" if bound is ours else "vllm"
    return bindings


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT_VAR)
    if not path or "mode" not in _session:
        return
    import kvblocks
    import kvblocks.vllm
    from kvblocks.vllm import _state

    status = kvblocks.vllm.status()
    report = {
        "mode": _session["mode"],
        "vllm": _session["vllm"],
        "kvblocks": kvblocks.__file__,
        "installed": _session["installed"],
        "status": str(status),
        "hasher_bindings": _hasher_bindings(),
        "active": status.active,
        "fallbacks": {f"{part}: {reason}": n for (part, reason), n in _state.fallbacks.items()},
        "tests": {
            nodeid: {**entry, "fallbacks": dict(entry["fallbacks"])}
            for nodeid, entry in _tests.items()
        },
    }
    Path(path).write_text(json.dumps(report, indent=1, sort_keys=True))
