"""One scheduler step's traffic: vLLM requests in, a fake model's outputs back, and what the
step decided as plain values.

The fake model samples one token for each request whose prefill is done: a fixed function of
the request id and the position (:func:`sampled_token`), so two runs that schedule alike
produce alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvblocks.vllm.bench_driver.config import VOCAB_SIZE, select_cpu_platform

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request


def block_hasher(hash_algo: str, block_size: int) -> Callable[[Request], list[bytes]]:
    """The request block hasher as ``EngineCore`` builds it: NONE_HASH first, then the
    factory looked up through ``kv_cache_utils`` (which the plugin patches)."""
    select_cpu_platform()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

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
    select_cpu_platform()
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


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
