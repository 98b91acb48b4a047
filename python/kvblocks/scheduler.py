"""A continuous-batching scheduler over one ``BlockManager`` (Rust or the twin): per-step token
budget and running-request cap, chunked prefill, prefix lookup at admission, preemption by
recompute (newest running request first, as vLLM does), one batched manager call per step."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblocks.step import ScheduledStep


@dataclass(eq=False)
class Sequence:
    """One sequence being generated (a request, or one sample of it when ``n > 1``)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    handle: int = -1
    #: Tokens whose KV is computed (or scheduled) in the cache.
    num_computed_tokens: int = 0
    #: Prompt tokens served from the prefix cache at the first admission.
    num_cached_tokens: int | None = None
    #: A token sampled last step, not yet appended to the manager.
    pending_token: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    sample_index: int = 0

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` without building the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    step: ScheduledStep
    sequences: list[Sequence]
    #: The step's input token ids, sequence after sequence.
    input_ids: np.ndarray


def _merge(steps: list[ScheduledStep]) -> ScheduledStep:
    """Concatenates the steps of one scheduling round (only needed after a preemption)."""
    if len(steps) == 1:
        return steps[0]
    width = max(s.block_table.shape[1] for s in steps)
    tables = [np.pad(s.block_table, ((0, 0), (0, width - s.block_table.shape[1]))) for s in steps]
    starts = [np.zeros(1, dtype=np.int32)]
    offset = 0
    for s in steps:
        starts.append((s.query_start_loc[1:] + offset).astype(np.int32))
        offset += s.num_scheduled_tokens
    return ScheduledStep(
        num_scheduled=sum(s.num_scheduled for s in steps),
        num_scheduled_tokens=offset,
        block_table=np.concatenate(tables).astype(np.int32),
        slot_mapping=np.concatenate([s.slot_mapping for s in steps]),
        seq_lens=np.concatenate([s.seq_lens for s in steps]),
        query_start_loc=np.concatenate(starts),
        block_copies=np.concatenate([s.block_copies for s in steps]).reshape(-1, 2),
        evicted_block_ids=np.concatenate([s.evicted_block_ids for s in steps]),
    )


class Scheduler:
    def __init__(self, manager: Any, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.handle = self.manager.add_request(seq.request_id, seq.prompt_token_ids)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: the blocks go back to the pool, the tokens stay."""
        self.manager.free(seq.handle)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput | None:
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int, int]] = []  # (sequence, new tokens, hit tokens)
        for seq in self.running:
            new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if new <= 0:
                continue
            plan.append((seq, new, 0))
            budget -= new
        admitted: list[Sequence] = []
        if self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # Admissions look up their prefix at their turn inside the step, so a request also
            # hits blocks that an earlier request of the same step has just cached.
            for seq in list(self.waiting)[: self.max_num_seqs - len(self.running)]:
                if budget <= 0:
                    break
                new = min(seq.num_tokens, budget)
                plan.append((seq, new, -1))
                admitted.append(seq)
                budget -= new
        if not plan:
            return None
        # Tokens sampled last step enter the manager with this step's (first) call.
        pending = {
            id(seq): seq.pending_token for seq, _, _ in plan if seq.pending_token is not None
        }
        steps: list[ScheduledStep] = []
        scheduled: list[tuple[Sequence, int, int]] = []
        while plan:
            # Plain lists: the glue reads them directly, cheaper than numpy for small batches.
            tokens, offsets = [], [0]
            for seq, _, _ in plan:
                if id(seq) in pending:
                    tokens.append(pending[id(seq)])
                offsets.append(len(tokens))
            lookup = [hits < 0 for _, _, hits in plan]
            step = self.manager.schedule_step(
                [seq.handle for seq, _, _ in plan],
                [new for _, new, _ in plan],
                prefix_lookup=lookup if any(lookup) else None,
                new_token_ids=tokens if tokens else None,
                new_token_offsets=offsets if tokens else None,
            )
            for seq, _, _ in plan:
                seq.pending_token = None
            pending = {}
            if step.num_scheduled:
                steps.append(step)
                # What each scheduled sequence got: its new tokens, and its hit at admission.
                starts = step.query_start_loc.tolist()
                counts = [b - a for a, b in itertools.pairwise(starts)]
                for (seq, _, hits), new, total in zip(
                    plan, counts, step.seq_lens.tolist(), strict=False
                ):
                    scheduled.append((seq, new, total - new if hits < 0 else 0))
            plan = plan[step.num_scheduled :]
            if not plan or plan[0][0] not in self.running:
                break  # done, or an admission does not fit: admissions stop there
            # A running sequence does not fit: preempt the newest running one, retry the rest.
            victim = self.running[-1]
            self._preempt(victim)
            plan = [p for p in plan if p[0] is not victim]
        if not steps:
            return None
        for seq, new, hits in scheduled:
            if seq in admitted:
                self.waiting.remove(seq)
                self.running.append(seq)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = hits
                seq.num_computed_tokens = hits
            seq.num_computed_tokens += new
        ids = [
            t
            for seq, new, _ in scheduled
            for t in seq.token_slice(seq.num_computed_tokens - new, seq.num_computed_tokens)
        ]
        return SchedulerOutput(
            step=_merge(steps),
            sequences=[seq for seq, _, _ in scheduled],
            input_ids=np.array(ids, dtype=np.int64),
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self.manager.remove_request(seq.handle)
