//! Extra-key arguments: vLLM-shaped key tuples for `hash_block`, and the request-level
//! `cache_salt` / `lora` / `mm_features` arguments.

use crate::args::{int_arg, size_arg, str_arg};
use crate::errors::to_py;
use kvblocks_core::{ExtraKey, MmFeature, RequestKeys};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString, PyTuple};

/// One extra key with owned data; [`OwnedKey::as_key`] borrows it for the core.
pub enum OwnedKey {
    Lora(String, String),
    Mm(String, i64),
    CacheSalt(String),
    PromptEmbeds(Vec<u8>),
}

impl OwnedKey {
    pub fn as_key(&self) -> ExtraKey<'_> {
        match self {
            Self::Lora(name, path) => ExtraKey::Lora { name, path },
            Self::Mm(identifier, offset) => ExtraKey::Mm { identifier, offset: *offset },
            Self::CacheSalt(salt) => ExtraKey::CacheSalt(salt),
            Self::PromptEmbeds(digest) => ExtraKey::PromptEmbeds(digest),
        }
    }
}

const KEY_SHAPES: &str = "(\"lora\", name, path), (\"mm\", identifier, offset), \
                          (\"cache_salt\", salt) or (\"prompt_embeds\", digest)";

fn extra_key(key: &Bound<'_, PyAny>) -> PyResult<OwnedKey> {
    let tuple = key.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(format!("each extra key must be a tuple: {KEY_SHAPES}"))
    })?;
    let items: Vec<Bound<'_, PyAny>> = tuple.iter().collect();
    let tag = match items.first() {
        Some(tag) if tag.is_instance_of::<PyString>() => tag.extract::<String>()?,
        _ => {
            return Err(PyValueError::new_err(format!(
                "unknown extra key {key}: expected {KEY_SHAPES}"
            )))
        }
    };
    match (tag.as_str(), items.as_slice()) {
        ("lora", [_, name, path]) => {
            Ok(OwnedKey::Lora(str_arg(name, "lora name")?, str_arg(path, "lora path")?))
        }
        ("mm", [_, identifier, offset]) => {
            Ok(OwnedKey::Mm(str_arg(identifier, "mm identifier")?, int_arg(offset, "mm offset")?))
        }
        ("cache_salt", [_, salt]) => Ok(OwnedKey::CacheSalt(str_arg(salt, "cache salt")?)),
        ("prompt_embeds", [_, digest]) => {
            let digest = digest
                .cast::<PyBytes>()
                .map_err(|_| PyTypeError::new_err("the prompt_embeds digest must be bytes"))?;
            Ok(OwnedKey::PromptEmbeds(digest.as_bytes().to_vec()))
        }
        _ => Err(PyValueError::new_err(format!("unknown extra key {key}: expected {KEY_SHAPES}"))),
    }
}

/// `None` or a tuple of keys (an empty tuple stays distinct from `None`, as in vLLM).
pub fn extract_extra_keys(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<OwnedKey>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let tuple = obj.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(format!("extra_keys must be None or a tuple of keys: {KEY_SHAPES}"))
    })?;
    tuple.iter().map(|k| extra_key(&k)).collect::<PyResult<Vec<_>>>().map(Some)
}

fn lora(obj: &Bound<'_, PyAny>) -> PyResult<(String, String)> {
    let pair = obj
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 2)
        .ok_or_else(|| PyTypeError::new_err("lora must be a (name, path) tuple of two str"))?;
    Ok((str_arg(&pair.get_item(0)?, "lora name")?, str_arg(&pair.get_item(1)?, "lora path")?))
}

fn mm_feature(obj: &Bound<'_, PyAny>) -> PyResult<MmFeature> {
    let triple = obj.cast::<PyTuple>().ok().filter(|t| t.len() == 3).ok_or_else(|| {
        PyTypeError::new_err("each mm feature must be an (identifier, offset, length) tuple")
    })?;
    Ok(MmFeature {
        identifier: str_arg(&triple.get_item(0)?, "mm identifier")?,
        offset: size_arg(&triple.get_item(1)?, "mm offset", 0)?,
        length: size_arg(&triple.get_item(2)?, "mm length", 1)?,
    })
}

/// Builds the request-level keys from the Python arguments.
pub fn request_keys(
    cache_salt: Option<&Bound<'_, PyAny>>,
    lora_arg: Option<&Bound<'_, PyAny>>,
    mm_features: Option<&Bound<'_, PyAny>>,
) -> PyResult<RequestKeys> {
    let cache_salt = match cache_salt.filter(|o| !o.is_none()) {
        Some(salt) => Some(str_arg(salt, "cache_salt")?),
        None => None,
    };
    let lora_arg = lora_arg.filter(|o| !o.is_none()).map(lora).transpose()?;
    let features = match mm_features.filter(|o| !o.is_none()) {
        Some(items) => items.try_iter()?.map(|f| mm_feature(&f?)).collect::<PyResult<Vec<_>>>()?,
        None => Vec::new(),
    };
    RequestKeys::new(lora_arg, cache_salt, features).map_err(to_py)
}
