"""Token-id inputs of every accepted kind, and bad input of every kind: both implementations
raise the same exception type, and a failed call changes nothing."""

from __future__ import annotations

import array
import re
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvblocks
import kvblocks.reference as ref

TOKENS = [5, 0, 2**32 - 1, 70000, 300, 24, 23, 1]


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        lambda t: array.array("I", t),
        lambda t: array.array("q", t),
        lambda t: memoryview(array.array("L", t)),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=">u4"),
        lambda t: np.repeat(np.array(t, dtype=np.uint32), 2)[::2],
        lambda t: iter(t),
        lambda t: [np.int64(x) for x in t],
    ],
    ids=[
        "list",
        "tuple",
        "array-I",
        "array-q",
        "memoryview",
        "np-u32",
        "np-i64",
        "np-u64",
        "np-big-endian",
        "np-strided",
        "iterator",
        "np-scalars",
    ],
)
def test_every_token_container_gives_the_same_hashes(impl: ModuleType, make: Any) -> None:
    hasher = impl.BlockHasher("sha256_cbor", block_size=2)
    assert hasher.hash_blocks(make(TOKENS)) == hasher.hash_blocks(TOKENS)
    assert hasher.hash_block(None, make(TOKENS)) == hasher.hash_block(None, TOKENS)


def test_small_dtypes_and_range(impl: ModuleType) -> None:
    hasher = impl.BlockHasher("xxh3_128", block_size=4, seed="s")
    small = [1, 2, 3, 4, 100, 120, 7, 0]
    expected = hasher.hash_blocks(small)
    for dtype in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        assert hasher.hash_blocks(np.array(small, dtype=dtype)) == expected
    assert hasher.hash_blocks(range(8)) == hasher.hash_blocks(list(range(8)))


BAD_TOKENS: list[tuple[Any, type[Exception]]] = [
    ([1, -1], ValueError),
    ([2**32], ValueError),
    ([2**70], ValueError),
    ([-(2**70)], ValueError),
    ([1.0], TypeError),
    ([True], TypeError),
    (["3"], TypeError),
    ([None], TypeError),
    ("1234", TypeError),
    (b"\x01\x02", TypeError),
    (bytearray(b"\x01"), TypeError),
    (5, TypeError),
    (np.zeros((2, 2), dtype=np.uint32), ValueError),
    (np.array(5, dtype=np.uint32), ValueError),
    (np.array([1.0, 2.0]), TypeError),
    (np.array([True, False]), TypeError),
    (np.array([1, -2], dtype=np.int32), ValueError),
    (np.array([1, -2], dtype=np.int64), ValueError),
    (np.array([2**33], dtype=np.uint64), ValueError),
    (np.array(["a"]), TypeError),
    (array.array("d", [1.0]), TypeError),
    ([np.bool_(True)], TypeError),
]


@pytest.mark.parametrize(("tokens", "error"), BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_bad_token_ids_raise(impl: ModuleType, tokens: Any, error: type[Exception]) -> None:
    hasher = impl.BlockHasher(block_size=2)
    with pytest.raises(error):
        hasher.hash_blocks(tokens)
    with pytest.raises(error):
        hasher.hash_block(None, tokens)
    with pytest.raises(error):
        impl.TokenSequence(tokens, hasher=hasher)


BAD_EXTRA_KEYS: list[tuple[Any, type[Exception]]] = [
    ([("cache_salt", "s")], TypeError),
    ((["cache_salt", "s"],), TypeError),
    (("cache_salt", "s"), TypeError),
    ((("colour", "red"),), ValueError),
    (((),), ValueError),
    (((1, 2),), ValueError),
    ((("lora", "a"),), ValueError),
    ((("cache_salt", "s", "t"),), ValueError),
    ((("lora", "a", 3),), TypeError),
    ((("mm", "a", "3"),), TypeError),
    ((("mm", "a", True),), TypeError),
    ((("mm", "a", 2**63),), ValueError),
    ((("mm", b"a", 1),), TypeError),
    ((("cache_salt", None),), TypeError),
    ((("prompt_embeds", "digest"),), TypeError),
]


@pytest.mark.parametrize(("extra", "error"), BAD_EXTRA_KEYS, ids=range(len(BAD_EXTRA_KEYS)))
def test_bad_extra_keys_raise(impl: ModuleType, extra: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        impl.BlockHasher().hash_block(None, [1, 2], extra)


BAD_REQUEST_KEYS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"cache_salt": 5}, TypeError),
    ({"cache_salt": b"s"}, TypeError),
    ({"lora": "name"}, TypeError),
    ({"lora": ("name",)}, TypeError),
    ({"lora": ["name", "path"]}, TypeError),
    ({"lora": ("name", None)}, TypeError),
    ({"mm_features": 3}, TypeError),
    ({"mm_features": [("a", 0)]}, TypeError),
    ({"mm_features": [("a", -1, 2)]}, ValueError),
    ({"mm_features": [("a", 0, 0)]}, ValueError),
    ({"mm_features": [("a", 5, 2), ("b", 1, 2)]}, ValueError),
    ({"mm_features": [(1, 0, 2)]}, TypeError),
    ({"mm_features": [("a", 0.5, 2)]}, TypeError),
]


@pytest.mark.parametrize(("kwargs", "error"), BAD_REQUEST_KEYS, ids=range(len(BAD_REQUEST_KEYS)))
def test_bad_request_keys_raise(
    impl: ModuleType, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    hasher = impl.BlockHasher(block_size=2)
    with pytest.raises(error):
        hasher.hash_blocks([1, 2, 3, 4], **kwargs)
    with pytest.raises(error):
        impl.TokenSequence([1, 2, 3, 4], hasher=hasher, **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        (("md5",), {}, ValueError),
        ((), {"block_size": 0}, ValueError),
        ((), {"block_size": -16}, ValueError),
        ((), {"block_size": 2**64}, ValueError),
        ((), {"block_size": 1.5}, TypeError),
        ((), {"block_size": True}, TypeError),
        ((), {"seed": 0}, TypeError),
        ((), {"seed": b"seed"}, TypeError),
    ],
)
def test_bad_hasher_arguments(
    impl: ModuleType, args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        impl.BlockHasher(*args, **kwargs)


def test_bad_parent_and_sequence_arguments(impl: ModuleType) -> None:
    hasher = impl.BlockHasher(block_size=2)
    with pytest.raises(TypeError):
        hasher.hash_block("parent", [1])
    with pytest.raises(TypeError):
        impl.TokenSequence([1, 2], hasher="sha256")
    with pytest.raises(ValueError, match="prompt"):
        impl.TokenSequence([], hasher=hasher)
    other = ref if impl is kvblocks else kvblocks
    with pytest.raises(TypeError):
        impl.TokenSequence([1, 2], hasher=other.BlockHasher())


def test_failed_append_changes_nothing(impl: ModuleType) -> None:
    seq = impl.TokenSequence([1, 2, 3], hasher=impl.BlockHasher(block_size=2))
    before = (seq.get_token_ids(), seq.block_hashes)
    for bad in ([4, -5], [4, 2**32], [4, "5"], 1.5, None, [[4]]):
        with pytest.raises((TypeError, ValueError)):
            seq.append_token_ids(bad)
    assert (seq.get_token_ids(), seq.block_hashes) == before
    with pytest.raises(ValueError):
        seq.get_prefix_token_ids(4)
    with pytest.raises(ValueError):
        seq.get_prefix_token_ids(-1)
    with pytest.raises(TypeError):
        seq.get_prefix_token_ids(1.0)


@pytest.mark.parametrize(
    ("num_blocks", "message"),
    [
        (1, "num_blocks must be >= 2 (block 0 is the null block), got 1"),
        (0, "num_blocks must be >= 2 (block 0 is the null block), got 0"),
        (-3, "num_blocks must be >= 2 (block 0 is the null block), got -3"),
        (
            10**12,
            # 2**31 - 1 slots of 16 tokens: 134,217,727 blocks
            "num_blocks * block_size = 1000000000000 * 16 exceeds the int32 slot range "
            "(at most 134217727 blocks of 16 tokens)",
        ),
    ],
)
def test_a_pool_size_that_cannot_work_says_the_limit(
    impl: ModuleType, num_blocks: int, message: str
) -> None:
    """One block is only the null block (nothing could ever be allocated); a pool past the
    int32 slot ids says how many blocks fit."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        impl.BlockManager(num_blocks, 16)
    assert impl.BlockManager(2, 16).num_free_blocks == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_num_reqs": -1}, ValueError, "max_num_reqs must be >= 0, got -1"),
        ({"max_num_tokens": -2}, ValueError, "max_num_tokens must be >= 0, got -2"),
        ({"max_blocks_per_req": "2"}, TypeError, "max_blocks_per_req must be an int, got str"),
    ],
)
def test_step_buffers_name_a_bad_size(kwargs: dict[str, Any], error: type, message: str) -> None:
    from kvblocks import StepBuffers

    sizes = {"max_num_reqs": 2, "max_num_tokens": 8, "max_blocks_per_req": 2, **kwargs}
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        StepBuffers.allocate(**sizes)
