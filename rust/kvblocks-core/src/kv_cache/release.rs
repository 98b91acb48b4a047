//! What gives blocks back or drops cache entries: freeing a request's blocks (at once, or
//! handed out first and freed later), the blocks that fall out of a window or chunk, evicting
//! cache entries, resetting the prefix cache, and recording which entries a step evicted.

use super::{group, invalid, mamba, KvCacheCoordinator, RequestBlocks};
use crate::pool::NULL_BLOCK;
use crate::{CoreError, CoreResult};

impl KvCacheCoordinator {
    /// vLLM's `remove_skipped_blocks` for every group: frees what no later token reads once
    /// `num_processed` tokens are done.
    pub fn remove_skipped_blocks(&mut self, held: &mut RequestBlocks, num_processed: usize) {
        if !self.windowed {
            return;
        }
        let groups = self.config.groups.iter().zip(&mut held.groups).zip(&self.align);
        for ((spec, blocks), align) in groups {
            match align {
                None => group::remove_skipped_blocks(spec, &mut self.pool, blocks, num_processed),
                Some(align) => {
                    mamba::remove_skipped_blocks(align, &mut self.pool, blocks, num_processed)
                }
            }
        }
    }

    /// vLLM's `free`: every group releases the request's blocks, last block first.
    pub fn free(&mut self, held: RequestBlocks) {
        for blocks in held.groups {
            group::free(&mut self.pool, blocks);
        }
    }

    /// vLLM's `pop_blocks_for_free`: the request's blocks, group by group in allocation order,
    /// each group's leading null blocks left out, still referenced; the caller frees them
    /// later with [`Self::free_blocks`] (in reverse order, so that tail blocks go first).
    pub fn pop_blocks_for_free(held: RequestBlocks) -> Vec<u32> {
        held.groups
            .into_iter()
            .flat_map(|g| g.blocks.into_iter().skip_while(|&b| b == NULL_BLOCK))
            .collect()
    }

    /// vLLM's `BlockPool.free_blocks` for blocks handed out by [`Self::pop_blocks_for_free`]:
    /// drops one reference per listed id (null blocks ignored). Refused, changing nothing,
    /// if an id is out of range or listed more often than it is referenced.
    pub fn free_blocks(&mut self, ids: &[u32]) -> CoreResult<()> {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &id in ids.iter().filter(|&&b| b != NULL_BLOCK) {
            if id as usize >= self.pool.num_blocks() {
                return Err(CoreError::OutOfRange {
                    what: "block id",
                    value: id as usize,
                    limit: self.pool.num_blocks(),
                });
            }
            let count = counts.entry(id).or_default();
            *count += 1;
            if *count > self.pool.ref_cnt(id) {
                return Err(invalid(format!("block {id} is freed more often than it is held")));
            }
        }
        self.pool.free_blocks(ids.iter().copied());
        Ok(())
    }

    /// vLLM's `evict_blocks`: the listed blocks lose their cache entry (a `BlockRemoved` each
    /// that had one), whether or not they are in use, in the order given. Refused, changing
    /// nothing, if an id is out of range.
    pub fn evict_blocks(&mut self, ids: &[u32]) -> CoreResult<()> {
        let limit = self.pool.num_blocks();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= limit) {
            return Err(CoreError::OutOfRange { what: "block id", value: id as usize, limit });
        }
        ids.iter().for_each(|&id| self.pool.uncache(id));
        Ok(())
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// From now on, the pool notes each block whose cache entry it evicts (see
    /// [`Self::stop_recording_evictions`]).
    pub fn record_evictions(&mut self) {
        self.pool.record_evictions();
    }

    /// The blocks whose cache entries were evicted since [`Self::record_evictions`], in order;
    /// recording stops.
    pub fn stop_recording_evictions(&mut self) -> Vec<u32> {
        self.pool.stop_recording_evictions()
    }
}
