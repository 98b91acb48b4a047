//! Checks shared by the integration tests.

use kvblocks_core::pool::BlockPool;
use std::collections::HashMap;

/// The pool agrees with the block tables that hold its blocks: every block's reference count
/// is the number of tables holding it, the free queue holds each unreferenced block once (never
/// the null block 0), and every cached block is indexed under its own key.
pub fn assert_pool_consistent(pool: &BlockPool, held: &HashMap<u32, u32>) {
    let free: Vec<u32> = pool.free_block_ids().collect();
    let mut seen = free.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), free.len(), "a block twice in the free queue");
    for block in 1..pool.num_blocks() as u32 {
        assert_eq!(pool.ref_cnt(block), held.get(&block).copied().unwrap_or(0), "block {block}");
    }
    assert!(free.iter().all(|&b| pool.ref_cnt(b) == 0 && b != 0));
    let used = (1..pool.num_blocks() as u32).filter(|&b| pool.ref_cnt(b) > 0).count();
    assert_eq!(free.len() + used, pool.num_blocks() - 1);
    for (key, blocks) in pool.cached_blocks() {
        assert!(blocks.iter().all(|&b| pool.key(b) == Some(key)));
        assert!(!blocks.contains(&0), "the null block is never cached");
    }
}
