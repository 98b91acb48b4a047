//! A Mamba group with prefix caching (vLLM 0.33's `MambaManager` in `mamba_cache_mode=
//! "align"`), for layouts whose groups all share the hash block size `B`.
//!
//! A request's table is indexed by position: block `i` stands for the state after
//! `(i + 1) * B` tokens. Most entries are null; the live ones are the running state (column
//! `cdiv(n, B) - 1` once `n` tokens are scheduled), the `K` blocks for the states of draft
//! tokens after it, and, in a prefill chunk that can export one, a checkpoint state in the
//! column before the running one. The states at block boundaries are cached like full
//! blocks (sparsely with a retention interval); a hit is the single latest cached state.
//!
//! What vLLM's manager keeps per request lives in a `MambaState`, beside the table; the one
//! coordinator-wide set (the keys cached during the current scheduler step, which no request may
//! adopt in that step) is the coordinator's.

use super::spec::{AttentionKind, CoordinatorConfig, GroupSpec};
use super::table::GroupBlocks;
use crate::hashing::BlockHash;
use crate::pool::{BlockPool, CacheKey, KvEvent, Registered, NULL_BLOCK};
use std::collections::HashSet;
use std::hash::BuildHasherDefault;

/// Keys registered during one scheduler step (vLLM's `cached_blocks_this_step`).
pub(super) type StepKeys = HashSet<CacheKey, BuildHasherDefault<crate::pool::DigestHasher>>;

/// What decides a Mamba group's align-mode behaviour.
#[derive(Debug, Clone, Copy)]
pub(super) struct Align {
    block_size: usize,
    pub(super) speculative_blocks: usize,
    /// `Some` when the spec has prefill checkpoint blocks and an alignment.
    checkpoint_alignment: Option<usize>,
    /// vLLM's `drop_eagle_checkpoint_block` (the EAGLE block drop is on).
    drop_eagle: bool,
    lookahead: usize,
    retention: Option<usize>,
}

impl Align {
    /// The group's align-mode parameters, if it is a Mamba group with prefix caching on.
    pub fn of(spec: &GroupSpec, config: &CoordinatorConfig) -> Option<Self> {
        let AttentionKind::Mamba { speculative_blocks, checkpoint_alignment } = spec.kind else {
            return None;
        };
        config.enable_caching.then_some(Self {
            block_size: spec.block_size,
            speculative_blocks,
            checkpoint_alignment,
            drop_eagle: config.use_eagle,
            lookahead: config.num_hash_lookahead_tokens,
            retention: config.retention_interval,
        })
    }

    /// vLLM's `get_mamba_prefill_checkpoint_position`: the last block boundary a prompt or
    /// chunk of `n` tokens can reuse (with the EAGLE drop, one block earlier).
    pub fn checkpoint_position(&self, n: usize) -> usize {
        let (n, b) = (n as i64, self.block_size as i64);
        let limit = if self.drop_eagle { n } else { n - self.lookahead.max(1) as i64 };
        let mut position = limit.div_euclid(b) * b;
        if self.drop_eagle {
            position -= b;
        }
        position.max(0) as usize
    }

    /// vLLM's `is_mamba_prefill_checkpoint_valid` for a chunk `[start, end)` and a
    /// checkpoint at `position` (the hash, Mamba and alignment block sizes are all `B`).
    fn checkpoint_valid(&self, start: usize, end: usize, position: usize) -> bool {
        let Some(alignment) = self.checkpoint_alignment else { return false };
        let (start, end, position, b) =
            (start as i64, end as i64, position as i64, self.block_size as i64);
        let initial_column = (start - 1).div_euclid(b);
        let checkpoint_column = (end + b - 1).div_euclid(b) - 2;
        start % b == 0
            && checkpoint_column > initial_column
            && start + b <= position
            && start < position
            && position < end
            && (position - start) % alignment as i64 == 0
    }

    /// vLLM's `_needs_internal_checkpoint`: the chunk `[start, end)` writes a checkpoint at
    /// `position` into a column not holding a live state.
    fn needs_checkpoint(
        &self,
        held: &GroupBlocks,
        start: usize,
        end: usize,
        position: usize,
        prefill_end: usize,
    ) -> bool {
        if end < prefill_end || !self.checkpoint_valid(start, end, position) {
            return false;
        }
        let Some(column) = end.div_ceil(self.block_size).checked_sub(2) else { return false };
        let len = held.blocks.len();
        column >= len
            || held.blocks.get(column) == Some(&NULL_BLOCK)
            || (held.mamba.allocated && column + self.speculative_blocks >= len)
    }

    /// Which of blocks `range` the base caching pass registers (vLLM's Mamba
    /// `reachable_block_mask`); `None` for all. With a retention interval of `r` tokens one
    /// state per `r` tokens, plus (also with `Some(0)`) the states where a request replaying
    /// the prompt or a sibling after a shared prefix resumes (`boundaries`).
    pub fn reachable_mask(
        &self,
        range: std::ops::Range<usize>,
        boundaries: impl FnOnce() -> Vec<usize>,
    ) -> Option<Vec<bool>> {
        let b = self.block_size;
        let retention = self.retention?;
        let mut mask = vec![false; range.len()];
        if retention != 0 {
            let per_segment = retention / b;
            if per_segment <= 1 {
                return None;
            }
            for (slot, i) in mask.iter_mut().zip(range.clone()) {
                *slot = (i + 1) % per_segment == 0;
            }
        }
        for boundary in boundaries() {
            let Some(i) = (boundary / b).checked_sub(1) else { continue };
            if range.contains(&i) {
                if let Some(slot) = mask.get_mut(i - range.start) {
                    *slot = true;
                }
            }
        }
        Some(mask)
    }

    /// Whether the retention interval alone keeps a state at `position` (vLLM's mask for its
    /// block, without replay boundaries).
    fn retains(&self, position: usize) -> bool {
        let b = self.block_size;
        position % b == 0
            && match self.retention {
                None => true,
                Some(0) => false,
                Some(r) => r / b <= 1 || (position / b) % (r / b) == 0,
            }
    }
}

/// A Mamba group's answer to vLLM's `get_num_blocks_to_allocate`.
pub(super) enum Demand {
    /// The request's hit is a state cached during this step: vLLM answers
    /// `num_gpu_blocks + 1` so that the request waits for the next step.
    Defer,
    /// The blocks it needs (negative when it holds more than this step needs, as vLLM's
    /// count can be) and the checkpoint the chunk writes.
    Blocks { blocks: i64, checkpoint: Option<(usize, usize)> },
}

/// vLLM's align-mode `get_num_blocks_to_allocate` for a chunk ending at `main` tokens
/// (draft tokens included, lookahead slots not) after `total_computed` computed ones.
#[allow(clippy::too_many_arguments)] // vLLM's own arguments
pub(super) fn num_blocks_to_allocate(
    align: &Align,
    pool: &BlockPool,
    held: &GroupBlocks,
    hits: &[u32],
    total_computed: usize,
    main: usize,
    prefill_end: usize,
    this_step: &StepKeys,
) -> Demand {
    if let Some(&last) = hits.last() {
        if pool.key(last).is_some_and(|key| this_step.contains(key)) {
            return Demand::Defer;
        }
    }
    let b = align.block_size;
    let k = align.speculative_blocks;
    let required = main.div_ceil(b) + k;
    let mut blocks = required as i64 - hits.len() as i64 - held.blocks.len() as i64;
    let position = align.checkpoint_position(main);
    let checkpoint = align
        .needs_checkpoint(held, total_computed, main, position, prefill_end)
        .then(|| (position, main.div_ceil(b) - 2));
    if blocks > 0 {
        let unallocated = if held.mamba.allocated { 0 } else { k };
        blocks = blocks.min((1 + usize::from(checkpoint.is_some()) + unallocated) as i64);
    }
    let evictable = hits.iter().filter(|&&h| h != NULL_BLOCK && pool.ref_cnt(h) == 0).count();
    Demand::Blocks { blocks: blocks + evictable as i64, checkpoint }
}

/// The blocks a first allocation that adopts `external` connector-provided tokens after
/// `local` computed ones takes in this group, where [`num_blocks_to_allocate`] counts what
/// vLLM counts: the `hits` it touches, the fresh block of the state loaded after `local +
/// external` tokens, and the new columns up to the running state's for `main` tokens.
///
/// vLLM bounds its count by the columns one chunk writes and leaves the loaded state's block
/// out of that bound, so that with new tokens past that column it counts one block fewer
/// than it takes: where the pool holds the count but not the blocks taken, vLLM admits the
/// request and its pool runs dry halfway (`ValueError: Cannot get 1 free blocks from the
/// pool`, vLLM 0.33 and 0.34). The coordinator refuses where the blocks taken do not fit
/// (docs/vllm.md, "Where kvblocks differs").
#[allow(clippy::too_many_arguments)]
pub(super) fn num_blocks_taken(
    align: &Align,
    spec: &GroupSpec,
    pool: &BlockPool,
    held: &GroupBlocks,
    hits: &[u32],
    (local, external): (usize, usize),
    main: usize,
    checkpoint: bool,
) -> usize {
    let computed = local.saturating_add(external);
    let touched = super::group::num_evictable_hits(spec, pool, held, hits, computed);
    let len = super::group::len_after_hits(spec, held, hits.len(), computed);
    let loaded = super::group::num_external_blocks(spec, len, local, external);
    // What allocate_new_blocks adds to a table of `before` blocks (a first allocation: no
    // draft-state block to move).
    let columns = align.columns(main, checkpoint);
    let before = len + loaded;
    touched + loaded + columns.required.saturating_sub(columns.padded(before))
}

/// The columns of a chunk ending at `main` tokens (vLLM's align-mode `allocate_new_blocks`,
/// and the worker's: it writes the running state to column `cdiv(main, B) - 1` and the draft
/// tokens' states to the `K` columns after it).
pub(super) struct Columns {
    /// The table's length once the chunk is allocated: the running state's column and the
    /// `K` speculative ones after it.
    pub required: usize,
    pub running: usize,
    /// The first column the chunk keeps: the checkpoint's, else the running state's.
    keep_from: usize,
}

impl Columns {
    /// The length of a table of `len` blocks once padded with null columns up to the first
    /// one the chunk keeps.
    fn padded(&self, len: usize) -> usize {
        if len < self.running && len < self.keep_from {
            self.keep_from
        } else {
            len
        }
    }
}

impl Align {
    pub(super) fn columns(&self, main: usize, checkpoint: bool) -> Columns {
        let k = self.speculative_blocks;
        let required = main.div_ceil(self.block_size) + k;
        let running = required.saturating_sub(k + 1);
        Columns { required, running, keep_from: running.saturating_sub(usize::from(checkpoint)) }
    }
}

/// vLLM's align-mode `allocate_new_blocks`: the running state's column for `main` tokens
/// and the `K` speculative columns after it, the checkpoint column before it when the
/// chunk writes one. Columns between the table's end and those are null; speculative blocks
/// left behind are moved to the end of the table (the worker reads them there), their old
/// columns nulled; fresh blocks fill the rest.
///
/// A table already long enough (and no checkpoint) is kept as it is, whatever its columns
/// hold: after rejected drafts move the running column back onto a column a relocation
/// emptied, that column is null and the worker writes the state into the null block (see
/// [`vllm_left_null`]).
pub(super) fn allocate_new_blocks(
    align: &Align,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    main: usize,
) {
    let k = align.speculative_blocks;
    let GroupBlocks { blocks, mamba, .. } = held;
    let columns = align.columns(main, mamba.checkpoint.is_some());
    let (required, keep_from) = (columns.required, columns.keep_from);
    if required <= blocks.len() && mamba.checkpoint.is_none() {
        mamba.allocated = true;
        return;
    }
    let before = blocks.len();
    blocks.resize(columns.padded(before), NULL_BLOCK);
    if mamba.allocated {
        for column in before.saturating_sub(k)..before {
            if column >= keep_from {
                break;
            }
            // vLLM asserts the block is the request's own and unregistered.
            if let Some(slot) = blocks.get_mut(column) {
                let block = std::mem::replace(slot, NULL_BLOCK);
                blocks.push(block);
            }
        }
    }
    let missing = required.saturating_sub(blocks.len());
    if missing > 0 {
        blocks.extend(pool.get_new_blocks(missing));
    }
    mamba.allocated = true;
}

/// Whether a null block at a live `column` (the running state's, a draft state's or the
/// checkpoint's) is vLLM's own doing rather than kvblocks': vLLM fills every column it
/// appends to a table, so a null live column is one the table held before this call
/// (`len_before`) on a request already running (not a first allocation). There only a
/// relocation or the padding before a running column can have left it null, and vLLM keeps
/// such a column as it is: after rejected drafts took the running column back onto it, or
/// when a decode step with drafts arms a checkpoint in it. vLLM 0.33 and 0.34 do both
/// (docs/vllm.md, "The null block in a Mamba table").
pub(super) fn vllm_left_null(column: usize, len_before: usize, first: bool) -> bool {
    !first && column < len_before
}

/// vLLM's align-mode `remove_skipped_blocks`: once `num_processed` tokens are done, every
/// state before the one at `num_processed` is released (each column once: a retirement
/// cursor). (vLLM also frees the previous running state's column once it is below
/// `ceil(num_processed / B) - 1`: always a column this sweep has already released.)
pub(super) fn remove_skipped_blocks(
    align: &Align,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    num_processed: usize,
) {
    let b = align.block_size;
    let GroupBlocks { blocks, mamba, .. } = held;
    if num_processed > 1 {
        let last = ((num_processed - 1) / b).min(blocks.len());
        if mamba.num_retired < last {
            let mut freed = Vec::new();
            let retiring = blocks.get_mut(mamba.num_retired..last).unwrap_or_default();
            for slot in retiring.iter_mut().rev() {
                if *slot != NULL_BLOCK {
                    freed.push(std::mem::replace(slot, NULL_BLOCK));
                }
            }
            if !freed.is_empty() {
                pool.free_blocks(freed.into_iter());
            }
            mamba.num_retired = last;
        }
    }
}

/// What the tail step of vLLM's Mamba `cache_blocks` reads of the request.
pub(super) struct Tail {
    pub group: u32,
    /// The tokens the group may cache (vLLM's `get_num_cacheable_tokens`).
    pub num_tokens: usize,
    pub num_prompt_tokens: usize,
    pub shared_prefix_boundary: usize,
}

/// The step vLLM's Mamba `cache_blocks` takes after registering full blocks
/// (`_cache_partial_tail_block`, with hash and block sizes equal): a chunk's checkpoint state
/// is keyed by its position (re-keyed if its column's key says otherwise), or dropped from
/// the cache if no hit may use it (neither the prompt's checkpoint, nor retained, nor at the
/// shared-prefix junction); without a checkpoint, the state at the prompt's last reusable
/// boundary is keyed if it is not. Returns the key it registered, if any. `hash(i)` is the
/// request's hash `i` (`None` past its hashes: vLLM would fail there; nothing is keyed).
pub(super) fn cache_tail(
    align: &Align,
    pool: &mut BlockPool,
    held: &GroupBlocks,
    tail: &Tail,
    hash: impl Fn(usize) -> Option<BlockHash>,
) -> Option<CacheKey> {
    let b = align.block_size;
    let (block, position, replace) = match held.mamba.checkpoint {
        Some((position, column)) => {
            let block = *held.blocks.get(column)?;
            let is_prompt = position == align.checkpoint_position(tail.num_prompt_tokens);
            if !is_prompt && !align.retains(position) && position != tail.shared_prefix_boundary {
                pool.uncache(block);
                return None;
            }
            (block, position, true)
        }
        None => {
            let n = tail.num_tokens;
            if n == 0 || n % b != 0 || n != align.checkpoint_position(tail.num_prompt_tokens) {
                return None;
            }
            (*held.blocks.get(n / b - 1)?, n, false)
        }
    };
    let keyed_here = pool.key(block).is_some() && pool.key_num_tokens(block) == position;
    if block == NULL_BLOCK || keyed_here {
        return None;
    }
    let key = CacheKey::new(hash(position / b - 1)?, tail.group);
    // With equal block sizes a block's key never covers more than its own column, so a
    // keyed block here is keyed at an earlier position: its key gives way (vLLM removes it
    // for a re-key, and for a tail whose key covers fewer tokens).
    if replace || pool.key(block).is_some() {
        pool.uncache(block);
    }
    pool.cache_block(block, key, position);
    if pool.events_enabled() {
        let index = position / b - 1;
        let stored =
            Registered { group: tail.group, first: index, end: index + 1, skipped: vec![] };
        pool.push_event(KvEvent::Registered(stored));
    }
    Some(key)
}
