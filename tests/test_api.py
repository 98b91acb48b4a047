"""Seed rules, properties, numpy views, and use from several threads."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from types import ModuleType

import numpy as np
import pytest

import kvblocks
import kvblocks.reference as ref
from tests.oracle import oracle_none_hash


def test_module_surface() -> None:
    assert kvblocks.HASH_ALGORITHMS == ref.HASH_ALGORITHMS
    assert kvblocks.HASH_ALGORITHMS == (
        "sha256",
        "sha256_cbor",
        "xxhash",
        "xxhash_cbor",
        "xxh3_128",
    )
    assert issubclass(kvblocks.KvBlocksError, Exception)
    assert isinstance(kvblocks.__version__, str)


def test_properties(impl: ModuleType) -> None:
    for algo, size in [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxh3_128", 16)]:
        h = impl.BlockHasher(algo, block_size=7, seed="s")
        assert (h.algo, h.block_size, h.seed, h.digest_size) == (algo, 7, "s", size)
        assert len(h.none_hash) == size
        assert repr(h) == f"BlockHasher(algo='{algo}', block_size=7)"
    assert impl.BlockHasher().block_size == 16
    assert impl.BlockHasher().algo == "sha256_cbor"


SEED_SCRIPT = """
import json, sys
import kvblocks, kvblocks.reference as ref
out = {}
for impl in (kvblocks, ref):
    for algo in kvblocks.HASH_ALGORITHMS:
        h = impl.BlockHasher(algo)
        out[impl.__name__ + ":" + algo] = [h.seed, h.none_hash.hex()]
print(json.dumps(out))
"""


def _run_seed_script(env_seed: str | None) -> dict[str, list[str]]:
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    done = subprocess.run(
        [sys.executable, "-c", SEED_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


def test_seed_without_pythonhashseed() -> None:
    first, second = _run_seed_script(None), _run_seed_script(None)
    for impl in ("kvblocks", "kvblocks.reference"):
        for algo in ("sha256", "sha256_cbor"):
            seed, none_hash = first[f"{impl}:{algo}"]
            assert seed == "vllm-none-hash"
            assert none_hash == oracle_none_hash(algo, seed).hex()
            assert second[f"{impl}:{algo}"] == first[f"{impl}:{algo}"]
        for algo in ("xxhash", "xxhash_cbor", "xxh3_128"):
            seed, none_hash = first[f"{impl}:{algo}"]
            assert len(seed) == 64  # a random 32-byte secret, in hex
            assert int(seed, 16) >= 0
            assert none_hash == oracle_none_hash(algo, seed).hex()
            assert second[f"{impl}:{algo}"][0] != seed


def test_seed_from_pythonhashseed() -> None:
    result = _run_seed_script("1234")
    for key, (seed, none_hash) in result.items():
        algo = key.split(":")[1]
        assert seed == "1234"
        assert none_hash == oracle_none_hash(algo, "1234").hex()


def test_explicit_seed_wins_and_secrets_are_per_hasher(
    impl: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert impl.BlockHasher("xxhash", seed="mine").seed == "mine"
    assert impl.BlockHasher("xxhash").seed == "0"
    monkeypatch.delenv("PYTHONHASHSEED")
    a, b = impl.BlockHasher("xxhash_cbor"), impl.BlockHasher("xxhash_cbor")
    assert a.seed != b.seed
    assert a.hash_blocks(range(16)) != b.hash_blocks(range(16))


def test_hash_blocks_array_matches_the_list(impl: ModuleType) -> None:
    for algo in ("sha256_cbor", "xxh3_128"):
        hasher = impl.BlockHasher(algo, block_size=4, seed="s")
        hashes = hasher.hash_blocks(range(18), cache_salt="t")
        array = hasher.hash_blocks_array(range(18), cache_salt="t")
        assert array.dtype == np.uint8
        assert array.shape == (4, hasher.digest_size)
        assert [row.tobytes() for row in array] == hashes
        assert hasher.hash_blocks_array([1, 2, 3]).shape == (0, hasher.digest_size)
    with pytest.raises(ValueError):
        hasher.hash_blocks_array([-1])


def test_prompt_view_is_zero_copy_read_only_and_outlives_appends() -> None:
    hasher = kvblocks.BlockHasher(block_size=4)
    prompt = np.arange(10, dtype=np.uint32)
    seq = kvblocks.TokenSequence(prompt, hasher=hasher)
    view = seq.prompt_token_ids
    assert view.dtype == np.uint32
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 99
    # Zero copy: two reads share the sequence's own buffer, not the caller's array.
    assert np.shares_memory(view, seq.prompt_token_ids)
    assert not np.shares_memory(view, prompt)
    seq.append_token_ids(list(range(100, 5000)))
    assert view.tolist() == list(range(10))
    del seq
    gc.collect()
    assert view.tolist() == list(range(10))  # the view keeps the sequence alive


def test_output_array_is_a_read_only_snapshot(impl: ModuleType) -> None:
    seq = impl.TokenSequence([1, 2], hasher=impl.BlockHasher(block_size=2))
    seq.append_token_ids([3, 4])
    out = seq.output_token_ids
    assert out.tolist() == [3, 4]
    assert out.dtype == np.uint32
    assert not out.flags.writeable
    seq.append_token_ids(5)
    assert out.tolist() == [3, 4]
    assert seq.output_token_ids.tolist() == [3, 4, 5]
    assert not np.shares_memory(out, seq.output_token_ids)
    assert len(seq) == 5


def test_caller_array_is_not_retained() -> None:
    tokens = np.arange(64, dtype=np.uint32)
    seq = kvblocks.TokenSequence(tokens, hasher=kvblocks.BlockHasher(block_size=16))
    before = seq.block_hashes
    tokens[:] = 0
    assert seq.block_hashes == before
    assert seq.get_token_ids() == list(range(64))


def test_threads_share_a_hasher_and_own_their_sequences() -> None:
    hasher = kvblocks.BlockHasher("sha256_cbor", block_size=16)
    reference = ref.BlockHasher("sha256_cbor", block_size=16)
    prompts = [list(range(t * 1000, t * 1000 + 3000)) for t in range(4)]
    expected = [reference.hash_blocks(p + list(range(200))) for p in prompts]
    results: list[list[bytes] | None] = [None] * len(prompts)
    shared = kvblocks.TokenSequence([1], hasher=hasher)

    def work(i: int) -> None:
        assert hasher.hash_blocks(np.array(prompts[i], dtype=np.uint32)) == reference.hash_blocks(
            prompts[i]
        )
        seq = kvblocks.TokenSequence(prompts[i], hasher=hasher)
        for t in range(200):
            seq.append_token_ids(t)
            shared.append_token_ids([t, t])
        results[i] = seq.block_hashes

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    assert shared.num_tokens == 1 + 2 * 200 * len(prompts)
    assert shared.num_blocks == shared.num_tokens // 16
