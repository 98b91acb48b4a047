"""A step's attention metadata and its plan: what every paged-attention path reads
(:mod:`kvblocks.runtime.attention` dispatches a call to the torch path or to the Triton kernels;
both read the plan built here, once per step and block size)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvblocks.step import ScheduledStep

#: A decode joins a bucket while its context is at least this share of the bucket's longest
#: (or at most ``_BUCKET_SLACK`` tokens shorter): padding stays under a third of the real work.
_BUCKET_RATIO = 0.75
_BUCKET_SLACK = 64


@dataclass(frozen=True)
class DecodeBucket:
    """Decodes of similar context lengths, attended together by one batched call."""

    tokens: torch.Tensor  # [Rb]: the step index of each request's one new token
    #: [Rb, Lb]: each request's context slots; past its own length, its first slot again (a
    #: slot of its own context, masked out: nothing outside the context is ever read).
    slots: torch.Tensor
    mask: torch.Tensor | None  # [Rb, 1, 1, Lb] bool, None when all lengths are equal


@dataclass(frozen=True)
class PrefillChunk:
    """A request's several new tokens (step indices ``first:end``), the last of its ``length``
    context tokens."""

    request: int
    first: int
    end: int
    length: int


@dataclass(frozen=True)
class StepPlan:
    """How one step's requests are attended, for one block size (built on the host once per
    step and reused by every layer). What only the torch path reads (the decode buckets, the
    prefill chunks' context slots) is built on its first use."""

    block_size: int
    #: The step index of every decode's one new token (request order, on the device).
    decode_tokens: torch.Tensor
    prefill: list[PrefillChunk]
    max_num_blocks: int  # highest block id the step reads, plus one
    #: Host copies of the block table, ``seq_lens`` and ``query_start_loc``, and the decodes'
    #: requests (for the torch path's buckets and slots).
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = field(compare=False, repr=False)
    decode_requests: torch.Tensor = field(compare=False, repr=False)
    device: torch.device = field(compare=False, repr=False)
    #: The Triton path's prefill query tiles (request, first token, count), by tile size.
    triton_tiles: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @functools.cached_property
    def decode(self) -> list[DecodeBucket]:
        """The decodes sorted by context length into buckets (on the device)."""
        _, lens, starts = self.host
        decodes = self.decode_requests
        decodes = decodes[torch.argsort(lens[decodes], descending=True, stable=True)]
        decode_lens = lens[decodes].tolist()
        buckets = []
        first = 0
        while first < len(decode_lens):
            longest, end = decode_lens[first], first + 1
            while end < len(decode_lens) and (
                decode_lens[end] >= _BUCKET_RATIO * longest
                or decode_lens[end] >= longest - _BUCKET_SLACK
            ):
                end += 1
            group = decodes[first:end]
            mask = None
            if decode_lens[end - 1] != longest:
                mask = (torch.arange(longest)[None, :] < lens[group][:, None])[:, None, None, :]
                mask = mask.to(self.device)
            slots = self._context_slots(group, longest).to(self.device)
            buckets.append(DecodeBucket(starts[group].to(self.device), slots, mask))
            first = end
        return buckets

    @functools.cached_property
    def prefill_slots(self) -> list[torch.Tensor]:
        """Each prefill chunk's context slots (``[length]``, on the device)."""
        return [
            self._context_slots(torch.tensor([c.request]), c.length)[0].to(self.device)
            for c in self.prefill
        ]

    def _context_slots(self, reqs: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(reqs), width]``: the slots of each request's context, padded past its own
        length with its first slot."""
        table, lens, _ = self.host
        last = (lens[reqs] - 1).clamp(min=0)[:, None]
        pos = torch.minimum(torch.arange(width)[None, :], last)
        return (
            table[reqs[:, None], pos // self.block_size] * self.block_size + pos % self.block_size
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """One batched step's metadata as device tensors (block ids, not KV, cross to the device)."""

    block_table: torch.Tensor  # [R, W] int64
    seq_lens: torch.Tensor  # [R]: context length after the step
    query_start_loc: torch.Tensor  # [R + 1]
    slot_mapping: torch.Tensor  # [T] int64
    token_request: torch.Tensor  # [T]: the request of each new token
    token_index: torch.Tensor  # [T]: its index among that request's new tokens
    positions: torch.Tensor  # [T]: its position in the sequence
    max_query_len: int
    #: Host copies of ``block_table``, ``seq_lens`` and ``query_start_loc`` (for planning).
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = field(compare=False, repr=False)
    _plans: dict[int, StepPlan] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_arrays(
        cls,
        block_table: np.ndarray | torch.Tensor,
        seq_lens: np.ndarray | torch.Tensor,
        query_start_loc: np.ndarray | torch.Tensor,
        slot_mapping: np.ndarray | torch.Tensor,
        device: str | torch.device = "cpu",
    ) -> AttentionMetadata:
        """Wraps kvblocks' int32 arrays (``torch.from_numpy``, no copy) and moves them to the
        device once. Inconsistent arrays are a ``ValueError``."""

        def host(a: np.ndarray | torch.Tensor, name: str) -> torch.Tensor:
            if isinstance(a, np.ndarray):
                if a.dtype.kind not in "iu":
                    raise TypeError(f"{name} must hold integers, got {a.dtype}")
                return torch.from_numpy(a).long()
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{name} must be a numpy array or a torch tensor")
            if a.is_floating_point() or a.is_complex():
                raise TypeError(f"{name} must hold integers, got {a.dtype}")
            return a.detach().to("cpu", torch.long)

        table, lens, starts, slots = (
            host(block_table, "block_table"),
            host(seq_lens, "seq_lens"),
            host(query_start_loc, "query_start_loc"),
            host(slot_mapping, "slot_mapping"),
        )
        if table.dim() != 2 or lens.dim() != 1 or starts.dim() != 1 or slots.dim() != 1:
            raise ValueError("block_table must be 2-D; seq_lens, query_start_loc, slots 1-D")
        num_reqs = len(lens)
        if len(table) != num_reqs or len(starts) != num_reqs + 1:
            raise ValueError(
                f"{num_reqs} seq_lens need {num_reqs} block-table rows and {num_reqs + 1} "
                f"query_start_loc entries, got {len(table)} and {len(starts)}"
            )
        query_lens = starts[1:] - starts[:-1]
        if int(starts[0]) != 0 or bool((query_lens < 0).any()):
            raise ValueError("query_start_loc must start at 0 and never decrease")
        if int(starts[-1]) != len(slots):
            raise ValueError(f"{int(starts[-1])} new tokens but {len(slots)} slots")
        if bool((query_lens > lens).any()):
            raise ValueError("a request has more new tokens than its context length")
        if bool((table < 0).any()) or bool((slots < 0).any()):
            raise ValueError("block ids and slots must be >= 0")

        token_request = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        token_index = torch.arange(len(slots)) - starts[token_request]
        positions = (lens - query_lens)[token_request] + token_index
        max_query_len = int(query_lens.max()) if num_reqs else 0

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, non_blocking=True)

        return cls(
            dev(table),
            dev(lens),
            dev(starts),
            dev(slots),
            dev(token_request),
            dev(token_index),
            dev(positions),
            max_query_len,
            host=(table, lens, starts),
        )

    @classmethod
    def from_step(
        cls, step: ScheduledStep, device: str | torch.device = "cpu"
    ) -> AttentionMetadata:
        return cls.from_arrays(
            step.block_table, step.seq_lens, step.query_start_loc, step.slot_mapping, device
        )

    def plan(self, block_size: int) -> StepPlan:
        """The step's split into decodes and prefill chunks for ``block_size`` (memoized)."""
        cached = self._plans.get(block_size)
        if cached is None:
            cached = self._plans[block_size] = _make_plan(self, block_size)
        return cached


def _make_plan(meta: AttentionMetadata, block_size: int) -> StepPlan:
    table, lens, starts = meta.host
    device = meta.block_table.device
    query_lens = starts[1:] - starts[:-1]
    needed = (lens + block_size - 1) // block_size
    if len(lens) and int(needed.max()) > table.shape[1]:
        raise ValueError(
            f"a context of {int(lens.max())} tokens needs {int(needed.max())} blocks of "
            f"{block_size}, but the block table has {table.shape[1]} columns"
        )
    max_block = -1
    if len(lens):
        cols = torch.arange(table.shape[1])[None, :] < needed[:, None]
        if bool(cols.any()):
            max_block = int(table[cols].max())
    decodes = torch.nonzero(query_lens == 1).flatten()
    prefill = [
        PrefillChunk(r, int(starts[r]), int(starts[r + 1]), int(lens[r]))
        for r in torch.nonzero(query_lens > 1).flatten().tolist()
    ]
    return StepPlan(
        block_size=block_size,
        decode_tokens=starts[decodes].to(device),
        prefill=prefill,
        max_num_blocks=max_block + 1,
        host=meta.host,
        decode_requests=decodes,
        device=device,
    )


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if not isinstance(query, torch.Tensor) or not isinstance(key_cache, torch.Tensor):
        raise TypeError("query and the caches must be torch tensors")
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            "query must be [tokens, heads, head_dim] and the caches "
            "[num_blocks, block_size, kv_heads, head_dim]"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key cache {tuple(key_cache.shape)} != value cache shape")
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {key_cache.shape[3]}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if not query.is_floating_point():
        raise TypeError(f"query must be floating point, got {query.dtype}")


def checked_plan(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata
) -> StepPlan:
    """Checks a paged-attention call's arguments (``query``: ``[T, num_heads, head_dim]``,
    the caches: ``[num_blocks, block_size, kv_heads, head_dim]``) and returns the step's plan
    for the caches' block size."""
    _check(query, key_cache, value_cache)
    if len(query) != len(meta.slot_mapping):
        raise ValueError(f"{len(query)} query tokens for a step of {len(meta.slot_mapping)}")
    num_blocks, block_size = key_cache.shape[:2]
    plan = meta.plan(block_size)
    if plan.max_num_blocks > num_blocks:
        raise ValueError(f"block id {plan.max_num_blocks - 1} out of range ({num_blocks} blocks)")
    return plan
