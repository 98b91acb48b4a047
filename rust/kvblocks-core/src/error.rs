//! The core's one error type. The glue crate maps each variant to a Python exception in a
//! single place, so every variant here is part of the public contract.

use std::fmt;

/// Every way a core operation can refuse its input. A refused call changes no state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// The hash algorithm name is not one of `known` ([`crate::HASH_ALGORITHMS`]).
    UnknownHashAlgorithm { name: String, known: &'static [&'static str] },
    /// A size argument (block size, ...) is out of its valid range.
    InvalidSize { what: &'static str, value: usize },
    /// A multimodal feature list is malformed (unsorted, zero length, ...).
    InvalidMmFeature(String),
    /// A prefix length exceeds the tokens that exist.
    OutOfRange { what: &'static str, value: usize, limit: usize },
    /// The operating system could not provide randomness for a secret seed.
    Randomness(String),
    /// No request has this id.
    UnknownRequest(String),
    /// No live request has this handle (never issued, or its request was removed).
    UnknownHandle(i64),
    /// A request with this id already exists.
    DuplicateRequest(String),
    /// An argument is inconsistent with the manager's state (the message says how).
    InvalidArgument(String),
    /// A requested size could not be allocated.
    OutOfMemory { what: &'static str, bytes: usize },
    /// An invariant of the core does not hold: a bug in kvblocks, never a bad argument.
    Internal(&'static str),
    /// A block table an allocation left does not cover its request's tokens, or holds a
    /// block no request references (`kv_cache::invariant`): a bug in kvblocks, caught
    /// before the table is used. The message names the group (and the request, once the
    /// caller that knows it added it with [`CoreError::for_request`]).
    Unsound(String),
}

impl CoreError {
    /// Names the request an [`CoreError::Unsound`] table belongs to.
    pub fn for_request(self, request_id: &str) -> Self {
        match self {
            Self::Unsound(what) => Self::Unsound(format!("request {request_id:?}, {what}")),
            other => other,
        }
    }
}

pub type CoreResult<T> = Result<T, CoreError>;

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownHashAlgorithm { name, known } => {
                write!(f, "unknown hash algorithm {name:?}; expected one of {}", known.join(", "))
            }
            Self::InvalidSize { what, value } => write!(f, "invalid {what}: {value}"),
            Self::InvalidMmFeature(msg) => write!(f, "invalid mm_features: {msg}"),
            Self::OutOfRange { what, value, limit } => {
                write!(f, "{what} {value} is out of range (at most {limit})")
            }
            Self::Randomness(msg) => write!(f, "cannot draw a random seed: {msg}"),
            Self::UnknownRequest(id) => write!(f, "unknown request id {id:?}"),
            Self::UnknownHandle(handle) => write!(f, "unknown request handle {handle}"),
            Self::DuplicateRequest(id) => write!(f, "request id {id:?} already exists"),
            Self::InvalidArgument(msg) => f.write_str(msg),
            Self::OutOfMemory { what, bytes } => {
                write!(f, "cannot allocate {bytes} bytes for {what}")
            }
            Self::Internal(what) => write!(f, "internal error in kvblocks (please report): {what}"),
            Self::Unsound(what) => write!(
                f,
                "internal error in kvblocks (please report): a block table is unsound: {what}"
            ),
        }
    }
}

impl std::error::Error for CoreError {}

/// `n` copies of `value`, or `OutOfMemory` instead of aborting the process when the
/// allocation fails (sizes come from user arguments).
pub(crate) fn try_filled<T: Clone>(n: usize, value: T, what: &'static str) -> CoreResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| CoreError::OutOfMemory { what, bytes: n.saturating_mul(size_of::<T>()) })?;
    v.resize(n, value);
    Ok(v)
}
