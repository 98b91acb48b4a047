"""An independent hash oracle built only from hashlib, pickle, cbor2 and xxhash (never from
kvblocks code): vLLM's ``hash_block_tokens`` and NONE_HASH as docs/semantics.md §1 states
them, and the ``xxh3_128`` layout of docs/hash-contract.md."""

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
    """The xxh3_128 contract, written from the table in docs/hash-contract.md."""
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


def _fresh(s: str) -> str:
    """An equal string as a distinct object (as a request decoded from the wire holds it)."""
    return s.encode().decode()


def oracle_chain(
    algo: str,
    none_hash: bytes,
    block_size: int,
    tokens: list[int],
    *,
    lookahead: int = 0,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    mm_features: list[tuple[str, int, int]] | tuple[()] = (),
) -> list[bytes]:
    """vLLM's request block hasher, written from docs/semantics.md §1.4-1.6: the hashes of the
    blocks of the request ``tokens``, chained from ``none_hash``. With ``lookahead`` = L > 0 a
    block is hashed once the L tokens after it exist, and its extra part is
    ``(E, *those tokens)`` with E the keys of the block widened by L tokens. Multimodal items
    must not overlap one another: then vLLM's scan finds exactly the items that overlap the
    (widened) block, which is how this oracle finds them."""
    hashes: list[bytes] = []
    parent = none_hash
    num_blocks = max(0, (len(tokens) - lookahead) // block_size)
    for index in range(num_blocks):
        start, end = index * block_size, (index + 1) * block_size
        window_end = end + lookahead
        keys: list[tuple[Any, ...]] = []
        if lora is not None:
            keys.append(("lora", _fresh(lora[0]), _fresh(lora[1])))
        for identifier, offset, length in mm_features:
            if offset < window_end and offset + length > start:
                keys.append(("mm", _fresh(identifier), offset - start))
        if start == 0 and cache_salt:
            keys.append(("cache_salt", _fresh(cache_salt)))
        extra: Any = tuple(keys) if keys else None
        if lookahead:
            extra = (extra, *tokens[end : end + lookahead])
        parent = oracle_block(algo, parent, tokens[start:end], extra)
        hashes.append(parent)
    return hashes
