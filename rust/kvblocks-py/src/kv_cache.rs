//! `kvblocks._core.KVCacheManager`: the Rust half of `kvblocks.vllm.KVCacheManager`, and the
//! small classes it takes and returns (`KVCacheGroup`, `KVCacheBlockIds`).
//!
//! Called once per vLLM manager call, with the request's own state as arguments; the block
//! hashes are read from the request's `list[bytes]` in place, only where the call needs them.

use crate::errors::GlueResult;
use crate::hasher::hash_bytes;
use crate::sync::{lock, lock_attached};
use kvblocks_core::pool::CacheKey;
use kvblocks_core::{
    AllocateArgs, AttentionKind, BlockHash, CoordinatorConfig, CoreError, CoreResult, GroupSpec,
    HashSource, KvCacheManager, ManagerEvent, RequestState,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard};

/// One KV-cache group: the attention kind whose rules manage its blocks.
#[pyclass(frozen, from_py_object, module = "kvblocks._core", name = "KVCacheGroup")]
#[derive(Clone)]
pub struct PyKvCacheGroup {
    pub(crate) spec: GroupSpec,
}

#[pymethods]
impl PyKvCacheGroup {
    #[new]
    #[pyo3(signature = (
        kind, block_size, *, sliding_window = None, extra_retained_tokens = 0,
        attention_chunk_size = None, num_speculative_blocks = 0, max_admission_blocks = None,
        is_eagle_group = false, prefill_checkpoint_alignment = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: &str,
        block_size: usize,
        sliding_window: Option<usize>,
        extra_retained_tokens: usize,
        attention_chunk_size: Option<usize>,
        num_speculative_blocks: usize,
        max_admission_blocks: Option<usize>,
        is_eagle_group: bool,
        prefill_checkpoint_alignment: Option<usize>,
    ) -> PyResult<Self> {
        let speculative = num_speculative_blocks;
        let checkpoint = prefill_checkpoint_alignment;
        let kind = match (kind, sliding_window, attention_chunk_size, speculative, checkpoint) {
            ("full", None, None, 0, None) => AttentionKind::Full,
            ("sliding_window", Some(window), None, 0, None) => {
                AttentionKind::SlidingWindow { window, extra_retained: extra_retained_tokens }
            }
            ("chunked_local", None, Some(chunk), 0, None) => AttentionKind::ChunkedLocal { chunk },
            ("mamba", None, None, speculative_blocks, checkpoint_alignment) => {
                AttentionKind::Mamba { speculative_blocks, checkpoint_alignment }
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "kind {kind:?} with sliding_window={sliding_window:?}, \
                     attention_chunk_size={attention_chunk_size:?}, \
                     num_speculative_blocks={speculative} and \
                     prefill_checkpoint_alignment={checkpoint:?}: expected \"full\" (none of \
                     them), \"sliding_window\" (sliding_window), \"chunked_local\" \
                     (attention_chunk_size) or \"mamba\" (num_speculative_blocks and \
                     prefill_checkpoint_alignment, optional)"
                )))
            }
        };
        Ok(Self { spec: GroupSpec { kind, block_size, max_admission_blocks, is_eagle_group } })
    }

    #[getter]
    fn kind(&self) -> &'static str {
        match self.spec.kind {
            AttentionKind::Full => "full",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
            AttentionKind::ChunkedLocal { .. } => "chunked_local",
            AttentionKind::Mamba { .. } => "mamba",
        }
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.spec.block_size
    }

    fn __repr__(&self) -> String {
        format!("KVCacheGroup({:?}, block_size={})", self.spec.kind, self.spec.block_size)
    }
}

/// What vLLM's scheduler gets where vLLM's manager returns `KVCacheBlocks`: the block ids of
/// each group, which is what the scheduler reads (`get_block_ids`).
#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheBlockIds")]
pub struct PyKvCacheBlockIds {
    groups: Vec<Vec<u32>>,
    /// Per group and block, the prefix-cache key at the time the result was made (vLLM's
    /// `block_hash`), where the result was asked for with them (`get_blocks(..., True)`).
    keys: Option<Vec<Vec<Option<CacheKey>>>>,
}

/// One block of a `KVCacheBlockIds` result, as vLLM's KV connectors read a `KVCacheBlock`:
/// its id, whether it is the null block, and the key it is registered under (or `None`).
#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheBlockView")]
pub struct PyKvCacheBlockView {
    #[pyo3(get)]
    block_id: u32,
    key: Option<CacheKey>,
}

#[pymethods]
impl PyKvCacheBlockView {
    /// The hash followed by the group id (4 bytes, big-endian), or `None`.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.key.as_ref().map(|key| {
            let mut bytes = key.hash.as_bytes().to_vec();
            bytes.extend_from_slice(&key.group.to_be_bytes());
            PyBytes::new(py, &bytes)
        })
    }

    #[getter]
    fn is_null(&self) -> bool {
        self.block_id == 0 // the null block
    }

    fn __repr__(&self) -> String {
        format!("KVCacheBlockView({}, hashed={})", self.block_id, self.key.is_some())
    }
}

impl PyKvCacheBlockIds {
    /// What reads the blocks' keys gets: a function giving block `i` of group `g`'s key, for
    /// a result asked for with them (what KV connectors get) or an empty one (no block, no
    /// key); an AttributeError naming `what` for ids only.
    fn keys_for(&self, what: &str) -> PyResult<impl Fn(usize, usize) -> Option<CacheKey> + '_> {
        if self.keys.is_none() && self.groups.iter().any(|g| !g.is_empty()) {
            return Err(pyo3::exceptions::PyAttributeError::new_err(format!(
                "{what}: this KVCacheBlockIds holds block ids only (KVCacheManager.get_blocks(\
                 request_id, True) also gives the blocks' keys)"
            )));
        }
        let keys = self.keys.as_ref();
        Ok(move |g: usize, i: usize| {
            keys.and_then(|k| k.get(g)).and_then(|k| k.get(i)).copied().flatten()
        })
    }
}

#[pymethods]
impl PyKvCacheBlockIds {
    #[new]
    #[pyo3(signature = (block_ids, /))]
    fn new(block_ids: Vec<Vec<u32>>) -> Self {
        Self { groups: block_ids, keys: None }
    }

    /// vLLM's `KVCacheBlocks.blocks`: per group, the blocks as views (id, null or not, key).
    /// Only for an empty result or one asked for with keys (`KVCacheManager.get_blocks(id,
    /// True)`, what KV connectors get): an AttributeError otherwise.
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let key = self.keys_for("blocks")?;
        let mut lists = Vec::with_capacity(self.groups.len());
        for (g, ids) in self.groups.iter().enumerate() {
            let views = ids
                .iter()
                .enumerate()
                .map(|(i, &block_id)| {
                    let key = key(g, i);
                    Py::new(py, PyKvCacheBlockView { block_id, key })
                })
                .collect::<PyResult<Vec<_>>>()?;
            lists.push(PyTuple::new(py, views)?);
        }
        PyTuple::new(py, lists)
    }

    /// vLLM's `KVCacheBlocks.get_unhashed_block_ids` (one group only): the ids of the blocks
    /// registered under no key, the null block included, as vLLM's.
    fn get_unhashed_block_ids(&self) -> PyResult<Vec<u32>> {
        let [ids] = self.groups.as_slice() else {
            return Err(PyValueError::new_err(format!(
                "get_unhashed_block_ids supports one KV-cache group, not {}",
                self.groups.len()
            )));
        };
        let key = self.keys_for("get_unhashed_block_ids")?;
        Ok(ids
            .iter()
            .enumerate()
            .filter(|&(i, _)| key(0, i).is_none())
            .map(|(_, &id)| id)
            .collect())
    }

    /// vLLM's `KVCacheBlocks.get_unhashed_block_ids_all_groups`: per group, the ids of the
    /// blocks that are neither null nor registered under a key (vLLM first drops a group's
    /// leading null blocks, which leaves the same ids).
    fn get_unhashed_block_ids_all_groups(&self) -> PyResult<Vec<Vec<u32>>> {
        let key = self.keys_for("get_unhashed_block_ids_all_groups")?;
        Ok(self
            .groups
            .iter()
            .enumerate()
            .map(|(g, ids)| {
                let unhashed = |&(i, &id): &(usize, &u32)| id != 0 && key(g, i).is_none();
                ids.iter().enumerate().filter(unhashed).map(|(_, &id)| id).collect()
            })
            .collect())
    }

    /// vLLM's `KVCacheBlocks.get_block_ids`: one list of ids per group (of the groups in
    /// `group_ids`, all by default), or `None` when all are empty and `allow_none`.
    #[pyo3(signature = (allow_none = false, *, group_ids = None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<Vec<usize>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let selected: Vec<&Vec<u32>> = match &group_ids {
            None => self.groups.iter().collect(),
            Some(ids) => ids
                .iter()
                .map(|&g| {
                    self.groups.get(g).ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "group {g} out of range ({} groups)",
                            self.groups.len()
                        ))
                    })
                })
                .collect::<PyResult<_>>()?,
        };
        if allow_none && selected.iter().all(|g| g.is_empty()) {
            return Ok(None);
        }
        let lists =
            selected.into_iter().map(|g| PyList::new(py, g)).collect::<PyResult<Vec<_>>>()?;
        Ok(Some(PyTuple::new(py, lists)?))
    }

    /// The number of groups.
    fn __len__(&self) -> usize {
        self.groups.len()
    }

    fn __repr__(&self) -> String {
        format!("KVCacheBlockIds({:?})", self.groups)
    }
}

/// A request's `block_hashes`: a list of `bytes`, read item by item.
pub(crate) struct ListHashes<'a, 'py>(&'a Bound<'py, PyList>);

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

pub(crate) fn hashes_arg<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<ListHashes<'a, 'py>> {
    obj.cast::<PyList>().map(ListHashes).map_err(|_| {
        PyTypeError::new_err(format!("block_hashes must be a list, got {}", type_name(obj)))
    })
}

/// Block ids from any iterable of ints, in its order.
fn block_ids_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    obj.try_iter()?.map(|item| item.and_then(|b| b.extract::<u32>())).collect()
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

#[pyclass(frozen, module = "kvblocks._core", name = "KVCacheManager")]
pub struct PyKvCacheManager {
    inner: Mutex<KvCacheManager>,
    /// What `contain_errors` set: called with `(request_id, message)` for each request whose
    /// allocation failed its check, instead of raising.
    on_contained: Mutex<Option<Py<PyAny>>>,
    /// The shared "no blocks" result, returned by identity as vLLM's manager does.
    empty: Py<PyKvCacheBlockIds>,
    /// The request statuses the watermark applies to (vLLM's WAITING and PREEMPTED).
    waiting_statuses: Vec<Py<PyAny>>,
    /// Some group frees blocks out of a window or chunk: only then does the coordinator read the
    /// request's in-flight tokens.
    windowed: bool,
    /// Sparse retention of sliding-window blocks (prefix caching, a retention interval, a
    /// window group) or Mamba groups with prefix caching: only then does the coordinator read the
    /// request's prompt length and shared-prefix boundary.
    boundaries: bool,
    /// A watermark is set: only then does the coordinator read the request's status.
    watermark: bool,
}

impl PyKvCacheManager {
    /// Block ids as a result object: the shared empty one when no group has any.
    fn blocks(&self, py: Python<'_>, groups: Vec<Vec<u32>>) -> PyResult<Py<PyKvCacheBlockIds>> {
        if groups.iter().all(Vec::is_empty) {
            Ok(self.empty.clone_ref(py))
        } else {
            Py::new(py, PyKvCacheBlockIds { groups, keys: None })
        }
    }

    /// The fields of vLLM's `Request` the coordinator reads, each only where the configuration
    /// uses it (this runs on every call): the status only for the watermark, which applies
    /// only when `has_scheduled_reqs`; the in-flight tokens only with a window or chunk; the
    /// prompt length and shared-prefix boundary only for sparse retention.
    fn request_state(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        has_scheduled_reqs: bool,
    ) -> PyResult<RequestState> {
        let field =
            |name: &Bound<'_, PyString>| -> PyResult<usize> { request.getattr(name)?.extract() };
        let mut state = RequestState {
            num_tokens: field(intern!(py, "num_tokens"))?,
            num_computed_tokens: field(intern!(py, "num_computed_tokens"))?,
            ..RequestState::default()
        };
        if self.watermark && has_scheduled_reqs {
            let status = request.getattr(intern!(py, "status"))?;
            state.is_waiting = self.waiting_statuses.iter().any(|s| status.is(s.bind(py)));
        }
        if self.windowed {
            state.num_in_flight_tokens = field(intern!(py, "num_in_flight_tokens"))?;
        }
        if self.boundaries {
            state.num_prompt_tokens = field(intern!(py, "num_prompt_tokens"))?;
            state.shared_prefix_boundary = field(intern!(py, "shared_prefix_boundary"))?;
        }
        Ok(state)
    }

    fn lock(&self) -> PyResult<MutexGuard<'_, KvCacheManager>> {
        lock(&self.inner)
    }

    /// `skip_zeroing_group_ids` (an iterable of group ids, or `None`) as a bit mask.
    fn group_mask(&self, group_ids: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let Some(group_ids) = group_ids else { return Ok(0) };
        let mut mask = 0u64;
        for item in group_ids.try_iter()? {
            let g: usize = item?.extract()?;
            if g >= self.num_groups() || g >= 64 {
                return Err(PyValueError::new_err(format!(
                    "skip_zeroing_group_ids: group {g} out of range ({} groups)",
                    self.num_groups()
                )));
            }
            mask |= 1 << g;
        }
        Ok(mask)
    }

    /// The hits vLLM hands back to `allocate_slots` (what `lookup` returned), or `None` for
    /// the shared empty result.
    fn hit_ids<'py>(
        &self,
        py: Python<'py>,
        blocks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyKvCacheBlockIds>>> {
        match blocks {
            Some(blocks) if !blocks.is(self.empty.bind(py)) && !blocks.is_none() => {
                let ids = blocks.cast::<PyKvCacheBlockIds>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "new_computed_blocks must come from get_computed_blocks, got {}",
                        type_name(blocks)
                    ))
                })?;
                Ok(Some(ids.clone()))
            }
            _ => Ok(None),
        }
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (
        num_blocks, groups, *, lookup_sets, max_model_len, enable_caching = true,
        enable_events = false, watermark_blocks = 0, use_eagle = false,
        num_prefill_lookahead = 0, num_hash_lookahead_tokens = 0, retention_interval = None,
        needs_kv_cache_zeroing = false, waiting_statuses = Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: u32,
        groups: Vec<PyKvCacheGroup>,
        lookup_sets: Vec<Vec<usize>>,
        max_model_len: usize,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: usize,
        use_eagle: bool,
        num_prefill_lookahead: usize,
        num_hash_lookahead_tokens: usize,
        retention_interval: Option<usize>,
        needs_kv_cache_zeroing: bool,
        waiting_statuses: Vec<Py<PyAny>>,
    ) -> GlueResult<Self> {
        let num_groups = groups.len();
        let config = CoordinatorConfig {
            num_blocks,
            groups: groups.into_iter().map(|g| g.spec).collect(),
            lookup_sets,
            max_model_len,
            enable_caching,
            enable_events,
            watermark_blocks,
            use_eagle,
            num_prefill_lookahead,
            num_hash_lookahead_tokens,
            retention_interval,
            needs_kv_cache_zeroing,
        };
        let windowed = config.is_windowed();
        let sliding = config.groups.iter().any(|g| g.kind.window_hit_blocks(1, false).is_some());
        let mamba = config.groups.iter().any(|g| g.kind.is_mamba());
        let boundaries =
            config.enable_caching && (mamba || config.retention_interval.is_some() && sliding);
        let watermark = config.watermark_blocks > 0;
        Ok(Self {
            inner: Mutex::new(KvCacheManager::new(config)?),
            on_contained: Mutex::new(None),
            empty: Py::new(
                py,
                PyKvCacheBlockIds { groups: vec![Vec::new(); num_groups], keys: None },
            )?,
            waiting_statuses,
            windowed,
            boundaries,
            watermark,
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
    fn num_groups(&self) -> usize {
        self.empty.get().groups.len()
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

    /// The ids of the requests holding blocks (those ``get_blocks`` answers), sorted.
    fn request_ids(&self) -> PyResult<Vec<String>> {
        let mut ids: Vec<String> = self.lock()?.request_ids().map(str::to_owned).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    /// vLLM's `find_longest_cache_hit`: `(blocks, num_tokens, num_uncached_common_tokens)`,
    /// the cached prefix (at most `max_length` tokens) every group can serve (the shared
    /// empty result when there is none). With `request_id`, a request `probe_request` probed
    /// resumes that walk where nothing cached was removed since (the same hit).
    #[pyo3(signature = (block_hashes, max_length, /, request_id = None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_length: usize,
        request_id: Option<&str>,
    ) -> GlueResult<(Py<PyKvCacheBlockIds>, usize, usize)> {
        let hashes = hashes_arg(block_hashes)?;
        let hit = match request_id {
            Some(id) => self.lock()?.lookup_request(id, &hashes, max_length)?,
            None => self.lock()?.lookup(&hashes, max_length)?,
        };
        Ok((self.blocks(py, hit.blocks)?, hit.num_tokens, hit.num_uncached_common))
    }

    /// vLLM 0.34's `get_num_cached_tokens(request)`, the request read in place (the probe
    /// vLLM's cache-aware admission makes for every waiting request in its window at every
    /// step, so no Python frame stands in between): 0 where vLLM's
    /// `prefix_cache_lookup_enabled` runs no lookup (the request's `prefix_cache_hit_limit`
    /// is 0, or caching is off), else [`KvCacheManager::num_cached_tokens`] over all but the
    /// request's last token.
    #[pyo3(signature = (request, /))]
    fn probe_request(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> GlueResult<usize> {
        let limit = request.getattr(intern!(py, "prefix_cache_hit_limit"))?;
        if !limit.is_none() && limit.extract::<i64>()? == 0 {
            return Ok(0);
        }
        let request_id = request.getattr(intern!(py, "request_id"))?;
        let request_id = request_id.cast::<PyString>().map_err(PyErr::from)?.to_str()?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        let num_tokens: usize = request.getattr(intern!(py, "num_tokens"))?.extract()?;
        let hashes = hashes_arg(&block_hashes)?;
        Ok(self.lock()?.num_cached_tokens(request_id, &hashes, num_tokens.saturating_sub(1))?)
    }

    /// vLLM's `find_longest_cache_hit_per_group`: each group's own longest cached prefix
    /// of `block_hashes` (at most `max_length` tokens), the groups not agreeing on one
    /// length: `(blocks, hit lengths per group)`.
    #[pyo3(signature = (block_hashes, max_length, /))]
    fn lookup_per_group<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        max_length: usize,
    ) -> GlueResult<(Py<PyKvCacheBlockIds>, Vec<usize>)> {
        let (blocks, lengths) =
            self.lock()?.lookup_per_group(&hashes_arg(block_hashes)?, max_length)?;
        Ok((self.blocks(py, blocks)?, lengths))
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
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> GlueResult<Option<Py<PyKvCacheBlockIds>>> {
        if num_encoder_tokens != 0 {
            return Err(PyValueError::new_err(
                "kvblocks' KVCacheManager has no encoder cache (encoder tokens)",
            )
            .into());
        }
        let skip_zeroing_groups = self.group_mask(skip_zeroing_group_ids)?;
        let hit_ids = self.hit_ids(py, new_computed_blocks)?;
        let request_id = request.getattr(intern!(py, "request_id"))?;
        let request_id = request_id.cast::<PyString>().map_err(PyErr::from)?.to_str()?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        let state = self.request_state(py, request, has_scheduled_reqs)?;
        let args = AllocateArgs {
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            reserved_blocks,
            full_sequence_must_fit,
            delay_cache_blocks,
            has_scheduled_reqs,
            copy_on_write: false,
            num_external_computed_tokens,
            skip_zeroing_groups,
        };
        let hashes = hashes_arg(&block_hashes)?;
        // No hits (the hot path, every decode step): no allocation.
        let hits: Vec<&[u32]> = hit_ids
            .as_ref()
            .map_or_else(Vec::new, |ids| ids.get().groups.iter().map(Vec::as_slice).collect());
        let mut manager = lock_attached(py, &self.inner)?;
        let new = manager.allocate_slots(request_id, &state, &args, &hits, &hashes)?;
        let contained = manager.take_contained();
        drop(manager);
        if !contained.is_empty() {
            let handler = lock(&self.on_contained)?.as_ref().map(|h| h.clone_ref(py));
            if let Some(handler) = handler {
                for (request_id, message) in contained {
                    handler.call1(py, (request_id, message))?;
                }
            }
        }
        Ok(new.map(|ids| self.blocks(py, ids)).transpose()?)
    }

    /// Contains an allocation that fails kvblocks' check (a bug of kvblocks', "a block table
    /// is unsound") to its request: instead of raising, `allocate_slots` gives the request a
    /// table safe to hand to a worker (only blocks it holds, null blocks where it holds none)
    /// and calls `handler(request_id, message)`, whose caller finishes the request with an
    /// error. `None` turns it off (the error is raised, as by default).
    #[pyo3(signature = (handler, /))]
    fn contain_errors(&self, handler: Option<Py<PyAny>>) -> PyResult<()> {
        let mut manager = self.lock()?;
        manager.contain_unsound(handler.is_some());
        *lock(&self.on_contained)? = handler;
        Ok(())
    }

    /// Benchmark-only: turns kvblocks' check of every allocation off (or on again), so that
    /// `benches/bench_vllm.py` measures what the check costs in one run. Never in serving:
    /// the check is what keeps an unsound table from the worker.
    #[pyo3(signature = (enabled, /))]
    fn _check_allocations(&self, enabled: bool) -> PyResult<()> {
        self.lock()?.set_check(enabled);
        Ok(())
    }

    /// Test-only (the `test-faults` feature): `request_id`'s next allocation frees a block its
    /// table alone holds before kvblocks' check runs, as a bug in a rule would leave it.
    #[cfg(feature = "test-faults")]
    #[pyo3(signature = (request_id, /))]
    fn _plant_fault(&self, request_id: &str) -> PyResult<()> {
        self.lock()?.plant_fault(request_id);
        Ok(())
    }

    /// vLLM's `pop_blocks_for_free`: forgets the request and returns its blocks (each group's
    /// in allocation order, leading null blocks left out), which stay held until
    /// `free_blocks` (empty for an unknown id).
    #[pyo3(signature = (request_id, /))]
    fn pop_blocks_for_free(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pop_blocks_for_free(request_id))
    }

    /// vLLM's `BlockPool.free_blocks` for block ids from `pop_blocks_for_free` (any iterable,
    /// in eviction order); a ValueError, changing nothing, for an id out of range or freed
    /// more often than held.
    #[pyo3(signature = (block_ids, /))]
    fn free_blocks(&self, block_ids: &Bound<'_, PyAny>) -> GlueResult<()> {
        let ids = block_ids_arg(block_ids)?;
        Ok(self.lock()?.free_blocks(&ids)?)
    }

    /// vLLM's coordinator `get_num_blocks_to_allocate` for a request without new hits: the
    /// blocks it needs for `num_tokens` slots (`num_tokens_main_model` of them the main
    /// model's, all by default: what a Mamba group counts) with `total_computed_tokens`
    /// computed tokens, the prefill ending at `prefill_end` (where a Mamba group with
    /// prefill checkpoints and retention interval 0 places the prompt's).
    #[pyo3(signature = (
        request_id, num_tokens, total_computed_tokens, apply_admission_cap = false,
        num_tokens_main_model = None, prefill_end = 0
    ))]
    fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: usize,
        total_computed_tokens: usize,
        apply_admission_cap: bool,
        num_tokens_main_model: Option<usize>,
        prefill_end: usize,
    ) -> PyResult<i64> {
        Ok(self.lock()?.num_blocks_to_allocate(
            request_id,
            num_tokens,
            num_tokens_main_model.unwrap_or(num_tokens),
            total_computed_tokens,
            prefill_end,
            apply_admission_cap,
        ))
    }

    /// vLLM's `cache_blocks` (vLLM's arguments): registers the request's full blocks up to
    /// `num_computed_tokens` tokens. vLLM calls it for every running request after every
    /// async step; on a step where none of the request's blocks filled it reads only the
    /// request's id and hashes and returns.
    #[pyo3(signature = (request, num_computed_tokens))]
    fn cache_blocks<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_computed_tokens: usize,
    ) -> GlueResult<()> {
        let request_id = request.getattr(intern!(py, "request_id"))?;
        let request_id = request_id.cast::<PyString>().map_err(PyErr::from)?.to_str()?;
        let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
        let hashes = hashes_arg(&block_hashes)?;
        if !self.lock()?.cache_blocks_due(request_id, num_computed_tokens, hashes.len()) {
            return Ok(());
        }
        let state = self.request_state(py, request, false)?;
        Ok(self.lock()?.cache_blocks(request_id, &state, num_computed_tokens, &hashes)?)
    }

    /// vLLM's `remove_skipped_blocks`: frees the blocks no later token reads once
    /// `num_processed` tokens are done (a no-op for an unknown id).
    #[pyo3(signature = (request_id, num_processed, /))]
    fn remove_skipped_blocks(&self, request_id: &str, num_processed: usize) -> PyResult<()> {
        self.lock()?.remove_skipped_blocks(request_id, num_processed);
        Ok(())
    }

    /// Releases the request's blocks (a no-op for an unknown id).
    #[pyo3(signature = (request_id, /))]
    fn free(&self, request_id: &str) -> PyResult<()> {
        self.lock()?.free(request_id);
        Ok(())
    }

    /// The request's block ids, one list per group (empty lists for an unknown id).
    #[pyo3(signature = (request_id, /))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let manager = self.lock()?;
        let lists = match manager.block_ids(request_id) {
            Some(held) => held
                .groups
                .iter()
                .map(|g| PyList::new(py, &g.blocks))
                .collect::<PyResult<Vec<_>>>()?,
            None => (0..self.num_groups()).map(|_| PyList::empty(py)).collect(),
        };
        PyTuple::new(py, lists)
    }

    /// vLLM's `get_blocks`: the request's whole block tables (a copy); `with_keys` also takes
    /// each block's prefix-cache key now, for `KVCacheBlockIds.blocks` (what KV connectors
    /// read).
    #[pyo3(signature = (request_id, with_keys = false, /))]
    fn get_blocks(
        &self,
        py: Python<'_>,
        request_id: &str,
        with_keys: bool,
    ) -> PyResult<Py<PyKvCacheBlockIds>> {
        let manager = self.lock()?;
        let Some(held) = manager.block_ids(request_id) else {
            drop(manager);
            return self.blocks(py, Vec::new());
        };
        let groups: Vec<Vec<u32>> = held.groups.iter().map(|g| g.blocks.clone()).collect();
        if !with_keys {
            drop(manager);
            return self.blocks(py, groups);
        }
        let pool = manager.pool();
        let keys =
            groups.iter().map(|ids| ids.iter().map(|&b| pool.key(b).copied()).collect()).collect();
        drop(manager);
        Py::new(py, PyKvCacheBlockIds { groups, keys: Some(keys) })
    }

    #[pyo3(signature = (request_id, /))]
    fn estimate_cached_tokens(&self, request_id: &str) -> PyResult<usize> {
        Ok(self.lock()?.estimate_cached_tokens(request_id))
    }

    fn reset_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    /// vLLM's `record_blocks_for_zeroing`: the request's blocks from token `start_token` on
    /// are recorded again for zeroing (a failed asynchronous load); a ValueError, changing
    /// nothing, unless `start_token` is at a block boundary.
    #[pyo3(signature = (request_id, start_token, /))]
    fn record_blocks_for_zeroing(&self, request_id: &str, start_token: usize) -> GlueResult<()> {
        Ok(self.lock()?.record_blocks_for_zeroing(request_id, start_token)?)
    }

    /// vLLM's `evict_blocks`: the blocks (any iterable of ids, in its order) lose their
    /// prefix-cache entries; a ValueError, changing nothing, for an id out of range.
    #[pyo3(signature = (block_ids, /))]
    fn evict_blocks(&self, block_ids: &Bound<'_, PyAny>) -> GlueResult<()> {
        let ids = block_ids_arg(block_ids)?;
        Ok(self.lock()?.evict_blocks(&ids)?)
    }

    /// vLLM's `new_step_starts`, at the start of every scheduler step: Mamba states cached
    /// before it may be adopted as prefix hits again. Returns how many times so far an
    /// allocation left a Mamba running or draft state column holding the null block by
    /// vLLM's own rule (after rejected drafts; the worker writes that state into the null
    /// block).
    fn new_step_starts(&self) -> PyResult<u64> {
        Ok(self.lock()?.new_step_starts())
    }

    /// vLLM's `take_new_block_ids`: the attention groups' blocks allocated since the last
    /// call, for the worker to zero (always empty unless `needs_kv_cache_zeroing`).
    fn take_new_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = self.lock()?.take_new_block_ids();
        PyList::new(py, ids)
    }

    /// vLLM's `take_boundary_state_offloads`: `{request_id: [(group_id, block_id,
    /// num_tokens), ...]}` for the Mamba states (prefix caching on) registered as full blocks
    /// since the last call, which a KV connector may offload; each request's in group order,
    /// then in the order they were registered. A freed request's are left out.
    fn take_boundary_state_offloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let states = self.lock()?.take_boundary_states();
        let out = PyDict::new(py);
        for (request_id, state) in states {
            let entry = (state.group, state.block, state.num_tokens);
            match out.get_item(&request_id)? {
                Some(list) => list.cast::<PyList>()?.append(entry)?,
                None => out.set_item(request_id, PyList::new(py, [entry])?)?,
            }
        }
        Ok(out)
    }

    /// The events since the last call, oldest first: `("removed", hash, group)`,
    /// `("stored", request_id, group, first_block, end_block, skipped_blocks)` or
    /// `("cleared",)`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.lock()?.take_events();
        let out = PyList::empty(py);
        for event in events {
            let item = match event {
                ManagerEvent::Removed { hash, group } => {
                    ("removed", hash_bytes(py, &hash), group).into_pyobject(py)?
                }
                ManagerEvent::Stored { request_id, group, first, end, skipped } => {
                    let skipped = PyTuple::new(py, skipped)?;
                    ("stored", request_id, group, first, end, skipped).into_pyobject(py)?
                }
                ManagerEvent::AllBlocksCleared => PyTuple::new(py, ["cleared"])?,
            };
            out.append(item)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> PyResult<String> {
        let m = self.lock()?;
        Ok(format!(
            "KVCacheManager(num_blocks={}, groups={}, requests={}, free={})",
            m.pool().num_blocks(),
            m.config().groups.len(),
            m.num_requests(),
            m.num_free_blocks()
        ))
    }
}
