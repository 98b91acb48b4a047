//! kvblocks-core: the pure-Rust engine of kvblocks.
//!
//! It owns vLLM-compatible chained block hashing ([`hashing`]), the per-request token
//! buffers that hash new full blocks as tokens arrive ([`TokenSequence`]), and the block pool
//! and block tables of a prefix-caching KV cache ([`pool`], [`BlockManager`]). Nothing here
//! knows about Python; the `kvblocks-py` crate is a thin PyO3 layer over this crate.

mod error;
mod free_queue;
pub mod hashing;
pub mod kv_cache;
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
pub use kv_cache::{
    AllocateArgs, AttentionKind, CacheHit, EngineConfig, GroupBlocks, GroupSpec, HashSource,
    KvCacheEngine, KvCacheManager, ManagerEvent, RequestBlocks, RequestState,
};
pub use manager::{
    BlockManager, ManagerConfig, PlannedStep, StepBuffers, StepInput, StepOutput, StepResult,
    StepSizes,
};
pub use requests::RequestRef;
pub use sequence::TokenSequence;
pub use stats::PrefixCacheStats;
