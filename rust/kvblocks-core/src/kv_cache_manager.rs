//! vLLM 0.33's `KVCacheManager` for one full-attention group, on block hashes the caller
//! owns: the engine under `kvblocks.vllm.KVCacheManager`.
//!
//! Unlike [`crate::BlockManager`], this manager keeps no tokens and no hashes: vLLM's
//! `Request` owns them (`request.block_hashes`, `request.num_tokens`,
//! `request.num_computed_tokens`), and the scheduler changes them behind the manager's back
//! (it truncates `block_hashes`, rolls `num_computed_tokens` back on preemption). So every
//! call takes what it needs of that state as arguments, and the hashes through a
//! [`HashSource`] that is read only where the call needs them: the prefix a lookup scans, the
//! blocks a call registers. What the manager owns is vLLM's own: the block pool, and per
//! request its block table and how many of its blocks are registered in the cache.

use crate::hashing::BlockHash;
use crate::pool::{BlockPool, DigestHasher, KvEvent, NULL_BLOCK};
use crate::{CoreError, CoreResult};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

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

/// Construction parameters (vLLM's `KVCacheManager` arguments that matter for one group).
#[derive(Debug, Clone)]
pub struct KvCacheConfig {
    pub num_blocks: u32,
    pub block_size: usize,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub enable_events: bool,
    /// vLLM's `watermark`: `int(watermark * num_blocks)` blocks kept free at admission.
    pub watermark_blocks: usize,
}

/// The per-call state of vLLM's `allocate_slots` (the request's fields and the arguments).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs {
    /// `request.num_tokens`
    pub num_tokens: usize,
    /// `request.num_computed_tokens`
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    pub num_new_computed_tokens: usize,
    pub num_lookahead_tokens: usize,
    pub reserved_blocks: usize,
    pub full_sequence_must_fit: bool,
    pub delay_cache_blocks: bool,
    /// vLLM's `has_scheduled_reqs`: some request is already scheduled in this step.
    pub has_scheduled_reqs: bool,
    /// The request is being admitted: its status is `WAITING` or `PREEMPTED`.
    pub waiting_or_preempted: bool,
}

impl AllocateArgs {
    /// vLLM's rule: the watermark keeps blocks free only against a waiting or preempted
    /// request, and only when some request is already scheduled in the step.
    pub fn applies_watermark(&self) -> bool {
        self.has_scheduled_reqs && self.waiting_or_preempted
    }
}

/// One KV-cache event, in the order the pool produced it. A `Stored` range is described by
/// the request's logical blocks `[first, end)`: the caller, who owns the request's tokens
/// and keys, builds vLLM's `BlockStored` from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerEvent {
    Removed(BlockHash),
    Stored { request_id: String, first: usize, end: usize },
    AllBlocksCleared,
}

#[derive(Debug, Default, Clone)]
struct RequestBlocks {
    blocks: Vec<u32>,
    /// vLLM's `num_cached_block[request_id]`: present once the request adopted prefix hits
    /// or registered a block; the count of its leading blocks registered in the cache.
    num_cached: Option<usize>,
}

type IdMap<V> = HashMap<String, V, BuildHasherDefault<DigestHasher>>;

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: KvCacheConfig,
    pool: BlockPool,
    requests: IdMap<RequestBlocks>,
    events: Vec<ManagerEvent>,
}

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

impl KvCacheManager {
    pub fn new(config: KvCacheConfig) -> CoreResult<Self> {
        if config.block_size == 0 {
            return Err(CoreError::InvalidSize { what: "block_size (must be >= 1)", value: 0 });
        }
        if config.num_blocks == 0 {
            return Err(CoreError::InvalidSize { what: "num_blocks (must be >= 1)", value: 0 });
        }
        let pool = BlockPool::new(config.num_blocks, config.enable_caching, config.enable_events)?;
        Ok(Self { config, pool, requests: IdMap::default(), events: Vec::new() })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// vLLM's `get_computed_blocks` scan: the cached blocks of the first hashes, at most
    /// `max_blocks` of them, stopping at the first miss (the earliest registered block of a
    /// hash that several blocks share). Takes no references.
    pub fn lookup(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_blocks: usize,
    ) -> CoreResult<Vec<u32>> {
        let mut hits = Vec::new();
        if !self.config.enable_caching {
            return Ok(hits);
        }
        for index in 0..max_blocks.min(hashes.len()) {
            match self.pool.lookup(&hashes.get(index)?).first() {
                Some(&block) => hits.push(block),
                None => break,
            }
        }
        Ok(hits)
    }

    /// The blocks the request would need for `num_tokens` slots (vLLM's
    /// `get_num_blocks_to_allocate` for a full-attention group).
    fn blocks_needed(
        &self,
        held: Option<&RequestBlocks>,
        hits: &[u32],
        num_tokens: usize,
    ) -> usize {
        let required = num_tokens.div_ceil(self.config.block_size);
        let num_held = held.map_or(0, |r| r.blocks.len());
        if held.is_some_and(|r| r.num_cached.is_some()) {
            return required.saturating_sub(num_held);
        }
        // Touching a free cached hit takes it out of the free queue: it counts as needed.
        let evictable = hits.iter().filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0);
        required.saturating_sub(hits.len() + num_held) + evictable.count()
    }

    fn check_hits(&self, held: Option<&RequestBlocks>, hits: &[u32]) -> CoreResult<()> {
        if hits.is_empty() {
            return Ok(());
        }
        if !self.config.enable_caching {
            return Err(invalid("prefix caching is disabled: there are no hits to adopt"));
        }
        if held.is_some_and(|r| r.num_cached.is_some() || !r.blocks.is_empty()) {
            return Err(invalid("prefix hits can only be adopted at a request's first allocation"));
        }
        let num_blocks = self.pool.num_blocks();
        for (index, &block) in hits.iter().enumerate() {
            if block == NULL_BLOCK || block as usize >= num_blocks {
                return Err(invalid(format!(
                    "new_computed_blocks[{index}] = {block} is not a cached block"
                )));
            }
            if self.pool.key(block).is_none() {
                return Err(invalid(format!(
                    "new_computed_blocks[{index}] = {block} is not registered in the prefix cache"
                )));
            }
        }
        Ok(())
    }

    /// vLLM's `allocate_slots`. Returns the newly allocated blocks, or `None` (nothing
    /// changed) when the pool cannot provide them. An error changes nothing either.
    pub fn allocate_slots(
        &mut self,
        request_id: &str,
        args: &AllocateArgs,
        hits: &[u32],
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<Option<Vec<u32>>> {
        if args.num_new_tokens == 0 && args.num_new_computed_tokens == 0 {
            return Err(invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        let max_len = self.config.max_model_len;
        let held = self.requests.get(request_id);
        self.check_hits(held, hits)?;
        let local = args.num_computed_tokens.saturating_add(args.num_new_computed_tokens);
        let total = local.min(max_len);
        let watermark = if args.applies_watermark() { self.config.watermark_blocks } else { 0 };
        let free = self.pool.num_free_blocks();
        if args.full_sequence_must_fit {
            let whole = self.blocks_needed(held, hits, args.num_tokens.min(max_len));
            if whole.saturating_add(watermark) > free {
                return Ok(None);
            }
        }
        let main = total.saturating_add(args.num_new_tokens);
        let slots = main.saturating_add(args.num_lookahead_tokens).min(max_len);
        let needed = self.blocks_needed(held, hits, slots);
        if needed.saturating_add(watermark).saturating_add(args.reserved_blocks) > free {
            return Ok(None);
        }

        // Read the hashes this call will register first: a bad one must change nothing.
        let target = slots.div_ceil(self.config.block_size);
        let held_blocks = held.map_or(0, |r| r.blocks.len()) + hits.len();
        let done = if hits.is_empty() {
            held.and_then(|r| r.num_cached).unwrap_or(0)
        } else {
            held_blocks
        };
        let to_cache = if args.delay_cache_blocks {
            Vec::new()
        } else {
            let num_blocks = held_blocks.max(target);
            self.keys_to_cache(done, main.min(args.num_tokens), num_blocks, hashes)?
        };

        // Nothing has changed up to here; from now on the allocation succeeds.
        if held.is_none() {
            self.requests.insert(request_id.to_owned(), RequestBlocks::default());
        }
        let request = self
            .requests
            .get_mut(request_id)
            .ok_or(CoreError::Internal("a request just inserted is missing"))?;
        if !hits.is_empty() {
            // check_hits: a first allocation with caching on.
            self.pool.touch(hits);
            request.blocks.extend_from_slice(hits);
            request.num_cached = Some(request.blocks.len());
        }
        let new_blocks = self.pool.get_new_blocks(target.saturating_sub(request.blocks.len()));
        request.blocks.extend_from_slice(&new_blocks);
        // The evictions of get_new_blocks are reported before what this call registers.
        Self::drain_pool_events(&mut self.pool, &mut self.events);
        let entry = (request_id, request);
        let (pool, events, b) = (&mut self.pool, &mut self.events, self.config.block_size);
        Self::register(pool, events, b, entry, done, to_cache);
        Ok(Some(new_blocks))
    }

    /// The hashes of the blocks `cache_blocks` would register: from block `done` up to the
    /// blocks full at `num_tokens` tokens, as far as the request has hashes and blocks.
    fn keys_to_cache(
        &self,
        done: usize,
        num_tokens: usize,
        num_blocks: usize,
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<Vec<BlockHash>> {
        if !self.config.enable_caching {
            return Ok(Vec::new());
        }
        let b = self.config.block_size;
        let full = (num_tokens.min(hashes.len().saturating_mul(b)) / b).min(num_blocks);
        (done..full.max(done)).map(|i| hashes.get(i)).collect()
    }

    /// Registers `request`'s blocks `done..done + keys.len()` under `keys` (vLLM's
    /// `cache_full_blocks`) and records one `Stored` event for them. Takes the fields it
    /// touches, so a caller holding the request needs no second lookup.
    fn register(
        pool: &mut BlockPool,
        events: &mut Vec<ManagerEvent>,
        block_size: usize,
        (request_id, request): (&str, &mut RequestBlocks),
        done: usize,
        keys: Vec<BlockHash>,
    ) {
        if keys.is_empty() {
            return;
        }
        let end = done + keys.len();
        let blocks = request.blocks.get(done..end).unwrap_or_default();
        for (index, (&block, key)) in (done..).zip(blocks.iter().zip(keys)) {
            pool.cache_block(block, key, (index + 1) * block_size);
        }
        request.num_cached = Some(end);
        if pool.events_enabled() {
            events.push(ManagerEvent::Stored {
                request_id: request_id.to_owned(),
                first: done,
                end,
            });
        }
    }

    /// vLLM's `cache_blocks`: registers the request's full blocks up to `num_tokens` tokens
    /// (as far as it has hashes) under their hashes. A request without blocks is left alone.
    pub fn cache_blocks(
        &mut self,
        request_id: &str,
        num_tokens: usize,
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<()> {
        let Some(request) = self.requests.get(request_id) else { return Ok(()) };
        let done = request.num_cached.unwrap_or(0);
        let keys = self.keys_to_cache(done, num_tokens, request.blocks.len(), hashes)?;
        let request = self
            .requests
            .get_mut(request_id)
            .ok_or(CoreError::Internal("a request found a moment ago is missing"))?;
        let entry = (request_id, request);
        Self::register(&mut self.pool, &mut self.events, self.config.block_size, entry, done, keys);
        Ok(())
    }

    /// vLLM's `free`: releases the request's blocks, last block first. Unknown ids are a
    /// no-op, as in vLLM (the scheduler frees requests that never got blocks).
    pub fn free(&mut self, request_id: &str) {
        if let Some(request) = self.requests.remove(request_id) {
            self.pool.free_blocks(request.blocks.iter().rev().copied());
        }
    }

    /// The request's block table (empty for an unknown id).
    pub fn block_ids(&self, request_id: &str) -> &[u32] {
        self.requests.get(request_id).map_or(&[], |r| r.blocks.as_slice())
    }

    /// vLLM's `estimate_cached_tokens`: the longest prefix that any of the request's blocks
    /// is registered for.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        let blocks = self.block_ids(request_id);
        blocks.iter().map(|&b| self.pool.key_num_tokens(b)).max().unwrap_or(0)
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.pool.reset_prefix_cache();
        Self::drain_pool_events(&mut self.pool, &mut self.events);
        done
    }

    /// The events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<ManagerEvent> {
        Self::drain_pool_events(&mut self.pool, &mut self.events);
        std::mem::take(&mut self.events)
    }

    fn drain_pool_events(pool: &mut BlockPool, events: &mut Vec<ManagerEvent>) {
        if !pool.events_enabled() {
            return;
        }
        for event in pool.take_events() {
            match event {
                KvEvent::BlockRemoved(hash) => events.push(ManagerEvent::Removed(hash)),
                KvEvent::AllBlocksCleared => events.push(ManagerEvent::AllBlocksCleared),
                KvEvent::BlockStored(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash::Sha256([i; 32])
    }

    fn manager(num_blocks: u32, block_size: usize) -> KvCacheManager {
        KvCacheManager::new(KvCacheConfig {
            num_blocks,
            block_size,
            max_model_len: 1 << 20,
            enable_caching: true,
            enable_events: true,
            watermark_blocks: 0,
        })
        .unwrap()
    }

    fn admit(
        m: &mut KvCacheManager,
        id: &str,
        hashes: &[BlockHash],
        num_tokens: usize,
    ) -> Vec<u32> {
        let b = m.config().block_size;
        let hits = m.lookup(hashes, (num_tokens - 1) / b).unwrap();
        let args = AllocateArgs {
            num_tokens,
            num_new_tokens: num_tokens - hits.len() * b,
            num_new_computed_tokens: hits.len() * b,
            full_sequence_must_fit: true,
            ..AllocateArgs::default()
        };
        m.allocate_slots(id, &args, &hits, hashes).unwrap().unwrap();
        m.block_ids(id).to_vec()
    }

    fn free_queue(m: &KvCacheManager) -> Vec<u32> {
        m.pool().free_block_ids().collect()
    }

    #[test]
    fn worked_trace_of_vllm_semantics() {
        // N = 11, B = 16: R0 = 48 shared tokens + 7, R1 = the same 48 + 5.
        let mut m = manager(11, 16);
        let shared = [h(1), h(2), h(3)];
        assert_eq!(admit(&mut m, "r0", &shared, 55), [1, 2, 3, 4]);
        assert_eq!(admit(&mut m, "r1", &shared, 53), [1, 2, 3, 5]);
        assert_eq!(m.num_free_blocks(), 5);
        assert_eq!(m.estimate_cached_tokens("r1"), 48);
        m.free("r0");
        m.free("r1");
        assert_eq!(free_queue(&m), [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
        // 160 fresh tokens take every free block and evict the three cached ones.
        let fresh: Vec<BlockHash> = (10..20).map(h).collect();
        admit(&mut m, "r2", &fresh[..9], 160);
        assert!(free_queue(&m).is_empty());
        let removed: Vec<_> =
            m.take_events().into_iter().filter(|e| matches!(e, ManagerEvent::Removed(_))).collect();
        assert_eq!(
            removed,
            [3, 2, 1].map(|i| ManagerEvent::Removed(h(i))),
            "evicted in queue order, tail of the chain first"
        );
    }

    #[test]
    fn refusals_change_nothing() {
        let mut m = manager(5, 4);
        admit(&mut m, "a", &[h(1), h(2)], 9); // 3 blocks, 1 free
        let before = (free_queue(&m), m.block_ids("a").to_vec());
        let args = AllocateArgs { num_tokens: 9, num_new_tokens: 9, ..AllocateArgs::default() };
        assert_eq!(m.allocate_slots("b", &args, &[], &[][..]).unwrap(), None);
        let zero = AllocateArgs::default();
        assert!(m.allocate_slots("b", &zero, &[], &[][..]).is_err());
        assert!(m.allocate_slots("b", &args, &[0], &[][..]).is_err()); // the null block
        assert!(m.allocate_slots("b", &args, &[99], &[][..]).is_err());
        assert!(m.allocate_slots("b", &args, &[3], &[][..]).is_err()); // not cached
        assert!(m.allocate_slots("a", &args, &[1], &[][..]).is_err()); // not first allocation
        assert_eq!((free_queue(&m), m.block_ids("a").to_vec()), before);
        assert_eq!(m.block_ids("b"), &[] as &[u32]);
        m.free("never-seen");
    }

    #[test]
    fn watermark_and_reserved_blocks_keep_headroom() {
        let fresh = || {
            KvCacheManager::new(KvCacheConfig {
                watermark_blocks: 3,
                ..manager(6, 4).config().clone()
            })
            .unwrap()
        };
        let mut args = AllocateArgs {
            num_tokens: 12,
            num_new_tokens: 12,
            has_scheduled_reqs: true,
            waiting_or_preempted: true,
            ..AllocateArgs::default()
        };
        assert_eq!(fresh().allocate_slots("a", &args, &[], &[][..]).unwrap(), None); // 3 + 3 > 5
                                                                                     // Not against a running request, nor while nothing else is scheduled.
        for (scheduled, admitting) in [(true, false), (false, true)] {
            args.has_scheduled_reqs = scheduled;
            args.waiting_or_preempted = admitting;
            let new = fresh().allocate_slots("a", &args, &[], &[][..]).unwrap();
            assert_eq!(new, Some(vec![1, 2, 3]));
        }
        args.reserved_blocks = 3;
        assert_eq!(fresh().allocate_slots("a", &args, &[], &[][..]).unwrap(), None);
        args.reserved_blocks = 2;
        let new = fresh().allocate_slots("a", &args, &[], &[][..]).unwrap();
        assert_eq!(new, Some(vec![1, 2, 3]));
    }

    #[test]
    fn caching_follows_the_hashes_the_caller_has() {
        let mut m = manager(8, 2);
        let args = AllocateArgs { num_tokens: 6, num_new_tokens: 6, ..AllocateArgs::default() };
        // Only one hash exists yet: only one block is registered.
        m.allocate_slots("a", &args, &[], &[h(1)][..]).unwrap().unwrap();
        assert_eq!(m.lookup(&[h(1), h(2)][..], 9).unwrap(), [1]);
        m.cache_blocks("a", 6, &[h(1), h(2), h(3)][..]).unwrap();
        assert_eq!(m.lookup(&[h(1), h(2), h(3)][..], 9).unwrap(), [1, 2, 3]);
        assert_eq!(m.lookup(&[h(1), h(2), h(3)][..], 2).unwrap(), [1, 2]);
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
        let mut m = manager(4, 2);
        admit(&mut m, "a", &[h(1)], 3);
        assert!(!m.reset_prefix_cache());
        m.free("a");
        m.take_events();
        assert!(m.reset_prefix_cache());
        assert_eq!(m.take_events(), [ManagerEvent::AllBlocksCleared]);
        assert!(m.lookup(&[h(1)][..], 1).unwrap().is_empty());
    }
}
