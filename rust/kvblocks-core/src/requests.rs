//! The manager's request table: string ids for convenience, integer handles for the hot path.
//!
//! A handle is `generation << 32 | slot`: slots are reused (most recently freed first), and the
//! generation makes a handle of a removed request unknown rather than someone else's.

use crate::{CoreError, CoreResult};
use std::collections::HashMap;

/// A request named by its id or by the handle `add_request` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestRef<'a> {
    Id(&'a str),
    Handle(i64),
}

impl<'a> From<&'a str> for RequestRef<'a> {
    fn from(id: &'a str) -> Self {
        Self::Id(id)
    }
}

impl From<i64> for RequestRef<'_> {
    fn from(handle: i64) -> Self {
        Self::Handle(handle)
    }
}

impl RequestRef<'_> {
    fn unknown(&self) -> CoreError {
        match self {
            Self::Id(id) => CoreError::UnknownRequest((*id).to_owned()),
            Self::Handle(h) => CoreError::UnknownHandle(*h),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry<T> {
    id: String,
    generation: u32,
    value: Option<T>,
}

const GENERATIONS: u32 = 1 << 31;

#[derive(Debug, Clone)]
pub(crate) struct Slab<T> {
    entries: Vec<Entry<T>>,
    free: Vec<u32>,
    by_id: HashMap<String, u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self { entries: Vec::new(), free: Vec::new(), by_id: HashMap::new() }
    }
}

impl<T> Slab<T> {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn contains_id(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    fn handle_of(&self, slot: usize) -> i64 {
        let generation = self.entries.get(slot).map_or(0, |e| e.generation);
        (i64::from(generation) << 32) | slot as i64
    }

    /// Stores `value` under `id` and returns its handle.
    pub fn insert(&mut self, id: &str, value: T) -> CoreResult<(usize, i64)> {
        if self.by_id.contains_key(id) {
            return Err(CoreError::DuplicateRequest(id.to_owned()));
        }
        let slot = match self.free.pop() {
            Some(slot) => {
                if let Some(entry) = self.entries.get_mut(slot as usize) {
                    entry.generation = (entry.generation + 1) % GENERATIONS;
                    entry.id = id.to_owned();
                    entry.value = Some(value);
                }
                slot
            }
            None => {
                let slot = u32::try_from(self.entries.len())
                    .map_err(|_| CoreError::InvalidArgument("too many requests".to_owned()))?;
                self.entries.push(Entry { id: id.to_owned(), generation: 0, value: Some(value) });
                slot
            }
        };
        self.by_id.insert(id.to_owned(), slot);
        Ok((slot as usize, self.handle_of(slot as usize)))
    }

    /// The slot of a live request.
    pub fn slot(&self, request: RequestRef<'_>) -> CoreResult<usize> {
        let slot = match request {
            RequestRef::Id(id) => self.by_id.get(id).map(|&s| s as usize),
            RequestRef::Handle(h) => {
                let slot = (h & 0xffff_ffff) as usize;
                let live = h >= 0 && self.handle_of(slot) == h && self.get(slot).is_some();
                live.then_some(slot)
            }
        };
        slot.ok_or_else(|| request.unknown())
    }

    pub fn handle(&self, slot: usize) -> i64 {
        self.handle_of(slot)
    }

    pub fn get(&self, slot: usize) -> Option<&T> {
        self.entries.get(slot).and_then(|e| e.value.as_ref())
    }

    pub fn get_mut(&mut self, slot: usize) -> Option<&mut T> {
        self.entries.get_mut(slot).and_then(|e| e.value.as_mut())
    }

    pub fn remove(&mut self, slot: usize) -> Option<T> {
        let entry = self.entries.get_mut(slot)?;
        let value = entry.value.take()?;
        self.by_id.remove(&entry.id);
        self.free.push(slot as u32);
        Some(value)
    }

    /// `(id, handle, value)` of every live request, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, i64, &T)> {
        self.entries.iter().enumerate().filter_map(|(slot, e)| {
            let handle = (i64::from(e.generation) << 32) | slot as i64;
            e.value.as_ref().map(|v| (e.id.as_str(), handle, v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_not_reused_for_new_requests() {
        let mut slab = Slab::default();
        let (_, a) = slab.insert("a", 1).unwrap();
        let (_, b) = slab.insert("b", 2).unwrap();
        assert_eq!((a, b), (0, 1));
        assert!(matches!(slab.insert("a", 3), Err(CoreError::DuplicateRequest(_))));
        let slot = slab.slot(RequestRef::Id("a")).unwrap();
        assert_eq!(slab.remove(slot), Some(1));
        let (_, c) = slab.insert("c", 3).unwrap();
        assert_eq!(c, 1 << 32); // slot 0 again, next generation
        assert!(slab.slot(RequestRef::Handle(a)).is_err());
        assert!(slab.slot(RequestRef::Handle(-1)).is_err());
        assert!(slab.slot(RequestRef::Id("a")).is_err());
        assert_eq!(slab.get(slab.slot(RequestRef::Handle(c)).unwrap()), Some(&3));
        assert_eq!(slab.iter().map(|(id, h, _)| (id, h)).collect::<Vec<_>>(), [("c", c), ("b", b)]);
    }

    #[test]
    fn unknown_requests_carry_the_id_or_handle_unquoted() {
        // The glue quotes the id the way Python does; the core must not quote it first.
        let slab: Slab<u8> = Slab::default();
        let err = slab.slot(RequestRef::Id("req-1")).unwrap_err();
        assert_eq!(err, CoreError::UnknownRequest("req-1".to_owned()));
        assert_eq!(err.to_string(), r#"unknown request id "req-1""#);
        let err = slab.slot(RequestRef::Handle(7)).unwrap_err();
        assert_eq!(err, CoreError::UnknownHandle(7));
        assert_eq!(err.to_string(), "unknown request handle 7");
    }
}
