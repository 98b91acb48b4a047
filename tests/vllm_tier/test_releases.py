"""kvblocks on the real vLLM release after the ones it supports: vLLM starts as it would
without kvblocks.

``.ci/run`` installs that release (vllm 0.34.0, ``--no-deps``) into a directory of its own
and names it in ``KVBLOCKS_NEXT_VLLM``; each case runs in a fresh process that finds it first
on its path (the rest of the environment is the tier's). Its plugin loads through vLLM's own
plugin loader, as in every process vLLM starts; ``--scheduler-cls kvblocks.vllm.Scheduler``
(and ``AsyncScheduler``) builds vLLM's own manager; every module of kvblocks' vLLM
integration imports; ``kvblocks bench --engine vllm`` says in one line that it does not run.
(vLLM 0.34 removed ``KVCacheManager.get_num_common_prefix_blocks``, which kvblocks 0.1.0
bound at import, so that ``--scheduler-cls kvblocks.vllm.Scheduler`` stopped vLLM's start-up.)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.fresh_process import run_cli, run_python
from tests.test_any_vllm import IMPORT_EVERY_MODULE, KEEP_LOG_LINES, PRODUCT

NEXT = os.environ.get("KVBLOCKS_NEXT_VLLM")
if NEXT is None and os.environ.get("KVBLOCKS_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVBLOCKS_NEXT_VLLM is not set: .ci/run installs vLLM 0.34 and sets it")
pytestmark = pytest.mark.skipif(
    NEXT is None, reason="KVBLOCKS_NEXT_VLLM names no vLLM release (.ci/run installs one)"
)

CHILD = (
    KEEP_LOG_LINES
    + r"""
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every process vLLM starts does first
from vllm.v1.core import kv_cache_utils
"""
    + IMPORT_EVERY_MODULE
    + r"""
import json, sys
from importlib.metadata import version
from kvblocks.vllm import AsyncScheduler, Scheduler
from tests.vllm_driver import SchedulerSpec, make_scheduler, tiny_model_dir

managers = []
for cls in (Scheduler, AsyncScheduler):
    spec = SchedulerSpec(block_size=16, num_blocks=64, layout="llama", hash_algo="sha256",
                         async_scheduling=cls is AsyncScheduler)
    scheduler = make_scheduler(tiny_model_dir(), spec, scheduler_cls=cls)
    managers.append(type(scheduler.kv_cache_manager).__module__)
status = v.status()
print(json.dumps({
    "vllm": version("vllm"),
    "hasher": kv_cache_utils.get_request_block_hasher.__module__,
    "errors": errors,
    "imported": sorted(m for m in sys.modules if m.startswith("kvblocks.")),
    "managers": managers,
    "mode": status.mode,
    "active": status.active,
    "fallbacks": status.fallbacks,
    "messages": [m for m in messages if m[0] != "DEBUG"],
}))
"""
)


@pytest.fixture(scope="module")
def started() -> dict[str, Any]:
    assert NEXT is not None
    done = run_python(CHILD, env={"PYTHONPATH": NEXT, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_next_release_is_the_vllm_found(started: dict[str, Any]) -> None:
    assert started["vllm"] == "0.34.0"


def test_vllm_starts_with_its_own_parts(started: dict[str, Any]) -> None:
    assert started["errors"] == {}
    assert set(PRODUCT) <= set(started["imported"])
    assert started["hasher"] == "vllm.v1.core.kv_cache_utils"
    assert started["managers"] == ["vllm.v1.core.kv_cache_manager"] * 2
    assert started["mode"] == "off"
    assert started["active"] == {}


def test_the_refusal_is_recorded_with_what_to_do(started: dict[str, Any]) -> None:
    remedy = (
        "vllm 0.34.0; to use kvblocks, install a kvblocks release that supports vllm 0.34.0, "
        'or pip install "vllm>=0.33,<0.34"'
    )
    text = "a vLLM release this version of kvblocks does not support"
    assert started["fallbacks"] == {
        f"hasher: {text} ({remedy})": 1,  # the plugin
        f"kv_cache_manager: {text} ({remedy})": 3,  # the plugin, then each scheduler
    }
    # One line in all, a warning.
    (line,) = started["messages"]
    assert line[0] == "WARNING"
    assert "not vllm 0.34.0" in line[1]
    assert 'pip install "vllm>=0.33,<0.34"' in line[1]


def test_bench_engine_vllm_says_so_in_one_line() -> None:
    assert NEXT is not None
    done = run_cli("bench", "--engine", "vllm", env={"PYTHONPATH": NEXT})
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("--engine vllm: kvblocks ")
    assert "not vllm 0.34.0" in line
