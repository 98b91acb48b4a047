//! `kvblocks.BlockHasher`.

use crate::args::{size_arg, str_arg};
use crate::errors::GlueResult;
use crate::keys::{extract_extra_keys, request_keys};
use crate::sync::detach_if_large;
use crate::tokens::{extract_token_ids, extract_token_ids_from};
use kvblocks_core::{
    known_seed, resolve_seed, BlockHash, BlockHasher, ExtraKey, HashAlgo, HashSink, HashTable,
};
use numpy::{IntoPyArray, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::sync::Arc;

/// vLLM's default block size.
const DEFAULT_BLOCK_SIZE: usize = 16;

#[pyclass(frozen, module = "kvblocks._core", name = "BlockHasher")]
pub struct PyBlockHasher {
    pub inner: Arc<BlockHasher>,
}

pub fn hash_bytes<'py>(py: Python<'py>, hash: &BlockHash) -> Bound<'py, PyBytes> {
    PyBytes::new(py, hash.as_bytes())
}

pub fn hash_list<'py>(py: Python<'py>, hashes: &[BlockHash]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, hashes.iter().map(|h| hash_bytes(py, h)))
}

/// `PYTHONHASHSEED` as the process sees it now (vLLM's seed rule reads it).
pub fn env_seed(py: Python<'_>) -> PyResult<Option<String>> {
    py.import("os")?.getattr("environ")?.call_method1("get", ("PYTHONHASHSEED",))?.extract()
}

/// The keyword arguments `hash_blocks` and `hash_blocks_array` share, as given.
struct ChainArgs<'a, 'py> {
    parent: Option<&'a [u8]>,
    start_block: Option<&'a Bound<'py, PyAny>>,
    cache_salt: Option<&'a Bound<'py, PyAny>>,
    lora: Option<&'a Bound<'py, PyAny>>,
    mm_features: Option<&'a Bound<'py, PyAny>>,
    num_lookahead_tokens: Option<&'a Bound<'py, PyAny>>,
}

impl PyBlockHasher {
    /// The shared body of `hash_blocks` and `hash_blocks_array`: the full blocks of
    /// `token_ids` from block `start_block` on (each followed by `num_lookahead_tokens` more),
    /// chained to `parent`, into `sink`.
    fn compute(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        args: ChainArgs<'_, '_>,
        sink: &mut (impl HashSink + Send),
    ) -> GlueResult<()> {
        let ChainArgs { parent, start_block, cache_salt, lora, mm_features, num_lookahead_tokens } =
            args;
        let first_block = match start_block {
            Some(block) => size_arg(block, "start_block", 0)?,
            None => 0,
        };
        let lookahead = match num_lookahead_tokens {
            Some(n) => size_arg(n, "num_lookahead_tokens", 0)?,
            None => 0,
        };
        let hasher = &self.inner;
        hasher.check_lookahead(lookahead)?;
        let start = first_block.checked_mul(hasher.block_size()).ok_or_else(|| {
            PyValueError::new_err(format!("start_block {first_block} is out of range"))
        })?;
        let (tokens, offset) = extract_token_ids_from(token_ids, start)?;
        let keys = request_keys(cache_salt, lora, mm_features)?;
        let tokens = tokens.as_slice().get(offset..).unwrap_or_default();
        let hash = || {
            hasher.hash_lookahead_blocks_into(tokens, first_block, parent, &keys, lookahead, sink)
        };
        Ok(detach_if_large(py, tokens.len(), hash)?)
    }
}

#[pymethods]
impl PyBlockHasher {
    #[new]
    #[pyo3(signature = (algo = "sha256_cbor", *, block_size = None, seed = None))]
    fn new(
        py: Python<'_>,
        algo: &str,
        block_size: Option<&Bound<'_, PyAny>>,
        seed: Option<&Bound<'_, PyAny>>,
    ) -> GlueResult<Self> {
        let algo = HashAlgo::from_name(algo)?;
        let block_size = match block_size {
            Some(size) => size_arg(size, "block_size", 1)?,
            None => DEFAULT_BLOCK_SIZE,
        };
        let seed = seed.filter(|s| !s.is_none()).map(|s| str_arg(s, "seed")).transpose()?;
        let seed = resolve_seed(algo, seed, env_seed(py)?)?;
        let inner = BlockHasher::new(algo, block_size, seed)?;
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The NONE_HASH seed of a vLLM engine using `algo` whose `PYTHONHASHSEED` is
    /// `python_hash_seed`, where another process (a router, a frontend) can know it: that
    /// value, else vLLM's fixed default for SHA-256; None for a non-cryptographic algorithm
    /// without one (the engine draws a random secret: read its NONE_HASH off it instead).
    #[staticmethod]
    #[pyo3(signature = (algo, python_hash_seed = None))]
    fn engine_seed(algo: &str, python_hash_seed: Option<String>) -> GlueResult<Option<String>> {
        Ok(known_seed(HashAlgo::from_name(algo)?, python_hash_seed))
    }

    #[getter]
    fn algo(&self) -> &'static str {
        self.inner.algo().name()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> &str {
        self.inner.seed()
    }

    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        hash_bytes(py, self.inner.none_hash())
    }

    #[getter]
    fn digest_size(&self) -> usize {
        self.inner.algo().digest_size()
    }

    #[pyo3(signature = (parent, token_ids, extra_keys = None, /))]
    fn hash_block<'py>(
        &self,
        py: Python<'py>,
        parent: Option<&[u8]>,
        token_ids: &Bound<'py, PyAny>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let tokens = extract_token_ids(token_ids)?;
        let owned = extract_extra_keys(extra_keys)?;
        let keys: Option<Vec<ExtraKey<'_>>> =
            owned.as_ref().map(|v| v.iter().map(|k| k.as_key()).collect());
        let hash =
            self.inner.hash_block(parent, tokens.as_slice(), keys.as_deref(), &mut Vec::new());
        Ok(hash_bytes(py, &hash))
    }

    #[pyo3(signature = (
        token_ids, /, *, parent = None, start_block = None, cache_salt = None, lora = None,
        mm_features = None, num_lookahead_tokens = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn hash_blocks<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        parent: Option<&[u8]>,
        start_block: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora: Option<&Bound<'py, PyAny>>,
        mm_features: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let args =
            ChainArgs { parent, start_block, cache_salt, lora, mm_features, num_lookahead_tokens };
        let mut hashes = Vec::new();
        self.compute(py, token_ids, args, &mut hashes)?;
        hash_list(py, &hashes)
    }

    /// Like `hash_blocks`, as one `(num_blocks, digest_size)` uint8 array: no Python object
    /// per block.
    #[pyo3(signature = (
        token_ids, /, *, parent = None, start_block = None, cache_salt = None, lora = None,
        mm_features = None, num_lookahead_tokens = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn hash_blocks_array<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        parent: Option<&[u8]>,
        start_block: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora: Option<&Bound<'py, PyAny>>,
        mm_features: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<u8>>> {
        let width = self.inner.algo().digest_size();
        let mut sink = HashTable::with_capacity(0, width);
        let args =
            ChainArgs { parent, start_block, cache_salt, lora, mm_features, num_lookahead_tokens };
        self.compute(py, token_ids, args, &mut sink)?;
        let table = numpy::ndarray::Array2::from_shape_vec((sink.len(), width), sink.bytes)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(table.into_pyarray(py))
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHasher(algo='{}', block_size={})",
            self.inner.algo().name(),
            self.inner.block_size()
        )
    }
}
