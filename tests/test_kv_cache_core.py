"""``kvblocks._core.KVCacheCore``, the Rust engine under ``kvblocks.vllm.KVCacheManager``,
through its Python surface: vLLM's worked trace, and bad input that changes nothing."""

from __future__ import annotations

import hashlib

import pytest

from kvblocks._core import KVCacheCore


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def admit(core: KVCacheCore, rid: str, hashes: list[bytes], num_tokens: int) -> list[int]:
    b = core.block_size
    hits = core.lookup(hashes, (num_tokens - 1) // b).block_ids
    new = core.allocate_slots(
        rid, hashes, num_tokens, 0, num_tokens - len(hits) * b, len(hits) * b, hits or None,
        0, False, True, 0, False,
    )  # fmt: skip
    assert new is not None
    return core.get_block_ids(rid)


def test_worked_trace() -> None:
    """N = 11 blocks of 16 tokens: two requests share a 48-token prefix (vLLM 0.33's rules:
    block 0 is the null block, hits are capped at num_tokens - 1, frees go tail first)."""
    core = KVCacheCore(11, 16, max_model_len=4096, enable_events=True)
    shared = [h(1), h(2), h(3)]
    assert admit(core, "r0", shared, 55) == [1, 2, 3, 4]
    assert admit(core, "r1", shared, 53) == [1, 2, 3, 5]
    assert core.num_free_blocks == 5
    assert core.usage == pytest.approx(0.5)
    assert core.estimate_cached_tokens("r1") == 48
    assert len(core) == 2
    core.free("r0")
    core.free("r1")
    core.free("never-seen")
    assert len(core) == 0
    # A 48-token prompt hits only 2 blocks: the last token must be computed.
    assert core.lookup(shared, (48 - 1) // 16).block_ids == [1, 2]
    assert core.get_blocks("r0") is core.empty_kv_cache_blocks
    events = core.take_events()
    assert events[0] == ("stored", "r0", 0, 3)
    assert ("stored", "r1", 3, 3) not in events
    assert core.reset_prefix_cache()
    assert core.take_events() == [("cleared",)]
    assert core.lookup(shared, 3) is core.empty_kv_cache_blocks


def test_bad_input_changes_nothing() -> None:
    core = KVCacheCore(8, 4, max_model_len=1024)
    admit(core, "a", [h(1)], 6)
    state = (core.num_free_blocks, core.get_block_ids("a"), core.lookup([h(1)], 1).block_ids)

    def allocate(hashes: object, num_new: int = 8, hits: list[int] | None = None) -> object:
        return core.allocate_slots("b", hashes, 8, 0, num_new, 0, hits, 0, False, False, 0, False)

    with pytest.raises(TypeError):
        allocate((h(1), h(2)))
    with pytest.raises(ValueError, match="not bytes"):
        allocate([h(1), "x"])
    with pytest.raises(ValueError, match="5 bytes"):
        allocate([h(1), b"short"])
    with pytest.raises(ValueError, match="greater than 0"):
        allocate([], num_new=0)
    for hits in ([0], [99], [3]):  # the null block, out of range, not cached
        with pytest.raises(ValueError):
            allocate([h(1)], hits=hits)
    with pytest.raises(ValueError, match="first allocation"):
        core.allocate_slots("a", [h(1)], 8, 6, 2, 0, [1], 0, False, False, 0, False)
    with pytest.raises(ValueError):
        core.cache_blocks("a", [h(1), b"\x00" * 7], 8)
    assert (
        core.num_free_blocks,
        core.get_block_ids("a"),
        core.lookup([h(1)], 1).block_ids,
    ) == state
    assert core.get_block_ids("b") == []
    with pytest.raises(ValueError):
        KVCacheCore(0, 4, max_model_len=8)
    with pytest.raises(ValueError):
        KVCacheCore(8, 0, max_model_len=8)


def test_refusal_when_full_changes_nothing() -> None:
    core = KVCacheCore(4, 4, max_model_len=1024)
    admit(core, "a", [], 9)  # 3 blocks: the pool is full
    assert core.allocate_slots("b", [], 4, 0, 4, 0, None, 0, False, False, 0, False) is None
    assert core.get_block_ids("b") == []
    assert core.num_free_blocks == 0
