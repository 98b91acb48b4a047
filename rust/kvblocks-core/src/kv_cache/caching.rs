//! Registering full blocks in the prefix cache (vLLM's `cache_blocks`, also run by
//! `allocate_slots`): which blocks each group may register (finalized tokens, sparse
//! retention, a Mamba group's reachable states and checkpoint), the Mamba states registered
//! during the current scheduler step, and what the last call registered.

use super::{group, mamba, HashSource, KvCacheCoordinator, RequestBlocks, RequestState};
use crate::hashing::BlockHash;
use crate::pool::{CacheKey, KvEvent, Registered, NULL_BLOCK};
use crate::CoreResult;

/// The hashes of blocks `first..end` of a request, read before a call changes anything.
#[derive(Debug, Default)]
pub(super) struct Keys {
    first: usize,
    end: usize,
    hashes: Vec<BlockHash>,
}

impl Keys {
    fn get(&self, index: usize) -> Option<BlockHash> {
        index.checked_sub(self.first).and_then(|i| self.hashes.get(i)).copied()
    }
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

impl KvCacheCoordinator {
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
        self.cache_with_keys_if_due(held, request, num_computed, &keys, hashes);
        Ok(())
    }

    /// [`Self::cache_with_keys`] where it may register anything (most decode steps fill no
    /// block: nothing to register).
    pub(super) fn cache_with_keys_if_due(
        &mut self,
        held: &mut RequestBlocks,
        request: &RequestState,
        num_computed: usize,
        keys: &Keys,
        hashes: &(impl HashSource + ?Sized),
    ) {
        if keys.end > keys.first || self.tail_may_act(held, request, num_computed) {
            self.cache_with_keys(held, request, num_computed, keys, hashes);
        }
    }

    /// The hashes registering up to `num_tokens` tokens may need (none without caching):
    /// from the first block some group has not registered yet, so that a decode step reads
    /// one hash, not the whole prompt's.
    pub(super) fn read_keys(
        &self,
        held: &RequestBlocks,
        hashes: &(impl HashSource + ?Sized),
        num_tokens: usize,
    ) -> CoreResult<Keys> {
        if !self.config.enable_caching {
            return Ok(Keys::default());
        }
        let (first, end) = self.key_range(held, hashes.len(), num_tokens);
        if first >= end {
            return Ok(Keys { first, end, hashes: Vec::new() });
        }
        let hashes = (first..end).map(|i| hashes.get(i)).collect::<CoreResult<_>>()?;
        Ok(Keys { first, end, hashes })
    }

    /// The blocks caching up to `num_tokens` tokens may register, `[first, end)`: from the
    /// first block some group has not registered to the last full block with a hash.
    fn key_range(
        &self,
        held: &RequestBlocks,
        num_hashes: usize,
        num_tokens: usize,
    ) -> (usize, usize) {
        let end = num_hashes.min(num_tokens / self.config.block_size());
        let first = held.groups.iter().map(|g| g.num_cached.unwrap_or(0)).min().unwrap_or(0);
        (first, end)
    }

    /// Whether [`Self::cache_blocks`] up to `num_computed` tokens of a request with
    /// `num_hashes` block hashes may do anything: register a block, or act on a Mamba
    /// group's tail. False on most decode steps (no block filled), so that a caller can skip
    /// reading the rest of the request.
    pub fn cache_blocks_due(
        &self,
        held: &RequestBlocks,
        num_computed: usize,
        num_hashes: usize,
    ) -> bool {
        if self.any_align {
            return true;
        }
        if !self.config.enable_caching {
            return false;
        }
        let (first, end) = self.key_range(held, num_hashes, num_computed);
        first < end
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

    /// What the last `allocate_slots` or `cache_blocks` call registered, per group.
    pub fn last_registered(&self) -> &[Registered] {
        &self.registered
    }

    /// The Mamba states the last `allocate_slots` or `cache_blocks` call registered as full
    /// blocks, in group then column order (with prefix caching in Mamba groups only).
    pub fn last_boundary_states(&self) -> &[BoundaryState] {
        &self.boundary_states
    }

    /// Rewrites the pending `Registered` events into the caller's (the embedded block manager
    /// owns the tokens and keys a full `BlockStored` event carries).
    pub fn rewrite_registered(&mut self, rewrite: impl FnMut(&Registered) -> KvEvent) {
        self.pool.rewrite_registered(rewrite);
    }
}
