//! Scalar arguments: ints that must not be bools and must fit 64 bits, sizes that must be
//! positive. Out-of-range values are `ValueError`, wrong types `TypeError`.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

pub fn int_arg(item: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    let type_error = || -> PyResult<PyErr> {
        Ok(PyTypeError::new_err(format!("{what} must be an int, got {}", item.get_type().name()?)))
    };
    if item.is_instance_of::<PyBool>() {
        return Err(type_error()?);
    }
    match item.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => {
            Err(PyValueError::new_err(format!("{what} {item} is out of range")))
        }
        Err(_) => Err(type_error()?),
    }
}

/// A count that must be `>= minimum`.
pub fn size_arg(item: &Bound<'_, PyAny>, what: &str, minimum: usize) -> PyResult<usize> {
    let value = int_arg(item, what)?;
    usize::try_from(value)
        .ok()
        .filter(|v| *v >= minimum)
        .ok_or_else(|| PyValueError::new_err(format!("{what} must be >= {minimum}, got {value}")))
}

pub fn str_arg(item: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    if !item.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a str, got {}",
            item.get_type().name()?
        )));
    }
    item.extract()
}
