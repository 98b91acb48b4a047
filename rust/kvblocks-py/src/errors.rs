//! The one place where core errors become Python exceptions.

use kvblocks_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyMemoryError, PyValueError};
use pyo3::PyErr;

create_exception!(
    kvblocks,
    KvBlocksError,
    PyException,
    "Base class of the errors kvblocks raises that are not plain ValueError/TypeError/KeyError."
);

/// Bad arguments are `ValueError`s (users expect them there); failures of the environment
/// are `KvBlocksError`.
pub fn to_py(err: CoreError) -> PyErr {
    match err {
        CoreError::UnknownHashAlgorithm(_)
        | CoreError::InvalidSize { .. }
        | CoreError::InvalidMmFeature(_)
        | CoreError::OutOfRange { .. }
        | CoreError::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        CoreError::UnknownRequest(_) | CoreError::DuplicateRequest(_) => {
            PyKeyError::new_err(err.to_string())
        }
        CoreError::Randomness(_) => KvBlocksError::new_err(err.to_string()),
        CoreError::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
    }
}

/// A poisoned lock means an earlier call panicked half-way; refuse to touch that state.
pub fn poisoned() -> PyErr {
    KvBlocksError::new_err("internal state is unusable after an earlier internal error")
}
