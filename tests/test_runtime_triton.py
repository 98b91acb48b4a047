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


def _run_interpreted(*argv: str) -> dict[str, Any]:
    """Runs ``python *argv`` in ``tests/`` with ``TRITON_INTERPRET=1``; its last line of output
    is a JSON object (``{"skip": reason}`` where Triton cannot be imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, *argv],
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


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    """Runs every case once in a child process with ``TRITON_INTERPRET=1``."""
    return _run_interpreted("-c", CHILD, json.dumps(CASES))


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


# The self-check of ``backend="auto"`` (kvblocks.runtime.triton_selfcheck): tests/
# triton_selfcheck_child.py runs each scenario under the interpreter, with "cpu" counted as a
# Triton device, one or both kernels replaced by a wrong (or raising) wrapper of the real one,
# and three "auto" calls on a mixed batch of decodes and prefill chunks.


@pytest.fixture(scope="module")
def selfcheck() -> dict[str, Any]:
    return _run_interpreted("triton_selfcheck_child.py")


def test_selfcheck_accepts_the_real_kernels_once(selfcheck: dict[str, Any]) -> None:
    """No warning; the check launches Triton twice (decode batch, prefill batch) on the first
    call only; every "auto" call returns the Triton path's result, which is not bit-identical
    to the torch path's (so this observes which path ran)."""
    result = selfcheck["real"]
    assert isinstance(result, dict), result
    assert result["warnings"] == []
    assert result["torch_only"] == []
    assert result["launches_after_first"] == 2 + 1
    assert result["launches"] == 2 + 3
    assert result["auto_is_triton"]
    assert not result["triton_is_torch"]
    assert result["triton_vs_torch"] < 1e-5


def test_selfcheck_tolerates_an_error_below_the_tolerance(selfcheck: dict[str, Any]) -> None:
    """A decode kernel off by 1e-6 (float32 tolerance 1e-4) is still used."""
    result = selfcheck["decode off by 1e-6"]
    assert isinstance(result, dict), result
    assert result["warnings"] == []
    assert result["auto_is_triton"]
    assert not result["triton_is_torch"]


@pytest.mark.parametrize(
    ("scenario", "kernel", "error"),
    [
        ("decode off by 1e-3", "decode", "max abs error 0.001 > tolerance 0.0001"),
        ("decode swaps requests", "decode", "max abs error"),
        ("decode reads past the context", "decode", "non-finite output"),
        ("decode ignores GQA", "decode", "max abs error"),
        ("decode raises", "decode", "raised RuntimeError('decode launch failed')"),
        ("prefill off by 1e-3", "prefill", "max abs error 0.001 > tolerance 0.0001"),
        ("prefill not causal", "prefill", "max abs error"),
        ("prefill reads past the context", "prefill", "non-finite output"),
        ("prefill raises", "prefill", "raised RuntimeError('prefill launch failed')"),
    ],
)
def test_selfcheck_rejects_a_wrong_kernel(
    selfcheck: dict[str, Any], scenario: str, kernel: str, error: str
) -> None:
    """One RuntimeWarning naming the kernel and its error; the device goes to the torch path:
    every "auto" call returns the torch path's result (not the wrong kernel's), and after the
    check's two launches Triton never runs again."""
    result = selfcheck[scenario]
    assert isinstance(result, dict), result
    assert result["categories"] == ["RuntimeWarning"]
    (message,) = result["warnings"]
    assert message.startswith(f"the Triton {kernel} kernel failed the self-check on cpu")
    other = "prefill" if kernel == "decode" else "decode"
    assert other not in message
    assert f"{kernel}: {error}" in message
    assert message.endswith("using the torch path on cpu for the rest of this process")
    assert result["torch_only"] == ["cpu"]
    assert result["launches_after_first"] == result["launches"] == 2
    assert result["auto_is_torch"]
    assert not result["auto_is_triton"]
    assert not result["triton_is_torch"]  # the wrong kernel's output (or exception) differs


def test_selfcheck_names_both_kernels_in_one_warning(selfcheck: dict[str, Any]) -> None:
    result = selfcheck["both raise"]
    assert isinstance(result, dict), result
    (message,) = result["warnings"]
    assert message.startswith("the Triton decode and prefill kernels failed the self-check")
    assert "decode: raised RuntimeError('decode down')" in message
    assert "prefill: raised RuntimeError('prefill down')" in message
    assert result["auto_is_torch"]
    assert result["launches"] == 2


def test_selfcheck_errors_of_the_real_kernels(selfcheck: dict[str, Any]) -> None:
    """The real kernels' errors against the float64 torch path stay inside the bounds
    triton_selfcheck's docstring derives (float32 under 1e-6; float16 under its 3.5e-3
    worst case), for GQA and block size 1 alike. (A bfloat16 query is not run: the
    interpreter's ``tl.dot`` multiplies bfloat16 operands as their raw uint16 bits.)"""
    rows = selfcheck["errors"]
    assert len(rows) == 6
    for geometry, checks in rows.items():
        bound = 3.5e-3 if geometry.startswith("float16") else 1e-6
        assert [c[0] for c in checks] == ["decode", "prefill"]
        for kernel, error, tol, exception in checks:
            assert exception is None, (geometry, kernel, exception)
            assert 0 < error < bound <= tol, (geometry, kernel, error)


def test_selfcheck_verdicts_are_per_device_geometry_and_scale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bookkeeping around the check (the check itself replaced: no Triton here): one
    check per device, geometry and softmax scale, a failure sends only that device to torch,
    with one warning, and it is never checked again."""
    from kvblocks.runtime import triton_selfcheck as sc

    monkeypatch.setattr(sc, "_VERIFIED", set())
    monkeypatch.setattr(sc, "_TORCH_ONLY", set())
    calls: list[tuple[str, int, float]] = []

    def fake_check(device: torch.device, *args: Any, **kw: Any) -> sc.SelfCheck:
        calls.append((str(device), kw["heads"], kw["scale"]))
        error = 0.5 if str(device) == "meta" else 0.0
        geometry = sc.Geometry(torch.float32, torch.float32, kw["heads"], 2, 8, 16)
        checks = (sc.KernelCheck("decode", 0.0, 1e-4), sc.KernelCheck("prefill", error, 1e-4))
        return sc.SelfCheck(str(device), geometry, checks)

    monkeypatch.setattr(sc, "check_kernels", fake_check)
    cache = torch.empty(4, 16, 2, 8)

    def verified(device: str, heads: int = 4, scale: float = 8**-0.5) -> bool:
        query = torch.empty(3, heads, 8, device=device)
        return sc.kernels_verified(query, cache.to(device), scale)

    with pytest.warns(RuntimeWarning) as caught:
        first = [verified("meta"), verified("meta"), verified("meta", heads=8)]
    assert first == [False, False, False]
    assert len(caught) == 1
    assert str(caught[0].message).startswith("the Triton prefill kernel failed")
    assert "max abs error 0.5 > tolerance 0.0001" in str(caught[0].message)
    s = 8**-0.5
    assert calls == [("meta", 4, s)]
    for _ in range(3):
        assert verified("cpu")
    assert verified("cpu", heads=8)  # another geometry: checked once more
    assert verified("cpu", scale=0.5)  # another scale: checked once more
    assert verified("cpu", scale=0.5)
    assert calls == [("meta", 4, s), ("cpu", 4, s), ("cpu", 8, s), ("cpu", 4, 0.5)]
    assert sorted(sc._TORCH_ONLY) == ["meta"]
