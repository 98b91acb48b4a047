//! The block pool: reference counts, the free queue in eviction order, the hash-to-block map
//! and KV-cache events, with vLLM 0.33's `BlockPool` rules. One pool serves every KV-cache
//! group of a model: a cache key is a block hash and the group it was computed for.

use crate::free_queue::FreeQueue;
use crate::hashing::BlockHash;
use crate::{try_filled, CoreResult};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Block 0 is vLLM's null block: reserved, never allocated, cached or freed.
pub const NULL_BLOCK: u32 = 0;

/// Map keys are already uniform digests, so a few multiply-xor rounds spread them well.
#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(23) ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word.iter_mut().zip(chunk).for_each(|(w, b)| *w = *b);
            self.0 = (self.0.rotate_left(23) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
}

/// A prefix-cache key: a block's hash and its KV-cache group (vLLM's `BlockHashWithGroupId`;
/// the same tokens cached for two groups are two entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CacheKey {
    pub hash: BlockHash,
    pub group: u32,
}

impl std::hash::Hash for CacheKey {
    /// A digest's bytes are already uniform, so its first eight (with the group mixed in) make
    /// a good table hash; equality still compares the whole key.
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut head = [0u8; 8];
        head.iter_mut().zip(self.hash.as_bytes()).for_each(|(h, b)| *h = *b);
        state.write_u64(u64::from_le_bytes(head) ^ u64::from(self.group).rotate_left(32));
    }
}

impl CacheKey {
    pub fn new(hash: BlockHash, group: u32) -> Self {
        Self { hash, group }
    }
}

pub type DigestMap<K, V> = HashMap<K, V, BuildHasherDefault<DigestHasher>>;

/// One untagged extra key as vLLM reports it in `BlockStored.extra_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKey {
    /// A LoRA name or a cache salt.
    Text(String),
    /// A multimodal `(identifier, offset)`.
    Mm(String, i64),
    /// A prompt-embeds digest.
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    pub lora_name: Option<String>,
    /// One entry per stored block: its untagged keys, or `None` when it has none.
    pub extra_keys: Vec<Option<Vec<EventKey>>>,
}

/// Blocks `first..end` of one group of a request were just registered in the cache (the
/// caller, who owns the request's tokens and keys, builds vLLM's `BlockStored` from it).
/// `skipped` lists the indices in that range left out: null blocks (outside a sliding
/// window) and blocks no cache hit could ever use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub group: u32,
    pub first: usize,
    pub end: usize,
    pub skipped: Vec<usize>,
}

/// vLLM's KV-cache events (medium "GPU"), in the order the pool produced them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A `BlockStored` built in full by the embedded block manager (group 0).
    BlockStored(BlockStored),
    /// Blocks registered for a request; see [`Registered`].
    Registered(Registered),
    BlockRemoved(CacheKey),
    AllBlocksCleared,
}

/// The blocks registered under one key: almost always one (a second only where two requests
/// computed the same block before either registered it), so kept inline, without a heap
/// allocation per registered block.
pub type KeyBlocks = smallvec::SmallVec<[u32; 2]>;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    /// The cache key a block is registered under, if any.
    key: Vec<Option<CacheKey>>,
    /// The prefix length the key of a block covers (vLLM's `block_hash_num_tokens`).
    key_tokens: Vec<u32>,
    queue: FreeQueue,
    /// Key -> blocks registered under it, earliest first (no deduplication, as vLLM).
    cached: DigestMap<CacheKey, KeyBlocks>,
    enable_caching: bool,
    events: Option<Vec<KvEvent>>,
    /// While `Some`, the blocks whose cache entry was evicted (a batched step's record).
    evicted: Option<Vec<u32>>,
    /// Blocks taken out of the cache so far (evictions, and resets): while it stays the same,
    /// every block that was cached still is, under its key and first among the key's blocks
    /// if it was first, so a cached prefix can only grow and a lookup finds the same blocks.
    removals: u64,
}

impl BlockPool {
    /// `num_blocks >= 1`; block 0 is taken as the null block at once.
    pub fn new(num_blocks: u32, enable_caching: bool, enable_events: bool) -> CoreResult<Self> {
        let mut queue = FreeQueue::new(num_blocks)?;
        queue.remove(NULL_BLOCK);
        Ok(Self {
            ref_cnt: try_filled(num_blocks as usize, 0, "block reference counts")?,
            key: try_filled(num_blocks as usize, None, "block keys")?,
            key_tokens: try_filled(num_blocks as usize, 0, "block key lengths")?,
            queue,
            cached: DigestMap::default(),
            enable_caching,
            events: enable_events.then(Vec::new),
            evicted: None,
            removals: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.queue.len()
    }

    /// `1 - free / (N - 1)`: the null block is neither free nor used.
    pub fn usage(&self) -> f64 {
        let usable = self.num_blocks().saturating_sub(1);
        if usable == 0 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / usable as f64
    }

    pub fn ref_cnt(&self, block: u32) -> u32 {
        self.ref_cnt.get(block as usize).copied().unwrap_or(0)
    }

    /// Whether `block` is a real block some request references: not the null block, in the
    /// pool, with a reference, out of the free queue (what every block a table holds must be).
    pub fn is_in_use(&self, block: u32) -> bool {
        block != NULL_BLOCK && self.ref_cnt(block) > 0 && !self.queue.contains(block)
    }

    pub fn key(&self, block: u32) -> Option<&CacheKey> {
        self.key.get(block as usize).and_then(Option::as_ref)
    }

    /// The number of tokens of the prefix that the block's key covers; 0 without a key.
    pub fn key_num_tokens(&self, block: u32) -> usize {
        match self.key(block) {
            Some(_) => self.key_tokens.get(block as usize).map_or(0, |&n| n as usize),
            None => 0,
        }
    }

    pub fn free_block_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.queue.iter()
    }

    pub fn cached_blocks(&self) -> &DigestMap<CacheKey, KeyBlocks> {
        &self.cached
    }

    /// Blocks taken out of the cache so far (see the field): unchanged means nothing cached
    /// was lost or reordered since.
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// The blocks registered under `key`, earliest first.
    pub fn lookup(&self, key: &CacheKey) -> &[u32] {
        self.cached.get(key).map_or(&[], KeyBlocks::as_slice)
    }

    fn emit(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    pub fn push_event(&mut self, event: KvEvent) {
        self.emit(event);
    }

    /// Replaces the `Registered` events at the end of the queue (those of the last call)
    /// by what `rewrite` makes of each: a caller that owns the request's tokens reports them
    /// in full.
    pub fn rewrite_registered(&mut self, mut rewrite: impl FnMut(&Registered) -> KvEvent) {
        let Some(events) = &mut self.events else { return };
        for event in events.iter_mut().rev() {
            let KvEvent::Registered(registered) = event else { break };
            *event = rewrite(registered);
        }
    }

    /// Starts recording evicted blocks (see [`BlockPool::stop_recording_evictions`]).
    pub fn record_evictions(&mut self) {
        self.evicted = Some(Vec::new());
    }

    /// The blocks evicted since `record_evictions`, in order; recording stops.
    pub fn stop_recording_evictions(&mut self) -> Vec<u32> {
        self.evicted.take().unwrap_or_default()
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Drops `block` from the map entry of its key (lazy eviction). Like vLLM, every block
    /// taken out of the map gets its own `BlockRemoved`, even when duplicates keep the key.
    fn evict(&mut self, block: u32) {
        let Some(key) = self.key.get_mut(block as usize).and_then(Option::take) else { return };
        let Some(blocks) = self.cached.get_mut(&key) else { return };
        let before = blocks.len();
        blocks.retain(|b| *b != block);
        if blocks.len() == before {
            return;
        }
        self.removals += 1;
        if blocks.is_empty() {
            self.cached.remove(&key);
        }
        if let Some(evicted) = &mut self.evicted {
            evicted.push(block);
        }
        self.emit(KvEvent::BlockRemoved(key));
    }

    /// Takes `block`'s cache entry away while the block stays in use (vLLM's
    /// `_maybe_evict_cached_block` on a held block: a Mamba checkpoint no hit may use, or a
    /// state re-keyed to another position). `BlockRemoved` if it had one.
    pub fn uncache(&mut self, block: u32) {
        self.evict(block);
    }

    /// Pops `n` blocks from the head of the free queue (the caller has checked that `n` are
    /// free), evicting their cache entries; each gets reference count 1.
    pub fn get_new_blocks(&mut self, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(block) = self.queue.pop_front() else { break };
            if self.enable_caching {
                self.evict(block);
            }
            if let Some(r) = self.ref_cnt.get_mut(block as usize) {
                *r = 1;
            }
            out.push(block);
        }
        out
    }

    /// A prefix hit takes a reference; a free cached block stops being an eviction candidate.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &block in blocks {
            if block == NULL_BLOCK {
                continue;
            }
            if self.ref_cnt(block) == 0 {
                self.queue.remove(block);
            }
            if let Some(r) = self.ref_cnt.get_mut(block as usize) {
                *r += 1;
            }
        }
    }

    /// Releases one reference of each block, `ordered` from first to last to evict. Blocks
    /// that reach zero go to the queue: un-hashed ones to the head (reused first), hashed
    /// ones to the tail (kept as long as possible, LRU).
    pub fn free_blocks(&mut self, ordered: impl Iterator<Item = u32>) {
        let mut front = Vec::new();
        for block in ordered {
            if block == NULL_BLOCK {
                continue;
            }
            let Some(r) = self.ref_cnt.get_mut(block as usize) else { continue };
            *r = r.saturating_sub(1);
            if *r == 0 {
                if self.enable_caching && self.key(block).is_some() {
                    self.queue.push_back(block);
                } else {
                    front.push(block);
                }
            }
        }
        self.queue.prepend_n(&front);
    }

    /// Drops one reference of a block that the caller knows is also held elsewhere.
    pub fn release_shared(&mut self, block: u32) {
        if let Some(r) = self.ref_cnt.get_mut(block as usize) {
            *r = r.saturating_sub(1);
        }
    }

    /// Registers `block` under `key`, which covers a prefix of `num_tokens` tokens (a block
    /// already holding a key keeps it).
    pub fn cache_block(&mut self, block: u32, key: CacheKey, num_tokens: usize) {
        let Some(slot) = self.key.get_mut(block as usize) else { return };
        if slot.is_some() || block == NULL_BLOCK {
            return;
        }
        *slot = Some(key);
        if let Some(n) = self.key_tokens.get_mut(block as usize) {
            *n = u32::try_from(num_tokens).unwrap_or(u32::MAX);
        }
        self.cached.entry(key).or_default().push(block);
    }

    /// vLLM's `reset_prefix_cache`: only when no block is in use; clears every key and emits
    /// one `AllBlocksCleared`. The free queue order is kept.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks() - self.num_free_blocks() != 1 {
            return false;
        }
        self.cached.clear();
        self.removals += 1;
        self.key.iter_mut().for_each(|k| *k = None);
        self.emit(KvEvent::AllBlocksCleared);
        true
    }
}
