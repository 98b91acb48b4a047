//! The KV-cache block manager: per-request token buffers and block tables for one
//! full-attention group, over the core's one coordinator ([`KvCacheCoordinator`], vLLM 0.33's
//! rules), which finds its prefix hits and takes every block, its forks' copy-on-write
//! included. What this layer adds: the requests' tokens and hashes, forks (parallel sampling,
//! sharing blocks until one writes), token-verified prefix hits, the batched step, events with
//! the tokens they cover, and statistics.
//!
//! The manager is the one owner of each request's state (tokens, computed tokens, block table,
//! handle). This file holds the per-request operations and the allocation call they share with
//! the batched step ([`step`]); `verify` holds the cache keys and the token verification the
//! coordinator's hit search and hit checks apply, `events` the events and provenance of
//! registered blocks.

mod events;
mod step;
mod verify;

use crate::kv_cache::{AllocateArgs, CoordinatorConfig, KvCacheCoordinator, RequestBlocks};
use crate::kv_cache::{GroupSpec, RequestState};
use crate::pool::{BlockPool, KvEvent};
use crate::requests::{RequestRef, Slab};
use crate::{BlockHasher, CoreError, CoreResult, PrefixCacheStats};
use crate::{RequestKeys, TokenSequence};
use std::sync::Arc;
pub use step::{PlannedStep, StepBuffers, StepInput, StepOutput, StepResult, StepSizes};
use verify::Provenance;

/// How a manager is built; see [`BlockManager::new`]. The default has prefix caching and
/// statistics on, everything else off, and no blocks: set `num_blocks`.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    pub num_blocks: usize,
    pub enable_caching: bool,
    pub max_model_len: Option<usize>,
    /// vLLM's `watermark`: the fraction of the blocks kept free when admitting a request
    /// while others run (`int(watermark * num_blocks)` blocks; any finite value >= 0).
    pub watermark: f64,
    pub log_stats: bool,
    pub enable_events: bool,
    /// Accept a prefix hit only when the block's tokens, parent and extra keys match.
    pub verify_tokens: bool,
    /// Testing only: register blocks under the first `n` bytes of their hash (the rest
    /// zeroed), so that unrelated blocks collide.
    pub debug_key_bytes: Option<usize>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 0,
            enable_caching: true,
            max_model_len: None,
            watermark: 0.0,
            log_stats: true,
            enable_events: false,
            verify_tokens: false,
            debug_key_bytes: None,
        }
    }
}

#[derive(Debug, Clone)]
struct Request {
    seq: TokenSequence,
    /// The block table, as the coordinator keeps it (one group).
    table: RequestBlocks,
    num_computed_tokens: usize,
    /// Holds an allocation (scheduled since its last `free`).
    running: bool,
    num_preemptions: u32,
}

impl Request {
    fn new(seq: TokenSequence) -> Self {
        Self {
            seq,
            table: RequestBlocks::new(1),
            num_computed_tokens: 0,
            running: false,
            num_preemptions: 0,
        }
    }

    /// The block table.
    fn blocks(&self) -> &[u32] {
        self.table.groups.first().map_or(&[], |g| g.blocks.as_slice())
    }

    /// Holds an allocation or blocks (prefix hits are only taken at a first allocation).
    fn holds_blocks(&self) -> bool {
        self.running || !self.blocks().is_empty()
    }

    /// What the coordinator reads of the request.
    fn state(&self) -> RequestState {
        RequestState {
            num_tokens: self.seq.num_tokens(),
            num_computed_tokens: self.num_computed_tokens,
            num_prompt_tokens: self.seq.num_prompt_tokens(),
            num_in_flight_tokens: 0,
            shared_prefix_boundary: 0,
            is_waiting: !self.running,
        }
    }
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    config: ManagerConfig,
    hasher: Arc<BlockHasher>,
    block_size: usize,
    max_model_len: usize,
    coordinator: KvCacheCoordinator,
    requests: Slab<Request>,
    stats: Option<PrefixCacheStats>,
    copies: Vec<[u32; 2]>,
    provenance: Option<Provenance>,
    /// The handles of the last step's rows, in order: `sampled_token_ids` of the next step
    /// are theirs.
    last_rows: Vec<i64>,
}

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

impl BlockManager {
    /// `config.num_blocks` includes the null block (id 0), as in vLLM.
    pub fn new(config: ManagerConfig, hasher: Arc<BlockHasher>) -> CoreResult<Self> {
        let block_size = hasher.block_size();
        if config.num_blocks < 2 {
            return Err(invalid(format!(
                "num_blocks must be >= 2 (block 0 is the null block), got {}",
                config.num_blocks
            )));
        }
        // Slot ids (block * block_size + offset) travel as int32, as in paged-attention kernels.
        if config.num_blocks.checked_mul(block_size).is_none_or(|slots| slots > i32::MAX as usize) {
            return Err(invalid(format!(
                "num_blocks * block_size = {} * {block_size} exceeds the int32 slot range (at \
                 most {} blocks of {block_size} tokens)",
                config.num_blocks,
                i32::MAX as usize / block_size
            )));
        }
        let num_blocks = u32::try_from(config.num_blocks)
            .map_err(|_| CoreError::InvalidSize { what: "num_blocks", value: config.num_blocks })?;
        if !(config.watermark.is_finite() && config.watermark >= 0.0) {
            return Err(invalid(format!(
                "watermark must be a finite number >= 0, got {}",
                config.watermark
            )));
        }
        if config.max_model_len == Some(0) {
            return Err(CoreError::InvalidSize { what: "max_model_len (must be >= 1)", value: 0 });
        }
        let provenance = match config.verify_tokens {
            true => Some(Provenance::new(config.num_blocks, block_size)?),
            false => None,
        };
        let max_model_len = config.max_model_len.unwrap_or(usize::MAX);
        let coordinator = KvCacheCoordinator::new(CoordinatorConfig {
            num_blocks,
            groups: vec![GroupSpec::full(block_size)],
            lookup_sets: vec![vec![0]],
            max_model_len,
            enable_caching: config.enable_caching,
            enable_events: config.enable_events,
            // vLLM's int(watermark * num_blocks), saturating for huge fractions.
            watermark_blocks: (config.watermark * config.num_blocks as f64) as usize,
            use_eagle: false,
            num_prefill_lookahead: 0,
            num_hash_lookahead_tokens: 0,
            retention_interval: None,
            needs_kv_cache_zeroing: false,
        })?;
        Ok(Self {
            coordinator,
            max_model_len,
            stats: config.log_stats.then(PrefixCacheStats::default),
            block_size,
            hasher,
            requests: Slab::default(),
            copies: Vec::new(),
            provenance,
            last_rows: Vec::new(),
            config,
        })
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    pub fn hasher(&self) -> &Arc<BlockHasher> {
        &self.hasher
    }

    pub fn pool(&self) -> &BlockPool {
        self.coordinator.pool()
    }

    fn slot<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<usize> {
        self.requests.slot(request.into())
    }

    fn request<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<&Request> {
        self.request_at(self.slot(request)?)
    }

    /// The request in a slot that [`Self::slot`] returned.
    fn request_at(&self, slot: usize) -> CoreResult<&Request> {
        self.requests.get(slot).ok_or(CoreError::Internal("a live handle's slot is empty"))
    }

    fn check_model_len(&self, num_tokens: usize) -> CoreResult<()> {
        if num_tokens > self.max_model_len {
            return Err(invalid(format!(
                "the request would hold {num_tokens} tokens, more than max_model_len={}",
                self.max_model_len
            )));
        }
        Ok(())
    }

    /// Adds a request and returns its handle.
    pub fn add_request(&mut self, id: &str, prompt: &[u32], keys: RequestKeys) -> CoreResult<i64> {
        if self.requests.contains_id(id) {
            return Err(CoreError::DuplicateRequest(id.to_owned()));
        }
        self.check_model_len(prompt.len())?;
        let seq = TokenSequence::new(self.hasher.clone(), prompt, keys)?;
        Ok(self.requests.insert(id, Request::new(seq))?.1)
    }

    /// Appends accepted output tokens; their full blocks are hashed at once.
    pub fn append_token_ids<'a>(
        &mut self,
        request: impl Into<RequestRef<'a>>,
        tokens: &[u32],
    ) -> CoreResult<()> {
        let slot = self.slot(request)?;
        let num_tokens = self.requests.get(slot).map_or(0, |r| r.seq.num_tokens());
        self.check_model_len(num_tokens.saturating_add(tokens.len()))?;
        if let Some(request) = self.requests.get_mut(slot) {
            request.seq.append_token_ids(tokens);
        }
        Ok(())
    }

    /// Frees the request's blocks and forgets it.
    pub fn remove_request<'a>(&mut self, request: impl Into<RequestRef<'a>>) -> CoreResult<()> {
        let slot = self.slot(request)?;
        self.free_slot(slot);
        self.requests.remove(slot);
        Ok(())
    }

    pub fn sequence<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<&TokenSequence> {
        Ok(&self.request(request)?.seq)
    }

    pub fn block_ids<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<&[u32]> {
        Ok(self.request(request)?.blocks())
    }

    pub fn num_computed_tokens<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<usize> {
        Ok(self.request(request)?.num_computed_tokens)
    }

    /// The handle of a request named by id (or the same handle, checked).
    pub fn handle<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<i64> {
        Ok(self.requests.handle(self.slot(request)?))
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// `(id, handle, block table)` of every request.
    pub fn block_tables(&self) -> impl Iterator<Item = (&str, i64, &[u32])> {
        self.requests.iter().map(|(id, h, r)| (id, h, r.blocks()))
    }

    /// vLLM's `get_computed_blocks`: the longest cached prefix, capped so that at least the
    /// last token is computed. Takes no references.
    pub fn get_computed_blocks<'a>(
        &self,
        request: impl Into<RequestRef<'a>>,
    ) -> CoreResult<(Vec<u32>, usize)> {
        let hits = self.computed_blocks(self.request(request)?)?;
        let num_tokens = hits.len() * self.block_size;
        Ok((hits, num_tokens))
    }

    /// The rules every allocation obeys, for `allocate_slots` and the batched step alike:
    /// `num_tokens` is what the request holds once this call's tokens are appended. With
    /// `may_be_empty` (a step with a token budget) nothing to compute is a skip, not an error.
    fn check_allocation(
        &self,
        request: &Request,
        num_tokens: usize,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        may_be_empty: bool,
    ) -> CoreResult<()> {
        if num_new_tokens == 0 && num_new_computed_tokens == 0 && !may_be_empty {
            return Err(invalid("num_new_tokens and num_new_computed_tokens are both 0"));
        }
        if num_new_computed_tokens % self.block_size != 0 {
            return Err(invalid("num_new_computed_tokens must be a multiple of block_size"));
        }
        if num_new_computed_tokens > 0 && request.holds_blocks() {
            return Err(invalid("prefix hits can only be added at a request's first allocation"));
        }
        let local = request.num_computed_tokens + num_new_computed_tokens;
        if local.saturating_add(num_new_tokens) > num_tokens {
            return Err(invalid(format!(
                "cannot schedule {num_new_tokens} new tokens after {local} computed ones: the \
                 request has {num_tokens} tokens (append them first; drafts are lookahead)"
            )));
        }
        Ok(())
    }

    /// vLLM's `allocate_slots` for one group. Returns the newly allocated block ids, or `None`
    /// (with nothing changed) when the pool cannot provide them.
    pub fn allocate_slots<'a>(
        &mut self,
        request: impl Into<RequestRef<'a>>,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        new_computed_blocks: &[u32],
        num_lookahead_tokens: usize,
    ) -> CoreResult<Option<Vec<u32>>> {
        let slot = self.slot(request)?;
        let request = self.request_at(slot)?;
        let num_tokens = request.seq.num_tokens();
        self.check_allocation(request, num_tokens, num_new_tokens, num_new_computed_tokens, false)?;
        // Caller-supplied hits are checked here; the batched step looks its hits up itself.
        self.check_hits(request, new_computed_blocks, num_new_computed_tokens)?;
        let before = request.blocks().len() + new_computed_blocks.len();
        let allocated = self.allocate_in(
            slot,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )?;
        if !allocated {
            return Ok(None);
        }
        Ok(Some(self.request_at(slot)?.blocks().get(before..).unwrap_or_default().to_vec()))
    }

    /// `allocate_slots` once [`Self::check_allocation`] and the hit checks passed: true when
    /// it allocated, false (nothing changed) when the pool cannot provide the blocks. The
    /// coordinator makes vLLM's decisions and takes every block, copy-on-write of shared
    /// blocks the step writes into included; this layer adds the request's computed tokens,
    /// statistics, verified provenance and the queue of block copies.
    fn allocate_in(
        &mut self,
        slot: usize,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        new_computed_blocks: &[u32],
        num_lookahead_tokens: usize,
    ) -> CoreResult<bool> {
        let b = self.block_size;
        let request = self.requests.get_mut(slot).ok_or(CoreError::Internal("no request"))?;
        let local = request.num_computed_tokens + num_new_computed_tokens;
        debug_assert!(local + num_new_tokens <= request.seq.num_tokens());
        let pool = self.coordinator.pool();
        let args = AllocateArgs {
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            // The embedded scheduler's running requests are exactly those holding blocks.
            has_scheduled_reqs: pool.num_blocks() - 1 > pool.num_free_blocks(),
            // Forks share blocks until one of them writes.
            copy_on_write: true,
            ..AllocateArgs::default()
        };
        let state = request.state();
        // The coordinator works on the table; the request gets it back whatever the outcome.
        let mut table = std::mem::take(&mut request.table);
        let hashes =
            verify::CacheKeys::new(request.seq.block_hashes(), self.config.debug_key_bytes);
        let new = self.coordinator.allocate_slots(
            &mut table,
            &state,
            &args,
            &[new_computed_blocks],
            &hashes,
        );
        request.table = table;
        self.copies.extend_from_slice(self.coordinator.last_copies());
        if let Err(error @ CoreError::Unsound(_)) = new {
            let handle = self.requests.handle(slot);
            let id = self.requests.iter().find(|&(_, h, _)| h == handle).map(|(id, _, _)| id);
            return Err(error.for_request(id.unwrap_or("?")));
        }
        if !new? {
            return Ok(false);
        }
        let request = self.requests.get_mut(slot).ok_or(CoreError::Internal("no request"))?;
        let first_admission = !request.running;
        request.num_computed_tokens = local + num_new_tokens;
        request.running = true;
        events::report_registered(&mut self.coordinator, request, self.provenance.as_mut(), b);
        if self.config.enable_caching && first_admission {
            if let Some(stats) = &mut self.stats {
                let num_tokens = request.seq.num_tokens();
                stats.record(num_tokens, num_new_computed_tokens, request.num_preemptions > 0);
            }
        }
        Ok(true)
    }

    /// Releases the request's blocks (tail first) and resets its computed tokens; its tokens
    /// and hashes stay, so it can be scheduled again and hit its own blocks. A request
    /// without blocks is left as it is.
    pub fn free<'a>(&mut self, request: impl Into<RequestRef<'a>>) -> CoreResult<()> {
        let slot = self.slot(request)?;
        self.free_slot(slot);
        Ok(())
    }

    fn free_slot(&mut self, slot: usize) {
        let Some(request) = self.requests.get_mut(slot) else { return };
        if !request.blocks().is_empty() {
            request.num_preemptions += 1;
        }
        let table = std::mem::replace(&mut request.table, RequestBlocks::new(1));
        request.num_computed_tokens = 0;
        request.running = false;
        self.coordinator.free(table);
    }

    /// Parallel sampling: `child` starts as a copy of `parent` sharing all its blocks.
    /// Returns the child's handle.
    pub fn fork<'a>(&mut self, parent: impl Into<RequestRef<'a>>, child: &str) -> CoreResult<i64> {
        if self.requests.contains_id(child) {
            return Err(CoreError::DuplicateRequest(child.to_owned()));
        }
        let mut copy = self.request(parent)?.clone();
        copy.num_preemptions = 0;
        let table = copy.table.clone();
        let (_, handle) = self.requests.insert(child, copy)?;
        self.coordinator.share(&table);
        Ok(handle)
    }

    /// For each request, the number of leading blocks and tokens a prefix lookup finds.
    pub fn lookup_batch(&self, handles: &[i64]) -> CoreResult<Vec<(usize, usize)>> {
        let mut out = Vec::with_capacity(handles.len());
        for &handle in handles {
            let (blocks, tokens) = self.get_computed_blocks(handle)?;
            out.push((blocks.len(), tokens));
        }
        Ok(out)
    }

    pub fn num_free_blocks(&self) -> usize {
        self.coordinator.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.coordinator.usage()
    }

    /// The statistics since the last call (a fresh record starts), or `None` without stats.
    pub fn make_prefix_cache_stats(&mut self) -> Option<PrefixCacheStats> {
        self.stats.as_mut().map(std::mem::take)
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.coordinator.reset_prefix_cache();
        if done {
            if let Some(stats) = &mut self.stats {
                stats.reset = true;
            }
        }
        done
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.coordinator.take_events()
    }

    /// The `(src, dst)` block copies queued by copy-on-write since the last call.
    pub fn take_block_copies(&mut self) -> Vec<[u32; 2]> {
        std::mem::take(&mut self.copies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{HashAlgo, DEFAULT_SEED};

    fn manager(num_blocks: usize, block_size: usize) -> BlockManager {
        let hasher =
            BlockHasher::new(HashAlgo::Sha256Cbor, block_size, DEFAULT_SEED.to_owned()).unwrap();
        let config = ManagerConfig {
            num_blocks,
            enable_caching: true,
            max_model_len: None,
            watermark: 0.0,
            log_stats: true,
            enable_events: true,
            verify_tokens: false,
            debug_key_bytes: None,
        };
        BlockManager::new(config, Arc::new(hasher)).unwrap()
    }

    fn admit(m: &mut BlockManager, id: &str, tokens: &[u32]) -> Option<Vec<u32>> {
        m.add_request(id, tokens, RequestKeys::default()).unwrap();
        let (hits, n) = m.get_computed_blocks(id).unwrap();
        m.allocate_slots(id, tokens.len() - n, n, &hits, 0).unwrap()
    }

    fn free_ids(m: &BlockManager) -> Vec<u32> {
        m.pool().free_block_ids().collect()
    }

    #[test]
    fn worked_trace_of_vllm_semantics() {
        // docs/semantics.md §3.9: N = 11, B = 16.
        let mut m = manager(11, 16);
        let common: Vec<u32> = (1000..1048).collect();
        let with = |tail: std::ops::Range<u32>| [common.clone(), tail.collect()].concat();
        assert_eq!(admit(&mut m, "r0", &with(0..7)), Some(vec![1, 2, 3, 4]));
        assert_eq!(admit(&mut m, "r1", &with(100..105)), Some(vec![5]));
        assert_eq!((1..6).map(|b| m.pool().ref_cnt(b)).collect::<Vec<_>>(), [2, 2, 2, 1, 1]);
        m.free("r0").unwrap();
        m.free("r1").unwrap();
        assert_eq!(free_ids(&m), [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
        assert_eq!(admit(&mut m, "r2", &with(200..206)), Some(vec![5]));
        m.free("r2").unwrap();
        m.take_events();
        let fresh: Vec<u32> = (5000..5160).collect();
        assert_eq!(admit(&mut m, "r3", &fresh), Some(vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]));
        assert!(free_ids(&m).is_empty());
        let removed =
            m.take_events().iter().filter(|e| matches!(e, KvEvent::BlockRemoved(_))).count();
        assert_eq!(removed, 3);
    }

    #[test]
    fn refused_allocation_changes_nothing_and_errors_are_typed() {
        let mut m = manager(4, 4);
        assert_eq!(admit(&mut m, "a", &[1, 2, 3, 4, 5, 6, 7, 8]), Some(vec![1, 2]));
        let before = free_ids(&m);
        m.add_request("b", &[9; 12], RequestKeys::default()).unwrap();
        assert_eq!(m.allocate_slots("b", 12, 0, &[], 0), Ok(None));
        assert_eq!(free_ids(&m), before);
        assert!(matches!(m.allocate_slots("zz", 1, 0, &[], 0), Err(CoreError::UnknownRequest(_))));
        assert!(matches!(
            m.add_request("a", &[1], RequestKeys::default()),
            Err(CoreError::DuplicateRequest(_))
        ));
        assert!(matches!(m.allocate_slots("b", 13, 0, &[], 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(m.allocate_slots("b", 1, 4, &[0], 0), Err(CoreError::InvalidArgument(_))));
    }

    #[test]
    fn fork_copies_a_shared_partial_block_on_write() {
        let mut m = manager(10, 4);
        admit(&mut m, "p", &[1, 2, 3, 4, 5, 6]);
        m.fork("p", "c").unwrap();
        m.append_token_ids("c", &[7]).unwrap();
        assert_eq!(m.allocate_slots("c", 1, 0, &[], 0), Ok(Some(vec![])));
        assert_eq!(m.take_block_copies(), [[2, 3]]);
        assert_eq!(m.block_ids("c").unwrap(), [1, 3]);
        assert_eq!(m.pool().ref_cnt(1), 2);
    }
}
