"""``hash_blocks(..., parent=, start_block=)``: continuing a chain where a caller's hash list
ends (what vLLM's request block hasher needs when the scheduler truncates that list)."""

from __future__ import annotations

import array
from types import ModuleType

import numpy as np
import pytest

import kvblocks
from tests.oracle import VLLM_ALGOS, oracle_block, oracle_none_hash

KEYS = {
    "cache_salt": "tenant",
    "lora": ("adapter", "/a"),
    "mm_features": [("img", 2, 7), ("img2", 13, 4)],
}


@pytest.mark.parametrize("algo", [*VLLM_ALGOS, "xxh3_128"])
def test_continuation_is_the_tail_of_the_whole_chain(impl: ModuleType, algo: str) -> None:
    hasher = impl.BlockHasher(algo, block_size=4, seed="s")
    tokens = list(range(1000, 1023))
    whole = hasher.hash_blocks(tokens, **KEYS)
    assert len(whole) == 5
    for start in range(6):
        parent = whole[start - 1] if start else None
        for kind in (list, tuple, np.array, lambda t: array.array("I", t)):
            tail = hasher.hash_blocks(kind(tokens), parent=parent, start_block=start, **KEYS)
            assert tail == whole[start:], (start, kind)
        flat = hasher.hash_blocks_array(tokens, parent=parent, start_block=start, **KEYS)
        assert flat.tobytes() == b"".join(whole[start:])


@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_parent_is_used_as_given(impl: ModuleType, algo: str) -> None:
    """An independent oracle (hashlib/pickle/cbor2/xxhash): block k is chained to `parent`,
    whatever produced it, and keys follow absolute positions (no salt after block 0)."""
    hasher = impl.BlockHasher(algo, block_size=2, seed="s")
    parent = b"\x07" * hasher.digest_size
    got = hasher.hash_blocks([5, 6, 7, 8, 9], parent=parent, start_block=1, cache_salt="x")
    expected = oracle_block(algo, parent, [7, 8], None)
    assert got == [expected]
    # No parent means NONE_HASH, as in vLLM's hash_block_tokens.
    got = hasher.hash_blocks([5, 6, 7, 8], start_block=1)
    assert got == [oracle_block(algo, oracle_none_hash(algo, "s"), [7, 8], None)]


def test_only_the_tail_of_a_list_is_read(impl: ModuleType) -> None:
    hasher = impl.BlockHasher("sha256_cbor", block_size=2)
    whole = hasher.hash_blocks([1, 2, 3, 4])
    # Positions before the start are not converted: a bad value there is not seen.
    assert hasher.hash_blocks([-1, "x", 3, 4], parent=whole[0], start_block=1) == whole[1:]
    with pytest.raises(ValueError, match="index 2"):
        hasher.hash_blocks([1, 2, -3, 4], start_block=1)


def test_only_the_tail_of_an_int32_buffer_is_read() -> None:
    """vLLM 0.34 keeps a request's tokens in an ``array('i')`` (its ``TokenBuffer``): the Rust
    reader converts and checks only the tokens from the start block on, as for a list, so that
    hashing each new block of a long request does not read the whole context again."""
    hasher = kvblocks.BlockHasher("sha256_cbor", block_size=2)
    whole = hasher.hash_blocks([1, 2, 3, 4])
    assert hasher.hash_blocks(array.array("i", [1, 2, 3, 4])) == whole
    tail = array.array("i", [-1, -2, 3, 4])  # the positions before the start are not read
    assert hasher.hash_blocks(tail, parent=whole[0], start_block=1) == whole[1:]
    with pytest.raises(ValueError, match="token id -3 at index 2 is out of range"):
        hasher.hash_blocks(array.array("i", [1, 2, -3, 4]), start_block=1)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"parent": "ab"}, TypeError),
        ({"parent": bytearray(b"ab")}, TypeError),
        ({"start_block": -1}, ValueError),
        ({"start_block": True}, TypeError),
        ({"start_block": 1.0}, TypeError),
        ({"start_block": 3}, ValueError),  # past the end of 5 tokens
        ({"start_block": 2**62}, ValueError),
    ],
)
def test_bad_arguments(impl: ModuleType, kwargs: dict[str, object], error: type) -> None:
    hasher = impl.BlockHasher("sha256_cbor", block_size=2)
    with pytest.raises(error):
        hasher.hash_blocks([1, 2, 3, 4, 5], **kwargs)
    with pytest.raises(error):
        hasher.hash_blocks(np.arange(5), **kwargs)


def test_start_at_the_end_is_empty(impl: ModuleType) -> None:
    hasher = impl.BlockHasher("sha256", block_size=2)
    assert hasher.hash_blocks([1, 2, 3, 4], start_block=2) == []
    assert hasher.hash_blocks([1, 2, 3, 4, 5], start_block=2) == []
