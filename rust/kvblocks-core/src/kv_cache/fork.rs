//! Forks (the embedded block manager's parallel sampling): a request shares another's
//! blocks, and copy-on-write gives it its own copy of each shared block it writes into.

use super::{KvCacheCoordinator, RequestBlocks};
use crate::{CoreError, CoreResult};

impl KvCacheCoordinator {
    /// Another request takes a reference to each of `held`'s blocks (the embedded block
    /// manager's fork: the two then share them until one writes, see
    /// [`super::AllocateArgs::copy_on_write`]).
    pub fn share(&mut self, held: &RequestBlocks) {
        for blocks in &held.groups {
            self.pool.touch(&blocks.blocks);
        }
    }

    /// The held blocks that tokens `local..local + num_new` are written into and that another
    /// request also holds, as `(group, column)`, in full-attention groups (copy-on-write).
    pub(super) fn shared_written<'a>(
        &'a self,
        held: &'a RequestBlocks,
        local: usize,
        num_new: usize,
    ) -> impl Iterator<Item = (usize, usize)> + 'a {
        let groups = self.config.groups.iter().zip(&held.groups).enumerate();
        groups.filter(|(_, (spec, _))| spec.kind.is_full()).flat_map(move |(g, (spec, blocks))| {
            let b = spec.block_size;
            let end = local.saturating_add(num_new).div_ceil(b).min(blocks.blocks.len());
            let shared = |&column: &usize| {
                blocks.blocks.get(column).is_some_and(|&x| self.pool.ref_cnt(x) > 1)
            };
            (local / b..end).filter(shared).map(move |column| (g, column))
        })
    }

    /// Copy-on-write: replaces each block of [`Self::shared_written`] by a fresh one, noting
    /// `[source, copy]` for those holding computed tokens (before `local`), whose content the
    /// worker must copy. The call has counted and checked the blocks it takes.
    pub(super) fn copy_on_write(
        &mut self,
        held: &mut RequestBlocks,
        local: usize,
        num_new: usize,
    ) -> CoreResult<()> {
        let shared: Vec<(usize, usize)> = self.shared_written(held, local, num_new).collect();
        for (g, column) in shared {
            let b = self.config.groups.get(g).map_or(1, |spec| spec.block_size);
            let slot = held.groups.get_mut(g).and_then(|blocks| blocks.blocks.get_mut(column));
            let Some(slot) = slot else { continue };
            let Some(&copy) = self.pool.get_new_blocks(1).first() else {
                return Err(CoreError::Internal("copy-on-write found no free block"));
            };
            if column * b < local {
                self.copies.push([*slot, copy]);
            }
            self.pool.release_shared(*slot);
            *slot = copy;
        }
        Ok(())
    }

    /// The `[source, copy]` blocks the last `allocate_slots` copied on write, whose content
    /// the worker must copy (see [`super::AllocateArgs::copy_on_write`]).
    pub fn last_copies(&self) -> &[[u32; 2]] {
        &self.copies
    }
}
