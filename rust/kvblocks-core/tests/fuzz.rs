//! Property-based fuzzing of the core through its public API: random operation sequences on a
//! small block manager (nothing may panic, every refusal is a typed error, the pool invariants
//! hold after every operation) and random hashing inputs for every algorithm.
//!
//! Quick by default; a long run: `PROPTEST_CASES=20000 cargo test --release -p kvblocks-core --test fuzz`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // test code: a panic is a failure

use kvblocks_core::{
    BlockHasher, BlockManager, ExtraKey, HashAlgo, ManagerConfig, MmFeature, RequestKeys,
    StepBuffers, StepInput, HASH_ALGORITHMS,
};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

mod common;

#[derive(Debug, Clone)]
enum Op {
    Add {
        id: u8,
        tokens: Vec<u32>,
        salt: bool,
    },
    Append {
        id: u8,
        tokens: Vec<u32>,
    },
    Admit {
        id: u8,
        chunk: usize,
        lookahead: usize,
    },
    Decode {
        id: u8,
        token: u32,
    },
    Free {
        id: u8,
    },
    Remove {
        id: u8,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    Step {
        ids: Vec<u8>,
        count: usize,
        budget: Option<usize>,
        preempt: bool,
        sampled: Vec<Option<u32>>,
    },
    Reset,
    Drain,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u8..6;
    let tokens = prop::collection::vec(prop_oneof![0u32..8, any::<u32>()], 0..24);
    prop_oneof![
        (id.clone(), tokens.clone(), any::<bool>()).prop_map(|(id, tokens, salt)| Op::Add {
            id,
            tokens,
            salt
        }),
        (id.clone(), tokens).prop_map(|(id, tokens)| Op::Append { id, tokens }),
        (id.clone(), 0usize..30, 0usize..4).prop_map(|(id, chunk, lookahead)| Op::Admit {
            id,
            chunk,
            lookahead
        }),
        (id.clone(), 0u32..8).prop_map(|(id, token)| Op::Decode { id, token }),
        id.clone().prop_map(|id| Op::Free { id }),
        id.clone().prop_map(|id| Op::Remove { id }),
        (id.clone(), id.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        (
            prop::collection::vec(id, 0..5),
            0usize..4,
            prop::option::of(0usize..12),
            any::<bool>(),
            prop::collection::vec(prop::option::of(0u32..8), 0..6),
        )
            .prop_map(|(ids, count, budget, preempt, sampled)| Op::Step {
                ids,
                count,
                budget,
                preempt,
                sampled
            }),
        Just(Op::Reset),
        Just(Op::Drain),
    ]
}

fn manager(num_blocks: usize, block_size: usize, verify: bool, debug_key: bool) -> BlockManager {
    let hasher = BlockHasher::new(HashAlgo::Xxh3Native, block_size, "fuzz".into()).unwrap();
    let config = ManagerConfig {
        num_blocks,
        enable_caching: true,
        max_model_len: Some(96),
        watermark: 0.0,
        log_stats: true,
        enable_events: true,
        verify_tokens: verify,
        debug_key_bytes: debug_key.then_some(1),
    };
    BlockManager::new(config, Arc::new(hasher)).unwrap()
}

fn check_invariants(m: &BlockManager) {
    let pool = m.pool();
    let mut held: HashMap<u32, u32> = HashMap::new();
    for (_, _, blocks) in m.block_tables() {
        for &b in blocks {
            *held.entry(b).or_default() += 1;
        }
    }
    common::assert_pool_consistent(pool, &held);
}

fn name(id: u8) -> String {
    format!("r{id}")
}

fn apply(m: &mut BlockManager, op: &Op) {
    // Every call either succeeds or returns a typed error; a panic fails the property.
    match op {
        Op::Add { id, tokens, salt } => {
            let keys = RequestKeys::new(None, salt.then(|| "s".to_owned()), vec![]).unwrap();
            let _ = m.add_request(&name(*id), tokens, keys);
        }
        Op::Append { id, tokens } => {
            let _ = m.append_token_ids(name(*id).as_str(), tokens);
        }
        Op::Admit { id, chunk, lookahead } => {
            let id = name(*id);
            if let (Ok((hits, n)), Ok(computed)) =
                (m.get_computed_blocks(id.as_str()), m.num_computed_tokens(id.as_str()))
            {
                let (hits, n) = if computed > 0 { (vec![], 0) } else { (hits, n) };
                let _ = m.allocate_slots(id.as_str(), *chunk, n, &hits, *lookahead);
            }
        }
        Op::Decode { id, token } => {
            let _ = m.append_token_ids(name(*id).as_str(), &[*token]);
            let _ = m.allocate_slots(name(*id).as_str(), 1, 0, &[], 0);
        }
        Op::Free { id } => {
            let _ = m.free(name(*id).as_str());
        }
        Op::Remove { id } => {
            let _ = m.remove_request(name(*id).as_str());
        }
        Op::Fork { parent, child } => {
            let _ = m.fork(name(*parent).as_str(), &name(*child));
        }
        Op::Step { ids, count, budget, preempt, sampled } => {
            let handles: Vec<i64> =
                ids.iter().map(|&id| m.handle(name(id).as_str()).unwrap_or(-1)).collect();
            let counts = vec![*count; handles.len()];
            let input = StepInput {
                handles: &handles,
                num_new_tokens: Some(&counts),
                token_budget: *budget,
                preempt: *preempt,
                sampled_token_ids: Some(sampled),
                ..Default::default()
            };
            let _ = m.schedule_step(input, &mut StepBuffers::new(5, 32, 32).output());
        }
        Op::Reset => {
            let _ = m.reset_prefix_cache();
        }
        Op::Drain => {
            let _ = m.take_events();
            let _ = m.take_block_copies();
            let _ = m.make_prefix_cache_stats();
        }
    }
}

proptest! {
    #[test]
    fn manager_operations_never_panic_and_keep_invariants(
        num_blocks in 2usize..24,
        block_size in prop_oneof![Just(1usize), Just(2), Just(4)],
        verify in any::<bool>(),
        debug_key in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut m = manager(num_blocks, block_size, verify, debug_key);
        for op in &ops {
            apply(&mut m, op);
            check_invariants(&m);
        }
    }

    #[test]
    fn hashing_never_panics_and_is_deterministic(
        algo in 0usize..5,
        block_size in 1usize..40,
        parent in prop::collection::vec(any::<u8>(), 0..40),
        tokens in prop::collection::vec(any::<u32>(), 0..120),
        text in ".{0,12}",
        offset in any::<i64>(),
        mm in prop::collection::vec((0usize..200, 1usize..40), 0..4),
    ) {
        let algo = HashAlgo::from_name(HASH_ALGORITHMS[algo]).unwrap();
        let hasher = BlockHasher::new(algo, block_size, text.clone()).unwrap();
        let keys = [
            ExtraKey::Lora { name: &text, path: &text },
            ExtraKey::Mm { identifier: &text, offset },
            ExtraKey::CacheSalt(&text),
            ExtraKey::PromptEmbeds(&parent),
        ];
        let a = hasher.hash_block(Some(&parent), &tokens, Some(&keys), &mut Vec::new());
        let b = hasher.hash_block(Some(&parent), &tokens, Some(&keys), &mut Vec::new());
        prop_assert_eq!(a, b);
        let mut features: Vec<MmFeature> = mm
            .into_iter()
            .map(|(offset, length)| MmFeature { identifier: text.clone(), offset, length })
            .collect();
        features.sort_by_key(|f| f.offset);
        let request = RequestKeys::new(Some((text.clone(), text.clone())), Some(text), features).unwrap();
        let hashes = hasher.hash_blocks(&tokens, &request);
        prop_assert_eq!(hashes.len(), tokens.len() / block_size);
    }
}
