"""The reference's batched step: ``schedule_step`` as the per-request calls it stands for, the
checks of the native ``plan_step`` before it, and ``lookup_batch``. The public functions take
the manager first and are bound as :class:`~kvblocks.reference.manager.BlockManager` methods;
what they use of it is :class:`StepManager` (this module does not import the manager)."""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvblocks.reference._args import int_arg, size_arg, token_ids
from kvblocks.reference._requests import Request, RequestRef
from kvblocks.reference.pool import BlockPool
from kvblocks.step import ScheduledStep, StepBuffers


class StepManager(Protocol):
    """What the batched step uses of the manager: its per-request operations, its request
    table, the checks every allocation passes, and the state a step leaves behind (the block
    copies not yet taken, the rows of the last step)."""

    block_size: int
    max_model_len: int
    block_pool: BlockPool
    _copies: list[tuple[int, int]]
    _last_rows: list[int]

    def append_token_ids(self, request_id: RequestRef, token_ids: Any, /) -> None: ...

    def get_computed_blocks(self, request_id: RequestRef, /) -> tuple[list[int], int]: ...

    def allocate_slots(
        self,
        request_id: RequestRef,
        num_new_tokens: int,
        /,
        *,
        num_new_computed_tokens: int | None = None,
        new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[int] | None: ...

    def free(self, request_id: RequestRef, /) -> None: ...

    def get_block_ids(self, request_id: RequestRef, /) -> list[int]: ...

    def num_computed_tokens(self, request_id: RequestRef, /) -> int: ...

    def num_tokens(self, request_id: RequestRef, /) -> int: ...

    def _slot(self, ref: RequestRef) -> int: ...

    def _handle_of(self, slot: int) -> int: ...

    def _request(self, ref: RequestRef) -> Request: ...

    def _request_at(self, slot: int) -> Request: ...

    def _check_model_len(self, num_tokens: int) -> None: ...

    def _check_allocation(
        self,
        request: Request,
        num_tokens: int,
        new: int,
        computed: int,
        *,
        may_be_empty: bool = False,
    ) -> None: ...


def _i64s(obj: Any, what: str) -> list[int]:
    """An int64-valued 1-D array argument as a list (the native glue's rules)."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 1:
            raise ValueError(f"{what} must be 1-D")
        if obj.dtype.kind not in "iu":
            raise TypeError(f"{what} must have an integer dtype")
        obj = obj.tolist()
    return [int_arg(v, what) for v in obj]


_FIELDS = (
    ("block_table", np.int32, 2),
    ("slot_mapping", np.int32, 1),
    ("seq_lens", np.int32, 1),
    ("query_start_loc", np.int32, 1),
    ("input_ids", np.int64, 1),
    ("positions", np.int64, 1),
    ("req_indices", np.int32, 1),
    ("num_new_tokens", np.int32, 1),
    ("num_new_computed_tokens", np.int32, 1),
)


def _checked_buffers(buffers: Any) -> dict[str, Any]:
    arrays = {name: getattr(buffers, name) for name, _, _ in _FIELDS}
    for name, dtype, ndim in _FIELDS:
        array = arrays[name]
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != ndim:
            raise TypeError(f"out.{name} must be a {ndim}-D {np.dtype(dtype).name} numpy array")
        if not array.flags.writeable:
            raise ValueError("output buffers must be writeable")
        if not array.flags.c_contiguous:
            raise ValueError("output buffers must be C-contiguous")
    return arrays


def lookup_batch(
    manager: StepManager, handles: Any, /
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    found = [manager.get_computed_blocks(h) for h in _i64s(handles, "handles")]
    return (
        np.array([len(blocks) for blocks, _ in found], dtype=np.int32),
        np.array([n for _, n in found], dtype=np.int32),
    )


def _mask(obj: Any, what: str) -> list[int]:
    """A mask: bools (numpy's too) or 0/1 ints, as 0/1."""
    out = []
    for item in obj:
        if isinstance(item, bool | np.bool_):
            out.append(int(item))
            continue
        value = int_arg(item, what)
        if value not in (0, 1):
            raise ValueError(f"{what} entries must be bools or 0/1, got {value}")
        out.append(value)
    return out


def _sampled(manager: StepManager, sampled_token_ids: Any) -> dict[int, int]:
    """The previous rows' samples as ``{slot: token}``, rows of removed requests dropped."""
    if sampled_token_ids is None:
        return {}
    tokens = _i64s(sampled_token_ids, "sampled_token_ids")
    rows = manager._last_rows
    if len(tokens) != len(rows):
        raise ValueError(
            f"sampled_token_ids has {len(tokens)} entries for the {len(rows)} rows of the last step"
        )
    out: dict[int, int] = {}
    for handle, token in zip(rows, tokens, strict=True):
        if not -1 <= token < 2**32:
            raise ValueError(
                f"sampled_token_ids entries must be token ids (0 <= id < 2**32) or -1, got {token}"
            )
        if token == -1:
            continue
        try:
            slot = manager._slot(handle)
        except KeyError:
            continue  # removed since
        manager._check_model_len(manager._request_at(slot).seq.num_tokens + 1)
        out[slot] = token
    return out


def _plan_step(
    manager: StepManager,
    handles: list[int],
    new: list[int] | None,
    hits: list[int] | None,
    tokens: list[int],
    offsets: list[int] | None,
    lookahead: int,
    lookup: list[int] | None,
    sampled: dict[int, int],
    budget: int | None,
) -> tuple[list[int], int, int]:
    """The checks of the native ``plan_step``; returns the slots, the widest block table
    after the step and the most tokens it can schedule."""
    n, b = len(handles), manager.block_size
    if new is None and budget is None:
        raise ValueError("num_new_tokens is needed without a token_budget")
    for values, what in (
        (new, "num_new_tokens"),
        (hits, "num_new_computed_tokens"),
        (lookup, "prefix_lookup"),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{what} has {len(values)} entries for {n} requests")
        if values is not None and any(v < 0 for v in values):
            raise ValueError(f"{what} must be >= 0, got {min(values)}")
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
        bound = new[i] if new is not None else 2**64
        hit = hits[i] if hits is not None else 0
        appended = offsets[i + 1] - offsets[i] if offsets is not None else 0
        num_tokens = request.seq.num_tokens + appended + (slot in sampled)
        manager._check_model_len(num_tokens)
        looks_up = lookup is not None and lookup[i] != 0
        if looks_up and (hit or request.running or request.blocks):
            raise ValueError("prefix_lookup is for admissions without num_new_computed_tokens")
        count = bound
        if looks_up or budget is not None:
            left = max(num_tokens - request.num_computed_tokens - hit, 0)
            count = min(bound, left, budget if budget is not None else bound)
        manager._check_allocation(request, num_tokens, count, hit, may_be_empty=budget is not None)
        local = request.num_computed_tokens + hit
        reach = num_tokens if looks_up else min(local, manager.max_model_len) + count
        need = min(reach + lookahead, manager.max_model_len)
        max_blocks = max(max_blocks, -(-need // b), len(request.blocks) + hit // b)
        max_tokens += count
    if budget is not None:
        max_tokens = min(max_tokens, budget)
    return slots, max_blocks, max_tokens


def schedule_step(
    manager: StepManager,
    handles: Any,
    num_new_tokens: Any = None,
    /,
    *,
    num_new_computed_tokens: Any = None,
    prefix_lookup: Any = None,
    num_lookahead_tokens: int | None = None,
    new_token_ids: Any = None,
    new_token_offsets: Any = None,
    sampled_token_ids: Any = None,
    token_budget: int | None = None,
    preempt: bool = False,
    out: StepBuffers | None = None,
) -> ScheduledStep:
    """The batched step, defined as the per-request calls it stands for: append the
    previous rows' samples and each request's accepted tokens, then in order look up (for
    admissions) and allocate, preempting the last running request of the step when asked,
    and stop at the first request that does not fit."""
    handle_list = _i64s(handles, "handles")
    new = None if num_new_tokens is None else _i64s(num_new_tokens, "num_new_tokens")
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
    lookup = None if prefix_lookup is None else _mask(prefix_lookup, "prefix_lookup")
    budget = None if token_budget is None else size_arg(token_budget, "token_budget", 0)
    tokens = [] if new_token_ids is None else token_ids(new_token_ids)
    offsets = None if new_token_offsets is None else _i64s(new_token_offsets, "new_token_offsets")
    sampled = _sampled(manager, sampled_token_ids)
    slots, max_blocks, max_tokens = _plan_step(
        manager, handle_list, new, hits, tokens, offsets, lookahead, lookup, sampled, budget
    )
    n, b = len(slots), manager.block_size
    buffers = out if out is not None else StepBuffers.allocate(n, max_tokens, max_blocks)
    arrays = _checked_buffers(buffers)
    table = arrays["block_table"]
    if not (
        table.shape[1] >= max_blocks
        and table.shape[0] >= n
        and all(len(arrays[k]) >= max_tokens for k in ("slot_mapping", "input_ids", "positions"))
        and all(
            len(arrays[k]) >= n
            for k in ("seq_lens", "req_indices", "num_new_tokens", "num_new_computed_tokens")
        )
        and len(arrays["query_start_loc"]) > n
    ):
        raise ValueError(
            f"output buffers too small: this step needs {n} block-table rows of {max_blocks} "
            f"columns, {max_tokens} token entries (slot_mapping, input_ids, positions), {n} "
            f"entries per request and {n + 1} query_start_loc entries"
        )
    for slot, token in sorted(sampled.items()):
        manager.append_token_ids(manager._handle_of(slot), [token])
    refs = [manager._handle_of(slot) for slot in slots]
    if offsets is not None:
        for i, ref in enumerate(refs):
            manager._request(ref).seq.append_token_ids(tokens[offsets[i] : offsets[i + 1]])
    copies_before = len(manager._copies)
    manager.block_pool.evicted = []
    manager._last_rows = []
    rows = cursor = 0
    preempted: list[int] = []
    arrays["query_start_loc"][0] = 0
    for i, ref in enumerate(refs):
        if i in preempted:
            continue
        running = manager._request(ref).running
        if preempted and not running:
            break  # a step that preempted admits nobody
        hit = hits[i] if hits is not None else 0
        blocks_hit: list[int] = []
        looks_up = lookup is not None and lookup[i] != 0
        if looks_up:
            blocks_hit, hit = manager.get_computed_blocks(ref)
        elif hit:
            blocks_hit = manager.get_computed_blocks(ref)[0]
            if len(blocks_hit) < hit // b:
                break
            blocks_hit = blocks_hit[: hit // b]
        count = new[i] if new is not None else 2**64
        if looks_up or budget is not None:
            left = manager.num_tokens(ref) - manager.num_computed_tokens(ref) - hit
            count = min(count, left, budget if budget is not None else count)
        if budget is not None and count == 0:
            continue
        while True:
            allocated = manager.allocate_slots(
                ref,
                count,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks_hit,
                num_lookahead_tokens=lookahead,
            )
            if allocated is not None or not (preempt and running):
                break
            victim = max(
                j for j in range(i, n) if j not in preempted and manager._request(refs[j]).running
            )
            manager.free(refs[victim])
            preempted.append(victim)
            if victim == i:
                break
        if allocated is None:
            if preempted and preempted[-1] == i:
                continue
            break
        blocks = manager.get_block_ids(ref)
        table[rows, :] = 0
        table[rows, : len(blocks)] = blocks
        end = manager.num_computed_tokens(ref)
        all_tokens = manager._request(ref).seq._all
        for position in range(end - count, end):
            arrays["slot_mapping"][cursor] = blocks[position // b] * b + position % b
            arrays["input_ids"][cursor] = all_tokens[position]
            arrays["positions"][cursor] = position
            cursor += 1
        for name, value in (
            ("seq_lens", end),
            ("req_indices", i),
            ("num_new_tokens", count),
            ("num_new_computed_tokens", hit),
        ):
            arrays[name][rows] = value
        arrays["query_start_loc"][rows + 1] = cursor
        manager._last_rows.append(ref)
        if budget is not None:
            budget -= count
        rows += 1
    copies, manager._copies = manager._copies[copies_before:], manager._copies[:copies_before]
    evicted, manager.block_pool.evicted = manager.block_pool.evicted, None

    def cut(name: str, size: int) -> Any:
        return arrays[name][:size]

    return ScheduledStep(
        num_scheduled=rows,
        num_scheduled_tokens=cursor,
        block_table=cut("block_table", rows),
        slot_mapping=cut("slot_mapping", cursor),
        seq_lens=cut("seq_lens", rows),
        query_start_loc=cut("query_start_loc", rows + 1),
        block_copies=np.array(copies, dtype=np.int32).reshape(len(copies), 2),
        evicted_block_ids=np.array(evicted, dtype=np.int32),
        input_ids=cut("input_ids", cursor),
        positions=cut("positions", cursor),
        req_indices=cut("req_indices", rows),
        num_new_tokens=cut("num_new_tokens", rows),
        num_new_computed_tokens=cut("num_new_computed_tokens", rows),
        preempted=np.array(preempted, dtype=np.int32),
    )
