//! `kvblocks._core.RouterIndex`: the cluster-wide block table of `kvblocks.router`.

use crate::errors::GlueResult;
use crate::kv_cache::{hashes_arg, PyKvCacheGroup};
use crate::sync::lock_attached;
use crate::tokens::exact_ints;
use kvblocks_core::{
    block_key, int_block_key, BlockHash, CoreResult, HashSource, HitRule, RouterIndex, MAX_REPLICAS,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList};
use std::sync::Mutex;

/// A replica's prefix-hit rule: its KV-cache groups and the sets they are looked up in, as
/// its engine's coordinator has them (see `kvblocks.router.ReplicaLayout`).
#[pyclass(frozen, module = "kvblocks._core", name = "HitRule")]
pub struct PyHitRule {
    rule: HitRule,
}

#[pymethods]
impl PyHitRule {
    #[new]
    #[pyo3(signature = (groups, /, *, lookup_sets, use_eagle = false))]
    fn new(
        groups: Vec<PyKvCacheGroup>,
        lookup_sets: Vec<Vec<usize>>,
        use_eagle: bool,
    ) -> GlueResult<Self> {
        let groups = groups.into_iter().map(|g| g.spec).collect();
        Ok(Self { rule: HitRule::new(groups, lookup_sets, use_eagle)? })
    }

    /// Whether the hit is the longest prefix every group holds (full attention only, no
    /// EAGLE drop): `RouterIndex.prefix_blocks` answers it for every replica at once.
    #[getter]
    fn is_plain_prefix(&self) -> bool {
        self.rule.is_plain_prefix()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.rule.block_size()
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.rule.num_groups()
    }
}

#[pyclass(frozen, module = "kvblocks._core", name = "RouterIndex")]
pub struct PyRouterIndex {
    inner: Mutex<RouterIndex>,
}

/// The index key of one block hash: `bytes` (vLLM's hash) or an int (the form vLLM's KV
/// events publish by default, its last 8 bytes big-endian).
fn key_of(item: &Bound<'_, PyAny>, group: u32, medium: u32) -> PyResult<u64> {
    if let Ok(bytes) = item.cast::<PyBytes>() {
        return Ok(block_key(bytes.as_bytes(), group, medium));
    }
    if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
        let value: u64 = item.extract().map_err(|_| {
            PyValueError::new_err(format!("a block hash int must be in [0, 2**64), got {item}"))
        })?;
        return Ok(int_block_key(value, group, medium));
    }
    Err(PyTypeError::new_err(format!(
        "a block hash must be bytes or an int, got {}",
        item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
    )))
}

/// A block hash from a live exact int (for [`exact_ints`]): in `[0, 2**64)`, else `None`.
fn hash_of_exact_int(item: *mut pyo3::ffi::PyObject) -> Option<u64> {
    // SAFETY: `item` is a live exact int. Out of range, the call raises OverflowError and
    // returns u64::MAX: the error is cleared (the checked path reports the item).
    let value = unsafe { pyo3::ffi::PyLong_AsUnsignedLongLong(item) };
    // SAFETY: reading and clearing the error indicator with the GIL held.
    if value == u64::MAX && unsafe { !pyo3::ffi::PyErr_Occurred().is_null() } {
        // SAFETY: as above.
        unsafe { pyo3::ffi::PyErr_Clear() };
        return None;
    }
    Some(value)
}

/// The index keys of a sequence of block hashes, in one group and medium.
fn keys_of(hashes: &Bound<'_, PyAny>, group: u32, medium: u32) -> PyResult<Vec<u64>> {
    if let Ok(list) = hashes.cast::<PyList>() {
        // vLLM's KV events publish ints by default: a list of them is read in one pass.
        let values = exact_ints(list, pyo3::ffi::PyList_GetItem, 0, hash_of_exact_int);
        if let Some(values) = values {
            return Ok(values.into_iter().map(|v| int_block_key(v, group, medium)).collect());
        }
        return list.iter().map(|item| key_of(&item, group, medium)).collect();
    }
    hashes.try_iter()?.map(|item| key_of(&item?, group, medium)).collect()
}

#[pymethods]
impl PyRouterIndex {
    #[new]
    #[pyo3(signature = (seed = 0))]
    fn new(seed: u64) -> Self {
        PyRouterIndex { inner: Mutex::new(RouterIndex::new(seed)) }
    }

    #[classattr]
    const MAX_REPLICAS: usize = MAX_REPLICAS;

    fn add_replica(&self, py: Python<'_>, replica: usize) -> GlueResult<()> {
        Ok(lock_attached(py, &self.inner)?.add_replica(replica)?)
    }

    fn clear_replica(&self, py: Python<'_>, replica: usize) -> GlueResult<u64> {
        Ok(lock_attached(py, &self.inner)?.clear_replica(replica)?)
    }

    fn remove_replica(&self, py: Python<'_>, replica: usize) -> GlueResult<u64> {
        Ok(lock_attached(py, &self.inner)?.remove_replica(replica)?)
    }

    fn store(
        &self,
        py: Python<'_>,
        replica: usize,
        hashes: &Bound<'_, PyAny>,
        group: u32,
        medium: u32,
    ) -> GlueResult<u64> {
        let keys = keys_of(hashes, group, medium)?;
        Ok(lock_attached(py, &self.inner)?.store(replica, &keys)?)
    }

    fn remove(
        &self,
        py: Python<'_>,
        replica: usize,
        hashes: &Bound<'_, PyAny>,
        group: u32,
        medium: u32,
    ) -> GlueResult<u64> {
        let keys = keys_of(hashes, group, medium)?;
        Ok(lock_attached(py, &self.inner)?.remove(replica, &keys)?)
    }

    /// `{replica: leading blocks of hashes it holds}` for every registered replica.
    fn prefix_blocks<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        group: u32,
        medium: u32,
    ) -> GlueResult<Bound<'py, PyDict>> {
        let keys = keys_of(hashes, group, medium)?;
        let mut out = [0u32; MAX_REPLICAS];
        let mut live = {
            let index = lock_attached(py, &self.inner)?;
            index.prefix_blocks(&keys, &mut out);
            index.replicas()
        };
        let result = PyDict::new(py);
        while live != 0 {
            let r = live.trailing_zeros() as usize;
            result.set_item(r, out.get(r).copied().unwrap_or(0))?;
            live &= live - 1;
        }
        Ok(result)
    }

    /// For each replica of `replicas`, the prefix tokens its scheduler would find cached in
    /// `medium` for a request with `block_hashes` (a list of `bytes`, every full block's), in
    /// a lookup of at most `max_length` tokens, under their layout's `rule` (the hashes read
    /// once for them all).
    #[pyo3(signature = (replicas, block_hashes, rule, medium, max_length, /))]
    fn hit_tokens(
        &self,
        py: Python<'_>,
        replicas: Vec<usize>,
        block_hashes: &Bound<'_, PyAny>,
        rule: &PyHitRule,
        medium: u32,
        max_length: usize,
    ) -> GlueResult<Vec<usize>> {
        let source = hashes_arg(block_hashes)?;
        let hashes =
            (0..source.len()).map(|i| source.get(i)).collect::<CoreResult<Vec<BlockHash>>>()?;
        let index = lock_attached(py, &self.inner)?;
        let found = replicas
            .iter()
            .map(|&r| index.hit_tokens(r, medium, &rule.rule, &hashes, max_length))
            .collect::<CoreResult<Vec<usize>>>()?;
        Ok(found)
    }

    fn holds(
        &self,
        py: Python<'_>,
        replica: usize,
        hash: &Bound<'_, PyAny>,
        group: u32,
        medium: u32,
    ) -> GlueResult<bool> {
        let key = key_of(hash, group, medium)?;
        Ok(lock_attached(py, &self.inner)?.holds(replica, key))
    }

    /// The blocks `replica` holds, for a snapshot: their keys (8 bytes each, little-endian)
    /// and their copies (4 bytes each), in the same order; `restore_replica` takes them back.
    fn replica_blocks<'py>(
        &self,
        py: Python<'py>,
        replica: usize,
    ) -> GlueResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let blocks = lock_attached(py, &self.inner)?.replica_blocks(replica)?;
        let keys: Vec<u8> = blocks.iter().flat_map(|(key, _)| key.to_le_bytes()).collect();
        let copies: Vec<u8> = blocks.iter().flat_map(|(_, c)| c.to_le_bytes()).collect();
        Ok((PyBytes::new(py, &keys), PyBytes::new(py, &copies)))
    }

    /// Gives `replica` (registered, holding nothing) the blocks `replica_blocks` gave;
    /// returns how many. A ValueError, changing nothing, for malformed input.
    fn restore_replica(
        &self,
        py: Python<'_>,
        replica: usize,
        keys: &[u8],
        copies: &[u8],
    ) -> GlueResult<u64> {
        if keys.len() % 8 != 0 || copies.len() % 4 != 0 || keys.len() / 8 != copies.len() / 4 {
            return Err(PyValueError::new_err(format!(
                "keys and copies must be 8 and 4 bytes per block, got {} and {} bytes",
                keys.len(),
                copies.len()
            ))
            .into());
        }
        let blocks: Vec<(u64, u32)> = keys
            .chunks_exact(8)
            .zip(copies.chunks_exact(4))
            .map(|(k, c)| {
                let key = u64::from_le_bytes(k.try_into().unwrap_or([0; 8]));
                (key, u32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
            })
            .collect();
        Ok(lock_attached(py, &self.inner)?.restore_replica(replica, &blocks)?)
    }

    fn held(&self, py: Python<'_>, replica: usize) -> GlueResult<u64> {
        Ok(lock_attached(py, &self.inner)?.held(replica))
    }

    #[getter]
    fn replicas(&self, py: Python<'_>) -> GlueResult<Vec<usize>> {
        let mut live = lock_attached(py, &self.inner)?.replicas();
        let mut ids = Vec::new();
        while live != 0 {
            ids.push(live.trailing_zeros() as usize);
            live &= live - 1;
        }
        Ok(ids)
    }

    #[getter]
    fn num_keys(&self, py: Python<'_>) -> GlueResult<usize> {
        Ok(lock_attached(py, &self.inner)?.num_keys())
    }

    /// (replica, block) pairs held in more than one copy.
    #[getter]
    fn num_copied(&self, py: Python<'_>) -> GlueResult<usize> {
        Ok(lock_attached(py, &self.inner)?.num_copied())
    }

    /// Makes room for `keys` distinct keys, so that the table does not grow until it holds more.
    fn reserve(&self, py: Python<'_>, keys: usize) -> GlueResult<()> {
        lock_attached(py, &self.inner)?.reserve(keys);
        Ok(())
    }

    #[getter]
    fn table_bytes(&self, py: Python<'_>) -> GlueResult<usize> {
        Ok(lock_attached(py, &self.inner)?.table_bytes())
    }

    /// What the index applied and refused: `stored`, `removed`, `repeated_stores`,
    /// `repeated_removals` (copies of a block beyond the first), `unknown_removals`,
    /// `cleared`.
    fn counts<'py>(&self, py: Python<'py>) -> GlueResult<Bound<'py, PyDict>> {
        let c = lock_attached(py, &self.inner)?.counts();
        let out = PyDict::new(py);
        out.set_item("stored", c.stored)?;
        out.set_item("removed", c.removed)?;
        out.set_item("repeated_stores", c.repeated_stores)?;
        out.set_item("repeated_removals", c.repeated_removals)?;
        out.set_item("unknown_removals", c.unknown_removals)?;
        out.set_item("cleared", c.cleared)?;
        Ok(out)
    }
}
