"""Byte-exact hashes: published vectors, vectors computed by vllm 0.33.0 itself, and vectors
computed in the test from hashlib / pickle / cbor2 / xxhash."""

from __future__ import annotations

import json
import pickle
import pickletools
from pathlib import Path
from types import ModuleType
from typing import Any

import cbor2
import pytest
import xxhash

import kvblocks
import kvblocks.reference
from tests.oracle import VLLM_ALGOS, oracle_block, oracle_none_hash

DATA = Path(__file__).parent / "data" / "vllm-0.33-hash-vectors.json"
ALL_ALGOS = (*VLLM_ALGOS, "xxh3_128")


def test_published_none_hashes(impl: ModuleType) -> None:
    published = {  # docs/semantics.md §1.2, seed "vllm-none-hash"
        "sha256": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "sha256_cbor": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "xxhash": "d98f72b9c430d985211489af307f0229",
        "xxhash_cbor": "a4e364baa0791a6f63bbf917db9b700d",
    }
    for algo, expected in published.items():
        assert impl.BlockHasher(algo, seed="vllm-none-hash").none_hash.hex() == expected


def test_published_block_vectors(impl: ModuleType) -> None:
    """docs/semantics.md §1.8 and §1.9."""
    h = impl.BlockHasher("sha256_cbor", block_size=5, seed="vllm-none-hash")
    h0 = h.hash_block(None, [1, 2, 3, 300, 70000])
    assert h0.hex() == "64a2177cdc4ad13cf6ff4c78a138c067abc894a027eb7755378d1ce49db50e0d"
    h1 = h.hash_block(h0, [4, 5, 6, 7, 8])
    assert h1.hex() == "f68aa1ec5519be54e8ad54458b4bac1c35fd8ad26ce57beae235d321810563c7"
    assert h.hash_blocks([1, 2, 3, 300, 70000, 4, 5, 6, 7, 8, 9]) == [h0, h1]
    assert int.from_bytes(h0[-8:], "big") == 4002887412026248717

    h4 = impl.BlockHasher("sha256_cbor", block_size=4, seed="vllm-none-hash")
    assert [x.hex() for x in h4.hash_blocks(range(8))] == [
        "c49ab11fb576db6f376aef58c24f728a0ba1807e8cac5f940f1a5c4c20741898",
        "9d0a7c928c548f9aeea31ae98471cf515045a206851732ac14cb3083c18d40f9",
    ]
    salted = h4.hash_blocks([1, 2, 3, 4], cache_salt="salt1")
    assert salted[0].hex() == "59f237785cf5c5448048dd9a9303b769f819ecae82c1d363df0e182e59b5c42b"

    p = impl.BlockHasher("sha256", block_size=5, seed="vllm-none-hash")
    assert (
        p.hash_block(None, [1, 2, 3, 300, 70000]).hex()
        == "060e374a2428d3ade297b9b4f3bf39df08580aa75cc8d93f5983e9f8b10b08a0"
    )


def _vllm_cases() -> list[tuple[dict[str, Any], int]]:
    data = json.loads(DATA.read_text())
    return [(result, i) for result in data["results"] for i in range(len(data["requests"]))]


@pytest.mark.parametrize(
    ("result", "index"),
    _vllm_cases(),
    ids=lambda v: str(v) if isinstance(v, int) else f"{v['hash']}-seed={v['seed']}",
)
def test_hashes_computed_by_vllm(
    impl: ModuleType, monkeypatch: pytest.MonkeyPatch, result: dict[str, Any], index: int
) -> None:
    """Every vector in the shared file, made by vllm 0.33.0's own request block hasher."""
    data = json.loads(DATA.read_text())
    request = data["requests"][index]
    if result["seed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", result["seed"])
    hasher = impl.BlockHasher(result["hash"], block_size=data["block_size"])
    assert hasher.none_hash.hex() == result["none_hash"]
    lora = tuple(request["lora"]) if request["lora"] else None
    kwargs = {"cache_salt": request["cache_salt"], "lora": lora}
    hashes = hasher.hash_blocks(request["tokens"], **kwargs)
    assert [h.hex() for h in hashes] == result["block_hashes"][index]
    seq = impl.TokenSequence(request["tokens"][:1], hasher=hasher, **kwargs)
    seq.append_token_ids(request["tokens"][1:])
    assert [h.hex() for h in seq.block_hashes] == result["block_hashes"][index]


CBOR_INTS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("block_size", [1, 16, 24, 256])
def test_blocks_match_the_oracle(impl: ModuleType, algo: str, block_size: int) -> None:
    hasher = impl.BlockHasher(algo, block_size=block_size, seed="s")
    # Three full blocks and a partial tail that must get no hash.
    tokens = [CBOR_INTS[i % len(CBOR_INTS)] for i in range(block_size * 3 + block_size // 2)]
    parent = oracle_none_hash(algo, "s")
    assert hasher.none_hash == parent
    expected = []
    for start in range(0, 3 * block_size, block_size):
        parent = oracle_block(algo, parent, tokens[start : start + block_size], None)
        expected.append(parent)
    assert hasher.hash_blocks(tokens) == expected


EXTRA_KEYS: list[tuple[Any, ...]] = [
    (("cache_salt", "salt1"),),
    (("lora", "my-lora", "/path/a"),),
    (("mm", "aaa", 11),),
    (("mm", "aaa", -5), ("mm", "bbb", 14)),
    (("lora", "L", "/p"), ("mm", "img0", 0), ("cache_salt", "s")),
    (("prompt_embeds", bytes(range(32))),),
    (("cache_salt", "é"), ("lora", "日本語", "ñ")),
    (("mm", "x" * 300, -(2**40)), ("mm", "", 2**40), ("mm", "a", 0), ("mm", "a", 1)),
    (("lora", "a", "a"), ("cache_salt", "")),
    (),
]


@pytest.mark.parametrize("algo", ALL_ALGOS)
@pytest.mark.parametrize("extra", EXTRA_KEYS, ids=range(len(EXTRA_KEYS)))
def test_extra_keys_match_the_oracle(impl: ModuleType, algo: str, extra: tuple[Any, ...]) -> None:
    hasher = impl.BlockHasher(algo, block_size=4, seed="seed")
    parent = bytes(range(hasher.digest_size))
    tokens = [7, 300, 70000, 2**32 - 1]
    # Fresh string objects, as vLLM receives them; tag literals stay shared (see pickle.rs).
    fresh = tuple(
        tuple(v.encode().decode() if isinstance(v, str) and i else v for i, v in enumerate(k))
        for k in extra
    )
    assert hasher.hash_block(parent, tokens, extra) == oracle_block(algo, parent, tokens, fresh)


def test_cbor_bytes_of_published_extra_keys() -> None:
    """The oracle itself agrees with the bytes published in docs/semantics.md §1.8."""
    published = {
        (("cache_salt", "salt1"),): "81826a63616368655f73616c74657361 6c7431",
        (("lora", "my-lora", "/path/a"),): "8183646c6f7261676d792d6c6f7261672f706174682f61",
        (("mm", "aaa", 11),): "8183626d6d636161610b",
        (("mm", "aaa", -5), ("mm", "bbb", 14)): "8283626d6d6361616124 83626d6d636262620e",
    }
    for value, expected in published.items():
        assert cbor2.dumps(value, canonical=True).hex() == expected.replace(" ", "")


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pickle_frames_of_huge_blocks(impl: ModuleType, algo: str) -> None:
    """Blocks over 64 KiB of pickle split into several frames exactly as CPython does."""
    for n in (13_100, 14_000, 40_000):
        hasher = impl.BlockHasher(algo, block_size=n, seed="s")
        tokens = [70000] * (n - 1) + [2**32 - 1]
        parent = hasher.none_hash
        extra = (("lora", "x" * 70_000, "p"),)
        assert hasher.hash_block(parent, tokens, extra) == oracle_block(
            algo, parent, tokens, (("lora", "x" * 70_000, "p"),)
        )
    # The last case really crosses frames (so the test exercises the framing rules).
    frames = [op for op, _, _ in pickletools.genops(pickle.dumps((tuple(tokens), extra), 5))]
    assert sum(op.name == "FRAME" for op in frames) >= 2


def test_native_layout_vectors() -> None:
    """The xxh3_128 vectors of docs/hash-contract.md (digests from the xxhash package over
    the documented layout), so that the contract cannot drift unnoticed."""
    none_hash = xxhash.xxh3_128_digest(b"kvblocks")
    assert none_hash.hex() == "0fde48fe3772fb5e4d95cd0861476920"
    salted_input = bytes.fromhex(
        "1000000000000000" + none_hash.hex() + "0200000000000000" + "01000000" + "ffffffff"
        "01" + "0100000000000000" + "03" + "0400000000000000" + b"salt".hex()
    )
    plain_input = bytes.fromhex(
        "1000000000000000" + none_hash.hex() + "0200000000000000" + "01000000" + "02000000" + "00"
    )
    assert xxhash.xxh3_128_digest(salted_input).hex() == "363c04a66af98b3dbac01aaa6614aa17"
    assert xxhash.xxh3_128_digest(plain_input).hex() == "52bb13f999fd8adf73bb0ce931952631"
    for impl in (kvblocks, kvblocks.reference):
        h = impl.BlockHasher("xxh3_128", block_size=2, seed="kvblocks")
        assert h.none_hash == none_hash
        assert h.hash_blocks([1, 2**32 - 1], cache_salt="salt")[0].hex() == (
            "363c04a66af98b3dbac01aaa6614aa17"
        )
        assert h.hash_block(None, [1, 2]).hex() == "52bb13f999fd8adf73bb0ce931952631"
