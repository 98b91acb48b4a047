//! kvblocks-core: the pure-Rust engine of kvblocks.
//!
//! It owns vLLM-compatible chained block hashing ([`hashing`]), the per-request token
//! buffers that hash new full blocks as tokens arrive ([`TokenSequence`]), the block pool
//! and block tables of a prefix-caching KV cache ([`pool`], [`BlockManager`]), and vLLM
//! 0.33's KV-cache manager on block hashes the caller owns ([`KvCacheManager`], the engine
//! under the vLLM plugin's `KVCacheManager`, with vLLM's allocation and watermark rules).
//! Nothing here knows about Python; the `kvblocks-py` crate is a thin PyO3 layer over this
//! crate.

mod error;
mod free_queue;
pub mod hashing;
pub mod kv_cache_manager;
mod manager;
pub mod pool;
mod requests;
mod sequence;
mod stats;

pub(crate) use error::try_filled;
pub use error::{CoreError, CoreResult};
pub use hashing::{
    resolve_seed, BlockHash, BlockHasher, ExtraKey, HashAlgo, HashSink, HashTable, MmFeature,
    RequestKeys, DEFAULT_SEED, HASH_ALGORITHMS,
};
pub use kv_cache_manager::{AllocateArgs, HashSource, KvCacheConfig, KvCacheManager, ManagerEvent};
pub use manager::{
    BlockManager, ManagerConfig, PlannedStep, StepBuffers, StepInput, StepOutput, StepResult,
    StepSizes,
};
pub use requests::RequestRef;
pub use sequence::TokenSequence;
pub use stats::PrefixCacheStats;
