//! A request's block tables, one per group, and the bookkeeping beside each: what the
//! caller keeps for each request and hands to every coordinator call.

/// A request's blocks in one group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupBlocks {
    /// The block table; null blocks stand where the group needs no block any more.
    pub blocks: Vec<u32>,
    /// vLLM's `num_cached_block[request_id]`: present once the request adopted prefix hits
    /// or registered a block; how many leading blocks are registered in the cache.
    pub num_cached: Option<usize>,
    /// A Mamba group's prefix-caching bookkeeping (unused otherwise).
    pub mamba: MambaState,
}

/// One request's blocks in every group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestBlocks {
    pub groups: Vec<GroupBlocks>,
}

impl RequestBlocks {
    pub fn new(num_groups: usize) -> Self {
        Self { groups: vec![GroupBlocks::default(); num_groups] }
    }

    /// Whether vLLM's coordinator tracks the request as already admitted (any group's
    /// `num_cached_block` has it): it then adopts no prefix hits.
    pub fn is_tracked(&self) -> bool {
        self.groups.iter().any(|g| g.num_cached.is_some())
    }

    pub fn holds_blocks(&self) -> bool {
        self.groups.iter().any(|g| !g.blocks.is_empty())
    }
}

/// A request's align-mode bookkeeping in one Mamba group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MambaState {
    /// vLLM's `_num_retired_blocks`: every column before it has been released.
    pub num_retired: usize,
    /// vLLM's `_allocated_block_reqs`: the request has allocated in this group (its
    /// speculative blocks exist and may be relocated).
    pub allocated: bool,
    /// vLLM's `_checkpoints`: the position and column of the checkpoint state the current
    /// chunk writes, set by every non-admission block count.
    pub checkpoint: Option<(usize, usize)>,
}
