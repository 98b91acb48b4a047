"""The Triton paged-attention kernel against dense attention and the torch path, on the CPU
under Triton's interpreter.

``TRITON_INTERPRET=1`` has to be set before ``triton`` is imported, so the kernel runs in one
child process (started once for the module) that reports each case's error; the rest of the
test session never imports Triton. Skipped only where ``triton`` cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the runtime needs the kvblocks[torch] extra")

from kvblocks.runtime import AttentionMetadata, PagedKVCache, paged_attention  # noqa: E402

HERE = Path(__file__).parent

# (block size, GQA groups, poison): every block size and GQA ratio test_runtime covers, with
# NaN, Inf or garbage everywhere outside the requests' contexts.
CASES = [
    (1, 1, "nan"),
    (1, 4, "inf"),
    (16, 1, "garbage"),
    (16, 4, "nan"),
    (32, 1, "inf"),
    (32, 4, "nan"),
]

CHILD = r"""
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton  # noqa: F401
except ImportError as e:
    print(json.dumps({"skip": f"triton cannot be imported: {e}"}))
    sys.exit(0)
import numpy as np
import torch
from test_runtime import _attention_case
from kvblocks.runtime import paged_attention

results = {}
def record(name, fn):
    try:
        results[name] = fn()
    except Exception as e:  # reported to the parent, which fails that case
        results[name] = f"{type(e).__name__}: {e}"

def case(block_size, groups, poison, shapes):
    q, cache, meta, expected = _attention_case("cpu", block_size, groups, poison, shapes)
    out = paged_attention(q, cache.key[0], cache.value[0], meta, backend="triton")
    plan = meta.plan(cache.key[0].shape[1])
    # The Triton path never builds the torch path's decode buckets or context slots.
    lazy = "decode" not in vars(plan) and "prefill_slots" not in vars(plan)
    ref = paged_attention(q, cache.key[0], cache.value[0], meta, backend="torch")
    return {
        "lazy": lazy,
        "finite": bool(out.isfinite().all()),
        "dense": float((out - expected).abs().max()),
        "torch": float((out - ref).abs().max()),
    }

for block_size, groups, poison in json.loads(sys.argv[1]):
    shapes = [(21, 3), (block_size + 5, 2), (6, 6), (40, 1), (1, 1)]
    record(f"{block_size}-{groups}-{poison}", lambda: case(block_size, groups, poison, shapes))
rng = np.random.default_rng(2)
mixed = [(int(n), 1) for n in rng.integers(1, 160, size=12)] + [(50, 7), (90, 80), (3, 2)]
record("mixed", lambda: case(16, 2, "nan", mixed))

def half():
    q, cache, meta, expected = _attention_case("cpu", 16, 2, "inf", [(30, 4), (19, 1)])
    k, v = cache.key[0].half(), cache.value[0].half()
    out = paged_attention(q.half(), k, v, meta, backend="triton")
    ref = paged_attention(q.half(), k, v, meta, backend="torch")
    return {
        "dtype": str(out.dtype),
        "finite": bool(out.isfinite().all()),
        "dense": float((out.float() - expected).abs().max()),
        "torch": float((out.float() - ref.float()).abs().max()),
    }
record("float16", half)

def bfloat16_cache():
    q, cache, meta, expected = _attention_case("cpu", 16, 2, "nan", [(40, 20), (19, 1)])
    k, v = cache.key[0].bfloat16(), cache.value[0].bfloat16()
    out = paged_attention(q, k, v, meta, backend="triton")
    ref = paged_attention(q, k, v, meta, backend="torch")
    return {
        "dtype": str(out.dtype),
        "finite": bool(out.isfinite().all()),
        "dense": float((out - expected).abs().max()),
        "torch": float((out - ref).abs().max()),
    }
record("bfloat16 cache", bfloat16_cache)

def model_steps():
    import kvblocks
    from test_runtime import _config
    from kvblocks.model import LlamaForCausalLM
    from kvblocks.runtime import ModelRunner

    model = LlamaForCausalLM.random(_config(), seed=4)
    manager = kvblocks.BlockManager(32, 4)
    # The same steps through the Triton kernel and, on a cache of its own, the torch path.
    runner = ModelRunner(model, 32, 4, attention="triton")
    reference = ModelRunner(model, 32, 4, attention="torch")
    seqs = [[5, 9, 2, 7, 1, 8, 3, 6, 4, 0, 11], [21, 22, 23, 24, 25]]
    handles = [manager.add_request(f"r{i}", s) for i, s in enumerate(seqs)]
    result = {"finite": True, "dense": 0.0, "torch": 0.0}
    def run(step, ids, rows):
        logits = runner.execute(step, np.array(ids))
        ref = reference.execute(step, np.array(ids))
        result["finite"] = result["finite"] and bool(logits.isfinite().all())
        result["torch"] = max(result["torch"], float((logits - ref).abs().max()))
        for row, s in rows:
            dense = model.forward_dense(torch.tensor(s))[-1]
            result["dense"] = max(result["dense"], float((logits[row] - dense).abs().max()))
    # A mixed step: a 7-token chunk of r0 with all of r1; then the rest of r0.
    step = manager.schedule_step(handles, [7, 5])
    run(step, seqs[0][:7] + seqs[1], [(0, seqs[0][:7]), (1, seqs[1])])
    step = manager.schedule_step(handles[:1], [4])
    run(step, seqs[0][7:], [(0, seqs[0])])
    for t in range(3):  # decode both
        new = [30 + t, 40 + t]
        offsets = [0, 1, 2]
        step = manager.schedule_step(handles, [1, 1], new_token_ids=new, new_token_offsets=offsets)
        for s, tok in zip(seqs, new):
            s.append(tok)
        run(step, new, [(0, seqs[0]), (1, seqs[1])])
    return result
record("model", model_steps)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    """Runs every case once in a child process with ``TRITON_INTERPRET=1``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


def _check(result: Any, atol: float) -> None:
    assert isinstance(result, dict), result  # an exception in the child is a failure here
    assert result["finite"]
    assert result["dense"] < atol, result
    assert result["torch"] < atol, result


@pytest.mark.parametrize(("block_size", "groups", "poison"), CASES)
def test_triton_kernel_matches_dense_and_torch(
    interpreted: dict[str, Any], block_size: int, groups: int, poison: str
) -> None:
    result = interpreted[f"{block_size}-{groups}-{poison}"]
    _check(result, 1e-5)
    assert result["lazy"]


def test_triton_kernel_on_a_mixed_batch(interpreted: dict[str, Any]) -> None:
    """Decodes of 1 to 160 tokens of context and three prefill chunks, one of them cut
    into three query tiles."""
    result = interpreted["mixed"]
    _check(result, 1e-5)
    assert result["lazy"]


def test_triton_kernel_keeps_half_precision(interpreted: dict[str, Any]) -> None:
    result = interpreted["float16"]
    _check(result, 2e-2)
    assert result["dtype"] == "torch.float16"


def test_triton_kernel_reads_a_cache_of_another_dtype(interpreted: dict[str, Any]) -> None:
    """A float32 query over a bfloat16 KV cache (the engine's ``dtype`` with a float32 model)."""
    result = interpreted["bfloat16 cache"]
    _check(result, 5e-2)
    assert result["torch"] < 1e-5
    assert result["dtype"] == "torch.float32"


def test_model_through_the_triton_kernel_equals_dense(interpreted: dict[str, Any]) -> None:
    """``ModelRunner(attention="triton")`` over kvblocks' steps (a mixed prefill step, a second
    chunk, three decode steps) gives the dense model's logits."""
    _check(interpreted["model"], 1e-4)


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    cache = PagedKVCache(1, 2, 4, 1, 8)
    one = np.array([0, 1], dtype=np.int32)
    meta = AttentionMetadata.from_arrays(
        np.array([[1]], np.int32), one[1:], one, np.array([4], np.int32)
    )
    with pytest.raises(ValueError, match="CUDA"):
        paged_attention(torch.ones(1, 1, 8), cache.key[0], cache.value[0], meta, backend="triton")
