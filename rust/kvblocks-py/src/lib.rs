//! PyO3 glue for kvblocks: each method converts its arguments into `kvblocks-core`'s types
//! (checked once here, so the core never sees a Python object), makes one call into the core,
//! and converts the result. The rules (hashing, allocation, eviction, caching, vLLM's
//! watermark) are all in the core. What the glue adds to plain conversion:
//!
//! - reading a vLLM `Request` in place (`KVCacheManager`, `kv_cache.rs`): its id, token counts,
//!   `block_hashes`, and whether its status is one of the statuses it was built with (by
//!   identity); and refusing the `allocate_slots` arguments the core has no field for
//!   (encoder tokens);
//! - results in the shapes Python callers expect: `KVCacheManager`'s one shared empty block list,
//!   returned by identity as vLLM's manager does; `BlockManager`'s events as
//!   `kvblocks.kv_events` objects; the batched step's numpy arrays (`step.rs`);
//! - one error type (`errors.rs`) and one lock and GIL-release rule (`sync.rs`).

mod args;
mod errors;
mod hasher;
#[cfg(feature = "bench-floor")]
mod hashing_floor;
mod ints;
mod keys;
mod kv_cache;
mod manager;
mod router;
mod sequence;
mod step;
mod sync;
mod tokens;

use kvblocks_core::HASH_ALGORITHMS;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // What `kvblocks bench` prints: timings of a dev build are not the product's.
    m.add("BUILD_PROFILE", if cfg!(debug_assertions) { "dev" } else { "release" })?;
    m.add("HASH_ALGORITHMS", PyTuple::new(m.py(), HASH_ALGORITHMS)?)?;
    m.add("KvBlocksError", m.py().get_type::<errors::KvBlocksError>())?;
    m.add_class::<hasher::PyBlockHasher>()?;
    // Benchmark-only (cargo feature bench-floor): an attribute, not in `__all__` (which
    // add_class would extend), so that the stubs, which do not declare it, match every build.
    #[cfg(feature = "bench-floor")]
    m.setattr("_HashingFloor", m.py().get_type::<hashing_floor::PyHashingFloor>())?;
    m.add_class::<sequence::PyTokenSequence>()?;
    m.add_class::<manager::PyBlockManager>()?;
    m.add_class::<kv_cache::PyKvCacheManager>()?;
    m.add_class::<kv_cache::PyKvCacheBlockIds>()?;
    m.add_class::<kv_cache::PyKvCacheBlockView>()?;
    m.add_class::<kv_cache::PyKvCacheGroup>()?;
    m.add_class::<router::PyRouterIndex>()?;
    m.add_class::<router::PyHitRule>()?;
    Ok(())
}
