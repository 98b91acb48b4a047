//! The prefix lookup (vLLM's `get_computed_blocks` and the per-group search a KV connector
//! uses, over [`hit`]'s search) and the checks on the hits a caller hands back
//! to `allocate_slots`.

use super::hit::{self, AnyCached, CacheHit, HitFilter};
use super::{invalid, AttentionKind, HashSource, KvCacheCoordinator, RequestBlocks};
use crate::hashing::BlockHash;
use crate::pool::{CacheKey, NULL_BLOCK};
use crate::CoreResult;

/// vLLM passes the shared empty result when there is nothing to adopt, and adopts a result
/// with any block (null ones included).
pub(super) fn no_hits(hits: &[&[u32]]) -> bool {
    hits.iter().all(|h| h.is_empty())
}

impl KvCacheCoordinator {
    /// vLLM's `get_computed_blocks` search: the cached prefix every group can serve, at most
    /// `max_length` tokens long, of blocks `filter` accepts ([`AnyCached`]: vLLM's). Takes no
    /// references.
    pub fn find_longest_cache_hit(
        &self,
        hashes: &(impl HashSource + ?Sized),
        max_length: usize,
        filter: &(impl HitFilter + ?Sized),
    ) -> CoreResult<CacheHit> {
        if !self.config.enable_caching {
            return Ok(CacheHit::empty(self.num_groups()));
        }
        let prefix = self.lookup_prefix(hashes, max_length)?;
        let block_size = self.config.block_size();
        let search = hit::Search { pool: &self.pool, hashes: &prefix, block_size, filter };
        Ok(hit::find_longest_cache_hit(&search, &self.sets, self.num_groups(), max_length))
    }

    /// Whether a lookup's hit is a plain longest prefix of cached blocks: one full-attention
    /// group, no EAGLE drop, caching on ([`Self::extend_cached_prefix`] answers for it).
    pub fn is_plain_prefix(&self) -> bool {
        self.config.enable_caching
            && self.num_groups() == 1
            && matches!(self.sets.as_slice(), [only] if only.kind == AttentionKind::Full && !only.drop_eagle)
    }

    /// Where [`Self::is_plain_prefix`]: the cached prefix of `hashes`, at most `max_length`
    /// tokens, given `blocks`, a prefix of it found earlier (cut to the limit, then extended
    /// block by block): the blocks [`Self::find_longest_cache_hit`] finds, the first block
    /// registered under each key.
    pub fn extend_cached_prefix(
        &self,
        hashes: &(impl HashSource + ?Sized),
        blocks: &mut Vec<u32>,
        max_length: usize,
    ) -> CoreResult<()> {
        let limit = hashes.len().min(max_length / self.config.block_size());
        blocks.truncate(limit);
        while blocks.len() < limit {
            let key = CacheKey::new(hashes.get(blocks.len())?, 0);
            let Some(&block) = self.pool.lookup(&key).first() else { break };
            blocks.push(block);
        }
        Ok(())
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
        let search =
            hit::Search { pool: &self.pool, hashes: &prefix, block_size, filter: &AnyCached };
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
    pub(super) fn check_hits(
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
        if let Some((group, index, block)) = self.first_unservable_hit(hits, &AnyCached) {
            return Err(invalid(format!(
                "new_computed_blocks[{group}][{index}] = {block} is not a block cached for group \
                 {group}"
            )));
        }
        Ok(())
    }

    /// The first block of `hits` (per group, as a lookup gives them) that no lookup could have
    /// given, as `(group, index, block)`: a null block where the group needs a real one (all
    /// but a window or chunk group's leading run), a block not cached for its group, or one
    /// `filter` does not accept after the group's blocks before it.
    pub(crate) fn first_unservable_hit(
        &self,
        hits: &[&[u32]],
        filter: &(impl HitFilter + ?Sized),
    ) -> Option<(usize, usize, u32)> {
        for (group, (blocks, spec)) in hits.iter().zip(&self.config.groups).enumerate() {
            let nulls = if spec.kind.is_full() {
                0
            } else {
                blocks.iter().take_while(|&&b| b == NULL_BLOCK).count()
            };
            for (index, &block) in blocks.iter().enumerate().skip(nulls) {
                let before = blocks.get(..index).unwrap_or_default();
                let servable = block != NULL_BLOCK
                    && self.pool.key(block).is_some_and(|key| {
                        key.group as usize == group
                            && filter.accepts(group, index, block, key, before)
                    });
                if !servable {
                    return Some((group, index, block));
                }
            }
        }
        None
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
}
