//! How a model's KV cache is laid out: its groups, each with the attention kind whose rules
//! manage its blocks, and the coordinator-wide settings (vLLM's `KVCacheConfig` plus the
//! `KVCacheManager` arguments that change decisions).

use crate::{CoreError, CoreResult};

/// The rules one group's blocks follow (vLLM's single-type managers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Every token attends to every earlier one: blocks are kept until the request ends
    /// (vLLM's `FullAttentionManager`: full attention and MLA).
    Full,
    /// A token attends to the `window - 1` tokens before it: blocks that fall out of the
    /// window (less `extra_retained` trailing tokens kept for multi-token prediction) are
    /// freed and replaced by the null block (vLLM's `SlidingWindowManager`).
    SlidingWindow { window: usize, extra_retained: usize },
    /// Tokens attend within chunks of `chunk` tokens: blocks of finished chunks are freed
    /// (vLLM's `ChunkedLocalAttentionManager`).
    ChunkedLocal { chunk: usize },
    /// A state-space or linear-attention layer (vLLM's `MambaManager`): a request keeps the
    /// block holding its running state, plus `speculative_blocks` blocks for the states of
    /// draft tokens; earlier blocks are freed. Without prefix caching (vLLM's
    /// `mamba_cache_mode="none"`) that is all. With it (vLLM's "align" mode) block `i` of the
    /// table holds the state after `(i + 1) * block_size` tokens, states at block boundaries
    /// are cached, and a prefill chunk may also write a checkpoint state inside it where the
    /// layer can export one: `checkpoint_alignment` is vLLM's `prefill_checkpoint_alignment`
    /// when the spec has prefill checkpoint blocks, `None` when it cannot checkpoint.
    Mamba { speculative_blocks: usize, checkpoint_alignment: Option<usize> },
}

impl AttentionKind {
    /// How many leading tokens no later token attends to, once `num_computed_tokens` are
    /// computed (vLLM's `get_num_skipped_tokens`).
    pub fn num_skipped_tokens(self, num_computed_tokens: usize) -> usize {
        match self {
            Self::Full => 0,
            Self::SlidingWindow { window, extra_retained } => {
                num_computed_tokens.saturating_add(1).saturating_sub(window + extra_retained)
            }
            Self::ChunkedLocal { chunk } => num_computed_tokens / chunk * chunk,
            // Only the state after the last computed token is read.
            Self::Mamba { .. } => num_computed_tokens.saturating_sub(1),
        }
    }

    /// The slots a group allocates beyond a request's tokens: a Mamba group's blocks for the
    /// states of draft tokens.
    pub fn extra_slots(self, block_size: usize) -> usize {
        match self {
            Self::Mamba { speculative_blocks, .. } => speculative_blocks.saturating_mul(block_size),
            _ => 0,
        }
    }

    /// Whether the group holds attention KV (vLLM's `AttentionSpec`), which the worker
    /// zeroes in fresh blocks when the KV cache needs it; a Mamba group's state does not.
    pub fn is_attention(self) -> bool {
        !matches!(self, Self::Mamba { .. })
    }

    /// How many contiguous cached blocks a sliding-window hit needs (vLLM's
    /// `_contiguous_blocks_for_hit`): the blocks the last token's window reads, plus the one
    /// an EAGLE hit drops. `None` for the other kinds.
    pub fn window_hit_blocks(self, block_size: usize, use_eagle: bool) -> Option<usize> {
        match self {
            Self::SlidingWindow { window, .. } => {
                Some(window.saturating_sub(1).div_ceil(block_size) + usize::from(use_eagle))
            }
            _ => None,
        }
    }

    pub fn is_full(self) -> bool {
        matches!(self, Self::Full)
    }

    pub fn is_mamba(self) -> bool {
        matches!(self, Self::Mamba { .. })
    }
}

/// One KV-cache group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: AttentionKind,
    pub block_size: usize,
    /// vLLM's `max_admission_blocks_per_request`: the most blocks a request of this group
    /// can hold at once (sliding window and chunked local recycle blocks); `None` when
    /// unbounded.
    pub max_admission_blocks: Option<usize>,
    /// vLLM's `KVCacheGroupSpec.is_eagle_group`: the draft model's group.
    pub is_eagle_group: bool,
}

impl GroupSpec {
    pub fn full(block_size: usize) -> Self {
        Self {
            kind: AttentionKind::Full,
            block_size,
            max_admission_blocks: None,
            is_eagle_group: false,
        }
    }
}

/// Everything that decides the coordinator's behaviour.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordinatorConfig {
    /// All blocks, the null block (id 0) included.
    pub num_blocks: u32,
    pub groups: Vec<GroupSpec>,
    /// The groups whose prefix hits are looked up together, in the order vLLM's hybrid
    /// coordinator visits them: one set per distinct spec (vLLM compares the specs; the
    /// caller, who has them, decides), full attention first. Every group in exactly one
    /// set. Ignored with fewer than two groups.
    pub lookup_sets: Vec<Vec<usize>>,
    pub max_model_len: usize,
    pub enable_caching: bool,
    pub enable_events: bool,
    /// vLLM's `int(watermark * num_blocks)`: blocks kept free when admitting a request
    /// while others are scheduled.
    pub watermark_blocks: usize,
    /// vLLM's `use_eagle` (EAGLE/MTP block drop): a prefix hit drops its last block.
    pub use_eagle: bool,
    /// vLLM's `num_prefill_lookahead`: the last `n - 1` computed tokens may be prefilled
    /// again (multi-token prediction), so they are not cached yet.
    pub num_prefill_lookahead: usize,
    /// vLLM's `num_hash_lookahead_tokens`: a block's hash also covers this many tokens after
    /// it (EAGLE/MTP lookahead hashing), which moves a Mamba group's checkpoints.
    pub num_hash_lookahead_tokens: usize,
    /// vLLM's `prefix_cache_retention_interval` (sliding-window groups): `None` registers
    /// every block a hit could use, `Some(0)` only those at replay boundaries and
    /// shared-prefix junctions, `Some(r)` also one window per `r` tokens.
    pub retention_interval: Option<usize>,
    /// vLLM's `KVCacheConfig.needs_kv_cache_zeroing` (Mamba layers, mixed-precision
    /// caches): the attention groups' fresh blocks are recorded for the worker to zero
    /// ([`super::KvCacheCoordinator::take_new_block_ids`]).
    pub needs_kv_cache_zeroing: bool,
}

impl CoordinatorConfig {
    /// One full-attention group of `block_size`-token blocks, caching on, nothing else.
    pub fn single_group(num_blocks: u32, block_size: usize, max_model_len: usize) -> Self {
        Self {
            num_blocks,
            groups: vec![GroupSpec::full(block_size)],
            lookup_sets: vec![vec![0]],
            max_model_len,
            enable_caching: true,
            enable_events: false,
            watermark_blocks: 0,
            use_eagle: false,
            num_prefill_lookahead: 0,
            num_hash_lookahead_tokens: 0,
            retention_interval: None,
            needs_kv_cache_zeroing: false,
        }
    }

    /// vLLM's slot count for an allocation: the computed tokens (capped at the model
    /// length), the new ones and the lookahead slots, at most the model length.
    pub fn num_slots(&self, num_computed: usize, num_new: usize, num_lookahead: usize) -> usize {
        num_computed
            .min(self.max_model_len)
            .saturating_add(num_new)
            .saturating_add(num_lookahead)
            .min(self.max_model_len)
    }

    /// Whether some group frees blocks out of a window or chunk (only then does the coordinator
    /// read a request's prompt length, in-flight tokens and shared-prefix boundary).
    pub fn is_windowed(&self) -> bool {
        self.groups.iter().any(|g| !g.kind.is_full())
    }

    /// The block size every group shares with prefix caching on (the coordinator reproduces vLLM
    /// for layouts whose groups all use the hash block size); without caching, group 0's
    /// (the coordinator then reads no hash).
    pub fn block_size(&self) -> usize {
        self.groups.first().map_or(1, |g| g.block_size)
    }

    /// Which groups drop their last hit block for EAGLE (vLLM's `drop_eagle_group_ids`): the
    /// draft groups, or every group when EAGLE is on and no group is marked.
    pub(crate) fn eagle_drop_groups(&self) -> Vec<bool> {
        if !self.use_eagle {
            return vec![false; self.groups.len()];
        }
        let marked: Vec<bool> = self.groups.iter().map(|g| g.is_eagle_group).collect();
        if marked.iter().any(|&m| m) {
            marked
        } else {
            vec![true; self.groups.len()]
        }
    }

    pub(crate) fn validate(&self) -> CoreResult<()> {
        let invalid = |msg: String| Err(CoreError::InvalidArgument(msg));
        if self.num_blocks == 0 {
            return Err(CoreError::InvalidSize { what: "num_blocks (must be >= 1)", value: 0 });
        }
        if self.groups.is_empty() {
            return invalid("a KV cache needs at least one group".into());
        }
        if self.groups.len() > u32::MAX as usize {
            return Err(CoreError::InvalidSize {
                what: "number of groups",
                value: self.groups.len(),
            });
        }
        let block_size = self.block_size();
        for (i, group) in self.groups.iter().enumerate() {
            if group.block_size == 0 {
                return Err(CoreError::InvalidSize { what: "block_size (must be >= 1)", value: 0 });
            }
            if self.enable_caching && group.block_size != block_size {
                return invalid(format!(
                    "group {i} has {}-token blocks and group 0 {block_size}-token blocks: \
                     with prefix caching every group must use the same block size",
                    group.block_size
                ));
            }
            match group.kind {
                AttentionKind::SlidingWindow { window: 0, .. } => {
                    return invalid(format!("group {i}: a sliding window must be >= 1 token"));
                }
                AttentionKind::SlidingWindow { window, extra_retained }
                    if window.checked_add(extra_retained).is_none() =>
                {
                    return invalid(format!(
                        "group {i}: sliding window {window} + {extra_retained} retained tokens \
                         overflows"
                    ));
                }
                AttentionKind::ChunkedLocal { chunk: 0 } => {
                    return invalid(format!("group {i}: an attention chunk must be >= 1 token"));
                }
                AttentionKind::Mamba { checkpoint_alignment: Some(0), .. } => {
                    return invalid(format!("group {i}: a checkpoint alignment must be >= 1"));
                }
                AttentionKind::Mamba { .. }
                    if self.enable_caching && self.num_hash_lookahead_tokens > 1 =>
                {
                    // A state could then carry two keys at once (vLLM keeps secondary keys
                    // on a block; the pool here keeps one).
                    return invalid(format!(
                        "group {i}: Mamba prefix caching is implemented with at most one \
                         lookahead token per block hash, not {}",
                        self.num_hash_lookahead_tokens
                    ));
                }
                AttentionKind::Mamba { speculative_blocks, .. }
                    if speculative_blocks.checked_mul(group.block_size).is_none() =>
                {
                    return invalid(format!(
                        "group {i}: {speculative_blocks} speculative blocks overflow"
                    ));
                }
                _ => {}
            }
            if group.max_admission_blocks == Some(0) {
                return invalid(format!("group {i}: max_admission_blocks must be >= 1"));
            }
        }
        if let Some(r) = self.retention_interval.filter(|&r| r > 0) {
            if r % block_size != 0 {
                return invalid(format!(
                    "prefix_cache_retention_interval ({r}) must be a multiple of the block size \
                     ({block_size})"
                ));
            }
        }
        let drops = self.eagle_drop_groups();
        let chunked_drop =
            self.groups.iter().zip(&drops).position(|(g, &drop)| {
                drop && matches!(g.kind, AttentionKind::ChunkedLocal { .. })
            });
        if let Some(i) = chunked_drop {
            // vLLM's chunked local manager asserts it is never asked to drop a block.
            return invalid(format!(
                "group {i}: chunked local attention cannot drop its last hit block for EAGLE"
            ));
        }
        if self.max_model_len == 0 {
            return Err(CoreError::InvalidSize { what: "max_model_len (must be >= 1)", value: 0 });
        }
        if self.groups.len() > 1 {
            let mut seen = vec![false; self.groups.len()];
            for set in &self.lookup_sets {
                let Some(&first) = set.first() else {
                    return invalid("an empty lookup set".into());
                };
                let kind = self.groups.get(first).map(|g| g.kind);
                for &g in set {
                    match seen.get_mut(g) {
                        Some(s) if !*s => *s = true,
                        _ => {
                            return invalid(format!("lookup sets name group {g} twice or unknown"))
                        }
                    }
                    if self.groups.get(g).map(|g| g.kind) != kind {
                        return invalid("a lookup set mixes attention kinds".into());
                    }
                }
            }
            if seen.iter().any(|s| !s) {
                return invalid("every group must be in one lookup set".into());
            }
        }
        Ok(())
    }
}
