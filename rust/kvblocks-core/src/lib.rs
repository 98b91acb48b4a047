//! kvblocks-core: the pure-Rust engine of kvblocks.
//!
//! It owns vLLM-compatible chained block hashing ([`hashing`]) and the per-request token
//! buffers that hash new full blocks as tokens arrive ([`TokenSequence`]). Nothing here
//! knows about Python; the `kvblocks-py` crate is a thin PyO3 layer over this crate.

mod error;
pub mod hashing;
mod sequence;

pub use error::{CoreError, CoreResult};
pub use hashing::{
    resolve_seed, BlockHash, BlockHasher, ExtraKey, HashAlgo, MmFeature, RequestKeys, DEFAULT_SEED,
    HASH_ALGORITHMS,
};
pub use sequence::TokenSequence;
