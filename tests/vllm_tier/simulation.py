"""The tier's scripted runs of vLLM's scheduler: either implementation in place
(:func:`implementation`), and :func:`run`, which drives a scheduler through a script of
arrivals, aborts, cache resets and actions and records everything each step decided and
published. The schedulers, requests and fake model come from :mod:`tests.vllm_driver`.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

import kvblocks.vllm
from kvblocks.vllm import _state
from kvblocks.vllm.kv_cache_manager import KVCacheManager
from tests.vllm_driver import Drafter, FakeModel, drafter_for, snapshot

#: The two sides of every comparison: stock vLLM, and vLLM with kvblocks installed.
IMPLS = ("vllm", "kvblocks")
#: Where the last exception :func:`run` caught was raised (``"file.py:function"``).
last_raise: str | None = None


@contextmanager
def implementation(impl: str) -> Iterator[type]:
    """Stock vLLM (``"vllm"``) or kvblocks installed in mode ``"all"`` (``"kvblocks"``, with
    the fallback counts cleared) for the block, then vLLM's own code again. Yields the class
    of KV-cache manager a scheduler built inside must have."""
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    kvblocks.vllm.uninstall()
    if impl == "kvblocks":
        kvblocks.vllm.install("all")
        _state.fallbacks.clear()
        manager: type = KVCacheManager
    else:
        manager = VllmKVCacheManager
    try:
        yield manager
    finally:
        kvblocks.vllm.uninstall()


class EventRecorder:
    """Stands in for vLLM's KV-event publisher and keeps every batch's events as plain data."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append([(type(e).__name__, msgspec.to_builtins(e)) for e in batch.events])

    def shutdown(self) -> None:
        pass

    def take(self) -> list[list[Any]]:
        batches, self.batches = self.batches, []
        return batches


def _outputs(engine_outputs: dict[int, Any]) -> tuple[Any, ...]:
    """The request outputs (with their prefill statistics, which ``estimate_cached_tokens``
    feeds) and the prefix-cache and speculative-decoding statistics of one
    ``update_from_output``."""
    outputs, stats = [], None
    for eco in engine_outputs.values():
        outputs += [
            (
                o.request_id,
                list(o.new_token_ids),
                str(o.finish_reason),
                None if o.prefill_stats is None else dataclasses.astuple(o.prefill_stats),
                # what a KV connector hands on (NIXL: a prefill's blocks for the decode node)
                o.kv_transfer_params,
            )
            for o in eco.outputs
        ]
        if eco.scheduler_stats is not None:
            s = eco.scheduler_stats
            p = s.prefix_cache_stats
            d = s.spec_decoding_stats
            stats = (
                round(s.kv_cache_usage, 12),
                (p.reset, p.requests, p.queries, p.hits),
                (p.preempted_requests, p.preempted_queries, p.preempted_hits),
                None if d is None else dataclasses.asdict(d),
            )
    return tuple(outputs), stats


#: Something a script does before a step's ``schedule()``; what it returns is recorded.
Action = Callable[[Scheduler], Any]


def run(
    scheduler: Scheduler,
    arrivals: Iterable[tuple[int, Request]] = (),
    *,
    aborts: Iterable[tuple[int, str]] = (),
    resets: Iterable[int] = (),
    actions: Mapping[int, Iterable[Action]] | None = None,
    lag: int | None = None,
    catch: bool = False,
    max_steps: int = 10_000,
    publisher: Any = None,
    drafter: Drafter | None = None,
) -> list[tuple[Any, ...]]:
    """Drives ``scheduler`` to the end of a script: before a step's ``schedule()``, the
    requests arriving at that step are added, its aborts and its ``reset_prefix_cache()`` call
    happen, then its ``actions`` run. The run ends once no request is left, no output is in
    flight, and no arrival or action is still to come.

    Returns, per step: the step's :func:`snapshot` followed by the ``SchedulerOutput``'s
    ``num_common_prefix_blocks`` (None where it scheduled nothing), the request outputs, the
    prefix-cache statistics, the KV events published, the reset's result, the results of the
    step's actions, and every live request's block ids in each group; then the arrivals'
    final block hashes. Each model output is handed back ``lag`` steps late (by
    default 1 for an ``AsyncScheduler``, as under async scheduling, else 0; more is a
    pipeline-parallel batch queue), one output a step, as ``EngineCore`` does; a step
    schedules only when there are requests or nothing is in flight. With speculative
    decoding, the fake model verifies drafts and proposes new ones (``drafter``, by default
    :func:`~tests.vllm_driver.drafter_for`'s); synchronously, ``EngineCore``'s
    ``post_step`` hands them to ``update_draft_token_ids`` after each step that ran the
    model (there is no batch queue with speculative decoding here). With ``catch``, an
    exception ends the run and is its last record, ``("raised", type name, message)``. With
    ``publisher`` (e.g. vLLM's ZMQ publisher), KV events go there instead of into the
    records."""
    pending = sorted(arrivals, key=lambda a: a[0])
    abort_at = sorted(aborts)
    reset_steps = set(resets)
    actions = actions or {}
    last = max([*actions, *(step for step, _ in pending)], default=-1)
    recorder = EventRecorder()
    scheduler.kv_event_publisher = recorder if publisher is None else publisher
    model = FakeModel(drafter_for(scheduler) if drafter is None else drafter)
    if lag is None:
        # vLLM may turn the config flag off on the CPU, so the class decides.
        lag = 1 if isinstance(scheduler, AsyncScheduler) else 0
    hands_drafts = model.drafter is not None and not model.drafter.in_worker
    if hands_drafts and lag:
        raise ValueError("speculative decoding runs synchronously or under async scheduling")
    manager = scheduler.kv_cache_manager
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    steps: list[tuple[Any, ...]] = []
    requests: list[Request] = []
    for step in range(max_steps):
        try:
            while pending and pending[0][0] <= step:
                request = pending.pop(0)[1]
                requests.append(request)
                scheduler.add_request(request)
            while abort_at and abort_at[0][0] <= step:
                scheduler.finish_requests(abort_at.pop(0)[1], RequestStatus.FINISHED_ABORTED)
            reset = scheduler.reset_prefix_cache() if step in reset_steps else None
            results = tuple(action(scheduler) for action in actions.get(step, ()))
            if step > last and not scheduler.has_requests() and not in_flight:
                break
            snap: tuple[Any, ...] | None = None
            if scheduler.has_requests() or not in_flight:
                out = scheduler.schedule()
                in_flight.append((out, model.execute(scheduler, out)))
                # num_common_prefix_blocks last, after the snapshot's fields (tests index them;
                # vLLM 0.34 has none: empty).
                common = getattr(out, "num_common_prefix_blocks", ())
                snap = (*snapshot(out), list(common))
            outputs: tuple[Any, ...] = ((), None)
            if len(in_flight) > lag or not scheduler.has_requests():
                done, result = in_flight.pop(0)
                outputs = _outputs(scheduler.update_from_output(done, result))
                drafts = model.take_draft_token_ids()
                if drafts is not None and done.total_num_scheduled_tokens:
                    scheduler.update_draft_token_ids(drafts)
            tables = sorted(
                (rid, tuple(map(tuple, manager.get_blocks(rid).get_block_ids())))
                for rid in scheduler.requests
            )
        except Exception as error:
            if not catch:
                raise
            # both managers must raise alike: the same exception, the same message
            steps.append(("raised", type(error).__name__, str(error)))
            global last_raise
            frame = traceback.extract_tb(error.__traceback__)[-1]
            last_raise = f"{Path(frame.filename).name}:{frame.name}"
            return steps
        steps.append((snap, *outputs, recorder.take(), reset, results, tables))
    else:
        raise AssertionError(f"the workload did not finish in {max_steps} steps")
    steps.append(tuple((r.request_id, list(r.block_hashes)) for r in requests))
    return steps
