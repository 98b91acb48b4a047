//! vLLM's `allocate_slots`: the decision (the count against the free blocks, the watermark
//! and the reserve), then adopting prefix hits and connector-loaded tokens, copy-on-write,
//! the new blocks of every group, registering what filled up, and the check of what the
//! call left (`invariant`).

use super::lookup::no_hits;
use super::{group, invalid, invariant, mamba};
use super::{HashSource, KvCacheCoordinator, RequestBlocks, RequestState};
use crate::pool::BlockPool;
use crate::{CoreError, CoreResult};

/// The arguments of vLLM's `allocate_slots` that the coordinator implements.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs {
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    pub num_lookahead_tokens: usize,
    /// Free blocks to leave for other in-flight sequences (vLLM 0.34's async KV loads). vLLM
    /// sums per-request counts that may be negative (a request holding more than its next
    /// step needs), and a negative reservation leaves more room: `needed > free - reserved`.
    pub reserved_blocks: i64,
    pub full_sequence_must_fit: bool,
    pub delay_cache_blocks: bool,
    /// Whether any request is already scheduled this step (the watermark applies only then).
    pub has_scheduled_reqs: bool,
    /// Copy-on-write (the embedded block manager's forks, full-attention groups): each held
    /// block this call writes new tokens into that another request also holds is replaced
    /// by a fresh one first, counted with the rest (see
    /// [`KvCacheCoordinator::last_copies`]).
    pub copy_on_write: bool,
    /// vLLM's `num_external_computed_tokens`: tokens after the prefix hits whose KV a KV
    /// connector provides (they get fresh blocks, registered once the load is done).
    pub num_external_computed_tokens: usize,
    /// vLLM's `skip_zeroing_group_ids` as a bit mask (bit `g`: group `g`'s blocks for
    /// external tokens are written by an asynchronous load, so they are not zeroed).
    pub skip_zeroing_groups: u64,
}

impl KvCacheCoordinator {
    /// vLLM's `allocate_slots`: true when it allocated ([`Self::new_blocks`] are the blocks it
    /// took for each group), false when the pool cannot provide them. A false return may
    /// still have freed blocks that fell out of a sliding window or chunk (vLLM frees those
    /// first, whatever the outcome); an error changes no block or table (only
    /// [`Self::last_registered`], which describes every call, failed ones included), but for
    /// [`CoreError::Unsound`]: a table the allocation left does not hold what its request
    /// needs (a bug, caught after the fact: see `invariant`), after which each table of the
    /// request holds only blocks it references and null blocks, at least as many columns as
    /// its tokens need (`make_safe`), and the blocks this call took are still its own.
    /// `hits` are the prefix hits per group (none: no group has any).
    pub fn allocate_slots(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        args: &AllocateArgs,
        hits: &[&[u32]],
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<bool> {
        self.allocate_slots_with_fault(held, request, args, hits, hashes, |_, _| {})
    }

    /// [`Self::allocate_slots`], with `fault` run where copy-on-write runs (the allocation
    /// is certain, the hits are adopted, no new block is taken yet): the tests plant faults
    /// there that the checks after the allocation must catch.
    pub(super) fn allocate_slots_with_fault(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        args: &AllocateArgs,
        hits: &[&[u32]],
        hashes: &(impl HashSource + ?Sized),
        fault: impl FnOnce(&mut BlockPool, &mut RequestBlocks),
    ) -> CoreResult<bool> {
        self.registered.clear();
        self.boundary_states.clear();
        self.copies.clear();
        if args.num_new_tokens == 0
            && args.num_new_computed_tokens == 0
            && args.num_external_computed_tokens == 0
        {
            return Err(invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        if held.groups.len() != self.num_groups() {
            return Err(CoreError::Internal("a request's tables do not match the groups"));
        }
        let max_len = self.config.max_model_len;
        let local = request.num_computed_tokens.saturating_add(args.num_new_computed_tokens);
        self.check_hits(held, hits, local, request.num_tokens)?;
        let external = args.num_external_computed_tokens;
        // Local and external computed tokens (vLLM caps only some uses at max_model_len).
        let computed = local.saturating_add(external);
        let total = computed.min(max_len);
        let watermark = if args.has_scheduled_reqs && request.is_waiting {
            self.config.watermark_blocks
        } else {
            0
        };
        let prefill_end =
            self.prefill_end(request.num_prompt_tokens.max(request.num_tokens.saturating_sub(1)));
        // A first allocation adopts its hits and external tokens (see below).
        let first = (!no_hits(hits) || external > 0) && !held.is_tracked();
        let adopts_external = (first && external > 0).then_some((local, external));
        let free = self.pool.num_free_blocks() as i64;
        if args.full_sequence_must_fit {
            let whole = request.num_tokens.min(max_len);
            match self.blocks_needed(held, whole, whole, hits, total, prefill_end, None, true) {
                Some((n, _)) if n + watermark as i64 <= free => {}
                _ => return Ok(false),
            }
        }
        let main = total.saturating_add(args.num_new_tokens);
        let slots = self.config.num_slots(computed, args.num_new_tokens, args.num_lookahead_tokens);
        // Read the hashes this call may register first: a bad one must change nothing.
        let cache_upto = main.min(request.num_tokens);
        let keys = if args.delay_cache_blocks {
            Default::default()
        } else {
            self.read_keys(held, hashes, cache_upto)?
        };

        // Blocks out of the window are freed even if the allocation then fails (vLLM frees
        // on the processed-token basis: in-flight steps still read below the boundary).
        let processed = total.saturating_sub(request.num_in_flight_tokens);
        self.remove_skipped_blocks(held, processed);
        // vLLM counts this chunk's blocks from the computed tokens before the max_model_len cap
        // (the full-sequence gate above uses the capped count).
        let needed = self.blocks_needed(
            held,
            slots,
            main,
            hits,
            computed,
            prefill_end,
            adopts_external,
            false,
        );
        let Some((needed, taken)) = needed else { return Ok(false) };
        let copied = if args.copy_on_write {
            self.shared_written(held, local, args.num_new_tokens).count()
        } else {
            0
        };
        // vLLM's `needed + watermark > free - reserved` (the count may be negative); and
        // never more blocks than are free (where vLLM's count falls short, its pool runs dry).
        let extra = (copied.saturating_add(watermark) as i64).saturating_add(args.reserved_blocks);
        let free_before = self.pool.num_free_blocks();
        if needed.saturating_add(extra) > free_before as i64
            || taken.saturating_add(copied as i64) > free_before as i64
        {
            return Ok(false);
        }

        if first {
            // A first allocation adopting hits (check_hits: caching on) or external tokens.
            // Touch every group's hits before any group takes new blocks, so none can evict
            // another's hit; then the blocks for the external tokens.
            for (g, (spec, blocks)) in self.config.groups.iter().zip(&mut held.groups).enumerate() {
                let group_hits = hits.get(g).copied().unwrap_or_default();
                group::add_computed_blocks(spec, &mut self.pool, blocks, group_hits, computed);
            }
            if external > 0 {
                self.allocate_external_blocks(held, local, external, args.skip_zeroing_groups);
            }
        }
        if copied > 0 {
            self.copy_on_write(held, local, args.num_new_tokens)?;
        }
        fault(&mut self.pool, held);
        let groups = self.config.groups.iter().zip(&mut held.groups).zip(&mut self.new_from);
        for (((spec, blocks), from), align) in groups.zip(&self.align) {
            *from = blocks.blocks.len();
            match align {
                None => group::allocate_new_blocks(spec, &mut self.pool, blocks, slots),
                // Mamba states take no lookahead slots (draft models have no Mamba layers).
                Some(align) => mamba::allocate_new_blocks(align, &mut self.pool, blocks, main),
            }
        }
        if self.config.needs_kv_cache_zeroing {
            self.record_new_blocks(held);
        }
        if !args.delay_cache_blocks {
            self.cache_with_keys_if_due(held, request, cache_upto, &keys, hashes);
        }
        let allocation = invariant::Allocation {
            slots,
            main,
            computed,
            total,
            first,
            taken: free_before.saturating_sub(self.pool.num_free_blocks()),
        };
        let counted = needed.max(taken).saturating_add(copied as i64);
        if !self.check {
            return Ok(true);
        }
        match self.check_allocation(held, &allocation, counted) {
            Ok(left_null) => {
                self.vllm_null_states = self.vllm_null_states.saturating_add(left_null as u64);
                Ok(true)
            }
            Err(error) => {
                // The request keeps what it holds, in a table safe to hand on (its own KV
                // is lost); the caller decides whether to finish it or to raise.
                self.make_safe(held, &allocation);
                Err(error)
            }
        }
    }

    /// Blocks for `external` connector-provided tokens after `local` computed ones, per group
    /// (vLLM's `allocate_external_computed_blocks`): only what the group's window still
    /// reads, recorded for zeroing unless the group's bit is in `skip_zeroing`.
    fn allocate_external_blocks(
        &mut self,
        held: &mut RequestBlocks,
        local: usize,
        external: usize,
        skip_zeroing: u64,
    ) {
        let zeroing = self.config.needs_kv_cache_zeroing;
        let groups = self.config.groups.iter().zip(&mut held.groups).zip(&mut self.new_block_ids);
        for (g, ((spec, blocks), ids)) in groups.enumerate() {
            let from =
                group::allocate_external_blocks(spec, &mut self.pool, blocks, local, external);
            let skipped = g < 64 && (skip_zeroing >> g) & 1 == 1;
            if zeroing && spec.kind.is_attention() && !skipped {
                ids.extend_from_slice(blocks.blocks.get(from..).unwrap_or_default());
            }
        }
    }

    /// The blocks the last successful `allocate_slots` took from the pool for `held` (the
    /// request it allocated for), per group.
    pub fn new_blocks<'a>(
        &'a self,
        held: &'a RequestBlocks,
    ) -> impl Iterator<Item = &'a [u32]> + 'a {
        held.groups
            .iter()
            .zip(&self.new_from)
            .map(|(g, &from)| g.blocks.get(from..).unwrap_or_default())
    }
}
