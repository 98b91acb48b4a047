"""Paged attention in portable torch: the K/V of each request is gathered through its block
table (no Python loop over blocks or requests) and attended with a causal mask that covers
any number of already-computed tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvblocks.step import ScheduledStep


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
        device once."""

        def tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
            t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
            return t.to(device=device, dtype=torch.long, non_blocking=True)

        table, lens, starts, slots = map(
            tensor, (block_table, seq_lens, query_start_loc, slot_mapping)
        )
        query_lens = starts[1:] - starts[:-1]
        num_reqs = len(lens)
        token_request = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_index = torch.arange(len(slots), device=device) - starts[token_request]
        positions = (lens - query_lens)[token_request] + token_index
        max_query_len = int(query_lens.max()) if num_reqs else 0
        return cls(table, lens, starts, slots, token_request, token_index, positions, max_query_len)

    @classmethod
    def from_step(
        cls, step: ScheduledStep, device: str | torch.device = "cpu"
    ) -> AttentionMetadata:
        return cls.from_arrays(
            step.block_table, step.seq_lens, step.query_start_loc, step.slot_mapping, device
        )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens (``query``: ``[T, num_heads, head_dim]``) over each
    request's cached and new K/V, read through the block table; returns ``[T, heads, dim]``."""
    num_reqs, width = meta.block_table.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    # [R, W, B, Hkv, D] -> [R, W*B, Hkv, D]: every request's context, in position order.
    keys = key_cache[meta.block_table].reshape(num_reqs, width * block_size, num_kv_heads, head_dim)
    values = value_cache[meta.block_table].reshape(keys.shape)
    if num_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
    padded = query.new_zeros(num_reqs, meta.max_query_len, num_heads, head_dim)
    padded[meta.token_request, meta.token_index] = query
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    first = meta.seq_lens - query_lens  # position of each request's first new token
    query_pos = first[:, None] + torch.arange(meta.max_query_len, device=query.device)[None, :]
    key_pos = torch.arange(width * block_size, device=query.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; never past the context
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.to(query.dtype).transpose(1, 2),
        values.to(query.dtype).transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
    )
    return out.transpose(1, 2)[meta.token_request, meta.token_index]
