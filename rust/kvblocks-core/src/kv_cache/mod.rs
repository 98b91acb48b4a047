//! The allocation engine: vLLM 0.33's `KVCacheManager`, its coordinators (unitary, hybrid,
//! no prefix cache) and single-type managers (full attention, sliding window, chunked local
//! attention, Mamba with and without prefix caching) over one [`BlockPool`], written once.
//!
//! The engine owns the pool and the rules; each request's block tables ([`RequestBlocks`])
//! belong to the caller, which also owns the request's tokens and hashes: the vLLM manager
//! ([`KvCacheManager`]) keeps tables by request id and reads everything else from vLLM's
//! `Request`, and the embedded [`crate::BlockManager`] keeps them beside its token buffers
//! and adds copy-on-write and token verification on top. Every call takes the request's
//! state it needs as arguments ([`RequestState`], a [`HashSource`]).

mod group;
mod hit;
mod invariant;
mod mamba;
mod manager;
mod spec;
#[cfg(test)]
mod tests;

pub use group::{GroupBlocks, RequestBlocks};
pub use hit::CacheHit;
pub use mamba::MambaState;
pub use manager::{KvCacheManager, ManagerEvent};
pub use spec::{AttentionKind, EngineConfig, GroupSpec};

use crate::hashing::BlockHash;
use crate::pool::{BlockPool, CacheKey, KvEvent, Registered, NULL_BLOCK};
use crate::{CoreError, CoreResult};

/// Read access to a request's block hashes (vLLM's `request.block_hashes`).
pub trait HashSource {
    fn len(&self) -> usize;
    /// Hash `index` (< `len()`); an error if it is not a 16- or 32-byte hash.
    fn get(&self, index: usize) -> CoreResult<BlockHash>;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HashSource for [BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }

    fn get(&self, index: usize) -> CoreResult<BlockHash> {
        <[BlockHash]>::get(self, index).copied().ok_or(CoreError::OutOfRange {
            what: "block hash index",
            value: index,
            limit: <[BlockHash]>::len(self),
        })
    }
}

/// The hashes of blocks `first..end` of a request, read before a call changes anything.
#[derive(Debug, Default)]
struct Keys {
    first: usize,
    end: usize,
    hashes: Vec<BlockHash>,
}

impl Keys {
    fn get(&self, index: usize) -> Option<BlockHash> {
        index.checked_sub(self.first).and_then(|i| self.hashes.get(i)).copied()
    }
}

/// What the engine reads of a request at each call (vLLM's `Request` fields).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestState {
    /// `request.num_tokens`: prompt and accepted output tokens.
    pub num_tokens: usize,
    /// `request.num_computed_tokens`
    pub num_computed_tokens: usize,
    pub num_prompt_tokens: usize,
    /// `request.shared_prefix_boundary`: where a longer cached prefix of another request
    /// ends (the third value of `get_computed_blocks`), 0 for none.
    pub shared_prefix_boundary: usize,
    /// `request.num_in_flight_tokens`: scheduled tokens whose step has not come back yet.
    pub num_in_flight_tokens: usize,
    /// The request waits for admission (vLLM's status WAITING or PREEMPTED).
    pub is_waiting: bool,
}

/// The arguments of vLLM's `allocate_slots` that the engine implements.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs {
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    pub num_lookahead_tokens: usize,
    pub reserved_blocks: usize,
    pub full_sequence_must_fit: bool,
    pub delay_cache_blocks: bool,
    /// Whether any request is already scheduled this step (the watermark applies only then).
    pub has_scheduled_reqs: bool,
    /// Blocks a layer above takes from the pool in the same call (copy-on-write).
    pub extra_blocks: usize,
    /// vLLM's `num_external_computed_tokens`: tokens after the prefix hits whose KV a KV
    /// connector provides (they get fresh blocks, registered once the load is done).
    pub num_external_computed_tokens: usize,
    /// vLLM's `skip_zeroing_group_ids` as a bit mask (bit `g`: group `g`'s blocks for
    /// external tokens are written by an asynchronous load, so they are not zeroed).
    pub skip_zeroing_groups: u64,
}

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

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

/// vLLM passes the shared empty result when there is nothing to adopt, and adopts a result
/// with any block (null ones included).
fn no_hits(hits: &[&[u32]]) -> bool {
    hits.iter().all(|h| h.is_empty())
}

#[derive(Debug, Clone)]
pub struct KvCacheEngine {
    config: EngineConfig,
    pool: BlockPool,
    /// The groups looked up together, in vLLM's order.
    sets: Vec<hit::LookupSet>,
    /// Whether any group drops its last hit block for EAGLE.
    any_drop: bool,
    /// Whether some group frees blocks out of a window or chunk (else nothing is skipped).
    windowed: bool,
    /// Per group: the group's hits are EAGLE-aware (vLLM's per-manager `use_eagle`).
    eagle_aware: Vec<bool>,
    /// What the last `allocate_slots` or `cache_blocks` registered (for a layer above that
    /// keeps its own record of registered blocks).
    registered: Vec<Registered>,
    /// Per group, where the blocks the last `allocate_slots` took from the pool start in the
    /// request's table (they are appended; see [`KvCacheEngine::new_blocks`]).
    new_from: Vec<usize>,
    /// Per group, the fresh blocks recorded for zeroing since the last
    /// [`KvCacheEngine::take_new_block_ids`] (vLLM's `new_block_ids` of each single-type
    /// manager); stays empty unless the config needs KV-cache zeroing.
    new_block_ids: Vec<Vec<u32>>,
    /// Per group, a Mamba group's prefix-caching parameters (`None` for other groups, and
    /// for every group without prefix caching).
    align: Vec<Option<mamba::Align>>,
    /// Whether any group is such a Mamba group.
    any_align: bool,
    /// The keys Mamba groups registered since the scheduler step began (see
    /// [`Self::new_step_starts`]).
    cached_this_step: mamba::StepKeys,
    /// The Mamba states the last `allocate_slots` or `cache_blocks` registered as full
    /// blocks (see [`Self::last_boundary_states`]).
    boundary_states: Vec<BoundaryState>,
}

/// A Mamba state at a block boundary that a `cache_blocks` pass registered (vLLM's
/// align-mode boundary-state offer, which a KV connector may offload by block id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundaryState {
    pub group: u32,
    pub block: u32,
    /// The tokens the state follows (the block's key covers them).
    pub num_tokens: usize,
}

impl KvCacheEngine {
    pub fn new(config: EngineConfig) -> CoreResult<Self> {
        config.validate()?;
        let pool = BlockPool::new(config.num_blocks, config.enable_caching, config.enable_events)?;
        let drop = hit::eagle_drop_groups(&config);
        let sets = hit::lookup_sets(&config, &drop);
        // A lookup set drops for all its groups when any member does.
        let mut eagle_aware = vec![false; config.groups.len()];
        for set in sets.iter().filter(|s| s.drop_eagle) {
            for &g in &set.groups {
                if let Some(aware) = eagle_aware.get_mut(g) {
                    *aware = true;
                }
            }
        }
        let any_drop = drop.iter().any(|&d| d);
        let new_from = vec![0; config.groups.len()];
        let windowed = config.is_windowed();
        let registered = Vec::new();
        let new_block_ids = vec![Vec::new(); config.groups.len()];
        let align: Vec<_> = config.groups.iter().map(|g| mamba::Align::of(g, &config)).collect();
        let any_align = align.iter().any(Option::is_some);
        Ok(Self {
            config,
            pool,
            sets,
            any_drop,
            windowed,
            eagle_aware,
            registered,
            new_from,
            new_block_ids,
            align,
            any_align,
            cached_this_step: mamba::StepKeys::default(),
            boundary_states: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub(crate) fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    pub fn num_groups(&self) -> usize {
        self.config.groups.len()
    }

    /// vLLM's `get_computed_blocks` search: the cached prefix every group can serve, at most
    /// `max_length` tokens long. Takes no references.
    pub fn find_longest_cache_hit(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<CacheHit> {
        if !self.config.enable_caching {
            return Ok(CacheHit::empty(self.num_groups()));
        }
        let prefix = self.lookup_prefix(hashes, max_length)?;
        let block_size = self.config.block_size();
        let search = hit::Search { pool: &self.pool, hashes: &prefix, block_size };
        Ok(hit::find_longest_cache_hit(&search, &self.sets, self.num_groups(), max_length))
    }

    /// vLLM's `find_longest_cache_hit_per_group` (the lookup for a KV connector that accepts
    /// hybrid hits diverging between groups): each group's own longest hit, at most
    /// `max_length` tokens long, and its length; the groups need not agree. Takes no
    /// references.
    pub fn find_cache_hit_per_group(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<(Vec<Vec<u32>>, Vec<usize>)> {
        if !self.config.enable_caching {
            return Ok((vec![Vec::new(); self.num_groups()], vec![0; self.num_groups()]));
        }
        let prefix = self.lookup_prefix(hashes, max_length)?;
        let block_size = self.config.block_size();
        let search = hit::Search { pool: &self.pool, hashes: &prefix, block_size };
        Ok(hit::find_cache_hit_per_group(&search, &self.sets, self.num_groups(), max_length))
    }

    /// The request's hashes a lookup of at most `max_length` tokens reads (one block past
    /// it, for an EAGLE group's dropped block).
    fn lookup_prefix(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<Vec<BlockHash>> {
        let needed = hashes.len().min((max_length / self.config.block_size()).saturating_add(1));
        (0..needed).map(|i| hashes.get(i)).collect()
    }

    /// The hits must have the shape a lookup gives: one list per group of cached blocks,
    /// after a leading run of null ones in a window or chunk group, adopted only at a
    /// request's first allocation and covering no more than the request's tokens.
    fn check_hits(
        &self,
        held: &RequestBlocks,
        hits: &[&[u32]],
        num_computed: usize,
        num_tokens: usize,
    ) -> CoreResult<()> {
        if no_hits(hits) {
            return Ok(());
        }
        if hits.len() != self.num_groups() {
            return Err(invalid(format!(
                "new_computed_blocks has {} groups, the KV cache {}",
                hits.len(),
                self.num_groups()
            )));
        }
        if !self.config.enable_caching {
            return Err(invalid("prefix caching is disabled: there are no hits to adopt"));
        }
        if held.is_tracked() || held.holds_blocks() {
            return Err(invalid("prefix hits can only be adopted at a request's first allocation"));
        }
        if num_computed > num_tokens {
            return Err(invalid(format!(
                "{num_computed} computed tokens with prefix hits, but the request has only \
                 {num_tokens} tokens"
            )));
        }
        for (group, (blocks, spec)) in hits.iter().zip(&self.config.groups).enumerate() {
            let nulls = if spec.kind.is_full() {
                0
            } else {
                blocks.iter().take_while(|&&b| b == NULL_BLOCK).count()
            };
            for (index, &block) in blocks.iter().enumerate().skip(nulls) {
                let cached = self.pool.key(block).is_some_and(|k| k.group as usize == group);
                if block == NULL_BLOCK || !cached {
                    return Err(invalid(format!(
                        "new_computed_blocks[{group}][{index}] = {block} is not a block cached \
                         for group {group}"
                    )));
                }
            }
        }
        Ok(())
    }

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
    fn blocks_needed(
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

    /// vLLM's `allocate_slots`: true when it allocated ([`Self::new_blocks`] are the blocks it
    /// took for each group), false when the pool cannot provide them. A false return may
    /// still have freed blocks that fell out of a sliding window or chunk (vLLM frees those
    /// first, whatever the outcome); an error changes no block or table (only
    /// [`Self::last_registered`], which describes every call, failed ones included), but for
    /// [`CoreError::Unsound`]: a table the allocation left does not hold what its request
    /// needs (a bug, caught after the fact: see `invariant`). `hits`
    /// are the prefix hits per group (none: no group has any). `before_new_blocks` runs once
    /// the allocation is certain, after the hits are adopted and before new blocks are taken
    /// (the embedded manager's copy-on-write, which takes `args.extra_blocks` blocks).
    pub fn allocate_slots(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        args: &AllocateArgs,
        hits: &[&[u32]],
        hashes: &(impl HashSource + ?Sized),
        before_new_blocks: impl FnOnce(&mut BlockPool, &mut RequestBlocks),
    ) -> CoreResult<bool> {
        self.registered.clear();
        self.boundary_states.clear();
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
            Keys::default()
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
        // vLLM's `needed + watermark > free - reserved` (the count may be negative); and
        // never more blocks than are free (where vLLM's count falls short, its pool runs dry).
        let extra =
            args.extra_blocks.saturating_add(watermark).saturating_add(args.reserved_blocks);
        let free_before = self.pool.num_free_blocks();
        if needed.saturating_add(extra as i64) > free_before as i64
            || taken.saturating_add(args.extra_blocks as i64) > free_before as i64
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
        before_new_blocks(&mut self.pool, held);
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
        // Most decode steps fill no block: nothing to register.
        if !args.delay_cache_blocks
            && (keys.end > keys.first || self.tail_may_act(held, request, cache_upto))
        {
            self.cache_with_keys(held, request, cache_upto, &keys, hashes);
        }
        let allocation = invariant::Allocation {
            slots,
            main,
            computed,
            total,
            first,
            taken: free_before.saturating_sub(self.pool.num_free_blocks()),
        };
        let counted = needed.max(taken).saturating_add(args.extra_blocks as i64);
        self.check_allocation(held, &allocation, counted)?;
        Ok(true)
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

    /// Records the attention groups' blocks the last `allocate_slots` took for the worker to
    /// zero (vLLM records them as its managers allocate them).
    fn record_new_blocks(&mut self, held: &RequestBlocks) {
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

    /// vLLM's `take_new_block_ids`: the blocks recorded for zeroing since the last call,
    /// group by group (each group's in allocation order), and forgets them.
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        self.new_block_ids.iter_mut().flat_map(std::mem::take).collect()
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

    /// The tokens of `num_computed` a group may register (vLLM's coordinator
    /// `get_num_cacheable_tokens`): finalized tokens only, and with EAGLE in a hybrid
    /// layout at most one block past the last block-aligned prefix.
    fn cacheable_tokens(&self, num_computed: usize, eagle_aware: bool) -> usize {
        let reprefillable = self.config.num_prefill_lookahead.saturating_sub(1);
        let finalized = num_computed.saturating_sub(reprefillable);
        if self.num_groups() == 1 {
            return finalized;
        }
        let b = self.config.block_size();
        let aligned = num_computed / b * b;
        if eagle_aware && aligned > 0 {
            finalized.min((finalized / b * b).saturating_add(b))
        } else {
            aligned
        }
    }

    /// vLLM's `cache_blocks`: registers each group's full blocks up to `num_computed` tokens
    /// (as far as the request has hashes).
    pub fn cache_blocks(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        num_computed: usize,
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<()> {
        self.registered.clear();
        self.boundary_states.clear();
        let keys = self.read_keys(held, hashes, num_computed)?;
        if keys.end > keys.first || self.tail_may_act(held, request, num_computed) {
            self.cache_with_keys(held, request, num_computed, &keys, hashes);
        }
        Ok(())
    }

    /// The hashes registering up to `num_tokens` tokens may need (none without caching):
    /// from the first block some group has not registered yet, so that a decode step reads
    /// one hash, not the whole prompt's.
    fn read_keys(
        &self,
        held: &RequestBlocks,
        hashes: &(impl HashSource + ?Sized),
        num_tokens: usize,
    ) -> CoreResult<Keys> {
        if !self.config.enable_caching {
            return Ok(Keys::default());
        }
        let end = hashes.len().min(num_tokens / self.config.block_size());
        let first = held.groups.iter().map(|g| g.num_cached.unwrap_or(0)).min().unwrap_or(0);
        if first >= end {
            return Ok(Keys { first, end, hashes: Vec::new() });
        }
        let hashes = (first..end).map(|i| hashes.get(i)).collect::<CoreResult<_>>()?;
        Ok(Keys { first, end, hashes })
    }

    /// `cache_blocks` once the hashes are read (`keys` holds every hash it may need; a Mamba
    /// group's checkpoint or prompt tail may read one more from `hashes`). A request holding
    /// fewer blocks than its full ones (its tokens outgrew `max_model_len`) registers the
    /// blocks it has.
    fn cache_with_keys(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        num_computed: usize,
        keys: &Keys,
        hashes: &(impl HashSource + ?Sized),
    ) {
        let b = self.config.block_size();
        let groups = self.config.groups.iter().zip(&self.eagle_aware).zip(&self.align);
        for (g, (((spec, &eagle), align), blocks)) in groups.zip(&mut held.groups).enumerate() {
            let num_tokens = self.cacheable_tokens(num_computed, eagle);
            let done = blocks.num_cached.unwrap_or(0);
            let full = (num_tokens.min(keys.end * b) / b).min(blocks.blocks.len());
            if done < full {
                let boundaries = || {
                    let mut boundaries = self.replay_boundaries(request.num_prompt_tokens);
                    if request.shared_prefix_boundary > 0 {
                        boundaries.push(request.shared_prefix_boundary);
                        if eagle {
                            // A sibling diverging right after the junction has no EAGLE peek block.
                            boundaries.extend(request.shared_prefix_boundary.checked_sub(b));
                        }
                    }
                    boundaries
                };
                let mask = match align {
                    Some(align) => align.reachable_mask(done..full, boundaries),
                    None => group::cacheable_mask(
                        spec,
                        eagle,
                        done..full,
                        self.config.retention_interval,
                        boundaries,
                    ),
                };
                let mut skipped = Vec::new();
                for index in done..full {
                    let (Some(&block), Some(hash)) = (blocks.blocks.get(index), keys.get(index))
                    else {
                        continue;
                    };
                    let masked = mask.as_ref().and_then(|m| m.get(index - done)) == Some(&false);
                    if block == NULL_BLOCK || masked {
                        skipped.push(index);
                        continue;
                    }
                    self.pool.cache_block(block, CacheKey::new(hash, g as u32), (index + 1) * b);
                }
                blocks.num_cached = Some(full);
                let registered = Registered { group: g as u32, first: done, end: full, skipped };
                if self.pool.events_enabled() {
                    self.pool.push_event(KvEvent::Registered(registered.clone()));
                }
                self.registered.push(registered);
            }
            let Some(align) = align else { continue };
            let tail = mamba::Tail {
                group: g as u32,
                num_tokens,
                num_prompt_tokens: request.num_prompt_tokens,
                shared_prefix_boundary: request.shared_prefix_boundary,
            };
            let hash = |i: usize| keys.get(i).or_else(|| hashes.get(i).ok());
            let tail_key = mamba::cache_tail(align, &mut self.pool, blocks, &tail, hash);
            // No request may adopt a state registered during this step; each state the pass
            // registered as a full block (keyed now, by it or by an earlier tail step) is
            // offered, in column order.
            self.cached_this_step.extend(tail_key);
            for &block in blocks.blocks.get(done..full).unwrap_or_default() {
                if let Some(key) = self.pool.key(block) {
                    self.cached_this_step.insert(*key);
                    let num_tokens = self.pool.key_num_tokens(block);
                    self.boundary_states.push(BoundaryState { group: g as u32, block, num_tokens });
                }
            }
        }
    }

    /// Whether registering up to `num_computed` tokens may key or drop a Mamba state beyond
    /// the full blocks (`mamba::cache_tail`): a group has a checkpoint, or its cacheable
    /// tokens end at the prompt's last reusable state.
    fn tail_may_act(
        &self,
        held: &RequestBlocks,
        request: &RequestState,
        num_computed: usize,
    ) -> bool {
        self.any_align
            && self.align.iter().zip(&held.groups).zip(&self.eagle_aware).any(
                |((align, blocks), &eagle)| {
                    align.is_some_and(|align| {
                        blocks.mamba.checkpoint.is_some()
                            || self.cacheable_tokens(num_computed, eagle)
                                == align.checkpoint_position(request.num_prompt_tokens)
                    })
                },
            )
    }

    /// vLLM's `new_step_starts`, called as each scheduler step begins: Mamba states
    /// registered before it may be adopted again.
    pub fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }

    /// Where a later request replaying a prompt of `num_prompt_tokens` can resume (vLLM's
    /// `replay_boundaries`): before its last token, and with EAGLE the block below each of
    /// the two block-aligned ends a resend or a longer sibling reaches.
    fn replay_boundaries(&self, num_prompt_tokens: usize) -> Vec<usize> {
        if !self.any_drop {
            return vec![num_prompt_tokens.saturating_sub(1)];
        }
        let b = self.config.block_size();
        let resend = num_prompt_tokens.saturating_sub(1) / b * b;
        let extension = num_prompt_tokens / b * b;
        let mut out = vec![resend.saturating_sub(b), extension.saturating_sub(b)];
        out.sort_unstable();
        out.dedup();
        out
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
    fn prefill_end(&self, prefill_end: usize) -> usize {
        if self.any_align && self.config.retention_interval == Some(0) {
            prefill_end
        } else {
            0
        }
    }

    /// vLLM's `free`: every group releases the request's blocks, last block first.
    pub fn free(&mut self, held: RequestBlocks) {
        for blocks in held.groups {
            group::free(&mut self.pool, blocks);
        }
    }

    /// vLLM's `estimate_cached_tokens`: per group the longest prefix any of the request's
    /// blocks is registered for; the shortest of those.
    pub fn estimate_cached_tokens(&self, held: &RequestBlocks) -> usize {
        held.groups
            .iter()
            .map(|g| g.blocks.iter().map(|&b| self.pool.key_num_tokens(b)).max().unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// What the last `allocate_slots` or `cache_blocks` call registered, per group.
    pub fn last_registered(&self) -> &[Registered] {
        &self.registered
    }

    /// The Mamba states the last `allocate_slots` or `cache_blocks` call registered as full
    /// blocks, in group then column order (with prefix caching in Mamba groups only).
    pub fn last_boundary_states(&self) -> &[BoundaryState] {
        &self.boundary_states
    }
}
