//! What the embedded manager adds to the coordinator's prefix lookup and hit checks: the
//! cache keys (with debug keys cut short), and (with `verify_tokens`) the provenance that
//! proves a cached block holds the same tokens as the request's block, as a [`HitFilter`].

use super::{invalid, BlockManager, Request};
use crate::hashing::native;
use crate::kv_cache::{HashSource, HitFilter};
use crate::pool::CacheKey;
use crate::{try_filled, BlockHash, CoreResult, ExtraKey, TokenSequence};

/// The parent of a first block.
pub(super) const NO_PARENT: u32 = u32::MAX;

/// What a verifying manager remembers of each cached block.
#[derive(Debug, Clone)]
pub(super) struct Provenance {
    tokens: Vec<u32>,
    parent: Vec<u32>,
    keys: Vec<Option<Box<[u8]>>>,
}

impl Provenance {
    pub(super) fn new(num_blocks: usize, block_size: usize) -> CoreResult<Self> {
        Ok(Self {
            tokens: try_filled(num_blocks * block_size, 0, "verified block tokens")?,
            parent: try_filled(num_blocks, NO_PARENT, "verified block parents")?,
            keys: try_filled(num_blocks, None, "verified block keys")?,
        })
    }

    /// Remembers that `block` now holds block `index` of `request`.
    pub(super) fn record(&mut self, request: &Request, index: usize, block: u32, b: usize) {
        let start = block as usize * b;
        if let Some(slot) = self.tokens.get_mut(start..start + b) {
            let tokens = request.seq.tokens_in(index * b, (index + 1) * b);
            slot.iter_mut().zip(tokens).for_each(|(s, t)| *s = t);
        }
        let parent = index.checked_sub(1).and_then(|i| request.blocks().get(i)).copied();
        if let Some(slot) = self.parent.get_mut(block as usize) {
            *slot = parent.unwrap_or(NO_PARENT);
        }
        if let Some(slot) = self.keys.get_mut(block as usize) {
            *slot = block_key_bytes(&request.seq, index, b);
        }
    }

    /// True when `block` holds exactly block `index` of `seq` after `parent`.
    fn matches(
        &self,
        seq: &TokenSequence,
        index: usize,
        block: u32,
        parent: u32,
        b: usize,
    ) -> bool {
        let start = block as usize * b;
        let stored = self.tokens.get(start..start + b).unwrap_or_default();
        self.parent.get(block as usize) == Some(&parent)
            && stored.iter().copied().eq(seq.tokens_in(index * b, (index + 1) * b))
            && self.keys.get(block as usize).cloned().flatten() == block_key_bytes(seq, index, b)
    }
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

/// The hash a block is registered under: the hash itself, or its first `n` bytes in debug
/// mode (so that unrelated blocks collide).
fn registered_hash(hash: &BlockHash, debug_key_bytes: Option<usize>) -> BlockHash {
    let Some(n) = debug_key_bytes else { return *hash };
    let mut key = *hash;
    match &mut key {
        BlockHash::Sha256(b) => b.iter_mut().skip(n).for_each(|x| *x = 0),
        BlockHash::Xxh3(b) => b.iter_mut().skip(n).for_each(|x| *x = 0),
    }
    key
}

/// The cache key of a block hash in the manager's one group (0).
fn key_of(hash: &BlockHash, debug_key_bytes: Option<usize>) -> CacheKey {
    CacheKey::new(registered_hash(hash, debug_key_bytes), 0)
}

/// A sequence's block hashes as the coordinator registers them (see [`registered_hash`]).
pub(super) struct CacheKeys<'a> {
    hashes: &'a [BlockHash],
    debug_key_bytes: Option<usize>,
}

impl<'a> CacheKeys<'a> {
    pub(super) fn new(hashes: &'a [BlockHash], debug_key_bytes: Option<usize>) -> Self {
        Self { hashes, debug_key_bytes }
    }
}

impl HashSource for CacheKeys<'_> {
    fn len(&self) -> usize {
        self.hashes.len()
    }

    fn get(&self, index: usize) -> CoreResult<BlockHash> {
        HashSource::get(self.hashes, index).map(|h| registered_hash(&h, self.debug_key_bytes))
    }
}

/// The embedded manager's rule for prefix hits, which the coordinator's hit search and hit
/// checks apply: a block serves block `index` of `seq` only if it is registered under the
/// sequence's hash `index` and, with `verify_tokens`, holds the same tokens after the same
/// parent (the hit's previous block) with the same extra keys.
struct Verified<'a> {
    seq: &'a TokenSequence,
    provenance: Option<&'a Provenance>,
    debug_key_bytes: Option<usize>,
    block_size: usize,
}

impl HitFilter for Verified<'_> {
    fn accepts(&self, _: usize, index: usize, block: u32, key: &CacheKey, before: &[u32]) -> bool {
        let hash = self.seq.block_hashes().get(index);
        let registered = hash.is_some_and(|h| *key == key_of(h, self.debug_key_bytes));
        let parent = before.last().copied().unwrap_or(NO_PARENT);
        registered
            && self
                .provenance
                .is_none_or(|p| p.matches(self.seq, index, block, parent, self.block_size))
    }
}

/// The index of the first block of `blocks` that also stands earlier in it.
fn first_repeat(blocks: &[u32]) -> Option<usize> {
    let seen_before = |(i, b): (usize, &u32)| blocks.get(..i).is_some_and(|seen| seen.contains(b));
    blocks.iter().enumerate().position(seen_before)
}

impl BlockManager {
    fn verified<'a>(&'a self, request: &'a Request) -> Verified<'a> {
        Verified {
            seq: &request.seq,
            provenance: self.provenance.as_ref(),
            debug_key_bytes: self.config.debug_key_bytes,
            block_size: self.block_size,
        }
    }

    /// The request's longest cached prefix (vLLM's `get_computed_blocks`), capped so that at
    /// least its last token is computed: the coordinator's search, of blocks [`Verified`]
    /// accepts. Takes no references.
    pub(super) fn computed_blocks(&self, request: &Request) -> CoreResult<Vec<u32>> {
        let max_length = request.seq.num_tokens().saturating_sub(1);
        let hashes = CacheKeys::new(request.seq.block_hashes(), self.config.debug_key_bytes);
        let found = self.coordinator.find_longest_cache_hit(
            &hashes,
            max_length,
            &self.verified(request),
        )?;
        let mut hits = found.blocks.into_iter().next().unwrap_or_default();
        // A block already in the hit is a key collision, possible only with keys cut short
        // for debugging: one block cannot hold two positions, the hit ends.
        if self.config.debug_key_bytes.is_some() {
            if let Some(end) = first_repeat(&hits) {
                hits.truncate(end);
            }
        }
        Ok(hits)
    }

    /// Caller-supplied hits must be the request's cached prefix, block by block (the
    /// coordinator's check, with [`Verified`]), each block once.
    pub(super) fn check_hits(
        &self,
        request: &Request,
        hits: &[u32],
        hit_tokens: usize,
    ) -> CoreResult<()> {
        if hits.len() * self.block_size != hit_tokens {
            return Err(invalid(format!(
                "num_new_computed_tokens={hit_tokens} must equal len(new_computed_blocks) * \
                 block_size = {}",
                hits.len() * self.block_size
            )));
        }
        let unservable = self.coordinator.first_unservable_hit(&[hits], &self.verified(request));
        let first_bad = unservable.map(|(_, index, _)| index).into_iter().chain(first_repeat(hits));
        if let Some(index) = first_bad.min() {
            let block = hits.get(index).copied().unwrap_or_default();
            return Err(invalid(format!(
                "new_computed_blocks[{index}] = {block} is not the request's cached block \
                 {index}; pass what get_computed_blocks returned"
            )));
        }
        Ok(())
    }
}
