//! `kvblocks._core._HashingFloor`: benchmark-only, built only with the cargo feature
//! `bench-floor` (off by default). `benches/bench_hashing.py` uses it to measure the floor
//! under block hashing (the digest alone over each block's exact bytes); nothing else in
//! kvblocks does, and it is not part of the public API (nor of the type stubs).

use crate::hasher::PyBlockHasher;
use crate::tokens::extract_token_ids;
use kvblocks_core::hashing::floor;
use kvblocks_core::BlockHasher;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

/// A `BlockHasher`'s serialization and digest, taken apart for the hashing benchmark.
#[pyclass(frozen, module = "kvblocks._core", name = "_HashingFloor")]
pub struct PyHashingFloor {
    hasher: Arc<BlockHasher>,
}

#[pymethods]
impl PyHashingFloor {
    #[new]
    #[pyo3(signature = (hasher, /))]
    fn new(hasher: &Bound<'_, PyBlockHasher>) -> Self {
        Self { hasher: Arc::clone(&hasher.get().inner) }
    }

    /// The bytes `hash_blocks` would digest for each full block of `token_ids` (no extra
    /// keys), concatenated, and where each block's bytes end (uint64).
    #[pyo3(signature = (token_ids, /))]
    fn serialized_blocks<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyArray1<u64>>)> {
        let tokens = extract_token_ids(token_ids)?;
        let (data, ends) =
            floor::serialized_blocks(&self.hasher, tokens.as_slice(), &Default::default());
        Ok((PyBytes::new(py, &data), ends.into_pyarray(py)))
    }

    /// Digests each range of `data` ending at `ends` (a contiguous uint64 array, read in
    /// place) with the hasher's digest and nothing else; returns how many ranges.
    #[pyo3(signature = (data, ends, /))]
    fn digest_each(&self, data: &[u8], ends: PyReadonlyArray1<'_, u64>) -> PyResult<usize> {
        let ends = ends.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(floor::digest_each(&self.hasher, data, ends))
    }
}
