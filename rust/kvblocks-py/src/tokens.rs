//! Token-id arguments: numpy arrays (read in place when the dtype allows), lists, tuples,
//! `range`, `array.array` and other iterables of ints, all checked to lie in `[0, 2**32)`.

use numpy::prelude::*;
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArray};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString, PyTuple, PyType,
};

/// Token ids either borrowed from a numpy array or copied into a vector.
pub enum TokenIds<'py> {
    U32(PyReadonlyArray1<'py, u32>),
    /// An int32 array already checked to hold no negative value.
    I32(PyReadonlyArray1<'py, i32>),
    Owned(Vec<u32>),
}

impl TokenIds<'_> {
    pub fn as_slice(&self) -> &[u32] {
        match self {
            Self::U32(a) => a.as_slice().unwrap_or_default(),
            Self::I32(a) => {
                let s = a.as_slice().unwrap_or_default();
                // SAFETY: i32 and u32 have the same size and alignment, and every value was
                // checked to be non-negative, so each reads back as the same number.
                unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u32>(), s.len()) }
            }
            Self::Owned(v) => v,
        }
    }
}

fn out_of_range(index: usize, value: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("token id {value} at index {index} is out of range [0, 2**32)"))
}

fn check_range(index: usize, value: i128) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| out_of_range(index, value))
}

/// The value of an exact `int` that fits 64 bits, read without the generic conversion
/// machinery (this runs once per token of every list argument).
fn exact_int(item: &Bound<'_, PyAny>) -> Option<i64> {
    if !item.is_exact_instance_of::<PyInt>() {
        return None;
    }
    let mut overflow: std::ffi::c_int = 0;
    // SAFETY: `item` is a live `int` object for the duration of the call; for an exact int
    // this function reports out-of-range values through `overflow` and raises nothing.
    let value = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(item.as_ptr(), &mut overflow) };
    (overflow == 0).then_some(value)
}

pub(crate) type GetItem = unsafe extern "C" fn(
    *mut pyo3::ffi::PyObject,
    pyo3::ffi::Py_ssize_t,
) -> *mut pyo3::ffi::PyObject;

/// The fast path for the common argument, a list or tuple of exact `int`s: one pass of
/// borrowed reads, no reference counting (twice as fast as pyo3's checked iterator), each item
/// read by `read` (given a live exact int; `None` for a value it does not take, with no Python
/// error left set). `None` sends any other content to the caller's checked path, which reports
/// the first bad element.
pub(crate) fn exact_ints<T, U>(
    seq: &Bound<'_, T>,
    get_item: GetItem,
    start: usize,
    read: impl Fn(*mut pyo3::ffi::PyObject) -> Option<U>,
) -> Option<Vec<U>> {
    if cfg!(Py_GIL_DISABLED) {
        return None; // borrowed reads are not safe against other threads there
    }
    let len = seq.as_any().len().ok()?;
    let mut out = Vec::with_capacity(len.saturating_sub(start));
    for index in start..len {
        // SAFETY: `seq` is a list or tuple matching `get_item` and `index < len`. The GIL is
        // held (free-threaded builds returned above) and this loop runs no Python code, so no
        // other thread can resize the sequence or free the borrowed item before it is read.
        let item = unsafe { get_item(seq.as_ptr(), index as pyo3::ffi::Py_ssize_t) };
        if item.is_null() {
            // SAFETY: an index error was set; clear it and let the checked path decide.
            unsafe { pyo3::ffi::PyErr_Clear() };
            return None;
        }
        // SAFETY: `item` is a live object borrowed from the list.
        if unsafe { pyo3::ffi::PyLong_CheckExact(item) } == 0 {
            return None;
        }
        out.push(read(item)?);
    }
    Some(out)
}

/// A token id from a live exact int (for [`exact_ints`]): in `[0, 2**32)`, else `None`.
fn token_of_exact_int(item: *mut pyo3::ffi::PyObject) -> Option<u32> {
    let mut overflow: std::ffi::c_int = 0;
    // SAFETY: `item` is a live exact int; overflow is reported through `overflow`.
    let value = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow) };
    u32::try_from(value).ok().filter(|_| overflow == 0)
}

fn token_from_item(index: usize, item: &Bound<'_, PyAny>) -> PyResult<u32> {
    if let Some(value) = exact_int(item) {
        return check_range(index, i128::from(value));
    }
    if item.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "token ids must be integers, got bool at index {index}"
        )));
    }
    match item.extract::<i64>() {
        Ok(v) => check_range(index, i128::from(v)),
        Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => Err(out_of_range(index, item)),
        Err(_) => Err(PyTypeError::new_err(format!(
            "token ids must be integers, got {} at index {index}",
            item.get_type().name()?
        ))),
    }
}

fn from_iter<'py>(
    items: impl Iterator<Item = PyResult<Bound<'py, PyAny>>>,
    hint: usize,
    start: usize,
) -> PyResult<TokenIds<'py>> {
    let mut out = Vec::with_capacity(hint);
    for (index, item) in items.enumerate() {
        out.push(token_from_item(start + index, &item?)?);
    }
    Ok(TokenIds::Owned(out))
}

fn copy_checked<T>(array: &Bound<'_, PyUntypedArray>) -> PyResult<Option<Vec<u32>>>
where
    T: numpy::Element + Copy + Into<i128>,
{
    let Ok(typed) = array.cast::<PyArray1<T>>() else {
        return Ok(None);
    };
    let view = typed.readonly();
    let view = view.as_array();
    let mut out = Vec::with_capacity(view.len());
    for (index, &v) in view.iter().enumerate() {
        out.push(check_range(index, v.into())?);
    }
    Ok(Some(out))
}

fn first_negative(values: &[i32]) -> Option<(usize, i32)> {
    values.iter().copied().enumerate().find(|&(_, v)| v < 0)
}

fn from_ndarray<'py>(array: &Bound<'py, PyUntypedArray>) -> PyResult<TokenIds<'py>> {
    if array.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "token ids must be a 1-D array, got a {}-D array",
            array.ndim()
        )));
    }
    let dtype = array.dtype();
    if !matches!(dtype.kind(), b'i' | b'u') {
        return Err(PyTypeError::new_err(format!(
            "token ids must have an integer dtype, got {}",
            dtype.str()?
        )));
    }
    if let Ok(a) = array.cast::<PyArray1<u32>>() {
        let ro = a.readonly();
        if ro.as_slice().is_ok() {
            return Ok(TokenIds::U32(ro));
        }
    }
    if let Ok(a) = array.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        if let Ok(values) = ro.as_slice() {
            if let Some((index, v)) = first_negative(values) {
                return Err(out_of_range(index, v));
            }
            return Ok(TokenIds::I32(ro));
        }
    }
    for copy in COPIERS {
        if let Some(values) = copy(array)? {
            return Ok(TokenIds::Owned(values));
        }
    }
    // A non-native byte order: let numpy convert it to a native 64-bit type first.
    let native = if dtype.kind() == b'u' { "uint64" } else { "int64" };
    let converted = array.call_method1("astype", (native,))?;
    from_ndarray(converted.cast::<PyUntypedArray>()?)
}

type Copier = fn(&Bound<'_, PyUntypedArray>) -> PyResult<Option<Vec<u32>>>;

/// Every native integer dtype, read element by element with a range check.
const COPIERS: [Copier; 8] = [
    copy_checked::<u32>,
    copy_checked::<i32>,
    copy_checked::<i64>,
    copy_checked::<u64>,
    copy_checked::<i16>,
    copy_checked::<u16>,
    copy_checked::<i8>,
    copy_checked::<u8>,
];

/// Converts a token-id argument (see the module doc).
pub fn extract_token_ids<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenIds<'py>> {
    extract_token_ids_from(obj, 0).map(|(ids, _)| ids)
}

/// A list or tuple of `len` items read from `start` on: the borrowed fast path, else the
/// checked path that reports the first bad element by its absolute index.
fn from_sequence<'py, T>(
    seq: &Bound<'py, T>,
    get_item: GetItem,
    len: usize,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    start: usize,
) -> PyResult<TokenIds<'py>> {
    if let Some(values) = exact_ints(seq, get_item, start, token_of_exact_int) {
        return Ok(TokenIds::Owned(values));
    }
    from_iter(items.skip(start).map(Ok), len - start, start)
}

/// The token ids of `obj` from position `start` on, as ids and the index in
/// [`TokenIds::as_slice`] where position `start` lies. A list or tuple is read from `start`
/// only, so continuing a long sequence converts just its new tokens; other inputs are
/// converted (or borrowed) whole. `start` past the end is a `ValueError`.
pub fn extract_token_ids_from<'py>(
    obj: &Bound<'py, PyAny>,
    start: usize,
) -> PyResult<(TokenIds<'py>, usize)> {
    let check_start = |len: usize| {
        if start > len {
            Err(PyValueError::new_err(format!(
                "start position {start} is past the end ({len} tokens)"
            )))
        } else {
            Ok(())
        }
    };
    if let Ok(list) = obj.cast::<PyList>() {
        check_start(list.len())?;
        let ids = from_sequence(list, pyo3::ffi::PyList_GetItem, list.len(), list.iter(), start)?;
        return Ok((ids, 0));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        check_start(tuple.len())?;
        let get_item = pyo3::ffi::PyTuple_GetItem;
        let ids = from_sequence(tuple, get_item, tuple.len(), tuple.iter(), start)?;
        return Ok((ids, 0));
    }
    if let Some(ids) = int32_buffer_from(obj, start, check_start)? {
        return Ok((ids, 0));
    }
    let ids = extract_other(obj)?;
    check_start(ids.as_slice().len())?;
    Ok((ids, start))
}

/// An `array.array('i')` (vLLM 0.34's `TokenBuffer` of a request's tokens is one) or another
/// one-dimensional buffer of C ints, read from `start` on only: continuing a long request
/// converts just its new tokens, as for a list. The buffer is released before this returns
/// (an exported buffer keeps the array from growing). `None` for anything else.
fn int32_buffer_from(
    obj: &Bound<'_, PyAny>,
    start: usize,
    check_start: impl Fn(usize) -> PyResult<()>,
) -> PyResult<Option<TokenIds<'static>>> {
    // numpy arrays are borrowed whole (extract_other); bytes are no token ids.
    if obj.cast::<PyUntypedArray>().is_ok()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Ok(None);
    }
    let Ok(buffer) = PyBuffer::<i32>::get(obj) else { return Ok(None) };
    if buffer.dimensions() != 1 {
        return Ok(None);
    }
    let Some(cells) = buffer.as_slice(obj.py()) else { return Ok(None) };
    check_start(cells.len())?;
    let mut out = Vec::with_capacity(cells.len() - start);
    for (offset, cell) in cells.iter().skip(start).enumerate() {
        let value = cell.get();
        out.push(u32::try_from(value).map_err(|_| out_of_range(start + offset, value))?);
    }
    Ok(Some(TokenIds::Owned(out)))
}

/// Every token-id argument but a list or tuple.
fn extract_other<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenIds<'py>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return from_ndarray(array);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(PyTypeError::new_err(format!(
            "token ids must be a sequence of integers, got {}",
            obj.get_type().name()?
        )));
    }
    if let Ok(view) = PyMemoryView::from(obj) {
        // array.array, memoryview and other buffers: numpy reads the declared item type.
        let array = obj.py().import("numpy")?.call_method1("asarray", (view,))?;
        return from_ndarray(array.cast::<PyUntypedArray>()?);
    }
    match obj.try_iter() {
        Ok(iter) => from_iter(iter, obj.len().unwrap_or(0), 0),
        Err(_) => Err(PyTypeError::new_err(format!(
            "token ids must be a sequence of integers, got {}",
            obj.get_type().name()?
        ))),
    }
}

static NUMPY_INTEGER: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Accepts one token (an int or a numpy integer scalar) or anything [`extract_token_ids`]
/// takes.
pub fn extract_one_or_many<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenIds<'py>> {
    let numpy_integer = NUMPY_INTEGER.import(obj.py(), "numpy", "integer")?;
    if (obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>())
        || obj.is_instance(numpy_integer)?
    {
        return Ok(TokenIds::Owned(vec![token_from_item(0, obj)?]));
    }
    extract_token_ids(obj)
}
