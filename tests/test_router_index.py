"""``kvblocks._core.RouterIndex`` (Rust) against its pure-Python reference
(``kvblocks.reference.router``): random streams of stores, removals, clears and replica
changes from many replicas, with repeated stores and removals of blocks never stored, must
leave the same answers (each replica's prefix of random lookups), the same counts and held
blocks, and refuse the same bad input. Keys are checked independently too: the bytes of a
hash and vLLM's int form of it (its last 8 bytes, big-endian) are one block."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks._core import RouterIndex
from kvblocks.reference import router as reference

HASHES = [hashlib.sha256(str(i).encode()).digest() for i in range(64)]


def as_int(block_hash: bytes) -> int:
    """What vLLM's KV events publish for a hash by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


@st.composite
def streams(draw: st.DrawFn) -> list[tuple]:
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        # replicas 30 to 33 cross the index's switch to 8-byte replica sets
        replica = draw(st.sampled_from([0, 1, 2, 3, 30, 31, 32, 33, 63]))
        kinds = ["store", "store", "remove", "clear", "add", "drop", "ask", "snapshot"]
        kind = draw(st.sampled_from(kinds))
        picks = draw(st.lists(st.integers(0, len(HASHES) - 1), max_size=12))
        group, medium = draw(st.integers(0, 2)), draw(st.integers(0, 1))
        as_ints = draw(st.booleans())
        ops.append((kind, replica, picks, group, medium, as_ints))
    return ops


def apply(index, op):
    kind, replica, picks, group, medium, as_ints = op
    hashes = [as_int(HASHES[i]) if as_ints else HASHES[i] for i in picks]
    try:
        if kind == "store":
            return index.store(replica, hashes, group, medium)
        if kind == "remove":
            return index.remove(replica, hashes, group, medium)
        if kind == "clear":
            return index.clear_replica(replica)
        if kind == "add":
            return index.add_replica(replica)
        if kind == "drop":
            return index.remove_replica(replica)
        if kind == "snapshot":  # the replica's blocks taken out and restored
            keys, copies = index.replica_blocks(replica)
            n = len(keys) // 8
            found = struct.unpack(f"<{n}Q", keys), struct.unpack(f"<{n}I", copies)
            blocks = sorted(zip(*found, strict=True))
            index.clear_replica(replica)
            return blocks, index.restore_replica(replica, keys, copies)
        return index.prefix_blocks(hashes, group, medium)
    except ValueError as error:
        return ("ValueError", str(error).split(" ")[0])


@settings(max_examples=300, deadline=None)
@given(streams())
def test_rust_and_reference_agree(ops: list[tuple]) -> None:
    ours, ref = RouterIndex(seed=123), reference.RouterIndex()
    for r in (0, 1):
        ours.add_replica(r)
        ref.add_replica(r)
    for op in ops:
        assert apply(ours, op) == apply(ref, op), op
        assert ours.counts() == ref.counts()
        assert ours.num_keys == ref.num_keys
        assert ours.num_copied == ref.num_copied
        assert ours.replicas == ref.replicas
        assert [ours.held(r) for r in range(64)] == [ref.held(r) for r in range(64)]
    for h in HASHES[:8]:
        for r in range(64):
            assert ours.holds(r, h, 0, 0) == ref.holds(r, h, 0, 0)


def test_a_block_stays_held_until_its_last_copy_is_removed() -> None:
    """vLLM caches a block computed again in a second copy, with a BlockStored for each
    copy and a BlockRemoved for each copy it evicts."""
    for index in (RouterIndex(), reference.RouterIndex()):
        index.add_replica(0)
        index.add_replica(1)
        block = [HASHES[0]]
        assert index.store(0, block, 0, 0) == 1
        assert index.store(0, [as_int(HASHES[0])], 0, 0) == 0  # a second copy, as an int
        assert index.store(1, block, 0, 0) == 1
        assert index.num_copied == 1
        assert index.remove(0, block, 0, 0) == 0
        assert index.holds(0, HASHES[0], 0, 0)
        assert index.remove(0, block, 0, 0) == 1
        assert not index.holds(0, HASHES[0], 0, 0)
        assert index.holds(1, HASHES[0], 0, 0)
        assert index.remove(0, block, 0, 0) == 0
        counts = index.counts()
        assert (counts["repeated_stores"], counts["repeated_removals"]) == (1, 1)
        assert (counts["removed"], counts["unknown_removals"]) == (1, 1)
        # a clear drops the copies with the blocks
        index.store(1, block, 0, 0)
        assert index.num_copied == 1
        assert index.clear_replica(1) == 1
        assert index.num_copied == 0


def test_bytes_and_int_forms_are_one_block() -> None:
    index = RouterIndex()
    index.add_replica(0)
    assert index.store(0, HASHES[:3], 1, 0) == 3
    assert index.store(0, [as_int(h) for h in HASHES[:3]], 1, 0) == 0  # the same three
    assert index.prefix_blocks([as_int(h) for h in HASHES[:4]], 1, 0) == {0: 3}
    assert index.prefix_blocks(HASHES[:3], 0, 0) == {0: 0}  # another group
    assert index.prefix_blocks(HASHES[:3], 1, 1) == {0: 0}  # another medium


def test_bad_input_raises_and_changes_nothing() -> None:
    index = RouterIndex()
    index.add_replica(2)
    index.store(2, HASHES[:2], 0, 0)
    before = (index.counts(), index.num_keys, index.held(2))
    with pytest.raises(ValueError, match="no replica 3"):
        index.store(3, HASHES[:2], 0, 0)
    with pytest.raises(ValueError, match="replica"):
        index.add_replica(64)
    with pytest.raises(ValueError, match="already in the index"):
        index.add_replica(2)
    with pytest.raises(TypeError, match="bytes or an int"):
        index.store(2, [HASHES[5], "x"], 0, 0)  # the bad item refuses the whole call
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        index.remove(2, [HASHES[0], -1], 0, 0)
    with pytest.raises(TypeError):
        index.store(2, 5, 0, 0)
    assert (index.counts(), index.num_keys, index.held(2)) == before


def test_a_million_blocks_over_dozens_of_replicas() -> None:
    """Memory per indexed block: one 12-byte slot per key (no control byte) in a table at
    most 7/8 full that grows by an eighth, however many replicas hold a block; 16-byte slots
    once a replica id reaches 32; and a table reserved for its keys holds them without
    growing."""
    rng = random.Random(4)
    blocks = [rng.getrandbits(64) for _ in range(1_000_000)]
    starts = [rng.randrange(0, 900_000) for _ in range(33)]
    index = RouterIndex(seed=9)
    for r in range(32):
        index.add_replica(r)
        index.store(r, blocks[starts[r] : starts[r] + 100_000], 0, 0)
    held = sum(index.held(r) for r in range(32))
    assert held == 3_200_000
    assert 0 < index.num_keys <= 1_000_000
    grown = index.table_bytes
    # a grown table is at most 7/8 full and, grown by an eighth, at least 7/9: <= 15.5 B a key
    assert 12 * 8 / 7 <= grown / index.num_keys <= 12 * 9 / 7
    assert grown / held < 16
    # replica 40: every slot's replica set widens to 8 bytes
    index.add_replica(40)
    index.store(40, blocks[:1], 0, 0)
    assert index.table_bytes == grown // 12 * 16
    assert index.prefix_blocks(blocks[:1], 0, 0)[40] == 1
    # reserved up front: sized to the keys, never grown
    reserved = RouterIndex(seed=9)
    reserved.reserve(1_000_000)
    before = reserved.table_bytes
    assert before / 1_000_000 < 12 * 8 / 7 + 0.01
    for r in range(32):
        reserved.add_replica(r)
        reserved.store(r, blocks[starts[r] : starts[r] + 100_000], 0, 0)
    assert reserved.table_bytes == before
    sample = blocks[starts[5] : starts[5] + 50]
    assert reserved.prefix_blocks(sample, 0, 0) == {
        r: v for r, v in index.prefix_blocks(sample, 0, 0).items() if r < 32
    }
