"""Paged attention over kvblocks' block tables.

A step's requests are split once (on the host, when the metadata is built) into

- decode-like requests (one new token): sorted by context length into buckets whose lengths
  differ by at most a quarter (or 64 tokens), each bucket gathered token by token through
  its slots and attended by one batched ``scaled_dot_product_attention`` (no padding to the
  longest request of the step: at most to the longest of the bucket);
- prefill chunks (several new tokens): each chunk gathers its own context (``seq_len`` slots,
  never more) and runs ``scaled_dot_product_attention`` with a causal mask offset by the
  tokens already computed.

Only the slots of a request's context are ever read, so whatever sits in the rest of the cache
(the tail of a request's last block, other requests' blocks, the null block 0, NaN or Inf
included) cannot change the result. On CUDA, when Triton is importable, the same work runs in
the Triton kernels of :mod:`kvblocks.runtime.triton_attention` once they have passed their
self-check on the device (:mod:`kvblocks.runtime.triton_selfcheck`); this torch path is the
fallback and the reference.

The step's metadata and its split live in :mod:`kvblocks.runtime._metadata` and the torch path
in :mod:`kvblocks.runtime._torch_attention`, below both this module and the Triton modules
(which import them, never this module); this module dispatches a call to one path or the other.
"""

from __future__ import annotations

import functools
import importlib

import torch

from kvblocks.runtime._metadata import (
    AttentionMetadata,
    DecodeBucket,
    PrefillChunk,
    StepPlan,
    checked_plan,
)
from kvblocks.runtime._torch_attention import torch_paged_attention

__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "DecodeBucket",
    "PrefillChunk",
    "StepPlan",
    "paged_attention",
    "torch_paged_attention",
    "triton_available",
]

BACKENDS = ("auto", "torch", "triton")


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of the step's new tokens (``query``: ``[T, num_heads, head_dim]``) over each
    request's cached and new K/V, read through the block table; returns ``[T, heads, dim]`` in
    the query's dtype. ``backend``: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA
    when it is importable and its kernels passed their self-check on the device, else
    torch)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    plan = checked_plan(query, key_cache, value_cache, meta)
    scale = query.shape[2] ** -0.5 if scale is None else float(scale)
    if backend == "triton" or (backend == "auto" and _auto_triton(query, key_cache, scale)):
        import kvblocks.runtime.triton_attention as triton_attention

        try:
            return triton_attention.triton_paged_attention(
                query, key_cache, value_cache, meta, plan, scale
            )
        except Exception as e:  # a kernel that does not build here: the torch path works
            if backend == "triton":
                raise
            import kvblocks.runtime.triton_selfcheck as triton_selfcheck

            triton_selfcheck.use_torch_on(
                query.device, f"the Triton paged-attention kernels failed ({e!r})", stacklevel=2
            )
    return torch_paged_attention(query, key_cache, value_cache, plan, scale)


#: The device types on which ``backend="auto"`` considers the Triton kernels (the tests add
#: ``"cpu"`` to run the whole "auto" path under ``TRITON_INTERPRET=1``).
_TRITON_DEVICE_TYPES = frozenset({"cuda"})


def _auto_triton(query: torch.Tensor, key_cache: torch.Tensor, scale: float) -> bool:
    """Whether ``backend="auto"`` takes the Triton kernels for this call: on a CUDA device,
    when Triton imports, and once both kernels passed their self-check there (see
    :mod:`kvblocks.runtime.triton_selfcheck`; the first call on a device runs it)."""
    if query.device.type not in _TRITON_DEVICE_TYPES or not triton_available():
        return False
    import kvblocks.runtime.triton_selfcheck as triton_selfcheck

    return triton_selfcheck.kernels_verified(query, key_cache, scale)


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports (checked once per process)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True
