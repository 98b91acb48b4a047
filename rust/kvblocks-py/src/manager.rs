//! `kvblocks.BlockManager`.

use crate::args::{int_arg, size_arg, str_arg};
use crate::errors::{GlueResult, KvBlocksError};
use crate::hasher::{env_seed, hash_bytes, hash_list, PyBlockHasher};
use crate::ints::extract_i64s;
use crate::keys::request_keys;
use crate::step::{mask_arg, optional_size, pairs_array, sampled_arg, sizes_arg, StepArrays};
use crate::sync::{detach_if_large, lock, lock_attached};
use crate::tokens::{extract_one_or_many, extract_token_ids};
use kvblocks_core::pool::{EventKey, KvEvent};
use kvblocks_core::{
    resolve_seed, BlockHash, BlockHasher, BlockManager, HashAlgo, ManagerConfig, RequestRef,
    StepInput,
};
use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyString, PyTuple, PyType};
use std::sync::{Arc, Mutex, MutexGuard};

#[pyclass(frozen, module = "kvblocks._core", name = "BlockManager")]
pub struct PyBlockManager {
    inner: Mutex<BlockManager>,
    hasher: Py<PyBlockHasher>,
    int_hashes: bool,
}

static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_BLOCKS_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static PREFIX_CACHE_STATS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

type Int32Array<'py> = Bound<'py, PyArray1<i32>>;

/// A request: its `str` id (borrowed, no copy) or its int handle.
fn id_arg<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<RequestRef<'a>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(RequestRef::Id(s.to_str()?));
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        return Ok(RequestRef::Handle(int_arg(obj, "request handle")?));
    }
    Err(PyTypeError::new_err(format!(
        "a request is named by its str id or its int handle, got {}",
        obj.get_type().name()?
    )))
}

/// A new request's id: a `str`.
fn new_id_arg<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    match obj.cast::<PyString>() {
        Ok(s) => s.to_str(),
        Err(_) => Err(PyTypeError::new_err(format!(
            "request_id must be a str, got {}",
            obj.get_type().name()?
        ))),
    }
}

fn block_ids_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let value = int_arg(&item?, "block id")?;
        out.push(
            u32::try_from(value)
                .map_err(|_| PyValueError::new_err(format!("block id {value} is out of range")))?,
        );
    }
    Ok(out)
}

impl PyBlockManager {
    fn lock(&self) -> PyResult<MutexGuard<'_, BlockManager>> {
        lock(&self.inner)
    }

    fn external<'py>(&self, py: Python<'py>, hash: &BlockHash) -> PyResult<Bound<'py, PyAny>> {
        if self.int_hashes {
            Ok(hash.external_u64().into_pyobject(py)?.into_any())
        } else {
            Ok(hash_bytes(py, hash).into_any())
        }
    }

    fn event<'py>(&self, py: Python<'py>, event: &KvEvent) -> PyResult<Bound<'py, PyAny>> {
        match event {
            KvEvent::BlockStored(stored) => {
                let hashes = stored
                    .block_hashes
                    .iter()
                    .map(|h| self.external(py, h))
                    .collect::<PyResult<Vec<_>>>()?;
                let parent = match &stored.parent_block_hash {
                    Some(h) => self.external(py, h)?,
                    None => py.None().into_bound(py),
                };
                let extra = PyList::empty(py);
                for keys in &stored.extra_keys {
                    match keys {
                        None => extra.append(py.None())?,
                        Some(keys) => {
                            let items = keys
                                .iter()
                                .map(|k| event_key(py, k))
                                .collect::<PyResult<Vec<_>>>()?;
                            extra.append(PyTuple::new(py, items)?)?;
                        }
                    }
                }
                let extra =
                    if extra.is_empty() { py.None().into_bound(py) } else { extra.into_any() };
                let kwargs = PyDict::new(py);
                kwargs.set_item("block_hashes", PyList::new(py, hashes)?)?;
                kwargs.set_item("parent_block_hash", parent)?;
                kwargs.set_item("token_ids", PyList::new(py, &stored.token_ids)?)?;
                kwargs.set_item("block_size", stored.block_size)?;
                kwargs.set_item("lora_name", stored.lora_name.as_deref())?;
                kwargs.set_item("extra_keys", extra)?;
                BLOCK_STORED
                    .import(py, "kvblocks.kv_events", "BlockStored")?
                    .call((), Some(&kwargs))
            }
            KvEvent::BlockRemoved(key) => {
                let hashes = PyList::new(py, [self.external(py, &key.hash)?])?;
                BLOCK_REMOVED.import(py, "kvblocks.kv_events", "BlockRemoved")?.call1((hashes,))
            }
            KvEvent::AllBlocksCleared => {
                ALL_BLOCKS_CLEARED.import(py, "kvblocks.kv_events", "AllBlocksCleared")?.call0()
            }
            KvEvent::Registered(_) => {
                Err(KvBlocksError::new_err("internal error: a registration without its event"))
            }
        }
    }
}

fn event_key<'py>(py: Python<'py>, key: &EventKey) -> PyResult<Bound<'py, PyAny>> {
    Ok(match key {
        EventKey::Text(s) => s.into_pyobject(py)?.into_any(),
        EventKey::Mm(identifier, offset) => (identifier, offset).into_pyobject(py)?.into_any(),
        EventKey::Bytes(b) => pyo3::types::PyBytes::new(py, b).into_any(),
    })
}

#[pymethods]
impl PyBlockManager {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size, *, enable_caching = true, hash_algo = "sha256_cbor",
        hash_seed = None, max_model_len = None, watermark = 0.0, log_stats = true,
        enable_events = false, verify_tokens = false, events_use_int_block_hashes = true,
        _debug_key_bytes = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_caching: bool,
        hash_algo: &str,
        hash_seed: Option<&Bound<'_, PyAny>>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        watermark: f64,
        log_stats: bool,
        enable_events: bool,
        verify_tokens: bool,
        events_use_int_block_hashes: bool,
        _debug_key_bytes: Option<&Bound<'_, PyAny>>,
    ) -> GlueResult<Self> {
        // The core refuses fewer than 2 too; a negative count gets the same message here.
        let value = int_arg(num_blocks, "num_blocks")?;
        let Some(num_blocks) = usize::try_from(value).ok().filter(|n| *n >= 2) else {
            let message =
                format!("num_blocks must be >= 2 (block 0 is the null block), got {value}");
            return Err(PyValueError::new_err(message).into());
        };
        let block_size = size_arg(block_size, "block_size", 1)?;
        let algo = HashAlgo::from_name(hash_algo)?;
        let seed =
            hash_seed.filter(|s| !s.is_none()).map(|s| str_arg(s, "hash_seed")).transpose()?;
        let seed = resolve_seed(algo, seed, env_seed(py)?)?;
        let hasher = Arc::new(BlockHasher::new(algo, block_size, seed)?);
        let config = ManagerConfig {
            num_blocks,
            enable_caching,
            max_model_len: max_model_len
                .filter(|m| !m.is_none())
                .map(|m| size_arg(m, "max_model_len", 1))
                .transpose()?,
            watermark,
            log_stats,
            enable_events,
            verify_tokens,
            debug_key_bytes: _debug_key_bytes
                .filter(|m| !m.is_none())
                .map(|m| size_arg(m, "_debug_key_bytes", 1))
                .transpose()?,
        };
        let manager = BlockManager::new(config, hasher.clone())?;
        Ok(Self {
            inner: Mutex::new(manager),
            hasher: Py::new(py, PyBlockHasher { inner: hasher })?,
            int_hashes: events_use_int_block_hashes,
        })
    }

    #[getter]
    fn hasher(&self, py: Python<'_>) -> Py<PyBlockHasher> {
        self.hasher.clone_ref(py)
    }

    #[getter]
    fn num_blocks(&self) -> GlueResult<usize> {
        Ok(self.lock()?.pool().num_blocks())
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.hasher.get().inner.block_size()
    }

    #[getter]
    fn enable_caching(&self) -> GlueResult<bool> {
        Ok(self.lock()?.config().enable_caching)
    }

    #[getter]
    fn num_free_blocks(&self) -> GlueResult<usize> {
        Ok(self.lock()?.num_free_blocks())
    }

    #[getter]
    fn usage(&self) -> GlueResult<f64> {
        Ok(self.lock()?.usage())
    }

    fn __len__(&self) -> GlueResult<usize> {
        Ok(self.lock()?.num_requests())
    }

    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<bool> {
        let Ok(id) = request_id.extract::<&str>() else { return Ok(false) };
        Ok(self.lock()?.sequence(id).is_ok())
    }

    #[pyo3(signature = (request_id, prompt_token_ids, /, *, cache_salt = None, lora = None, mm_features = None))]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora: Option<&Bound<'_, PyAny>>,
        mm_features: Option<&Bound<'_, PyAny>>,
    ) -> GlueResult<i64> {
        let id = new_id_arg(request_id)?;
        let tokens = extract_token_ids(prompt_token_ids)?;
        let keys = request_keys(cache_salt, lora, mm_features)?;
        let tokens = tokens.as_slice();
        let mut manager = self.lock()?;
        let manager = &mut *manager;
        Ok(detach_if_large(py, tokens.len(), || manager.add_request(id, tokens, keys))?)
    }

    #[pyo3(signature = (request_id, token_ids, /))]
    fn append_token_ids(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> GlueResult<()> {
        let id = id_arg(request_id)?;
        let tokens = extract_one_or_many(token_ids)?;
        let tokens = tokens.as_slice();
        let mut manager = self.lock()?;
        let manager = &mut *manager;
        Ok(detach_if_large(py, tokens.len(), || manager.append_token_ids(id, tokens))?)
    }

    #[pyo3(signature = (request_id, /))]
    fn remove_request(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<()> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.remove_request(id)?)
    }

    #[pyo3(signature = (request_id, /))]
    fn get_computed_blocks(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<(Vec<u32>, usize)> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.get_computed_blocks(id)?)
    }

    #[pyo3(signature = (
        request_id, num_new_tokens, /, *, num_new_computed_tokens = None,
        new_computed_blocks = None, num_lookahead_tokens = None,
    ))]
    fn allocate_slots(
        &self,
        request_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        num_new_computed_tokens: Option<&Bound<'_, PyAny>>,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: Option<&Bound<'_, PyAny>>,
    ) -> GlueResult<Option<Vec<u32>>> {
        let id = id_arg(request_id)?;
        let new = size_arg(num_new_tokens, "num_new_tokens", 0)?;
        let computed = optional_size(num_new_computed_tokens, "num_new_computed_tokens")?;
        let lookahead = optional_size(num_lookahead_tokens, "num_lookahead_tokens")?;
        let hits = match new_computed_blocks {
            Some(b) if !b.is_none() => block_ids_arg(b)?,
            _ => Vec::new(),
        };
        Ok(self.lock()?.allocate_slots(id, new, computed, &hits, lookahead)?)
    }

    #[pyo3(signature = (request_id, /))]
    fn free(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<()> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.free(id)?)
    }

    #[pyo3(signature = (parent_id, child_id, /))]
    fn fork(&self, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> GlueResult<i64> {
        let (parent, child) = (id_arg(parent_id)?, new_id_arg(child_id)?);
        Ok(self.lock()?.fork(parent, child)?)
    }

    /// The int handle of a request (named by id or handle).
    #[pyo3(signature = (request_id, /))]
    fn handle(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<i64> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.handle(id)?)
    }

    /// For each request, how many leading blocks and tokens a prefix lookup finds, as two
    /// int32 arrays. Takes no references.
    #[pyo3(signature = (handles, /))]
    fn lookup_batch<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
    ) -> GlueResult<(Int32Array<'py>, Int32Array<'py>)> {
        let handles = extract_i64s(handles, "handles")?;
        let found = self.lock()?.lookup_batch(handles.as_slice())?;
        let blocks: Vec<i32> = found.iter().map(|&(b, _)| b as i32).collect();
        let tokens: Vec<i32> = found.iter().map(|&(_, t)| t as i32).collect();
        Ok((PyArray1::from_vec(py, blocks), PyArray1::from_vec(py, tokens)))
    }

    /// One scheduler step in one call; see docs/step.md.
    #[pyo3(signature = (
        handles, num_new_tokens = None, /, *, num_new_computed_tokens = None,
        prefix_lookup = None, num_lookahead_tokens = None, new_token_ids = None,
        new_token_offsets = None, sampled_token_ids = None, token_budget = None, preempt = false,
        out = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn schedule_step<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
        num_new_computed_tokens: Option<&Bound<'py, PyAny>>,
        prefix_lookup: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: Option<&Bound<'py, PyAny>>,
        new_token_ids: Option<&Bound<'py, PyAny>>,
        new_token_offsets: Option<&Bound<'py, PyAny>>,
        sampled_token_ids: Option<&Bound<'py, PyAny>>,
        token_budget: Option<&Bound<'py, PyAny>>,
        preempt: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> GlueResult<Bound<'py, PyAny>> {
        let present = |o: Option<&Bound<'py, PyAny>>| o.filter(|v| !v.is_none()).cloned();
        let handles = extract_i64s(handles, "handles")?;
        let counts =
            present(num_new_tokens).map(|c| sizes_arg(&c, "num_new_tokens")).transpose()?;
        let hits = present(num_new_computed_tokens)
            .map(|h| sizes_arg(&h, "num_new_computed_tokens"))
            .transpose()?;
        let lookup = present(prefix_lookup).map(|m| mask_arg(&m, "prefix_lookup")).transpose()?;
        let tokens = present(new_token_ids).map(|t| extract_token_ids(&t)).transpose()?;
        let offsets =
            present(new_token_offsets).map(|o| sizes_arg(&o, "new_token_offsets")).transpose()?;
        let sampled = present(sampled_token_ids).map(|t| sampled_arg(&t)).transpose()?;
        let input = StepInput {
            handles: handles.as_slice(),
            num_new_tokens: counts.as_deref(),
            num_new_computed_tokens: hits.as_deref(),
            prefix_lookup: lookup.as_deref(),
            num_lookahead_tokens: optional_size(num_lookahead_tokens, "num_lookahead_tokens")?,
            new_token_ids: tokens.as_ref().map_or(&[], |t| t.as_slice()),
            new_token_offsets: offsets.as_deref(),
            sampled_token_ids: sampled.as_deref(),
            token_budget: present(token_budget)
                .map(|b| size_arg(&b, "token_budget", 0))
                .transpose()?,
            preempt,
        };
        let mut manager = lock_attached(py, &self.inner)?;
        let planned = manager.plan_step(input)?;
        let sizes = planned.sizes();
        let arrays = match present(out) {
            Some(buffers) => StepArrays::from_buffers(&buffers)?,
            None => StepArrays::allocate(py, sizes),
        };
        let mut views = arrays.borrow()?;
        let mut step_out = views.output()?;
        let work = sizes.max_tokens + sizes.num_reqs * sizes.max_blocks;
        let result = detach_if_large(py, work, || planned.run(&mut step_out))?;
        drop(views);
        drop(manager);
        Ok(arrays.scheduled_step(py, &result)?)
    }

    #[pyo3(signature = (request_id, /))]
    fn get_block_ids(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<Vec<u32>> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.block_ids(id)?.to_vec())
    }

    #[pyo3(signature = (request_id, /))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> GlueResult<Bound<'py, PyList>> {
        let id = id_arg(request_id)?;
        let manager = self.lock()?;
        Ok(hash_list(py, manager.sequence(id)?.block_hashes())?)
    }

    #[pyo3(signature = (request_id, /))]
    fn num_computed_tokens(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<usize> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.num_computed_tokens(id)?)
    }

    #[pyo3(signature = (request_id, /))]
    fn num_tokens(&self, request_id: &Bound<'_, PyAny>) -> GlueResult<usize> {
        let id = id_arg(request_id)?;
        Ok(self.lock()?.sequence(id)?.num_tokens())
    }

    #[pyo3(signature = (request_id, /))]
    fn get_token_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> GlueResult<Bound<'py, PyList>> {
        let id = id_arg(request_id)?;
        let manager = self.lock()?;
        Ok(PyList::new(py, manager.sequence(id)?.token_ids())?)
    }

    fn make_prefix_cache_stats<'py>(
        &self,
        py: Python<'py>,
    ) -> GlueResult<Option<Bound<'py, PyAny>>> {
        let Some(s) = self.lock()?.make_prefix_cache_stats() else { return Ok(None) };
        let kwargs = PyDict::new(py);
        kwargs.set_item("reset", s.reset)?;
        kwargs.set_item("requests", s.requests)?;
        kwargs.set_item("queries", s.queries)?;
        kwargs.set_item("hits", s.hits)?;
        kwargs.set_item("preempted_requests", s.preempted_requests)?;
        kwargs.set_item("preempted_queries", s.preempted_queries)?;
        kwargs.set_item("preempted_hits", s.preempted_hits)?;
        let cls = PREFIX_CACHE_STATS.import(py, "kvblocks.stats", "PrefixCacheStats")?;
        Ok(cls.call((), Some(&kwargs)).map(Some)?)
    }

    fn reset_prefix_cache(&self) -> GlueResult<bool> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    fn take_events<'py>(&self, py: Python<'py>) -> GlueResult<Bound<'py, PyList>> {
        let events = self.lock()?.take_events();
        let objects = events.iter().map(|e| self.event(py, e)).collect::<PyResult<Vec<_>>>()?;
        Ok(PyList::new(py, objects)?)
    }

    /// The pending copy-on-write copies as an `(N, 2)` int32 array of `(src, dst)` block ids.
    fn take_block_copies<'py>(&self, py: Python<'py>) -> GlueResult<Bound<'py, PyAny>> {
        let copies = self.lock()?.take_block_copies();
        Ok(pairs_array(py, &copies)?)
    }

    /// The pool's internal state, for tests and debugging: the free queue (head first), every
    /// block's reference count and cache key, and the key-to-blocks map.
    fn debug_state<'py>(&self, py: Python<'py>) -> GlueResult<Bound<'py, PyDict>> {
        let manager = self.lock()?;
        let pool = manager.pool();
        let state = PyDict::new(py);
        state.set_item("free_block_ids", pool.free_block_ids().collect::<Vec<_>>())?;
        let n =
            u32::try_from(pool.num_blocks()).map_err(|_| PyTypeError::new_err("pool too large"))?;
        state.set_item("ref_counts", (0..n).map(|b| pool.ref_cnt(b)).collect::<Vec<_>>())?;
        let keys = PyList::empty(py);
        for b in 0..n {
            match pool.key(b) {
                Some(k) => keys.append(hash_bytes(py, &k.hash))?,
                None => keys.append(py.None())?,
            }
        }
        state.set_item("block_keys", keys)?;
        let cached = PyDict::new(py);
        for (key, blocks) in pool.cached_blocks() {
            cached.set_item(hash_bytes(py, &key.hash), blocks.to_vec())?;
        }
        state.set_item("cached", cached)?;
        let tables = PyDict::new(py);
        let handles = PyDict::new(py);
        for (id, handle, blocks) in manager.block_tables() {
            tables.set_item(id, blocks.to_vec())?;
            handles.set_item(id, handle)?;
        }
        state.set_item("block_tables", tables)?;
        state.set_item("handles", handles)?;
        Ok(state)
    }

    fn __repr__(&self) -> GlueResult<String> {
        let m = self.lock()?;
        Ok(format!(
            "BlockManager(num_blocks={}, block_size={}, num_free_blocks={}, num_requests={})",
            m.pool().num_blocks(),
            m.hasher().block_size(),
            m.num_free_blocks(),
            m.num_requests()
        ))
    }
}
