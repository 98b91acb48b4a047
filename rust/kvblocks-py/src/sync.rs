//! How the glue holds state and the GIL: one lock helper, one rule for releasing the GIL.

use crate::errors::poisoned;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use std::sync::{Mutex, MutexGuard};

/// Work of at least this many items (tokens hashed, block-table entries written) runs with
/// the GIL released; below it, releasing and taking the GIL back costs more than it frees.
pub const DETACH_MIN_WORK: usize = 1024;

/// Locks `state`; a thread that has to wait detaches from the interpreter, so a holder that
/// released the GIL for long work can always finish.
pub fn lock<T>(state: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    Python::attach(|py| lock_attached(py, state))
}

/// [`lock`] for a caller that holds the GIL already (the hot path: no attach bookkeeping).
pub fn lock_attached<'a, T>(py: Python<'_>, state: &'a Mutex<T>) -> PyResult<MutexGuard<'a, T>> {
    state.lock_py_attached(py).map_err(|_| poisoned())
}

/// Runs `work` (of `size` items) without the GIL when it is large enough.
///
/// Slices passed in may borrow numpy arrays in place: as with hashlib reading a buffer
/// without the GIL, a concurrent writer to such an array is the caller's race.
pub fn detach_if_large<T: Send>(py: Python<'_>, size: usize, work: impl Send + FnOnce() -> T) -> T {
    if size >= DETACH_MIN_WORK {
        py.detach(work)
    } else {
        work()
    }
}
