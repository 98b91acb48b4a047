"""One scheduler step's traffic: vLLM requests in, a fake model's outputs back, and what the
step decided as plain values.

The fake model samples one token for each request whose prefill is done: a fixed function of
the request id and the position (:func:`sampled_token`), so two runs that schedule alike
produce alike. With a drafter (:class:`Drafter`, speculative decoding) it also verifies the
step's drafts: it returns the accepted ones and the token after them. Where the scheduler has
a KV connector, it also runs the connector's worker side (a :class:`WorkerSide` the caller
fakes) and returns what it reported. The benchmark uses neither; the repository's test driver
(``tests/vllm_driver``) brings both.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvblocks.vllm.bench.platform import VOCAB_SIZE, select_cpu_platform

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request


class WorkerSide(Protocol):
    """A KV connector's faked worker side: what it reports for one scheduler step."""

    def step(self, out: SchedulerOutput) -> KVConnectorOutput: ...


class Drafter(Protocol):
    """A speculative-decoding drafter as the fake model steps it."""

    def to_verify(self, request_id: str, scheduled: list[int]) -> list[int]:
        """The drafts of ``request_id`` the step verifies (``scheduled``: what the scheduler
        scheduled of them)."""
        ...

    def propose(self, batch: dict[str, int | None]) -> None:
        """Proposes the next drafts: ``batch`` maps each request of the step to how many
        tokens it has sampled so far, or None where it sampled nothing this step."""
        ...

    def take_draft_token_ids(self) -> DraftTokenIds | None: ...


#: A step's KV connector decisions as plain values (three, or three per child connector).
Decisions = Callable[["SchedulerOutput"], tuple[Any, ...]]


def block_hasher(
    hash_algo: str, block_size: int, num_hash_lookahead_tokens: int = 0
) -> Callable[[Request], list[bytes]]:
    """The request block hasher as ``EngineCore`` builds it: NONE_HASH first, then the
    factory looked up through ``kv_cache_utils`` (which the plugin patches), with the
    config's ``num_hash_lookahead_tokens`` (EAGLE/MTP lookahead hashing)."""
    select_cpu_platform()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher: Callable[[Request], list[bytes]] = kv_cache_utils.get_request_block_hasher(
        block_size, hash_fn, num_hash_lookahead_tokens
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
    select_cpu_platform()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {}))
    return Request(request_id, list(prompt), params, None, block_hasher=hasher, **kwargs)


def sampled_token(request_id: str, index: int) -> int:
    """The fake model's ``index``-th sampled token for a request: a fixed function of both."""
    return zlib.crc32(f"{request_id}:{index}".encode()) % VOCAB_SIZE


class FakeModel:
    """Samples one token for every request whose prefill is done, deciding at schedule time
    (as the GPU would), so that outputs can be handed back one step late under async
    scheduling; with a ``drafter``, also the drafts it accepts, and then proposes the next
    ones.

    Where the scheduler has a KV connector, ``worker_side(scheduler)`` (called at the first
    step) builds its worker side, stepped as vLLM's model runner steps it: the output carries
    its ``kv_connector_output``; ``decisions`` reads what the connector decided in a step, for
    :meth:`snapshot`. A scheduler with a connector and no ``worker_side`` is refused. A
    request whose KV is still loading is not scheduled, so it samples nothing."""

    def __init__(
        self,
        drafter: Drafter | None = None,
        *,
        worker_side: Callable[[Scheduler], WorkerSide] | None = None,
        decisions: Decisions | None = None,
    ) -> None:
        self._num_sampled: dict[str, int] = {}
        self.drafter = drafter
        self.connector_worker: WorkerSide | None = None
        self._worker_side = worker_side
        self._decisions = decisions

    def execute(self, scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        kv_connector_output = None
        if scheduler.connector is not None:
            if self.connector_worker is None:
                if self._worker_side is None:
                    name = type(scheduler.connector).__name__
                    raise ValueError(f"the fake model has no worker side for the {name}")
                self.connector_worker = self._worker_side(scheduler)
            kv_connector_output = self.connector_worker.step(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or request.is_prefill_chunk:
                sampled.append([])
                continue
            index = self._num_sampled.get(req_id, 0)
            tokens = [sampled_token(req_id, index)]
            if self.drafter is not None:
                scheduled = out.scheduled_spec_decode_tokens.get(req_id, [])
                for draft in self.drafter.to_verify(req_id, scheduled):
                    if draft != tokens[-1]:  # the first wrong draft ends the accepted run
                        break
                    tokens.append(sampled_token(req_id, index + len(tokens)))
            self._num_sampled[req_id] = index + len(tokens)
            sampled.append(tokens)
        if self.drafter is not None and req_ids:
            self.drafter.propose(
                {
                    r: self._num_sampled[r] if s else None
                    for r, s in zip(req_ids, sampled, strict=True)
                }
            )
        return model_output(req_ids, sampled, kv_connector_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts the engine core hands the scheduler after a step (vLLM's
        ``take_draft_token_ids``): none without a drafter or under async scheduling."""
        return None if self.drafter is None else self.drafter.take_draft_token_ids()

    def snapshot(self, out: SchedulerOutput) -> tuple[Any, ...]:
        """:func:`snapshot` of a step, its KV connector's decisions read by ``decisions``."""
        return snapshot(out, self._decisions)


def model_output(
    req_ids: list[str],
    sampled: list[list[int]],
    kv_connector_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """A model runner's output: ``sampled[i]`` is what request ``req_ids[i]`` sampled;
    ``kv_connector_output``, what the KV connector's worker side reported."""
    select_cpu_platform()
    from dataclasses import fields

    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:  # vLLM 0.33's
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
        **extra,
    )


def snapshot(out: SchedulerOutput, decisions: Decisions | None = None) -> tuple[Any, ...]:
    """Everything a scheduler step decides, as plain comparable values; the last three, what
    its KV connector decided, read by ``decisions`` (e.g. CPU offloading's load jobs, store
    jobs and the job ids it flushes; empty without a connector), or for a MultiConnector,
    three per child (NIXL's, then offloading's). A step with connector metadata and no
    ``decisions`` is refused."""
    cached = out.scheduled_cached_reqs
    connector: tuple[Any, ...] = ([], [], [])
    if out.kv_connector_metadata is not None:
        if decisions is None:
            name = type(out.kv_connector_metadata).__name__
            raise ValueError(f"no reading of the KV connector's decisions ({name})")
        connector = decisions(out)
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
        # (vLLM 0.34 sends a resumed request again as a new one, with all its blocks)
        sorted(getattr(cached, "resumed_req_ids", ())),
        sorted(out.finished_req_ids),
        sorted(out.preempted_req_ids or ()),
        sorted((r, list(t)) for r, t in out.scheduled_spec_decode_tokens.items()),
        out.new_block_ids_to_zero,
        out.kv_cache_block_copies,
        *connector,
    )
