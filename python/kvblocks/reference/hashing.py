"""Pure-Python reference for :class:`kvblocks.BlockHasher`, hashing blocks the way vLLM 0.33 does:
build the Python tuple ``(parent, tuple(tokens), extra_keys)``, serialize it with pickle or
canonical CBOR, digest it with SHA-256 or XXH3-128."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvblocks.reference._args import int_arg, size_arg, str_arg, token_ids_from
from kvblocks.reference._args import token_ids as as_token_ids

_I64_MAX = 2**63 - 1

HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "xxh3_128")
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

# The tag strings are module constants, shared by every key like the literals in vLLM's
# source; pickle writes a repeated one as a back-reference (see the native pickle encoder).
LORA, MM, CACHE_SALT, PROMPT_EMBEDS = "lora", "mm", "cache_salt", "prompt_embeds"
_KEY_SHAPES = (
    '("lora", name, path), ("mm", identifier, offset), ("cache_salt", salt) or '
    '("prompt_embeds", digest)'
)

ExtraKeys = tuple[tuple[Any, ...], ...] | None
#: The third item of a block's tuple under lookahead hashing: ``(extra_keys, t_1, ..., t_L)``.
LookaheadExtra = tuple[Any, ...]


def _fresh(s: str) -> str:
    """The string as a request decoded from the wire holds it: a distinct object unless
    CPython shares it (empty or one latin-1 character), which decides pickle's memo."""
    return s.encode("utf-8").decode("utf-8")


def _fresh_bytes(b: bytes) -> bytes:
    return bytes(bytearray(b))


def _pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor() -> Callable[[object], bytes]:
    import cbor2

    def dumps(obj: object) -> bytes:
        out: bytes = cbor2.dumps(obj, canonical=True)
        return out

    return dumps


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128() -> Callable[[bytes], bytes]:
    import xxhash

    def digest(data: bytes) -> bytes:
        out: bytes = xxhash.xxh3_128_digest(data)
        return out

    return digest


def _sized(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _native(obj: object) -> bytes:
    """The ``xxh3_128`` layout (docs/hash-contract.md): the seed string, or a block tuple."""
    if isinstance(obj, str):
        return obj.encode("utf-8")
    assert isinstance(obj, tuple)
    parent: bytes = obj[0]
    tokens: tuple[int, ...] = obj[1]
    extra_keys: ExtraKeys = obj[2]
    out = bytearray(_sized(parent))
    out += struct.pack(f"<Q{len(tokens)}I", len(tokens), *tokens)
    if extra_keys is None:
        out.append(0x00)
        return bytes(out)
    out.append(0x01)
    out += struct.pack("<Q", len(extra_keys))
    for key in extra_keys:
        tag = key[0]
        if tag == LORA:
            out += b"\x01" + _sized(key[1].encode()) + _sized(key[2].encode())
        elif tag == MM:
            out += b"\x02" + _sized(key[1].encode()) + struct.pack("<q", key[2])
        elif tag == CACHE_SALT:
            out += b"\x03" + _sized(key[1].encode())
        else:
            out += b"\x04" + _sized(key[1])
    return bytes(out)


def _hash_function(algo: str) -> Callable[[object], bytes]:
    if algo == "sha256":
        return lambda obj: _sha256(_pickle(obj))
    if algo == "sha256_cbor":
        cbor = _cbor()
        return lambda obj: _sha256(cbor(obj))
    if algo == "xxhash":
        xxh = _xxh3_128()
        return lambda obj: xxh(_pickle(obj))
    if algo == "xxhash_cbor":
        cbor, xxh = _cbor(), _xxh3_128()
        return lambda obj: xxh(cbor(obj))
    xxh = _xxh3_128()
    return lambda obj: xxh(_native(obj))


def _extra_key(key: Any) -> tuple[Any, ...]:
    if not isinstance(key, tuple):
        raise TypeError(f"each extra key must be a tuple: {_KEY_SHAPES}")
    tag = key[0] if key else None
    if not isinstance(tag, str):
        raise ValueError(f"unknown extra key {key!r}: expected {_KEY_SHAPES}")
    if tag == LORA and len(key) == 3:
        return (LORA, _fresh(str_arg(key[1], "lora name")), _fresh(str_arg(key[2], "lora path")))
    if tag == MM and len(key) == 3:
        return (MM, _fresh(str_arg(key[1], "mm identifier")), int_arg(key[2], "mm offset"))
    if tag == CACHE_SALT and len(key) == 2:
        return (CACHE_SALT, _fresh(str_arg(key[1], "cache salt")))
    if tag == PROMPT_EMBEDS and len(key) == 2:
        if not isinstance(key[1], bytes):
            raise TypeError("the prompt_embeds digest must be bytes")
        return (PROMPT_EMBEDS, _fresh_bytes(key[1]))
    raise ValueError(f"unknown extra key {key!r}: expected {_KEY_SHAPES}")


def extra_keys_arg(obj: Any) -> ExtraKeys:
    """``None`` or a tuple of vLLM-shaped keys, rebuilt from fresh objects."""
    if obj is None:
        return None
    if not isinstance(obj, tuple):
        raise TypeError(f"extra_keys must be None or a tuple of keys: {_KEY_SHAPES}")
    return tuple(_extra_key(k) for k in obj)


class RequestKeys:
    """The request-level inputs of vLLM's ``generate_block_hash_extra_keys``."""

    def __init__(self, cache_salt: Any = None, lora: Any = None, mm_features: Any = None):
        self.cache_salt = None if cache_salt is None else str_arg(cache_salt, "cache_salt")
        self.lora: tuple[str, str] | None = None
        if lora is not None:
            if not (isinstance(lora, tuple) and len(lora) == 2):
                raise TypeError("lora must be a (name, path) tuple of two str")
            self.lora = (str_arg(lora[0], "lora name"), str_arg(lora[1], "lora path"))
        self.mm_features: list[tuple[str, int, int]] = []
        if mm_features is not None:
            if not isinstance(mm_features, Iterable):
                raise TypeError(f"'{type(mm_features).__name__}' object is not iterable")
            for feature in mm_features:
                if not (isinstance(feature, tuple) and len(feature) == 3):
                    raise TypeError("each mm feature must be an (identifier, offset, length) tuple")
                self.mm_features.append(
                    (
                        str_arg(feature[0], "mm identifier"),
                        size_arg(feature[1], "mm offset", 0),
                        size_arg(feature[2], "mm length", 1),
                    )
                )
        previous = 0
        for i, (identifier, offset, _) in enumerate(self.mm_features):
            if offset < previous:
                raise ValueError(
                    f"invalid mm_features: items must be sorted by offset; item {i} "
                    f"({identifier!r}) starts at {offset} after an item at {previous}"
                )
            previous = offset

    def is_empty(self) -> bool:
        return self.lora is None and not self.cache_salt and not self.mm_features

    def block_extra_keys(self, start: int, end: int, mm_idx: int) -> tuple[ExtraKeys, int]:
        """Keys of the block ``[start, end)`` in vLLM's order, and the next multimodal index."""
        keys: list[tuple[Any, ...]] = []
        if self.lora is not None:
            keys.append((LORA, _fresh(self.lora[0]), _fresh(self.lora[1])))
        mm_keys, mm_idx = self._mm_keys(start, end, mm_idx)
        keys.extend(mm_keys)
        if start == 0 and self.cache_salt:
            keys.append((CACHE_SALT, _fresh(self.cache_salt)))
        return (tuple(keys) if keys else None), mm_idx

    def lookahead_block_extra_keys(
        self, start: int, end: int, hash_end: int, mm_idx: int
    ) -> tuple[ExtraKeys, int]:
        """Keys of the block ``[start, end)`` under lookahead hashing: those of the window
        ``[start, hash_end)``, and the multimodal index moved back to the first item that
        does not end by ``end`` (the next block starts there and must see it again)."""
        keys, mm_idx = self.block_extra_keys(start, hash_end, mm_idx)
        features = self.mm_features
        while mm_idx > 0 and features[mm_idx - 1][1] + features[mm_idx - 1][2] > end:
            mm_idx -= 1
        return keys, mm_idx

    def _mm_keys(self, start: int, end: int, idx: int) -> tuple[list[tuple[Any, ...]], int]:
        features = self.mm_features
        if not features or features[-1][1] + features[-1][2] <= start:
            return [], idx
        keys: list[tuple[Any, ...]] = []
        while idx < len(features):
            identifier, offset, length = features[idx]
            if offset >= end:
                break
            if offset + length <= start:
                idx += 1
                continue
            keys.append((MM, _fresh(identifier), offset - start))
            if offset + length <= end:
                idx += 1
            else:
                break
        return keys, idx


class BlockHasher:
    """Chained block hashing with vLLM's algorithms (see :class:`kvblocks.BlockHasher`)."""

    def __init__(
        self,
        algo: str = "sha256_cbor",
        *,
        block_size: int | None = None,
        seed: str | None = None,
    ) -> None:
        if algo not in HASH_ALGORITHMS:
            raise ValueError(
                f"unknown hash algorithm {algo!r}; expected one of {', '.join(HASH_ALGORITHMS)}"
            )
        self._block_size = (
            DEFAULT_BLOCK_SIZE if block_size is None else size_arg(block_size, "block_size", 1)
        )
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        elif not isinstance(seed, str):
            raise TypeError(f"seed must be a str, got {type(seed).__name__}")
        if seed is None:
            seed = DEFAULT_SEED if algo in ("sha256", "sha256_cbor") else os.urandom(32).hex()
        self._algo = algo
        self._seed = seed
        self._hash_fn = _hash_function(algo)
        self._none_hash = self._hash_fn(_fresh(seed))

    @property
    def algo(self) -> str:
        return self._algo

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def seed(self) -> str:
        return self._seed

    @property
    def none_hash(self) -> bytes:
        return self._none_hash

    @property
    def digest_size(self) -> int:
        return len(self._none_hash)

    def hash_block_tokens(
        self, parent: bytes | None, tokens: tuple[int, ...], extra: ExtraKeys | LookaheadExtra
    ) -> bytes:
        """vLLM's ``hash_block_tokens`` on already-checked arguments."""
        if not parent:
            parent = self._none_hash
        return self._hash_fn((_fresh_bytes(parent), tokens, extra))

    def hash_block(self, parent: bytes | None, token_ids: Any, extra_keys: Any = None, /) -> bytes:
        if parent is not None and not isinstance(parent, bytes):
            raise TypeError(f"parent must be bytes or None, got {type(parent).__name__}")
        tokens = tuple(as_token_ids(token_ids))
        return self.hash_block_tokens(parent, tokens, extra_keys_arg(extra_keys))

    def hash_blocks(
        self,
        token_ids: Any,
        /,
        *,
        parent: bytes | None = None,
        start_block: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Any = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[bytes]:
        if parent is not None and not isinstance(parent, bytes):
            raise TypeError(f"parent must be bytes or None, got {type(parent).__name__}")
        first = 0 if start_block is None else size_arg(start_block, "start_block", 0)
        lookahead = (
            0
            if num_lookahead_tokens is None
            else size_arg(num_lookahead_tokens, "num_lookahead_tokens", 0)
        )
        if lookahead and self._algo == "xxh3_128":
            raise ValueError(
                f"num_lookahead_tokens={lookahead}: the xxh3_128 layout has no lookahead form; "
                "lookahead hashing needs one of vLLM's algorithms (sha256, sha256_cbor, "
                "xxhash, xxhash_cbor)"
            )
        if first * self._block_size > _I64_MAX:
            raise ValueError(f"start_block {first} is out of range")
        tokens = token_ids_from(token_ids, first * self._block_size)
        keys = RequestKeys(cache_salt, lora, mm_features)
        if lookahead:
            return _hash_lookahead_run(self, keys, tokens, first, parent, lookahead)
        hashes, _ = _hash_run(self, keys, tokens, first, parent, 0)
        return hashes

    def hash_blocks_array(
        self,
        token_ids: Any,
        /,
        *,
        parent: bytes | None = None,
        start_block: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm_features: Any = None,
        num_lookahead_tokens: int | None = None,
    ) -> npt.NDArray[np.uint8]:
        hashes = self.hash_blocks(
            token_ids,
            parent=parent,
            start_block=start_block,
            cache_salt=cache_salt,
            lora=lora,
            mm_features=mm_features,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        flat = np.frombuffer(b"".join(hashes), dtype=np.uint8)
        return flat.reshape(len(hashes), self.digest_size).copy()

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self._algo!r}, block_size={self._block_size})"


class BlockChain:
    """The block hashes of one request, extended block by block as tokens arrive (vLLM's
    request block hasher)."""

    def __init__(self, hasher: BlockHasher, keys: RequestKeys) -> None:
        self.hasher = hasher
        self.keys = keys
        self.hashes: list[bytes] = []
        self._mm_idx = 0

    def clone(self) -> BlockChain:
        chain = BlockChain(self.hasher, self.keys)
        chain.hashes = list(self.hashes)
        chain._mm_idx = self._mm_idx
        return chain

    def extend(self, all_tokens: list[int]) -> None:
        """Hashes every block of ``all_tokens`` (the request's tokens so far) that became full."""
        parent = self.hashes[-1] if self.hashes else None
        first = len(self.hashes)
        tail = all_tokens[first * self.hasher.block_size :]
        new, self._mm_idx = _hash_run(self.hasher, self.keys, tail, first, parent, self._mm_idx)
        self.hashes.extend(new)


def _hash_run(
    hasher: BlockHasher,
    keys: RequestKeys,
    tokens: list[int],
    first_block: int,
    parent: bytes | None,
    mm_idx: int,
) -> tuple[list[bytes], int]:
    """The hashes of the full blocks of ``tokens``, which start at block ``first_block`` of
    the request, the first chained to ``parent``, and the multimodal index after them
    (vLLM's ``mm_idx``)."""
    size = hasher.block_size
    offset = first_block * size
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - size + 1, size):
        extra: ExtraKeys = None
        if not keys.is_empty():
            extra, mm_idx = keys.block_extra_keys(offset + start, offset + start + size, mm_idx)
        parent = hasher.hash_block_tokens(parent, tuple(tokens[start : start + size]), extra)
        hashes.append(parent)
    return hashes, mm_idx


def _hash_lookahead_run(
    hasher: BlockHasher,
    keys: RequestKeys,
    tokens: list[int],
    first_block: int,
    parent: bytes | None,
    lookahead: int,
) -> list[bytes]:
    """vLLM's lookahead hashing (``num_hash_lookahead_tokens``) over ``tokens``, which start
    at block ``first_block`` of the request: a block is hashed once the ``lookahead`` tokens
    after it exist, with ``(extra_keys, *those_tokens)`` as the third item of its tuple."""
    size = hasher.block_size
    offset = first_block * size
    hashes: list[bytes] = []
    mm_idx = 0
    for start in range(0, len(tokens) - lookahead - size + 1, size):
        end = start + size
        extra: ExtraKeys = None
        if not keys.is_empty():
            extra, mm_idx = keys.lookahead_block_extra_keys(
                offset + start, offset + end, offset + end + lookahead, mm_idx
            )
        wrapped = (extra, *tokens[end : end + lookahead])
        parent = hasher.hash_block_tokens(parent, tuple(tokens[start:end]), wrapped)
        hashes.append(parent)
    return hashes
