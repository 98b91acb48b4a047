"""vLLM 0.33's block-manager behaviours (docs/semantics.md §3.9 and §5, single group), each run
against the Rust manager and its pure-Python reference."""

from __future__ import annotations

from types import ModuleType

import pytest

from kvblocks.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.manager_calls import admit, free_queue

B = 16
COMMON = list(range(1000, 1048))  # 48 tokens = 3 full blocks


def ext(h: bytes) -> int:
    """vLLM's external event hash: the last 8 bytes, big-endian."""
    return int.from_bytes(h[-8:], "big")


def test_worked_trace(impl: ModuleType) -> None:
    """docs/semantics.md §3.9, step by step."""
    m = impl.BlockManager(11, B, enable_events=True)
    assert m.num_free_blocks == 10  # block 0 is the null block
    # 1. R0 = 48 common tokens + 7: nothing cached yet.
    m.add_request("r0", [*COMMON, *range(7)])
    assert m.get_computed_blocks("r0") == ([], 0)
    assert m.allocate_slots("r0", 55) == [1, 2, 3, 4]
    state = m.debug_state()
    hashes = m.block_hashes("r0")
    assert state["block_keys"][1:5] == [*hashes, None]
    assert state["ref_counts"][1:5] == [1, 1, 1, 1]
    # 2. R1 = the same 48 + 5: hits blocks 1-3 and allocates only its tail.
    m.add_request("r1", [*COMMON, *range(100, 105)])
    assert m.get_computed_blocks("r1") == ([1, 2, 3], 48)
    assert m.allocate_slots("r1", 5, num_new_computed_tokens=48, new_computed_blocks=[1, 2, 3]) == [
        5
    ]
    assert m.debug_state()["ref_counts"][1:6] == [2, 2, 2, 1, 1]
    assert m.num_free_blocks == 5
    # 3. Free both: un-hashed tails to the head, hashed blocks to the tail, tail block first.
    m.free("r0")
    m.free("r1")
    assert free_queue(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # 4. R2 hits 1-3 again (pulled out of the queue) and gets the head block.
    assert admit(m, "r2", [*COMMON, *range(200, 206)]) == [5]
    assert m.num_free_blocks == 6
    m.free("r2")
    assert free_queue(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # 5. 160 fresh tokens take every block in queue order, evicting 3, 2, 1.
    m.take_events()
    assert admit(m, "r3", list(range(5000, 5160))) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert free_queue(m) == []
    events = m.take_events()
    assert events[:3] == [BlockRemoved([ext(h)]) for h in reversed(hashes)]
    assert len(events) == 4
    assert isinstance(events[3], BlockStored)
    assert events[3].block_hashes == [ext(h) for h in m.block_hashes("r3")]


def test_hit_is_capped_so_the_last_token_is_computed(impl: ModuleType) -> None:
    m = impl.BlockManager(20, B)
    admit(m, "a", COMMON)
    m.free("a")
    m.add_request("b", COMMON)
    hits, n = m.get_computed_blocks("b")
    assert (hits, n) == ([1, 2], 32)  # 48 tokens all cached -> the last block is recomputed
    m.add_request("c", [*COMMON, 7])
    assert m.get_computed_blocks("c") == ([1, 2, 3], 48)


def test_decode_allocates_at_block_boundaries_and_caches_full_blocks(impl: ModuleType) -> None:
    m = impl.BlockManager(20, B, enable_events=True)
    admit(m, "r", list(range(30)))
    first = m.take_events()
    assert len(first) == 1
    assert first[0].token_ids == list(range(16))
    assert first[0].parent_block_hash is None
    for t in range(30, 32):  # fill the second block: no new block
        m.append_token_ids("r", t)
        assert m.allocate_slots("r", 1) == []
    assert m.take_events()[0].block_hashes == [ext(m.block_hashes("r")[1])]
    m.append_token_ids("r", 32)
    assert m.allocate_slots("r", 1) == [3]  # crossing the boundary
    assert m.get_block_ids("r") == [1, 2, 3]
    assert m.num_computed_tokens("r") == 33
    assert m.debug_state()["block_keys"][2] == m.block_hashes("r")[1]
    assert m.take_events() == []


def test_reused_block_loses_its_stale_hash(impl: ModuleType) -> None:
    m = impl.BlockManager(3, B)  # two usable blocks
    admit(m, "a", list(range(32)))
    m.free("a")
    assert m.debug_state()["block_keys"][1:] == m.block_hashes("a")
    admit(m, "b", list(range(500, 505)))  # a partial block reuses the head (block 2)
    keys = m.debug_state()["block_keys"]
    assert m.get_block_ids("b") == [2]
    assert keys[2] is None
    assert keys[1] == m.block_hashes("a")[0]


def test_hits_are_touched_before_new_blocks_are_taken(impl: ModuleType) -> None:
    m = impl.BlockManager(5, B)
    admit(m, "r0", list(range(32)))  # blocks 1, 2, cached
    m.free("r0")
    admit(m, "r9", list(range(900, 932)))  # blocks 3, 4
    m.free("r9")
    assert free_queue(m) == [2, 1, 4, 3]  # r0's cached blocks are next to be evicted
    tokens = [*range(32), *range(700, 730)]
    m.add_request("r1", tokens)
    assert m.get_computed_blocks("r1") == ([1, 2], 32)
    new = m.allocate_slots("r1", 30, num_new_computed_tokens=32, new_computed_blocks=[1, 2])
    assert new == [4, 3]
    assert m.get_block_ids("r1") == [1, 2, 4, 3]


def test_caching_disabled(impl: ModuleType) -> None:
    m = impl.BlockManager(4, B, enable_caching=False)
    admit(m, "a", COMMON)
    m.free("a")
    m.add_request("b", COMMON)
    assert m.get_computed_blocks("b") == ([], 0)
    assert m.allocate_slots("b", 48) is not None
    assert all(k is None for k in m.debug_state()["block_keys"])
    assert m.debug_state()["cached"] == {}
    m.add_request("c", [1])
    assert m.allocate_slots("c", 1) is None  # three usable blocks, all taken


def test_failed_allocation_changes_nothing(impl: ModuleType) -> None:
    m = impl.BlockManager(6, B)
    admit(m, "a", COMMON)
    m.free("a")
    before = m.debug_state()
    m.add_request("big", [*COMMON, *range(200)])
    hits, n = m.get_computed_blocks("big")
    assert hits == [1, 2, 3]
    assert m.allocate_slots("big", 200, num_new_computed_tokens=n, new_computed_blocks=hits) is None
    after = m.debug_state()
    del after["block_tables"]["big"]
    del after["handles"]["big"]
    assert after == before
    assert m.num_computed_tokens("big") == 0


def test_reset_prefix_cache(impl: ModuleType) -> None:
    m = impl.BlockManager(10, B, enable_events=True)
    admit(m, "a", COMMON)
    m.take_events()
    assert m.reset_prefix_cache() is False
    assert m.debug_state()["cached"] != {}
    m.free("a")
    order = free_queue(m)
    assert m.reset_prefix_cache() is True
    state = m.debug_state()
    assert state["cached"] == {}
    assert all(k is None for k in state["block_keys"])
    assert state["free_block_ids"] == order
    assert m.take_events() == [AllBlocksCleared()]
    stats = m.make_prefix_cache_stats()
    assert stats is not None
    assert stats.reset is True


def test_stats(impl: ModuleType) -> None:
    m = impl.BlockManager(20, B)
    admit(m, "a", [*COMMON, 1])
    admit(m, "b", [*COMMON, 2])
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 98, 48)
    assert (stats.preempted_requests, stats.reset) == (0, False)
    m.free("b")  # preemption: the request comes back and hits its own blocks
    hits, n = m.get_computed_blocks("b")
    m.allocate_slots("b", 49 - n, num_new_computed_tokens=n, new_computed_blocks=hits)
    m.append_token_ids("b", 5)
    m.allocate_slots("b", 1)  # a decode step records nothing
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.preempted_requests, stats.preempted_hits) == (0, 1, 48)
    assert stats.preempted_queries == 49
    off = impl.BlockManager(20, B, log_stats=False)
    admit(off, "a", COMMON)
    assert off.make_prefix_cache_stats() is None
    assert off.reset_prefix_cache() is False
    assert off.make_prefix_cache_stats() is None


def test_duplicate_keys_are_evicted_one_by_one(impl: ModuleType) -> None:
    m = impl.BlockManager(9, B, enable_events=True)
    admit(m, "a", COMMON)  # blocks 1, 2, 3
    admit(m, "b", COMMON)  # hits 1, 2 (cap), recomputes block 3's content into block 4
    key3 = m.block_hashes("a")[2]
    assert m.get_block_ids("b") == [1, 2, 4]
    assert m.debug_state()["cached"][key3] == [3, 4]
    m.free("a")
    m.free("b")
    m.take_events()
    assert free_queue(m) == [5, 6, 7, 8, 3, 4, 2, 1]
    admit(m, "x", list(range(3000, 3080)))  # five blocks: 5, 6, 7, 8, then 3
    assert m.debug_state()["cached"][key3] == [4]  # the duplicate keeps the key alive
    # vLLM reports each block taken out of the map, duplicates included.
    assert m.take_events()[0] == BlockRemoved([ext(key3)])
    admit(m, "y", list(range(4000, 4010)))  # takes 4: the key's last block
    assert key3 not in m.debug_state()["cached"]
    assert m.take_events() == [BlockRemoved([ext(key3)])]


def test_events_for_reallocation_without_lookup(impl: ModuleType) -> None:
    m = impl.BlockManager(4, B, enable_events=True, events_use_int_block_hashes=False)
    m.add_request("a", COMMON)
    m.allocate_slots("a", 48)
    hashes = m.block_hashes("a")
    stored = m.take_events()
    assert stored == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=COMMON,
            block_size=B,
            extra_keys=[None, None, None],
        )
    ]
    m.free("a")
    m.add_request("b", COMMON)
    m.allocate_slots("b", 48)  # no lookup: takes 3, 2, 1 and evicts their keys first
    events = m.take_events()
    assert events[:3] == [BlockRemoved([h]) for h in reversed(hashes)]
    assert events[3].block_hashes == hashes
    silent = impl.BlockManager(4, B)
    admit(silent, "a", COMMON)
    assert silent.take_events() == []


def test_event_extra_keys_and_lora(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4, enable_events=True)
    m.add_request(
        "a", list(range(12)), lora=("ad", "/p"), cache_salt="s", mm_features=[("img", 2, 3)]
    )
    m.allocate_slots("a", 12)
    (event,) = m.take_events()
    assert event.lora_name == "ad"
    assert event.extra_keys == [("ad", ("img", 2), "s"), ("ad", ("img", -2)), ("ad",)]
    assert event.block_size == 4
    assert event.group_idx == 0
    assert event.medium == "GPU"


def test_lookahead_slots(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4)
    m.add_request("a", [1, 2, 3])
    assert m.allocate_slots("a", 3, num_lookahead_tokens=2) == [1, 2]


def test_usage_excludes_the_null_block(impl: ModuleType) -> None:
    m = impl.BlockManager(5, B)
    assert m.usage == 0.0
    admit(m, "a", list(range(20)))
    assert m.usage == pytest.approx(0.5)
    assert impl.BlockManager(2, B).usage == 0.0


def test_watermark_reserves_blocks_at_admission(impl: ModuleType) -> None:
    m = impl.BlockManager(10, B, watermark=0.2)  # two blocks held back
    admit(m, "a", list(range(16)))  # nothing else runs: no watermark
    assert m.num_free_blocks == 8
    m.add_request("b", list(range(100, 200)))  # 7 blocks needed, 8 free, 2 reserved
    assert m.allocate_slots("b", 100) is None
    m.add_request("c", list(range(300, 390)))  # 6 blocks
    assert m.allocate_slots("c", 90) is not None
    m.append_token_ids("a", list(range(16, 32)))
    assert m.allocate_slots("a", 16) is not None  # a running request ignores the watermark
    assert m.num_free_blocks == 1


def test_max_model_len(impl: ModuleType) -> None:
    m = impl.BlockManager(10, 4, max_model_len=8)
    with pytest.raises(ValueError):
        m.add_request("a", list(range(9)))
    m.add_request("a", list(range(6)))
    m.append_token_ids("a", [6, 7])
    with pytest.raises(ValueError):
        m.append_token_ids("a", 8)
    assert m.allocate_slots("a", 8, num_lookahead_tokens=4) == [1, 2]
    assert m.num_tokens("a") == 8
