//! The free block queue: an intrusive doubly linked list over block ids, in eviction order
//! (head first). O(1) removal from the middle, as vLLM's `FreeKVCacheBlockQueue`.

use crate::{try_filled, CoreResult};

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

fn at(v: &[u32], i: u32) -> u32 {
    v.get(i as usize).copied().unwrap_or(NIL)
}

fn set(v: &mut [u32], i: u32, value: u32) {
    if let Some(slot) = v.get_mut(i as usize) {
        *slot = value;
    }
}

impl FreeQueue {
    /// Every block `0..num_blocks`, linked in id order.
    pub fn new(num_blocks: u32) -> CoreResult<Self> {
        let n = num_blocks as usize;
        let mut queue = Self {
            prev: try_filled(n, NIL, "the free queue")?,
            next: try_filled(n, NIL, "the free queue")?,
            queued: try_filled(n, false, "the free queue")?,
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..num_blocks {
            queue.push_back(b);
        }
        Ok(queue)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn contains(&self, block: u32) -> bool {
        self.queued.get(block as usize).copied().unwrap_or(false)
    }

    /// Takes the head (the next block to reuse).
    pub fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        if head == NIL {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    /// Unlinks `block`; a block that is not queued is left alone.
    pub fn remove(&mut self, block: u32) {
        if !self.contains(block) {
            return;
        }
        let (p, n) = (at(&self.prev, block), at(&self.next, block));
        if p == NIL {
            self.head = n;
        } else {
            set(&mut self.next, p, n);
        }
        if n == NIL {
            self.tail = p;
        } else {
            set(&mut self.prev, n, p);
        }
        set(&mut self.prev, block, NIL);
        set(&mut self.next, block, NIL);
        if let Some(q) = self.queued.get_mut(block as usize) {
            *q = false;
        }
        self.len -= 1;
    }

    pub fn push_back(&mut self, block: u32) {
        if self.contains(block) || block as usize >= self.queued.len() {
            return;
        }
        set(&mut self.prev, block, self.tail);
        if self.tail == NIL {
            self.head = block;
        } else {
            set(&mut self.next, self.tail, block);
        }
        self.tail = block;
        if let Some(q) = self.queued.get_mut(block as usize) {
            *q = true;
        }
        self.len += 1;
    }

    pub fn push_front(&mut self, block: u32) {
        if self.contains(block) || block as usize >= self.queued.len() {
            return;
        }
        set(&mut self.next, block, self.head);
        if self.head == NIL {
            self.tail = block;
        } else {
            set(&mut self.prev, self.head, block);
        }
        self.head = block;
        if let Some(q) = self.queued.get_mut(block as usize) {
            *q = true;
        }
        self.len += 1;
    }

    /// Puts `blocks` at the head keeping their order (`blocks[0]` becomes the head).
    pub fn prepend_n(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.push_front(b);
        }
    }

    /// Head to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), move |&b| {
            let n = at(&self.next, b);
            (n != NIL).then_some(n)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_links_and_count() {
        let mut q = FreeQueue::new(5).unwrap();
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        assert_eq!(q.pop_front(), Some(0));
        q.remove(2);
        q.remove(2); // not queued: ignored
        q.prepend_n(&[2, 0]);
        q.push_back(2); // already queued: ignored
        assert_eq!(q.iter().collect::<Vec<_>>(), [2, 0, 1, 3, 4]);
        q.remove(4);
        q.remove(2);
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 3]);
        assert_eq!(q.len(), 3);
        while q.pop_front().is_some() {}
        assert_eq!(q.len(), 0);
        assert_eq!(q.iter().count(), 0);
        q.push_back(3);
        assert_eq!(q.iter().collect::<Vec<_>>(), [3]);
    }
}
