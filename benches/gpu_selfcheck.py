"""The Triton kernels' self-check on a real CUDA GPU: prints each kernel's largest error against
the torch path per dtype and geometry, then runs a small model through ``attention="auto"``.

    python3 benches/gpu_selfcheck.py [--json FILE]

from the checkout, with kvblocks installed in the environment (``pip install ".[torch]"``, or
``pip install -e ".[torch]"``: the Rust extension is built by the install, so the source tree's
``python/`` alone cannot be imported; on Linux, torch's CUDA wheel brings Triton).

Exits 1 when a kernel fails its check, the "auto" path warns or does not take the Triton
kernels, or CUDA or Triton is missing. (Under ``TRITON_INTERPRET=1`` the same check runs in
tests/test_runtime_triton.py; this is the run on hardware, about a minute with compilation.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch

import kvblocks
from kvblocks.model import LlamaConfig, LlamaForCausalLM
from kvblocks.runtime import ModelRunner, triton_attention, triton_selfcheck
from kvblocks.runtime.attention import triton_available

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
#: (query dtype, KV-cache dtype)
DTYPES = [(f32, f32), (f16, f16), (bf16, bf16), (f32, bf16)]
#: (heads, KV heads, head_dim, block size): GQA 4 (Llama-3 8B's heads), GQA 7 (a group count
#: that is not a power of two), head_dim 80, block sizes 1 and 32, no GQA.
GEOMETRIES = [(8, 2, 64, 16), (32, 8, 128, 16), (14, 2, 64, 16), (12, 4, 80, 32), (4, 4, 64, 1)]


def kernel_errors(device: str) -> list[dict[str, Any]]:
    rows = []
    for query_dtype, cache_dtype in DTYPES:
        for heads, kv_heads, head_dim, block_size in GEOMETRIES:
            start = time.perf_counter()
            report = triton_selfcheck.check_kernels(
                device,
                query_dtype,
                cache_dtype,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
            )
            seconds = time.perf_counter() - start
            cells = "  ".join(f"{c.kernel} {c.describe():<44}" for c in report.checks)
            print(
                f"{'ok  ' if report.passed else 'FAIL'} {report.geometry}  {cells} {seconds:.1f}s"
            )
            rows.append(
                {
                    "geometry": str(report.geometry),
                    "passed": report.passed,
                    "seconds": seconds,
                    "kernels": {
                        c.kernel: {
                            "max_error": c.max_error,
                            "tolerance": c.tolerance,
                            "exception": c.exception,
                        }
                        for c in report.checks
                    },
                }
            )
    return rows


def auto_model_run(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """A mixed prefill step, a second chunk and three decode steps of a random 2-layer model
    (8 heads over 2 KV heads, head_dim 64) through ``attention="auto"`` and ``"torch"``."""
    triton_selfcheck.forget()
    real = triton_attention.triton_paged_attention
    launches = [0]

    def counted(*args: Any) -> torch.Tensor:
        launches[0] += 1
        return real(*args)

    triton_attention.triton_paged_attention = counted  # type: ignore[assignment]
    config = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM.random(config, seed=1, dtype=dtype, device=device)
    manager = kvblocks.BlockManager(64, 16)
    auto = ModelRunner(model, 64, 16, device=device, attention="auto")
    reference = ModelRunner(model, 64, 16, device=device, attention="torch")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, n).tolist() for n in (70, 23)]
    handles = [manager.add_request(f"r{i}", s) for i, s in enumerate(seqs)]
    worst = 0.0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def run(step: Any, ids: list[int]) -> None:
                nonlocal worst
                out = auto.execute(step, np.array(ids))
                ref = reference.execute(step, np.array(ids))
                worst = max(worst, float((out - ref).abs().max()))

            step = manager.schedule_step(handles, [40, 23])
            run(step, seqs[0][:40] + seqs[1])
            step = manager.schedule_step(handles[:1], [30])
            run(step, seqs[0][40:])
            for t in range(3):
                new = [7 + t, 9 + t]
                step = manager.schedule_step(
                    handles, [1, 1], new_token_ids=new, new_token_offsets=[0, 1, 2]
                )
                run(step, new)
    finally:
        triton_attention.triton_paged_attention = real
    return {
        "dtype": str(dtype),
        "warnings": [str(w.message) for w in caught],
        "triton_launches": launches[0],  # 2 (the check) + 2 layers x 5 steps when used
        "max_logit_diff_vs_torch": worst,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not triton_available():
        print("needs a CUDA device and triton")
        return 1
    device = "cuda:0"
    print(torch.cuda.get_device_name(device), "torch", torch.__version__, end=" ")
    import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]

    print("triton", triton.__version__)
    rows = kernel_errors(device)
    runs = [auto_model_run(device, dtype) for dtype in (f32, bf16)]
    for run in runs:
        print("auto model run:", json.dumps(run))
    ok = all(r["passed"] for r in rows) and all(
        not r["warnings"] and r["triton_launches"] == 2 + 2 * 5 for r in runs
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": rows, "auto": runs, "ok": ok}, f, indent=1)
    print("all kernels passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
