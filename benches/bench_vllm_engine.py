"""What kvblocks is worth in tokens/s: vLLM 0.33's (or 0.34's) own engine-core loop, stock and
with kvblocks, on a modelled device (:mod:`kvblocks.vllm.bench.engine_loop`).

For each number of running requests, workload and scheduling mode (async, vLLM's default:
a batch queue of two; or off), three runs per side record the engine thread's CPU per loop
call (the sides alternate, stock first, and their outputs must be the same token for token;
each call's CPU is the median of the three), and the replay lays it against a device step of
``base + 1 us per scheduled token`` for each base in the sweep. Reported per setting:
tokens/s of each side and their ratio, how long the device waited, the engine thread's CPU
per step, time to first token and inter-token latency (p50 / p99).

    pytest benches/bench_vllm_engine.py -s [--engine-json FILE]

``KVBLOCKS_ENGINE_RUNNING`` (default ``64,256,1024``; ``2048`` too for the full sweep) and
``KVBLOCKS_ENGINE_DEVICE_MS`` (default ``2,4,8,12,20,40``) choose the sweep. An untimed pass
(``--benchmark-disable``, as ``.ci/run``) runs one small setting so that the file cannot rot.
``--engine-json FILE`` keeps the rows for ``benches/plot_engine.py``, which draws the
README's figure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason='needs vllm (pip install ".[vllm]" in a kvblocks checkout)')

from kvblocks.vllm.bench.engine_loop import (
    WORKLOADS,
    DeviceModel,
    compare_sides,
    markdown_table,
    replay,
    sweep_rows,
    workload,
)
from kvblocks.vllm.bench.platform import select_cpu_platform

ROWS: list[dict[str, Any]] = []
#: Runs per side and setting (alternating sides); each CPU segment is their median.
ROUNDS = 3


def _ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",") if v.strip()]


def _sweep(disabled: bool) -> tuple[list[int], list[int]]:
    if disabled:
        return [16], [4]
    return _ints("KVBLOCKS_ENGINE_RUNNING", "64,256,1024"), _ints(
        "KVBLOCKS_ENGINE_DEVICE_MS", "2,4,8,12,20,40"
    )


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Any:
    yield
    if not ROWS:
        return
    print("\n" + markdown_table(ROWS))
    path = request.config.getoption("--engine-json", default=None)
    if path:
        Path(path).write_text(json.dumps(ROWS, indent=1))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_engine_loop_tokens_per_s(
    benchmark: Any, name: str, async_scheduling: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    select_cpu_platform()
    untimed = benchmark.disabled
    running_counts, device_steps = _sweep(untimed)
    for running in running_counts:
        load = workload(name, running, output_len=8 if untimed else None)
        recordings = compare_sides(load, async_scheduling, 1 if untimed else ROUNDS)
        ROWS.extend(sweep_rows(name, load, async_scheduling, recordings, device_steps))
    # pytest-benchmark needs one timed call: the replay of the last setting (cheap).
    device = DeviceModel(device_steps[-1])
    benchmark.pedantic(replay, args=(recordings["kvblocks"], device), rounds=1, iterations=1)
