"""The driver with vLLM's native CPU offloading (``SchedulerSpec.kv_offloading``: the
``OffloadingConnector`` and its real ``CPUOffloadingManager``, a fake worker side) on stock
vLLM: blocks go to the CPU tier, come back after the GPU prefix cache is reset, the tier
evicts, its KV events are published, and the snapshots record the connector's jobs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request, RequestStatus

from tests.vllm_driver import (
    SchedulerSpec,
    Workload,
    block_hasher,
    make_request,
    make_scheduler,
    timed_run,
)
from tests.vllm_driver.offloading import KeyedCPUOffloadingManager, chunk_bytes
from tests.vllm_tier.harness import play, soak_script
from tests.vllm_tier.simulation import run

# The snapshot's connector fields (simulation.run's records start with the snapshot).
LOADS, STORES, FLUSHED = 9, 10, 11
# A job: (job id, request id, (GPU block ids, group sizes, block indices), chunk ids, keys, sync)
REQ, GPU, CHUNKS, KEYS = 1, 2, 3, 4

SMALL_GPT_OSS = [("full", 0), ("sliding_window", 16)]


def offloading_spec(**kwargs: Any) -> SchedulerSpec:
    kwargs = {
        "block_size": 4,
        "num_blocks": 64,
        "kv_offloading": 48,
        "kv_events": True,
        "max_num_batched_tokens": 64,
        **kwargs,
    }
    return SchedulerSpec(**kwargs)


def snapshots(records: list[Any]) -> list[Any]:
    """The snapshot of every step that scheduled (the last record is the final hashes)."""
    return [r[0] for r in records[:-1] if r[0] is not None]


def jobs(records: list[Any], field: int) -> list[Any]:
    return [job for snap in snapshots(records) for job in snap[field]]


def events(records: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [e for r in records[:-1] for batch in r[3] for e in batch]


def tokens_out(records: list[Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for r in records[:-1]:
        for request_id, new_tokens, *_ in r[1]:
            counts[request_id] += len(new_tokens)
    return counts


def prompt_keys(request: Request, block_size: int, group: int = 0) -> set[bytes]:
    """The offload keys of the prompt's full blocks in ``group``."""
    full = request.block_hashes[: request.num_prompt_tokens // block_size]
    return {make_offload_key(h, group) for h in full}


def statuses(scheduler: Any) -> dict[str, str]:
    return {rid: r.status.name for rid, r in scheduler.requests.items()}


def test_the_spec_builds_vllms_offloading(model_dir: Path, async_scheduling: bool) -> None:
    """The config ``--kv-offloading-size`` gives (OffloadingConnector, kv_both,
    cpu_bytes_to_use), with vLLM's own CPU manager and LRU policy on the scheduler side, a
    tier of exactly ``kv_offloading`` chunks, and blocks freed late under async scheduling
    (as on a GPU)."""
    spec = offloading_spec(kv_offloading=10, async_scheduling=async_scheduling)
    scheduler = make_scheduler(model_dir, spec)
    transfer = scheduler.vllm_config.kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"
    assert transfer.kv_role == "kv_both"
    extra = transfer.kv_connector_extra_config
    assert extra["cpu_bytes_to_use"] == 10 * chunk_bytes(scheduler.kv_cache_config)
    assert isinstance(scheduler.connector, OffloadingConnector)
    manager = scheduler.connector.connector_scheduler.manager
    # vLLM's CPU manager, as DriverCPUOffloadingSpec builds it (recording the keys).
    assert isinstance(manager, CPUOffloadingManager)
    assert type(manager) is KeyedCPUOffloadingManager
    assert manager._num_chunks == 10
    assert type(manager._policy).__name__ == "LRUCachePolicy"
    assert scheduler.defer_block_free is async_scheduling
    plain = make_scheduler(model_dir, SchedulerSpec(async_scheduling=async_scheduling))
    assert plain.connector is None
    assert plain.vllm_config.kv_transfer_config is None


@pytest.mark.parametrize("layout", ["llama", "gpt-oss"])
def test_cpu_tier_serves_prefixes_after_a_gpu_reset(
    model_dir: Path, async_scheduling: bool, layout: str
) -> None:
    """Prompts' full blocks are stored to the CPU tier; after ``reset_prefix_cache`` empties
    the GPU cache, requests with the same prefixes load them back asynchronously (waiting
    in WAITING_FOR_REMOTE_KVS, unscheduled, while the load runs) and start past them."""
    groups = SMALL_GPT_OSS if layout == "gpt-oss" else [("full", 0)]
    spec = offloading_spec(layout=groups, async_scheduling=async_scheduling)
    scheduler = make_scheduler(model_dir, spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    prefixes = [list(range(100, 124)), list(range(500, 520))]  # 6 and 5 blocks
    first = [
        make_request(f"a{i}", prefixes[i % 2] + [i] * 3, hasher, max_tokens=3) for i in range(4)
    ]
    records = run(scheduler, [(0, r) for r in first])
    assert tokens_out(records) == {r.request_id: 3 for r in first}
    assert not jobs(records, LOADS)
    stores = jobs(records, STORES)
    stored = {key for job in stores for key in job[KEYS]}
    group0 = (0).to_bytes(4, "big")
    expected = set().union(*(prompt_keys(r, spec.block_size) for r in first))
    assert {key for key in stored if key.endswith(group0)} == expected
    assert sum(len(job[KEYS]) for job in stores) == len(stored)  # each block stored once

    assert scheduler.reset_prefix_cache()
    second = [
        make_request(f"b{i}", prefixes[i] + [50 + i] * 2, hasher, max_tokens=3) for i in range(2)
    ]
    probe = {step: [statuses] for step in range(8)}
    records = run(scheduler, [(0, r) for r in second], actions=probe)
    assert tokens_out(records) == {"b0": 3, "b1": 3}
    loads = jobs(records, LOADS)
    assert {job[REQ] for job in loads} == {"b0", "b1"}
    loaded = {key for job in loads for key in job[KEYS]}
    assert loaded <= stored
    assert prompt_keys(second[0], 4) | prompt_keys(second[1], 4) <= loaded
    assert not any(job[-1] for job in loads)  # asynchronous loads
    for snap in snapshots(records):
        for job in snap[LOADS]:
            assert job[REQ] not in dict(snap[0]), "a loading request was scheduled"
    # Each request starts past its prefix, all of it external (the GPU cache is empty).
    started = {r[0]: r[2] for snap in snapshots(records) for r in snap[1]}
    assert started == {"b0": 24, "b1": 20}
    seen = [status for r in records[:-1] for result in r[5] for status in result.values()]
    assert RequestStatus.WAITING_FOR_REMOTE_KVS.name in seen
    assert RequestStatus.RUNNING.name in seen


def test_cpu_events_mirror_the_stored_blocks(model_dir: Path) -> None:
    """With KV events on, the connector publishes BlockStored with medium CPU for each block
    it stored, the same hashes the GPU events named for those blocks."""
    spec = offloading_spec()
    scheduler = make_scheduler(model_dir, spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    request = make_request("a", list(range(100, 122)), hasher, max_tokens=6)
    records = run(scheduler, [(0, request)])
    published = events(records)
    cpu = [e for e in published if e[1]["medium"] == "CPU"]
    assert cpu
    assert all(name == "BlockStored" for name, _ in cpu)
    gpu_hashes = [h for n, e in published if e["medium"] == "GPU" for h in e["block_hashes"]]
    cpu_hashes = [h for _, e in cpu for h in e["block_hashes"]]
    # The prompt's five full blocks (the first five the GPU stored), each once.
    assert sorted(cpu_hashes) == sorted(gpu_hashes[:5])
    assert len(jobs(records, STORES)[0][KEYS]) == 5


def test_a_small_cpu_tier_evicts_the_least_recently_used(
    model_dir: Path, async_scheduling: bool
) -> None:
    """A tier of 8 chunks holds two 4-block prefixes: storing a third evicts the first
    (BlockRemoved, medium CPU; its chunks reused), which then misses after a GPU reset while
    the third hits."""
    spec = offloading_spec(kv_offloading=8, async_scheduling=async_scheduling)
    scheduler = make_scheduler(model_dir, spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    prefixes = {
        name: list(range(base, base + 16)) for name, base in [("A", 0), ("B", 200), ("C", 400)]
    }
    chunks = {}
    removed: list[Any] = []
    for name, prefix in prefixes.items():
        records = run(scheduler, [(0, make_request(name, [*prefix, 7, 7], hasher, max_tokens=2))])
        (store,) = jobs(records, STORES)
        chunks[name] = set(store[CHUNKS])
        removed += [e for n, e in events(records) if n == "BlockRemoved" and e["medium"] == "CPU"]
    assert len(chunks["A"] | chunks["B"]) == 8
    assert chunks["C"] == chunks["A"]
    assert [h for e in removed for h in e["block_hashes"]], "the tier must evict"
    assert scheduler.reset_prefix_cache()
    again = [
        make_request(f"{name}2", prefixes[name] + [9, 9], hasher, max_tokens=2) for name in "AC"
    ]
    records = run(scheduler, [(0, again[0]), (3, again[1])])
    assert {job[REQ] for job in jobs(records, LOADS)} == {"C2"}
    assert tokens_out(records) == {"A2": 2, "C2": 2}


def test_a_soak_with_offloading(model_dir: Path, async_scheduling: bool) -> None:
    """The tier's soak script (resets, aborts, salts, LoRA, preemptions) with a small CPU
    tier: loads, stores, flushes of stores whose blocks were reused, evictions, and runs
    that repeat exactly (what a differential comparison needs)."""
    spec = SchedulerSpec(
        block_size=4,
        num_blocks=41,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        kv_events=True,
        kv_offloading=30,
        async_scheduling=async_scheduling,
    )
    script = soak_script(spec, seed=99)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    records = play(script, make_scheduler(model_dir, spec), hasher)
    assert len(records) > 1000
    assert jobs(records, LOADS)
    assert jobs(records, STORES)
    assert jobs(records, FLUSHED)
    assert any(snap[5] for snap in snapshots(records)), "must preempt"
    assert any(n == "BlockRemoved" and e["medium"] == "CPU" for n, e in events(records))
    assert play(script, make_scheduler(model_dir, spec), hasher) == records


def test_timed_runs_offload(model_dir: Path, async_scheduling: bool) -> None:
    """The benchmark's timed run steps the connector too, the same way each time."""
    spec = SchedulerSpec(num_blocks=128, kv_offloading=64, async_scheduling=async_scheduling)
    workload = Workload(num_requests=12, prompt_len=120, shared_len=80, output_len=4)
    _, snaps = timed_run(model_dir, spec, workload)
    assert sum(len(s[STORES]) for s in snaps) >= workload.num_requests
    assert timed_run(model_dir, spec, workload)[1] == snaps


def test_without_offloading_the_connector_fields_are_empty(model_dir: Path) -> None:
    """The snapshot's appended connector fields are empty without a connector."""
    spec = SchedulerSpec(block_size=4, num_blocks=32)
    scheduler = make_scheduler(model_dir, spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    records = run(scheduler, [(0, make_request("a", list(range(20)), hasher, max_tokens=3))])
    snaps = snapshots(records)
    assert snaps
    assert all(len(s) == 13 for s in snaps)
    assert all(s[LOADS : FLUSHED + 1] == ([], [], []) for s in snaps)
