"""kvblocks never breaks vLLM, whatever vLLM it finds: on a vLLM release it does not support,
and on one that moved every name kvblocks uses, importing any of its vLLM modules raises
nothing, the plugin leaves vLLM unchanged and says why and what to do (``status()`` and one
log line), ``--scheduler-cls kvblocks.vllm.Scheduler`` is importable, and ``kvblocks bench
--engine vllm`` says so in one line.

Needs no vLLM: each case runs in a fresh process that finds a stand-in ``vllm`` distribution
first on its path, an empty package (nothing of vLLM's can be imported from it) with the
version given. The real releases are checked in the vLLM tier
(``tests/vllm_tier/test_releases.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.fresh_process import run_cli, run_python

#: The modules of kvblocks' vLLM integration that vLLM itself imports or that a user names
#: (the plugin, ``--scheduler-cls``, the manager, the hasher, the fingerprints). The
#: benchmark driver (``kvblocks.vllm.bench*``) builds vLLM's objects as the supported
#: releases take them and is not among them.
PRODUCT = [
    "kvblocks.vllm",
    "kvblocks.vllm._state",
    "kvblocks.vllm.block_hasher",
    "kvblocks.vllm.fingerprints",
    "kvblocks.vllm.fingerprints.extract",
    "kvblocks.vllm.fingerprints.ported",
    "kvblocks.vllm.kv_cache_manager",
    "kvblocks.vllm.scheduler",
    "kvblocks.vllm.support",
]


Result = dict[str, Any]


def stand_in_vllm(root: Path, version: str) -> Path:
    """An installed ``vllm`` ``version`` under ``root`` whose package holds nothing."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


#: Child code: kvblocks' log lines go to ``messages`` (level name, text).
KEEP_LOG_LINES = r"""
import logging
messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append([record.levelname, record.getMessage()])
logging.getLogger("vllm.kvblocks").addHandler(Keep())
"""
#: Child code: imports every module of kvblocks.vllm, each one's error in ``errors``.
IMPORT_EVERY_MODULE = r"""
import importlib, pkgutil
import kvblocks.vllm as v
errors = {}
for info in pkgutil.walk_packages(v.__path__, "kvblocks.vllm.", onerror=lambda name: None):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except BaseException as error:
        errors[info.name] = f"{type(error).__name__}: {error}"
"""

CHILD = (
    KEEP_LOG_LINES
    + 'logging.getLogger("vllm.kvblocks").setLevel(logging.INFO)\n'
    + IMPORT_EVERY_MODULE
    + r"""
import json, sys
v.register()  # what vLLM's plugin loader calls in every process it starts
status = v.status()

from kvblocks.vllm import Scheduler, AsyncScheduler, KVCacheManager
from kvblocks.vllm.support import Unsupported
try:
    Scheduler(vllm_config=None)
    built = "built"
except BaseException as error:
    built = f"{type(error).__name__}: {error}"
try:
    KVCacheManager(kv_cache_config=None, max_model_len=16)
    manager = "built"
except Unsupported as refusal:
    manager = f"Unsupported: {refusal.reason} ({refusal.detail})"
except BaseException as error:
    manager = f"{type(error).__name__}: {error}"
print(json.dumps({
    "modules": sorted(sys.modules),
    "errors": errors,
    "messages": messages,
    "mode": status.mode,
    "version": status.vllm_version,
    "fallbacks": status.fallbacks,
    "status": str(status),
    "scheduler": built,
    "async_scheduler_base": AsyncScheduler.__mro__[1].__name__,
    "manager": manager,
}))
"""
)


def run_with(vllm_root: Path, code: str) -> subprocess.CompletedProcess[str]:
    return run_python(code, env={"PYTHONPATH": str(vllm_root), "KVBLOCKS_VLLM": "all"})


@pytest.fixture(scope="module")
def unsupported(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """A vLLM release kvblocks does not support, with nothing where kvblocks looks."""
    root = stand_in_vllm(tmp_path_factory.mktemp("vllm-0.99"), "0.99.0")
    done = run_with(root, CHILD)
    assert done.returncode == 0, done.stderr[-3000:]
    result: Result = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_stand_in_is_the_vllm_found(unsupported: dict) -> None:
    assert unsupported["version"] == "0.99.0"
    # Not vacuous: the product's modules were imported (and vLLM's scheduler was not there).
    assert set(PRODUCT) <= set(unsupported["modules"])
    assert "vllm.v1" not in unsupported["modules"]


def test_no_module_raises_whatever_vllm_moved(unsupported: dict) -> None:
    assert {m: e for m, e in unsupported["errors"].items() if m in PRODUCT} == {}


def test_the_plugin_leaves_vllm_alone_and_says_why_and_what_to_do(
    unsupported: dict,
) -> None:
    assert unsupported["mode"] == "off"
    reasons = unsupported["fallbacks"]
    assert set(reasons) == {
        "hasher: a vLLM release this version of kvblocks does not support (vllm 0.99.0; to use "
        'kvblocks, install a kvblocks release that supports vllm 0.99.0, or pip install "vllm'
        '>=0.33,<0.35")',
        "kv_cache_manager: a vLLM release this version of kvblocks does not support (vllm "
        "0.99.0; to use kvblocks, install a kvblocks release that supports vllm 0.99.0, or pip "
        'install "vllm>=0.33,<0.35")',
    }
    assert "nothing active" in unsupported["status"]
    assert "fallback x1: hasher: a vLLM release" in unsupported["status"]
    # One log line, a warning, naming the release and the remedy.
    (line,) = unsupported["messages"]
    assert line[0] == "WARNING"
    assert "not vllm 0.99.0" in line[1]
    assert 'pip install "vllm>=0.33,<0.35"' in line[1]


def test_scheduler_cls_imports_and_says_what_is_missing(
    unsupported: dict,
) -> None:
    # --scheduler-cls kvblocks.vllm.Scheduler resolves; building it on a vLLM without vLLM's
    # scheduler says so (there is no vLLM scheduler to stand in for).
    assert unsupported["scheduler"].startswith("ImportError: kvblocks.vllm.Scheduler stands in")
    assert "drop --scheduler-cls" in unsupported["scheduler"]
    assert unsupported["async_scheduler_base"] == "Missing"


def test_the_manager_refuses_to_be_built_naming_what_moved(
    unsupported: dict,
) -> None:
    assert unsupported["manager"].startswith("Unsupported: vllm_sources (ModuleNotFoundError")
    assert "vllm.distributed" in unsupported["manager"]


def test_a_supported_release_that_moved_everything(tmp_path: Path) -> None:
    """vLLM 0.33.0 with none of its files: nothing raises, nothing is installed, each part
    names what it did not find (the fingerprints compare the files, never import them)."""
    done = run_with(stand_in_vllm(tmp_path, "0.33.0"), CHILD)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert {m: e for m, e in result["errors"].items() if m in PRODUCT} == {}
    assert result["mode"] == "all"
    assert "nothing active" in result["status"]
    assert sorted(reason.split(":")[0] for reason in result["fallbacks"]) == [
        "hasher",
        "kv_cache_manager",
    ]
    for reason in result["fallbacks"]:
        assert "differ from the release it was ported from (vllm 0.33.0: " in reason
        assert "vllm/v1/request.py (removed)" in reason
    assert result["manager"].startswith("Unsupported: vllm_sources (ModuleNotFoundError")


def test_bench_engine_vllm_says_so_in_one_line(tmp_path: Path) -> None:
    root = stand_in_vllm(tmp_path, "0.99.0")
    done = run_cli("bench", "--engine", "vllm", env={"PYTHONPATH": str(root)})
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("--engine vllm: kvblocks ")
    assert "not vllm 0.99.0" in line


def test_a_vllm_with_the_modules_but_not_their_members(tmp_path: Path) -> None:
    """vLLM's scheduler and manager modules are there, their classes and members are not (a
    release that renamed them): nothing raises at import; each name is missing where it is
    used."""
    root = stand_in_vllm(tmp_path, "0.33.0")
    for package in ("v1", "v1/core", "v1/core/sched"):
        (root / "vllm" / package).mkdir()
        (root / "vllm" / package / "__init__.py").write_text("")
    (root / "vllm/v1/core/sched/scheduler.py").write_text("")
    (root / "vllm/v1/core/sched/async_scheduler.py").write_text("Scheduler = 1\n")
    (root / "vllm/v1/core/kv_cache_manager.py").write_text("class KVCacheManager:\n    pass\n")
    done = run_with(root, CHILD)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert {m: e for m, e in result["errors"].items() if m in PRODUCT} == {}
    assert "(vllm.v1.core.sched.scheduler has no class Scheduler)" in result["scheduler"]
    assert result["manager"].startswith("Unsupported: vllm_sources (ModuleNotFoundError")
