"""The torch path of :func:`kvblocks.runtime.paged_attention`: the fallback, and the reference
the Triton kernels are checked against (:mod:`kvblocks.runtime.triton_selfcheck`). Decodes are
attended bucket by bucket, prefill chunks one by one, over the slots of their own context only
(see :mod:`kvblocks.runtime.attention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvblocks.runtime._metadata import DecodeBucket, StepPlan


def torch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
) -> torch.Tensor:
    """The torch path of :func:`~kvblocks.runtime.paged_attention` (arguments checked there,
    by :func:`~kvblocks.runtime._metadata.checked_plan`): the fallback, and the reference the
    Triton kernels are checked against."""
    out = query.new_empty(query.shape)
    for bucket in plan.decode:
        out[bucket.tokens] = _decode_attention(
            query[bucket.tokens], key_cache, value_cache, bucket, scale
        )
    for chunk, slots in zip(plan.prefill, plan.prefill_slots, strict=True):
        out[chunk.first : chunk.end] = _prefill_attention(
            query[chunk.first : chunk.end], key_cache, value_cache, slots, chunk.length, scale
        )
    return out


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
) -> torch.Tensor:
    """One new token per request over its context, padded only to the bucket's longest."""
    heads, dim = query.shape[1:]
    kv_heads = key_cache.shape[2]
    index = bucket.slots.flatten()
    shape = (*bucket.slots.shape, kv_heads, dim)
    keys = key_cache.view(-1, kv_heads, dim).index_select(0, index).view(shape)
    values = value_cache.view(-1, kv_heads, dim).index_select(0, index).view(shape)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],
        keys.to(query.dtype).transpose(1, 2),
        values.to(query.dtype).transpose(1, 2),
        attn_mask=bucket.mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out[:, :, 0, :]


def _prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """A chunk of ``n`` new tokens at positions ``length - n ..`` over its own ``length``
    context slots, causal."""
    new, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    keys = key_cache.view(-1, kv_heads, dim).index_select(0, slots)
    values = value_cache.view(-1, kv_heads, dim).index_select(0, slots)
    keys, values = keys.to(query.dtype).transpose(0, 1), values.to(query.dtype).transpose(0, 1)
    query_pos = torch.arange(length - new, length, device=query.device)
    mask = torch.arange(length, device=query.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.transpose(0, 1)
