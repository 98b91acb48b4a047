"""``kvblocks._core.KVCacheManager``, the Rust half of ``kvblocks.vllm.KVCacheManager``,
through its Python surface, with stand-in requests carrying the fields vLLM's ``Request``
has: vLLM's worked trace, several groups, and bad input that changes nothing. (Runs
without vLLM; tests/vllm_tier compares the engine with vLLM itself.)"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

from kvblocks._core import KVCacheBlockIds, KVCacheGroup, KVCacheManager

WAITING, RUNNING = "waiting", "running"  # stand-ins for vLLM's RequestStatus members


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def request(rid: str, hashes: list[Any], num_tokens: int, computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        num_computed_tokens=computed,
        num_in_flight_tokens=0,
        shared_prefix_boundary=0,
        status=WAITING,
    )


def core(
    num_blocks: int, block_size: int, groups: list[KVCacheGroup] | None = None, **kwargs: Any
) -> KVCacheManager:
    groups = groups or [KVCacheGroup("full", block_size)]
    full_first = sorted(range(len(groups)), key=lambda g: groups[g].kind != "full")
    return KVCacheManager(
        num_blocks,
        groups,
        lookup_sets=[[g] for g in full_first],
        max_model_len=4096,
        waiting_statuses=[WAITING],
        **kwargs,
    )


def admit(
    c: KVCacheManager, rid: str, hashes: list[bytes], num_tokens: int
) -> tuple[list[int], ...]:
    hits, num_hit, _ = c.lookup(hashes, num_tokens - 1)
    new = c.allocate_for_request(
        request(rid, hashes, num_tokens),
        num_tokens - num_hit,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        full_sequence_must_fit=True,
    )
    assert new is not None
    ids: tuple[list[int], ...] = c.get_block_ids(rid)
    return ids


def test_worked_trace() -> None:
    """N = 11 blocks of 16 tokens: two requests share a 48-token prefix (docs/semantics.md
    §3.9: block 0 is the null block, hits are capped at num_tokens - 1, frees go tail first)."""
    c = core(11, 16, enable_events=True)
    shared = [h(1), h(2), h(3)]
    assert admit(c, "r0", shared, 55) == ([1, 2, 3, 4],)
    assert admit(c, "r1", shared, 53) == ([1, 2, 3, 5],)
    assert c.num_free_blocks == 5
    assert c.usage == pytest.approx(0.5)
    assert c.estimate_cached_tokens("r1") == 48
    assert len(c) == 2
    c.free("r0")
    c.free("r1")
    c.free("never-seen")
    assert len(c) == 0
    # A 48-token prompt hits only 2 blocks: the last token must be computed.
    hits, num_hit, _ = c.lookup(shared, 48 - 1)
    assert (hits.get_block_ids(), num_hit) == (([1, 2],), 32)
    assert c.get_blocks("r0") is c.empty_kv_cache_blocks
    events = c.take_events()
    assert events[0] == ("stored", "r0", 0, 0, 3, ())
    assert all(e[1] != "r1" for e in events if e[0] == "stored")
    assert c.reset_prefix_cache()
    assert c.take_events() == [("cleared",)]
    assert c.lookup(shared, 47)[0] is c.empty_kv_cache_blocks


def test_two_groups_share_one_pool() -> None:
    """Full attention and a 4-token sliding window (block 2): each group has its own
    blocks from the one pool, and the window group replaces blocks it no longer reads by
    the null block (0)."""
    groups = [KVCacheGroup("full", 2), KVCacheGroup("sliding_window", 2, sliding_window=4)]
    c = core(20, 2, groups, enable_events=True)
    hashes = [h(i) for i in range(4)]
    assert admit(c, "a", hashes, 8) == ([1, 2, 3, 4], [5, 6, 7, 8])
    running = request("a", hashes, 9, computed=8)
    running.status = RUNNING
    assert c.allocate_for_request(running, 1) is not None
    full, window = c.get_block_ids("a")
    assert full == [1, 2, 3, 4, 9]
    assert window[:2] == [0, 0], "tokens 0..4 are out of every later token's window"
    stored_groups = {e[2] for e in c.take_events() if e[0] == "stored"}
    assert stored_groups == {0, 1}
    c.free("a")
    hits, num_hit, _ = c.lookup(hashes, 8)
    assert num_hit == 8
    assert hits.get_block_ids() == ([1, 2, 3, 4], [0, 0, 7, 8])
    assert hits.get_block_ids(group_ids=[1]) == ([0, 0, 7, 8],)


def test_two_group_worked_example() -> None:
    """docs/semantics.md §6.8, step by step: full attention and an 8-token sliding window
    (blocks of 4, so a window hit needs 2 blocks), vLLM's default retention 0. The expected
    ids were derived by hand from §6 and agree with vLLM 0.33's own KVCacheManager."""
    groups = [KVCacheGroup("full", 4), KVCacheGroup("sliding_window", 4, sliding_window=8)]
    c = core(16, 4, groups, enable_events=True, retention_interval=0)
    prefix = [h(0), h(1), h(2), h(3)]
    # 1. 18 tokens: 5 blocks per group; the window group registers only the 2 blocks under
    #    replay boundary 17 (indices 2, 3), skipping indices 0 and 1.
    assert admit(c, "r0", prefix, 18) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert c.num_free_blocks == 5
    assert c.take_events() == [("stored", "r0", 0, 0, 4, ()), ("stored", "r0", 1, 0, 4, (0, 1))]
    # 2. Free: queue 10 7 6 5 11 12 13 14 15 4 3 2 1 9 8 (seen through steps 3 and 5).
    c.free("r0")
    assert c.num_free_blocks == 15
    # 3. 21 tokens sharing 16: the window hit is found from the right, nulls before it.
    longer = [*prefix, h(40)]
    hits, num_hit, uncached = c.lookup(longer, 20)
    assert (hits.get_block_ids(), num_hit, uncached) == (([1, 2, 3, 4], [0, 0, 8, 9]), 16, 0)
    assert admit(c, "r1", longer, 21) == ([1, 2, 3, 4, 10, 7], [0, 0, 8, 9, 6, 5])
    assert c.num_free_blocks == 5
    assert c.take_events() == [("stored", "r1", 0, 4, 5, ()), ("stored", "r1", 1, 4, 5, ())]
    assert c.estimate_cached_tokens("r1") == 20
    # 4. Decoding token 22 frees block 8 (out of the window), back to the first null.
    running = request("r1", longer, 22, computed=21)
    running.num_prompt_tokens, running.status = 21, RUNNING
    new = c.allocate_for_request(running, 1)
    assert new is not None
    assert new.get_block_ids() == ([], [])
    assert c.get_block_ids("r1") == ([1, 2, 3, 4, 10, 7], [0, 0, 0, 9, 6, 5])
    assert c.num_free_blocks == 6
    assert c.take_events() == []
    # 5. 12 unrelated tokens take 11-13 and 14, 15, 8, evicting 8's entry (h2, group 1).
    assert admit(c, "x", [h(50), h(51), h(52)], 12) == ([11, 12, 13], [14, 15, 8])
    assert c.take_events() == [
        ("removed", h(2), 1),
        ("stored", "x", 0, 0, 3, ()),
        ("stored", "x", 1, 0, 3, (2,)),
    ]


def test_watermark_applies_to_waiting_requests_only() -> None:
    c = core(6, 4, watermark_blocks=3)
    waiting = request("a", [], 12)
    assert c.allocate_for_request(waiting, 12) is None  # 3 blocks + 3 watermark > 5 free
    assert c.allocate_for_request(waiting, 12, has_scheduled_reqs=False) is not None
    running = request("b", [], 8)
    running.status = RUNNING
    assert c.allocate_for_request(running, 8) is not None  # 2 blocks, no watermark


def test_bad_input_changes_nothing() -> None:
    c = core(8, 4)
    admit(c, "a", [h(1)], 6)
    state = (c.num_free_blocks, c.get_block_ids("a"), c.lookup([h(1)], 5)[1])

    def allocate(hashes: Any, num_new: int = 8, hits: Any = None) -> Any:
        return c.allocate_for_request(request("b", hashes, 8), num_new, new_computed_blocks=hits)

    with pytest.raises(TypeError):
        allocate((h(1), h(2)))
    with pytest.raises(ValueError, match="not bytes"):
        allocate([h(1), "x"])
    with pytest.raises(ValueError, match="5 bytes"):
        allocate([h(1), b"short"])
    with pytest.raises(ValueError, match="greater than 0"):
        allocate([], num_new=0)
    # out of range, not cached, two groups, the null block in a full-attention group
    for hits in ([[99]], [[3]], [[1], [1]], [[0]], [[0, 1]]):
        with pytest.raises(ValueError):
            allocate([h(1)], hits=KVCacheBlockIds(hits))
    with pytest.raises(ValueError, match="only 3 tokens"):  # a hit longer than the request
        c.allocate_for_request(
            request("b", [h(1)], 3), 1, 4, new_computed_blocks=KVCacheBlockIds([[1]])
        )
    with pytest.raises(TypeError, match="get_computed_blocks"):
        allocate([h(1)], hits=[1])
    with pytest.raises(ValueError, match="first allocation"):
        c.allocate_for_request(
            request("a", [h(1)], 8, computed=6), 2, new_computed_blocks=KVCacheBlockIds([[1]])
        )
    with pytest.raises(ValueError, match="encoder"):
        c.allocate_for_request(request("b", [], 8), 4, num_encoder_tokens=4)
    with pytest.raises(ValueError, match="group 1 out of range"):
        c.allocate_for_request(request("b", [], 8), 4, skip_zeroing_group_ids=(1,))
    with pytest.raises(ValueError, match="out of range"):
        c.free_blocks([99])
    with pytest.raises(ValueError):
        c.cache_blocks(request("a", [h(1), b"\x00" * 7], 8), 8)
    assert (c.num_free_blocks, c.get_block_ids("a"), c.lookup([h(1)], 5)[1]) == state
    assert c.get_block_ids("b") == ([],)
    with pytest.raises(ValueError):
        core(0, 4)
    with pytest.raises(ValueError):
        core(8, 0)
    with pytest.raises(ValueError, match="same block size"):
        core(8, 4, [KVCacheGroup("full", 4), KVCacheGroup("full", 8)])
    with pytest.raises(ValueError, match="expected"):
        KVCacheGroup("sliding_window", 4)  # no window
    with pytest.raises(ValueError, match="expected"):
        KVCacheGroup("full", 4, num_speculative_blocks=1)  # draft-state blocks are Mamba's
    with pytest.raises(ValueError, match="at most one lookahead token"):
        core(8, 4, [KVCacheGroup("full", 4), KVCacheGroup("mamba", 4)], num_hash_lookahead_tokens=2)
    with pytest.raises(ValueError, match="expected"):
        KVCacheGroup("full", 4, prefill_checkpoint_alignment=4)  # checkpoints are Mamba's
    with pytest.raises(ValueError, match="checkpoint alignment"):
        core(8, 4, [KVCacheGroup("mamba", 4, prefill_checkpoint_alignment=0)])


def test_mamba_groups_and_zeroing_without_prefix_caching() -> None:
    """A full-attention group of 4-token blocks and a Mamba group of 64-token blocks with one
    draft-state block: 10 tokens take ceil(10 / 4) = 3 and ceil((10 + 64) / 64) = 2 blocks;
    only the attention blocks are recorded for zeroing, once."""
    groups = [KVCacheGroup("full", 4), KVCacheGroup("mamba", 64, num_speculative_blocks=1)]
    assert groups[1].kind == "mamba"
    c = core(16, 4, groups, enable_caching=False, needs_kv_cache_zeroing=True)
    blocks = c.allocate_for_request(request("a", [], 10), 10)
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3], [4, 5])
    assert c.take_new_block_ids() == [1, 2, 3]
    assert c.take_new_block_ids() == []
    unzeroed = core(16, 4, groups, enable_caching=False)
    unzeroed.allocate_for_request(request("a", [], 10), 10)
    assert unzeroed.take_new_block_ids() == []


def test_mamba_prefix_caching_defers_a_state_cached_in_this_step() -> None:
    """Full attention and a Mamba group of 4-token blocks with prefix caching (vLLM's align
    mode): 8 of a 9-token prompt leave the Mamba state after 8 tokens in column 1, the column
    before it null, and cache it. A request with the same prompt hits it, but waits while the
    step that cached it lasts (``new_step_starts`` ends it)."""
    c = core(16, 4, [KVCacheGroup("full", 4), KVCacheGroup("mamba", 4)])
    hashes = [h(1), h(2)]
    assert c.allocate_for_request(request("a", hashes, 9), 8) is not None
    assert c.get_block_ids("a") == ([1, 2], [0, 3])
    hits, num_hit, _ = c.lookup(hashes, 8)
    assert (hits.get_block_ids(), num_hit) == (([1, 2], [0, 3]), 8)
    b = request("b", hashes, 9)
    kwargs = {"num_new_computed_tokens": 8, "new_computed_blocks": hits}
    assert c.allocate_for_request(b, 1, **kwargs) is None
    assert c.get_block_ids("b") == ([], [])
    c.new_step_starts()
    assert c.allocate_for_request(b, 1, **kwargs) is not None
    assert c.get_block_ids("b") == ([1, 2, 4], [0, 3, 5])


def test_unhashed_blocks_as_kv_connectors_read_them() -> None:
    """What NIXL reads of a request's table (``get_blocks(request_id, True)``): per group,
    after its leading null blocks, the blocks neither null nor registered; a single group's
    unregistered blocks (vLLM keeps null ones there). A result without keys refuses."""
    c = core(16, 4, [KVCacheGroup("full", 4), KVCacheGroup("sliding_window", 4, sliding_window=4)])
    admit(c, "a", [h(1), h(2)], 10)  # two full blocks registered, the third not
    c.free("a")
    hits, num_hit, _ = c.lookup([h(1), h(2), h(3)], 12)
    assert num_hit == 8
    b = request("b", [h(1), h(2), h(3)], 14)
    c.allocate_for_request(b, 2, num_new_computed_tokens=8, new_computed_blocks=hits)
    full, window = c.get_block_ids("b")
    assert window[0] == 0  # out of the window: null
    blocks = c.get_blocks("b", True)
    hit_full, hit_window = hits.get_block_ids()
    assert blocks.get_unhashed_block_ids_all_groups() == [
        [blk for blk in full if blk not in hit_full],
        [blk for blk in window if blk and blk not in hit_window],
    ]
    with pytest.raises(ValueError, match="one KV-cache group"):
        blocks.get_unhashed_block_ids()
    with pytest.raises(AttributeError, match="block ids only"):
        c.get_blocks("b").get_unhashed_block_ids_all_groups()
    assert KVCacheBlockIds([[], []]).get_unhashed_block_ids_all_groups() == [[], []]
    one = core(8, 4)
    admit(one, "x", [h(1)], 6)
    assert one.get_blocks("x", True).get_unhashed_block_ids() == one.get_block_ids("x")[0][1:]


def test_request_ids_are_the_requests_holding_blocks() -> None:
    """``request_ids`` (what ``req_to_blocks`` views list): every request ``get_blocks``
    answers for, sorted, and none once freed or popped for a deferred free."""
    c = core(16, 4)
    assert c.request_ids() == []
    assert len(c) == 0
    for rid, n in (("b", 6), ("a", 9), ("c", 3)):
        admit(c, rid, [h(n)], n)
    assert c.request_ids() == ["a", "b", "c"]
    assert len(c) == 3
    assert all(any(c.get_block_ids(rid)) for rid in c.request_ids())
    c.free("b")
    c.pop_blocks_for_free("c")
    assert c.request_ids() == ["a"]
    assert not any(c.get_block_ids("b"))


def test_evict_blocks_and_record_blocks_for_zeroing() -> None:
    c = core(16, 4, needs_kv_cache_zeroing=True)
    ids = admit(c, "a", [h(1), h(2)], 10)[0]
    c.take_new_block_ids()
    with pytest.raises(ValueError, match="out of range"):
        c.evict_blocks({ids[0], 99})
    assert c.lookup([h(1), h(2)], 9)[1] == 8  # nothing changed
    c.evict_blocks({ids[1]})
    assert c.lookup([h(1), h(2)], 9)[1] == 4  # the second block's entry is gone
    with pytest.raises(ValueError, match="block boundary"):
        c.record_blocks_for_zeroing("a", 2)
    c.record_blocks_for_zeroing("a", 4)
    assert c.take_new_block_ids() == ids[1:]


def test_refusal_when_full_changes_nothing() -> None:
    c = core(4, 4)
    admit(c, "a", [], 9)  # 3 blocks: the pool is full
    assert c.allocate_for_request(request("b", [], 4), 4) is None
    assert c.get_block_ids("b") == ([],)
    assert c.num_free_blocks == 0


def test_block_ids_results() -> None:
    ids = KVCacheBlockIds([[3, 1, 2], []])
    assert ids.get_block_ids() == ([3, 1, 2], [])
    assert ids.get_block_ids(allow_none=True) == ([3, 1, 2], [])
    assert ids.get_block_ids(allow_none=True, group_ids=[1]) is None
    assert ids.get_block_ids(group_ids=[1, 0]) == ([], [3, 1, 2])
    with pytest.raises(ValueError, match="out of range"):
        ids.get_block_ids(group_ids=[2])
    assert KVCacheBlockIds([[]]).get_block_ids(allow_none=True) is None
    assert KVCacheBlockIds([[]]).get_block_ids() == ([],)
    assert len(ids) == 2
    fresh = ids.get_block_ids()
    assert fresh is not None
    fresh[0].append(9)  # a fresh list each call, as vLLM's
    assert ids.get_block_ids()[0] == [3, 1, 2]


def test_sizes_by_keyword_or_by_position() -> None:
    groups = [KVCacheGroup(kind="full", block_size=4)]
    for c in (
        KVCacheManager(num_blocks=12, groups=groups, lookup_sets=[[0]], max_model_len=8),
        KVCacheManager(12, groups, lookup_sets=[[0]], max_model_len=8),
    ):
        assert (c.num_blocks, c.num_groups, c.num_free_blocks) == (12, 1, 11)


def test_block_views_for_kv_connectors() -> None:
    """``get_blocks(id, True).blocks``: per group, each block's id, whether it is the null
    block, and its key then (vLLM's ``block_hash``: the hash and the group id as 4 bytes,
    big-endian; ``None`` when unregistered). Without keys only an empty result has them."""
    groups = [KVCacheGroup("full", 4), KVCacheGroup("sliding_window", 4, sliding_window=4)]
    c = core(16, 4, groups)
    admit(c, "a", [h(1), h(2)], 10)  # 3 blocks per group, 2 full ones registered
    table = c.get_block_ids("a")
    views = c.get_blocks("a", True).blocks
    assert [[v.block_id for v in group] for group in views] == [list(ids) for ids in table]
    assert [v.block_hash for v in views[0]] == [h(1) + b"\0\0\0\0", h(2) + b"\0\0\0\0", None]
    # A 4-token window needs one block for a hit: every full block is registered (retention
    # None); nothing is freed before the next allocation.
    window = views[1]
    assert [v.is_null for v in window] == [False, False, False]
    assert [v.block_hash for v in window] == [h(1) + b"\0\0\0\1", h(2) + b"\0\0\0\1", None]
    c.allocate_for_request(request("a", [h(1), h(2)], 11, computed=10), 1)
    # 10 computed: the window skips 10 + 1 - 4 = 7 tokens, one whole block.
    assert [v.is_null for v in c.get_blocks("a", True).blocks[1]] == [True, False, False]
    with pytest.raises(AttributeError, match="block ids only"):
        c.get_blocks("a").blocks  # noqa: B018
    assert c.empty_kv_cache_blocks.blocks == ((), ())
    assert c.get_blocks("unknown", True).blocks == ((), ())


def test_mamba_boundary_states_are_offered_by_block_id() -> None:
    """``take_boundary_state_offloads`` (what vLLM's CPU offloading stores Mamba states
    from): each Mamba state a pass registers as a full block, ``(group, block, tokens it
    follows)``, each request's in group order then column order; drained by the call, and a
    request freed (or popped for a deferred free) before it is drained is left out."""
    groups = [KVCacheGroup("full", 4), KVCacheGroup("mamba", 4), KVCacheGroup("mamba", 4)]
    c = core(32, 4, groups)
    assert c.take_boundary_state_offloads() == {}
    a = request("a", [h(1), h(2), h(3), h(4)], 17)
    assert c.allocate_for_request(a, 8) is not None  # states after 4 and 8 tokens
    _, m1, m2 = c.get_block_ids("a")
    assert (m1[0], m2[0]) == (0, 0)  # the state after 4 tokens is overwritten: null
    offers = c.take_boundary_state_offloads()
    assert offers == {"a": [(1, m1[1], 8), (2, m2[1], 8)]}
    assert c.take_boundary_state_offloads() == {}
    # Two passes of one request before a drain: group by group, then in pass order.
    a.num_computed_tokens = 8
    assert c.allocate_for_request(a, 4) is not None  # the state after 12 tokens
    a.num_computed_tokens = 12
    b = request("b", [h(7), h(8)], 9)
    assert c.allocate_for_request(b, 8) is not None
    assert c.allocate_for_request(a, 4) is not None  # the state after 16 tokens
    _, m1, m2 = c.get_block_ids("a")
    _, b1, b2 = c.get_block_ids("b")
    assert c.take_boundary_state_offloads() == {
        "a": [(1, m1[2], 12), (1, m1[3], 16), (2, m2[2], 12), (2, m2[3], 16)],
        "b": [(1, b1[1], 8), (2, b2[1], 8)],
    }
    # Undrained offers of a freed request go with it; the others stay.
    c.new_step_starts()
    d = request("d", [h(5), h(6)], 9)
    assert c.allocate_for_request(d, 8) is not None
    e = request("e", [h(9)], 5)
    assert c.allocate_for_request(e, 4) is not None
    c.free("d")
    _, e1, e2 = c.get_block_ids("e")
    assert c.take_boundary_state_offloads() == {"e": [(1, e1[0], 4), (2, e2[0], 4)]}
    assert c.allocate_for_request(request("f", [h(4)], 5), 4) is not None
    c.pop_blocks_for_free("f")
    assert c.take_boundary_state_offloads() == {}
    # Without prefix caching nothing is registered, so nothing is offered.
    off = core(32, 4, groups, enable_caching=False)
    assert off.allocate_for_request(request("a", [h(1), h(2)], 9), 8) is not None
    assert off.take_boundary_state_offloads() == {}


def test_per_group_lookup_lets_groups_disagree() -> None:
    """``lookup_per_group`` (vLLM's per-group search for NIXL): full attention and a Mamba
    group each report their own longest hit, where the joint ``lookup`` takes the shorter.
    A 13-token request computed in chunks of 8 and 5 tokens leaves three full blocks but
    Mamba states only after 8 tokens (the second chunk's running state ends at 13). A group
    with nothing cached reports 0; without prefix caching every group does."""
    c = core(32, 4, [KVCacheGroup("full", 4), KVCacheGroup("mamba", 4)])
    hashes = [h(1), h(2), h(3)]
    assert c.allocate_for_request(request("a", hashes, 13), 8) is not None
    a = request("a", hashes, 13, computed=8)
    assert c.allocate_for_request(a, 5) is not None
    full, mamba = c.get_block_ids("a")
    c.free("a")
    c.new_step_starts()
    blocks, lengths = c.lookup_per_group(hashes, 12)
    assert (blocks.get_block_ids(), lengths) == ((full[:3], [0, mamba[1]]), [12, 8])
    hits, num_hit, _ = c.lookup(hashes, 12)
    assert (hits.get_block_ids(), num_hit) == ((full[:2], [0, mamba[1]]), 8)
    assert c.lookup_per_group(hashes, 7)[1] == [4, 0]
    assert c.lookup_per_group([h(99)], 12)[1] == [0, 0]
    off = core(32, 4, [KVCacheGroup("full", 4), KVCacheGroup("mamba", 4)], enable_caching=False)
    assert off.lookup_per_group(hashes, 12)[1] == [0, 0]
