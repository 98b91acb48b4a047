"""A continuous-batching scheduler over one block manager (Rust or the reference).

The scheduler keeps policy only: the waiting queue and the running order, the per-step token
budget and running-request cap, and finishing. Everything per request that the step needs
(tokens, computed tokens, block tables) lives in the manager, and one ``schedule_step`` call
per step does the rest: it appends the tokens sampled in the previous step, gives each running
request its tokens (chunked prefill) and each admission its prefix-cache hit, preempts by
recompute (newest running request first, as vLLM) and writes the runtime's arrays into
reused buffers. See docs/step.md."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvblocks.step import BlockManagerProtocol, ScheduledStep, StepBuffers


@dataclass(eq=False)
class Sequence:
    """One sequence being generated (a request, or one sample of it when ``n > 1``): its
    manager handle and its sampling state. Its tokens and KV bookkeeping live in the
    manager."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    handle: int = -1
    #: Prompt tokens served from the prefix cache at the first admission.
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    sample_index: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens the sequence can hold (prompt plus every output token)."""
        return len(self.prompt_token_ids) + self.max_tokens


@dataclass
class SchedulerOutput:
    step: ScheduledStep
    #: The sequence of each row of the step.
    sequences: list[Sequence]

    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """The step's input token ids, row after row."""
        return self.step.input_ids


class Scheduler:
    def __init__(
        self,
        manager: BlockManagerProtocol,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        #: Running sequences, oldest first (preemption takes the newest).
        self.running: list[Sequence] = []
        self._running_handles: list[int] = []
        self.num_preemptions = 0
        self._buffers = StepBuffers.allocate(max_num_seqs, max_num_batched_tokens, 1)
        #: The tokens sampled for the last step's rows, handed to the next step.
        self._sampled: npt.NDArray[np.int64] | None = None

    def _fit_buffers(self, seq: Sequence) -> None:
        """Widens the block-table buffer to hold ``seq`` at its longest."""
        width = -(-seq.max_num_tokens // self.manager.block_size)
        if width > self._buffers.block_table.shape[1]:
            self._buffers = StepBuffers.allocate(
                self.max_num_seqs, self.max_num_batched_tokens, width
            )

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""
        self._fit_buffers(seq)
        seq.handle = self.manager.add_request(seq.request_id, seq.prompt_token_ids)
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence, first_token: int) -> None:
        """Parallel sampling: ``child`` starts as a copy of the running ``parent`` (sharing
        its blocks), with its own first sampled token."""
        self._fit_buffers(child)
        child.handle = self.manager.fork(parent.handle, child.request_id)
        self.manager.append_token_ids(child.handle, [first_token])
        self.running.append(child)
        self._running_handles.append(child.handle)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def update(self, sampled_token_ids: npt.NDArray[np.int64]) -> None:
        """The tokens sampled for the last step's rows (``-1``: none), in row order."""
        self._sampled = sampled_token_ids

    def _stop_running(self, index: int) -> Sequence:
        del self._running_handles[index]
        return self.running.pop(index)

    def schedule(self) -> SchedulerOutput | None:
        running = self.running
        num_running = len(running)
        admissions = list(itertools.islice(self.waiting, max(self.max_num_seqs - num_running, 0)))
        handles = self._running_handles
        lookup = None
        if admissions:
            handles = handles + [seq.handle for seq in admissions]
            lookup = [False] * num_running + [True] * len(admissions)
        if not handles:
            return None
        step = self.manager.schedule_step(
            handles,
            prefix_lookup=lookup,
            sampled_token_ids=self._sampled,
            token_budget=self.max_num_batched_tokens,
            preempt=True,
            out=self._buffers,
        )
        self._sampled = None
        entries = running + admissions if admissions else running
        if step.num_scheduled == len(entries):
            sequences = list(entries)
        else:
            sequences = [entries[i] for i in step.req_indices.tolist()]
        if len(step.preempted):
            self._preempted([entries[i] for i in step.preempted.tolist()])
        if admissions:
            self._admitted(step, sequences, num_running)
        if not step.num_scheduled:
            return None
        return SchedulerOutput(step=step, sequences=sequences)

    def _preempted(self, victims: list[Sequence]) -> None:
        """The step freed these running sequences for recompute: back to the waiting queue's
        front, the newest in front."""
        for seq in victims:
            self._stop_running(self.running.index(seq))
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(seq)

    def _admitted(self, step: ScheduledStep, sequences: list[Sequence], num_running: int) -> None:
        """Moves the step's admissions from the waiting queue to the running list."""
        first = int(np.searchsorted(step.req_indices, num_running))
        hits = step.num_new_computed_tokens[first:].tolist()
        for seq, hit in zip(sequences[first:], hits, strict=True):
            self.waiting.remove(seq)
            self.running.append(seq)
            self._running_handles.append(seq.handle)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a running sequence and releases it in the manager."""
        seq.finish_reason = reason
        self._stop_running(self.running.index(seq))
        self.manager.remove_request(seq.handle)
