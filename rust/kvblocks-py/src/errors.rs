//! The one place where core errors become Python exceptions, and the glue's one result type:
//! a `#[pymethods]` function returns [`GlueResult`] and uses `?` on core and Python results
//! alike.

use kvblocks_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

create_exception!(
    kvblocks,
    KvBlocksError,
    PyException,
    "Base class of the errors kvblocks raises that are not plain ValueError/TypeError/KeyError."
);

/// Bad arguments are `ValueError`s (users expect them there); failures of the environment
/// and broken invariants are `KvBlocksError`.
pub fn to_py(err: CoreError) -> PyErr {
    match err {
        CoreError::UnknownHashAlgorithm { .. }
        | CoreError::InvalidSize { .. }
        | CoreError::InvalidMmFeature(_)
        | CoreError::OutOfRange { .. }
        | CoreError::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        CoreError::UnknownRequest(id) => {
            PyKeyError::new_err(format!("unknown request id {}", py_repr(&id)))
        }
        CoreError::DuplicateRequest(id) => {
            PyKeyError::new_err(format!("request id {} already exists", py_repr(&id)))
        }
        CoreError::UnknownHandle(_) => PyKeyError::new_err(err.to_string()),
        CoreError::Randomness(_) | CoreError::Internal(_) | CoreError::Unsound(_) => {
            KvBlocksError::new_err(err.to_string())
        }
        CoreError::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
    }
}

/// `repr(id)` as Python writes it (the reference's messages quote ids with `!r`); Rust's `{:?}`
/// quotes and escapes differently.
fn py_repr(id: &str) -> String {
    Python::attach(|py| PyString::new(py, id).repr().map(|r| r.to_string()))
        .unwrap_or_else(|_| format!("{id:?}"))
}

/// A core error or a Python one; becomes a Python exception at the boundary.
pub enum GlueError {
    Core(CoreError),
    Py(PyErr),
}

pub type GlueResult<T> = Result<T, GlueError>;

impl From<CoreError> for GlueError {
    fn from(err: CoreError) -> Self {
        Self::Core(err)
    }
}

impl From<PyErr> for GlueError {
    fn from(err: PyErr) -> Self {
        Self::Py(err)
    }
}

impl From<GlueError> for PyErr {
    fn from(err: GlueError) -> Self {
        match err {
            GlueError::Core(err) => to_py(err),
            GlueError::Py(err) => err,
        }
    }
}

/// A poisoned lock means an earlier call panicked half-way; refuse to touch that state.
pub fn poisoned() -> PyErr {
    KvBlocksError::new_err("internal state is unusable after an earlier internal error")
}
