"""The twin's batched step: ``schedule_step`` as the per-request calls it stands for, the
checks of the native ``plan_step`` before it, and ``lookup_batch``. The public functions take
the manager first and are bound as :class:`~kvblocks.reference.manager.BlockManager`
methods."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvblocks.reference._args import int_arg, size_arg, token_ids
from kvblocks.step import ScheduledStep, StepBuffers

if TYPE_CHECKING:
    from kvblocks.reference.manager import BlockManager


def _i64s(obj: Any, what: str) -> list[int]:
    """An int64-valued 1-D array argument as a list (the native glue's rules)."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 1:
            raise ValueError(f"{what} must be 1-D")
        if obj.dtype.kind not in "iu":
            raise TypeError(f"{what} must have an integer dtype")
        obj = obj.tolist()
    return [int_arg(v, what) for v in obj]


def _checked_buffers(buffers: Any) -> tuple[Any, Any, Any, Any]:
    arrays = (
        buffers.block_table,
        buffers.slot_mapping,
        buffers.seq_lens,
        buffers.query_start_loc,
    )
    names = ("block_table", "slot_mapping", "seq_lens", "query_start_loc")
    for array, name, ndim in zip(arrays, names, (2, 1, 1, 1), strict=True):
        if not isinstance(array, np.ndarray) or array.dtype != np.int32 or array.ndim != ndim:
            raise TypeError(f"out.{name} must be a {ndim}-D int32 numpy array")
    for array in arrays:
        if not array.flags.writeable:
            raise ValueError("output buffers must be writeable")
        if not array.flags.c_contiguous:
            raise ValueError("output buffers must be C-contiguous")
    return arrays


def lookup_batch(
    manager: BlockManager, handles: Any, /
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    found = [manager.get_computed_blocks(h) for h in _i64s(handles, "handles")]
    return (
        np.array([len(blocks) for blocks, _ in found], dtype=np.int32),
        np.array([n for _, n in found], dtype=np.int32),
    )


def _plan_step(
    manager: BlockManager,
    handles: list[int],
    new: list[int],
    hits: list[int] | None,
    tokens: list[int],
    offsets: list[int] | None,
    lookahead: int,
    lookup: list[int] | None = None,
) -> tuple[list[int], int, int]:
    """The checks of the native ``plan_step``, in the same order; returns the slots, the
    widest block table after the step and the most tokens it can schedule."""
    n, b = len(handles), manager.block_size
    for values, what in (
        (new, "num_new_tokens"),
        (hits, "num_new_computed_tokens"),
        (lookup, "prefix_lookup"),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{what} has {len(values)} entries for {n} requests")
    if offsets is None:
        if tokens:
            raise ValueError("new_token_ids needs new_token_offsets")
    elif not (
        len(offsets) == n + 1
        and offsets[0] == 0
        and all(a <= c for a, c in itertools.pairwise(offsets))
        and offsets[-1] == len(tokens)
    ):
        raise ValueError(
            "new_token_offsets must have one entry per request plus one, start at 0, never "
            "decrease and end at len(new_token_ids)"
        )
    slots = [manager._slot(h) for h in handles]
    if len(set(slots)) != len(slots):
        raise ValueError("a request appears twice in one step")
    max_blocks = max_tokens = 0
    for i, slot in enumerate(slots):
        request = manager._request_at(slot)
        count, hit = new[i], hits[i] if hits is not None else 0
        if count < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {count}")
        if hit < 0:
            raise ValueError(f"num_new_computed_tokens must be >= 0, got {hit}")
        appended = offsets[i + 1] - offsets[i] if offsets is not None else 0
        num_tokens = request.seq.num_tokens + appended
        manager._check_model_len(num_tokens)
        if count == 0 and hit == 0:
            raise ValueError("num_new_tokens and num_new_computed_tokens are both 0")
        if hit % b:
            raise ValueError("num_new_computed_tokens must be a multiple of block_size")
        if hit and (request.running or request.blocks):
            raise ValueError("prefix hits can only be added at a request's first allocation")
        looks_up = lookup is not None and lookup[i] != 0
        if looks_up and (hit or request.running or request.blocks):
            raise ValueError("prefix_lookup is for admissions without num_new_computed_tokens")
        if looks_up:
            count = min(count, num_tokens - request.num_computed_tokens)
        local = request.num_computed_tokens + hit
        if local + count > num_tokens:
            raise ValueError(
                f"cannot schedule {count} new tokens after {local} computed ones: the "
                f"request has {num_tokens} tokens (append them first; drafts are lookahead)"
            )
        reach = num_tokens if looks_up else min(local, manager.max_model_len) + count
        need = min(reach + lookahead, manager.max_model_len)
        max_blocks = max(max_blocks, -(-need // b), len(request.blocks) + hit // b)
        max_tokens += count
    return slots, max_blocks, max_tokens


def schedule_step(
    manager: BlockManager,
    handles: Any,
    num_new_tokens: Any,
    /,
    *,
    num_new_computed_tokens: Any = None,
    prefix_lookup: Any = None,
    num_lookahead_tokens: int | None = None,
    new_token_ids: Any = None,
    new_token_offsets: Any = None,
    out: StepBuffers | None = None,
) -> ScheduledStep:
    """The batched step, defined as the per-request calls it stands for: append each
    request's accepted tokens, then in order look up (for admissions with hits) and
    allocate, stopping at the first request that does not fit."""
    handle_list = _i64s(handles, "handles")
    new = _i64s(num_new_tokens, "num_new_tokens")
    hits = (
        None
        if num_new_computed_tokens is None
        else _i64s(num_new_computed_tokens, "num_new_computed_tokens")
    )
    lookahead = (
        0
        if num_lookahead_tokens is None
        else size_arg(num_lookahead_tokens, "num_lookahead_tokens", 0)
    )
    lookup = None
    if prefix_lookup is not None:
        mask = np.asarray(prefix_lookup)
        lookup = _i64s(mask.astype(np.int64) if mask.dtype.kind == "b" else mask, "prefix_lookup")
    tokens = [] if new_token_ids is None else token_ids(new_token_ids)
    offsets = None if new_token_offsets is None else _i64s(new_token_offsets, "new_token_offsets")
    slots, max_blocks, max_tokens = _plan_step(
        manager, handle_list, new, hits, tokens, offsets, lookahead, lookup
    )
    n, b = len(slots), manager.block_size
    buffers = out if out is not None else StepBuffers.allocate(n, max_tokens, max_blocks)
    table, slot_mapping, seq_lens, starts = _checked_buffers(buffers)
    if not (
        table.shape[1] >= max_blocks
        and table.shape[0] >= n
        and len(slot_mapping) >= max_tokens
        and len(seq_lens) >= n
        and len(starts) > n
    ):
        raise ValueError(
            f"output buffers too small: this step needs {n} block-table rows of {max_blocks} "
            f"columns, {max_tokens} slots, {n} seq_lens and {n + 1} query_start_loc entries"
        )
    refs = [manager._handle_of(slot) for slot in slots]
    if offsets is not None:
        for i, ref in enumerate(refs):
            manager._request(ref).seq.append_token_ids(tokens[offsets[i] : offsets[i + 1]])
    copies_before = len(manager._copies)
    manager.block_pool.evicted = []
    scheduled = cursor = 0
    starts[0] = 0
    for i, ref in enumerate(refs):
        hit = hits[i] if hits is not None else 0
        count = new[i]
        blocks_hit: list[int] = []
        if lookup is not None and lookup[i]:
            blocks_hit, hit = manager.get_computed_blocks(ref)
            count = min(count, manager.num_tokens(ref) - manager.num_computed_tokens(ref) - hit)
        elif hit:
            blocks_hit = manager.get_computed_blocks(ref)[0]
            if len(blocks_hit) < hit // b:
                break
            blocks_hit = blocks_hit[: hit // b]
        allocated = manager.allocate_slots(
            ref,
            count,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks_hit,
            num_lookahead_tokens=lookahead,
        )
        if allocated is None:
            break
        blocks = manager.get_block_ids(ref)
        table[i, :] = 0
        table[i, : len(blocks)] = blocks
        end = manager.num_computed_tokens(ref)
        for position in range(end - count, end):
            slot_mapping[cursor] = blocks[position // b] * b + position % b
            cursor += 1
        seq_lens[i] = end
        starts[i + 1] = cursor
        scheduled += 1
    copies, manager._copies = manager._copies[copies_before:], manager._copies[:copies_before]
    evicted, manager.block_pool.evicted = manager.block_pool.evicted, None
    return ScheduledStep(
        num_scheduled=scheduled,
        num_scheduled_tokens=cursor,
        block_table=table[:scheduled],
        slot_mapping=slot_mapping[:cursor],
        seq_lens=seq_lens[:scheduled],
        query_start_loc=starts[: scheduled + 1],
        block_copies=np.array(copies, dtype=np.int32).reshape(len(copies), 2),
        evicted_block_ids=np.array(evicted, dtype=np.int32),
    )
