"""kvblocks inside the real vLLM 0.33: stock vLLM against vLLM with the kvblocks plugin, in
the same run, on vLLM's own V1 scheduler driven by a fake model on the CPU.

- prompt hashing at request arrival: the request block hasher over 256 prompts of 2,000
  tokens, as ``EngineCore`` calls it when it builds each ``Request``;
- one decode step's ``allocate_slots`` calls for 256 running requests, without timers, on
  each KV-cache layout of the driver (``config.LAYOUTS``: llama, gpt-oss, gemma3, llama4,
  mla, and the Mamba hybrids qwen3.5 and jamba; prefix caching on, vLLM's default, so the
  Mamba groups run in vLLM's "align" mode, qwen3.5's with prefill checkpoints); and the same
  calls to a floor (:func:`allocate_slots_floor`): a Python function that only reads what
  every ``allocate_slots`` must read of the request, kvblocks' distance to what vLLM's
  per-request call costs any manager;
- the shared-prefix workload (256 requests, 2,000-token prompts sharing 1,500 tokens, 32 and
  128 output tokens, block size 16, 8,192 blocks, one full-attention group), then the 32-token
  workload on each layout with 9,216 blocks per KV-cache group: scheduler-side CPU time
  (request arrival + ``schedule()`` + ``update_from_output()``) and the shares of it spent
  hashing at arrival and inside the KV-cache manager. Both runs must produce identical
  scheduler outputs; on the layouts every request must run to its end without preemption;
- the 32-token workload on the one-group layout with n-gram and EAGLE speculative decoding,
  with vLLM's native CPU offloading (``--kv-offloading-size``: the OffloadingConnector
  storing every prompt block to the CPU tier; also on qwen3.5, whose Mamba states it stores
  from the manager's boundary-state offers) and with the DecodeBenchConnector; and on the
  Mamba hybrids with prefix caching off (``--no-enable-prefix-caching``, vLLM's Mamba cache
  mode "none").

The scheduler-side CPU time is request arrival + ``schedule()`` + ``update_from_output()``
(+ ``update_draft_token_ids``); the fake model's step, and a connector's fake worker side,
are not timed.

Every kvblocks case asserts that kvblocks' hasher and KV-cache manager really ran, with no
fallback to vLLM's code (and every stock case that vLLM's own ran): a fallback would time
stock vLLM against itself.

An untimed pass (``--benchmark-disable``) runs the layouts other than the one-group cases on
16 requests (``UNTIMED_LAYOUT_WORKLOAD``).

    pytest benches/bench_vllm.py -s --benchmark-columns=median,rounds [--ratios-md FILE]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason='needs vllm (pip install ".[vllm]" in a kvblocks checkout)')

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm.bench import describe_layout, mamba_checkpoint_alignment_for, pool_blocks
from kvblocks.vllm.bench.timing import IMPLEMENTATION_MODULES
from tests.vllm_driver import (
    LAYOUTS,
    FakeModel,
    SchedulerSpec,
    Speculation,
    Workload,
    block_hasher,
    implementation_of,
    make_request,
    make_scheduler,
    select_cpu_platform,
    timed_run,
    tiny_model_dir,
)
from tests.vllm_driver.config import scheduler_config_has

IMPLS = ["vllm", "kvblocks"]
#: The decode-step case's third variant: :func:`allocate_slots_floor` on stock vLLM's scheduler.
FLOOR = "floor"
#: Fields of a step's snapshot (``vllm_driver.snapshot``): scheduled drafts, connector stores
#: (CPU offloading), connector fills (the decode-bench connector).
DRAFTS, FILLS, STORES = 6, 9, 10
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
    _state.fallbacks.clear()
    yield impl
    kvblocks.vllm.uninstall()


def allocate_slots_floor(request: Any, num_new_tokens: int, **kwargs: Any) -> None:
    """What vLLM's scheduler's ``allocate_slots`` call costs a manager that does nothing: the
    call (as the scheduler makes it, with a keyword argument) and reading what any manager
    must read of the request to place its new tokens (its id, its token counts and its block
    hashes). Returns None (vLLM's "the pool is full"), which this benchmark never acts on."""
    _read = (request.request_id, request.num_tokens, request.num_computed_tokens)
    _hashes = request.block_hashes


def assert_ran_on(impl: str, *implementations: str) -> None:
    """Each run used ``impl``'s hasher and manager (:func:`implementation_of`), and nothing
    fell back to vLLM's code."""
    assert set(implementations) == {impl}, f"{impl} side ran on {implementations}"
    assert not _state.fallbacks, f"fell back: {kvblocks.vllm.status().fallbacks}"


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
    assert hasher.__module__ == IMPLEMENTATION_MODULES[installed][1]
    requests = [make_request(f"r{i}", p, None) for i, p in enumerate(workload.prompts())]

    def hash_all() -> list[list[bytes]]:
        return [hasher(r) for r in requests]

    case = f"hash 256 prompts of 2,000 tokens at arrival, {algo}"
    _label(benchmark, case, installed)
    hashes = benchmark.pedantic(hash_all, rounds=5, warmup_rounds=1)
    assert all(len(h) == 125 for h in hashes)
    assert not _state.fallbacks, f"fell back: {kvblocks.vllm.status().fallbacks}"
    HASHES[(algo, installed)] = hashes
    if len(HASHES) % 2 == 0:  # both implementations ran: the same bytes
        assert HASHES[(algo, "vllm")] == HASHES[(algo, "kvblocks")]


WORKLOADS = {
    "shared prefix, 32 output tokens": Workload(output_len=32),
    "shared prefix, 128 output tokens (decode-heavy)": Workload(output_len=128),
}
#: The pool of the one-group scheduler cases above (on it stock vLLM preempts 7 times with 32
#: output tokens, 43 times with 128; kept, so that these figures compare with earlier runs).
ONE_GROUP_BLOCKS = 8192
#: Blocks per KV-cache group in the layout cases below: 93 shared blocks + 256 x 34 own ones
#: fit, so no request is preempted (the cases assert it). vLLM's groups share one pool: a
#: layout of n groups gets n times this (``pool_blocks``).
BLOCKS_PER_GROUP = 9216
#: The scheduler cases: (workload, KV-cache layout of ``config.LAYOUTS``, blocks per group).
#: The one-group cases on 8,192 blocks keep their names and set-up; then every layout,
#: one-group included, runs the 32-token workload with the same room per group.
#: Speculative decoding on the one-group layout, 3 draft tokens: n-gram proposals, and EAGLE
#: with vLLM's default lookahead block hashes (the fake model accepts 75% of drafts).
SPECULATION = {"n-gram": Speculation("ngram", 3), "EAGLE": Speculation("eagle", 3)}
#: vLLM's native CPU offloading (``--kv-offloading-size``: the OffloadingConnector with vLLM's
#: CPU tier and LRU, a fake worker side completing every transfer at once) on the one-group
#: layout and on qwen3.5 (its Mamba states offloaded too): a CPU tier of this many blocks per
#: KV-cache group, which stores every prompt block once.
OFFLOADING = "CPU offloading"
OFFLOADING_CHUNKS = 16384
#: The Mamba layouts also run without prefix caching (``--no-enable-prefix-caching``: vLLM's
#: Mamba cache mode "none", one block of ``max_model_len`` tokens per request and group).
NO_CACHING = "prefix caching off"
#: vLLM's decode-benchmark connector (``DecodeBenchConnector``): every prompt but its last
#: token arrives as dummy KV, so every step but a request's first is a decode step.
DECODE_BENCH = "DecodeBenchConnector"
MAMBA = [layout for layout, groups in LAYOUTS.items() if any(k == "mamba" for k, _ in groups)]
#: The layouts run with CPU offloading.
OFFLOADED = ["llama", "qwen3.5"]
#: (workload, layout, blocks per group, speculative method, OFFLOADING, NO_CACHING,
#: DECODE_BENCH or "").
SCHEDULER_CASES = (
    [(name, "llama", ONE_GROUP_BLOCKS, "") for name in WORKLOADS]
    + [("shared prefix, 32 output tokens", layout, BLOCKS_PER_GROUP, "") for layout in LAYOUTS]
    + [("shared prefix, 32 output tokens", "llama", BLOCKS_PER_GROUP, m) for m in SPECULATION]
    + [("shared prefix, 32 output tokens", m, BLOCKS_PER_GROUP, OFFLOADING) for m in OFFLOADED]
    + [("shared prefix, 32 output tokens", m, BLOCKS_PER_GROUP, NO_CACHING) for m in MAMBA]
    + [("shared prefix, 32 output tokens", "llama", BLOCKS_PER_GROUP, DECODE_BENCH)]
)

#: What the layout cases run in an untimed pass (``--benchmark-disable``, as CI runs
#: benches/): the same prompts, fewer requests and output tokens, so that every layout is
#: still run and checked without multiplying CI time.
UNTIMED_LAYOUT_WORKLOAD = Workload(num_requests=16, output_len=4)


def _is_layout_case(layout: str, blocks_per_group: int) -> bool:
    return not (layout == "llama" and blocks_per_group == ONE_GROUP_BLOCKS)


def _layout_case(case: str, layout: str) -> str:
    return f"{case}, {layout} layout ({describe_layout(layout)})"


def _assert_every_request_finished(snapshots: list[Any], workload: Workload) -> None:
    """The pool fits the workload: no request was preempted, and each was computed to its
    last token (its cache hit at admission plus every token scheduled for it)."""
    computed: dict[str, int] = {}
    for scheduled, new, _cached, _resumed, _finished, preempted, *_drafts in snapshots:
        assert not preempted, f"requests preempted: {preempted}; the pool is too small"
        for req_id, _blocks, hit in new:
            computed[req_id] = computed.get(req_id, 0) + hit
        for req_id, tokens in scheduled:
            computed[req_id] = computed.get(req_id, 0) + tokens
    last = workload.prompt_len + workload.output_len - 1  # the last sampled token is not fed
    assert computed == {f"r{i}": last for i in range(workload.num_requests)}


@pytest.mark.parametrize("installed", IMPLS, indirect=True)
@pytest.mark.parametrize(("name", "layout", "blocks_per_group", "method"), SCHEDULER_CASES)
def test_scheduler_cpu_time(
    benchmark: Any, installed: str, name: str, layout: str, blocks_per_group: int, method: str
) -> None:
    model_dir: Path = tiny_model_dir()
    spec = SchedulerSpec(
        block_size=16,
        num_blocks=pool_blocks(blocks_per_group, layout),
        layout=layout,
        hash_algo="sha256",
        enable_caching=method != NO_CACHING,
        mamba_checkpoint_alignment=mamba_checkpoint_alignment_for(layout, 16),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        speculative=SPECULATION.get(method),
        kv_offloading=pool_blocks(OFFLOADING_CHUNKS, layout) if method == OFFLOADING else 0,
        decode_bench="per request" if method == DECODE_BENCH else "",
    )
    layout_case = _is_layout_case(layout, blocks_per_group)
    workload = WORKLOADS[name]
    if layout_case and benchmark.disabled:
        workload = UNTIMED_LAYOUT_WORKLOAD
    runs: list[Any] = []

    def run_once() -> None:
        runs.append(timed_run(model_dir, spec, workload))

    case = f"vLLM scheduler, 256 requests, {name}"
    if method == OFFLOADING and layout == "llama":
        case = f"{case}, {method} ({OFFLOADING_CHUNKS:,} CPU blocks), {blocks_per_group:,} blocks"
    elif method == OFFLOADING:
        case = _layout_case(
            f"{case}, {method} ({OFFLOADING_CHUNKS:,} CPU blocks per group), "
            f"{blocks_per_group:,} blocks per group",
            layout,
        )
    elif method == DECODE_BENCH:
        case = f"{case}, {method} (every prompt filled), {blocks_per_group:,} blocks"
    elif method in SPECULATION:
        case = f"{case}, {method} speculative decoding (k=3), {blocks_per_group:,} blocks"
    elif layout_case:
        case = _layout_case(f"{case}, {blocks_per_group:,} blocks per group", layout)
        if method == NO_CACHING:
            case = f"{case}, {method}"
    _label(benchmark, case, installed)
    benchmark.pedantic(run_once, rounds=3, warmup_rounds=0)
    # Compared: the scheduler-side CPU time each run measured, not building the scheduler.
    runs.sort(key=lambda run: run[0].scheduler)
    timings, snapshots = runs[len(runs) // 2]
    benchmark.extra_info["seconds"] = timings.scheduler
    assert all(s == snapshots for _, s in runs)
    assert_ran_on(installed, *(t.implementation for t, _ in runs))
    if method == OFFLOADING:  # every request's prompt blocks were stored to the CPU tier
        _assert_every_request_finished(snapshots, workload)
        stores = [job for snap in snapshots for job in snap[STORES]]
        assert stores
        for g in (g for g, (kind, _) in enumerate(LAYOUTS[layout]) if kind == "mamba"):
            assert any(job[2][1][g] for job in stores), "and the Mamba states, by offer"
    elif method == DECODE_BENCH:  # every prompt arrived filled: one step per output token
        _assert_every_request_finished(snapshots, workload)
        assert all(hit == workload.prompt_len - 1 for s in snapshots for _, _, hit in s[1])
        assert sum(len(snap[FILLS]) for snap in snapshots) == workload.num_requests
    elif method in SPECULATION:  # drafts scheduled, some accepted: fewer steps than tokens
        assert any(snap[DRAFTS] for snap in snapshots)
        assert timings.steps < workload.output_len + 8
    elif layout_case:
        _assert_every_request_finished(snapshots, workload)
    SNAPSHOTS.setdefault(case, snapshots)
    assert snapshots == SNAPSHOTS[case], "kvblocks changed vLLM's scheduling decisions"
    # Where the time goes: one more run with a timer on every hasher and manager call.
    parts, _ = timed_run(model_dir, spec, workload, instrument=True)
    assert_ran_on(installed, parts.implementation)
    shares = {
        "hashing at arrival": parts.hashing / parts.scheduler,
        "KV-cache manager": parts.manager / parts.scheduler,
    }
    if parts.connector_calls:  # vLLM's connector code, on both sides of the comparison
        shares["KV connector"] = parts.connector / parts.scheduler
    benchmark.extra_info["shares"] = shares
    benchmark.extra_info["per_call"] = {
        method: seconds / calls for method, (calls, seconds) in parts.manager_calls.items() if calls
    }
    print(
        f"\n{case}, {installed}: {timings.steps} steps, scheduler-side CPU time "
        f"{timings.scheduler * 1e3:.0f} ms; " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items())
    )


@pytest.mark.parametrize("installed", IMPLS, indirect=True)
def test_cache_aware_admission(benchmark: Any, installed: str) -> None:
    """vLLM 0.34's cache-aware admission with a window of 64 and threshold 0 over a queue
    deeper than the window (256 requests, 32 running at most): every step asks the manager
    how many tokens of each of the 64 waiting requests at the head are cached
    (``get_num_cached_tokens``) and admits the deepest first."""
    model_dir: Path = tiny_model_dir()  # (selects vLLM's CPU platform before vLLM's config)
    if not scheduler_config_has("cache_aware_admission_window"):
        pytest.skip("vLLM 0.33 has no cache-aware admission (0.34's cache_aware_admission_window)")
    spec = SchedulerSpec(
        block_size=16,
        num_blocks=BLOCKS_PER_GROUP,
        hash_algo="sha256",
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        scheduler={"cache_aware_admission_window": 64, "cache_aware_admission_threshold": 0.0},
    )
    workload = WORKLOADS["shared prefix, 32 output tokens"]
    if benchmark.disabled:
        workload = UNTIMED_LAYOUT_WORKLOAD
    runs: list[Any] = []
    case = "vLLM scheduler, 256 requests, 32 running at most, cache-aware admission (window 64)"
    _label(benchmark, case, installed)
    benchmark.pedantic(lambda: runs.append(timed_run(model_dir, spec, workload)), rounds=3)
    runs.sort(key=lambda run: run[0].scheduler)
    timings, snapshots = runs[len(runs) // 2]
    benchmark.extra_info["seconds"] = timings.scheduler
    assert all(s == snapshots for _, s in runs)
    assert_ran_on(installed, *(t.implementation for t, _ in runs))
    SNAPSHOTS.setdefault(case, snapshots)
    assert snapshots == SNAPSHOTS[case], "kvblocks changed vLLM's scheduling decisions"
    # The manager's share from the instrumented run in the middle of three (one run's share
    # moves by a point or more on this shared machine).
    instrumented = [
        timed_run(model_dir, spec, workload, instrument=True)[0]
        for _ in range(1 if benchmark.disabled else 3)
    ]
    instrumented.sort(key=lambda run: run.manager / run.scheduler)
    parts = instrumented[len(instrumented) // 2]
    calls, _seconds = parts.manager_calls["get_num_cached_tokens"]
    assert calls > workload.num_requests  # the window probed every step
    shares = {"KV-cache manager": parts.manager / parts.scheduler}
    benchmark.extra_info["shares"] = shares
    benchmark.extra_info["per_call"] = {
        method: seconds / n for method, (n, seconds) in parts.manager_calls.items() if n
    }
    print(
        f"\n{case}, {installed}: {timings.steps} steps, scheduler-side CPU time "
        f"{timings.scheduler * 1e3:.0f} ms; KV-cache manager {shares['KV-cache manager']:.1%}, "
        f"{calls} get_num_cached_tokens calls"
    )


@pytest.mark.parametrize("installed", [*IMPLS, FLOOR], indirect=True)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_allocate_slots(benchmark: Any, installed: str, layout: str) -> None:
    """One decode step's ``allocate_slots`` calls (one new token for every running request),
    made directly in a steady decode state, without the per-call timers of the runs above;
    the floor variant makes the same calls to :func:`allocate_slots_floor` (on stock vLLM's
    scheduler), and kvblocks' row reports its time over the floor's. kvblocks' row also
    reports the share of the step that its always-on check of every allocation takes: the
    step timed with the check on and off in alternation (:func:`check_share`)."""
    # 93 shared blocks + 256 x 33 own ones per group: every request runs, none is preempted.
    spec = SchedulerSpec(
        block_size=16,
        num_blocks=pool_blocks(BLOCKS_PER_GROUP, layout),
        layout=layout,
        mamba_checkpoint_alignment=mamba_checkpoint_alignment_for(layout, 16),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    scheduler = make_scheduler(tiny_model_dir(), spec)
    hasher = block_hasher(spec.hash_algo, spec.block_size) if spec.enable_caching else None
    untimed = benchmark.disabled and layout != "llama"
    prompts = (UNTIMED_LAYOUT_WORKLOAD if untimed else Workload()).prompts()
    requests = [
        make_request(f"r{i}", prompt, hasher, max_tokens=1000) for i, prompt in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add_request(request)
    model = FakeModel()
    while any(r.num_output_tokens == 0 for r in requests):  # until every request decodes
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.execute(scheduler, out))
    running = list(scheduler.running)
    assert len(running) == len(requests) == len(prompts)
    manager = "vllm" if installed == FLOOR else installed
    assert_ran_on(manager, implementation_of(scheduler.kv_cache_manager, hasher))
    allocate: Callable[..., Any] = (
        allocate_slots_floor if installed == FLOOR else scheduler.kv_cache_manager.allocate_slots
    )

    def step() -> None:
        for request in running:
            allocate(request, 1, num_lookahead_tokens=0)

    case = "decode step: allocate_slots for 256 running requests"
    if layout != "llama":  # the one-group case keeps its name
        case = _layout_case(case, layout)
    _label(benchmark, case, installed)
    if installed == "kvblocks":
        benchmark.extra_info["floors"] = [[case, FLOOR]]
        if not benchmark.disabled:
            share = check_share(scheduler.kv_cache_manager._core, step)
            benchmark.extra_info["shares"] = {"kvblocks' allocation check": share}
    benchmark(step)


def check_share(core: Any, step: Callable[[], None], rounds: int = 301) -> float:
    """The share of ``step`` that kvblocks' check of every allocation takes: ``step`` timed
    with the check on and off in alternation (``_core.KVCacheManager._check_allocations``,
    benchmark only), ``1 - median(off) / median(on)``. A repeated decode call allocates
    nothing new (the request's computed tokens do not move), so every round does the same
    work; alternating cancels drift on a shared machine."""
    on, off = [], []
    try:
        for _ in range(rounds):
            for enabled, times in ((True, on), (False, off)):
                core._check_allocations(enabled)
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    finally:
        core._check_allocations(True)
    return 1 - statistics.median(off) / statistics.median(on)
