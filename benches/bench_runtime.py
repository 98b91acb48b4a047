"""Paged attention on the CPU: a mixed batch costs about its real work, not the padding to its
longest request.

    pytest benches/bench_runtime.py -s --benchmark-columns=median,rounds [--ratios-md FILE]

- mixed batch (one 512-token prefill chunk at context 1,536 + 31 decodes at context 2,048)
  against the same two parts run as separate batches, and against the padded attention that
  kvblocks used before (every request padded to the longest query and context);
- the peak memory of the mixed batch against the separate batches' (resident set, Linux);
- a decode-only batch of 64 requests at context 2,048: tokens/s and KV bytes read per second.

Small heads (8 query heads, 2 KV heads, head_dim 32, float32, block size 16) keep it to
seconds on two cores.
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the runtime needs the kvblocks[torch] extra")
F = torch.nn.functional

from kvblocks.runtime import AttentionMetadata, PagedKVCache, paged_attention  # noqa: E402

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 2, 32
PREFILL = [(1536, 512)]  # (context length after the step, new tokens)
DECODES = [(2048, 1)] * 31
MIXED = "mixed batch: 512-token prefill chunk + 31 decodes at 2k context"
RESULTS: dict[str, float] = {}


class Batch:
    """Requests of the given shapes on shuffled blocks of a random cache, plus their queries."""

    def __init__(self, shapes: list[tuple[int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // BLOCK_SIZE) for n, _ in shapes]
        num_blocks = sum(need) + 1
        self.cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.cache.key[0].copy_(torch.randn(self.cache.key[0].shape, generator=gen))
        self.cache.value[0].copy_(torch.randn(self.cache.value[0].shape, generator=gen))
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).numpy()
        table = np.zeros((len(shapes), max(need)), dtype=np.int32)
        starts, slots, used = [0], [], 0
        for r, ((length, new), nb) in enumerate(zip(shapes, need, strict=True)):
            table[r, :nb] = ids[used : used + nb]
            used += nb
            pos = np.arange(length - new, length)
            slots += (table[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).tolist()
            starts.append(starts[-1] + new)
        self.table, self.starts, self.slots = table, np.array(starts), np.array(slots)
        self.seq_lens = np.array([n for n, _ in shapes], dtype=np.int32)
        self.meta = AttentionMetadata.from_arrays(
            table, self.seq_lens, self.starts.astype(np.int32), self.slots.astype(np.int32)
        )
        self.query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen)

    def part(self, first: int, end: int) -> Batch:
        """Requests ``first:end`` alone, as their own batch on the same cache."""
        part = Batch.__new__(Batch)
        part.cache = self.cache
        lo, hi = self.starts[first], self.starts[end]
        part.table, part.seq_lens = self.table[first:end], self.seq_lens[first:end]
        part.starts, part.slots = self.starts[first : end + 1] - lo, self.slots[lo:hi]
        part.meta = AttentionMetadata.from_arrays(
            part.table, part.seq_lens, part.starts.astype(np.int32), part.slots.astype(np.int32)
        )
        part.query = self.query[lo:hi]
        return part

    def run(self) -> torch.Tensor:
        return paged_attention(self.query, self.cache.key[0], self.cache.value[0], self.meta)

    def run_padded(self) -> torch.Tensor:
        return padded_attention(self.query, self.cache.key[0], self.cache.value[0], self.meta)

    @property
    def kv_bytes(self) -> int:
        """K and V bytes of every request's context (what attention has to read)."""
        item = self.cache.key[0].element_size()
        return int(self.seq_lens.sum()) * KV_HEADS * HEAD_DIM * item * 2


def padded_attention(query: Any, key_cache: Any, value_cache: Any, meta: AttentionMetadata) -> Any:
    """The padded attention this runtime replaced: whole blocks of every request gathered, the
    queries padded to the longest, one masked ``scaled_dot_product_attention``."""
    num_reqs, width = meta.block_table.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    keys = key_cache[meta.block_table].reshape(num_reqs, width * block_size, num_kv_heads, head_dim)
    values = value_cache[meta.block_table].reshape(keys.shape)
    keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)
    values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
    padded = query.new_zeros(num_reqs, meta.max_query_len, num_heads, head_dim)
    padded[meta.token_request, meta.token_index] = query
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    first = meta.seq_lens - query_lens
    query_pos = first[:, None] + torch.arange(meta.max_query_len)[None, :]
    mask = torch.arange(width * block_size)[None, None, :] <= query_pos[:, :, None]
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
    )
    return out.transpose(1, 2)[meta.token_request, meta.token_index]


# Peak resident memory of one call (Linux, glibc): free heap memory handed back to the system
# (malloc_trim), then the high-water mark reset (clear_refs) just before the call.
try:
    _LIBC: Any = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
except OSError:  # another C library
    _LIBC = None


def _status(key: str) -> int:
    match = re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match.group(1)) * 1024


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Bytes the call adds to the resident set at its peak (``None`` where not measurable)."""
    if _LIBC is None:
        return None
    fn()  # warm up: lazy initializations are not the call's memory
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        return None
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


@pytest.fixture(scope="module")
def batches() -> dict[str, Batch]:
    mixed = Batch(PREFILL + DECODES)
    return {"mixed": mixed, "prefill": mixed.part(0, 1), "decode": mixed.part(1, len(DECODES) + 1)}


def _label(benchmark: Any, impl: str, baselines: list[list[str]]) -> None:
    benchmark.group = MIXED
    benchmark.extra_info.update(case=MIXED, impl=impl, baselines=baselines)


def test_mixed_batch(benchmark: Any, batches: dict[str, Batch]) -> None:
    b = batches["mixed"]
    _label(benchmark, "mixed batch", [[MIXED, "separate batches"], [MIXED, "padded (before)"]])
    out = benchmark(b.run)
    # The mixed batch computes exactly what its parts compute on their own.
    n = PREFILL[0][1]
    torch.testing.assert_close(out[:n], batches["prefill"].run(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[n:], batches["decode"].run(), atol=1e-5, rtol=1e-5)
    assert out.isfinite().all()
    if benchmark.stats:
        RESULTS["mixed_s"] = benchmark.stats.stats.median
    peak = peak_memory(b.run)
    if peak is not None:
        benchmark.extra_info["peak_bytes"] = peak
        RESULTS["mixed_peak"] = peak
        print(f"\n{MIXED}: peak memory {peak / 2**20:.1f} MiB")


def test_separate_batches(benchmark: Any, batches: dict[str, Batch]) -> None:
    prefill, decode = batches["prefill"], batches["decode"]
    _label(benchmark, "separate batches", [])

    def run() -> None:
        prefill.run()
        decode.run()

    benchmark(run)
    if benchmark.stats and "mixed_s" in RESULTS:
        ratio = RESULTS["mixed_s"] / benchmark.stats.stats.median
        print(
            f"\nmixed batch / (prefill batch + decode batch), medians: {ratio:.2f}x (target 1.2x)"
        )
    peaks = [peak_memory(prefill.run), peak_memory(decode.run)]
    if None not in peaks:
        peak = max(p for p in peaks if p is not None)
        benchmark.extra_info["peak_bytes"] = peak
        RESULTS["separate_peak"] = peak
        print(f"\n{MIXED}, separate batches: peak memory {peak / 2**20:.1f} MiB")
        if "mixed_peak" in RESULTS:
            ratio = RESULTS["mixed_peak"] / max(peak, 1)
            print(f"mixed / separate peak memory: {ratio:.2f}x")
            assert ratio < 1.5 + 8 * 2**20 / max(peak, 1)  # 1.5x, with 8 MiB of noise


def test_padded_before(benchmark: Any, batches: dict[str, Batch]) -> None:
    b = batches["mixed"]
    _label(benchmark, "padded (before)", [])
    out = benchmark.pedantic(b.run_padded, rounds=3, warmup_rounds=0)
    torch.testing.assert_close(out, b.run(), atol=1e-4, rtol=1e-4)
    peak = peak_memory(b.run_padded)
    if peak is not None:
        benchmark.extra_info["peak_bytes"] = peak
        print(f"\n{MIXED}, padded (before): peak memory {peak / 2**20:.1f} MiB")


DECODE_ONLY = "decode-only batch: 64 requests at 2k context"


@pytest.fixture(scope="module")
def decode_only() -> Batch:
    return Batch([(2048, 1)] * 64, seed=1)


def test_decode_only_batch_padded_before(benchmark: Any, decode_only: Batch) -> None:
    benchmark.group = DECODE_ONLY
    benchmark.extra_info.update(case=DECODE_ONLY, impl="padded (before)", baselines=[])
    out = benchmark.pedantic(decode_only.run_padded, rounds=3, warmup_rounds=0)
    torch.testing.assert_close(out, decode_only.run(), atol=1e-4, rtol=1e-4)


def test_decode_only_batch(benchmark: Any, decode_only: Batch) -> None:
    b, case = decode_only, DECODE_ONLY
    benchmark.group = case
    benchmark.extra_info.update(
        case=case, impl="paged attention", baselines=[[case, "padded (before)"]]
    )
    out = benchmark(b.run)
    assert out.shape == (64, HEADS, HEAD_DIM)
    assert out.isfinite().all()
    median = benchmark.stats.stats.median if benchmark.stats else None
    if median:
        tokens_per_s, bytes_per_s = 64 / median, b.kv_bytes / median
        bandwidth = copy_bandwidth()
        benchmark.extra_info.update(
            tokens_per_s=tokens_per_s, kv_bytes_per_s=bytes_per_s, copy_bytes_per_s=bandwidth
        )
        print(
            f"\n{case}: {tokens_per_s:,.0f} tokens/s per layer, "
            f"{bytes_per_s / 1e9:.2f} GB/s of KV read ({b.kv_bytes / 2**20:.0f} MiB per call), "
            f"{bytes_per_s / bandwidth:.0%} of this machine's memory bandwidth as a large tensor "
            f"copy measures it ({bandwidth / 1e9:.1f} GB/s read + write)"
        )


def copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes per second moved (read + written) by copying a large tensor: the memory
    bandwidth decode attention is bounded by, measured in the same run (best of five)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best
