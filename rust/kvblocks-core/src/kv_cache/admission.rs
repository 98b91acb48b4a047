//! Counting before allocating (vLLM's coordinator `get_num_blocks_to_allocate`): the blocks
//! a request needs in every group, prefix hits, connector-loaded tokens and Mamba checkpoints
//! included, which decide whether a request is admitted or a chunk is scheduled.

use super::{group, mamba, KvCacheCoordinator, RequestBlocks};

impl KvCacheCoordinator {
    /// vLLM's coordinator `get_num_blocks_to_allocate`, summed over the groups: `num_tokens`
    /// slots, of which `main` are the model's own (draft tokens in, lookahead slots out: what
    /// a Mamba group counts), `total_computed` computed once the hits are adopted;
    /// `prefill_end` is where vLLM's Mamba groups place the prompt's checkpoint (0 unless the
    /// retention interval is 0). `None` when a Mamba hit was cached during this step (the
    /// request must wait). The count may be negative. Without `cap` (the admission gate),
    /// each Mamba group notes the checkpoint the chunk writes, as vLLM's does, whatever the
    /// outcome.
    ///
    /// Also returns the blocks the allocation takes, which differs from the count only where
    /// this call adopts external tokens (`external`: `(local, external)` computed tokens) in
    /// a Mamba group (see [`mamba::num_blocks_taken`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn blocks_needed(
        &self,
        held: &mut RequestBlocks,
        num_tokens: usize,
        main: usize,
        hits: &[&[u32]],
        total_computed: usize,
        prefill_end: usize,
        external: Option<(usize, usize)>,
        cap: bool,
    ) -> Option<(i64, i64)> {
        let (mut needed, mut taken, mut deferred) = (0i64, 0i64, false);
        let groups = self.config.groups.iter().zip(&mut held.groups).zip(&self.align);
        for (g, ((spec, blocks), align)) in groups.enumerate() {
            let hits = hits.get(g).copied().unwrap_or_default();
            let Some(align) = align else {
                let count = group::num_blocks_to_allocate(
                    spec,
                    &self.pool,
                    blocks,
                    num_tokens,
                    hits,
                    total_computed,
                    cap,
                ) as i64;
                needed += count;
                taken += count;
                continue;
            };
            let demand = mamba::num_blocks_to_allocate(
                align,
                &self.pool,
                blocks,
                hits,
                total_computed,
                main,
                prefill_end,
                &self.cached_this_step,
            );
            let mamba::Demand::Blocks { blocks: count, checkpoint } = demand else {
                deferred = true;
                continue;
            };
            needed += count;
            taken += match external {
                Some(tokens) => mamba::num_blocks_taken(
                    align,
                    spec,
                    &self.pool,
                    blocks,
                    hits,
                    tokens,
                    main,
                    checkpoint.is_some(),
                ) as i64,
                None => count,
            };
            if !cap {
                blocks.mamba.checkpoint = checkpoint;
            }
        }
        (!deferred).then_some((needed, taken))
    }

    /// vLLM's coordinator `get_num_blocks_to_allocate` without hits: the blocks `held` needs
    /// for `num_tokens` slots, `main` of them the main model's (what a Mamba group counts),
    /// with `total_computed` computed tokens and the prefill ending at `prefill_end` (`cap`:
    /// the admission cap of recycling groups).
    pub fn num_blocks_to_allocate(
        &self,
        held: &mut RequestBlocks,
        num_tokens: usize,
        main: usize,
        total_computed: usize,
        prefill_end: usize,
        cap: bool,
    ) -> i64 {
        // vLLM answers a deferral with one block more than the pool has.
        let prefill_end = self.prefill_end(prefill_end);
        self.blocks_needed(held, num_tokens, main, &[], total_computed, prefill_end, None, cap)
            .map_or(self.pool.num_blocks() as i64 + 1, |(needed, _)| needed)
    }

    /// Where vLLM's Mamba groups place the prompt's checkpoint for a prefill ending at
    /// `prefill_end`: there with retention interval 0, else nowhere (0; vLLM's coordinator
    /// drops it).
    pub(super) fn prefill_end(&self, prefill_end: usize) -> usize {
        if self.any_align && self.config.retention_interval == Some(0) {
            prefill_end
        } else {
            0
        }
    }
}
