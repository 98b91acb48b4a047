"""Timed runs of vLLM's scheduler: what ``benches/bench_vllm.py`` and
``kvblocks bench --engine vllm`` measure.

A run adds every request of a :class:`Workload` at once and steps the scheduler to the end
with the fake model; :class:`Timings` holds the scheduler-side CPU time it took and, in an
instrumented run, where that time went.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblocks.vllm.bench.config import SchedulerSpec, make_scheduler
from kvblocks.vllm.bench.fake_model import block_hasher, make_request
from kvblocks.vllm.bench.platform import VOCAB_SIZE
from kvblocks.workloads import shared_prefix_prompts

#: The KV-cache manager methods vLLM's scheduler calls, timed by :func:`timed_run`.
MANAGER_METHODS = (
    "new_step_starts",
    "get_computed_blocks",
    "allocate_slots",
    "get_blocks",
    "cache_blocks",
    "estimate_cached_tokens",
    "get_num_cached_tokens",  # vLLM 0.34's cache-aware admission probe
    "free",
    "take_events",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "reset_prefix_cache",
)
#: The KV connector's scheduler-side methods vLLM's scheduler calls, timed by
#: :func:`timed_run` where the scheduler has a connector (vLLM's code with either manager).
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc",
    "on_new_request",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_kv_connector_stats",
)


@dataclass(frozen=True)
class Workload:
    """Requests that share a prefix: ``num_requests`` prompts of ``prompt_len`` tokens whose
    first ``shared_len`` tokens are the same, ``output_len`` generated tokens each."""

    num_requests: int = 256
    prompt_len: int = 2000
    shared_len: int = 1500
    output_len: int = 32

    def prompts(self) -> list[list[int]]:
        own = self.prompt_len - self.shared_len
        return shared_prefix_prompts(self.num_requests, self.shared_len, own, vocab_size=VOCAB_SIZE)


#: The modules of the KV-cache manager and the request block hasher a run used, by
#: implementation (what :func:`implementation_of` recognises).
IMPLEMENTATION_MODULES = {
    "vllm": ("vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils"),
    "kvblocks": ("kvblocks.vllm.kv_cache_manager", "kvblocks.vllm.block_hasher"),
}


def implementation_of(manager: Any, hasher: Any) -> str:
    """``"kvblocks"`` when the scheduler's KV-cache manager and the request block hasher are
    both kvblocks', ``"vllm"`` when both are vLLM's own, else a description of the mix
    (e.g. ``"manager vllm.v1.core.kv_cache_manager, hasher kvblocks.vllm.block_hasher"``):
    a run meant to measure kvblocks measured it only if this says so. Without prefix caching
    there is no hasher (``None``): the manager decides."""
    modules = (type(manager).__module__, getattr(hasher, "__module__", None))
    for name, expected in IMPLEMENTATION_MODULES.items():
        if modules == expected or (hasher is None and modules[0] == expected[0]):
            return name
    return f"manager {modules[0]}, hasher {modules[1]}"


@dataclass
class Timings:
    """Scheduler-side CPU time of one run, in seconds."""

    arrival: float = 0.0  # building the requests (hashing their prompts) and add_request
    hashing: float = 0.0  # inside the request block hasher, at arrival
    schedule: float = 0.0
    update: float = 0.0  # update_from_output (appending tokens hashes new full blocks)
    manager: float = 0.0  # inside the KV-cache manager, during schedule and update
    manager_calls: dict[str, list[float]] = field(default_factory=dict)  # name -> [calls, s]
    connector: float = 0.0  # inside the KV connector's scheduler side (arrival included)
    connector_calls: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0
    #: Whose manager and hasher ran: ``"vllm"``, ``"kvblocks"`` or a mix
    #: (:func:`implementation_of`).
    implementation: str = ""

    @property
    def scheduler(self) -> float:
        """Request arrival + ``schedule()`` + ``update_from_output()``."""
        return self.arrival + self.schedule + self.update


def _timed(
    function: Callable[..., Any], slot: list[float], overhead: float | None = None
) -> Callable[..., Any]:
    """``function``, adding one call and the seconds it took to ``slot``, minus what the
    wrapper itself adds inside its timed region (so that a cheap method is not charged for
    the timer: see :func:`_timer_overhead`)."""
    clock = time.perf_counter
    if overhead is None:
        overhead = _timer_overhead()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return function(*args, **kwargs)
        finally:
            slot[0] += 1
            slot[1] += clock() - start - overhead

    return wrapper


@functools.cache
def _timer_overhead() -> float:
    """The seconds a timed call of a no-op records, measured once: the clock call and the
    argument forwarding that the wrapper adds to every timed call, with the call shape of
    the scheduler's most frequent call (``allocate_slots(request, n, num_lookahead_tokens=0)``)."""

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    rounds = []
    for _ in range(5):
        slot = [0.0, 0.0]
        timed = _timed(noop, slot, overhead=0.0)
        target = object()
        for _ in range(20_000):
            timed(target, 1, num_lookahead_tokens=0)
        rounds.append(slot[1] / slot[0])
    return min(rounds)


def timed_run(
    model_dir: Path, spec: SchedulerSpec, workload: Workload, *, instrument: bool = False
) -> tuple[Timings, list[tuple[Any, ...]]]:
    """Adds every request of ``workload`` at once, then steps vLLM's scheduler to the end.
    Returns the timings and each step's :func:`snapshot` (to check two runs are identical);
    ``Timings.implementation`` says whose KV-cache manager and hasher the run used.

    ``instrument`` also times every call of the request block hasher, of the KV-cache
    manager's methods (``hashing``, ``manager``, ``manager_calls``) and of the KV connector's
    scheduler-side methods (``connector``, ``connector_calls``: vLLM's code on both sides,
    which kvblocks does not replace); the timers slow the run down, so compare totals of runs
    without them.

    With speculative decoding (a spec whose fake model drafts) the fake model verifies drafts and
    proposes new ones, which reach the scheduler as ``EngineCore.post_step`` hands them over
    (``update_draft_token_ids``, counted in ``update``), and the request block hasher hashes
    as many lookahead tokens as the configuration says.

    As vLLM's ``EngineCore`` does once its start-up is done, the heap is frozen for the
    garbage collector (:func:`_static_heap`) while the run goes."""
    scheduler = make_scheduler(model_dir, spec)
    with _static_heap():
        return _drive(scheduler, spec, workload, instrument)


@contextlib.contextmanager
def _static_heap() -> Iterator[None]:
    """vLLM's ``EngineCore`` marks the heap its start-up built as static for the garbage
    collector (vLLM's ``freeze_gc_heap``) and undoes it at shutdown; the runs do the same with
    each scheduler, so that the collector's passes during a run scan what the run allocates,
    not the scheduler's start-up or what earlier runs in the process left behind."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    try:
        yield
    finally:
        gc.unfreeze()


#: Steps in a row in which vLLM's scheduler schedules nothing while no request runs, after
#: which a run stops with an error (the pool cannot hold one request; a KV connector's load
#: keeps a request waiting a step or two, never this long).
STALLED_STEPS = 100


def _drive(
    scheduler: Any, spec: SchedulerSpec, workload: Workload, instrument: bool
) -> tuple[Timings, list[tuple[Any, ...]]]:
    """:func:`timed_run` on a scheduler already built."""
    timings = Timings()
    lookahead = scheduler.vllm_config.num_hash_lookahead_tokens
    # EngineCore hashes requests only for prefix caching or a KV connector.
    hashing = spec.enable_caching or spec.has_kv_connector
    hasher = block_hasher(spec.hash_algo, spec.block_size, lookahead) if hashing else None
    timings.implementation = implementation_of(scheduler.kv_cache_manager, hasher)
    hasher_slot = [0.0, 0.0]
    if instrument and hasher is not None:
        hasher = _timed(hasher, hasher_slot)
    if instrument:
        manager = scheduler.kv_cache_manager
        for name in MANAGER_METHODS:
            method = getattr(manager, name, None)
            if method is not None:
                slot = timings.manager_calls.setdefault(name, [0.0, 0.0])
                setattr(manager, name, _timed(method, slot))
        connector = scheduler.connector
        for name in CONNECTOR_METHODS if connector is not None else ():
            method = getattr(connector, name, None)
            if method is not None:
                slot = timings.connector_calls.setdefault(name, [0.0, 0.0])
                setattr(connector, name, _timed(method, slot))
    prompts = workload.prompts()
    model = spec.fake_model(scheduler)
    clock = time.perf_counter
    start = clock()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, hasher, max_tokens=workload.output_len))
    timings.arrival = clock() - start
    timings.hashing = hasher_slot[1]
    manager_at_arrival = sum(s for _, s in timings.manager_calls.values())
    snapshots = []
    idle = 0  # steps in a row that scheduled nothing with no request running
    while scheduler.has_requests():
        start = clock()
        out = scheduler.schedule()
        timings.schedule += clock() - start
        idle = idle + 1 if not out.total_num_scheduled_tokens and not scheduler.running else 0
        if idle > STALLED_STEPS:
            raise ValueError(
                f"vLLM's scheduler admitted no request in {STALLED_STEPS} steps: the pool "
                f"({spec.num_blocks} blocks) cannot hold one request; raise --num-blocks"
            )
        # The model's step (and the connector's fake worker side) is not the scheduler's.
        result = model.execute(scheduler, out)
        drafts = model.take_draft_token_ids()
        start = clock()
        scheduler.update_from_output(out, result)
        if drafts is not None and out.total_num_scheduled_tokens:
            scheduler.update_draft_token_ids(drafts)
        timings.update += clock() - start
        timings.steps += 1
        snapshots.append(model.snapshot(out))
    timings.manager = sum(s for _, s in timings.manager_calls.values()) - manager_at_arrival
    timings.connector = sum(s for _, s in timings.connector_calls.values())
    return timings, snapshots
