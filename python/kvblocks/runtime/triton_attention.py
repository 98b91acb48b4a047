"""Paged attention in Triton: decodes, prefill chunks and mixed batches, two launches a step.

- decodes: one program per (decode token, KV head) walks the token's own context block by
  block through the block table, with an online softmax in float32, for all the query heads
  that share the KV head (decode is memory-bound: each K/V block is read once per KV head);
- prefill chunks: one program per (tile of new tokens, KV head), flash-attention style: the
  tile's rows (tokens x the KV head's query heads) against its context in tiles of 32
  positions with ``tl.dot``, causal.

Every load past a token's visible context is masked (never read) and every masked score is
selected away with ``tl.where``, so nothing outside a request's context can reach the output.
Used by :func:`kvblocks.runtime.paged_attention` on CUDA when Triton is importable and the
kernels passed their self-check there (:mod:`kvblocks.runtime.triton_selfcheck`); runs on the
CPU under ``TRITON_INTERPRET=1``, which is how the tests check it against the torch path.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvblocks.runtime._metadata import AttentionMetadata, StepPlan

_KERNEL: Any = None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel() -> Any:
    """Defines (once) and returns the two kernels; importing this module needs no Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def paged_attention_kernel(  # type: ignore[no-untyped-def]
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        tokens_ptr,
        token_request_ptr,
        positions_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_table,
        block_size,
        groups,
        head_dim,
        BLOCK: tl.constexpr,
        GROUPS: tl.constexpr,
        DIM: tl.constexpr,
    ):
        token = tl.load(tokens_ptr + tl.program_id(0))
        kv_head = tl.program_id(1)
        request = tl.load(token_request_ptr + token)
        context = tl.load(positions_ptr + token) + 1  # causal: up to the token itself
        g = tl.arange(0, GROUPS)
        d = tl.arange(0, DIM)
        s = tl.arange(0, BLOCK)
        g_ok = g < groups
        d_ok = d < head_dim
        heads = kv_head * groups + g
        q = tl.load(
            q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        peak = tl.full((GROUPS,), float("-inf"), tl.float32)
        total = tl.zeros((GROUPS,), tl.float32)
        acc = tl.zeros((GROUPS, DIM), tl.float32)
        num_blocks = (context + block_size - 1) // block_size
        for j in range(0, num_blocks):
            block = tl.load(table_ptr + request * stride_table + j).to(tl.int64)
            pos = j * block_size + s
            valid = (s < block_size) & (pos < context)
            kv_mask = valid[:, None] & d_ok[None, :]
            k_at = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            v_at = block * stride_vb + s[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
            k = tl.load(k_ptr + k_at, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + v_at, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUPS, BLOCK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_peak = tl.maximum(peak, tl.max(scores, axis=1))
            alpha = tl.exp(peak - new_peak)
            p = tl.exp(scores - new_peak[:, None])
            p = tl.where(valid[None, :], p, 0.0)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            peak = new_peak
        result = acc / total[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )

    @triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
    def prefill_kernel(  # type: ignore[no-untyped-def]
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        tile_request_ptr,
        tile_start_ptr,
        tile_len_ptr,
        positions_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_table,
        block_size,
        groups,
        head_dim,
        TILE: tl.constexpr,
        GROUPS: tl.constexpr,
        DIM: tl.constexpr,
        KV_TILE: tl.constexpr,
        FP32: tl.constexpr,
    ):
        """``TILE`` consecutive new tokens of one chunk x the ``groups`` query heads of one KV
        head (``TILE * GROUPS`` rows), flash-style over the chunk's context in tiles of
        ``KV_TILE`` positions, causal."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        request = tl.load(tile_request_ptr + tile)
        first = tl.load(tile_start_ptr + tile)
        count = tl.load(tile_len_ptr + tile)
        rows = tl.arange(0, TILE * GROUPS)
        t = rows // GROUPS
        g = rows % GROUPS
        d = tl.arange(0, DIM)
        d_ok = d < head_dim
        row_ok = (t < count) & (g < groups)
        token = first + t
        heads = kv_head * groups + g
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=q_mask,
            other=0.0,
        )
        q_pos = tl.load(positions_ptr + token, mask=row_ok, other=0)
        context = tl.load(positions_ptr + first + count - 1) + 1  # the tile's last token's
        peak = tl.full((TILE * GROUPS,), float("-inf"), tl.float32)
        total = tl.zeros((TILE * GROUPS,), tl.float32)
        acc = tl.zeros((TILE * GROUPS, DIM), tl.float32)
        n = tl.arange(0, KV_TILE)
        for start in range(0, context, KV_TILE):
            pos = start + n
            pos_ok = pos < context
            block = tl.load(
                table_ptr + request * stride_table + pos // block_size, mask=pos_ok, other=0
            ).to(tl.int64)
            offset = pos % block_size
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k_at = block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
            v_at = block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
            # In the query's dtype (the cache may hold another one): tl.dot wants one dtype.
            k = tl.load(k_ptr + k_at + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + v_at + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if FP32:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores.to(tl.float32) * scale, float("-inf"))
            new_peak = tl.maximum(peak, tl.max(scores, axis=1))
            alpha = tl.exp(peak - new_peak)
            p = tl.where(visible, tl.exp(scores - new_peak[:, None]), 0.0)
            total = total * alpha + tl.sum(p, axis=1)
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            peak = new_peak
        result = acc / total[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )

    _KERNEL = (paged_attention_kernel, prefill_kernel)
    return _KERNEL


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    plan: StepPlan,
    scale: float,
) -> torch.Tensor:
    """The Triton path of :func:`kvblocks.runtime.paged_attention` (same arguments, checked
    there): one launch for the decodes, one for the prefill chunks' query tiles."""
    if not query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before triton "
            "is imported)"
        )
    try:
        decode_kernel, prefill_kernel = _kernel()
    except ImportError as e:
        raise ValueError(f"the triton backend needs triton: {e}") from e
    heads, dim = query.shape[1:]
    _, block_size, kv_heads, _ = key_cache.shape
    groups = heads // kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    q = query if query.stride(2) == 1 else query.contiguous()
    k = key_cache if key_cache.stride(3) == 1 else key_cache.contiguous()
    v = value_cache if value_cache.stride(3) == 1 else value_cache.contiguous()
    table = meta.block_table.contiguous()
    common = (
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        table.stride(0),
        block_size,
        groups,
        dim,
    )
    group_pow2 = _next_pow2(groups)
    # tl.dot wants every dimension >= 16.
    dim_pow2 = max(_next_pow2(dim), 16)
    if len(plan.decode_tokens):
        decode_kernel[(len(plan.decode_tokens), kv_heads)](
            out,
            q,
            k,
            v,
            table,
            plan.decode_tokens,
            meta.token_request,
            meta.positions,
            *common,
            BLOCK=_next_pow2(block_size),
            GROUPS=group_pow2,
            DIM=_next_pow2(dim),
        )
    if plan.prefill:
        tile = prefill_tile(groups)
        tiles = plan.triton_tiles.get(tile)
        if tiles is None:
            tiles = plan.triton_tiles[tile] = _tiles(meta, plan, tile)
        prefill_kernel[(len(tiles[0]), kv_heads)](
            out,
            q,
            k,
            v,
            table,
            *tiles,
            meta.positions,
            *common,
            TILE=tile,
            GROUPS=group_pow2,
            DIM=dim_pow2,
            KV_TILE=_KV_TILE,
            FP32=query.dtype == torch.float32,
        )
    return out


#: Rows (new tokens x query heads of one KV head) per prefill program, and context positions
#: per inner step.
_ROWS = 64
_KV_TILE = 32


def prefill_tile(groups: int) -> int:
    """New tokens per prefill program, for ``groups`` query heads per KV head."""
    return max(_ROWS // _next_pow2(groups), 1)


def _tiles(
    meta: AttentionMetadata, plan: StepPlan, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill chunks cut into tiles of ``tile`` tokens: (request, first token, count)."""
    request, first, count = [], [], []
    for chunk in plan.prefill:
        for a in range(chunk.first, chunk.end, tile):
            request.append(chunk.request)
            first.append(a)
            count.append(min(tile, chunk.end - a))
    device = meta.block_table.device
    return (
        torch.tensor(request, dtype=torch.long, device=device),
        torch.tensor(first, dtype=torch.long, device=device),
        torch.tensor(count, dtype=torch.long, device=device),
    )
