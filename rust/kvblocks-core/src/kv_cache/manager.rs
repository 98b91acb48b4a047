//! vLLM 0.33's `KVCacheManager` on block hashes the caller owns, over one
//! [`KvCacheCoordinator`]: the Rust side of `kvblocks.vllm.KVCacheManager` (through the PyO3
//! class `kvblocks._core.KVCacheManager`).
//!
//! This manager keeps no tokens and no hashes: vLLM's `Request` owns them
//! (`request.block_hashes`, `request.num_tokens`, `request.num_computed_tokens`), and the
//! scheduler changes them behind the manager's back (it truncates `block_hashes`, rolls
//! `num_computed_tokens` back on preemption). So every call takes what it needs of that
//! state as arguments. What the manager owns is vLLM's own: the block pool and, per request
//! and group, its block table and how many of its blocks are registered in the cache.

use super::{
    AllocateArgs, BoundaryState, CacheHit, CoordinatorConfig, HashSource, KvCacheCoordinator,
    RequestBlocks,
};
use super::{AnyCached, RequestState};
use crate::hashing::BlockHash;
use crate::pool::{BlockPool, DigestHasher, KvEvent};
use crate::{CoreError, CoreResult};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// One KV-cache event, in the order the pool produced it. A `Stored` range is one group's
/// logical blocks `[first, end)` of a request, less the `skipped` indices (null blocks): the
/// caller, who owns the request's tokens and keys, builds vLLM's `BlockStored` from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerEvent {
    Removed { hash: BlockHash, group: u32 },
    Stored { request_id: String, group: u32, first: usize, end: usize, skipped: Vec<usize> },
    AllBlocksCleared,
}

type IdMap<V> = HashMap<String, V, BuildHasherDefault<DigestHasher>>;

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    coordinator: KvCacheCoordinator,
    requests: IdMap<RequestBlocks>,
    events: Vec<ManagerEvent>,
    /// Mamba states registered since the last [`Self::take_boundary_states`], with the
    /// request that registered each, in call order.
    boundary_states: Vec<(String, BoundaryState)>,
    /// [`Self::num_cached_tokens`]'s last answer per request.
    probes: IdMap<Probe>,
    /// Whether an unsound allocation is contained to its request (see
    /// [`Self::contain_unsound`]) instead of raised.
    contain: bool,
    /// The requests whose allocation was unsound since the last [`Self::take_contained`],
    /// with what was wrong.
    contained: Vec<(String, String)>,
    /// A test's planted fault: the request whose next allocation frees a block of its own
    /// table before the check (`test-faults` builds only).
    #[cfg(feature = "test-faults")]
    fault: Option<String>,
}

/// What a probe found of a request's cached prefix: the pool's removal count then, and the
/// prefix's blocks (valid while that count stays the same).
#[derive(Debug, Clone)]
struct Probe {
    removals: u64,
    blocks: Vec<u32>,
}

/// Probes remembered at most (the requests a scheduler's admission window probes are far
/// fewer; past it the memory is dropped and refilled).
const MAX_PROBES: usize = 1 << 12;

impl KvCacheManager {
    pub fn new(config: CoordinatorConfig) -> CoreResult<Self> {
        Ok(Self {
            coordinator: KvCacheCoordinator::new(config)?,
            requests: IdMap::default(),
            events: Vec::new(),
            boundary_states: Vec::new(),
            probes: IdMap::default(),
            contain: false,
            contained: Vec::new(),
            #[cfg(feature = "test-faults")]
            fault: None,
        })
    }

    /// With `contain`, an allocation that fails its check ([`CoreError::Unsound`]) does not
    /// raise: the request keeps a table safe to hand to a worker (see
    /// [`KvCacheCoordinator::allocate_slots`]), the call returns its new blocks as if it had
    /// succeeded, and the request and the error wait in [`Self::take_contained`] for the
    /// layer above to finish the request with an error.
    pub fn contain_unsound(&mut self, contain: bool) {
        self.contain = contain;
    }

    /// See [`KvCacheCoordinator::set_check`] (benchmarks only).
    pub fn set_check(&mut self, check: bool) {
        self.coordinator.set_check(check);
    }

    /// The requests contained since the last call, each with the error's text.
    pub fn take_contained(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.contained)
    }

    /// A test's fault: `request_id`'s next allocation frees a block its table holds alone
    /// before the check runs, which the check must catch (`test-faults` builds only).
    #[cfg(feature = "test-faults")]
    pub fn plant_fault(&mut self, request_id: &str) {
        self.fault = Some(request_id.to_owned());
    }

    pub fn config(&self) -> &CoordinatorConfig {
        self.coordinator.config()
    }

    pub fn pool(&self) -> &BlockPool {
        self.coordinator.pool()
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// The ids of the requests holding blocks, in no particular order.
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        self.requests.keys().map(String::as_str)
    }

    /// vLLM's `get_computed_blocks` search (see [`KvCacheCoordinator::find_longest_cache_hit`]).
    pub fn lookup(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<CacheHit> {
        self.coordinator.find_longest_cache_hit(hashes, max_length, &AnyCached)
    }

    /// vLLM 0.34's `get_num_cached_tokens` probe for request `request_id`: the tokens of its
    /// cached prefix, at most `max_length`, as [`Self::lookup`] finds them. A scheduler probes
    /// each waiting request in its admission window at every step; where the hit is a plain
    /// longest prefix, a probe resumes from the request's previous answer while nothing
    /// cached has been removed since (a cached prefix only grows then), so a probe costs a
    /// lookup or two instead of one per block.
    pub fn num_cached_tokens(
        &mut self,
        request_id: &str,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<usize> {
        if !self.coordinator.is_plain_prefix() {
            return Ok(self.lookup(hashes, max_length)?.num_tokens);
        }
        if self.probes.len() >= MAX_PROBES && !self.probes.contains_key(request_id) {
            self.probes.clear();
        }
        let removals = self.coordinator.pool().removals();
        let probe = match self.probes.get_mut(request_id) {
            Some(probe) => probe,
            None => self
                .probes
                .entry(request_id.to_owned())
                .or_insert(Probe { removals, blocks: Vec::new() }),
        };
        if probe.removals != removals {
            probe.removals = removals;
            probe.blocks.clear();
        }
        self.coordinator.extend_cached_prefix(hashes, &mut probe.blocks, max_length)?;
        Ok(probe.blocks.len() * self.coordinator.config().block_size())
    }

    /// [`Self::lookup`] for request `request_id`: where the request was probed
    /// ([`Self::num_cached_tokens`], vLLM 0.34's cache-aware admission, which looks up the
    /// requests it admits right after probing them) and nothing cached was removed since,
    /// the probe's walk resumed instead of a new one. The same hit.
    pub fn lookup_request(
        &mut self,
        request_id: &str,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<CacheHit> {
        let removals = self.coordinator.pool().removals();
        let Some(probe) = self.probes.get_mut(request_id).filter(|p| p.removals == removals) else {
            return self.lookup(hashes, max_length);
        };
        self.coordinator.extend_cached_prefix(hashes, &mut probe.blocks, max_length)?;
        let num_tokens = probe.blocks.len() * self.coordinator.config().block_size();
        Ok(CacheHit { blocks: vec![probe.blocks.clone()], num_tokens, num_uncached_common: 0 })
    }

    /// vLLM's per-group search (see [`KvCacheCoordinator::find_cache_hit_per_group`]).
    pub fn lookup_per_group(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
    ) -> CoreResult<(Vec<Vec<u32>>, Vec<usize>)> {
        self.coordinator.find_cache_hit_per_group(hashes, max_length)
    }

    /// vLLM's `allocate_slots` for the request `request_id`. Returns the blocks newly
    /// allocated per group, or `None` when the pool cannot provide them.
    pub fn allocate_slots(
        &mut self,
        request_id: &str,
        request: &RequestState,
        args: &AllocateArgs,
        hits: &[&[u32]],
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<Option<Vec<Vec<u32>>>> {
        let num_groups = self.coordinator.num_groups();
        let held = match self.requests.get_mut(request_id) {
            Some(held) => held,
            None => self
                .requests
                .entry(request_id.to_owned())
                .or_insert_with(|| RequestBlocks::new(num_groups)),
        };
        #[cfg(feature = "test-faults")]
        let allocated = if self.fault.as_deref() == Some(request_id) {
            self.fault = None;
            self.coordinator.allocate_slots_with_fault(
                held,
                request,
                args,
                hits,
                hashes,
                |pool, held| {
                    let sole = held.groups.iter().flat_map(|g| g.blocks.iter().rev()).copied();
                    let sole = sole
                        .filter(|&b| b != crate::pool::NULL_BLOCK)
                        .find(|&b| pool.ref_cnt(b) == 1);
                    pool.free_blocks(sole.into_iter());
                },
            )
        } else {
            self.coordinator.allocate_slots(held, request, args, hits, hashes)
        };
        #[cfg(not(feature = "test-faults"))]
        let allocated = self.coordinator.allocate_slots(held, request, args, hits, hashes);
        let allocated = match allocated {
            Err(CoreError::Unsound(what)) if self.contain => {
                let error = CoreError::Unsound(what).for_request(request_id);
                self.contained.push((request_id.to_owned(), error.to_string()));
                Ok(true)
            }
            other => other,
        };
        let new = match allocated {
            Ok(true) => Some(self.coordinator.new_blocks(held).map(<[u32]>::to_vec).collect()),
            _ => None,
        };
        if !held.holds_blocks() && !held.is_tracked() {
            // Nothing allocated for a request vLLM does not track yet: keep no entry.
            self.requests.remove(request_id);
        }
        allocated.map_err(|e| e.for_request(request_id))?;
        self.drain_events(request_id);
        self.keep_boundary_states(request_id);
        Ok(new)
    }

    /// vLLM's `cache_blocks`: registers the request's full blocks up to `num_tokens` tokens.
    /// A request without blocks is left alone.
    pub fn cache_blocks(
        &mut self,
        request_id: &str,
        request: &RequestState,
        num_tokens: usize,
        hashes: &(impl HashSource + ?Sized),
    ) -> CoreResult<()> {
        let Some(held) = self.requests.get_mut(request_id) else { return Ok(()) };
        self.coordinator.cache_blocks(held, request, num_tokens, hashes)?;
        self.drain_events(request_id);
        self.keep_boundary_states(request_id);
        Ok(())
    }

    /// Whether [`Self::cache_blocks`] up to `num_computed` tokens of `request_id` (with
    /// `num_hashes` block hashes) may do anything (false for an unknown id): see
    /// [`KvCacheCoordinator::cache_blocks_due`].
    pub fn cache_blocks_due(
        &self,
        request_id: &str,
        num_computed: usize,
        num_hashes: usize,
    ) -> bool {
        self.requests
            .get(request_id)
            .is_some_and(|held| self.coordinator.cache_blocks_due(held, num_computed, num_hashes))
    }

    /// vLLM's `remove_skipped_blocks`: frees what no later token reads once
    /// `num_processed` tokens are done (a no-op for an unknown id).
    pub fn remove_skipped_blocks(&mut self, request_id: &str, num_processed: usize) {
        if let Some(held) = self.requests.get_mut(request_id) {
            self.coordinator.remove_skipped_blocks(held, num_processed);
        }
        self.drain_events(request_id);
    }

    /// vLLM's `free`: releases the request's blocks, last block first. Unknown ids are a
    /// no-op, as in vLLM (the scheduler frees requests that never got blocks).
    pub fn free(&mut self, request_id: &str) {
        self.probes.remove(request_id);
        if let Some(held) = self.requests.remove(request_id) {
            self.coordinator.free(held);
        }
        self.drop_boundary_states(request_id);
    }

    /// vLLM's `pop_blocks_for_free`: forgets the request and returns its blocks, still held
    /// (see [`KvCacheCoordinator::pop_blocks_for_free`]); empty for an unknown id.
    pub fn pop_blocks_for_free(&mut self, request_id: &str) -> Vec<u32> {
        self.drop_boundary_states(request_id);
        self.requests
            .remove(request_id)
            .map(KvCacheCoordinator::pop_blocks_for_free)
            .unwrap_or_default()
    }

    /// vLLM's `take_boundary_state_offloads`: the Mamba states registered as full blocks
    /// since the last call, group by group (each group's in the order they were registered),
    /// with their requests; a freed request's states are gone (their blocks may be reused).
    pub fn take_boundary_states(&mut self) -> Vec<(String, BoundaryState)> {
        let mut states = std::mem::take(&mut self.boundary_states);
        states.sort_by_key(|(_, state)| state.group);
        states
    }

    fn keep_boundary_states(&mut self, request_id: &str) {
        let states = self.coordinator.last_boundary_states();
        if !states.is_empty() {
            let owned = states.iter().map(|&state| (request_id.to_owned(), state));
            self.boundary_states.extend(owned);
        }
    }

    fn drop_boundary_states(&mut self, request_id: &str) {
        if !self.boundary_states.is_empty() {
            self.boundary_states.retain(|(id, _)| id != request_id);
        }
    }

    /// vLLM's `BlockPool.free_blocks` (see [`KvCacheCoordinator::free_blocks`]).
    pub fn free_blocks(&mut self, ids: &[u32]) -> CoreResult<()> {
        self.coordinator.free_blocks(ids)?;
        self.drain_events("");
        Ok(())
    }

    /// vLLM's coordinator `get_num_blocks_to_allocate` for `request_id` without hits (a
    /// request not seen yet holds nothing; see [`KvCacheCoordinator::num_blocks_to_allocate`]).
    pub fn num_blocks_to_allocate(
        &mut self,
        request_id: &str,
        num_tokens: usize,
        main: usize,
        total_computed: usize,
        prefill_end: usize,
        cap: bool,
    ) -> i64 {
        let mut empty;
        let held = match self.requests.get_mut(request_id) {
            Some(held) => held,
            None => {
                empty = RequestBlocks::new(self.coordinator.num_groups());
                &mut empty
            }
        };
        self.coordinator.num_blocks_to_allocate(
            held,
            num_tokens,
            main,
            total_computed,
            prefill_end,
            cap,
        )
    }

    /// The request's block table in each group (empty for an unknown id).
    pub fn block_ids(&self, request_id: &str) -> Option<&RequestBlocks> {
        self.requests.get(request_id)
    }

    /// vLLM's `estimate_cached_tokens`.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        self.requests
            .get(request_id)
            .map_or(0, |held| self.coordinator.estimate_cached_tokens(held))
    }

    pub fn num_free_blocks(&self) -> usize {
        self.coordinator.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.coordinator.usage()
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds a block.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.coordinator.reset_prefix_cache();
        self.drain_events("");
        done
    }

    /// vLLM's `new_step_starts` (see [`KvCacheCoordinator::new_step_starts`]); returns
    /// [`KvCacheCoordinator::vllm_null_states`].
    pub fn new_step_starts(&mut self) -> u64 {
        self.coordinator.new_step_starts();
        self.coordinator.vllm_null_states()
    }

    /// vLLM's `record_blocks_for_zeroing` for `request_id` (see
    /// [`KvCacheCoordinator::record_blocks_for_zeroing`]); a no-op for an unknown id.
    pub fn record_blocks_for_zeroing(
        &mut self,
        request_id: &str,
        start_token: usize,
    ) -> CoreResult<()> {
        match self.requests.get(request_id) {
            Some(held) => self.coordinator.record_blocks_for_zeroing(held, start_token),
            None => Ok(()),
        }
    }

    /// vLLM's `evict_blocks` (see [`KvCacheCoordinator::evict_blocks`]).
    pub fn evict_blocks(&mut self, ids: &[u32]) -> CoreResult<()> {
        self.coordinator.evict_blocks(ids)?;
        self.drain_events("");
        Ok(())
    }

    /// vLLM's `take_new_block_ids` (see [`KvCacheCoordinator::take_new_block_ids`]).
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        self.coordinator.take_new_block_ids()
    }

    /// The events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<ManagerEvent> {
        self.drain_events("");
        std::mem::take(&mut self.events)
    }

    /// Moves the pool's events here; registrations are the call's, for `request_id`.
    fn drain_events(&mut self, request_id: &str) {
        if !self.coordinator.pool().events_enabled() {
            return;
        }
        for event in self.coordinator.take_events() {
            self.events.push(match event {
                KvEvent::BlockRemoved(key) => {
                    ManagerEvent::Removed { hash: key.hash, group: key.group }
                }
                KvEvent::AllBlocksCleared => ManagerEvent::AllBlocksCleared,
                KvEvent::Registered(r) => ManagerEvent::Stored {
                    request_id: request_id.to_owned(),
                    group: r.group,
                    first: r.first,
                    end: r.end,
                    skipped: r.skipped,
                },
                KvEvent::BlockStored(_) => continue,
            });
        }
    }
}
