//! `kvblocks._core.KVCacheCore`: the Rust half of `kvblocks.vllm.KVCacheManager`.
//!
//! Called once per vLLM manager call, with the request's own state as arguments; the block
//! hashes are read from the request's `list[bytes]` in place, only where the call needs them.

use crate::errors::GlueResult;
use crate::hasher::hash_bytes;
use crate::sync::{lock, lock_attached};
use kvblocks_core::{
    AllocateArgs, BlockHash, CoreError, CoreResult, HashSource, KvCacheConfig, KvCacheManager,
    ManagerEvent,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard};

#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheCore")]
pub struct PyKvCacheCore {
    inner: Mutex<KvCacheManager>,
    /// The shared "no blocks" result, returned by identity as vLLM's manager does.
    empty: Py<PyKvCacheBlockIds>,
    /// The request statuses the watermark applies to (vLLM's WAITING and PREEMPTED).
    admitted_statuses: Vec<Py<PyAny>>,
}

/// What vLLM's scheduler gets where vLLM's manager returns `KVCacheBlocks`: the block ids
/// of the one group, which is all the scheduler reads (`get_block_ids`).
#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheBlockIds")]
pub struct PyKvCacheBlockIds {
    ids: Vec<u32>,
}

#[pymethods]
impl PyKvCacheBlockIds {
    #[new]
    #[pyo3(signature = (block_ids, /))]
    fn new(block_ids: Vec<u32>) -> Self {
        Self { ids: block_ids }
    }

    /// A fresh list of the block ids.
    #[getter(block_ids)]
    fn ids_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.ids)
    }

    /// vLLM's `KVCacheBlocks.get_block_ids`: `([ids],)`, or `None` when empty and
    /// `allow_none`.
    #[pyo3(signature = (allow_none = false, *, group_ids = None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let _ = group_ids; // one group: every selection is that group
        if allow_none && self.ids.is_empty() {
            return Ok(None);
        }
        Ok(Some(PyTuple::new(py, [PyList::new(py, &self.ids)?])?))
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    fn __repr__(&self) -> String {
        format!("KVCacheBlockIds({:?})", self.ids)
    }
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
    /// Block ids as a result object: the shared empty one when there are none.
    fn blocks(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<Py<PyKvCacheBlockIds>> {
        if ids.is_empty() {
            Ok(self.empty.clone_ref(py))
        } else {
            Py::new(py, PyKvCacheBlockIds { ids })
        }
    }

    fn lock(&self) -> PyResult<MutexGuard<'_, KvCacheManager>> {
        lock(&self.inner)
    }
}

#[pymethods]
impl PyKvCacheCore {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size, *, max_model_len, enable_caching = true,
        enable_events = false, watermark_blocks = 0, admitted_statuses = Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: u32,
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: usize,
        admitted_statuses: Vec<Py<PyAny>>,
    ) -> GlueResult<Self> {
        let config = KvCacheConfig {
            num_blocks,
            block_size,
            max_model_len,
            enable_caching,
            enable_events,
            watermark_blocks,
        };
        Ok(Self {
            inner: Mutex::new(KvCacheManager::new(config)?),
            empty: Py::new(py, PyKvCacheBlockIds { ids: Vec::new() })?,
            admitted_statuses,
        })
    }

    /// The shared empty result (vLLM's `empty_kv_cache_blocks`).
    #[getter]
    fn empty_kv_cache_blocks(&self, py: Python<'_>) -> Py<PyKvCacheBlockIds> {
        self.empty.clone_ref(py)
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

    /// The cached blocks of the leading hashes (at most `max_blocks`), stopping at a miss
    /// (the shared empty result when the first one misses).
    #[pyo3(signature = (block_hashes, max_blocks, /))]
    fn lookup(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_blocks: usize,
    ) -> GlueResult<Py<PyKvCacheBlockIds>> {
        let hits = self.lock()?.lookup(&hashes_arg(block_hashes)?, max_blocks)?;
        Ok(self.blocks(py, hits)?)
    }

    /// vLLM's `KVCacheManager.allocate_slots`, called by vLLM's scheduler directly: reads
    /// the request's id, block hashes, token counts and status, and returns the new blocks
    /// (the shared empty result when there are none), or `None` when the pool is too full.
    /// No KV connector or encoder cache: external and encoder tokens must be 0.
    #[pyo3(signature = (
        request, num_new_tokens, num_new_computed_tokens = 0, new_computed_blocks = None,
        num_lookahead_tokens = 0, num_external_computed_tokens = 0, delay_cache_blocks = false,
        num_encoder_tokens = 0, full_sequence_must_fit = false, reserved_blocks = 0,
        has_scheduled_reqs = true, skip_zeroing_group_ids = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_for_request<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: usize,
        num_new_computed_tokens: usize,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: usize,
        num_external_computed_tokens: usize,
        delay_cache_blocks: bool,
        num_encoder_tokens: usize,
        full_sequence_must_fit: bool,
        reserved_blocks: usize,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> GlueResult<Option<Py<PyKvCacheBlockIds>>> {
        let _ = skip_zeroing_group_ids; // nothing is zeroed in the supported configurations
        if num_external_computed_tokens != 0 || num_encoder_tokens != 0 {
            return Err(PyValueError::new_err(
                "kvblocks' KVCacheManager has no KV connector or encoder cache \
                 (external or encoder tokens)",
            )
            .into());
        }
        let hit_ids = match new_computed_blocks {
            Some(blocks) if !blocks.is(self.empty.bind(py)) && !blocks.is_none() => {
                Some(blocks.cast::<PyKvCacheBlockIds>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "new_computed_blocks must come from get_computed_blocks, got {}",
                        type_name(blocks)
                    ))
                })?)
            }
            _ => None,
        };
        let hits = hit_ids.map_or(&[][..], |blocks| blocks.get().ids.as_slice());
        let request_id = request.getattr(intern!(py, "request_id"))?;
        let request_id = request_id.cast::<PyString>().map_err(PyErr::from)?.to_str()?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        let apply_watermark = has_scheduled_reqs && {
            let status = request.getattr(intern!(py, "status"))?;
            self.admitted_statuses.iter().any(|s| status.is(s.bind(py)))
        };
        let args = AllocateArgs {
            num_tokens: request.getattr(intern!(py, "num_tokens"))?.extract()?,
            num_computed_tokens: request.getattr(intern!(py, "num_computed_tokens"))?.extract()?,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            reserved_blocks,
            full_sequence_must_fit,
            delay_cache_blocks,
            apply_watermark,
        };
        let hashes = hashes_arg(&block_hashes)?;
        let new =
            lock_attached(py, &self.inner)?.allocate_slots(request_id, &args, hits, &hashes)?;
        Ok(new.map(|ids| self.blocks(py, ids)).transpose()?)
    }

    /// vLLM's `cache_blocks`: registers the full blocks up to `num_tokens` tokens.
    #[pyo3(signature = (request_id, block_hashes, num_tokens, /))]
    fn cache_blocks(
        &self,
        request_id: &str,
        block_hashes: &Bound<'_, PyAny>,
        num_tokens: usize,
    ) -> GlueResult<()> {
        let hashes = hashes_arg(block_hashes)?;
        Ok(self.lock()?.cache_blocks(request_id, num_tokens, &hashes)?)
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

    /// vLLM's `get_blocks`: the request's whole block table (a copy).
    #[pyo3(signature = (request_id, /))]
    fn get_blocks(&self, py: Python<'_>, request_id: &str) -> PyResult<Py<PyKvCacheBlockIds>> {
        let ids = self.lock()?.block_ids(request_id).to_vec();
        self.blocks(py, ids)
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
                    [("removed").into_pyobject(py)?.into_any(), hash_bytes(py, &hash).into_any()],
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
