//! Property-based tests of the allocation engine through the vLLM manager's API, without
//! vLLM: random layouts (full attention, sliding windows, chunked local, Mamba; EAGLE,
//! retention, prefix caching on and off) and random scheduler-like call sequences. Nothing may panic,
//! every refusal is a typed error that changes nothing, and after every call the pool's
//! invariants hold: each block's reference count is the number of tables holding it, the
//! free queue holds exactly the unreferenced blocks, the null block is never handed out,
//! every cache entry points at blocks registered under it, and a group's null blocks form a
//! prefix of its table (a Mamba group's with prefix caching is indexed by position). (tests/vllm_tier
//! compares the engine's decisions with vLLM's own.)
//!
//! A long run: `PROPTEST_CASES=5000 cargo test --release -p kvblocks-core --test engine`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // test code: a panic is a failure

use kvblocks_core::{
    AllocateArgs, AttentionKind, BlockHash, CoordinatorConfig, GroupSpec, KvCacheManager,
    ManagerEvent, RequestState,
};
use proptest::prelude::*;
use std::collections::HashMap;

mod common;

const BLOCK: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    /// A request arrives: `len` tokens of chain `chain` (shared prefixes), looked up and
    /// admitted with at most `chunk` new tokens.
    Admit {
        id: u8,
        chain: u8,
        len: usize,
        chunk: usize,
        full_sequence: bool,
        /// Tokens after the hit that a KV connector provides (loaded asynchronously).
        external: usize,
    },
    /// A running request computes `n` more tokens (decode or another prefill chunk), with
    /// `lookahead` slots and `in_flight` tokens of an earlier step not yet processed.
    Compute {
        id: u8,
        n: usize,
        lookahead: usize,
        in_flight: usize,
    },
    /// The request's output adds `n` tokens (their full blocks get hashes).
    Append {
        id: u8,
        n: usize,
    },
    /// The request's blocks freed at once, or (`deferred`) popped and freed afterwards in
    /// reverse order, as vLLM's scheduler does with a KV connector and async scheduling.
    Free {
        id: u8,
        deferred: bool,
    },
    Reset,
    /// A scheduler step begins (Mamba states cached before it may be adopted again).
    NewStep,
    /// Arguments the engine must refuse: hits of another request, a block out of range.
    Bad {
        id: u8,
        kind: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u8..6;
    prop_oneof![
        (
            id.clone(),
            0u8..3,
            1usize..60,
            1usize..64,
            any::<bool>(),
            prop_oneof![Just(0), 1usize..12]
        )
            .prop_map(|(id, chain, len, chunk, full_sequence, external)| Op::Admit {
                id,
                chain,
                len,
                chunk,
                full_sequence,
                external,
            }),
        (id.clone(), 1usize..20, 0usize..4, 0usize..6)
            .prop_map(|(id, n, lookahead, in_flight)| Op::Compute { id, n, lookahead, in_flight }),
        (id.clone(), 1usize..12).prop_map(|(id, n)| Op::Append { id, n }),
        (id.clone(), any::<bool>()).prop_map(|(id, deferred)| Op::Free { id, deferred }),
        Just(Op::Reset),
        Just(Op::NewStep),
        (id, 0u8..3).prop_map(|(id, kind)| Op::Bad { id, kind }),
    ]
}

fn group() -> impl Strategy<Value = GroupSpec> {
    let kind = prop_oneof![
        Just(AttentionKind::Full),
        (1usize..24, 0usize..3).prop_map(|(window, extra_retained)| AttentionKind::SlidingWindow {
            window,
            extra_retained
        }),
        (1usize..6).prop_map(|blocks| AttentionKind::ChunkedLocal { chunk: blocks * BLOCK }),
        (0usize..3, prop_oneof![Just(None), Just(Some(1)), Just(Some(BLOCK))]).prop_map(
            |(speculative_blocks, checkpoint_alignment)| AttentionKind::Mamba {
                speculative_blocks,
                checkpoint_alignment
            }
        ),
    ];
    (kind, prop::option::of(2usize..12), any::<bool>()).prop_map(|(kind, cap, is_eagle_group)| {
        GroupSpec {
            kind,
            block_size: BLOCK,
            max_admission_blocks: matches!(
                kind,
                AttentionKind::SlidingWindow { .. } | AttentionKind::ChunkedLocal { .. }
            )
            .then_some(cap.unwrap_or(64)),
            is_eagle_group,
        }
    })
}

fn config() -> impl Strategy<Value = CoordinatorConfig> {
    (
        prop::collection::vec(group(), 1..4),
        8u32..60,
        any::<bool>(),
        any::<bool>(),
        0usize..3,
        prop_oneof![Just(None), Just(Some(0)), Just(Some(8))],
        0usize..4,
        any::<bool>(),
        0usize..2,
    )
        .prop_map(
            |(
                groups,
                num_blocks,
                caching,
                eagle,
                prefill,
                retention,
                watermark,
                zeroing,
                lookahead,
            )| {
                let mamba = groups.iter().any(|g| matches!(g.kind, AttentionKind::Mamba { .. }));
                // One lookup set per group, full attention first (vLLM's order for distinct specs).
                let mut order: Vec<usize> = (0..groups.len()).collect();
                order.sort_by_key(|&g| !groups[g].kind.is_full());
                // vLLM refuses EAGLE with a chunked-local group (kvblocks' guard falls back).
                let chunked =
                    groups.iter().any(|g| matches!(g.kind, AttentionKind::ChunkedLocal { .. }));
                CoordinatorConfig {
                    num_blocks,
                    lookup_sets: order.into_iter().map(|g| vec![g]).collect(),
                    groups,
                    max_model_len: 64,
                    enable_caching: caching,
                    enable_events: true,
                    watermark_blocks: watermark,
                    use_eagle: eagle && !chunked,
                    num_prefill_lookahead: prefill,
                    num_hash_lookahead_tokens: lookahead,
                    retention_interval: retention,
                    needs_kv_cache_zeroing: zeroing || mamba,
                }
            },
        )
}

/// The hashes of chain `chain`: requests on one chain share every prefix.
fn chain_hash(chain: u8, index: usize) -> BlockHash {
    let mut bytes = [0u8; 32];
    bytes[0] = chain;
    bytes[1..9].copy_from_slice(&(index as u64).to_le_bytes());
    BlockHash::Sha256(bytes)
}

#[derive(Debug, Clone)]
struct Request {
    chain: u8,
    num_tokens: usize,
    num_prompt_tokens: usize,
    num_computed_tokens: usize,
    admitted: bool,
}

impl Request {
    fn hashes(&self) -> Vec<BlockHash> {
        (0..self.num_tokens / BLOCK).map(|i| chain_hash(self.chain, i)).collect()
    }

    fn state(&self, in_flight: usize) -> RequestState {
        RequestState {
            num_tokens: self.num_tokens,
            num_computed_tokens: self.num_computed_tokens,
            num_prompt_tokens: self.num_prompt_tokens,
            num_in_flight_tokens: in_flight.min(self.num_computed_tokens),
            shared_prefix_boundary: 0,
            is_waiting: !self.admitted,
        }
    }
}

fn name(id: u8) -> String {
    format!("r{id}")
}

/// Everything observable of the pool and the tables, to compare before and after a refusal.
fn snapshot(m: &KvCacheManager, ids: &[u8]) -> (Vec<u32>, Vec<u32>, Vec<Vec<Vec<u32>>>) {
    let pool = m.pool();
    let free = pool.free_block_ids().collect();
    let refs = (0..pool.num_blocks() as u32).map(|b| pool.ref_cnt(b)).collect();
    let tables = ids
        .iter()
        .map(|&id| {
            m.block_ids(&name(id))
                .map(|t| t.groups.iter().map(|g| g.blocks.clone()).collect())
                .unwrap_or_default()
        })
        .collect();
    (free, refs, tables)
}

fn check_invariants(m: &KvCacheManager, ids: &[u8]) {
    let pool = m.pool();
    let mut held: HashMap<u32, u32> = HashMap::new();
    let config = m.config();
    for &id in ids {
        let Some(tables) = m.block_ids(&name(id)) else { continue };
        for (g, spec) in tables.groups.iter().zip(&config.groups) {
            let nulls = g.blocks.iter().take_while(|&&b| b == 0).count();
            // A Mamba group's table is indexed by position with prefix caching: states sit
            // between null columns.
            let positional = config.enable_caching && spec.kind.is_mamba();
            assert!(
                positional || g.blocks[nulls..].iter().all(|&b| b != 0),
                "interior null block: {:?}",
                g.blocks
            );
            for &b in g.blocks[nulls..].iter().filter(|&&b| b != 0) {
                *held.entry(b).or_default() += 1;
            }
        }
    }
    common::assert_pool_consistent(pool, &held);
}

fn apply(m: &mut KvCacheManager, requests: &mut HashMap<u8, Request>, op: &Op) {
    let ids: Vec<u8> = (0..6).collect();
    match op {
        Op::Admit { id, chain, len, chunk, full_sequence, external } => {
            if requests.get(id).is_some_and(|r| r.admitted) {
                return;
            }
            let r = requests.entry(*id).or_insert(Request {
                chain: *chain,
                num_tokens: *len,
                num_prompt_tokens: *len,
                num_computed_tokens: 0,
                admitted: false,
            });
            let hashes = r.hashes();
            let hit = m.lookup(&hashes[..], r.num_tokens - 1).unwrap();
            let computed = hit.num_tokens.min(r.num_tokens - 1);
            let external = (*external).min(r.num_tokens - 1 - computed);
            // An asynchronous load computes nothing new in its first step.
            let new = if external > 0 { 0 } else { (r.num_tokens - computed).min(*chunk).max(1) };
            let args = AllocateArgs {
                num_new_tokens: new,
                num_new_computed_tokens: hit.num_tokens,
                num_external_computed_tokens: external,
                delay_cache_blocks: external > 0,
                skip_zeroing_groups: u64::from(*chunk % 2 == 0),
                full_sequence_must_fit: *full_sequence,
                has_scheduled_reqs: true,
                ..AllocateArgs::default()
            };
            let hits: Vec<&[u32]> = hit.blocks.iter().map(Vec::as_slice).collect();
            let state = r.state(0);
            if let Some(_new) =
                m.allocate_slots(&name(*id), &state, &args, &hits, &hashes[..]).unwrap()
            {
                r.num_computed_tokens += hit.num_tokens + external + new;
                r.admitted = true;
            }
        }
        Op::Compute { id, n, lookahead, in_flight } => {
            let Some(r) = requests.get_mut(id).filter(|r| r.admitted) else { return };
            let n = (*n).min(r.num_tokens.saturating_sub(r.num_computed_tokens));
            if n == 0 {
                return;
            }
            let args = AllocateArgs {
                num_new_tokens: n,
                num_lookahead_tokens: *lookahead,
                has_scheduled_reqs: true,
                ..AllocateArgs::default()
            };
            let hashes = r.hashes();
            let state = r.state(*in_flight);
            if m.allocate_slots(&name(*id), &state, &args, &[], &hashes[..]).unwrap().is_some() {
                r.num_computed_tokens += n;
            } else {
                // A running request that does not fit is preempted (freed, recomputed later).
                m.free(&name(*id));
                r.num_computed_tokens = 0;
                r.admitted = false;
            }
        }
        Op::Append { id, n } => {
            let Some(r) = requests.get_mut(id) else { return };
            r.num_tokens = (r.num_tokens + n).min(64);
            let hashes = r.hashes();
            let state = r.state(0);
            m.cache_blocks(&name(*id), &state, r.num_computed_tokens, &hashes[..]).unwrap();
        }
        Op::Free { id, deferred } => {
            if *deferred {
                let held = m.pop_blocks_for_free(&name(*id));
                let reversed: Vec<u32> = held.iter().rev().copied().collect();
                m.free_blocks(&reversed).unwrap();
            } else {
                m.free(&name(*id));
            }
            if let Some(r) = requests.get_mut(id) {
                r.num_computed_tokens = 0;
                r.admitted = false;
            }
        }
        Op::NewStep => {
            m.new_step_starts();
        }
        Op::Reset => {
            // Idle: no request holds a real block (a table of null blocks only holds none:
            // external tokens a chunk or window already skipped get none).
            let idle = ids.iter().all(|&id| {
                m.block_ids(&name(id))
                    .is_none_or(|t| t.groups.iter().all(|g| g.blocks.iter().all(|&b| b == 0)))
            });
            assert_eq!(m.reset_prefix_cache(), idle);
        }
        Op::Bad { id, kind } => {
            let before = snapshot(m, &ids);
            let state = requests.get(id).map_or_else(RequestState::default, |r| r.state(0));
            let groups = m.config().groups.len();
            let args = AllocateArgs { num_new_tokens: 1, ..AllocateArgs::default() };
            let out_of_range = [u32::MAX];
            let hits: Vec<&[u32]> = match kind {
                0 => vec![&out_of_range[..]; groups],
                1 => vec![&[1u32][..]; groups + 1],
                _ => vec![],
            };
            let zero = AllocateArgs::default();
            let args = if *kind == 2 { zero } else { args };
            assert!(m.allocate_slots(&name(*id), &state, &args, &hits, &[][..]).is_err());
            assert_eq!(snapshot(m, &ids), before, "a refused call changed the state");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn random_calls_keep_the_pool_consistent(
        config in config(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let zeroing = config.needs_kv_cache_zeroing;
        let mut m = KvCacheManager::new(config).unwrap();
        let mut requests = HashMap::new();
        let ids: Vec<u8> = (0..6).collect();
        for op in &ops {
            apply(&mut m, &mut requests, op);
            check_invariants(&m, &ids);
            let to_zero = m.take_new_block_ids();
            prop_assert!(zeroing || to_zero.is_empty(), "blocks to zero without zeroing");
            prop_assert!(to_zero.iter().all(|&b| b != 0), "the null block recorded for zeroing");
            for event in m.take_events() {
                if let ManagerEvent::Stored { first, end, skipped, .. } = event {
                    prop_assert!(first < end);
                    prop_assert!(skipped.iter().all(|&i| first <= i && i < end));
                }
            }
        }
        // Freeing everything returns every block.
        for id in &ids {
            m.free(&name(*id));
        }
        prop_assert_eq!(m.num_free_blocks(), m.pool().num_blocks() - 1);
    }
}
