//! PyO3 glue for kvblocks: converts arguments, makes one call into `kvblocks-core`, converts
//! the result. No domain logic lives here.

mod args;
mod errors;
mod hasher;
mod hashing_floor;
mod ints;
mod keys;
mod kv_cache;
mod manager;
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
    m.add("HASH_ALGORITHMS", PyTuple::new(m.py(), HASH_ALGORITHMS)?)?;
    m.add("KvBlocksError", m.py().get_type::<errors::KvBlocksError>())?;
    m.add_class::<hasher::PyBlockHasher>()?;
    m.add_class::<hashing_floor::PyHashingFloor>()?; // benchmark-only
    m.add_class::<sequence::PyTokenSequence>()?;
    m.add_class::<manager::PyBlockManager>()?;
    m.add_class::<kv_cache::PyKvCacheCore>()?;
    m.add_class::<kv_cache::PyKvCacheBlockIds>()?;
    Ok(())
}
