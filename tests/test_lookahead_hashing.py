"""Lookahead hashing (vLLM's ``num_hash_lookahead_tokens``, EAGLE/MTP): ``hash_blocks(...,
num_lookahead_tokens=L)`` against the independent oracle of tests/oracle.py (hashlib, pickle,
cbor2, xxhash), for both implementations. vLLM's own hasher is the oracle of the same feature in
tests/vllm_tier/test_block_hasher.py.

The chains start from the oracle's own NONE_HASH for the hasher's seed
(``oracle_none_hash``), not from the ``none_hash`` the implementation under test reports, so
a wrong NONE_HASH fails them too; tests/test_api.py checks the implementations' NONE_HASH
against ``oracle_none_hash`` on its own, for every algorithm and the seeds chosen without an
explicit one (vLLM's constant, a random secret, ``PYTHONHASHSEED``)."""

from __future__ import annotations

import pickle
import pickletools
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
import kvblocks.reference as ref
from tests.oracle import VLLM_ALGOS, oracle_chain, oracle_none_hash

LOOKAHEADS = (1, 2, 3, 5)
# Every integer width of CBOR and pickle, LONG1 (>= 2**31) included.
WIDE_INTS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
TOKENS = [WIDE_INTS[i * 7 % len(WIDE_INTS)] ^ (i % 3) for i in range(41)]

# With B = 4: "img-a" [5, 7) starts inside block 1 but block 0's lookahead window reaches it
# from L = 2; "img-b" [12, 13) sits in the lookahead tokens of block 2; "img-c" [14, 30) spans
# several blocks. None overlaps another (the oracle's rule, and vLLM's usual layout).
MM = [("img-a", 5, 2), ("img-b", 12, 1), ("img-c", 14, 16)]
KEY_CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "salt": {"cache_salt": "tenant-42"},
    "one_char_salt": {"cache_salt": "é"},
    "lora": {"lora": ("adapter-a", "/adapters/a")},
    "one_char_lora": {"lora": ("b", "/")},
    "mm": {"mm_features": MM},
    "all": {"cache_salt": "s", "lora": ("adapter-c", "/p/c"), "mm_features": MM},
}


def expected(hasher: Any, tokens: list[int], lookahead: int, **kwargs: Any) -> list[bytes]:
    none_hash = oracle_none_hash(hasher.algo, hasher.seed)
    return oracle_chain(
        hasher.algo, none_hash, hasher.block_size, tokens, lookahead=lookahead, **kwargs
    )


@pytest.mark.parametrize("case", list(KEY_CASES))
@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_chain_matches_the_oracle(impl: ModuleType, algo: str, lookahead: int, case: str) -> None:
    hasher = impl.BlockHasher(algo, block_size=4, seed="s")
    keys = KEY_CASES[case]
    got = hasher.hash_blocks(TOKENS, num_lookahead_tokens=lookahead, **keys)
    assert len(got) == (len(TOKENS) - lookahead) // 4
    assert got == expected(hasher, TOKENS, lookahead, **keys)
    # The lookahead tokens really are hashed: the plain chain differs from block 0 on.
    assert got[0] != hasher.hash_blocks(TOKENS, **keys)[0]


def test_oracle_sees_an_item_only_in_the_lookahead_window() -> None:
    """The case the mm layout above was built for: block 0 ([0, 4)) with L = 2 covers
    [0, 6), which reaches "img-a" at 5; with L = 1 it does not. Checked on the oracle's own
    inputs, so that the comparisons above exercise it."""
    hasher = kvblocks.BlockHasher("sha256_cbor", block_size=4, seed="s")
    with_item = expected(hasher, TOKENS[:6], 2, mm_features=MM)
    without_item = expected(hasher, TOKENS[:6], 2)
    assert with_item != without_item
    assert expected(hasher, TOKENS[:5], 1, mm_features=MM) == expected(hasher, TOKENS[:5], 1)


@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_continuation_is_the_tail_of_the_whole_chain(
    impl: ModuleType, algo: str, lookahead: int
) -> None:
    hasher = impl.BlockHasher(algo, block_size=4, seed="s")
    keys = KEY_CASES["all"]
    whole = hasher.hash_blocks(TOKENS, num_lookahead_tokens=lookahead, **keys)
    for start in range(len(whole) + 1):
        parent = whole[start - 1] if start else None
        for kind in (list, tuple, lambda t: np.array(t, dtype=np.uint32)):
            tail = hasher.hash_blocks(
                kind(TOKENS),
                parent=parent,
                start_block=start,
                num_lookahead_tokens=lookahead,
                **keys,
            )
            assert tail == whole[start:], (start, kind)
        flat = hasher.hash_blocks_array(
            TOKENS, parent=parent, start_block=start, num_lookahead_tokens=lookahead, **keys
        )
        assert flat.shape == (len(whole) - start, hasher.digest_size)
        assert flat.tobytes() == b"".join(whole[start:])


@pytest.mark.parametrize("lookahead", LOOKAHEADS)
@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_appends_one_token_at_a_time(impl: ModuleType, algo: str, lookahead: int) -> None:
    """As vLLM's request block hasher is driven: after each new token, continue from the hash
    list so far. Every block appears exactly when its lookahead tokens have arrived."""
    block_size = 3
    hasher = impl.BlockHasher(algo, block_size=block_size, seed="s")
    keys = {"cache_salt": "x", "mm_features": [("m", 4, 2), ("n", 9, 5)]}
    hashes: list[bytes] = []
    for n in range(1, len(TOKENS) + 1):
        tokens = TOKENS[:n]
        parent = hashes[-1] if hashes else None
        hashes += hasher.hash_blocks(
            tokens, parent=parent, start_block=len(hashes), num_lookahead_tokens=lookahead, **keys
        )
        assert len(hashes) == max(0, (n - lookahead) // block_size), n
    assert hashes == expected(hasher, TOKENS, lookahead, **keys)


def test_blocks_wait_for_their_lookahead_tokens(impl: ModuleType) -> None:
    hasher = impl.BlockHasher("sha256", block_size=4, seed="s")
    assert hasher.hash_blocks(range(6), num_lookahead_tokens=3) == []
    assert len(hasher.hash_blocks(range(7), num_lookahead_tokens=3)) == 1
    assert len(hasher.hash_blocks(range(10), num_lookahead_tokens=3)) == 1
    assert len(hasher.hash_blocks(range(11), num_lookahead_tokens=3)) == 2
    assert hasher.hash_blocks(range(100), num_lookahead_tokens=97) == []


def test_zero_lookahead_is_plain_hashing(impl: ModuleType) -> None:
    for algo in (*VLLM_ALGOS, "xxh3_128"):
        hasher = impl.BlockHasher(algo, block_size=4, seed="s")
        plain = hasher.hash_blocks(TOKENS, **KEY_CASES["all"])
        assert hasher.hash_blocks(TOKENS, num_lookahead_tokens=0, **KEY_CASES["all"]) == plain


def test_xxh3_128_has_no_lookahead_layout(impl: ModuleType) -> None:
    hasher = impl.BlockHasher("xxh3_128", block_size=4, seed="s")
    for tokens in ([], list(range(40))):  # refused even when no block would be hashed
        with pytest.raises(ValueError, match="xxh3_128 layout has no lookahead form"):
            hasher.hash_blocks(tokens, num_lookahead_tokens=1)
        with pytest.raises(ValueError, match="xxh3_128 layout has no lookahead form"):
            hasher.hash_blocks_array(tokens, num_lookahead_tokens=2)


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (2**64, ValueError), (True, TypeError), (1.0, TypeError), ("1", TypeError)],
)
def test_bad_lookahead_arguments(impl: ModuleType, value: object, error: type) -> None:
    hasher = impl.BlockHasher("sha256_cbor", block_size=2)
    for method in (hasher.hash_blocks, hasher.hash_blocks_array):
        with pytest.raises(error, match="num_lookahead_tokens"):
            method([1, 2, 3, 4, 5], num_lookahead_tokens=value)


FRAME_CUT_SIZES = range(13_098, 13_105)


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pickle_frames_around_the_lookahead_tokens(impl: ModuleType, algo: str) -> None:
    """Blocks of 5-byte ints just under pickle's 64 KiB frame target: CPython's pickler
    closes the frame before the wrapping tuple or before one of the lookahead ints, depending
    on the block size; kvblocks must cut exactly there. A 70,000-character LoRA name (written
    outside any frame) moves the cut again."""
    lookahead = 5
    for n in FRAME_CUT_SIZES:
        hasher = impl.BlockHasher(algo, block_size=n, seed="s")
        tokens = [70000] * (n + lookahead)
        for keys in ({}, {"lora": ("x" * 70_000, "p")}):
            got = hasher.hash_blocks(tokens, num_lookahead_tokens=lookahead, **keys)
            assert got == expected(hasher, tokens, lookahead, **keys), (n, keys)


def test_frame_cut_sizes_cover_the_lookahead_part() -> None:
    """The sizes above do move CPython's frame cut across the lookahead part: before the
    wrapping tuple (MARK) for some, before one of its ints for others."""
    cuts = set()
    for n in FRAME_CUT_SIZES:
        obj = (b"\0" * 16, (70000,) * n, (None, *[70000] * 5))
        ops = [op.name for op, _, _ in pickletools.genops(pickle.dumps(obj, protocol=5))]
        frames = [i for i, name in enumerate(ops) if name == "FRAME"]
        if len(frames) > 1:
            cuts.add((ops[frames[1] + 1], len(ops) - frames[1]))
    # The wrapping tuple and its items are the last 13 opcodes.
    assert any(name == "MARK" for name, _ in cuts), cuts
    assert len({d for name, d in cuts if name == "BININT" and d < 13}) >= 3, cuts


disjoint_items = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 9), st.sampled_from(["i0", "i1", "é"])),
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(
    algo=st.sampled_from(VLLM_ALGOS),
    block_size=st.sampled_from([1, 2, 3, 4, 7]),
    lookahead=st.integers(0, 6),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    salt=st.sampled_from([None, "", "salt", "é"]),
    lora=st.sampled_from([None, ("n", "/p"), ("adapter", "x")]),
    gaps=disjoint_items,
    start=st.integers(0, 20),
)
def test_random_chains_match_the_oracle(
    algo: str,
    block_size: int,
    lookahead: int,
    tokens: list[int],
    salt: str | None,
    lora: tuple[str, str] | None,
    gaps: list[tuple[int, int, str]],
    start: int,
) -> None:
    features, position = [], 0
    for gap, length, identifier in gaps:
        features.append((identifier, position + gap, length))
        position += gap + length
    keys: dict[str, Any] = {"cache_salt": salt, "lora": lora, "mm_features": features}
    hashers = [m.BlockHasher(algo, block_size=block_size, seed="s") for m in (kvblocks, ref)]
    whole = expected(hashers[0], tokens, lookahead, **keys)
    start = min(start, len(whole))
    parent = whole[start - 1] if start else None
    for hasher in hashers:
        assert hasher.hash_blocks(tokens, num_lookahead_tokens=lookahead, **keys) == whole
        tail = hasher.hash_blocks(
            tokens, parent=parent, start_block=start, num_lookahead_tokens=lookahead, **keys
        )
        assert tail == whole[start:]
