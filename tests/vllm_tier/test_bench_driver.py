"""The benchmark driver picks vLLM's CPU platform itself, when it first builds something of
vLLM's, not at import: run in a fresh interpreter without ``VLLM_TARGET_DEVICE`` (the tier's
conftest sets it in this one)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvblocks

CHILD = r"""
import json, os, sys
from kvblocks.vllm.bench import config as bench_config

state = {"at_import": [os.environ.get("VLLM_TARGET_DEVICE"), "vllm.config" in sys.modules]}
# The test-only Triton flag for vLLM 0.34's CPU platform, as the tier's other configs have it,
# entered once the driver has selected the platform (entering it imports vLLM's platforms).
import contextlib
from tests.vllm_driver.config import scheduler_only_cpu_platform

flag = contextlib.ExitStack()
select = bench_config.select_cpu_platform

def select_then_flag():
    select()
    flag.enter_context(scheduler_only_cpu_platform())

bench_config.select_cpu_platform = select_then_flag
with flag:
    config = bench_config.make_vllm_config(
        bench_config.tiny_model_dir(), bench_config.SchedulerSpec()
    )
bench_config.select_cpu_platform = select
from vllm.platforms import current_platform, interface

state["built"] = [os.environ.get("VLLM_TARGET_DEVICE"), current_platform.is_cpu()]
state["block_size"] = config.cache_config.block_size

# vLLM imported earlier without a device: the driver says what to do instead of building.
import vllm.platforms
vllm.platforms.current_platform = interface.UnspecifiedPlatform()
bench_config.select_cpu_platform.cache_clear()
try:
    bench_config.select_cpu_platform()
except RuntimeError as error:
    state["unspecified"] = str(error)
print(json.dumps(state))
"""


def test_the_driver_selects_the_cpu_platform_when_it_builds_a_config() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    package_root = str(Path(kvblocks.__file__).parent.parent)
    repo_root = str(Path(__file__).resolve().parents[2])  # for the test driver's flag
    env["PYTHONPATH"] = os.pathsep.join([package_root, repo_root, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(done.stdout.splitlines()[-1])
    assert state["at_import"] == [None, False]  # importing set nothing, chose no platform
    assert state["built"] == ["cpu", True]
    assert state["block_size"] == 16
    assert "set VLLM_TARGET_DEVICE=cpu before" in state["unspecified"]


def test_a_timed_run_freezes_the_start_up_heap_as_engine_core_does(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's EngineCore freezes the heap its start-up built for the garbage collector and
    unfreezes it at shutdown: a timed run does the same around each scheduler it drives."""
    from kvblocks.vllm.bench import timing
    from tests.vllm_driver import SchedulerSpec, Workload

    frozen_during: list[int] = []
    drive = timing._drive

    def spy(*args: Any) -> Any:
        frozen_during.append(gc.get_freeze_count())
        return drive(*args)

    monkeypatch.setattr(timing, "_drive", spy)
    before = gc.get_freeze_count()
    workload = Workload(num_requests=2, prompt_len=40, shared_len=16, output_len=2)
    _, snapshots = timing.timed_run(model_dir, SchedulerSpec(num_blocks=64), workload)
    assert snapshots
    assert len(frozen_during) == 1
    assert frozen_during[0] > before
    assert gc.get_freeze_count() == before


def test_a_pool_that_cannot_hold_one_request_stops_the_run() -> None:
    """A layout whose pool cannot hold one request and that the command line's arithmetic
    does not cover (no full-attention group): vLLM's scheduler admits nothing, and the run
    stops with an error after STALLED_STEPS steps instead of looping forever."""
    from kvblocks.vllm.bench.timing import STALLED_STEPS
    from tests.vllm_driver import SchedulerSpec, Workload, timed_run, tiny_model_dir

    spec = SchedulerSpec(block_size=16, num_blocks=3, layout=[("sliding_window", 64)])
    workload = Workload(num_requests=2, prompt_len=200, shared_len=100, output_len=2)
    with pytest.raises(ValueError, match=f"admitted no request in {STALLED_STEPS} steps"):
        timed_run(tiny_model_dir(), spec, workload)
