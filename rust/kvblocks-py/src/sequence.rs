//! `kvblocks.TokenSequence`.

use crate::args::size_arg;
use crate::errors::GlueResult;
use crate::hasher::{hash_list, PyBlockHasher};
use crate::keys::request_keys;
use crate::step::read_only;
use crate::sync::{detach_if_large, lock};
use crate::tokens::{extract_one_or_many, extract_token_ids};
use kvblocks_core::TokenSequence;
use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::sync::{Arc, Mutex, MutexGuard};

#[pyclass(frozen, module = "kvblocks._core", name = "TokenSequence")]
pub struct PyTokenSequence {
    inner: Mutex<TokenSequence>,
    /// The same immutable buffer the sequence holds; numpy views borrow it.
    prompt: Arc<[u32]>,
    hasher: Py<PyBlockHasher>,
}

impl PyTokenSequence {
    /// Locks the sequence; a thread that has to wait detaches from the interpreter, so a
    /// holder that released the GIL for long work can always finish.
    fn lock(&self) -> PyResult<MutexGuard<'_, TokenSequence>> {
        lock(&self.inner)
    }
}

#[pymethods]
impl PyTokenSequence {
    #[new]
    #[pyo3(signature = (prompt_token_ids, /, *, hasher, cache_salt = None, lora = None, mm_features = None))]
    fn new(
        py: Python<'_>,
        prompt_token_ids: &Bound<'_, PyAny>,
        hasher: Bound<'_, PyBlockHasher>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora: Option<&Bound<'_, PyAny>>,
        mm_features: Option<&Bound<'_, PyAny>>,
    ) -> GlueResult<Self> {
        let tokens = extract_token_ids(prompt_token_ids)?;
        let keys = request_keys(cache_salt, lora, mm_features)?;
        let core_hasher = hasher.get().inner.clone();
        let tokens = tokens.as_slice();
        let build = || TokenSequence::new(core_hasher, tokens, keys);
        let seq = detach_if_large(py, tokens.len(), build)?;
        Ok(Self { prompt: seq.prompt().clone(), inner: Mutex::new(seq), hasher: hasher.unbind() })
    }

    /// Appends one token id or a sequence of them.
    #[pyo3(signature = (token_ids, /))]
    fn append_token_ids(&self, py: Python<'_>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = extract_one_or_many(token_ids)?;
        let tokens = tokens.as_slice();
        let mut seq = self.lock()?;
        let seq = &mut *seq;
        detach_if_large(py, tokens.len(), || seq.append_token_ids(tokens));
        Ok(())
    }

    #[getter]
    fn hasher(&self, py: Python<'_>) -> Py<PyBlockHasher> {
        self.hasher.clone_ref(py)
    }

    #[getter]
    fn num_tokens(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_tokens())
    }

    fn __len__(&self) -> PyResult<usize> {
        self.num_tokens()
    }

    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.prompt.len()
    }

    #[getter]
    fn num_output_tokens(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_output_tokens())
    }

    #[getter]
    fn last_token_id(&self) -> PyResult<u32> {
        Ok(self.lock()?.last_token_id())
    }

    #[getter]
    fn block_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hash_list(py, self.lock()?.block_hashes())
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.block_hashes().len())
    }

    fn get_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let seq = self.lock()?;
        PyList::new(py, seq.token_ids())
    }

    #[pyo3(signature = (num_tokens, /))]
    fn get_prefix_token_ids<'py>(
        &self,
        py: Python<'py>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> GlueResult<Bound<'py, PyTuple>> {
        let n = size_arg(num_tokens, "num_tokens", 0)?;
        let seq = self.lock()?;
        let (prompt, output) = seq.prefix_token_ids(n)?;
        let prompt = PyTuple::new(py, prompt)?;
        let output = match output {
            Some(out) => PyTuple::new(py, out)?.into_any(),
            None => py.None().into_bound(py),
        };
        Ok(PyTuple::new(py, [prompt.into_any(), output])?)
    }

    /// The prompt as a read-only uint32 array that borrows this object's buffer (no copy).
    #[getter]
    fn prompt_token_ids<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let view = ArrayView1::from(&*slf.get().prompt);
        // SAFETY: the prompt buffer is an `Arc<[u32]>` owned by `slf`, never written or
        // reallocated after construction, and `slf` is the array's base object, so the memory
        // outlives the array. The array is made read-only before it is returned.
        let array = unsafe { PyArray1::borrow_from_array(&view, slf.clone().into_any()) };
        read_only(array)
    }

    /// The output tokens as a read-only uint32 array (a copy: the buffer grows).
    #[getter]
    fn output_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let array = PyArray1::from_slice(py, self.lock()?.output());
        read_only(array)
    }

    fn __repr__(&self) -> PyResult<String> {
        let seq = self.lock()?;
        Ok(format!(
            "TokenSequence(num_prompt_tokens={}, num_output_tokens={}, num_blocks={})",
            seq.num_prompt_tokens(),
            seq.num_output_tokens(),
            seq.block_hashes().len()
        ))
    }
}
