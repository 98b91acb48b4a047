"""The arrays one batched scheduler step produces for a paged-attention runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """Preallocated int32 output arrays, reused step after step (``schedule_step(out=...)``).

    Any C-contiguous int32 arrays of these shapes work, for instance the ``.numpy()`` views of
    pinned torch tensors, so that the host-to-device copy can start from them directly."""

    block_table: Int32Array  # [max_num_reqs, max_blocks_per_req]
    slot_mapping: Int32Array  # [max_num_tokens]
    seq_lens: Int32Array  # [max_num_reqs]
    query_start_loc: Int32Array  # [max_num_reqs + 1]

    @classmethod
    def allocate(
        cls, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int
    ) -> StepBuffers:
        return cls(
            block_table=np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32),
            slot_mapping=np.zeros(max_num_tokens, dtype=np.int32),
            seq_lens=np.zeros(max_num_reqs, dtype=np.int32),
            query_start_loc=np.zeros(max_num_reqs + 1, dtype=np.int32),
        )


class ScheduledStep(NamedTuple):
    """What ``BlockManager.schedule_step`` did and the metadata of the scheduled requests.

    Requests ``0 .. num_scheduled - 1`` of the step were allocated (the step stops at the first
    request that does not fit). The arrays are views of the output buffers, cut to size."""

    num_scheduled: int
    num_scheduled_tokens: int
    #: ``[num_scheduled, width]`` block ids, each row padded with 0 (the null block).
    block_table: Int32Array
    #: ``block_id * block_size + offset`` for each scheduled token, request by request.
    slot_mapping: Int32Array
    #: Each scheduled request's context length after the step (computed tokens).
    seq_lens: Int32Array
    #: ``[num_scheduled + 1]``: request ``i`` owns tokens ``query_start_loc[i:i + 2]``.
    query_start_loc: Int32Array
    #: ``(K, 2)`` copy-on-write ``(src, dst)`` block pairs queued by this step.
    block_copies: Int32Array
    #: Blocks whose cached content this step evicted, in order.
    evicted_block_ids: Int32Array
