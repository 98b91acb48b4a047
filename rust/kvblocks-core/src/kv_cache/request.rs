//! What the coordinator reads of a request at each call: its block hashes ([`HashSource`])
//! and its token counts and status ([`RequestState`]), as arguments (the caller owns the
//! request: vLLM's `Request`, or the embedded block manager's token buffers).

use crate::hashing::BlockHash;
use crate::{CoreError, CoreResult};

/// Read access to a request's block hashes (vLLM's `request.block_hashes`).
pub trait HashSource {
    fn len(&self) -> usize;
    /// Hash `index` (< `len()`); an error if it is not a 16- or 32-byte hash.
    fn get(&self, index: usize) -> CoreResult<BlockHash>;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HashSource for [BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }

    fn get(&self, index: usize) -> CoreResult<BlockHash> {
        <[BlockHash]>::get(self, index).copied().ok_or(CoreError::OutOfRange {
            what: "block hash index",
            value: index,
            limit: <[BlockHash]>::len(self),
        })
    }
}

/// What the coordinator reads of a request at each call (vLLM's `Request` fields).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestState {
    /// `request.num_tokens`: prompt and accepted output tokens.
    pub num_tokens: usize,
    /// `request.num_computed_tokens`
    pub num_computed_tokens: usize,
    pub num_prompt_tokens: usize,
    /// `request.shared_prefix_boundary`: where a longer cached prefix of another request
    /// ends (the third value of `get_computed_blocks`), 0 for none.
    pub shared_prefix_boundary: usize,
    /// `request.num_in_flight_tokens`: scheduled tokens whose step has not come back yet.
    pub num_in_flight_tokens: usize,
    /// The request waits for admission (vLLM's status WAITING or PREEMPTED).
    pub is_waiting: bool,
}
