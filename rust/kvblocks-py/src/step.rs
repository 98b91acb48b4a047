//! The batched step's arguments and output arrays: converted and checked once here, in the
//! core's types, so that the core never sees a negative count or a non-bool mask.

use crate::args::{int_arg, size_arg};
use crate::errors::GlueResult;
use crate::ints::extract_i64s;
use kvblocks_core::{StepOutput, StepResult, StepSizes};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadwriteArray1, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PySlice, PyType};
use pyo3::{intern, PyErr};

static SCHEDULED_STEP: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// Read-only empty results, shared by the steps that copy, evict or preempt nothing.
static NO_PAIRS: PyOnceLock<Py<PyArray2<i32>>> = PyOnceLock::new();
static NO_IDS: PyOnceLock<Py<PyArray1<i32>>> = PyOnceLock::new();

/// Marks a numpy array read-only (results shared between calls, or views of state).
pub fn read_only<T>(array: Bound<'_, T>) -> PyResult<Bound<'_, T>> {
    let kwargs = pyo3::types::PyDict::new(array.py());
    kwargs.set_item("write", false)?;
    array.as_any().call_method("setflags", (), Some(&kwargs))?;
    Ok(array)
}

/// `ids` as an int32 array (the shared read-only empty one when there are none).
fn ids_array<'py>(py: Python<'py>, ids: Vec<i32>) -> PyResult<Bound<'py, PyAny>> {
    if !ids.is_empty() {
        return Ok(PyArray1::from_vec(py, ids).into_any());
    }
    let empty = NO_IDS.get_or_try_init(py, || {
        read_only(PyArray1::<i32>::zeros(py, 0, false)).map(Bound::unbind)
    })?;
    Ok(empty.bind(py).clone().into_any())
}

/// `(src, dst)` pairs as a `(K, 2)` int32 array (shared and read-only when empty).
pub fn pairs_array<'py>(py: Python<'py>, pairs: &[[u32; 2]]) -> PyResult<Bound<'py, PyAny>> {
    if !pairs.is_empty() {
        let flat: Vec<i32> = pairs.iter().flatten().map(|&b| b as i32).collect();
        return Ok(PyArray1::from_vec(py, flat).reshape([pairs.len(), 2])?.into_any());
    }
    let empty = NO_PAIRS.get_or_try_init(py, || {
        read_only(PyArray2::<i32>::zeros(py, [0, 2], false)).map(Bound::unbind)
    })?;
    Ok(empty.bind(py).clone().into_any())
}

/// Counts or offsets: integers `>= 0`.
pub fn sizes_arg(obj: &Bound<'_, PyAny>, what: &str) -> GlueResult<Vec<usize>> {
    let values = extract_i64s(obj, what)?;
    let sizes = values.as_slice().iter().map(|&v| {
        usize::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("{what} must be >= 0, got {v}")).into())
    });
    sizes.collect()
}

/// A mask: bools (a bool array, or a sequence of bools or 0/1 ints, as numpy reads them).
pub fn mask_arg(obj: &Bound<'_, PyAny>, what: &str) -> GlueResult<Vec<bool>> {
    if let Ok(array) = obj.cast::<PyArray1<bool>>() {
        return Ok(array.to_vec().map_err(|e| PyValueError::new_err(e.to_string()))?);
    }
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        let item = item?;
        // bool and numpy.bool_ extract as bools; ints must be 0 or 1.
        let flag = match item.extract::<bool>() {
            Ok(flag) => flag,
            Err(_) => match int_arg(&item, what)? {
                0 => false,
                1 => true,
                v => {
                    let msg = format!("{what} entries must be bools or 0/1, got {v}");
                    return Err(PyValueError::new_err(msg).into());
                }
            },
        };
        out.push(flag);
    }
    Ok(out)
}

/// One sampled token per row of the previous step; `-1` for none.
pub fn sampled_arg(obj: &Bound<'_, PyAny>) -> GlueResult<Vec<Option<u32>>> {
    let values = extract_i64s(obj, "sampled_token_ids")?;
    let tokens = values.as_slice().iter().map(|&v| match v {
        -1 => Ok(None),
        _ => u32::try_from(v).map(Some).map_err(|_| {
            PyValueError::new_err(format!(
                "sampled_token_ids entries must be token ids (0 <= id < 2**32) or -1, got {v}"
            ))
            .into()
        }),
    });
    tokens.collect()
}

/// An optional count, 0 when absent.
pub fn optional_size(obj: Option<&Bound<'_, PyAny>>, what: &str) -> GlueResult<usize> {
    match obj.filter(|v| !v.is_none()) {
        Some(v) => Ok(size_arg(v, what, 0)?),
        None => Ok(0),
    }
}

/// The output arrays of one step: the caller's `StepBuffers`, or fresh ones of the planned
/// sizes.
pub struct StepArrays<'py> {
    block_table: Bound<'py, PyArray2<i32>>,
    slot_mapping: Bound<'py, PyArray1<i32>>,
    seq_lens: Bound<'py, PyArray1<i32>>,
    query_start_loc: Bound<'py, PyArray1<i32>>,
    input_ids: Bound<'py, PyArray1<i64>>,
    positions: Bound<'py, PyArray1<i64>>,
    req_indices: Bound<'py, PyArray1<i32>>,
    num_new_tokens: Bound<'py, PyArray1<i32>>,
    num_new_computed_tokens: Bound<'py, PyArray1<i32>>,
}

fn field<'py, T: numpy::Element>(
    buffers: &Bound<'py, PyAny>,
    name: &Bound<'py, pyo3::types::PyString>,
    dtype: &str,
) -> GlueResult<Bound<'py, PyArray1<T>>> {
    let array = buffers.getattr(name)?;
    Ok(array.cast_into::<PyArray1<T>>().map_err(|_| {
        PyTypeError::new_err(format!("out.{name} must be a 1-D {dtype} numpy array"))
    })?)
}

impl<'py> StepArrays<'py> {
    pub fn from_buffers(buffers: &Bound<'py, PyAny>) -> GlueResult<Self> {
        let py = buffers.py();
        let table = buffers.getattr(intern!(py, "block_table"))?;
        let block_table = table
            .cast_into::<PyArray2<i32>>()
            .map_err(|_| PyTypeError::new_err("out.block_table must be a 2-D int32 numpy array"))?;
        Ok(Self {
            block_table,
            slot_mapping: field(buffers, intern!(py, "slot_mapping"), "int32")?,
            seq_lens: field(buffers, intern!(py, "seq_lens"), "int32")?,
            query_start_loc: field(buffers, intern!(py, "query_start_loc"), "int32")?,
            input_ids: field(buffers, intern!(py, "input_ids"), "int64")?,
            positions: field(buffers, intern!(py, "positions"), "int64")?,
            req_indices: field(buffers, intern!(py, "req_indices"), "int32")?,
            num_new_tokens: field(buffers, intern!(py, "num_new_tokens"), "int32")?,
            num_new_computed_tokens: field(
                buffers,
                intern!(py, "num_new_computed_tokens"),
                "int32",
            )?,
        })
    }

    pub fn allocate(py: Python<'py>, sizes: StepSizes) -> Self {
        let (rows, tokens) = (sizes.num_reqs, sizes.max_tokens);
        Self {
            block_table: PyArray2::zeros(py, [rows, sizes.max_blocks], false),
            slot_mapping: PyArray1::zeros(py, tokens, false),
            seq_lens: PyArray1::zeros(py, rows, false),
            query_start_loc: PyArray1::zeros(py, rows + 1, false),
            input_ids: PyArray1::zeros(py, tokens, false),
            positions: PyArray1::zeros(py, tokens, false),
            req_indices: PyArray1::zeros(py, rows, false),
            num_new_tokens: PyArray1::zeros(py, rows, false),
            num_new_computed_tokens: PyArray1::zeros(py, rows, false),
        }
    }

    /// Writable views of every array (refused for read-only or already borrowed arrays).
    pub fn borrow(&self) -> GlueResult<StepViews<'py>> {
        let rw = |e: numpy::BorrowError| PyValueError::new_err(format!("output buffers: {e}"));
        let one = |a: &Bound<'py, PyArray1<i32>>| a.try_readwrite().map_err(rw);
        Ok(StepViews {
            width: self.block_table.shape().get(1).copied().unwrap_or(0),
            block_table: self.block_table.try_readwrite().map_err(rw)?,
            slot_mapping: one(&self.slot_mapping)?,
            seq_lens: one(&self.seq_lens)?,
            query_start_loc: one(&self.query_start_loc)?,
            input_ids: self.input_ids.try_readwrite().map_err(rw)?,
            positions: self.positions.try_readwrite().map_err(rw)?,
            req_indices: one(&self.req_indices)?,
            num_new_tokens: one(&self.num_new_tokens)?,
            num_new_computed_tokens: one(&self.num_new_computed_tokens)?,
        })
    }

    /// `kvblocks.step.ScheduledStep` over views of the arrays, cut to what the step wrote.
    pub fn scheduled_step(
        &self,
        py: Python<'py>,
        result: &StepResult,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (rows, tokens) = (result.num_scheduled, result.num_scheduled_tokens);
        let cut = |a: &Bound<'py, PyAny>, n: usize| a.get_item(PySlice::new(py, 0, n as isize, 1));
        let evicted: Vec<i32> = result.evicted_blocks.iter().map(|&b| b as i32).collect();
        let preempted: Vec<i32> = result.preempted.iter().map(|&i| i as i32).collect();
        let fields = [
            rows.into_pyobject(py)?.into_any(),
            tokens.into_pyobject(py)?.into_any(),
            cut(self.block_table.as_any(), rows)?,
            cut(self.slot_mapping.as_any(), tokens)?,
            cut(self.seq_lens.as_any(), rows)?,
            cut(self.query_start_loc.as_any(), rows + 1)?,
            pairs_array(py, &result.block_copies)?,
            ids_array(py, evicted)?,
            cut(self.input_ids.as_any(), tokens)?,
            cut(self.positions.as_any(), tokens)?,
            cut(self.req_indices.as_any(), rows)?,
            cut(self.num_new_tokens.as_any(), rows)?,
            cut(self.num_new_computed_tokens.as_any(), rows)?,
            ids_array(py, preempted)?,
        ];
        let cls = SCHEDULED_STEP.import(py, "kvblocks.step", "ScheduledStep")?;
        cls.call1(pyo3::types::PyTuple::new(py, fields)?)
    }
}

/// The arrays of a step borrowed for writing.
pub struct StepViews<'py> {
    width: usize,
    block_table: PyReadwriteArray2<'py, i32>,
    slot_mapping: PyReadwriteArray1<'py, i32>,
    seq_lens: PyReadwriteArray1<'py, i32>,
    query_start_loc: PyReadwriteArray1<'py, i32>,
    input_ids: PyReadwriteArray1<'py, i64>,
    positions: PyReadwriteArray1<'py, i64>,
    req_indices: PyReadwriteArray1<'py, i32>,
    num_new_tokens: PyReadwriteArray1<'py, i32>,
    num_new_computed_tokens: PyReadwriteArray1<'py, i32>,
}

fn not_contiguous(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("output buffers must be C-contiguous: {e}"))
}

impl StepViews<'_> {
    pub fn output(&mut self) -> GlueResult<StepOutput<'_>> {
        Ok(StepOutput {
            width: self.width,
            block_table: self.block_table.as_slice_mut().map_err(not_contiguous)?,
            slot_mapping: self.slot_mapping.as_slice_mut().map_err(not_contiguous)?,
            seq_lens: self.seq_lens.as_slice_mut().map_err(not_contiguous)?,
            query_start_loc: self.query_start_loc.as_slice_mut().map_err(not_contiguous)?,
            input_ids: self.input_ids.as_slice_mut().map_err(not_contiguous)?,
            positions: self.positions.as_slice_mut().map_err(not_contiguous)?,
            req_indices: self.req_indices.as_slice_mut().map_err(not_contiguous)?,
            num_new_tokens: self.num_new_tokens.as_slice_mut().map_err(not_contiguous)?,
            num_new_computed_tokens: self
                .num_new_computed_tokens
                .as_slice_mut()
                .map_err(not_contiguous)?,
        })
    }
}
