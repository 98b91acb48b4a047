//! `kvblocks._core.KVCacheCore`: the Rust half of `kvblocks.vllm.KVCacheManager`.
//!
//! Called once per vLLM manager call, with the request's own state as arguments; the block
//! hashes are read from the request's `list[bytes]` in place, only where the call needs them.

use crate::errors::{poisoned, to_py};
use kvblocks_core::{
    AllocateArgs, BlockHash, CoreError, CoreResult, HashSource, KvCacheConfig, KvCacheManager,
    ManagerEvent,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::sync::{Mutex, MutexGuard};

#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheCore")]
pub struct PyKvCacheCore {
    inner: Mutex<KvCacheManager>,
}

/// A request's `block_hashes`: a list of `bytes`, read item by item.
struct ListHashes<'a, 'py>(&'a Bound<'py, PyList>);

impl HashSource for ListHashes<'_, '_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, index: usize) -> CoreResult<BlockHash> {
        let bad =
            |what: String| CoreError::InvalidArgument(format!("block_hashes[{index}] {what}"));
        let item = self.0.get_item(index).map_err(|e| bad(e.to_string()))?;
        let bytes = item.cast::<PyBytes>().map_err(|_| bad("is not bytes".into()))?;
        let bytes = bytes.as_bytes();
        BlockHash::from_bytes(bytes)
            .ok_or_else(|| bad(format!("has {} bytes, not 32 or 16", bytes.len())))
    }
}

fn hashes_arg<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<ListHashes<'a, 'py>> {
    obj.cast::<PyList>().map(ListHashes).map_err(|_| {
        PyTypeError::new_err(format!("block_hashes must be a list, got {}", type_name(obj)))
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

impl PyKvCacheCore {
    fn lock(&self) -> PyResult<MutexGuard<'_, KvCacheManager>> {
        Python::attach(|py| self.inner.lock_py_attached(py)).map_err(|_| poisoned())
    }
}

#[pymethods]
impl PyKvCacheCore {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size, /, *, max_model_len, enable_caching = true,
        enable_events = false, watermark_blocks = 0
    ))]
    fn new(
        num_blocks: u32,
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: usize,
    ) -> PyResult<Self> {
        let config = KvCacheConfig {
            num_blocks,
            block_size,
            max_model_len,
            enable_caching,
            enable_events,
            watermark_blocks,
        };
        Ok(Self { inner: Mutex::new(KvCacheManager::new(config).map_err(to_py)?) })
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool().num_blocks())
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        Ok(self.lock()?.config().block_size)
    }

    #[getter]
    fn num_free_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_free_blocks())
    }

    #[getter]
    fn usage(&self) -> PyResult<f64> {
        Ok(self.lock()?.usage())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_requests())
    }

    /// The cached blocks of the leading hashes (at most `max_blocks`), stopping at a miss.
    #[pyo3(signature = (block_hashes, max_blocks, /))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_blocks: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let hits = self.lock()?.lookup(&hashes_arg(block_hashes)?, max_blocks).map_err(to_py)?;
        PyList::new(py, hits)
    }

    /// vLLM's `allocate_slots`: the new block ids, or `None` when the pool is too full.
    #[pyo3(signature = (
        request_id, block_hashes, num_tokens, num_computed_tokens, num_new_tokens,
        num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens, apply_watermark,
        full_sequence_must_fit, reserved_blocks, delay_cache_blocks, /
    ))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
        block_hashes: &Bound<'py, PyAny>,
        num_tokens: usize,
        num_computed_tokens: usize,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        new_computed_blocks: Option<Vec<u32>>,
        num_lookahead_tokens: usize,
        apply_watermark: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: usize,
        delay_cache_blocks: bool,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let args = AllocateArgs {
            num_tokens,
            num_computed_tokens,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            reserved_blocks,
            full_sequence_must_fit,
            delay_cache_blocks,
            apply_watermark,
        };
        let hits = new_computed_blocks.unwrap_or_default();
        let hashes = hashes_arg(block_hashes)?;
        let new = self.lock()?.allocate_slots(request_id, &args, &hits, &hashes).map_err(to_py)?;
        new.map(|blocks| PyList::new(py, blocks)).transpose()
    }

    /// vLLM's `cache_blocks`: registers the full blocks up to `num_tokens` tokens.
    #[pyo3(signature = (request_id, block_hashes, num_tokens, /))]
    fn cache_blocks(
        &self,
        request_id: &str,
        block_hashes: &Bound<'_, PyAny>,
        num_tokens: usize,
    ) -> PyResult<()> {
        let hashes = hashes_arg(block_hashes)?;
        self.lock()?.cache_blocks(request_id, num_tokens, &hashes).map_err(to_py)
    }

    /// Releases the request's blocks (a no-op for an unknown id).
    #[pyo3(signature = (request_id, /))]
    fn free(&self, request_id: &str) -> PyResult<()> {
        self.lock()?.free(request_id);
        Ok(())
    }

    #[pyo3(signature = (request_id, /))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.lock()?.block_ids(request_id))
    }

    #[pyo3(signature = (request_id, /))]
    fn estimate_cached_tokens(&self, request_id: &str) -> PyResult<usize> {
        Ok(self.lock()?.estimate_cached_tokens(request_id))
    }

    fn reset_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    /// The events since the last call, oldest first: `("removed", hash)`,
    /// `("stored", request_id, first_block, end_block)` or `("cleared",)`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.lock()?.take_events();
        let out = PyList::empty(py);
        for event in events {
            let item = match event {
                ManagerEvent::Removed(hash) => PyTuple::new(
                    py,
                    [
                        ("removed").into_pyobject(py)?.into_any(),
                        PyBytes::new(py, hash.as_bytes()).into_any(),
                    ],
                )?,
                ManagerEvent::Stored { request_id, first, end } => PyTuple::new(
                    py,
                    [
                        "stored".into_pyobject(py)?.into_any(),
                        request_id.into_pyobject(py)?.into_any(),
                        first.into_pyobject(py)?.into_any(),
                        end.into_pyobject(py)?.into_any(),
                    ],
                )?,
                ManagerEvent::AllBlocksCleared => PyTuple::new(py, ["cleared"])?,
            };
            out.append(item)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> PyResult<String> {
        let m = self.lock()?;
        Ok(format!(
            "KVCacheCore(num_blocks={}, block_size={}, requests={}, free={})",
            m.pool().num_blocks(),
            m.config().block_size,
            m.num_requests(),
            m.num_free_blocks()
        ))
    }
}
