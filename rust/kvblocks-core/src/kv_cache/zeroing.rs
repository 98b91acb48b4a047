//! KV-cache zeroing (vLLM's `new_block_ids`): the attention groups' fresh blocks the worker
//! must zero before use, recorded as they are taken, recorded again after a failed
//! asynchronous load, and handed over each step.

use super::{invalid, GroupSpec, KvCacheCoordinator, RequestBlocks};
use crate::CoreResult;

/// Records each attention group's blocks of `held` from table index `from(group, spec)` on
/// for the worker to zero (in `ids`, one list per group).
fn record_for_zeroing(
    groups: &[GroupSpec],
    held: &RequestBlocks,
    ids: &mut [Vec<u32>],
    from: impl Fn(usize, &GroupSpec) -> usize,
) {
    for (g, ((spec, blocks), ids)) in groups.iter().zip(&held.groups).zip(ids).enumerate() {
        if spec.kind.is_attention() {
            ids.extend_from_slice(blocks.blocks.get(from(g, spec)..).unwrap_or_default());
        }
    }
}

impl KvCacheCoordinator {
    /// Records the attention groups' blocks the last `allocate_slots` took for the worker to
    /// zero (vLLM records them as its managers allocate them).
    pub(super) fn record_new_blocks(&mut self, held: &RequestBlocks) {
        let new_from = &self.new_from;
        let from = |g: usize, _: &GroupSpec| new_from.get(g).copied().unwrap_or(0);
        record_for_zeroing(&self.config.groups, held, &mut self.new_block_ids, from);
    }

    /// vLLM's `record_blocks_for_zeroing`: records `held`'s blocks from token `start_token`
    /// on again for zeroing (blocks a failed asynchronous load left unwritten), in each
    /// attention group (null entries included, as vLLM's). `start_token` must be a multiple
    /// of each such group's block size (vLLM asserts it); refused otherwise, changing nothing.
    pub fn record_blocks_for_zeroing(
        &mut self,
        held: &RequestBlocks,
        start_token: usize,
    ) -> CoreResult<()> {
        if !self.config.needs_kv_cache_zeroing {
            return Ok(());
        }
        let attention = || self.config.groups.iter().filter(|g| g.kind.is_attention());
        if let Some(g) = attention().find(|g| start_token % g.block_size != 0) {
            return Err(invalid(format!(
                "record_blocks_for_zeroing: token {start_token} is not at a block boundary of \
                 {}-token blocks",
                g.block_size
            )));
        }
        let from = |_: usize, spec: &GroupSpec| start_token / spec.block_size;
        record_for_zeroing(&self.config.groups, held, &mut self.new_block_ids, from);
        Ok(())
    }

    /// vLLM's `take_new_block_ids`: the blocks recorded for zeroing since the last call,
    /// group by group (each group's in allocation order), and forgets them.
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        self.new_block_ids.iter_mut().flat_map(std::mem::take).collect()
    }
}
