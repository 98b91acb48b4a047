"""vLLM 0.33's own V1 scheduler on the CPU, driven by a fake model: what the vLLM test tier,
``benches/bench_vllm.py`` and ``kvblocks bench --engine vllm`` run.

No network and no weights: a tiny Llama ``config.json`` written to a directory, a
``KVCacheConfig`` with one full-attention group, and fake model outputs (one sampled token,
a fixed function of the request and position, for each request whose prefill is done). The
scheduler, its KV-cache manager and the request block hasher are vLLM's (or kvblocks', where
the plugin is installed). Importing this module imports vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the PyPI wheel is a CUDA build

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvblocks.workloads import shared_prefix_prompts

VOCAB_SIZE = 32000
MAX_MODEL_LEN = 8192

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def write_model_dir(path: Path) -> Path:
    """Writes the tiny model's ``config.json`` into ``path`` (a directory) and returns it."""
    (path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    return path


@functools.cache
def tiny_model_dir() -> Path:
    """A process-wide temporary directory holding the tiny model's config."""
    return write_model_dir(Path(tempfile.mkdtemp(prefix="kvblocks-tiny-")))


@functools.cache
def model_config(model_dir: Path) -> ModelConfig:
    """One ``ModelConfig`` per directory (building one inspects the architecture: slow)."""
    return ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )


@dataclass
class SchedulerSpec:
    """The knobs the tests turn; everything else is vLLM's default."""

    block_size: int = 16
    num_blocks: int = 512
    hash_algo: str = "sha256"
    enable_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = False
    watermark: float = 0.0
    kv_events: bool = False
    max_model_len: int = MAX_MODEL_LEN
    #: More ``SchedulerConfig`` fields (``policy``, ``long_prefill_token_threshold``, ...).
    scheduler: dict[str, Any] = field(default_factory=dict)
    #: More ``VllmConfig`` fields.
    extra: dict[str, Any] = field(default_factory=dict)


def make_vllm_config(model_dir: Path, spec: SchedulerSpec) -> VllmConfig:
    scheduler_config = SchedulerConfig(
        # vLLM needs a token budget of at least one token per sequence.
        max_num_seqs=min(spec.max_num_seqs, spec.max_num_batched_tokens),
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=spec.async_scheduling,
        watermark=spec.watermark,
        **spec.scheduler,
    )
    cache_config = CacheConfig(
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_caching,
        prefix_caching_hash_algo=spec.hash_algo,
    )
    cache_config.num_gpu_blocks = spec.num_blocks
    extra = dict(spec.extra)
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    models = model_config(model_dir)
    if spec.max_model_len != models.max_model_len:
        models = copy.copy(models)  # the cached config is shared
        models.max_model_len = spec.max_model_len
    return VllmConfig(
        model_config=models,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        **extra,
    )


def make_kv_cache_config(spec: SchedulerSpec) -> KVCacheConfig:
    """One full-attention group of ``spec.num_blocks`` blocks."""
    attention = FullAttentionSpec(
        block_size=spec.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], attention)],
    )


def make_scheduler(
    model_dir: Path,
    spec: SchedulerSpec,
    *,
    scheduler_cls: type[Scheduler] | None = None,
    kv_cache_config: KVCacheConfig | None = None,
) -> Scheduler:
    """vLLM's scheduler (``AsyncScheduler`` under async scheduling, or ``scheduler_cls``) for
    ``spec``, on :func:`make_kv_cache_config`'s layout or ``kv_cache_config``."""
    vllm_config = make_vllm_config(model_dir, spec)
    if scheduler_cls is None:
        scheduler_cls = Scheduler
        if spec.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            scheduler_cls = AsyncScheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config or make_kv_cache_config(spec),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=spec.block_size,
    )


#: The two sides of every comparison: stock vLLM, and vLLM with kvblocks installed.
IMPLS = ("vllm", "kvblocks")


@contextmanager
def implementation(impl: str) -> Iterator[type]:
    """Stock vLLM (``"vllm"``) or kvblocks installed in mode ``"all"`` (``"kvblocks"``, with
    the fallback counts cleared) for the block, then vLLM's own code again. Yields the class
    of KV-cache manager a scheduler built inside must have."""
    import kvblocks.vllm
    from kvblocks.vllm import _state

    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")
    kvblocks.vllm.uninstall()
    if impl == "kvblocks":
        from kvblocks.vllm.kv_cache_manager import KVCacheManager

        kvblocks.vllm.install("all")
        _state.fallbacks.clear()
        manager: type = KVCacheManager
    else:
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

        manager = VllmKVCacheManager
    try:
        yield manager
    finally:
        kvblocks.vllm.uninstall()


def block_hasher(hash_algo: str, block_size: int) -> Callable[[Request], list[bytes]]:
    """The request block hasher as ``EngineCore`` builds it: NONE_HASH first, then the
    factory looked up through ``kv_cache_utils`` (which the plugin patches)."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher: Callable[[Request], list[bytes]] = kv_cache_utils.get_request_block_hasher(
        block_size, hash_fn
    )
    return hasher


def make_request(
    request_id: str,
    prompt: list[int],
    hasher: Callable[[Request], list[bytes]] | None,
    *,
    max_tokens: int = 8,
    sampling: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Request:
    """A vLLM ``Request`` (``kwargs`` go to ``Request``, ``sampling`` to ``SamplingParams``)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {}))
    return Request(request_id, list(prompt), params, None, block_hasher=hasher, **kwargs)


def sampled_token(request_id: str, index: int) -> int:
    """The fake model's ``index``-th sampled token for a request: a fixed function of both."""
    return zlib.crc32(f"{request_id}:{index}".encode()) % VOCAB_SIZE


class FakeModel:
    """Samples one token for every request whose prefill is done, deciding at schedule time
    (as the GPU would), so that outputs can be handed back one step late under async
    scheduling."""

    def __init__(self) -> None:
        self._num_sampled: dict[str, int] = {}

    def execute(self, scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or request.is_prefill_chunk:
                sampled.append([])
                continue
            index = self._num_sampled.get(req_id, 0)
            self._num_sampled[req_id] = index + 1
            sampled.append([sampled_token(req_id, index)])
        return model_output(req_ids, sampled)


def model_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """A model runner's output: ``sampled[i]`` is what request ``req_ids[i]`` sampled."""
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


class EventRecorder:
    """Stands in for vLLM's KV-event publisher and keeps every batch's events as plain data."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        import msgspec

        self.batches.append([(type(e).__name__, msgspec.to_builtins(e)) for e in batch.events])

    def shutdown(self) -> None:
        pass

    def take(self) -> list[list[Any]]:
        batches, self.batches = self.batches, []
        return batches


def snapshot(out: SchedulerOutput) -> tuple[Any, ...]:
    """Everything a scheduler step decides, as plain comparable values."""
    cached = out.scheduled_cached_reqs
    return (
        sorted(out.num_scheduled_tokens.items()),
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
        list(
            zip(
                cached.req_ids,
                cached.new_block_ids,
                cached.num_computed_tokens,
                cached.num_output_tokens,
                strict=True,
            )
        ),
        sorted(cached.resumed_req_ids),
        sorted(out.finished_req_ids),
        sorted(out.preempted_req_ids or ()),
    )


def _outputs(engine_outputs: dict[int, Any]) -> tuple[Any, ...]:
    """The request outputs (with their prefill statistics, which ``estimate_cached_tokens``
    feeds) and the prefix-cache statistics of one ``update_from_output``."""
    outputs, stats = [], None
    for eco in engine_outputs.values():
        outputs += [
            (
                o.request_id,
                list(o.new_token_ids),
                str(o.finish_reason),
                None if o.prefill_stats is None else dataclasses.astuple(o.prefill_stats),
            )
            for o in eco.outputs
        ]
        if eco.scheduler_stats is not None:
            s = eco.scheduler_stats
            p = s.prefix_cache_stats
            stats = (
                round(s.kv_cache_usage, 12),
                (p.reset, p.requests, p.queries, p.hits),
                (p.preempted_requests, p.preempted_queries, p.preempted_hits),
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
) -> list[tuple[Any, ...]]:
    """Drives ``scheduler`` to the end of a script: before a step's ``schedule()``, the
    requests arriving at that step are added, its aborts and its ``reset_prefix_cache()`` call
    happen, then its ``actions`` run. The run ends once no request is left, no output is in
    flight, and no arrival or action is still to come.

    Returns, per step: the step's :func:`snapshot` (None where it scheduled nothing), the
    request outputs, the prefix-cache statistics, the KV events published, the reset's
    result, the results of the step's actions, and every live request's block ids; then the
    arrivals' final block hashes. Each model output is handed back ``lag`` steps late (by
    default 1 for an ``AsyncScheduler``, as under async scheduling, else 0; more is a
    pipeline-parallel batch queue), one output a step, as ``EngineCore`` does; a step
    schedules only when there are requests or nothing is in flight. With ``catch``, an
    exception ends the run and is its last record, ``("raised", type name)``. With
    ``publisher`` (e.g. vLLM's ZMQ publisher), KV events go there instead of into the
    records."""
    from vllm.v1.request import RequestStatus

    pending = sorted(arrivals, key=lambda a: a[0])
    abort_at = sorted(aborts)
    reset_steps = set(resets)
    actions = actions or {}
    last = max([*actions, *(step for step, _ in pending)], default=-1)
    recorder = EventRecorder()
    scheduler.kv_event_publisher = recorder if publisher is None else publisher
    model = FakeModel()
    if lag is None:
        # vLLM may turn the config flag off on the CPU, so the class decides.
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        lag = 1 if isinstance(scheduler, AsyncScheduler) else 0
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
                snap = snapshot(out)
            outputs: tuple[Any, ...] = ((), None)
            if len(in_flight) > lag or not scheduler.has_requests():
                done, result = in_flight.pop(0)
                outputs = _outputs(scheduler.update_from_output(done, result))
            tables = sorted(
                (rid, tuple(manager.get_blocks(rid).get_block_ids()[0]))
                for rid in scheduler.requests
            )
        except Exception as error:
            if not catch:
                raise
            steps.append(("raised", type(error).__name__))  # both managers must raise alike
            return steps
        steps.append((snap, *outputs, recorder.take(), reset, results, tables))
    else:
        raise AssertionError(f"the workload did not finish in {max_steps} steps")
    steps.append(tuple((r.request_id, list(r.block_hashes)) for r in requests))
    return steps


# Timed runs: the benchmark's and `kvblocks bench --engine vllm`'s measurement.

#: The KV-cache manager methods vLLM's scheduler calls, timed by :func:`timed_run`.
MANAGER_METHODS = (
    "new_step_starts",
    "get_computed_blocks",
    "allocate_slots",
    "get_blocks",
    "cache_blocks",
    "estimate_cached_tokens",
    "free",
    "take_events",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "reset_prefix_cache",
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


@dataclass
class Timings:
    """Scheduler-side CPU time of one run, in seconds."""

    arrival: float = 0.0  # building the requests (hashing their prompts) and add_request
    hashing: float = 0.0  # inside the request block hasher, at arrival
    schedule: float = 0.0
    update: float = 0.0  # update_from_output (appending tokens hashes new full blocks)
    manager: float = 0.0  # inside the KV-cache manager, during schedule and update
    manager_calls: dict[str, list[float]] = field(default_factory=dict)  # name -> [calls, s]
    steps: int = 0

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
    Returns the timings and each step's :func:`snapshot` (to check two runs are identical).

    ``instrument`` also times every call of the request block hasher and of the KV-cache
    manager's methods (``hashing``, ``manager``, ``manager_calls``); the timers slow the run
    down, so compare totals of runs without them."""
    timings = Timings()
    hasher = block_hasher(spec.hash_algo, spec.block_size)
    hasher_slot = [0.0, 0.0]
    scheduler = make_scheduler(model_dir, spec)
    if instrument:
        hasher = _timed(hasher, hasher_slot)
        manager = scheduler.kv_cache_manager
        for name in MANAGER_METHODS:
            method = getattr(manager, name, None)
            if method is not None:
                slot = timings.manager_calls.setdefault(name, [0.0, 0.0])
                setattr(manager, name, _timed(method, slot))
    prompts = workload.prompts()
    model = FakeModel()
    clock = time.perf_counter
    start = clock()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, hasher, max_tokens=workload.output_len))
    timings.arrival = clock() - start
    timings.hashing = hasher_slot[1]
    manager_at_arrival = sum(s for _, s in timings.manager_calls.values())
    snapshots = []
    while scheduler.has_requests():
        start = clock()
        out = scheduler.schedule()
        middle = clock()
        scheduler.update_from_output(out, model.execute(scheduler, out))
        timings.schedule += middle - start
        timings.update += clock() - middle
        timings.steps += 1
        snapshots.append(snapshot(out))
    timings.manager = sum(s for _, s in timings.manager_calls.values()) - manager_at_arrival
    return timings, snapshots
