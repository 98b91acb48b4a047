"""The fake model's drafter for speculative decoding: what it proposes, which proposals a
step verifies, and how they reach the scheduler.

The model's ``p``-th output token for a request is :func:`sampled_token` of the request id
and ``p``. After a step that leaves a request with ``n`` output tokens, the drafter guesses
the tokens at ``n, n + 1, ...``: each guess is right or wrong by a fixed function of the
drafter's seed, the request id, ``n`` and its offset (right with probability ``accuracy``
over seeds), so how many drafts the next step accepts (the leading right guesses) is a fixed
function of the request and its position: two runs that schedule alike accept alike.
Drafters with their own forward pass (EAGLE, EAGLE-3, MTP, a separate draft model, DFlash,
DSpark) propose ``k`` drafts for every request of a batch; n-gram and suffix decoding propose
``0..k`` (a fixed function too), none for a request that sampled nothing. vLLM's GPU n-gram
drafter (``ngram_gpu``) proposes as n-gram does but hands over a ``k``-wide tensor row: its
``0..k`` drafts, then ``-1`` padding (``padded``), which the scheduler schedules as drafts.

Where proposals go follows vLLM 0.33's engine core:

- synchronous scheduling: after ``update_from_output``, the engine core hands the batch's
  proposals to ``Scheduler.update_draft_token_ids`` (:meth:`Drafter.take_draft_token_ids`),
  and the next step schedules them as ``scheduled_spec_decode_tokens``;
- async scheduling: the scheduler schedules ``-1`` placeholders and the worker fills in
  its own proposals from the previous batch (``in_worker``); a request that was not in the
  previous batch has none, so its placeholders are all rejected.

Padding (``-1``, e.g. a newly admitted request padded to ``1 + k`` tokens) is never
accepted, as in vLLM's rejection sampler.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvblocks.vllm.bench.fake_model import sampled_token
from kvblocks.vllm.bench.platform import VOCAB_SIZE, select_cpu_platform

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds


def _hash(*parts: object) -> int:
    """A well-mixed fixed function of ``parts`` (CRC-32's low bits are affine in its input:
    nearby keys would accept in lockstep)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Drafter:
    """Proposes ``num_speculative_tokens`` drafts a request (``every_step``) or up to that
    many (``padded`` with ``-1`` to that many), and keeps them where vLLM keeps them
    (``in_worker`` under async scheduling)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        every_step: bool,
        in_worker: bool,
        padded: bool = False,
        seed: int = 0,
        accuracy: float = 0.75,
    ) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be within [0, 1], not {accuracy}")
        self.k = num_speculative_tokens
        self.every_step = every_step
        self.in_worker = in_worker
        self.padded = padded
        self.seed = seed
        self._right_below = round(accuracy * 2**20)  # of 2**20 equally likely hash values
        self._proposed: dict[str, list[int]] = {}  # the last executed batch's proposals
        self._handed: DraftTokenIds | None = None

    def num_drafts(self, request_id: str, num_sampled: int) -> int:
        if self.every_step:
            return self.k
        return _hash(self.seed, request_id, num_sampled, "matches") % (self.k + 1)

    def guess(self, request_id: str, num_sampled: int, offset: int) -> int:
        """The guess at the request's output token ``num_sampled + offset``, proposed when it
        has ``num_sampled``: the right token, or the id after it."""
        token = sampled_token(request_id, num_sampled + offset)
        if _hash(self.seed, request_id, num_sampled, offset) % 2**20 < self._right_below:
            return token
        return (token + 1) % VOCAB_SIZE

    def to_verify(self, request_id: str, scheduled: list[int]) -> list[int]:
        """The drafts a step verifies for a request it scheduled ``scheduled`` spec tokens
        for: the scheduled ones up to the first padding, or under async scheduling the
        worker's own proposals from the previous batch, as many as were scheduled."""
        if self.in_worker:
            drafts = self._proposed.get(request_id, [])[: len(scheduled)]
        else:
            drafts = scheduled
        for i, token in enumerate(drafts):
            if token < 0:
                return drafts[:i]
        return drafts

    def propose(self, batch: dict[str, int | None]) -> None:
        """Proposals after an executed batch: ``batch`` maps each of its requests to its
        number of output tokens, or ``None`` for a request that sampled nothing (a prefill
        chunk: EAGLE drafts from it anyway, the scheduler drops them; n-gram has none)."""
        proposed: dict[str, list[int]] = {}
        for request_id, num_sampled in batch.items():
            if num_sampled is None and not self.every_step:
                drafts: list[int] = []
            else:
                n = num_sampled or 0
                count = self.num_drafts(request_id, n)
                drafts = [self.guess(request_id, n, j) for j in range(count)]
            if self.padded:
                drafts += [-1] * (self.k - len(drafts))
            proposed[request_id] = drafts
        self._proposed = proposed
        if not self.in_worker:
            select_cpu_platform()
            from vllm.v1.outputs import DraftTokenIds

            self._handed = DraftTokenIds(list(proposed), [list(d) for d in proposed.values()])

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """What vLLM's model executor hands the engine core after a step (synchronous
        scheduling only; None under async scheduling, where drafts stay in the worker)."""
        handed, self._handed = self._handed, None
        return handed


def drafter_for(scheduler: Scheduler, *, seed: int = 0, accuracy: float = 0.75) -> Drafter | None:
    """The drafter of ``scheduler``'s speculative config (None without one): drafts kept in
    the worker under async scheduling (an ``AsyncScheduler``), else handed to the
    scheduler."""
    config = scheduler.vllm_config.speculative_config
    if config is None:
        return None
    select_cpu_platform()
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return Drafter(
        scheduler.num_spec_tokens,
        # A drafter with its own forward pass: the hidden-state ones and a draft model.
        every_step=config.use_eagle() or config.uses_draft_model(),
        in_worker=isinstance(scheduler, AsyncScheduler),
        padded=config.use_ngram_gpu(),
        seed=seed,
        accuracy=accuracy,
    )
