//! What every successful `allocate_slots` leaves behind, checked before anyone reads it.
//!
//! The scheduler hands a request's block tables to the worker, which writes the KV (or the
//! Mamba state) of every scheduled token into them: a table one block short means KV written
//! outside the request's blocks, silently. So after each allocation the coordinator checks, per
//! group of the request, that the table covers the tokens under that group's rule and that
//! every block the new tokens use is a real block the request references (not the null
//! block, not free, not out of the pool), and that the call took no more free blocks than it
//! counted (vLLM's contract that the admission count predicts the allocation). A violation is
//! [`CoreError::Unsound`] naming the group: a bug, never a bad argument, and never silent.
//! One exception is vLLM's own rule and kept as vLLM has it: a Mamba group's live column that
//! vLLM leaves null after rejected drafts ([`super::mamba::vllm_left_null`]); the check counts
//! those instead.
//!
//! The check reads only the columns this call added or must have (a few per group in a decode
//! step), so it stays on in release builds; debug builds (the tests) also check every block
//! of every table the call returns.

use super::{mamba, AttentionKind, KvCacheCoordinator, RequestBlocks};
use crate::pool::NULL_BLOCK;
use crate::{CoreError, CoreResult};

/// What one `allocate_slots` call decided, for [`KvCacheCoordinator::check_allocation`].
pub(super) struct Allocation {
    /// The slots every attention group must cover (computed, new and lookahead tokens).
    pub slots: usize,
    /// The main model's tokens once the chunk is done (what a Mamba group's state follows).
    pub main: usize,
    /// Computed tokens, local and external, before and after the model-length cap.
    pub computed: usize,
    pub total: usize,
    /// Whether the call adopted prefix hits or external tokens (the table was built anew).
    pub first: bool,
    /// Free blocks the call took (its count included every block it may take).
    pub taken: usize,
}

/// The first token the next token reads in a group of this kind: its window, without the
/// tokens vLLM retains beyond it for multi-token prediction (a prefix hit need not hold
/// those: vLLM's sliding-window hit search adopts the null block there).
fn first_read(kind: AttentionKind, num_computed: usize) -> usize {
    match kind {
        AttentionKind::SlidingWindow { window, .. } => {
            AttentionKind::SlidingWindow { window, extra_retained: 0 }
                .num_skipped_tokens(num_computed)
        }
        kind => kind.num_skipped_tokens(num_computed),
    }
}

fn unsound(group: usize, what: String) -> CoreError {
    CoreError::Unsound(format!("group {group}: {what}"))
}

/// The columns one group of a request must hold after an allocation.
struct Live {
    /// The table's length at least.
    need: usize,
    /// The first of the columns up to `need` that must hold a live block.
    live_from: usize,
    /// Further columns that must be live (a Mamba group's checkpoint and loaded state).
    also: [Option<usize>; 2],
}

impl KvCacheCoordinator {
    /// What group `g` of a request must hold once `call` allocated (see the module's
    /// documentation).
    fn live_columns(&self, g: usize, group: &super::GroupBlocks, call: &Allocation) -> Live {
        let Some(spec) = self.config.groups.get(g) else {
            return Live { need: 0, live_from: 0, also: [None, None] };
        };
        let b = spec.block_size;
        match self.align.get(g).copied().flatten() {
            None => {
                let need = (call.slots + spec.kind.extra_slots(b)).div_ceil(b);
                let live = first_read(spec.kind, call.computed) / b;
                let from = if call.first { 0 } else { self.new_from.get(g).copied().unwrap_or(0) };
                // At least the last column, unless the window reads none of them.
                Live {
                    need,
                    live_from: from.min(need.saturating_sub(1)).max(live),
                    also: [None; 2],
                }
            }
            Some(align) => {
                // The running state's column and the K speculative ones after it; the
                // checkpoint column; on a first allocation the loaded state's column.
                let checkpoint = group.mamba.checkpoint.map(|(_, column)| column);
                let columns = align.columns(call.main, checkpoint.is_some());
                let loaded = (call.first && call.total > 0 && call.total == call.computed)
                    .then(|| (call.total - 1) / b);
                Live {
                    need: columns.required,
                    live_from: columns.running,
                    also: [checkpoint, loaded],
                }
            }
        }
    }

    /// After a failed check: makes every table of the request safe to hand to a worker, at
    /// the price of its own KV. Each column the call must hold exists, and each holds a
    /// block the request references or the null block (a table one block short gets null
    /// columns; a column holding a block nobody references gets the null block), so the
    /// worker writes nothing into another request's blocks or into a cached block, and
    /// freeing the request later releases exactly what it holds.
    pub(super) fn make_safe(&self, held: &mut RequestBlocks, call: &Allocation) {
        for g in 0..held.groups.len() {
            let Some(group) = held.groups.get(g) else { continue };
            let need = self.live_columns(g, group, call).need;
            let Some(group) = held.groups.get_mut(g) else { continue };
            if group.blocks.len() < need {
                group.blocks.resize(need, NULL_BLOCK);
            }
            for block in &mut group.blocks {
                if *block != NULL_BLOCK && !self.pool.is_in_use(*block) {
                    *block = NULL_BLOCK;
                }
            }
        }
    }

    /// Checks what a successful allocation must leave (see the module's documentation);
    /// `counted` is the count the call admitted the request with, extra blocks included.
    /// Returns how many live Mamba columns hold the null block by vLLM's own rule
    /// ([`mamba::vllm_left_null`]).
    pub(super) fn check_allocation(
        &self,
        held: &RequestBlocks,
        call: &Allocation,
        counted: i64,
    ) -> CoreResult<usize> {
        let mut left_null = 0;
        if call.taken as i64 > counted.max(0) {
            return Err(CoreError::Unsound(format!(
                "the allocation took {} free blocks after counting {counted}",
                call.taken
            )));
        }
        for (g, group) in held.groups.iter().enumerate() {
            let blocks = &group.blocks;
            let Live { need, live_from, also } = self.live_columns(g, group, call);
            let align = self.align.get(g).copied().flatten();
            let len_before = self.new_from.get(g).copied().unwrap_or(0);
            if blocks.len() < need {
                return Err(unsound(
                    g,
                    format!("{} blocks where {} tokens need {need}", blocks.len(), call.slots),
                ));
            }
            let columns = (live_from..need).chain(also.into_iter().flatten());
            for column in columns {
                let block = blocks.get(column).copied().unwrap_or(NULL_BLOCK);
                if block == NULL_BLOCK
                    && align.is_some()
                    && mamba::vllm_left_null(column, len_before, call.first)
                {
                    left_null += 1;
                    continue;
                }
                if !self.pool.is_in_use(block) {
                    return Err(unsound(
                        g,
                        format!(
                            "column {column} holds block {block} (reference count {}), \
                             which no request references",
                            self.pool.ref_cnt(block)
                        ),
                    ));
                }
            }
            #[cfg(debug_assertions)]
            for (column, &block) in blocks.iter().enumerate() {
                if block != NULL_BLOCK && !self.pool.is_in_use(block) {
                    return Err(unsound(
                        g,
                        format!("column {column} holds block {block}, which is not in use"),
                    ));
                }
            }
        }
        Ok(left_null)
    }
}
