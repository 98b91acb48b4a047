"""The Triton kernels prove themselves on a device before ``backend="auto"`` uses them.

A kernel that builds and runs can still be wrong on a GPU it was never run on (a compiler
change, a ``tl.dot`` lowering, an architecture's quirk), and a wrong kernel raises nothing. So
the first ``backend="auto"`` call that would take the Triton path on a device runs each kernel
once on a tiny batch and compares it with the torch path:

- decode: three requests of 1, ``1.5 * block_size + 1`` (ends mid-block) and
  ``max(3 * block_size, 37)`` (ends on a block boundary, many blocks) tokens of context;
- prefill: a chunk of ``tile + 3`` new tokens (two of the kernel's query tiles, so two
  programs) after ``block_size + 3`` cached ones, and a 5-token prompt from position 0.

Both batches use the call's own head count, KV heads (GQA), head_dim, block size, scale and
dtypes, so the check runs the kernel variants the real calls compile. Each request's blocks
are scattered in descending order with a free block between any two, and every slot outside
the requests' contexts (the tails of last blocks, the blocks between, the null block 0 that
pads the block table) holds NaN: a kernel that reads past a context, or lets a masked slot
reach the output (the runtime promises it never does), returns NaN and fails. The reference
is the torch path run on the CPU in float64 over the same values (K/V rounded to the cache's
dtype, then to the query's, as the torch path rounds them) on a cache without the poison, so
it owes nothing to the device or to the torch path's own masking.

The tolerance is on the largest absolute error, per query dtype (the kernels compute in it).
Queries, keys and values are standard normal, so ``|v| < 5`` and the outputs, averages of
values, are mostly below 2:

- float32, ``1e-4``: both kernels accumulate in float32 (the prefill ``tl.dot`` in IEEE
  precision); a correct kernel is off by under ``1e-6`` (at most ``6e-7`` under the
  interpreter), while TF32, what ``tl.dot`` does with float32 by default, would be off by
  about ``1e-3`` (rounding the check's inputs to TF32 alone moves its outputs by ``9e-4`` to
  ``1.5e-3``);
- float16, ``1e-2``: two roundings the float64 reference does not make: the output to
  float16 (half an ulp: at most ``1e-3`` below 4) and, in the prefill kernel, the softmax
  weights to float16 before ``p @ v`` (``2**-11`` relative: at most ``2**-11 * max|v|``,
  ``2.5e-3``); about ``3.5e-3`` at worst, ``1e-3`` measured under the interpreter;
- bfloat16, ``4e-2``: the same two roundings with bfloat16's 8-bit significand (``2**-8``
  relative): at most ``8e-3`` and ``2e-2``, ``2.8e-2`` together (``5e-3`` measured for the
  decode kernel under the interpreter, whose bfloat16 ``tl.dot`` is not usable);
- anything else: ``max(1e-4, 8 * eps)``.

A wrong kernel misses by far more: another request's output, a wrong KV head or a missing
causal mask change outputs by tenths or more, and a dropped or extra position does on the
short contexts (the 1-token context, the prompt's first tokens).

On a mismatch or an exception the device gets the torch path for the rest of the process,
with one ``RuntimeWarning`` naming the kernel and its error (the same happens, on that
device, when a Triton call raises later). A passed check is remembered per device, dtypes,
geometry and softmax scale (one model: one check per device). ``backend="triton"`` is never
checked: it asks for the kernels, whatever they return. :func:`check_kernels` runs the check
by hand and returns the errors (``benches/gpu_selfcheck.py`` prints them on a GPU).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

import kvblocks.runtime.triton_attention as triton_attention
from kvblocks.runtime._metadata import AttentionMetadata, checked_plan
from kvblocks.runtime._torch_attention import torch_paged_attention

_TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def tolerance(dtype: torch.dtype) -> float:
    """The largest absolute error a kernel may make with a ``dtype`` query (see above)."""
    return _TOLERANCES.get(dtype, max(1e-4, 8 * torch.finfo(dtype).eps))


@dataclass(frozen=True)
class KernelCheck:
    """One kernel's result: its largest absolute error against the torch path (NaN when its
    output was not finite, or when it raised: then ``exception`` says what)."""

    kernel: str
    max_error: float
    tolerance: float
    exception: str | None = None

    @property
    def passed(self) -> bool:
        return self.exception is None and self.max_error <= self.tolerance  # NaN: False

    def describe(self) -> str:
        if self.exception is not None:
            return f"raised {self.exception}"
        if not math.isfinite(self.max_error):
            return (
                f"non-finite output (max abs error {self.max_error}, tolerance {self.tolerance:g})"
            )
        verdict = "<=" if self.passed else ">"
        return f"max abs error {self.max_error:.3g} {verdict} tolerance {self.tolerance:g}"


@dataclass(frozen=True)
class Geometry:
    """What the kernels specialize on besides the device."""

    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int

    def __str__(self) -> str:
        return (
            f"{_name(self.query_dtype)} query, {_name(self.cache_dtype)} KV cache, "
            f"{self.heads} heads over {self.kv_heads} KV heads, head_dim {self.head_dim}, "
            f"block size {self.block_size}"
        )


@dataclass(frozen=True)
class SelfCheck:
    """Both kernels' results on one device for one geometry."""

    device: str
    geometry: Geometry
    checks: tuple[KernelCheck, ...]  # decode, prefill

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failure(self) -> str | None:
        """The warning's first part: which kernels failed and how (None when none did)."""
        failed = [c for c in self.checks if not c.passed]
        if not failed:
            return None
        names = " and ".join(c.kernel for c in failed)
        errors = "; ".join(f"{c.kernel}: {c.describe()}" for c in failed)
        noun = "kernel" if len(failed) == 1 else "kernels"
        return (
            f"the Triton {names} {noun} failed the self-check on {self.device} "
            f"({self.geometry}): {errors}"
        )


def check_kernels(
    device: str | torch.device,
    query_dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    *,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    scale: float | None = None,
) -> SelfCheck:
    """Runs both Triton kernels on ``device`` once on their check batch and measures them
    against the torch path (no state changes; a kernel's exception is reported, not raised)."""
    geometry = Geometry(
        query_dtype, cache_dtype or query_dtype, heads, kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5 if scale is None else scale
    data = _CheckData.build(geometry)
    k, v = (c.masked_fill(~data.used, math.nan).to(device, geometry.cache_dtype) for c in data.kv)
    # The torch path's rounding: the cache's dtype, then the query's (float64 after that).
    ref_k, ref_v = (c.to(geometry.cache_dtype).to(query_dtype).double() for c in data.kv)
    tol = tolerance(query_dtype)
    checks = []
    for batch in data.batches:
        query = batch.query.to(query_dtype)
        try:
            ref_meta = AttentionMetadata.from_arrays(*batch.arrays)
            ref_query = query.double()
            ref_plan = checked_plan(ref_query, ref_k, ref_v, ref_meta)
            expected = torch_paged_attention(ref_query, ref_k, ref_v, ref_plan, float(scale))
            meta = AttentionMetadata.from_arrays(*batch.arrays, device=device)
            out = triton_attention.triton_paged_attention(
                query.to(device), k, v, meta, meta.plan(block_size), scale
            )
            error = float((out.cpu().double() - expected).abs().max())
            checks.append(KernelCheck(batch.kernel, error, tol))
        except Exception as e:  # reported: the caller falls back to the torch path
            checks.append(KernelCheck(batch.kernel, math.nan, tol, repr(e)))
    return SelfCheck(str(torch.device(device)), geometry, tuple(checks))


@dataclass(frozen=True)
class _Batch:
    """One kernel's check batch: its queries (float32, CPU) and metadata arrays."""

    kernel: str
    query: torch.Tensor
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _CheckData:
    """The check's values (float32, on the CPU): K/V of every request in one cache, which
    slots hold them, and the decode and prefill batches."""

    kv: tuple[torch.Tensor, torch.Tensor]  # [num_blocks, block_size, kv_heads, head_dim]
    used: torch.Tensor  # [num_blocks, block_size, 1, 1] bool
    batches: tuple[_Batch, _Batch]

    @classmethod
    def build(cls, g: Geometry) -> _CheckData:
        b = g.block_size
        tile = triton_attention.prefill_tile(g.heads // g.kv_heads)
        # (context length after the step, new tokens)
        decodes = [(1, 1), (b + b // 2 + 1, 1), (max(3 * b, 37), 1)]
        prefills = [(b + 3 + tile + 3, tile + 3), (5, 5)]
        needed = [-(-n // b) for n, _ in decodes + prefills]
        total = sum(needed)
        # Request after request, descending ids with a poisoned block between any two.
        free = iter(range(2 * total + 1, 1, -2))
        blocks = [[next(free) for _ in range(n)] for n in needed]
        num_blocks = 2 * total + 2
        gen = torch.Generator().manual_seed(0)
        shape = (num_blocks, b, g.kv_heads, g.head_dim)
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        used = torch.zeros(num_blocks * b, dtype=torch.bool)
        for (length, _), owned in zip(decodes + prefills, blocks, strict=True):
            used[_slots(owned, b, 0, length)] = True
        width = max(needed) + 1  # a padding column of the null block

        def batch(kernel: str, requests: list[tuple[int, int]], tables: list[list[int]]) -> _Batch:
            table = np.zeros((len(requests), width), dtype=np.int32)
            starts, slots = [0], []
            for row, ((length, new), owned) in enumerate(zip(requests, tables, strict=True)):
                table[row, : len(owned)] = owned
                starts.append(starts[-1] + new)
                slots += _slots(owned, b, length - new, length)
            lens = np.array([n for n, _ in requests], dtype=np.int32)
            query = torch.randn(starts[-1], g.heads, g.head_dim, generator=gen)
            arrays = (table, lens, np.array(starts, np.int32), np.array(slots, np.int32))
            return _Batch(kernel, query, arrays)

        return cls(
            (k, v),
            used.view(num_blocks, b, 1, 1),
            (batch("decode", decodes, blocks[:3]), batch("prefill", prefills, blocks[3:])),
        )


def _slots(blocks: list[int], block_size: int, first: int, end: int) -> list[int]:
    """The slots of positions ``first:end`` of a request on ``blocks``."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(first, end)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_LOCK = threading.RLock()
#: (device, geometry, scale) whose check passed.
_VERIFIED: set[tuple[str, Geometry, float]] = set()
#: Devices on which "auto" uses the torch path for the rest of the process.
_TORCH_ONLY: set[str] = set()


def kernels_verified(query: torch.Tensor, key_cache: torch.Tensor, scale: float) -> bool:
    """Whether ``backend="auto"`` may run the Triton kernels for this call: runs the check the
    first time a device sees this geometry and ``scale``; a failure sends the device to the
    torch path."""
    device = str(query.device)
    if device in _TORCH_ONLY:
        return False
    _, block_size, kv_heads, head_dim = key_cache.shape
    geometry = Geometry(
        query.dtype, key_cache.dtype, query.shape[1], kv_heads, head_dim, block_size
    )
    key = (device, geometry, float(scale))
    if key in _VERIFIED:
        return True
    with _LOCK:  # one check per device, geometry and scale, even with several threads
        if device in _TORCH_ONLY:
            return False
        if key in _VERIFIED:
            return True
        with torch.no_grad():
            report = check_kernels(
                query.device,
                query.dtype,
                key_cache.dtype,
                heads=geometry.heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                scale=scale,
            )
        failure = report.failure()
        if failure is None:
            _VERIFIED.add(key)
            return True
        # (kernels_verified <- _auto_triton <- paged_attention <- its caller)
        use_torch_on(query.device, failure, stacklevel=4)
        return False


def use_torch_on(device: torch.device | str, reason: str, *, stacklevel: int = 2) -> None:
    """Sends ``device`` to the torch path for the rest of the process, with one warning
    (``reason`` says why; a device already sent there warns no more)."""
    name = str(device)
    with _LOCK:
        if name in _TORCH_ONLY:
            return
        _TORCH_ONLY.add(name)
    warnings.warn(
        f"{reason}; using the torch path on {name} for the rest of this process",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


def forget() -> None:
    """Forgets every verdict (for tests: the next "auto" call checks again)."""
    with _LOCK:
        _VERIFIED.clear()
        _TORCH_ONLY.clear()
