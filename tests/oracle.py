"""An independent hash oracle built only from hashlib, pickle, cbor2 and xxhash (never from
kvblocks code): vLLM's ``hash_block_tokens`` and NONE_HASH as docs/semantics.md §1 states
them, and the README's ``xxh3_128`` layout."""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any

import cbor2
import xxhash

VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def serialize(algo: str, obj: Any) -> bytes:
    if algo in ("sha256", "xxhash"):
        return pickle.dumps(obj, protocol=5)
    if algo in ("sha256_cbor", "xxhash_cbor"):
        return cbor2.dumps(obj, canonical=True)
    raise ValueError(algo)


def digest(algo: str, data: bytes) -> bytes:
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def oracle_block(algo: str, parent: bytes, tokens: list[int], extra: Any) -> bytes:
    """vLLM's hash_block_tokens, written from docs/semantics.md §1.3."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest(native_layout(parent, tokens, extra))
    return digest(algo, serialize(algo, (parent, tuple(tokens), extra)))


def oracle_none_hash(algo: str, seed: str) -> bytes:
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest(seed.encode())
    return digest(algo, serialize(algo, seed))


def _sized(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def native_layout(parent: bytes, tokens: list[int], extra: Any) -> bytes:
    """The README's xxh3_128 contract, written from the README table."""
    out = _sized(parent) + struct.pack("<Q", len(tokens))
    out += b"".join(struct.pack("<I", t) for t in tokens)
    if extra is None:
        return out + b"\x00"
    out += b"\x01" + struct.pack("<Q", len(extra))
    for key in extra:
        if key[0] == "lora":
            out += b"\x01" + _sized(key[1].encode()) + _sized(key[2].encode())
        elif key[0] == "mm":
            out += b"\x02" + _sized(key[1].encode()) + struct.pack("<q", key[2])
        elif key[0] == "cache_salt":
            out += b"\x03" + _sized(key[1].encode())
        else:
            out += b"\x04" + _sized(key[1])
    return out
