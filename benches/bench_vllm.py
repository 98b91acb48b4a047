"""kvblocks inside the real vLLM 0.33: stock vLLM against vLLM with the kvblocks plugin, in
the same run, on vLLM's own V1 scheduler driven by a fake model on the CPU.

- prompt hashing at request arrival: the request block hasher over 256 prompts of 2,000
  tokens, as ``EngineCore`` calls it when it builds each ``Request``;
- one decode step's ``allocate_slots`` calls for 256 running requests, without timers;
- the shared-prefix workload (256 requests, 2,000-token prompts sharing 1,500 tokens, 32
  output tokens, block size 16, 8,192 blocks): scheduler-side CPU time (request arrival +
  ``schedule()`` + ``update_from_output()``) and the shares of it spent hashing at arrival and
  inside the KV-cache manager. Both runs must produce identical scheduler outputs.

    pytest benches/bench_vllm.py -s --benchmark-columns=median,rounds [--ratios-md FILE]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason='needs vllm (pip install ".[vllm]" in a kvblocks checkout)')

import kvblocks.vllm
from kvblocks.vllm.bench_driver import (
    FakeModel,
    SchedulerSpec,
    Workload,
    block_hasher,
    make_request,
    make_scheduler,
    select_cpu_platform,
    timed_run,
    tiny_model_dir,
)

IMPLS = ["vllm", "kvblocks"]
SNAPSHOTS: dict[str, list[Any]] = {}
HASHES: dict[tuple[str, str], list[list[bytes]]] = {}


@pytest.fixture
def installed(request: pytest.FixtureRequest) -> Iterator[str]:
    select_cpu_platform()  # before install() imports vLLM, which then picks its platform
    impl = request.param
    if impl == "kvblocks":
        kvblocks.vllm.install("all")
    else:
        kvblocks.vllm.uninstall()
    yield impl
    kvblocks.vllm.uninstall()


def _label(benchmark: Any, case: str, impl: str) -> None:
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl=impl, baselines=[[case, "vllm"]] if impl == "kvblocks" else []
    )


@pytest.mark.parametrize("installed", IMPLS, indirect=True)
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_prompt_hashing_at_arrival(benchmark: Any, installed: str, algo: str) -> None:
    workload = Workload(num_requests=256, prompt_len=2000, shared_len=1500)
    hasher: Callable[[Any], list[bytes]] = block_hasher(algo, 16)
    requests = [make_request(f"r{i}", p, None) for i, p in enumerate(workload.prompts())]

    def hash_all() -> list[list[bytes]]:
        return [hasher(r) for r in requests]

    case = f"hash 256 prompts of 2,000 tokens at arrival, {algo}"
    _label(benchmark, case, installed)
    hashes = benchmark.pedantic(hash_all, rounds=5, warmup_rounds=1)
    assert all(len(h) == 125 for h in hashes)
    HASHES[(algo, installed)] = hashes
    if len(HASHES) % 2 == 0:  # both implementations ran: the same bytes
        assert HASHES[(algo, "vllm")] == HASHES[(algo, "kvblocks")]


WORKLOADS = {
    "shared prefix, 32 output tokens": Workload(output_len=32),
    "shared prefix, 128 output tokens (decode-heavy)": Workload(output_len=128),
}


@pytest.mark.parametrize("installed", IMPLS, indirect=True)
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_scheduler_cpu_time(benchmark: Any, installed: str, name: str) -> None:
    model_dir: Path = tiny_model_dir()
    spec = SchedulerSpec(
        block_size=16,
        num_blocks=8192,
        hash_algo="sha256",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    runs: list[Any] = []

    def run_once() -> None:
        runs.append(timed_run(model_dir, spec, WORKLOADS[name]))

    case = f"vLLM scheduler, 256 requests, {name}"
    _label(benchmark, case, installed)
    benchmark.pedantic(run_once, rounds=3, warmup_rounds=0)
    # Compared: the scheduler-side CPU time each run measured, not building the scheduler.
    runs.sort(key=lambda run: run[0].scheduler)
    timings, snapshots = runs[len(runs) // 2]
    benchmark.extra_info["seconds"] = timings.scheduler
    assert all(s == snapshots for _, s in runs)
    SNAPSHOTS.setdefault(name, snapshots)
    assert snapshots == SNAPSHOTS[name], "kvblocks changed vLLM's scheduling decisions"
    # Where the time goes: one more run with a timer on every hasher and manager call.
    parts, _ = timed_run(model_dir, spec, WORKLOADS[name], instrument=True)
    shares = {
        "hashing at arrival": parts.hashing / parts.scheduler,
        "KV-cache manager": parts.manager / parts.scheduler,
    }
    benchmark.extra_info["shares"] = shares
    benchmark.extra_info["per_call"] = {
        method: seconds / calls for method, (calls, seconds) in parts.manager_calls.items() if calls
    }
    print(
        f"\n{case}, {installed}: {timings.steps} steps, scheduler-side CPU time "
        f"{timings.scheduler * 1e3:.0f} ms; " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
    )


@pytest.mark.parametrize("installed", IMPLS, indirect=True)
def test_decode_allocate_slots(benchmark: Any, installed: str) -> None:
    """One decode step's ``allocate_slots`` calls (one new token for every running request),
    made directly in a steady decode state, without the per-call timers of the runs above."""
    # 93 shared blocks + 256 x 33 own ones: every request runs, none is preempted.
    spec = SchedulerSpec(
        block_size=16, num_blocks=9216, max_num_seqs=256, max_num_batched_tokens=8192
    )
    scheduler = make_scheduler(tiny_model_dir(), spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    requests = [
        make_request(f"r{i}", prompt, hasher, max_tokens=1000)
        for i, prompt in enumerate(Workload().prompts())
    ]
    for request in requests:
        scheduler.add_request(request)
    model = FakeModel()
    while any(r.num_output_tokens == 0 for r in requests):  # until every request decodes
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.execute(scheduler, out))
    running = list(scheduler.running)
    assert len(running) == len(requests) == 256
    allocate = scheduler.kv_cache_manager.allocate_slots

    def step() -> None:
        for request in running:
            allocate(request, 1, num_lookahead_tokens=0)

    case = "decode step: allocate_slots for 256 running requests"
    _label(benchmark, case, installed)
    benchmark(step)
