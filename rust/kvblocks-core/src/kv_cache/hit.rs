//! The prefix-cache hit search: for each attention kind, which cached blocks serve a
//! request's prefix (vLLM's single-type managers' `find_longest_cache_hit`), and for several
//! groups the longest prefix every group can serve (vLLM's unitary and hybrid coordinators).
//!
//! Every group shares one block size here, which is also the hash block size and the hit
//! alignment, so block `i` of every group is keyed by the request's hash `i`.
//!
//! This is the one walk over cached blocks in the crate: the embedded block manager's
//! token-verified hits come from it too, through a [`HitFilter`], and so do a router's
//! predictions of a replica's hit, through [`CachedBlocks`] and a [`HitRule`].

use super::spec::{AttentionKind, CoordinatorConfig, GroupSpec};
use crate::hashing::BlockHash;
use crate::pool::{BlockPool, CacheKey, NULL_BLOCK};
use crate::CoreResult;
use smallvec::SmallVec;

/// One block per group of a lookup set, found at one position (no heap allocation for the
/// few groups a set has).
type Found = SmallVec<[u32; 4]>;

/// The cached blocks a request can adopt, per group (null blocks where a group needs no
/// block), and the number of tokens they cover.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheHit {
    pub blocks: Vec<Vec<u32>>,
    pub num_tokens: usize,
    /// Tokens of a longer prefix that some group has cached and another has not (vLLM's
    /// `num_uncached_common_prefix_tokens`; 0 unless hybrid).
    pub num_uncached_common: usize,
}

impl CacheHit {
    pub fn empty(num_groups: usize) -> Self {
        Self { blocks: vec![Vec::new(); num_groups], ..Self::default() }
    }

    /// vLLM passes an empty result by identity and adopts nothing for it; a result with any
    /// block (null ones included) is adopted.
    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(Vec::is_empty)
    }
}

/// Which cached blocks a prefix hit may adopt, beyond their cache key. vLLM adopts any block
/// cached under the request's hash ([`AnyCached`]); the embedded block manager also checks
/// that the block holds the request's tokens. A search takes, at each position, the first
/// candidate the filter accepts, and the checks on hits a caller hands back
/// ([`crate::KvCacheCoordinator`]'s) refuse a block it does not accept.
pub trait HitFilter {
    /// Whether `block`, registered under `key` for group `group`, may serve block `index` of
    /// the request. `before` is the group's hit before it where the search extends a hit
    /// from its first block (full and chunked local attention, and every check: `index`
    /// blocks); the searches from the right (sliding window, Mamba) pass none.
    fn accepts(
        &self,
        group: usize,
        index: usize,
        block: u32,
        key: &CacheKey,
        before: &[u32],
    ) -> bool;
}

/// vLLM's rule: every block cached under the request's hash serves it.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnyCached;

impl HitFilter for AnyCached {
    fn accepts(&self, _: usize, _: usize, _: u32, _: &CacheKey, _: &[u32]) -> bool {
        true
    }
}

/// One lookup set's hit: per member group its blocks, and the hit length in tokens.
struct SetHit {
    blocks: Vec<Vec<u32>>,
    num_tokens: usize,
}

/// vLLM's `find_longest_cache_hit` of a kind, for the groups of one lookup set, over a
/// prefix of at most `max_length` tokens. `drop_eagle` drops the last matched block (EAGLE
/// must recompute it to get its hidden states). `hashes` holds at least the first
/// `min(len(block_hashes), max_length / block_size + 1)` of the request's hashes (enough for
/// every limit below; vLLM would fail on an index past the request's hashes, here the
/// search stops there).
fn find_for_kind<F: HitFilter + ?Sized, C: CachedBlocks + ?Sized>(
    search: &Search<'_, F, C>,
    kind: AttentionKind,
    max_length: usize,
    groups: &[usize],
    drop_eagle: bool,
) -> SetHit {
    let Search { hashes, block_size, .. } = *search;
    let max_blocks = (max_length / block_size).min(hashes.len());
    let searched = hashes.get(..max_blocks).unwrap_or_default();
    let mut blocks = vec![Vec::new(); groups.len()];
    let push = |blocks: &mut Vec<Vec<u32>>, found: Found| {
        blocks.iter_mut().zip(found).for_each(|(b, f)| b.push(f));
    };
    match kind {
        AttentionKind::Full => {
            // Chained hashes: the first miss ends the hit.
            for (i, hash) in searched.iter().enumerate() {
                let Some(found) = search.cached(i, hash, groups, &blocks) else { break };
                push(&mut blocks, found);
            }
        }
        AttentionKind::SlidingWindow { .. } => {
            // Only the blocks the last token's window reads must be cached: search from the
            // right for enough contiguous hits; everything before them is null.
            let needed = kind.window_hit_blocks(block_size, drop_eagle).unwrap_or(0);
            let mut run: Vec<Found> = Vec::new();
            let mut found = None;
            for (i, hash) in searched.iter().enumerate().rev() {
                match search.cached(i, hash, groups, &[]) {
                    Some(hit) => {
                        run.push(hit);
                        if run.len() >= needed {
                            found = Some(i);
                            break;
                        }
                    }
                    None => run.clear(),
                }
            }
            // Without a full window, the run that starts at block 0 is still a hit.
            let start = found.unwrap_or(0);
            blocks.iter_mut().for_each(|b| b.resize(start, NULL_BLOCK));
            run.into_iter().rev().for_each(|hit| push(&mut blocks, hit));
        }
        AttentionKind::ChunkedLocal { chunk } => {
            // Blocks of chunks before the last one are never read again: null, and computed
            // (whether or not the request has hashes that far).
            let first = max_length / chunk * chunk / block_size;
            blocks.iter_mut().for_each(|b| b.resize(first, NULL_BLOCK));
            for (i, hash) in searched.iter().enumerate().skip(first) {
                let Some(found) = search.cached(i, hash, groups, &blocks) else { break };
                push(&mut blocks, found);
            }
        }
        AttentionKind::Mamba { .. } => {
            // A state is complete in itself: the latest cached one is the hit, every column
            // before it null. (vLLM's Mamba search ignores the EAGLE drop.)
            for (i, hash) in searched.iter().enumerate().rev() {
                if let Some(found) = search.cached(i, hash, groups, &[]) {
                    blocks.iter_mut().for_each(|b| b.resize(i, NULL_BLOCK));
                    push(&mut blocks, found);
                    break;
                }
            }
        }
    }
    if drop_eagle && !kind.is_mamba() {
        blocks.iter_mut().for_each(|b| {
            b.pop();
        });
    }
    let num_tokens = blocks.first().map_or(0, Vec::len) * block_size;
    SetHit { blocks, num_tokens }
}

/// Groups whose prefix hits are looked up together (vLLM's `SpecGroup`): equal specs, one
/// kind; `drop_eagle` when any member drops its last hit block for EAGLE.
#[derive(Debug, Clone)]
pub(crate) struct LookupSet {
    pub kind: AttentionKind,
    pub groups: Vec<usize>,
    pub drop_eagle: bool,
}

/// The lookup sets in vLLM's order (a validated config names every group once).
pub(crate) fn lookup_sets(config: &CoordinatorConfig, drop: &[bool]) -> Vec<LookupSet> {
    let mut sets =
        if config.groups.len() == 1 { vec![vec![0]] } else { config.lookup_sets.clone() };
    // vLLM's hybrid coordinator visits full attention first (a stable sort, like vLLM's).
    let is_full = |set: &Vec<usize>| {
        set.first().and_then(|&g| config.groups.get(g)).map(|g| g.kind.is_full())
    };
    sets.sort_by_key(|set| !is_full(set).unwrap_or(false));
    sets.into_iter()
        .filter_map(|groups| {
            let kind = config.groups.get(*groups.first()?)?.kind;
            let drop_eagle = groups.iter().any(|&g| drop.get(g).copied().unwrap_or(false));
            Some(LookupSet { kind, groups, drop_eagle })
        })
        .collect()
}

/// Where a search finds the blocks cached under a key: a block pool, or a record of what
/// another engine's pool holds (a router's index of one replica's blocks).
pub trait CachedBlocks {
    /// The blocks cached under `key`, in the order a search tries them.
    fn cached_blocks(&self, key: &CacheKey) -> &[u32];
}

impl CachedBlocks for BlockPool {
    fn cached_blocks(&self, key: &CacheKey) -> &[u32] {
        self.lookup(key)
    }
}

/// What a hit search reads: where blocks are cached, the request's leading hashes (see
/// [`find_for_kind`]), the block size every group shares, and which cached blocks it may
/// adopt.
pub(crate) struct Search<'a, F: ?Sized, C: ?Sized = BlockPool> {
    pub pool: &'a C,
    pub hashes: &'a [BlockHash],
    pub block_size: usize,
    pub filter: &'a F,
}

impl<F: ?Sized, C: ?Sized> Clone for Search<'_, F, C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F: ?Sized, C: ?Sized> Copy for Search<'_, F, C> {}

impl<F: HitFilter + ?Sized, C: CachedBlocks + ?Sized> Search<'_, F, C> {
    /// The block the filter accepts for position `index` (hash `hash`) in each group of
    /// `groups`, or `None` if any group has none; `hit` holds the groups' hits so far (see
    /// [`HitFilter::accepts`]).
    fn cached(
        &self,
        index: usize,
        hash: &BlockHash,
        groups: &[usize],
        hit: &[Vec<u32>],
    ) -> Option<Found> {
        let mut found = Found::new();
        for (k, &g) in groups.iter().enumerate() {
            let key = CacheKey::new(*hash, g as u32);
            let before = hit.get(k).map_or(&[][..], Vec::as_slice);
            let accepts = |&b: &u32| self.filter.accepts(g, index, b, &key, before);
            found.push(*self.pool.cached_blocks(&key).iter().find(|b| accepts(b))?);
        }
        Some(found)
    }

    /// How far a lookup set searches for a hit of at most `length` tokens: with the EAGLE
    /// drop (never for Mamba) one block further, as far as the hashes go, so that the hit
    /// is `length` once its last block is dropped.
    fn limit(&self, kind: AttentionKind, drop_eagle: bool, length: usize) -> usize {
        if drop_eagle && !kind.is_mamba() {
            length.saturating_add(self.block_size).min(self.hashes.len() * self.block_size)
        } else {
            length
        }
    }
}

/// The longest prefix of the request's hashes (at most `max_length` tokens) every group can
/// serve from the cache (vLLM's unitary and hybrid coordinators).
pub(crate) fn find_longest_cache_hit(
    search: &Search<'_, impl HitFilter + ?Sized, impl CachedBlocks + ?Sized>,
    sets: &[LookupSet],
    num_groups: usize,
    max_length: usize,
) -> CacheHit {
    match sets {
        [only] if num_groups == 1 => {
            let hit = find_for_kind(search, only.kind, max_length, &only.groups, only.drop_eagle);
            CacheHit { blocks: hit.blocks, num_tokens: hit.num_tokens, num_uncached_common: 0 }
        }
        _ => hybrid_hit(search, sets, num_groups, max_length),
    }
}

/// vLLM's `find_longest_cache_hit_per_group`: each lookup set searched on its own, over at
/// most `max_length` tokens (with the EAGLE drop, one block more, as far as the hashes go),
/// with no agreement between sets. Per group, its blocks and its hit length in tokens.
pub(crate) fn find_cache_hit_per_group(
    search: &Search<'_, impl HitFilter + ?Sized, impl CachedBlocks + ?Sized>,
    sets: &[LookupSet],
    num_groups: usize,
    max_length: usize,
) -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut blocks = vec![Vec::new(); num_groups];
    let mut lengths = vec![0; num_groups];
    for set in sets {
        let limit = search.limit(set.kind, set.drop_eagle, max_length);
        let hit = find_for_kind(search, set.kind, limit, &set.groups, set.drop_eagle);
        for (&g, group_blocks) in set.groups.iter().zip(hit.blocks) {
            if let (Some(slot), Some(length)) = (blocks.get_mut(g), lengths.get_mut(g)) {
                *slot = group_blocks;
                *length = hit.num_tokens;
            }
        }
    }
    (blocks, lengths)
}

/// vLLM's hybrid coordinator: every lookup set either accepts the candidate length or
/// shortens it, and a shortening restarts the round, until the length holds for all.
fn hybrid_hit(
    search: &Search<'_, impl HitFilter + ?Sized, impl CachedBlocks + ?Sized>,
    sets: &[LookupSet],
    num_groups: usize,
    max_length: usize,
) -> CacheHit {
    let block_size = search.block_size;
    // Per set: its last hit (blocks per member) and length, once looked up.
    let mut hits: Vec<Option<SetHit>> = sets.iter().map(|_| None).collect();
    let simple = sets.len() == 2 && sets.first().is_some_and(|s| s.kind.is_full());
    let mut hit_length = max_length;
    let mut longest = 0;
    // Sets whose EAGLE drop was applied at the current candidate length (at most once each).
    let mut eagle_verified = vec![false; sets.len()];
    loop {
        let mut current = hit_length;
        for ((set, slot), index) in sets.iter().zip(&mut hits).zip(0..) {
            if let (true, Some(earlier)) = (set.kind.is_full(), slot.as_ref()) {
                // Full attention is downward-closed: trim the earlier hit, no new lookup.
                current = current.min(earlier.num_tokens);
                continue;
            }
            let drop_eagle = set.drop_eagle && !eagle_verified.get(index).copied().unwrap_or(true);
            let limit = search.limit(set.kind, drop_eagle, current);
            let hit = find_for_kind(search, set.kind, limit, &set.groups, drop_eagle);
            if drop_eagle {
                if let Some(v) = eagle_verified.get_mut(index) {
                    *v = true;
                }
            } else if hit.num_tokens < current {
                eagle_verified.iter_mut().for_each(|v| *v = false);
            }
            current = hit.num_tokens;
            longest = longest.max(current);
            *slot = Some(hit);
        }
        if current >= hit_length {
            break;
        }
        hit_length = current;
        if simple {
            break;
        }
    }
    let mut blocks = vec![Vec::new(); num_groups];
    for (set, hit) in sets.iter().zip(hits) {
        let Some(hit) = hit else { continue };
        for (&g, mut group_blocks) in set.groups.iter().zip(hit.blocks) {
            if set.kind.is_full() {
                group_blocks.truncate(hit_length.div_ceil(block_size));
            }
            if let Some(slot) = blocks.get_mut(g) {
                *slot = group_blocks;
            }
        }
    }
    CacheHit {
        blocks,
        num_tokens: hit_length,
        num_uncached_common: longest.saturating_sub(hit_length),
    }
}

/// A KV-cache layout's prefix-hit rule apart from any pool: its groups' lookup sets in
/// vLLM's order, for predicting the hit of a cache kvblocks only reads about (a router's
/// record of what a replica holds, [`crate::router`]).
#[derive(Debug, Clone)]
pub struct HitRule {
    sets: Vec<LookupSet>,
    num_groups: usize,
    block_size: usize,
}

impl HitRule {
    /// The rule of `groups` (one block size, the hash block size), looked up in `lookup_sets`
    /// (as [`CoordinatorConfig::lookup_sets`]), with vLLM's EAGLE block drop when
    /// `use_eagle`. Refuses what a [`CoordinatorConfig`] with prefix caching refuses.
    pub fn new(
        groups: Vec<GroupSpec>,
        lookup_sets: Vec<Vec<usize>>,
        use_eagle: bool,
    ) -> CoreResult<Self> {
        let block_size = groups.first().map_or(1, |g| g.block_size);
        let config = CoordinatorConfig {
            groups,
            lookup_sets,
            use_eagle,
            ..CoordinatorConfig::single_group(1, block_size, usize::MAX)
        };
        config.validate()?;
        let sets = self::lookup_sets(&config, &config.eagle_drop_groups());
        Ok(Self { sets, num_groups: config.groups.len(), block_size })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_groups(&self) -> usize {
        self.num_groups
    }

    /// Whether the hit is the longest prefix of blocks every group holds: full attention
    /// (MLA included) only, no EAGLE drop.
    pub fn is_plain_prefix(&self) -> bool {
        self.sets.iter().all(|s| s.kind.is_full() && !s.drop_eagle)
    }

    /// The tokens of a request with `hashes` (all its full blocks' hashes) that a lookup of
    /// at most `max_length` tokens finds in `cached` (vLLM's rule: any block cached under the
    /// request's hash serves it).
    pub fn hit_tokens(
        &self,
        cached: &(impl CachedBlocks + ?Sized),
        hashes: &[BlockHash],
        max_length: usize,
    ) -> usize {
        let search =
            Search { pool: cached, hashes, block_size: self.block_size, filter: &AnyCached };
        find_longest_cache_hit(&search, &self.sets, self.num_groups, max_length).num_tokens
    }
}
