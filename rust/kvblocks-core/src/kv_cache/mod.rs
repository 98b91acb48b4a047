//! The coordinator: vLLM 0.33's `KVCacheManager`, its coordinators (unitary, hybrid, no
//! prefix cache) and single-type managers (full attention, sliding window, chunked local
//! attention, Mamba with and without prefix caching) over one [`BlockPool`], written once
//! ([`KvCacheCoordinator`], vLLM's name for the object that holds the pool and the groups
//! and runs the hit search and allocation across groups).
//!
//! The coordinator owns the pool and the rules; each request's block tables
//! ([`RequestBlocks`]) belong to the caller, which also owns the request's tokens and hashes:
//! the vLLM manager ([`KvCacheManager`]) keeps tables by request id and reads everything else
//! from vLLM's `Request`, and the embedded [`crate::BlockManager`] keeps them beside its token
//! buffers and adds token verification on top (a [`HitFilter`]). Every call takes the
//! request's state it needs as arguments ([`RequestState`], a [`HashSource`]).
//!
//! This file holds what the coordinator is made of; each concern is a file of its own:
//!
//! - the layout and the rules: `spec` (the configuration), `table` (a request's tables),
//!   `group` (each attention kind's rules), `mamba` (a Mamba group with prefix caching),
//!   `hit` (the hit search);
//! - what the coordinator does, each an `impl KvCacheCoordinator` block: `lookup` (prefix
//!   lookup and the checks on hits), `admission` (counting blocks), `allocate`
//!   (`allocate_slots`), `fork` (sharing and copy-on-write), `caching` (registering blocks),
//!   `zeroing` (blocks the worker must zero), `release` (freeing and eviction), `invariant`
//!   (what every allocation must leave);
//! - `request` (what the coordinator reads of a request) and `manager` (vLLM's
//!   `KVCacheManager` over one coordinator, by request id).

mod admission;
mod allocate;
mod caching;
mod fork;
mod group;
mod hit;
mod invariant;
mod lookup;
mod mamba;
mod manager;
mod release;
mod request;
mod spec;
mod table;
#[cfg(test)]
mod tests;
mod zeroing;

pub use allocate::AllocateArgs;
pub use caching::BoundaryState;
pub use hit::{AnyCached, CacheHit, CachedBlocks, HitFilter, HitRule};
pub use manager::{KvCacheManager, ManagerEvent};
pub use request::{HashSource, RequestState};
pub use spec::{AttentionKind, CoordinatorConfig, GroupSpec};
pub use table::{GroupBlocks, MambaState, RequestBlocks};

use crate::pool::{BlockPool, KvEvent, Registered};
use crate::{CoreError, CoreResult};

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

#[derive(Debug, Clone)]
pub struct KvCacheCoordinator {
    config: CoordinatorConfig,
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
    /// request's table (they are appended; see [`KvCacheCoordinator::new_blocks`]).
    new_from: Vec<usize>,
    /// The `[source, copy]` blocks the last `allocate_slots` copied on write (see
    /// [`AllocateArgs::copy_on_write`]).
    copies: Vec<[u32; 2]>,
    /// Per group, the fresh blocks recorded for zeroing since the last
    /// [`KvCacheCoordinator::take_new_block_ids`] (vLLM's `new_block_ids` of each single-type
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
    /// Whether every allocation is checked (`invariant`; always, but in a benchmark that
    /// measures what the check costs: [`Self::set_check`]).
    check: bool,
    /// Live Mamba columns that allocations left holding the null block by vLLM's own rule
    /// (`mamba::vllm_left_null`), since the coordinator was made.
    vllm_null_states: u64,
}

impl KvCacheCoordinator {
    pub fn new(config: CoordinatorConfig) -> CoreResult<Self> {
        config.validate()?;
        let pool = BlockPool::new(config.num_blocks, config.enable_caching, config.enable_events)?;
        let drop = config.eagle_drop_groups();
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
            copies: Vec::new(),
            new_block_ids,
            align,
            any_align,
            cached_this_step: mamba::StepKeys::default(),
            boundary_states: Vec::new(),
            check: true,
            vllm_null_states: 0,
        })
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn num_groups(&self) -> usize {
        self.config.groups.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Turns the check of every allocation off or on again: for a benchmark that measures its
    /// cost, never in serving (the check is what keeps an unsound table from a worker).
    pub fn set_check(&mut self, check: bool) {
        self.check = check;
    }

    /// How many times an allocation left a Mamba group's running or draft state column
    /// holding the null block, as vLLM's own allocation does after rejected drafts (the
    /// worker then writes that request's state into the null block; docs/vllm.md, "The null
    /// block in a Mamba table").
    pub fn vllm_null_states(&self) -> u64 {
        self.vllm_null_states
    }
}
