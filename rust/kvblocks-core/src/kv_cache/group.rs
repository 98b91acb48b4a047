//! The rules that grow, shrink and register one group's blocks of one request
//! (vLLM's `SingleTypeKVCacheManager` and its subclasses for full attention, sliding window,
//! chunked local attention and Mamba without prefix caching).

use super::spec::GroupSpec;
use super::table::GroupBlocks;
use crate::pool::{BlockPool, NULL_BLOCK};

fn num_skipped_blocks(spec: &GroupSpec, num_computed_tokens: usize) -> usize {
    spec.kind.num_skipped_tokens(num_computed_tokens) / spec.block_size
}

/// The blocks a request needs beyond what it holds to have `num_tokens` slots in this group
/// (vLLM's `get_num_blocks_to_allocate`). `hits` are the prefix hits it would adopt,
/// `total_computed` its computed tokens once they are adopted. With `cap` the count is
/// bounded by what a recycling group can ever hold at once (the admission gate).
pub(super) fn num_blocks_to_allocate(
    spec: &GroupSpec,
    pool: &BlockPool,
    held: &GroupBlocks,
    num_tokens: usize,
    hits: &[u32],
    total_computed: usize,
    cap: bool,
) -> usize {
    let num_tokens = num_tokens.saturating_add(spec.kind.extra_slots(spec.block_size));
    let mut required = num_tokens.div_ceil(spec.block_size);
    if let (true, Some(max)) = (cap, spec.max_admission_blocks) {
        required = required.min(max);
    }
    let num_held = held.blocks.len();
    if held.num_cached.is_some() {
        // An admitted request adopts no hits; after rejected drafts it may hold more.
        return required.saturating_sub(num_held);
    }
    let skipped = num_skipped_blocks(spec, total_computed);
    let new = required.saturating_sub(skipped.max(hits.len() + num_held));
    new + num_evictable_hits(spec, pool, held, hits, total_computed)
}

/// The free cached blocks among the `hits` a first allocation keeps with `num_computed`
/// computed tokens: adopting one takes it out of the free queue, so it counts as needed.
pub(super) fn num_evictable_hits(
    spec: &GroupSpec,
    pool: &BlockPool,
    held: &GroupBlocks,
    hits: &[u32],
    num_computed: usize,
) -> usize {
    let skipped = num_skipped_blocks(spec, num_computed);
    let kept = hits.get(skipped.saturating_sub(held.blocks.len())..).unwrap_or_default();
    kept.iter().filter(|&&b| b != NULL_BLOCK && pool.ref_cnt(b) == 0).count()
}

/// Adopts prefix hits at a request's first allocation (vLLM's `add_local_computed_blocks`;
/// hits exist only with caching on): blocks already out of the window become null, the rest
/// are touched.
pub(super) fn add_computed_blocks(
    spec: &GroupSpec,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    hits: &[u32],
    num_computed: usize,
) {
    let skipped = num_skipped_blocks(spec, num_computed);
    let kept = hits.get(skipped..).unwrap_or_default();
    pool.touch(kept);
    held.blocks.resize(held.blocks.len() + skipped, NULL_BLOCK);
    held.blocks.extend_from_slice(kept);
    held.num_cached = Some(held.blocks.len());
}

/// New blocks until the request has `num_tokens` slots (vLLM's `allocate_new_blocks`; a
/// Mamba group also covers its speculative blocks), appended to its table.
pub(super) fn allocate_new_blocks(
    spec: &GroupSpec,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    num_tokens: usize,
) {
    let num_tokens = num_tokens.saturating_add(spec.kind.extra_slots(spec.block_size));
    let required = num_tokens.div_ceil(spec.block_size);
    let missing = required.saturating_sub(held.blocks.len());
    if missing > 0 {
        let new = pool.get_new_blocks(missing);
        held.blocks.extend_from_slice(&new);
    }
}

/// Fresh blocks for `external` connector-provided tokens after `local` computed ones (vLLM's
/// `allocate_external_computed_blocks`; no draft-state slots), appended to the table: none
/// when the group's window or chunk no longer reads any of them. Returns where they start.
pub(super) fn allocate_external_blocks(
    spec: &GroupSpec,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    local: usize,
    external: usize,
) -> usize {
    let from = held.blocks.len();
    let missing = num_external_blocks(spec, from, local, external);
    if missing > 0 {
        held.blocks.extend_from_slice(&pool.get_new_blocks(missing));
    }
    from
}

/// How many fresh blocks [`allocate_external_blocks`] takes for `external` tokens after
/// `local` computed ones when the table holds `len` blocks.
pub(super) fn num_external_blocks(
    spec: &GroupSpec,
    len: usize,
    local: usize,
    external: usize,
) -> usize {
    let computed = local.saturating_add(external);
    let skipped = spec.kind.num_skipped_tokens(computed);
    if skipped > 0 && external.min(computed - skipped) == 0 {
        return 0;
    }
    computed.div_ceil(spec.block_size).saturating_sub(len)
}

/// The table's length once [`add_computed_blocks`] adopted `hits` (`num_hits` of them) with
/// `num_computed` computed tokens.
pub(super) fn len_after_hits(
    spec: &GroupSpec,
    held: &GroupBlocks,
    num_hits: usize,
    num_computed: usize,
) -> usize {
    held.blocks.len() + num_skipped_blocks(spec, num_computed).max(num_hits)
}

/// Frees the blocks no later token reads once `num_processed` tokens are done, replacing
/// them by the null block (vLLM's `remove_skipped_blocks`). Walks back from the last
/// skipped block to the first null one, so repeated calls only free what is new.
pub(super) fn remove_skipped_blocks(
    spec: &GroupSpec,
    pool: &mut BlockPool,
    held: &mut GroupBlocks,
    num_processed: usize,
) {
    let skipped = num_skipped_blocks(spec, num_processed);
    let mut freed = Vec::new();
    for slot in held.blocks.iter_mut().take(skipped).rev() {
        if *slot == NULL_BLOCK {
            break;
        }
        freed.push(std::mem::replace(slot, NULL_BLOCK));
    }
    if !freed.is_empty() {
        pool.free_blocks(freed.into_iter());
    }
}

/// Which of blocks `first..end` a later hit could use, so that only those are registered
/// (vLLM's `reachable_block_mask`, for hits aligned to the block size); `None` means all.
///
/// Only a sliding-window group is sparse: a hit needs the `need` blocks under the window
/// right before the hit's end (one more with EAGLE, whose hit ends a block later). With
/// `retention` `None` every block-aligned prefix keeps such a tail (all blocks, unless the
/// window needs none); `Some(0)` keeps only the tails ending at `boundaries` (where a later
/// request replaying the prompt can resume, and shared-prefix junctions); `Some(r)` also
/// keeps one tail per `r`-token segment.
pub(super) fn cacheable_mask(
    spec: &GroupSpec,
    use_eagle: bool,
    blocks: std::ops::Range<usize>,
    retention: Option<usize>,
    boundaries: impl FnOnce() -> Vec<usize>,
) -> Option<Vec<bool>> {
    let b = spec.block_size;
    let need = spec.kind.window_hit_blocks(b, use_eagle)?;
    let shift = usize::from(use_eagle);
    let mut mask = vec![false; blocks.len()];
    let segment = match retention {
        None => Some(b),
        Some(0) => None,
        Some(r) => Some(r),
    };
    if let Some(segment) = segment {
        let per_segment = (segment / b).max(1);
        if need >= per_segment {
            return None;
        }
        for (slot, i) in mask.iter_mut().zip(blocks.clone()) {
            *slot = i >= shift && (i - shift) % per_segment >= per_segment - need;
        }
    }
    if retention.is_some() {
        for boundary in boundaries() {
            let end = boundary / b + shift;
            let first = end.saturating_sub(need).max(blocks.start);
            let tail = mask.iter_mut().skip(first - blocks.start).take(end.saturating_sub(first));
            tail.for_each(|slot| *slot = true);
        }
    }
    Some(mask)
}

/// Releases a request's blocks, last first, leading null blocks aside (vLLM's `free`).
pub(super) fn free(pool: &mut BlockPool, held: GroupBlocks) {
    let start = held.blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
    pool.free_blocks(held.blocks.iter().skip(start).rev().copied());
}
