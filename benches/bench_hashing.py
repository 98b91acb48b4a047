"""Block hashing: kvblocks (Rust) against its pure-Python reference, in one run.

    pytest benches/bench_hashing.py --benchmark-columns=median,iqr,rounds [--ratios-md FILE]

Cases: hash a whole prompt of 1k, 8k and 32k tokens with each algorithm, and decode-style
appends of one token at a time up to 4k tokens. The workloads (lengths, tokens, block size,
hasher seed) are ``kvblocks.workloads``' hashing workloads, the defaults of
``kvblocks bench-hashing`` too. Variants:

- ``rust`` / ``rust-numpy``: ``kvblocks.BlockHasher.hash_blocks`` on a list / a uint32 array;
- ``rust-numpy-array``: ``hash_blocks_array`` on a uint32 array (no Python object per block);
- ``reference``: ``kvblocks.reference.BlockHasher.hash_blocks`` on the same list (the same API,
  including the same input checks);
- ``vllm-loop`` (where noted): the reference's bare chain loop, i.e. vLLM's own per-block work
  (tuple, serialize, digest) with no input checks: the conservative baseline.

And the floor under each 32k-token figure, measured in the same run (``test_floor``): the
digest alone over each block's exact serialized bytes (``digest-each``, a tight Rust loop, from
the benchmark-only ``kvblocks._core._HashingFloor``),
the digest over all blocks' bytes as one buffer (``one-buffer``), XXH3-128 over the raw
uint32 tokens in one call, and converting the Python list to uint32 with CPython's own
``array.array``. The summary divides kvblocks' time by its floor: the per-block digest from
an array, the list conversion plus the per-block digest from a list.

``_HashingFloor`` is built only with the cargo feature ``bench-floor`` (off by default):

    MATURIN_PEP517_ARGS="--profile dev --features bench-floor" pip install -e .

Without it the floor benchmarks that need it skip, saying so, and the summary has no floor
rows; every other benchmark runs.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash

import kvblocks
import kvblocks._core
import kvblocks.reference as ref
from kvblocks.reference.hashing import BlockChain, RequestKeys
from kvblocks.workloads import (
    DECODE_LENGTH,
    HASHING_BLOCK_SIZE,
    HASHING_PROMPT_LENGTHS,
    decode_workload,
    hashing_hasher,
    hashing_prompt,
)

FLOOR_SIZE = max(HASHING_PROMPT_LENGTHS)

#: The benchmark-only floor class, in builds with the cargo feature ``bench-floor``.
_HashingFloor: Any = getattr(kvblocks._core, "_HashingFloor", None)
#: The floor comparisons that need it skip without it (never pass unmeasured).
needs_floor = pytest.mark.skipif(
    _HashingFloor is None,
    reason="kvblocks._core was built without the cargo feature bench-floor (the benchmark-only "
    '_HashingFloor); build with it: MATURIN_PEP517_ARGS="--profile dev --features '
    'bench-floor" pip install -e .',
)


def _run(
    benchmark: Any, case: str, impl: str, fn: Callable[[], object], baselines: list[str]
) -> None:
    """Benchmarks ``fn``; the summary divides each ``baselines`` entry (``impl`` of this case,
    or ``case::impl``) by it."""
    benchmark.group = case
    pairs = [b.split("::")[::-1] if "::" in b else [case, b] for b in baselines]
    benchmark.extra_info.update(case=case, impl=impl, baselines=pairs)
    benchmark(fn)


# The variant varies fastest, so each case's variants run back to back (less drift between them).
@pytest.mark.parametrize(
    "impl", ["rust", "rust-numpy", "rust-numpy-array", "reference", "vllm-loop"]
)
@pytest.mark.parametrize("num_tokens", HASHING_PROMPT_LENGTHS)
@pytest.mark.parametrize("algo", kvblocks.HASH_ALGORITHMS)
def test_hash_prompt(benchmark: Any, impl: str, num_tokens: int, algo: str) -> None:
    tokens = hashing_prompt(num_tokens)
    case = f"hash {num_tokens // 1024}k tokens, {algo}"
    rust_baselines = ["reference", "vllm-loop"]
    if algo == "xxh3_128":  # the fast mode against vLLM's default-portable algorithm
        rust_baselines.append(f"reference::hash {num_tokens // 1024}k tokens, sha256_cbor")
    floor = f"floor, {num_tokens // 1024}k tokens"
    if num_tokens == FLOOR_SIZE and impl.startswith("rust") and _HashingFloor is not None:
        digest = [f"{floor}, {algo}", "digest-each"]
        from_list = [[floor, "list-to-uint32"], digest]
        benchmark.extra_info["floors"] = from_list if impl == "rust" else [digest]
    if impl == "rust":
        hasher = hashing_hasher(kvblocks, algo)
        _run(benchmark, case, impl, lambda: hasher.hash_blocks(tokens), rust_baselines)
    elif impl.startswith("rust-numpy"):
        hasher = hashing_hasher(kvblocks, algo)
        method = hasher.hash_blocks_array if impl == "rust-numpy-array" else hasher.hash_blocks
        uint32 = np.array(tokens, dtype=np.uint32)
        _run(benchmark, case, impl, lambda: method(uint32), rust_baselines)
    elif impl == "reference":
        reference = hashing_hasher(ref, algo)
        _run(benchmark, case, impl, lambda: reference.hash_blocks(tokens), [])
    else:
        reference = hashing_hasher(ref, algo)
        keys = RequestKeys()
        _run(benchmark, case, impl, lambda: BlockChain(reference, keys).extend(tokens), [])


@pytest.mark.parametrize("impl", ["rust", "reference"])
@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128"])
def test_decode_appends(benchmark: Any, impl: str, algo: str) -> None:
    """A 16-token prompt grown to 4k tokens one token per call, as a decode loop does."""
    module = kvblocks if impl == "rust" else ref
    decode = decode_workload(module, hashing_hasher(module, algo))
    baselines = ["reference"] if impl == "rust" else []
    case = f"decode {DECODE_LENGTH // 1024}k tokens one at a time, {algo}"
    _run(benchmark, case, impl, decode, baselines)


def test_reference_and_rust_agree_on_the_benchmark_workload() -> None:
    """The benchmarked variants compute the same hashes (a fast check, runs with the suite)."""
    tokens = hashing_prompt(DECODE_LENGTH)
    for algo in kvblocks.HASH_ALGORITHMS:
        expected = hashing_hasher(ref, algo).hash_blocks(tokens)
        assert hashing_hasher(kvblocks, algo).hash_blocks(np.array(tokens)) == expected


@needs_floor
@pytest.mark.parametrize("impl", ["digest-each", "one-buffer"])
@pytest.mark.parametrize("algo", kvblocks.HASH_ALGORITHMS)
def test_floor(benchmark: Any, impl: str, algo: str) -> None:
    """What hashing 32k tokens cannot go below: the digest of each block's exact bytes
    (serialized beforehand, digested in a tight Rust loop), and of all of them as one buffer."""
    hasher = hashing_hasher(kvblocks, algo)
    floor = _HashingFloor(hasher)
    tokens = hashing_prompt(FLOOR_SIZE)
    data, ends = floor.serialized_blocks(tokens)
    assert len(ends) == FLOOR_SIZE // HASHING_BLOCK_SIZE
    case = f"floor, {FLOOR_SIZE // 1024}k tokens, {algo}"
    if impl == "digest-each":
        _run(benchmark, case, impl, lambda: floor.digest_each(data, ends), [])
    else:
        digest = hashlib.sha256 if hasher.digest_size == 32 else xxhash.xxh3_128
        _run(benchmark, case, impl, lambda: digest(data).digest(), [])


@pytest.mark.parametrize("impl", ["list-to-uint32", "xxh3-raw-tokens"])
def test_token_floor(benchmark: Any, impl: str) -> None:
    """Reading 32k Python ints (CPython's own C loop) and XXH3-128 over the raw tokens."""
    tokens = hashing_prompt(FLOOR_SIZE)
    case = f"floor, {FLOOR_SIZE // 1024}k tokens"
    if impl == "list-to-uint32":
        _run(benchmark, case, impl, lambda: array.array("I", tokens), [])
    else:
        raw = np.array(tokens, dtype=np.uint32).tobytes()
        _run(benchmark, case, impl, lambda: xxhash.xxh3_128_digest(raw), [])


@needs_floor
def test_serialized_blocks_are_what_is_hashed() -> None:
    """The floor's bytes are the real ones: digesting them gives the hashes themselves."""
    tokens = hashing_prompt(1024)
    for algo in kvblocks.HASH_ALGORITHMS:
        hasher = hashing_hasher(kvblocks, algo)
        floor = _HashingFloor(hasher)
        data, ends = floor.serialized_blocks(tokens)
        digest = hashlib.sha256 if hasher.digest_size == 32 else xxhash.xxh3_128
        bounds = [0, *ends.tolist()]
        expected = hasher.hash_blocks(tokens)
        got = [digest(data[a:b]).digest() for a, b in itertools.pairwise(bounds)]
        assert got == expected
        assert floor.digest_each(data, ends) == len(expected)
