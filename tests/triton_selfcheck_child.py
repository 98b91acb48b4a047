"""Runs the Triton kernels' self-check under ``TRITON_INTERPRET=1`` (started as a child
process by tests/test_runtime_triton.py, with ``tests/`` as its working directory)
and prints one JSON object: each scenario's observations, for the parent to judge.

A scenario replaces one or both kernels by a wrapper that launches the real kernel with edited
arguments, edits its output, or raises; then calls ``paged_attention(backend="auto")`` three
times on a mixed batch with ``"cpu"`` counted as a Triton device.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from test_runtime import _attention_case

from kvblocks.runtime import attention, paged_attention, triton_attention, triton_selfcheck

Args = list[Any]
Edit = Callable[[Args], None]

#: The real kernels and launcher (set by main, once Triton imported), and the launches since
#: a scenario began.
REAL_KERNELS: Any = None
REAL_LAUNCH = triton_attention.triton_paged_attention
LAUNCHES = [0]


def counted_launch(*args: Any) -> torch.Tensor:
    LAUNCHES[0] += 1
    return REAL_LAUNCH(*args)


class Wrapped:
    """A kernel launched as ``kernel[grid](*args)`` whose arguments ``before`` edits and whose
    arguments (the output first) ``after`` reads once it ran."""

    def __init__(self, kernel: Any, before: Edit | None = None, after: Edit | None = None):
        self.kernel, self.before, self.after = kernel, before, after

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            edited = list(args)
            if self.before:
                self.before(edited)
            self.kernel[grid](*edited, **kwargs)
            if self.after:
                self.after(edited)

        return launch


def raises(message: str) -> Edit:
    def edit(args: Args) -> None:
        raise RuntimeError(message)

    return edit


# Argument positions, as triton_attention launches the kernels.
DECODE_TOKENS, DECODE_POSITIONS, STRIDE_KH, STRIDE_VH = 5, 7, 15, 18
TILE_START, TILE_LEN, PREFILL_POSITIONS = 6, 7, 8


def decode_rows(args: Args) -> torch.Tensor:
    return args[DECODE_TOKENS]


def prefill_rows(args: Args) -> torch.Tensor:
    starts, lens = args[TILE_START].tolist(), args[TILE_LEN].tolist()
    return torch.tensor([s + i for s, n in zip(starts, lens, strict=True) for i in range(n)])


def add_to(rows: Callable[[Args], torch.Tensor], delta: float) -> Edit:
    def edit(args: Args) -> None:
        args[0][rows(args)] += delta

    return edit


def swap_requests(args: Args) -> None:
    """Each decode token gets the next decode token's (another request's) output."""
    rows = decode_rows(args)
    args[0][rows] = args[0][rows.roll(1)].clone()


def one_more_position(at: int) -> Edit:
    def edit(args: Args) -> None:
        args[at] = args[at] + 1

    return edit


def kv_head_zero(args: Args) -> None:
    """Every query head reads KV head 0 (GQA's head mapping ignored)."""
    args[STRIDE_KH] = args[STRIDE_VH] = 0


def tile_not_causal(args: Args) -> None:
    """Every token of a prefill tile sees as far as the tile's last token."""
    positions = args[PREFILL_POSITIONS].clone()
    for start, n in zip(args[TILE_START].tolist(), args[TILE_LEN].tolist(), strict=True):
        positions[start : start + n] = positions[start + n - 1]
    args[PREFILL_POSITIONS] = positions


# name -> (decode wrapper, prefill wrapper) as keyword arguments of Wrapped
SCENARIOS: dict[str, tuple[dict[str, Edit], dict[str, Edit]]] = {
    "real": ({}, {}),
    "decode off by 1e-3": ({"after": add_to(decode_rows, 1e-3)}, {}),
    "decode off by 1e-6": ({"after": add_to(decode_rows, 1e-6)}, {}),
    "decode swaps requests": ({"after": swap_requests}, {}),
    "decode reads past the context": ({"before": one_more_position(DECODE_POSITIONS)}, {}),
    "decode ignores GQA": ({"before": kv_head_zero}, {}),
    "decode raises": ({"before": raises("decode launch failed")}, {}),
    "prefill off by 1e-3": ({}, {"after": add_to(prefill_rows, 1e-3)}),
    "prefill not causal": ({}, {"before": tile_not_causal}),
    "prefill reads past the context": ({}, {"before": one_more_position(PREFILL_POSITIONS)}),
    "prefill raises": ({}, {"before": raises("prefill launch failed")}),
    "both raise": ({"before": raises("decode down")}, {"before": raises("prefill down")}),
}

# A mixed batch: decodes of 1 to 70 tokens of context and prefill chunks of 5 and 16 tokens,
# 4 query heads over 2 KV heads, block size 16, NaN outside the contexts.
CASE = _attention_case("cpu", 16, 2, "nan")


def scenario(decode: dict[str, Edit], prefill: dict[str, Edit]) -> dict[str, Any]:
    query, cache, meta, _ = CASE
    k, v = cache.key[0], cache.value[0]
    triton_selfcheck.forget()
    triton_attention._KERNEL = (
        Wrapped(REAL_KERNELS[0], **decode),
        Wrapped(REAL_KERNELS[1], **prefill),
    )
    LAUNCHES[0] = 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [paged_attention(query, k, v, meta)]
            launches_after_first = LAUNCHES[0]
            outs += [paged_attention(query, k, v, meta) for _ in range(2)]
        launches = LAUNCHES[0]
        torch_out = paged_attention(query, k, v, meta, backend="torch")
        try:
            triton_out: torch.Tensor | None = paged_attention(query, k, v, meta, backend="triton")
        except RuntimeError:
            triton_out = None
    finally:
        triton_attention._KERNEL = REAL_KERNELS
    return {
        "launches": launches,
        "launches_after_first": launches_after_first,
        "warnings": [str(w.message) for w in caught],
        "categories": [w.category.__name__ for w in caught],
        "torch_only": sorted(triton_selfcheck._TORCH_ONLY),
        "auto_is_torch": all(torch.equal(o, torch_out) for o in outs),
        "auto_is_triton": triton_out is not None and all(torch.equal(o, triton_out) for o in outs),
        "triton_is_torch": triton_out is not None and torch.equal(triton_out, torch_out),
        "triton_vs_torch": None
        if triton_out is None
        else float((triton_out - torch_out).abs().max()),
    }


def check_errors() -> dict[str, Any]:
    """The real kernels' errors for each dtype and geometry the interpreter can run."""
    rows = {}
    for dtype, cache_dtype in [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ]:
        for heads, kv_heads, head_dim, block_size in [(4, 4, 16, 1), (8, 2, 32, 16)]:
            report = triton_selfcheck.check_kernels(
                "cpu",
                dtype,
                cache_dtype,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
            )
            rows[str(report.geometry)] = [
                [c.kernel, c.max_error, c.tolerance, c.exception] for c in report.checks
            ]
    return rows


def main() -> None:
    global REAL_KERNELS
    assert os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        print(json.dumps({"skip": f"triton cannot be imported: {e}"}))
        return
    REAL_KERNELS = triton_attention._kernel()
    triton_attention.triton_paged_attention = counted_launch
    attention._TRITON_DEVICE_TYPES = frozenset({"cpu"})  # "auto" takes Triton on the CPU here
    results: dict[str, Any] = {}
    for name, (decode, prefill) in SCENARIOS.items():
        try:
            results[name] = scenario(decode, prefill)
        except Exception as e:  # reported to the parent, which fails that case
            results[name] = f"{type(e).__name__}: {e}"
    results["errors"] = check_errors()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
