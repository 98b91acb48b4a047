"""What kvblocks is worth in tokens/s: vLLM's own engine-core loop on a modelled device.

vLLM's ``EngineCore`` is built by its own constructor (the plugin loading as in production),
with an executor whose device is instant and whose own CPU is not counted, and driven as
vLLM's busy loop drives it: ``step_with_batch_queue`` under async scheduling (a batch queue of
two: the next batch is scheduled while the device runs the last), ``step`` without it, and
each step's outputs encoded with vLLM's ``MsgpackEncoder`` as its output thread does. The run
records, per call, the engine thread's CPU time before the call submits its batch, the batch's
scheduled tokens, whether the call then waits for the oldest batch, and the CPU time after.

vLLM's loop decides from the order of its calls alone, never from whether a batch is done
yet (its batch queue blocks only when full), so one recorded run serves every device speed:
:func:`replay` lays the recorded CPU segments and a device step of ``base + per-token``
time each on one timeline, as a dedicated core and a device would run them, and gives
tokens/s, time to first token, inter-token latency, CPU per step and how long the device
waited. On a shared, noisy machine that is the figure a dedicated core would give; the CPU
segments themselves are measured, so the engine thread's real work is what is replayed.

Not modelled: the GIL shared with vLLM's output thread (encoding is counted on the engine
thread here, as if it took the GIL from it), the device's launch latency, and the CPU a real
model runner spends preparing inputs (on the worker process, not the engine core).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvblocks.vllm
import kvblocks.vllm._state as _state
from kvblocks.vllm.bench.config import SchedulerSpec, make_vllm_config, tiny_model_dir
from kvblocks.vllm.bench.fake_model import model_output, sampled_token
from kvblocks.vllm.bench.platform import VOCAB_SIZE

IMPLS = ("vllm", "kvblocks")
LAYER = "model.layers.0.self_attn.attn"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class EngineWorkload:
    """``num_running`` requests arriving together, each a shared prefix and a tail of its
    own, ``output_len`` tokens each, so that all of them run at once once their prefills are
    done (:data:`WORKLOADS`)."""

    num_running: int
    prefix_len: int = 512
    tail_len: int = 64
    output_len: int = 64
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        import random

        rng = random.Random(self.seed)
        prefix = [rng.randrange(VOCAB_SIZE) for _ in range(self.prefix_len)]
        return [
            prefix + [rng.randrange(VOCAB_SIZE) for _ in range(self.tail_len)]
            for _ in range(self.num_running)
        ]

    def spec(self, async_scheduling: bool) -> SchedulerSpec:
        per_request = -(-(self.prefix_len + self.tail_len + self.output_len) // BLOCK_SIZE) + 1
        return SchedulerSpec(
            block_size=BLOCK_SIZE,
            num_blocks=per_request * self.num_running + 64,
            max_num_seqs=self.num_running,
            max_num_batched_tokens=max(8192, self.num_running),
            max_model_len=self.prefix_len + self.tail_len + self.output_len + BLOCK_SIZE,
            async_scheduling=async_scheduling,
        )


#: The workloads by name, as (prefix, tail, output) lengths: a 512-token shared prefix (a
#: long system prompt or document) with a 64-token question; and chats, a 256-token system
#: prompt with 768 tokens of conversation of their own and longer answers.
WORKLOADS = {"shared prefix": (512, 64, 64), "chat": (256, 768, 128)}


def workload(name: str, num_running: int, output_len: int | None = None) -> EngineWorkload:
    prefix, tail, output = WORKLOADS[name]
    return EngineWorkload(num_running, prefix, tail, output_len or output)


@dataclass
class Call:
    """One call of vLLM's loop (``step_with_batch_queue`` or ``step``) and its outputs."""

    #: Engine-thread CPU seconds before the call submitted its batch (or before it waited).
    before: float = 0.0
    #: The scheduled tokens of the batch it submitted (None: it submitted none).
    tokens: int | None = None
    #: Engine-thread CPU seconds from the submission to the wait (or to the call's end).
    between: float = 0.0
    #: Whether it then waited for the oldest batch in flight.
    waits: bool = False
    #: Engine-thread CPU seconds after the wait (``update_from_output``, encoding).
    after: float = 0.0
    #: (request id, tokens) the call's outputs gave each request.
    emitted: list[tuple[str, int]] = field(default_factory=list)

    @property
    def cpu(self) -> float:
        return self.before + self.between + self.after


@dataclass
class Recording:
    """One side's run: the CPU of adding the requests, then every call."""

    impl: str
    arrival: float
    calls: list[Call]
    tokens: dict[str, list[int]]
    queue_size: int


class _Clock:
    """Splits a call's engine-thread CPU at the submission and at the wait, leaving out what
    the instant executor itself spends (a device's work, not the engine's)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.call = Call()
        self._mark = time.thread_time()
        self._excluded = 0.0
        self._phase = "before"

    def _split(self) -> float:
        now = time.thread_time()
        spent = now - self._mark - self._excluded
        self._mark, self._excluded = now, 0.0
        return max(spent, 0.0)

    def _close_phase(self) -> None:
        spent = self._split()
        setattr(self.call, self._phase, getattr(self.call, self._phase) + spent)

    def submitted(self, tokens: int) -> None:
        if self._phase == "before":
            self._close_phase()
            self.call.tokens = tokens
            self._phase = "between"

    def waiting(self) -> None:
        if self._phase != "after":
            self._close_phase()
            self.call.waits = True
            self._phase = "after"

    def exclude(self, seconds: float) -> None:
        self._excluded += seconds

    def finish(self) -> Call:
        self._close_phase()
        return self.call


class _Waited(Future):  # type: ignore[type-arg]
    """A batch's result: asking for it is where vLLM's loop waits for the device."""

    def __init__(self, clock: _Clock, value: Any) -> None:
        super().__init__()
        self._clock = clock
        self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        self._clock.waiting()
        return super().result(timeout)


def _executor_class(clock: _Clock) -> type:
    """vLLM's ``Executor`` with one full-attention layer and an instant device that samples
    :func:`~kvblocks.vllm.bench.fake_model.sampled_token` for every request whose prefill is
    done; its own CPU is left out of the engine's (``clock``)."""
    import torch
    from vllm.v1.executor import Executor
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    class InstantExecutor(Executor):  # type: ignore[misc]
        def _init_executor(self) -> None:
            self._lengths: dict[str, list[int]] = {}
            self._pending: Any = None

        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"no workers (collective_rpc {method!r})")

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

        @property
        def supported_tasks(self) -> tuple[str, ...]:
            return ("generate",)

        def get_kv_cache_specs(self) -> list[dict[str, Any]]:
            spec = FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32
            )
            return [{LAYER: spec}]

        def get_supported_kv_cache_layouts(self) -> list[list[str]]:
            return [["LBNHC"]]

        def set_kv_cache_layout(self, layout_name: str, interleave: int) -> None:
            pass

        def determine_available_memory(self) -> list[int]:
            return [1 << 40]

        def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
            pass

        def compile_or_warm_up_model(self) -> None:
            pass

        def execute_model(self, out: Any, non_block: bool = False) -> Any:
            began = time.thread_time()
            clock.submitted(out.total_num_scheduled_tokens)
            computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            for r in out.scheduled_new_reqs:
                self._lengths.setdefault(r.req_id, [len(r.prompt_token_ids), 0])
            cached = out.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            req_ids = list(out.num_scheduled_tokens)
            sampled: list[list[int]] = []
            for req_id in req_ids:
                length = self._lengths[req_id]
                if computed[req_id] + out.num_scheduled_tokens[req_id] < sum(length):
                    sampled.append([])
                    continue
                sampled.append([sampled_token(req_id, length[1])])
                length[1] += 1
            for req_id in out.finished_req_ids:
                self._lengths.pop(req_id, None)
            result = None
            if out.total_num_scheduled_tokens == 0:
                result = EMPTY_MODEL_RUNNER_OUTPUT
            else:
                self._pending = model_output(req_ids, sampled, None)
            clock.exclude(time.thread_time() - began)
            return _Waited(clock, result) if non_block else result

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            result, self._pending = self._pending, None
            if not non_block:
                clock.waiting()
                return result
            return _Waited(clock, result)

    return InstantExecutor


@contextmanager
def _side(impl: str) -> Iterator[None]:
    if impl == "kvblocks":
        kvblocks.vllm.install("all")
    else:
        kvblocks.vllm.uninstall()
    _state.fallbacks.clear()
    try:
        yield
    finally:
        kvblocks.vllm.uninstall()


def record(
    impl: str,
    workload: EngineWorkload,
    async_scheduling: bool,
    model_dir: Path | None = None,
    profiler: Any = None,
) -> Recording:
    """One run of ``workload`` through vLLM's ``EngineCore`` on ``impl``'s manager and hasher
    (asserted: a kvblocks run that fell back would measure vLLM against itself). A
    ``profiler`` (``cProfile.Profile``) runs around the loop alone."""
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.serial_utils import MsgpackEncoder

    clock = _Clock()
    spec = workload.spec(async_scheduling)
    # What earlier runs in the process left behind is not this run's to collect (vLLM's
    # EngineCore then freezes the heap its start-up built, as in production).
    gc.collect()
    with _side(impl):
        config = make_vllm_config(model_dir or tiny_model_dir(), spec)
        config.cache_config.num_gpu_blocks_override = spec.num_blocks
        # vLLM's CPU platform turns async scheduling off; the loop under test is the GPU's.
        config.scheduler_config.async_scheduling = async_scheduling
        engine = EngineCore(config, executor_class=_executor_class(clock), log_stats=True)
        manager = type(engine.scheduler.kv_cache_manager).__module__
        expected = "kvblocks.vllm.kv_cache_manager" if impl == "kvblocks" else "vllm."
        assert manager.startswith(expected), f"{impl} ran on {manager}"
        assert not _state.fallbacks, f"fell back: {dict(_state.fallbacks)}"
        processor = InputProcessor(config)
        tasks = engine.get_supported_tasks()
        params = SamplingParams(max_tokens=workload.output_len, ignore_eos=True)
        began = time.thread_time()
        for i, prompt in enumerate(workload.prompts()):
            request = processor.process_inputs(
                f"r{i}", tokens_input(prompt), params, tasks, arrival_time=0.0
            )
            engine.add_request(*engine.preprocess_add_request(request))
        arrival = time.thread_time() - began
        encoder = MsgpackEncoder()
        queue = engine.batch_queue
        step = engine.step_with_batch_queue if queue is not None else engine.step
        calls: list[Call] = []
        tokens: dict[str, list[int]] = {}
        if profiler is not None:
            profiler.enable()
        while engine.scheduler.has_requests() or queue:
            clock.start()
            outputs, _ = step()
            for eco in (outputs or {}).values():
                encoder.encode(eco)
                for o in eco.outputs:
                    if o.new_token_ids:
                        clock.call.emitted.append((o.request_id, len(o.new_token_ids)))
                        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            calls.append(clock.finish())
        if profiler is not None:
            profiler.disable()
        engine.shutdown()
    return Recording(impl, arrival, calls, tokens, engine.batch_queue_size)


def median_recording(runs: list[Recording]) -> Recording:
    """Runs of one side on one workload merged call by call: each CPU segment the median of
    the runs' (their calls are the same decisions, so they line up; a call that a pause of
    the machine lengthened in one run does not move the figure)."""
    first = runs[0]
    for run in runs[1:]:
        same = run.tokens == first.tokens and len(run.calls) == len(first.calls)
        if not same or any(
            (a.tokens, a.waits, a.emitted) != (b.tokens, b.waits, b.emitted)
            for a, b in zip(first.calls, run.calls, strict=True)
        ):
            raise ValueError("the runs did not take the same decisions: they cannot be merged")
    calls = [
        Call(
            before=statistics.median(r.calls[i].before for r in runs),
            tokens=call.tokens,
            between=statistics.median(r.calls[i].between for r in runs),
            waits=call.waits,
            after=statistics.median(r.calls[i].after for r in runs),
            emitted=call.emitted,
        )
        for i, call in enumerate(first.calls)
    ]
    arrival = statistics.median(r.arrival for r in runs)
    return Recording(first.impl, arrival, calls, first.tokens, first.queue_size)


@dataclass(frozen=True)
class DeviceModel:
    """A device step of ``base_ms`` plus ``per_token_us`` per scheduled token (none for a
    batch of no tokens)."""

    base_ms: float
    per_token_us: float = 1.0

    def seconds(self, tokens: int) -> float:
        return 0.0 if tokens == 0 else self.base_ms / 1e3 + tokens * self.per_token_us / 1e6


@dataclass(frozen=True)
class Replayed:
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    cpu_per_step: float
    device_idle: float
    steps: int


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def replay(recording: Recording, device: DeviceModel) -> Replayed:
    """The recorded calls and a device of ``device``'s speed on one timeline (see the
    module's documentation): the engine thread runs each call's CPU in order; a submitted
    batch starts on the device once the device is free and the batch is submitted; a call
    that waits resumes once the oldest batch in flight is done."""
    t = recording.arrival
    device_free = 0.0
    busy = 0.0
    in_flight: deque[float] = deque()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    total = 0
    steps = 0
    cpu = recording.arrival
    for call in recording.calls:
        t += call.before
        cpu += call.cpu
        if call.tokens is not None:
            steps += call.tokens > 0
            seconds = device.seconds(call.tokens)
            device_free = max(t, device_free) + seconds
            busy += seconds
            in_flight.append(device_free)
        t += call.between
        if call.waits and in_flight:
            t = max(t, in_flight.popleft())
        t += call.after
        for request_id, n in call.emitted:
            total += n
            if request_id in last:
                gaps.append((t - last[request_id]) / n)
            else:
                first[request_id] = t
            last[request_id] = t
    ttfts = list(first.values())
    return Replayed(
        tokens_per_s=total / t if t > 0 else 0.0,
        ttft_p50=statistics.median(ttfts) if ttfts else 0.0,
        ttft_p99=_percentile(ttfts, 0.99),
        itl_p50=statistics.median(gaps) if gaps else 0.0,
        itl_p99=_percentile(gaps, 0.99),
        cpu_per_step=cpu / max(steps, 1),
        device_idle=1.0 - busy / t if t > 0 else 0.0,
        steps=steps,
    )


def compare_sides(
    load: EngineWorkload,
    async_scheduling: bool,
    rounds: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Recording]:
    """Each side's ``rounds`` runs of ``load`` (stock and kvblocks alternating, stock first),
    merged call by call (:func:`median_recording`). A RuntimeError where the sides' outputs
    differ (a kvblocks run must generate exactly what stock vLLM does)."""
    runs: dict[str, list[Recording]] = {impl: [] for impl in IMPLS}
    for _ in range(rounds):
        for impl, side in runs.items():
            side.append(record(impl, load, async_scheduling))
            if progress is not None:
                progress(impl)
    recordings = {impl: median_recording(side) for impl, side in runs.items()}
    stock, ours = recordings["vllm"].tokens, recordings["kvblocks"].tokens
    if stock != ours:
        differ = sorted(r for r in stock if stock[r] != ours.get(r))
        raise RuntimeError(f"kvblocks' outputs differ from stock vLLM's for {differ[:5]}")
    if len(stock) != load.num_running or any(len(t) != load.output_len for t in stock.values()):
        raise RuntimeError("a request did not generate its output_len tokens")
    return recordings


def sweep_rows(
    name: str,
    load: EngineWorkload,
    async_scheduling: bool,
    recordings: dict[str, Recording],
    device_steps_ms: list[float],
) -> list[dict[str, Any]]:
    """The replay of both sides' recordings at each device step: one row per step, with
    each side's :class:`Replayed` figures and the tokens/s gain."""
    rows = []
    for ms in device_steps_ms:
        device = DeviceModel(ms)
        stock, ours = (replay(recordings[impl], device) for impl in IMPLS)
        # The device's busy time is the same work on both sides.
        if not stock.steps == ours.steps > 0:
            raise RuntimeError(f"the sides ran {stock.steps} and {ours.steps} device steps")
        rows.append(
            {
                "workload": name,
                "running": load.num_running,
                "async": async_scheduling,
                "device_ms": ms,
                "gain": ours.tokens_per_s / stock.tokens_per_s,
                "stock": vars(stock),
                "kvblocks": vars(ours),
            }
        )
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """:func:`sweep_rows`' rows as the Markdown table the benchmark and the CLI print."""
    lines = [
        "| workload | running | async | device step | tokens/s stock -> kvblocks | gain | "
        "device idle | engine CPU per step | TTFT p50 / p99 | ITL p50 / p99 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, k = r["stock"], r["kvblocks"]
        lines.append(
            f"| {r['workload']} | {r['running']} | {'on' if r['async'] else 'off'} | "
            f"{r['device_ms']:g} ms | {s['tokens_per_s']:,.0f} -> {k['tokens_per_s']:,.0f} | "
            f"{r['gain']:.2f}x | {s['device_idle']:.0%} -> {k['device_idle']:.0%} | "
            f"{s['cpu_per_step'] * 1e3:.2f} -> {k['cpu_per_step'] * 1e3:.2f} ms | "
            f"{s['ttft_p50'] * 1e3:.0f} / {s['ttft_p99'] * 1e3:.0f} -> "
            f"{k['ttft_p50'] * 1e3:.0f} / {k['ttft_p99'] * 1e3:.0f} ms | "
            f"{s['itl_p50'] * 1e3:.1f} / {s['itl_p99'] * 1e3:.1f} -> "
            f"{k['itl_p50'] * 1e3:.1f} / {k['itl_p99'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines)
