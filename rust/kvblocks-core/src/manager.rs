//! The KV-cache block manager: per-request token buffers and block tables over one
//! [`BlockPool`], with vLLM 0.33's `KVCacheManager` rules for a single full-attention group,
//! plus copy-on-write forks and token-verified prefix hits.

use crate::hashing::native;
use crate::pool::{BlockPool, BlockStored, EventKey, KvEvent, NULL_BLOCK};
use crate::requests::{RequestRef, Slab};
use crate::{
    try_filled, BlockHash, BlockHasher, CoreError, CoreResult, ExtraKey, PrefixCacheStats,
};
use crate::{RequestKeys, TokenSequence};
use std::sync::Arc;

/// How a manager is built; see [`BlockManager::new`].
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    pub num_blocks: usize,
    pub enable_caching: bool,
    pub max_model_len: Option<usize>,
    /// Fraction of the blocks kept free when admitting a request while others run.
    pub watermark: f64,
    pub log_stats: bool,
    pub enable_events: bool,
    /// Accept a prefix hit only when the block's tokens, parent and extra keys match.
    pub verify_tokens: bool,
    /// Testing only: register blocks under the first `n` bytes of their hash (the rest
    /// zeroed), so that unrelated blocks collide.
    pub debug_key_bytes: Option<usize>,
}

#[derive(Debug, Clone)]
struct Request {
    seq: TokenSequence,
    blocks: Vec<u32>,
    /// Leading blocks already registered in the cache (vLLM's `num_cached_block`).
    num_cached_blocks: usize,
    num_computed_tokens: usize,
    /// Holds an allocation (scheduled since its last `free`).
    running: bool,
    num_preemptions: u32,
}

/// The inputs of one batched scheduler step (see [`BlockManager::schedule_step`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepInput<'a> {
    /// The requests, in scheduling order.
    pub handles: &'a [i64],
    /// Tokens to compute for each request this step.
    pub num_new_tokens: &'a [i64],
    /// Prefix-cache hit tokens to take at admission (a multiple of the block size), or none.
    pub num_new_computed_tokens: Option<&'a [i64]>,
    /// Nonzero for admissions whose prefix lookup happens at their turn in the step (so they
    /// also hit blocks that earlier requests of the same step just cached); their
    /// `num_new_tokens` is then an upper bound, capped to the tokens the hit leaves to compute.
    pub prefix_lookup: Option<&'a [i64]>,
    pub num_lookahead_tokens: usize,
    /// Accepted tokens to append first: request `i` gets
    /// `new_token_ids[new_token_offsets[i]..new_token_offsets[i + 1]]`.
    pub new_token_ids: &'a [u32],
    pub new_token_offsets: Option<&'a [i64]>,
}

/// Output sizes of a step, known before it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPlan {
    pub num_reqs: usize,
    /// The widest block table among the requests after the step.
    pub max_blocks: usize,
    /// The most slots the step can map (all of `num_new_tokens`).
    pub max_tokens: usize,
}

/// Where a step writes the paged-attention metadata of the scheduled requests.
#[derive(Debug)]
pub struct StepOutput<'a> {
    /// Row-major `[rows, width]`; row `i` holds request `i`'s block ids, padded with 0.
    pub block_table: &'a mut [i32],
    pub width: usize,
    /// `block_id * block_size + offset` of each scheduled token, request after request.
    pub slot_mapping: &'a mut [i32],
    /// Each request's computed tokens after the step (its context length).
    pub seq_lens: &'a mut [i32],
    /// `query_start_loc[i]..query_start_loc[i + 1]` are request `i`'s tokens.
    pub query_start_loc: &'a mut [i32],
}

/// What a step did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepResult {
    /// Requests `0..num_scheduled` were allocated; the step stopped at the next one.
    pub num_scheduled: usize,
    pub num_scheduled_tokens: usize,
    /// Copy-on-write copies made by this step (not also left for `take_block_copies`).
    pub block_copies: Vec<[u32; 2]>,
    /// Blocks whose cached content this step evicted, in order.
    pub evicted_blocks: Vec<u32>,
}

/// What a verifying manager remembers of each cached block.
#[derive(Debug, Clone)]
struct Provenance {
    tokens: Vec<u32>,
    parent: Vec<u32>,
    keys: Vec<Option<Box<[u8]>>>,
}

const NO_PARENT: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct BlockManager {
    config: ManagerConfig,
    hasher: Arc<BlockHasher>,
    block_size: usize,
    max_model_len: usize,
    watermark_blocks: usize,
    pool: BlockPool,
    requests: Slab<Request>,
    stats: Option<PrefixCacheStats>,
    copies: Vec<[u32; 2]>,
    provenance: Option<Provenance>,
}

fn invalid(msg: impl Into<String>) -> CoreError {
    CoreError::InvalidArgument(msg.into())
}

impl BlockManager {
    /// `config.num_blocks` includes the null block (id 0), as in vLLM.
    pub fn new(config: ManagerConfig, hasher: Arc<BlockHasher>) -> CoreResult<Self> {
        let num_blocks = u32::try_from(config.num_blocks)
            .ok()
            .filter(|n| *n >= 1 && *n < u32::MAX)
            .ok_or(CoreError::InvalidSize { what: "num_blocks", value: config.num_blocks })?;
        let block_size = hasher.block_size();
        // Slot ids (block * block_size + offset) travel as int32, as in paged-attention kernels.
        if config.num_blocks.checked_mul(block_size).is_none_or(|slots| slots > i32::MAX as usize) {
            return Err(invalid(format!(
                "num_blocks * block_size = {} * {block_size} exceeds the int32 slot range",
                config.num_blocks
            )));
        }
        if !(0.0..=1.0).contains(&config.watermark) {
            return Err(invalid(format!("watermark must be in [0, 1], got {}", config.watermark)));
        }
        if config.max_model_len == Some(0) {
            return Err(CoreError::InvalidSize { what: "max_model_len (must be >= 1)", value: 0 });
        }
        let provenance = match config.verify_tokens {
            true => Some(Provenance {
                tokens: try_filled(config.num_blocks * block_size, 0, "verified block tokens")?,
                parent: try_filled(config.num_blocks, NO_PARENT, "verified block parents")?,
                keys: try_filled(config.num_blocks, None, "verified block keys")?,
            }),
            false => None,
        };
        Ok(Self {
            pool: BlockPool::new(num_blocks, config.enable_caching, config.enable_events)?,
            watermark_blocks: (config.watermark * config.num_blocks as f64) as usize,
            max_model_len: config.max_model_len.unwrap_or(usize::MAX),
            stats: config.log_stats.then(PrefixCacheStats::default),
            block_size,
            hasher,
            requests: Slab::default(),
            copies: Vec::new(),
            provenance,
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
        &self.pool
    }

    fn slot<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<usize> {
        self.requests.slot(request.into())
    }

    fn request<'a>(&self, request: impl Into<RequestRef<'a>>) -> CoreResult<&Request> {
        let slot = self.slot(request)?;
        self.requests.get(slot).ok_or_else(|| invalid("request slot is empty"))
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
        let request = Request {
            seq,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed_tokens: 0,
            running: false,
            num_preemptions: 0,
        };
        Ok(self.requests.insert(id, request)?.1)
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
        Ok(&self.request(request)?.blocks)
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
        self.requests.iter().map(|(id, h, r)| (id, h, r.blocks.as_slice()))
    }

    fn key_of(&self, hash: &BlockHash) -> BlockHash {
        key_of(hash, self.config.debug_key_bytes)
    }

    /// The block's extra keys in the native layout, or `None` when it has none.
    fn block_key_bytes(seq: &TokenSequence, index: usize, block_size: usize) -> Option<Box<[u8]>> {
        let keys = seq.keys();
        if keys.is_empty() {
            return None;
        }
        let mut extra: Vec<ExtraKey<'_>> = Vec::new();
        let start = index * block_size;
        keys.block_keys(start, start + block_size, &mut 0, &mut extra);
        if extra.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        native::keys(&mut out, Some(&extra));
        Some(out.into_boxed_slice())
    }

    /// True when `block` holds exactly block `index` of `seq` after `parent`.
    fn provenance_matches(
        &self,
        seq: &TokenSequence,
        index: usize,
        block: u32,
        parent: u32,
    ) -> bool {
        let Some(p) = &self.provenance else { return true };
        let b = self.block_size;
        let start = block as usize * b;
        let stored = p.tokens.get(start..start + b).unwrap_or_default();
        p.parent.get(block as usize) == Some(&parent)
            && stored.iter().copied().eq(seq.tokens_in(index * b, (index + 1) * b))
            && p.keys.get(block as usize).cloned().flatten() == Self::block_key_bytes(seq, index, b)
    }

    /// The cached block for block `index` of `seq`, if any.
    fn find_cached(&self, seq: &TokenSequence, index: usize, parent: u32) -> Option<u32> {
        let hash = seq.block_hashes().get(index)?;
        let candidates = self.pool.lookup(&self.key_of(hash));
        if self.provenance.is_none() {
            return candidates.first().copied();
        }
        candidates.iter().copied().find(|&b| self.provenance_matches(seq, index, b, parent))
    }

    /// vLLM's `get_computed_blocks`: the longest cached prefix, capped so that at least the
    /// last token is computed. Takes no references.
    pub fn get_computed_blocks<'a>(
        &self,
        request: impl Into<RequestRef<'a>>,
    ) -> CoreResult<(Vec<u32>, usize)> {
        let hits = self.computed_blocks(self.request(request)?);
        let num_tokens = hits.len() * self.block_size;
        Ok((hits, num_tokens))
    }

    fn computed_blocks(&self, request: &Request) -> Vec<u32> {
        let mut hits = Vec::new();
        if !self.config.enable_caching {
            return hits;
        }
        let max_blocks = request.seq.num_tokens().saturating_sub(1) / self.block_size;
        for index in 0..max_blocks {
            let parent = hits.last().copied().unwrap_or(NO_PARENT);
            match self.find_cached(&request.seq, index, parent) {
                Some(block) => hits.push(block),
                None => break,
            }
        }
        hits
    }

    fn check_hits(&self, request: &Request, hits: &[u32], hit_tokens: usize) -> CoreResult<()> {
        if hits.len() * self.block_size != hit_tokens {
            return Err(invalid(format!(
                "num_new_computed_tokens={hit_tokens} must equal len(new_computed_blocks) * \
                 block_size = {}",
                hits.len() * self.block_size
            )));
        }
        if hits.is_empty() {
            return Ok(());
        }
        if request.running || !request.blocks.is_empty() {
            return Err(invalid("prefix hits can only be added at a request's first allocation"));
        }
        let mut parent = NO_PARENT;
        for (index, &block) in hits.iter().enumerate() {
            let hash = request.seq.block_hashes().get(index);
            let registered = hash.is_some_and(|h| self.pool.key(block) == Some(&self.key_of(h)));
            if block == NULL_BLOCK
                || !registered
                || hits.get(..index).is_some_and(|seen| seen.contains(&block))
                || !self.provenance_matches(&request.seq, index, block, parent)
            {
                return Err(invalid(format!(
                    "new_computed_blocks[{index}] = {block} is not the request's cached block \
                     {index}; pass what get_computed_blocks returned"
                )));
            }
            parent = block;
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
        let request = self.requests.get(slot).ok_or_else(|| invalid("request slot is empty"))?;
        if num_new_tokens == 0 && num_new_computed_tokens == 0 {
            return Err(invalid("num_new_tokens and num_new_computed_tokens are both 0"));
        }
        // Caller-supplied hits are checked here; the batched step looks its hits up itself.
        self.check_hits(request, new_computed_blocks, num_new_computed_tokens)?;
        self.allocate_in(
            slot,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )
    }

    /// `allocate_slots` once the hits are known to be the request's cached prefix.
    fn allocate_in(
        &mut self,
        slot: usize,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        new_computed_blocks: &[u32],
        num_lookahead_tokens: usize,
    ) -> CoreResult<Option<Vec<u32>>> {
        let b = self.block_size;
        let request = self.requests.get(slot).ok_or_else(|| invalid("request slot is empty"))?;
        if num_new_tokens == 0 && num_new_computed_tokens == 0 {
            return Err(invalid("num_new_tokens and num_new_computed_tokens are both 0"));
        }
        let local = request.num_computed_tokens + num_new_computed_tokens;
        let num_tokens = request.seq.num_tokens();
        if local.saturating_add(num_new_tokens) > num_tokens {
            return Err(invalid(format!(
                "cannot schedule {num_new_tokens} new tokens after {local} computed ones: the \
                 request has {num_tokens} tokens (append them first; drafts are lookahead)"
            )));
        }
        let total = local.min(self.max_model_len);
        let need = total
            .saturating_add(num_new_tokens)
            .saturating_add(num_lookahead_tokens)
            .min(self.max_model_len);
        let target = need.div_ceil(b);
        let held = request.blocks.len();
        let hits = new_computed_blocks;
        let evictable_hits = hits.iter().filter(|&&h| self.pool.ref_cnt(h) == 0).count();
        // Copy-on-write: every held block that this step writes into and that a fork shares.
        let written = local / b..(local + num_new_tokens).div_ceil(b).min(held);
        let shared = |pool: &BlockPool, blocks: &[u32], i: usize| {
            blocks.get(i).is_some_and(|&blk| pool.ref_cnt(blk) > 1)
        };
        let num_cow = written.clone().filter(|&i| shared(&self.pool, &request.blocks, i)).count();
        let in_use = self.pool.num_blocks() - 1 - self.pool.num_free_blocks();
        let watermark = if !request.running && in_use > 0 { self.watermark_blocks } else { 0 };
        let needed = target.saturating_sub(hits.len() + held) + evictable_hits + num_cow;
        if needed + watermark > self.pool.num_free_blocks() {
            return Ok(None);
        }

        // Nothing has changed up to here; from now on the allocation succeeds.
        let Some(request) = self.requests.get_mut(slot) else { return Ok(None) };
        let pool = &mut self.pool;
        let first_admission = !request.running;
        for index in written {
            if !shared(pool, &request.blocks, index) {
                continue;
            }
            let fresh = pool.get_new_blocks(1);
            if let (Some(&dst), Some(slot)) = (fresh.first(), request.blocks.get_mut(index)) {
                if index * b < local {
                    self.copies.push([*slot, dst]);
                }
                pool.release_shared(*slot);
                *slot = dst;
            }
        }
        if !hits.is_empty() {
            pool.touch(hits);
            request.blocks.extend_from_slice(hits);
            request.num_cached_blocks = request.blocks.len();
        }
        let new_blocks = pool.get_new_blocks(target.saturating_sub(request.blocks.len()));
        request.blocks.extend_from_slice(&new_blocks);
        request.num_computed_tokens = local + num_new_tokens;
        request.running = true;
        if self.config.enable_caching {
            let context = CacheContext {
                pool,
                provenance: &mut self.provenance,
                debug_key_bytes: self.config.debug_key_bytes,
            };
            context.cache_blocks(request, (total + num_new_tokens).min(num_tokens), b);
            if first_admission {
                if let Some(stats) = &mut self.stats {
                    stats.record(num_tokens, num_new_computed_tokens, request.num_preemptions > 0);
                }
            }
        }
        Ok(Some(new_blocks))
    }

    fn stored_event(seq: &TokenSequence, done: usize, full: usize, b: usize) -> BlockStored {
        let hashes = seq.block_hashes();
        let keys = seq.keys();
        let extra_keys = (done..full)
            .map(|index| {
                let mut extra = Vec::new();
                keys.block_keys(index * b, (index + 1) * b, &mut 0, &mut extra);
                (!extra.is_empty()).then(|| extra.iter().map(event_key).collect())
            })
            .collect();
        BlockStored {
            block_hashes: hashes.get(done..full).unwrap_or_default().to_vec(),
            parent_block_hash: done.checked_sub(1).and_then(|i| hashes.get(i)).copied(),
            token_ids: seq.tokens_in(done * b, full * b).collect(),
            block_size: b,
            lora_name: keys.lora.as_ref().map(|(name, _)| name.clone()),
            extra_keys,
        }
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
        if !request.blocks.is_empty() {
            request.num_preemptions += 1;
        }
        let blocks = std::mem::take(&mut request.blocks);
        request.num_cached_blocks = 0;
        request.num_computed_tokens = 0;
        request.running = false;
        self.pool.free_blocks(blocks.iter().rev().copied());
    }

    /// Parallel sampling: `child` starts as a copy of `parent` sharing all its blocks.
    /// Returns the child's handle.
    pub fn fork<'a>(&mut self, parent: impl Into<RequestRef<'a>>, child: &str) -> CoreResult<i64> {
        if self.requests.contains_id(child) {
            return Err(CoreError::DuplicateRequest(child.to_owned()));
        }
        let mut copy = self.request(parent)?.clone();
        copy.num_preemptions = 0;
        let blocks = copy.blocks.clone();
        let (_, handle) = self.requests.insert(child, copy)?;
        self.pool.touch(&blocks);
        Ok(handle)
    }

    fn size(value: i64, what: &str) -> CoreResult<usize> {
        usize::try_from(value).map_err(|_| invalid(format!("{what} must be >= 0, got {value}")))
    }

    /// Checks a step and returns the slots it schedules and the output sizes it needs.
    /// Changes nothing; every error a step can raise is raised here.
    pub fn plan_step(&self, input: &StepInput<'_>) -> CoreResult<(Vec<usize>, StepPlan)> {
        let n = input.handles.len();
        let b = self.block_size;
        let same_len = |len: usize, what: &str| {
            if len == n {
                Ok(())
            } else {
                Err(invalid(format!("{what} has {len} entries for {n} requests")))
            }
        };
        same_len(input.num_new_tokens.len(), "num_new_tokens")?;
        if let Some(hits) = input.num_new_computed_tokens {
            same_len(hits.len(), "num_new_computed_tokens")?;
        }
        if let Some(lookup) = input.prefix_lookup {
            same_len(lookup.len(), "prefix_lookup")?;
        }
        match input.new_token_offsets {
            None if !input.new_token_ids.is_empty() => {
                return Err(invalid("new_token_ids needs new_token_offsets"));
            }
            None => {}
            Some(offsets) => {
                let ok = offsets.len() == n + 1
                    && offsets.first() == Some(&0)
                    && offsets.iter().zip(offsets.iter().skip(1)).all(|(a, b)| a <= b)
                    && offsets.last().copied() == i64::try_from(input.new_token_ids.len()).ok();
                if !ok {
                    return Err(invalid(
                        "new_token_offsets must have one entry per request plus one, start at 0, \
                         never decrease and end at len(new_token_ids)",
                    ));
                }
            }
        }
        let mut slots = Vec::with_capacity(n);
        for &handle in input.handles {
            slots.push(self.slot(handle)?);
        }
        let mut seen = slots.clone();
        seen.sort_unstable();
        if seen.iter().zip(seen.iter().skip(1)).any(|(a, b)| a == b) {
            return Err(invalid("a request appears twice in one step"));
        }
        let mut plan = StepPlan { num_reqs: n, max_blocks: 0, max_tokens: 0 };
        for (i, &slot) in slots.iter().enumerate() {
            let request =
                self.requests.get(slot).ok_or_else(|| invalid("request slot is empty"))?;
            let new =
                Self::size(input.num_new_tokens.get(i).copied().unwrap_or(0), "num_new_tokens")?;
            let hit_tokens = match input.num_new_computed_tokens {
                Some(hits) => {
                    Self::size(hits.get(i).copied().unwrap_or(0), "num_new_computed_tokens")?
                }
                None => 0,
            };
            let appended = match input.new_token_offsets {
                Some(o) => {
                    (o.get(i + 1).copied().unwrap_or(0) - o.get(i).copied().unwrap_or(0)) as usize
                }
                None => 0,
            };
            let num_tokens = request.seq.num_tokens() + appended;
            self.check_model_len(num_tokens)?;
            if new == 0 && hit_tokens == 0 {
                return Err(invalid("num_new_tokens and num_new_computed_tokens are both 0"));
            }
            if hit_tokens % b != 0 {
                return Err(invalid("num_new_computed_tokens must be a multiple of block_size"));
            }
            if hit_tokens > 0 && (request.running || !request.blocks.is_empty()) {
                return Err(invalid(
                    "prefix hits can only be added at a request's first allocation",
                ));
            }
            let lookup = input.prefix_lookup.and_then(|l| l.get(i)).is_some_and(|&l| l != 0);
            if lookup && (hit_tokens > 0 || request.running || !request.blocks.is_empty()) {
                return Err(invalid(
                    "prefix_lookup is for admissions without num_new_computed_tokens",
                ));
            }
            // With a lookup, `new` is a bound: the hit (unknown yet) only lowers it.
            let new = if lookup { new.min(num_tokens - request.num_computed_tokens) } else { new };
            let local = request.num_computed_tokens + hit_tokens;
            if local.saturating_add(new) > num_tokens {
                return Err(invalid(format!(
                    "cannot schedule {new} new tokens after {local} computed ones: the request \
                     has {num_tokens} tokens (append them first; drafts are lookahead)"
                )));
            }
            // A lookup's hit plus its new tokens can reach the whole request.
            let reach = if lookup { num_tokens } else { local.min(self.max_model_len) + new };
            let need = reach.saturating_add(input.num_lookahead_tokens).min(self.max_model_len);
            let blocks_after = need.div_ceil(b).max(request.blocks.len() + hit_tokens / b);
            plan.max_blocks = plan.max_blocks.max(blocks_after);
            plan.max_tokens += new;
        }
        Ok((slots, plan))
    }

    /// One scheduler step in one call: appends each request's accepted tokens, then
    /// allocates for each request in order exactly as `get_computed_blocks` (for admissions
    /// with hits) and `allocate_slots` would, stopping at the first request that does not
    /// fit, and writes the scheduled requests' paged-attention metadata into `out`.
    pub fn schedule_step(
        &mut self,
        input: &StepInput<'_>,
        out: &mut StepOutput<'_>,
    ) -> CoreResult<StepResult> {
        let (slots, plan) = self.plan_step(input)?;
        self.run_planned_step(input, &slots, plan, out)
    }

    /// [`BlockManager::schedule_step`] after [`BlockManager::plan_step`] accepted `input` and
    /// nothing changed since (the glue plans first to size the output arrays).
    pub fn run_planned_step(
        &mut self,
        input: &StepInput<'_>,
        slots: &[usize],
        plan: StepPlan,
        out: &mut StepOutput<'_>,
    ) -> CoreResult<StepResult> {
        let b = self.block_size;
        let fits = out.width >= plan.max_blocks
            && out.block_table.len() >= plan.num_reqs.saturating_mul(out.width)
            && out.slot_mapping.len() >= plan.max_tokens
            && out.seq_lens.len() >= plan.num_reqs
            && out.query_start_loc.len() > plan.num_reqs;
        if !fits {
            return Err(invalid(format!(
                "output buffers too small: this step needs {} block-table rows of {} columns, \
                 {} slots, {} seq_lens and {} query_start_loc entries",
                plan.num_reqs,
                plan.max_blocks,
                plan.max_tokens,
                plan.num_reqs,
                plan.num_reqs + 1
            )));
        }
        if let Some(offsets) = input.new_token_offsets {
            for (i, &slot) in slots.iter().enumerate() {
                let (Some(&lo), Some(&hi)) = (offsets.get(i), offsets.get(i + 1)) else { continue };
                let tokens = input.new_token_ids.get(lo as usize..hi as usize).unwrap_or_default();
                if let Some(request) = self.requests.get_mut(slot) {
                    request.seq.append_token_ids(tokens);
                }
            }
        }
        let copies_before = self.copies.len();
        self.pool.record_evictions();
        let mut result = StepResult::default();
        if let Some(first) = out.query_start_loc.first_mut() {
            *first = 0;
        }
        for (i, &slot) in slots.iter().enumerate() {
            let mut new = input.num_new_tokens.get(i).copied().unwrap_or(0) as usize;
            let mut hit_tokens =
                input.num_new_computed_tokens.and_then(|h| h.get(i)).copied().unwrap_or(0) as usize;
            let mut hits = Vec::new();
            if input.prefix_lookup.and_then(|l| l.get(i)).is_some_and(|&l| l != 0) {
                let Some(request) = self.requests.get(slot) else { break };
                hits = self.computed_blocks(request);
                hit_tokens = hits.len() * b;
                new = new.min(request.seq.num_tokens() - request.num_computed_tokens - hit_tokens);
            } else if hit_tokens > 0 {
                let Some(request) = self.requests.get(slot) else { break };
                hits = self.computed_blocks(request);
                if hits.len() < hit_tokens / b {
                    break; // an earlier request of this step evicted part of the prefix
                }
                hits.truncate(hit_tokens / b);
            }
            let allocated =
                self.allocate_in(slot, new, hit_tokens, &hits, input.num_lookahead_tokens);
            match allocated {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    self.pool.stop_recording_evictions();
                    return Err(e);
                }
            }
            let Some(request) = self.requests.get(slot) else { break };
            write_row(out, i, &request.blocks);
            let end = request.num_computed_tokens;
            for position in end - new..end {
                let block = request.blocks.get(position / b).copied().unwrap_or(0) as usize;
                if let Some(s) = out.slot_mapping.get_mut(result.num_scheduled_tokens) {
                    *s = (block * b + position % b) as i32;
                }
                result.num_scheduled_tokens += 1;
            }
            if let Some(len) = out.seq_lens.get_mut(i) {
                *len = end as i32;
            }
            if let Some(q) = out.query_start_loc.get_mut(i + 1) {
                *q = result.num_scheduled_tokens as i32;
            }
            result.num_scheduled += 1;
        }
        // The step hands its own copies over; earlier ones stay for `take_block_copies`.
        result.block_copies = self.copies.split_off(copies_before.min(self.copies.len()));
        result.evicted_blocks = self.pool.stop_recording_evictions();
        Ok(result)
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
        self.pool.num_free_blocks()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The statistics since the last call (a fresh record starts), or `None` without stats.
    pub fn make_prefix_cache_stats(&mut self) -> Option<PrefixCacheStats> {
        self.stats.as_mut().map(std::mem::take)
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.pool.reset_prefix_cache();
        if done {
            if let Some(stats) = &mut self.stats {
                stats.reset = true;
            }
        }
        done
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// The `(src, dst)` block copies queued by copy-on-write since the last call.
    pub fn take_block_copies(&mut self) -> Vec<[u32; 2]> {
        std::mem::take(&mut self.copies)
    }
}

/// Writes `blocks` into row `row` of the block table, padding the row with 0.
fn write_row(out: &mut StepOutput<'_>, row: usize, blocks: &[u32]) {
    let start = row * out.width;
    if let Some(cells) = out.block_table.get_mut(start..start + out.width) {
        cells.fill(0);
        cells.iter_mut().zip(blocks).for_each(|(cell, &block)| *cell = block as i32);
    }
}

/// The cache key of a block hash: the hash itself, or its first `n` bytes in debug mode.
fn key_of(hash: &BlockHash, debug_key_bytes: Option<usize>) -> BlockHash {
    let Some(n) = debug_key_bytes else { return *hash };
    let mut key = *hash;
    match &mut key {
        BlockHash::Sha256(b) => b.iter_mut().skip(n).for_each(|x| *x = 0),
        BlockHash::Xxh3(b) => b.iter_mut().skip(n).for_each(|x| *x = 0),
    }
    key
}

/// What registering a request's blocks touches, borrowed apart from the request map.
struct CacheContext<'a> {
    pool: &'a mut BlockPool,
    provenance: &'a mut Option<Provenance>,
    debug_key_bytes: Option<usize>,
}

impl CacheContext<'_> {
    /// Registers the request's full blocks up to `num_tokens` (vLLM's `cache_blocks`), with
    /// one `BlockStored` event for the newly registered range.
    fn cache_blocks(self, request: &mut Request, num_tokens: usize, b: usize) {
        let hashes = request.seq.block_hashes();
        let full = num_tokens.min(hashes.len() * b) / b;
        let done = request.num_cached_blocks;
        if done >= full {
            return;
        }
        for index in done..full {
            let (Some(&block), Some(hash)) = (request.blocks.get(index), hashes.get(index)) else {
                continue;
            };
            if self.pool.key(block).is_none() {
                if let Some(p) = self.provenance.as_mut() {
                    p.record(request, index, block, b);
                }
            }
            self.pool.cache_block(block, key_of(hash, self.debug_key_bytes), (index + 1) * b);
        }
        if self.pool.events_enabled() {
            self.pool.push_stored(BlockManager::stored_event(&request.seq, done, full, b));
        }
        request.num_cached_blocks = full;
    }
}

impl Provenance {
    fn record(&mut self, request: &Request, index: usize, block: u32, b: usize) {
        let start = block as usize * b;
        if let Some(slot) = self.tokens.get_mut(start..start + b) {
            let tokens = request.seq.tokens_in(index * b, (index + 1) * b);
            slot.iter_mut().zip(tokens).for_each(|(s, t)| *s = t);
        }
        let parent = index.checked_sub(1).and_then(|i| request.blocks.get(i)).copied();
        if let Some(slot) = self.parent.get_mut(block as usize) {
            *slot = parent.unwrap_or(NO_PARENT);
        }
        if let Some(slot) = self.keys.get_mut(block as usize) {
            *slot = BlockManager::block_key_bytes(&request.seq, index, b);
        }
    }
}

fn event_key(key: &ExtraKey<'_>) -> EventKey {
    match *key {
        ExtraKey::Lora { name, .. } => EventKey::Text(name.to_owned()),
        ExtraKey::Mm { identifier, offset } => EventKey::Mm(identifier.to_owned(), offset),
        ExtraKey::CacheSalt(salt) => EventKey::Text(salt.to_owned()),
        ExtraKey::PromptEmbeds(digest) => EventKey::Bytes(digest.to_vec()),
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
