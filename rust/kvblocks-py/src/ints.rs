//! Integer-array arguments of the batched API (request handles, token counts, offsets):
//! an int64 array is read in place; other integer arrays and sequences are copied, checked.

use crate::args::int_arg;
use numpy::prelude::*;
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

pub enum I64s<'py> {
    Borrowed(PyReadonlyArray1<'py, i64>),
    Owned(Vec<i64>),
}

impl I64s<'_> {
    pub fn as_slice(&self) -> &[i64] {
        match self {
            Self::Borrowed(a) => a.as_slice().unwrap_or_default(),
            Self::Owned(v) => v,
        }
    }
}

pub fn extract_i64s<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<I64s<'py>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(PyValueError::new_err(format!("{what} must be 1-D")));
        }
        if !matches!(array.dtype().kind(), b'i' | b'u') {
            return Err(PyTypeError::new_err(format!("{what} must have an integer dtype")));
        }
        if let Ok(a) = array.cast::<PyArray1<i64>>() {
            let ro = a.readonly();
            if ro.as_slice().is_ok() {
                return Ok(I64s::Borrowed(ro));
            }
        }
        // Other integer dtypes: Python ints, then the same checks as a list.
        return extract_i64s(&array.call_method0("tolist")?, what);
    }
    let mut out = Vec::new();
    for item in obj.try_iter()? {
        out.push(int_arg(&item?, what)?);
    }
    Ok(I64s::Owned(out))
}
