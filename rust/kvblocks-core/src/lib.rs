//! kvblocks-core: the pure-Rust engine of kvblocks.
//!
//! It owns vLLM-compatible chained block hashing ([`hashing`]), the per-request token
//! buffers that hash new full blocks as tokens arrive ([`TokenSequence`]), the block pool
//! ([`pool`]) and the coordinator over it ([`KvCacheCoordinator`], in [`kv_cache`]: vLLM
//! 0.33's coordinators and single-type managers, written once), which serves both the vLLM
//! plugin's KV-cache manager ([`KvCacheManager`], on block hashes the caller owns) and the
//! embedded block manager ([`BlockManager`], with its own token buffers, copy-on-write and
//! token verification). Nothing here knows about Python; the `kvblocks-py` crate is a thin
//! PyO3 layer over this crate.

mod block_manager;
mod error;
mod free_queue;
pub mod hashing;
pub mod kv_cache;
pub mod pool;
mod requests;
pub mod router;
mod router_table;
mod sequence;
mod stats;

pub use block_manager::{
    BlockManager, ManagerConfig, PlannedStep, StepBuffers, StepInput, StepOutput, StepResult,
    StepSizes,
};
pub(crate) use error::try_filled;
pub use error::{CoreError, CoreResult};
pub use hashing::{
    known_seed, resolve_seed, BlockHash, BlockHasher, ExtraKey, HashAlgo, HashSink, HashTable,
    MmFeature, RequestKeys, DEFAULT_SEED, HASH_ALGORITHMS,
};
pub use kv_cache::{
    AllocateArgs, AttentionKind, BoundaryState, CacheHit, CoordinatorConfig, GroupBlocks,
    GroupSpec, HashSource, HitRule, KvCacheCoordinator, KvCacheManager, ManagerEvent,
    RequestBlocks, RequestState,
};
pub use requests::RequestRef;
pub use router::{block_key, int_block_key, RouterCounts, RouterIndex, MAX_REPLICAS};
pub use sequence::TokenSequence;
pub use stats::PrefixCacheStats;
