"""The arrays one batched scheduler step produces for a paged-attention runtime (the step
contract is described in docs/step.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """Preallocated output arrays, reused step after step (``schedule_step(out=...)``).

    Any C-contiguous arrays of these dtypes and shapes work, for instance the ``.numpy()``
    views of pinned torch tensors, so that the host-to-device copy can start from them
    directly. ``max_num_tokens`` bounds the tokens of one step (the scheduler's token budget).
    """

    block_table: Int32Array  # [max_num_reqs, max_blocks_per_req]
    slot_mapping: Int32Array  # [max_num_tokens]
    seq_lens: Int32Array  # [max_num_reqs]
    query_start_loc: Int32Array  # [max_num_reqs + 1]
    input_ids: Int64Array  # [max_num_tokens]
    positions: Int64Array  # [max_num_tokens]
    req_indices: Int32Array  # [max_num_reqs]
    num_new_tokens: Int32Array  # [max_num_reqs]
    num_new_computed_tokens: Int32Array  # [max_num_reqs]

    @classmethod
    def allocate(
        cls, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int
    ) -> StepBuffers:
        sizes = {
            "max_num_reqs": max_num_reqs,
            "max_num_tokens": max_num_tokens,
            "max_blocks_per_req": max_blocks_per_req,
        }
        for name, value in sizes.items():
            if not isinstance(value, int | np.integer) or isinstance(value, bool | np.bool_):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

        def i32(n: int) -> Int32Array:
            return np.zeros(n, dtype=np.int32)

        return cls(
            block_table=np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32),
            slot_mapping=i32(max_num_tokens),
            seq_lens=i32(max_num_reqs),
            query_start_loc=i32(max_num_reqs + 1),
            input_ids=np.zeros(max_num_tokens, dtype=np.int64),
            positions=np.zeros(max_num_tokens, dtype=np.int64),
            req_indices=i32(max_num_reqs),
            num_new_tokens=i32(max_num_reqs),
            num_new_computed_tokens=i32(max_num_reqs),
        )


class ScheduledStep(NamedTuple):
    """What ``BlockManager.schedule_step`` did: one row per scheduled request, in step order.

    Without a token budget or preemption, rows ``0 .. num_scheduled - 1`` are the step's first
    requests (the step stops at the first request that does not fit); in general row ``r`` is
    input ``req_indices[r]``. The arrays are views of the output buffers, cut to size."""

    num_scheduled: int
    num_scheduled_tokens: int
    #: ``[num_scheduled, width]`` block ids, each row padded with 0 (the null block).
    block_table: Int32Array
    #: ``block_id * block_size + offset`` for each scheduled token, row by row.
    slot_mapping: Int32Array
    #: Each row's context length after the step (computed tokens).
    seq_lens: Int32Array
    #: ``[num_scheduled + 1]``: row ``r`` owns tokens ``query_start_loc[r:r + 2]``.
    query_start_loc: Int32Array
    #: ``(K, 2)`` copy-on-write ``(src, dst)`` block pairs queued by this step.
    block_copies: Int32Array
    #: Blocks whose cached content this step evicted, in order.
    evicted_block_ids: Int32Array
    #: The token id of each scheduled token.
    input_ids: Int64Array
    #: Each scheduled token's position in its request.
    positions: Int64Array
    #: Each row's index in the step's input.
    req_indices: Int32Array
    #: Each row's scheduled tokens.
    num_new_tokens: Int32Array
    #: Each row's prefix-cache hit tokens taken by this step (admissions only).
    num_new_computed_tokens: Int32Array
    #: Input indices of the requests this step preempted (freed for recompute), in order.
    preempted: Int32Array


class BlockManagerProtocol(Protocol):
    """What a scheduler and the engine use of a block manager: ``kvblocks.BlockManager`` and
    its pure-Python reference ``kvblocks.reference.BlockManager`` both satisfy it."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def add_request(self, request_id: str, prompt_token_ids: Any, /) -> int: ...

    def append_token_ids(self, request_id: str | int, token_ids: Any, /) -> None: ...

    def fork(self, parent_id: str | int, child_id: str, /) -> int: ...

    def remove_request(self, request_id: str | int, /) -> None: ...

    def schedule_step(
        self,
        handles: Any,
        num_new_tokens: Any = None,
        /,
        *,
        prefix_lookup: Any = None,
        sampled_token_ids: Any = None,
        token_budget: int | None = None,
        preempt: bool = False,
        out: StepBuffers | None = None,
    ) -> ScheduledStep: ...

    def make_prefix_cache_stats(self) -> Any: ...
