//! Worked examples of the coordinator's rules (docs/semantics.md §2, §3 and §5), one group and
//! several.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)] // test code: a panic is a failure

use super::*;
use crate::hashing::BlockHash;
use crate::pool::NULL_BLOCK;

fn h(i: u8) -> BlockHash {
    BlockHash::Sha256([i; 32])
}

fn hashes(range: std::ops::Range<u8>) -> Vec<BlockHash> {
    range.map(h).collect()
}

fn full(block_size: usize) -> GroupSpec {
    GroupSpec::full(block_size)
}

fn window(block_size: usize, window: usize) -> GroupSpec {
    GroupSpec {
        kind: AttentionKind::SlidingWindow { window, extra_retained: 0 },
        block_size,
        max_admission_blocks: None,
        is_eagle_group: false,
    }
}

fn mamba(block_size: usize, speculative_blocks: usize) -> GroupSpec {
    let kind = AttentionKind::Mamba { speculative_blocks, checkpoint_alignment: None };
    GroupSpec { kind, ..full(block_size) }
}

fn chunked(block_size: usize, chunk: usize) -> GroupSpec {
    GroupSpec { kind: AttentionKind::ChunkedLocal { chunk }, ..full(block_size) }
}

fn manager(num_blocks: u32, groups: Vec<GroupSpec>) -> KvCacheManager {
    let lookup_sets = {
        // full attention first, one set per group (no two specs are equal here)
        let mut ids: Vec<usize> = (0..groups.len()).collect();
        ids.sort_by_key(|&g| !groups[g].kind.is_full());
        ids.into_iter().map(|g| vec![g]).collect()
    };
    KvCacheManager::new(CoordinatorConfig {
        groups,
        lookup_sets,
        enable_events: true,
        ..CoordinatorConfig::single_group(num_blocks, 4, 1 << 20)
    })
    .unwrap()
}

fn state(num_tokens: usize) -> RequestState {
    RequestState {
        num_tokens,
        num_prompt_tokens: num_tokens,
        is_waiting: true,
        ..Default::default()
    }
}

/// A new request's admission: lookup, then one allocation of everything not hit.
fn admit(m: &mut KvCacheManager, id: &str, hashes: &[BlockHash], num_tokens: usize) -> CacheHit {
    let hit = m.lookup(hashes, num_tokens - 1).unwrap();
    let args = AllocateArgs {
        num_new_tokens: num_tokens - hit.num_tokens,
        num_new_computed_tokens: hit.num_tokens,
        full_sequence_must_fit: true,
        ..AllocateArgs::default()
    };
    let hits: Vec<&[u32]> = hit.blocks.iter().map(Vec::as_slice).collect();
    m.allocate_slots(id, &state(num_tokens), &args, &hits, hashes).unwrap().unwrap();
    hit
}

fn table(m: &KvCacheManager, id: &str, group: usize) -> Vec<u32> {
    m.block_ids(id).map(|r| r.groups[group].blocks.clone()).unwrap_or_default()
}

fn free_queue(m: &KvCacheManager) -> Vec<u32> {
    m.pool().free_block_ids().collect()
}

#[test]
fn worked_trace_of_vllm_semantics() {
    // N = 11, B = 16: R0 = 48 shared tokens + 7, R1 = the same 48 + 5.
    let mut m = KvCacheManager::new(CoordinatorConfig {
        enable_events: true,
        ..CoordinatorConfig::single_group(11, 16, 1 << 20)
    })
    .unwrap();
    let shared = hashes(1..4);
    admit(&mut m, "r0", &shared, 55);
    assert_eq!(table(&m, "r0", 0), [1, 2, 3, 4]);
    admit(&mut m, "r1", &shared, 53);
    assert_eq!(table(&m, "r1", 0), [1, 2, 3, 5]);
    assert_eq!(m.num_free_blocks(), 5);
    assert_eq!(m.estimate_cached_tokens("r1"), 48);
    m.free("r0");
    m.free("r1");
    assert_eq!(free_queue(&m), [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
    // 160 fresh tokens take every free block and evict the three cached ones.
    admit(&mut m, "r2", &hashes(10..19), 160);
    assert!(free_queue(&m).is_empty());
    let removed: Vec<_> =
        m.take_events().into_iter().filter(|e| matches!(e, ManagerEvent::Removed { .. })).collect();
    let expected = [3, 2, 1].map(|i| ManagerEvent::Removed { hash: h(i), group: 0 });
    assert_eq!(removed, expected, "evicted in queue order, tail of the chain first");
}

#[test]
fn refusals_change_nothing() {
    let mut m = manager(5, vec![full(4)]);
    admit(&mut m, "a", &[h(1), h(2)], 9); // 3 blocks, 1 free
    let before = (free_queue(&m), table(&m, "a", 0));
    let args = AllocateArgs { num_new_tokens: 9, ..AllocateArgs::default() };
    let none: &[&[u32]] = &[&[]];
    assert_eq!(m.allocate_slots("b", &state(9), &args, none, &[][..]).unwrap(), None);
    let zero = AllocateArgs::default();
    assert!(m.allocate_slots("b", &state(9), &zero, none, &[][..]).is_err());
    for bad in [[99], [3]] {
        // a block out of range; a block not cached
        assert!(m.allocate_slots("b", &state(9), &args, &[&bad], &[][..]).is_err());
    }
    assert!(m.allocate_slots("a", &state(9), &args, &[&[1]], &[][..]).is_err(), "not first");
    let two: &[&[u32]] = &[&[1], &[]];
    assert!(m.allocate_slots("b", &state(9), &args, two, &[][..]).is_err(), "two groups");
    assert_eq!((free_queue(&m), table(&m, "a", 0)), before);
    assert!(m.block_ids("b").is_none());
    m.free("never-seen"); // vLLM frees requests that never got blocks: a no-op
    assert!(m.pop_blocks_for_free("never-seen").is_empty());
    assert_eq!((free_queue(&m), table(&m, "a", 0)), before);
}

#[test]
fn watermark_applies_to_waiting_requests_while_others_are_scheduled() {
    let mut m = KvCacheManager::new(CoordinatorConfig {
        watermark_blocks: 3,
        ..CoordinatorConfig::single_group(6, 4, 1 << 20)
    })
    .unwrap();
    let none: &[&[u32]] = &[&[]];
    let mut args =
        AllocateArgs { num_new_tokens: 12, has_scheduled_reqs: true, ..Default::default() };
    assert_eq!(m.allocate_slots("a", &state(12), &args, none, &[][..]).unwrap(), None); // 3+3 > 5
    let running = RequestState { is_waiting: false, ..state(12) };
    args.reserved_blocks = 3;
    assert_eq!(m.allocate_slots("a", &running, &args, none, &[][..]).unwrap(), None);
    args.reserved_blocks = 2;
    let new = m.allocate_slots("a", &running, &args, none, &[][..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3]]));
    // Nothing scheduled yet: no watermark for a waiting request either.
    let mut m = KvCacheManager::new(CoordinatorConfig {
        watermark_blocks: 3,
        ..CoordinatorConfig::single_group(6, 4, 1 << 20)
    })
    .unwrap();
    args = AllocateArgs { num_new_tokens: 12, has_scheduled_reqs: false, ..Default::default() };
    assert!(m.allocate_slots("a", &state(12), &args, none, &[][..]).unwrap().is_some());
}

#[test]
fn caching_follows_the_hashes_the_caller_has() {
    let mut m = manager(8, vec![full(2)]);
    let args = AllocateArgs { num_new_tokens: 6, ..AllocateArgs::default() };
    // Only one hash exists yet: only one block is registered.
    let none: &[&[u32]] = &[&[]];
    m.allocate_slots("a", &state(6), &args, none, &[h(1)][..]).unwrap().unwrap();
    assert_eq!(m.lookup(&[h(1), h(2)][..], 9).unwrap().blocks, [vec![1]]);
    // Due only where a block with a hash is full and not registered yet.
    assert!(!m.cache_blocks_due("a", 6, 1));
    assert!(!m.cache_blocks_due("a", 3, 3));
    assert!(m.cache_blocks_due("a", 4, 3));
    assert!(!m.cache_blocks_due("unknown", 6, 3));
    m.cache_blocks("a", &state(6), 6, &[h(1), h(2), h(3)][..]).unwrap();
    assert_eq!(m.lookup(&hashes(1..4)[..], 9).unwrap().blocks, [vec![1, 2, 3]]);
    assert!(!m.cache_blocks_due("a", 7, 3));
    assert!(m.cache_blocks_due("a", 8, 4));
    assert_eq!(m.lookup(&hashes(1..4)[..], 5).unwrap().num_tokens, 4);
    let stored: Vec<_> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            ManagerEvent::Stored { first, end, .. } => Some((first, end)),
            _ => None,
        })
        .collect();
    assert_eq!(stored, [(0, 1), (1, 3)]);
}

#[test]
fn reset_needs_every_block_back() {
    let mut m = manager(4, vec![full(2)]);
    admit(&mut m, "a", &[h(1)], 3);
    assert!(!m.reset_prefix_cache());
    m.free("a");
    m.take_events();
    assert!(m.reset_prefix_cache());
    assert_eq!(m.take_events(), [ManagerEvent::AllBlocksCleared]);
    assert!(m.lookup(&[h(1)][..], 1).unwrap().is_empty());
}

#[test]
fn sliding_window_frees_blocks_that_leave_the_window() {
    // Window 8, block 4: once 13 tokens are computed, tokens 0..6 are outside every later
    // token's window: block 0 (tokens 0..4) is freed and becomes the null block.
    let mut m = manager(10, vec![window(4, 8)]);
    let all = hashes(1..5);
    admit(&mut m, "a", &all, 13);
    assert_eq!(table(&m, "a", 0), [1, 2, 3, 4]);
    let running = RequestState { num_computed_tokens: 13, is_waiting: false, ..state(14) };
    let one = AllocateArgs { num_new_tokens: 1, ..AllocateArgs::default() };
    m.allocate_slots("a", &running, &one, &[&[]], &all[..]).unwrap().unwrap();
    assert_eq!(table(&m, "a", 0), [0, 2, 3, 4]);
    assert_eq!(free_queue(&m)[..2], [5, 6], "the freed block is cached: it goes to the tail");
    assert_eq!(*free_queue(&m).last().unwrap(), 1);
}

#[test]
fn sliding_window_hits_need_only_the_window_and_search_from_the_right() {
    let mut m = manager(12, vec![window(4, 8)]);
    let all = hashes(1..5);
    admit(&mut m, "a", &all, 17); // blocks 1..=5, the first four cached
    m.free("a");
    // Fresh blocks go first; then the cached ones, head of the chain first: a request of 28
    // tokens evicts block 1 (hash 1) only. The window before token 16 needs just the two
    // blocks holding tokens 8..16, so the hit survives the loss of its head.
    assert_eq!(free_queue(&m), [5, 6, 7, 8, 9, 10, 11, 4, 3, 2, 1]);
    admit(&mut m, "fill", &hashes(20..27), 28);
    let hit = m.lookup(&all[..], 16).unwrap();
    assert_eq!(hit.num_tokens, 16);
    assert_eq!(hit.blocks, [vec![0, 0, 3, 4]], "blocks before the window are null");
}

#[test]
fn chunked_local_hits_start_at_the_last_chunk() {
    // Chunk 8, block 4. A 13-token prompt on an empty cache: tokens 0..8 are a finished
    // chunk no later token reads, so they count as computed with null blocks.
    let mut m = manager(12, vec![chunked(4, 8)]);
    let all = hashes(1..5);
    let hit = admit(&mut m, "a", &all, 13);
    assert_eq!((hit.blocks, hit.num_tokens), (vec![vec![0, 0]], 8));
    assert_eq!(table(&m, "a", 0), [0, 0, 1, 2]);
    m.free("a");
    // At 15 tokens, block 2 (tokens 8..12) is looked up and cached now.
    let hit = m.lookup(&all[..], 15).unwrap();
    assert_eq!((hit.blocks, hit.num_tokens), (vec![vec![0, 0, 1]], 12));
    // At exactly 16, every block is in a finished chunk.
    let hit = m.lookup(&all[..], 16).unwrap();
    assert_eq!((hit.blocks, hit.num_tokens), (vec![vec![0, 0, 0, 0]], 16));
}

#[test]
fn hybrid_hits_are_the_longest_prefix_every_group_serves() {
    // Full attention (group 0) and a window of 8 (group 1), block 4.
    let mut m = manager(30, vec![full(4), window(4, 8)]);
    let all = hashes(1..6);
    admit(&mut m, "a", &all, 21); // 6 blocks each, the 5 full ones cached
    assert_eq!(table(&m, "a", 0).len(), 6);
    m.free("a");
    let hit = m.lookup(&all[..], 20).unwrap();
    assert_eq!(hit.num_tokens, 20);
    assert_eq!(hit.blocks[0].len(), 5);
    assert_eq!(hit.blocks[1][..3], [0, 0, 0], "the window group needs only its last blocks");
    // A shorter request: both groups serve its 3 full blocks (12 of its 13 tokens); the
    // window group needs only the 2 blocks under the last hit token.
    let b = admit(&mut m, "b", &all[..3], 13);
    assert_eq!(b.num_tokens, 12);
    assert_eq!(b.blocks[0], table(&m, "b", 0)[..3]);
    assert_eq!(b.blocks[1][0], NULL_BLOCK);
    assert_eq!(b.blocks[1][1..], table(&m, "b", 1)[1..3]);
    assert!(b.blocks[1][1..].iter().all(|&block| block != NULL_BLOCK));
}

#[test]
fn eagle_drops_the_last_matched_block() {
    let config = |use_eagle| CoordinatorConfig {
        use_eagle,
        ..CoordinatorConfig::single_group(10, 4, 1 << 20)
    };
    for (use_eagle, expected) in [(false, 12), (true, 8)] {
        let mut m = KvCacheManager::new(config(use_eagle)).unwrap();
        let all = hashes(1..5);
        admit(&mut m, "a", &all, 17);
        m.free("a");
        assert_eq!(m.lookup(&all[..], 12).unwrap().num_tokens, expected);
    }
}

#[test]
fn sparse_retention_registers_only_the_windows_a_replay_can_use() {
    // Window 8 at block 4: a hit needs 2 blocks under its end. Retention 0: only the tail
    // before the replay boundary (prompt - 1 = 23, aligned down to 20: blocks 3 and 4) is
    // registered.
    let groups = vec![window(4, 8)];
    let mut m = KvCacheManager::new(CoordinatorConfig {
        groups,
        enable_events: true,
        retention_interval: Some(0),
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    })
    .unwrap();
    let all = hashes(1..7);
    admit(&mut m, "a", &all, 24);
    let events = m.take_events();
    let skipped = events.iter().find_map(|e| match e {
        ManagerEvent::Stored { skipped, first: 0, end: 6, .. } => Some(skipped.clone()),
        _ => None,
    });
    assert_eq!(skipped, Some(vec![0, 1, 2, 5]));
    m.free("a");
    assert_eq!(m.lookup(&all[..], 23).unwrap().num_tokens, 20);
    assert_eq!(m.lookup(&all[..], 15).unwrap().num_tokens, 0, "no window kept at 12..16");
}

#[test]
fn a_failed_allocation_still_frees_blocks_out_of_the_window() {
    let mut m = manager(5, vec![window(4, 4)]);
    let all = hashes(1..4);
    admit(&mut m, "a", &all, 12); // 3 blocks, 1 free
    let running = RequestState { num_computed_tokens: 12, is_waiting: false, ..state(30) };
    let big = AllocateArgs { num_new_tokens: 18, ..AllocateArgs::default() };
    let before = m.num_free_blocks();
    assert_eq!(m.allocate_slots("a", &running, &big, &[&[]], &all[..]).unwrap(), None);
    assert_eq!(table(&m, "a", 0), [0, 0, 3]);
    assert_eq!(m.num_free_blocks(), before + 2);
}

#[test]
fn more_reserved_blocks_than_free_refuse_even_an_allocation_that_needs_none() {
    let mut m = manager(4, vec![full(4)]);
    admit(&mut m, "a", &[], 3); // one block, slots for 4 tokens
    let running = RequestState { num_computed_tokens: 3, is_waiting: false, ..state(4) };
    let one = AllocateArgs { num_new_tokens: 1, reserved_blocks: 10, ..AllocateArgs::default() };
    let none: &[&[u32]] = &[&[]];
    assert_eq!(m.allocate_slots("a", &running, &one, none, &[][..]).unwrap(), None);
    let one = AllocateArgs { reserved_blocks: 2, ..one };
    assert_eq!(m.allocate_slots("a", &running, &one, none, &[][..]).unwrap(), Some(vec![vec![]]));
}

#[test]
fn a_negative_reservation_leaves_more_room_as_vllms_does() {
    // vLLM 0.34 sums the blocks its parked async loads still need, counts that may be
    // negative, and admits where `needed + watermark <= free - reserved`. 5 free blocks, a
    // watermark of 3, a waiting request needing 3: refused without a reservation (3 + 3 > 5),
    // admitted with -1 (3 + 3 <= 5 + 1). kvblocks still never takes more than are free.
    let config =
        CoordinatorConfig { watermark_blocks: 3, ..CoordinatorConfig::single_group(6, 4, 1 << 20) };
    let none: &[&[u32]] = &[&[]];
    let args = |reserved_blocks: i64| AllocateArgs {
        num_new_tokens: 12,
        has_scheduled_reqs: true,
        reserved_blocks,
        ..Default::default()
    };
    let mut m = KvCacheManager::new(config.clone()).unwrap();
    assert_eq!(m.allocate_slots("a", &state(12), &args(0), none, &[][..]).unwrap(), None);
    let new = m.allocate_slots("a", &state(12), &args(-1), none, &[][..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3]]));
    let mut m = KvCacheManager::new(config).unwrap();
    let six = AllocateArgs { num_new_tokens: 24, ..args(-100) };
    assert_eq!(m.allocate_slots("a", &state(24), &six, none, &[][..]).unwrap(), None);
}

#[test]
fn hits_must_have_a_lookups_shape() {
    // Full attention (group 0) and a window of 8 (group 1), block 4: five blocks cached.
    let mut m = manager(30, vec![full(4), window(4, 8)]);
    let all = hashes(1..6);
    admit(&mut m, "a", &all, 21);
    m.free("a");
    let hit = m.lookup(&all[..], 20).unwrap();
    let (f, w) = (hit.blocks[0].clone(), hit.blocks[1].clone());
    assert_eq!(w[..3], [0, 0, 0]);
    let args =
        AllocateArgs { num_new_tokens: 1, num_new_computed_tokens: 20, ..AllocateArgs::default() };
    let before = free_queue(&m);
    let mut null_in_full = f.clone();
    null_in_full[0] = 0;
    let mut interior_null = w.clone();
    interior_null[4] = 0;
    let bad: [[&[u32]; 2]; 2] = [[&null_in_full, &w], [&f, &interior_null]];
    for hits in &bad {
        assert!(m.allocate_slots("b", &state(21), &args, hits, &all[..]).is_err());
    }
    // More computed tokens than the request has.
    assert!(m.allocate_slots("b", &state(19), &args, &[&f, &w], &all[..]).is_err());
    assert_eq!(free_queue(&m), before, "a refused adoption changes nothing");
    assert!(m.block_ids("b").is_none());
    assert!(m.allocate_slots("b", &state(21), &args, &[&f, &w], &all[..]).unwrap().is_some());
    assert_eq!(table(&m, "b", 1)[..3], [0, 0, 0]);
}

#[test]
fn lookup_sets_are_visited_full_attention_first_whatever_their_order() {
    let config = CoordinatorConfig {
        groups: vec![window(4, 8), chunked(4, 8), full(4)],
        lookup_sets: vec![vec![0], vec![1], vec![2]],
        ..CoordinatorConfig::single_group(30, 4, 1 << 20)
    };
    let sets = hit::lookup_sets(&config, &[false; 3]);
    let order: Vec<Vec<usize>> = sets.into_iter().map(|s| s.groups).collect();
    assert_eq!(order, [vec![2], vec![0], vec![1]], "full first, the others in the given order");
}

#[test]
fn configs_vllm_cannot_run_are_refused() {
    let overflow = GroupSpec {
        kind: AttentionKind::SlidingWindow { window: usize::MAX, extra_retained: 1 },
        ..full(4)
    };
    let eagle_chunked = CoordinatorConfig {
        groups: vec![full(4), chunked(4, 8)],
        lookup_sets: vec![vec![0], vec![1]],
        use_eagle: true,
        ..CoordinatorConfig::single_group(10, 4, 1 << 20)
    };
    let bad = [
        CoordinatorConfig {
            groups: vec![overflow],
            ..CoordinatorConfig::single_group(10, 4, 1 << 20)
        },
        eagle_chunked,
    ];
    for config in bad {
        assert!(matches!(KvCacheManager::new(config), Err(CoreError::InvalidArgument(_))));
    }
}

#[test]
fn huge_token_counts_do_not_overflow() {
    let mut m = manager(10, vec![window(4, 8), chunked(4, 8)]);
    admit(&mut m, "a", &hashes(1..3), 9);
    m.remove_skipped_blocks("a", usize::MAX);
    assert_eq!(table(&m, "a", 0), [0, 0, 0]);
    let huge = RequestState { num_computed_tokens: usize::MAX, is_waiting: false, ..state(9) };
    let args = AllocateArgs { num_new_tokens: 1, ..AllocateArgs::default() };
    let none: &[&[u32]] = &[&[], &[]];
    assert!(m.allocate_slots("a", &huge, &args, none, &[][..]).is_ok());
    assert!(m.lookup(&hashes(1..3)[..], usize::MAX).unwrap().num_tokens <= 8);
}

#[test]
fn mamba_keeps_the_running_state_and_its_draft_blocks_and_only_attention_is_zeroed() {
    // vLLM's MambaManager without prefix caching: `num_tokens + block_size *
    // num_speculative_blocks` slots, and every block before the one holding token
    // `num_computed - 1` is freed. Groups may differ in block size without caching.
    let mut m = KvCacheManager::new(CoordinatorConfig {
        groups: vec![full(4), mamba(8, 1)],
        lookup_sets: vec![vec![0], vec![1]],
        enable_caching: false,
        needs_kv_cache_zeroing: true,
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    })
    .unwrap();
    let first = AllocateArgs { num_new_tokens: 10, ..AllocateArgs::default() };
    let new = m.allocate_slots("a", &state(10), &first, &[], &[][..]).unwrap().unwrap();
    // Full: ceil(10 / 4) = 3 blocks; Mamba: ceil((10 + 8) / 8) = 3 blocks.
    assert_eq!(new, vec![vec![1, 2, 3], vec![4, 5, 6]]);
    assert_eq!(m.take_new_block_ids(), vec![1, 2, 3], "only attention blocks are zeroed");
    assert_eq!(m.take_new_block_ids(), Vec::<u32>::new(), "taking forgets them");

    // 10 computed, one decode token: the Mamba state before token 9 (block 0) is freed;
    // 11 + 8 slots still fit in 3 Mamba blocks, 11 in 3 full-attention blocks.
    let decode = AllocateArgs { num_new_tokens: 1, ..AllocateArgs::default() };
    let running = RequestState { num_computed_tokens: 10, is_waiting: false, ..state(11) };
    let new = m.allocate_slots("a", &running, &decode, &[], &[][..]).unwrap().unwrap();
    assert_eq!(new, vec![Vec::<u32>::new(), vec![]]);
    assert_eq!(table(&m, "a", 1), vec![NULL_BLOCK, 5, 6]);
    // An uncached freed block is reused first (vLLM prepends it to the free queue).
    assert_eq!(free_queue(&m)[..2], [4, 7]);

    // 16 computed, 2 more: full needs block 5 (ceil(18 / 4)); Mamba ceil(26 / 8) = 4 blocks,
    // and the state before token 15 is in block 1: block 0 stays null, nothing else freed.
    let running = RequestState { num_computed_tokens: 16, is_waiting: false, ..state(18) };
    let two = AllocateArgs { num_new_tokens: 2, ..AllocateArgs::default() };
    let new = m.allocate_slots("a", &running, &two, &[], &[][..]).unwrap().unwrap();
    assert_eq!(new, vec![vec![4, 7], vec![8]]);
    assert_eq!(m.take_new_block_ids(), vec![4, 7]);
    assert_eq!(table(&m, "a", 1), vec![NULL_BLOCK, 5, 6, 8]);
}

#[test]
fn mamba_prefix_caching_refuses_multi_token_lookahead_and_block_sizes_must_agree() {
    let cached = CoordinatorConfig {
        groups: vec![full(4), mamba(4, 0)],
        lookup_sets: vec![vec![0], vec![1]],
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    };
    assert!(KvCacheManager::new(cached.clone()).is_ok());
    let lookahead = CoordinatorConfig { num_hash_lookahead_tokens: 2, ..cached.clone() };
    let err = KvCacheManager::new(lookahead).unwrap_err().to_string();
    assert!(err.contains("at most one lookahead token"), "{err}");
    let mut zero = mamba(4, 0);
    zero.kind = AttentionKind::Mamba { speculative_blocks: 0, checkpoint_alignment: Some(0) };
    assert!(
        KvCacheManager::new(CoordinatorConfig { groups: vec![full(4), zero], ..cached }).is_err()
    );
    let sizes = CoordinatorConfig {
        groups: vec![full(4), full(8)],
        lookup_sets: vec![vec![0, 1]],
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    };
    let err = KvCacheManager::new(sizes.clone()).unwrap_err().to_string();
    assert!(err.contains("same block size"), "{err}");
    assert!(KvCacheManager::new(CoordinatorConfig { enable_caching: false, ..sizes }).is_ok());
}

/// Full attention and one Mamba group of 16-token blocks, prefix caching on (vLLM's
/// "align" mode), `speculative` draft-state blocks, 64 blocks, every state retained.
fn align(speculative: usize) -> KvCacheManager {
    KvCacheManager::new(CoordinatorConfig {
        groups: vec![full(16), mamba(16, speculative)],
        lookup_sets: vec![vec![0], vec![1]],
        enable_events: true,
        ..CoordinatorConfig::single_group(64, 16, 1 << 20)
    })
    .unwrap()
}

/// One `allocate_slots` of `new` tokens (`lookahead` slots) for a running request with
/// `computed` of its `num_tokens` tokens computed, prompt of 100.
fn step(
    m: &mut KvCacheManager,
    id: &str,
    computed: usize,
    new: usize,
    lookahead: usize,
    num_tokens: usize,
    hashes: &[BlockHash],
) -> Option<Vec<Vec<u32>>> {
    let running = RequestState {
        num_computed_tokens: computed,
        num_prompt_tokens: 100,
        is_waiting: computed == 0,
        ..state(num_tokens)
    };
    let args = AllocateArgs {
        num_new_tokens: new,
        num_lookahead_tokens: lookahead,
        ..AllocateArgs::default()
    };
    m.allocate_slots(id, &running, &args, &[], hashes).unwrap()
}

#[test]
fn mamba_align_keeps_one_state_per_step_and_caches_block_boundaries() {
    // vLLM 0.33 traced on the CPU (docs/semantics.md §6.12): a 100-token prompt in chunks of
    // 96 and 4 (the scheduler's split stops at the prompt's last reusable state, 96).
    let mut m = align(0);
    let prompt = hashes(1..7); // 100 // 16 = 6 full blocks
    step(&mut m, "r0", 0, 96, 0, 100, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 0), [1, 2, 3, 4, 5, 6]);
    // Position-indexed: the state after 96 tokens in column 5, the columns before null.
    assert_eq!(table(&m, "r0", 1), [0, 0, 0, 0, 0, 7]);
    assert_eq!(m.pool().key_num_tokens(7), 96);
    step(&mut m, "r0", 96, 4, 0, 100, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 1), [0, 0, 0, 0, 0, 7, 9]);
    // The first decode step frees the state after 96 (it stays cached, at the queue's tail).
    step(&mut m, "r0", 100, 1, 0, 101, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 1), [0, 0, 0, 0, 0, 0, 9]);
    assert_eq!(free_queue(&m).last(), Some(&7));
    // The same prompt hits the state after 96 (a Mamba hit is the latest cached state).
    m.new_step_starts();
    let hit = m.lookup(&prompt[..], 99).unwrap();
    assert_eq!((hit.num_tokens, &hit.blocks[1]), (96, &vec![0, 0, 0, 0, 0, 7]));
}

#[test]
fn mamba_align_moves_draft_state_blocks_left_behind_to_the_end() {
    // vLLM 0.33 traced on the CPU: 2 draft-state blocks, a 100-token prompt in chunks of 32
    // (full attention also takes 2 lookahead slots).
    let mut m = align(2);
    let prompt = hashes(1..7);
    step(&mut m, "r0", 0, 32, 2, 100, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 1), [0, 4, 5, 6]);
    step(&mut m, "r0", 32, 32, 2, 100, &prompt).unwrap();
    // Column 2's draft block (5) is behind the new running state (column 3, block 6).
    assert_eq!(table(&m, "r0", 1), [0, 4, 0, 6, 5, 9]);
    assert_eq!(m.pool().key_num_tokens(6), 64);
    step(&mut m, "r0", 64, 32, 2, 100, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 1), [0, 0, 0, 6, 0, 9, 5, 12]);
    let new = step(&mut m, "r0", 96, 4, 2, 100, &prompt).unwrap();
    assert_eq!(table(&m, "r0", 1), [0, 0, 0, 0, 0, 9, 5, 12, 13]);
    assert_eq!(new, vec![vec![], vec![13]]);
}

#[test]
fn mamba_align_defers_a_hit_cached_in_this_step_and_counts_can_go_negative() {
    let mut m = align(0);
    let prompt = hashes(1..7);
    step(&mut m, "r0", 0, 96, 0, 100, &prompt).unwrap();
    // r1 hits the state r0 cached during this step: it must wait for the next step.
    let hit = m.lookup(&prompt[..], 99).unwrap();
    assert_eq!(hit.num_tokens, 96);
    let hits: Vec<&[u32]> = hit.blocks.iter().map(Vec::as_slice).collect();
    let args =
        AllocateArgs { num_new_tokens: 4, num_new_computed_tokens: 96, ..AllocateArgs::default() };
    let free = m.num_free_blocks();
    assert_eq!(m.allocate_slots("r1", &state(100), &args, &hits, &prompt[..]).unwrap(), None);
    assert_eq!(m.num_free_blocks(), free);
    m.new_step_starts();
    assert!(m.allocate_slots("r1", &state(100), &args, &hits, &prompt[..]).unwrap().is_some());
    assert_eq!(table(&m, "r1", 1)[..6], [0, 0, 0, 0, 0, 7]);

    // vLLM's count is signed: a step that scheduled 16 drafts left 5 Mamba blocks; one with a
    // single draft needs ceil(58 / 16) = 4 (traced: -1).
    let mut m = align(0);
    let prompt = hashes(1..4);
    step(&mut m, "a", 0, 55, 0, 55, &prompt).unwrap();
    step(&mut m, "a", 55, 17, 0, 56, &prompt).unwrap();
    assert_eq!(table(&m, "a", 1).len(), 5);
    assert_eq!(m.num_blocks_to_allocate("a", 58, 58, 57, 0, false), -1);
}

#[test]
fn external_tokens_get_fresh_blocks_within_the_window_and_deferred_frees_keep_them_held() {
    // vLLM's allocate_slots with a KV connector: 4 hit tokens, 8 external ones (an
    // asynchronous load: nothing new to compute, registration delayed). Full attention needs
    // ceil(12 / 4) = 3 blocks: the hit and 2 fresh ones. A 4-token window skips
    // 12 + 1 - 4 = 9 tokens: 2 null blocks, and only block 2 (tokens 8..12) is taken.
    let mut m = KvCacheManager::new(CoordinatorConfig {
        groups: vec![full(4), window(4, 4)],
        lookup_sets: vec![vec![0], vec![1]],
        needs_kv_cache_zeroing: true,
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    })
    .unwrap();
    admit(&mut m, "a", &hashes(1..2), 4);
    m.free("a");
    let hit = m.lookup(&hashes(1..4)[..], 15).unwrap();
    assert_eq!((hit.num_tokens, hit.blocks[0].clone()), (4, vec![1]));
    m.take_new_block_ids();
    let args = AllocateArgs {
        num_new_tokens: 0,
        num_new_computed_tokens: 4,
        num_external_computed_tokens: 8,
        delay_cache_blocks: true,
        skip_zeroing_groups: 0b10, // group 1's load writes its blocks: not zeroed
        ..AllocateArgs::default()
    };
    let hits: Vec<&[u32]> = hit.blocks.iter().map(Vec::as_slice).collect();
    let new = m.allocate_slots("b", &state(16), &args, &hits, &hashes(1..4)[..]).unwrap();
    // No block for new tokens: the external ones are not returned (as vLLM's new_blocks).
    assert_eq!(new, Some(vec![vec![], vec![]]));
    let full_table = table(&m, "b", 0);
    let window_table = table(&m, "b", 1);
    assert_eq!(full_table.len(), 3);
    assert_eq!(full_table[0], 1);
    assert_eq!(window_table[..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(window_table.len(), 3);
    assert_eq!(m.take_new_block_ids(), full_table[1..].to_vec());
    // Delayed: nothing registered beyond the hit until the load is done.
    assert_eq!(m.lookup(&hashes(1..4)[..], 15).unwrap().num_tokens, 4);

    // Deferred free: the blocks come back still held, then are freed tail first.
    let free_before = m.num_free_blocks();
    let popped = m.pop_blocks_for_free("b");
    assert_eq!(popped, [&full_table[..], &window_table[2..]].concat());
    assert!(m.block_ids("b").is_none());
    assert_eq!(m.num_free_blocks(), free_before);
    let reversed: Vec<u32> = popped.iter().rev().copied().collect();
    assert!(m.free_blocks(&[99]).is_err(), "out of range");
    assert!(m.free_blocks(&[popped[1], popped[1]]).is_err(), "freed twice");
    assert_eq!(m.num_free_blocks(), free_before, "a refused free changes nothing");
    m.free_blocks(&reversed).unwrap();
    assert_eq!(m.num_free_blocks(), free_before + popped.len());
    // The unhashed ones were prepended in the order freed (so the tail is reused first), the
    // hashed hit appended.
    assert_eq!(free_queue(&m)[..3], [window_table[2], full_table[2], full_table[1]]);
    assert_eq!(free_queue(&m).last(), Some(&1));
}

#[test]
fn evicting_blocks_drops_their_keys_and_zeroing_records_a_table_again() {
    // vLLM's failed-load paths: evict_blocks takes the listed blocks' cache entries away (a
    // BlockRemoved each that had one) without freeing them; record_blocks_for_zeroing records
    // an attention group's blocks from a block boundary on for zeroing again.
    let mut m = KvCacheManager::new(CoordinatorConfig {
        groups: vec![full(4), window(4, 4)],
        lookup_sets: vec![vec![0], vec![1]],
        enable_events: true,
        needs_kv_cache_zeroing: true,
        ..CoordinatorConfig::single_group(20, 4, 1 << 20)
    })
    .unwrap();
    admit(&mut m, "a", &hashes(1..4), 12);
    let (full_table, window_table) = (table(&m, "a", 0), table(&m, "a", 1));
    m.take_new_block_ids();
    m.take_events();
    let free = m.num_free_blocks();
    assert!(m.evict_blocks(&[full_table[1], 99]).is_err(), "an id out of range");
    assert!(m.take_events().is_empty(), "a refused call changes nothing");
    m.evict_blocks(&[full_table[1], full_table[0], 0]).unwrap();
    let removed = m.take_events();
    let expected = [2, 1].map(|i| ManagerEvent::Removed { hash: h(i), group: 0 });
    assert_eq!(removed, expected, "in the order given; the null block has no entry");
    assert_eq!(m.num_free_blocks(), free, "evicted, not freed");
    assert_eq!(m.lookup(&hashes(1..4)[..], 11).unwrap().num_tokens, 0);

    assert!(m.record_blocks_for_zeroing("a", 6).is_err(), "not at a block boundary");
    assert!(m.take_new_block_ids().is_empty());
    m.record_blocks_for_zeroing("a", 4).unwrap();
    let expected: Vec<u32> = [&full_table[1..], &window_table[1..]].concat();
    assert_eq!(m.take_new_block_ids(), expected, "group by group, in table order");
    m.record_blocks_for_zeroing("unknown", 0).unwrap();
    assert!(m.take_new_block_ids().is_empty());
}

/// Jamba's layout in miniature: three Mamba groups (prefix caching on: vLLM's "align"
/// mode) and one full-attention group, 16-token blocks, `num_blocks` in the pool.
fn jamba(num_blocks: u32) -> KvCacheCoordinator {
    KvCacheCoordinator::new(CoordinatorConfig {
        groups: vec![mamba(16, 0), mamba(16, 0), mamba(16, 0), full(16)],
        lookup_sets: vec![vec![3], vec![0, 1, 2]],
        ..CoordinatorConfig::single_group(num_blocks, 16, 1 << 20)
    })
    .unwrap()
}

/// A request of 18 tokens coming back with 16 of them loaded from a KV connector in this
/// step (a synchronous load) and 2 to compute.
fn sync_load() -> (RequestState, AllocateArgs) {
    let args = AllocateArgs {
        num_new_tokens: 2,
        num_external_computed_tokens: 16,
        full_sequence_must_fit: true,
        ..AllocateArgs::default()
    };
    (state(18), args)
}

#[test]
fn a_mamba_state_loaded_from_a_connector_is_counted_before_admission() {
    // tests/vllm_tier/data/jamba-offload-preempt.json (docs/vllm.md, "Where kvblocks
    // differs"): each Mamba group takes the loaded state's column and the running state's
    // column, 2 blocks, and the full-attention group ceil(18 / 16) = 2. vLLM counts each Mamba
    // group 1 (its cap of one column per chunk), 5 in all, so with 7 free blocks it admits the
    // request and its pool runs dry in the last group. kvblocks also checks the 8 blocks it
    // takes: with 7 free it refuses, changing nothing.
    let (request, args) = sync_load();
    let hashes = hashes(1..2);
    let mut short = jamba(8); // 7 usable blocks
    let mut held = RequestBlocks::new(4);
    let done = short.allocate_slots(&mut held, &request, &args, &[], &hashes[..]);
    assert_eq!(done, Ok(false));
    assert_eq!(short.num_free_blocks(), 7);
    assert!(held.groups.iter().all(|g| g.blocks.is_empty()));

    let mut enough = jamba(9); // 8 usable blocks: exactly what it takes
    let mut held = RequestBlocks::new(4);
    let done = enough.allocate_slots(&mut held, &request, &args, &[], &hashes[..]);
    assert_eq!(done, Ok(true));
    assert_eq!(enough.num_free_blocks(), 0);
    for group in &held.groups {
        assert_eq!(group.blocks.len(), 2);
        assert!(group.blocks.iter().all(|&b| b != NULL_BLOCK));
    }
}

#[test]
fn a_planted_under_allocation_is_caught_naming_the_group() {
    // Something takes one of the counted blocks while the allocation runs (the pool "runs
    // dry halfway", as vLLM's did in jamba-offload-preempt): the full-attention group, filled
    // last, gets one block fewer than its tokens need. The invariant refuses to hand that
    // table on.
    let (request, args) = sync_load();
    let hashes = hashes(1..2);
    let mut coordinator = jamba(9);
    let mut held = RequestBlocks::new(4);
    let steal = |pool: &mut BlockPool, _: &mut RequestBlocks| {
        pool.get_new_blocks(1);
    };
    let done =
        coordinator.allocate_slots_with_fault(&mut held, &request, &args, &[], &hashes[..], steal);
    let Err(CoreError::Unsound(what)) = done else { panic!("not caught: {done:?}") };
    assert_eq!(what, "group 3: 1 blocks where 18 tokens need 2");
    // The manager names the request too.
    assert_eq!(
        CoreError::Unsound(what.clone()).for_request("r3").to_string(),
        format!("internal error in kvblocks (please report): a block table is unsound: request \"r3\", {what}")
    );
}

#[test]
fn an_unsound_allocation_leaves_a_table_safe_for_the_worker() {
    // The two faults the check catches: a table one block short (the pool ran dry halfway)
    // and a column holding a block nobody references. After the error each table covers its
    // tokens and holds only blocks the request references or the null block, so freeing the
    // request returns every block it holds (the one each fault left outside any table stays
    // taken).
    let (request, args) = sync_load();
    let hashes = hashes(1..2);
    let faults: [fn(&mut BlockPool, &mut RequestBlocks); 2] = [
        |pool, _| {
            pool.get_new_blocks(1);
        },
        |pool, held| {
            // The full-attention group's loaded block replaced by the free queue's last block
            // (the one this call takes last, if at all), the block it held left taken.
            held.groups[3].blocks[0] = pool.free_block_ids().last().unwrap();
        },
    ];
    for (i, fault) in faults.into_iter().enumerate() {
        // (A pool large enough that the freed block is not handed out again in the call.)
        let mut coordinator = jamba(if i == 0 { 9 } else { 40 });
        let free_before = coordinator.num_free_blocks();
        let mut held = RequestBlocks::new(4);
        // A first allocation adopts the external tokens' blocks before the fault runs.
        let done = coordinator.allocate_slots_with_fault(
            &mut held,
            &request,
            &args,
            &[],
            &hashes[..],
            fault,
        );
        assert!(matches!(done, Err(CoreError::Unsound(_))), "fault {i}: {done:?}");
        assert!(held.groups[3].blocks.len() >= 2, "fault {i}: {:?}", held.groups[3]);
        for group in &held.groups {
            for &block in &group.blocks {
                assert!(block == NULL_BLOCK || coordinator.pool().is_in_use(block), "{block}");
            }
        }
        coordinator.free(held);
        assert_eq!(coordinator.num_free_blocks(), free_before - 1);
    }
}

#[test]
fn the_invariant_names_a_short_table_and_a_block_no_request_holds() {
    // Planted directly into a table the coordinator just allocated (a bug in a rule would leave
    // the same): one block short in the full-attention group, then a column holding a free
    // block in a Mamba group.
    let (request, args) = sync_load();
    let hashes = hashes(1..2);
    let mut coordinator = jamba(12);
    let mut held = RequestBlocks::new(4);
    let free_before = coordinator.num_free_blocks();
    coordinator.allocate_slots(&mut held, &request, &args, &[], &hashes[..]).unwrap();
    let call = invariant::Allocation {
        slots: 18,
        main: 18,
        computed: 16,
        total: 16,
        first: true,
        taken: free_before - coordinator.num_free_blocks(),
    };
    assert_eq!(coordinator.check_allocation(&held, &call, 8), Ok(0));

    let mut one_short = held.clone();
    one_short.groups[3].blocks.pop();
    assert_eq!(
        coordinator.check_allocation(&one_short, &call, 8),
        Err(CoreError::Unsound("group 3: 1 blocks where 18 tokens need 2".into()))
    );

    let mut stale = held.clone();
    let free = coordinator.pool().free_block_ids().next().unwrap();
    stale.groups[1].blocks[1] = free;
    let Err(CoreError::Unsound(what)) = coordinator.check_allocation(&stale, &call, 8) else {
        panic!("a free block in a table was not caught")
    };
    assert!(what.starts_with("group 1: column 1 holds block"), "{what}");
    assert!(what.ends_with("which no request references"), "{what}");

    // More blocks taken than counted is caught even when every table is whole.
    let Err(CoreError::Unsound(what)) = coordinator.check_allocation(&held, &call, 5) else {
        panic!("an under-count was not caught")
    };
    assert_eq!(what, "the allocation took 8 free blocks after counting 5");
}

/// vLLM 0.34's cache-aware admission probe (`num_cached_tokens`, which resumes a request's
/// previous walk while nothing cached was removed) answers what a full lookup answers, through
/// admissions, frees, evictions and resets, on one full-attention group and on a layout where
/// it does not resume.
#[test]
fn admission_probes_answer_as_lookups() {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for groups in [vec![full(4)], vec![full(4), window(4, 8)]] {
        let mut m = manager(40, groups);
        // waiting requests: chains sharing prefixes of three roots
        let waiting: Vec<(String, Vec<BlockHash>, usize)> = (0..12u8)
            .map(|i| {
                let root = (i % 3) * 60;
                let shared = next(8) as u8;
                let mut chain: Vec<BlockHash> = (0..shared).map(|b| h(root + b + 1)).collect();
                chain.extend((0..4).map(|b| h(200 + i * 4 + b)));
                let tokens = chain.len() * 4 + next(4) as usize + 1;
                (format!("w{i}"), chain, tokens)
            })
            .collect();
        let mut running: Vec<String> = Vec::new();
        let mut hits = 0;
        for step in 0..200 {
            for (id, chain, tokens) in &waiting {
                let probe = m.num_cached_tokens(id, &chain[..], tokens - 1).unwrap();
                let lookup = m.lookup(&chain[..], tokens - 1).unwrap();
                assert_eq!(probe, lookup.num_tokens, "step {step}, {id}");
                hits += usize::from(probe > 0);
                // A lookup for a probed request (resuming the probe's walk where nothing was
                // removed since) finds the same blocks, within a lower hit limit too.
                let limit = if next(3) == 0 { next(*tokens as u64) as usize } else { tokens - 1 };
                let expected = m.lookup(&chain[..], limit).unwrap();
                let resumed = m.lookup_request(id, &chain[..], limit).unwrap();
                assert_eq!(resumed.blocks, expected.blocks, "step {step}, {id}, limit {limit}");
                assert_eq!(
                    (resumed.num_tokens, resumed.num_uncached_common),
                    (expected.num_tokens, expected.num_uncached_common)
                );
                assert_eq!(m.lookup(&chain[..], tokens - 1).unwrap().blocks, lookup.blocks);
            }
            match next(5) {
                0 | 1 => {
                    // a new request caches a chain sharing a root's prefix; one in three
                    // ignores its hit, caching second copies of blocks already cached (the
                    // eviction of a first copy changes the block a lookup finds)
                    let root = next(3) as u8 * 60;
                    let len = next(10) as u8 + 1;
                    let chain: Vec<BlockHash> = (0..len).map(|b| h(root + b + 1)).collect();
                    let id = format!("r{step}");
                    let tokens = chain.len() * 4 + 1;
                    let hit = if next(3) == 0 {
                        CacheHit::empty(m.config().groups.len())
                    } else {
                        m.lookup(&chain[..], tokens - 1).unwrap()
                    };
                    let args = AllocateArgs {
                        num_new_tokens: tokens - hit.num_tokens,
                        num_new_computed_tokens: hit.num_tokens,
                        full_sequence_must_fit: true,
                        ..AllocateArgs::default()
                    };
                    let hits: Vec<&[u32]> = hit.blocks.iter().map(Vec::as_slice).collect();
                    if m.allocate_slots(&id, &state(tokens), &args, &hits, &chain[..])
                        .unwrap()
                        .is_some()
                    {
                        running.push(id);
                    }
                }
                2 | 3 if !running.is_empty() => {
                    let id = running.remove(next(running.len() as u64) as usize);
                    m.free(&id);
                }
                _ if running.is_empty() && next(4) == 0 => {
                    assert!(m.reset_prefix_cache());
                }
                _ => {}
            }
        }
        // Not vacuous: probes found hits, and cached blocks were evicted or reset meanwhile.
        assert!(hits > 100, "{hits}");
        assert!(m.pool().removals() > 5);
    }
}
