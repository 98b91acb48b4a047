//! A cluster-wide block table for KV-aware routing: which replica holds which block.
//!
//! Each vLLM replica publishes its cache changes as KV events (a block stored, a block
//! removed, everything cleared), per KV-cache group and medium. The index keeps, for every
//! block hash it has seen, the set of replicas that hold it, and answers the question a router
//! asks for a request: how many of its leading blocks each replica holds.
//!
//! A key is the last 8 bytes of vLLM's block hash (a sha256 or xxhash digest, uniformly
//! distributed; what vLLM publishes by default as an int) mixed with the group and the
//! medium: 8 bytes, and a replica set of one bit per replica (up to [`MAX_REPLICAS`]): 4 bytes
//! while every replica id is below 32, 8 after. An indexed block costs one 12-byte slot (16
//! with a replica id of 32 or more) however many replicas hold it, in a table at most 7/8
//! full ([`crate::router_table`]). Two different blocks share a key with probability 2^-64 per pair (for ten
//! million blocks, about 3 in a million that any pair does): the index is exact up to that.
//!
//! A replica may cache one block in several copies: vLLM registers a block computed again
//! (two requests computing a shared prefix at once, or a hybrid model recomputing blocks its
//! full-attention group had cached because another group's hit was shorter) under its hash
//! beside the first, publishes a `BlockStored` for each copy and a `BlockRemoved` for each
//! copy it evicts. The index counts the copies beyond the first per (replica, key), in a
//! side table that holds only such keys, so the block stays held until its last copy goes.
//!
//! Nothing here trusts a publisher: a removal of a block the replica does not hold is counted
//! and dropped, and every call either applies in full or refuses (an unknown replica) without
//! changing the index.

use crate::hashing::BlockHash;
use crate::kv_cache::{CachedBlocks, HitRule};
use crate::pool::CacheKey;
use crate::router_table::{mix, HolderTable};
use crate::{CoreError, CoreResult};
use std::collections::HashMap;

/// The most replicas one index tracks (one bit each).
pub const MAX_REPLICAS: usize = 64;

/// The index key of a block hash (`bytes`): its last 8 bytes read big-endian (what vLLM
/// publishes as the block's hash with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, its default;
/// shorter hashes are zero-extended), mixed with its KV-cache group and medium.
pub fn block_key(hash: &[u8], group: u32, medium: u32) -> u64 {
    let tail = hash.get(hash.len().saturating_sub(8)..).unwrap_or_default();
    let value = tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    int_block_key(value, group, medium)
}

/// The index key of a block hash vLLM published as an int (the last 8 bytes of the hash,
/// big-endian): the same key [`block_key`] gives the hash's bytes.
pub fn int_block_key(value: u64, group: u32, medium: u32) -> u64 {
    let tag = (u64::from(group) << 32) | u64::from(medium);
    value ^ mix(tag)
}

/// What the index has applied and refused, for monitoring a fleet's event streams.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RouterCounts {
    /// Blocks a replica stored that it did not hold yet.
    pub stored: u64,
    /// Blocks a replica removed the last copy of.
    pub removed: u64,
    /// Stores of a block the replica already held: another copy of it.
    pub repeated_stores: u64,
    /// Removals of one of several copies of a block (the block stays held).
    pub repeated_removals: u64,
    /// Removals of a block the replica did not hold (changed nothing).
    pub unknown_removals: u64,
    /// Blocks dropped by a replica's clear or removal.
    pub cleared: u64,
}

/// The cluster-wide block table. See the module's documentation.
pub struct RouterIndex {
    table: HolderTable,
    /// One bit per registered replica.
    live: u64,
    /// Blocks each replica holds.
    held: [u64; MAX_REPLICAS],
    /// Per (key, replica) holding more than one copy of the block: the copies beyond the
    /// first.
    copies: HashMap<(u64, u8), u32>,
    counts: RouterCounts,
}

fn bit(replica: usize) -> CoreResult<u64> {
    if replica >= MAX_REPLICAS {
        return Err(CoreError::OutOfRange {
            what: "replica",
            value: replica,
            limit: MAX_REPLICAS - 1,
        });
    }
    Ok(1u64 << replica)
}

impl RouterIndex {
    /// An empty index with no replica; `seed` keys its table (any value; a random one keeps
    /// publishers from predicting bucket placement).
    pub fn new(seed: u64) -> Self {
        RouterIndex {
            table: HolderTable::new(mix(seed)),
            live: 0,
            held: [0; MAX_REPLICAS],
            copies: HashMap::new(),
            counts: RouterCounts::default(),
        }
    }

    fn live_bit(&self, replica: usize) -> CoreResult<u64> {
        let b = bit(replica)?;
        if self.live & b == 0 {
            return Err(CoreError::InvalidArgument(format!("no replica {replica} in the index")));
        }
        Ok(b)
    }

    /// Registers replica `replica` (0 to [`MAX_REPLICAS`] - 1), holding nothing.
    pub fn add_replica(&mut self, replica: usize) -> CoreResult<()> {
        let b = bit(replica)?;
        if self.live & b != 0 {
            return Err(CoreError::InvalidArgument(format!(
                "replica {replica} is already in the index"
            )));
        }
        self.live |= b;
        Ok(())
    }

    /// Drops every block `replica` holds (vLLM's `AllBlocksCleared`, or a restart); returns
    /// how many. The replica stays registered.
    pub fn clear_replica(&mut self, replica: usize) -> CoreResult<u64> {
        let b = self.live_bit(replica)?;
        let dropped = self.held.get(replica).copied().unwrap_or(0);
        if dropped > 0 {
            self.table.remove_bit_everywhere(b);
        }
        self.copies.retain(|&(_, r), _| usize::from(r) != replica);
        if let Some(held) = self.held.get_mut(replica) {
            *held = 0;
        }
        self.counts.cleared += dropped;
        Ok(dropped)
    }

    /// Unregisters `replica`, dropping its blocks; returns how many it held.
    pub fn remove_replica(&mut self, replica: usize) -> CoreResult<u64> {
        let dropped = self.clear_replica(replica)?;
        self.live &= !(1u64 << replica);
        Ok(dropped)
    }

    /// `replica` now holds (another copy of) each block of `keys` ([`block_key`]); returns
    /// how many it did not hold before.
    pub fn store(&mut self, replica: usize, keys: &[u64]) -> CoreResult<u64> {
        let b = self.live_bit(replica)?;
        let mut new = 0;
        for &key in keys {
            if self.table.insert_bit(key, b) {
                new += 1;
            } else {
                // `replica` < MAX_REPLICAS (64): it fits a byte.
                let extra = self.copies.entry((key, replica as u8)).or_insert(0);
                *extra = extra.saturating_add(1);
            }
        }
        if let Some(held) = self.held.get_mut(replica) {
            *held += new;
        }
        self.counts.stored += new;
        self.counts.repeated_stores += keys.len() as u64 - new;
        Ok(new)
    }

    /// `replica` dropped a copy of each block of `keys`; returns how many blocks it no longer
    /// holds (their last copy gone).
    pub fn remove(&mut self, replica: usize, keys: &[u64]) -> CoreResult<u64> {
        let b = self.live_bit(replica)?;
        let (mut gone, mut copies) = (0, 0);
        for &key in keys {
            let slot = (key, replica as u8);
            if let Some(extra) = self.copies.get_mut(&slot) {
                *extra -= 1;
                if *extra == 0 {
                    self.copies.remove(&slot);
                }
                copies += 1;
            } else {
                gone += u64::from(self.table.remove_bit(key, b));
            }
        }
        if let Some(held) = self.held.get_mut(replica) {
            *held -= gone;
        }
        self.counts.removed += gone;
        self.counts.repeated_removals += copies;
        self.counts.unknown_removals += keys.len() as u64 - gone - copies;
        Ok(gone)
    }

    /// The blocks `replica` holds, as (key, copies) pairs (copies at least 1), in no
    /// particular order: what [`Self::restore_replica`] takes back, in this index or a new
    /// one (a snapshot).
    pub fn replica_blocks(&self, replica: usize) -> CoreResult<Vec<(u64, u32)>> {
        let b = self.live_bit(replica)?;
        let extra = |key: u64| self.copies.get(&(key, replica as u8)).copied().unwrap_or(0);
        Ok(self
            .table
            .keys_with_bit(b)
            .into_iter()
            .map(|key| (key, extra(key).saturating_add(1)))
            .collect())
    }

    /// Gives `replica`, registered and holding nothing, the blocks of a
    /// [`Self::replica_blocks`]; returns how many. A copy count of 0, or a replica holding
    /// blocks, is an error that changes nothing. Restored blocks count as no event.
    pub fn restore_replica(&mut self, replica: usize, blocks: &[(u64, u32)]) -> CoreResult<u64> {
        let b = self.live_bit(replica)?;
        if self.held.get(replica).copied().unwrap_or(0) != 0 {
            return Err(CoreError::InvalidArgument(format!(
                "replica {replica} holds blocks: only an empty replica is restored"
            )));
        }
        if blocks.iter().any(|&(_, copies)| copies == 0) {
            return Err(CoreError::InvalidArgument("a block restored with 0 copies".into()));
        }
        let mut new = 0;
        for &(key, copies) in blocks {
            let extra = if self.table.insert_bit(key, b) {
                new += 1;
                copies - 1
            } else {
                copies
            };
            if extra > 0 {
                let slot = self.copies.entry((key, replica as u8)).or_insert(0);
                *slot = slot.saturating_add(extra);
            }
        }
        if let Some(held) = self.held.get_mut(replica) {
            *held = new;
        }
        Ok(new)
    }

    /// For each replica, how many of the leading blocks of `keys` it holds without a gap
    /// (`out[r]`; `out` is cleared first and has one entry per possible replica).
    pub fn prefix_blocks(&self, keys: &[u64], out: &mut [u32; MAX_REPLICAS]) {
        *out = [0; MAX_REPLICAS];
        let mut alive = self.live;
        for (depth, key) in keys.iter().enumerate() {
            if alive == 0 {
                return;
            }
            let holders = self.table.get(*key) & alive;
            let mut ended = alive & !holders;
            while ended != 0 {
                let r = ended.trailing_zeros() as usize;
                if let Some(slot) = out.get_mut(r) {
                    *slot = depth as u32;
                }
                ended &= ended - 1;
            }
            alive = holders;
        }
        let depth = keys.len() as u32;
        while alive != 0 {
            let r = alive.trailing_zeros() as usize;
            if let Some(slot) = out.get_mut(r) {
                *slot = depth;
            }
            alive &= alive - 1;
        }
    }

    /// The prefix tokens `replica`'s scheduler would find cached in `medium` for a request
    /// whose full blocks have `hashes`, in a lookup of at most `max_length` tokens: its
    /// layout's hit `rule` (vLLM's coordinator's, for every kind of group) searched over the
    /// blocks the replica holds. The plain-prefix layouts have [`Self::prefix_blocks`], for
    /// every replica at once.
    pub fn hit_tokens(
        &self,
        replica: usize,
        medium: u32,
        rule: &HitRule,
        hashes: &[BlockHash],
        max_length: usize,
    ) -> CoreResult<usize> {
        let bit = self.live_bit(replica)?;
        let held = HeldBy { table: &self.table, bit, medium };
        Ok(rule.hit_tokens(&held, hashes, max_length))
    }

    /// Whether `replica` holds the block of `key`.
    pub fn holds(&self, replica: usize, key: u64) -> bool {
        bit(replica).is_ok_and(|b| self.table.get(key) & b != 0)
    }

    /// The registered replicas, one bit each.
    pub fn replicas(&self) -> u64 {
        self.live
    }

    /// Blocks `replica` holds (0 for one not registered).
    pub fn held(&self, replica: usize) -> u64 {
        self.held.get(replica).copied().unwrap_or(0)
    }

    /// Distinct keys in the index (a block held by several replicas counts once).
    pub fn num_keys(&self) -> usize {
        self.table.len()
    }

    /// Bytes the table has allocated (12 or 16 a slot, at most 7/8 of its slots used).
    pub fn table_bytes(&self) -> usize {
        self.table.bytes()
    }

    /// (replica, block) pairs held in more than one copy.
    pub fn num_copied(&self) -> usize {
        self.copies.len()
    }

    /// Makes room for `keys` distinct keys in all, so that the table does not grow (and
    /// briefly hold twice its size) until it holds more: a router sized for its fleet's
    /// pools reserves their total.
    pub fn reserve(&mut self, keys: usize) {
        self.table.reserve(keys);
    }

    pub fn counts(&self) -> RouterCounts {
        self.counts
    }
}

/// What one replica holds in one medium, read as a hit search reads a block pool: a held
/// block is [`HELD`] (a search only counts the blocks of a hit).
struct HeldBy<'a> {
    table: &'a HolderTable,
    bit: u64,
    medium: u32,
}

/// The block a [`HeldBy`] view gives for every block its replica holds.
const HELD: [u32; 1] = [1];

impl CachedBlocks for HeldBy<'_> {
    fn cached_blocks(&self, key: &CacheKey) -> &[u32] {
        let key = block_key(key.hash.as_bytes(), key.group, self.medium);
        if self.table.get(key) & self.bit != 0 {
            &HELD
        } else {
            &[]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<u64> {
        range.map(|i| block_key(&i.to_le_bytes(), 0, 0)).collect()
    }

    #[test]
    fn a_replicas_blocks_restore_into_a_new_index() {
        let mut index = RouterIndex::new(1);
        index.add_replica(0).unwrap();
        index.add_replica(5).unwrap();
        let mut stored = keys(0..40);
        stored.push(0); // the key that marks an empty slot in the table
        index.store(5, &stored).unwrap();
        index.store(5, &stored[..3]).unwrap(); // second copies
        index.store(0, &stored[10..20]).unwrap();
        let mut blocks = index.replica_blocks(5).unwrap();
        blocks.sort_unstable();
        let mut expected: Vec<(u64, u32)> =
            stored.iter().enumerate().map(|(i, &k)| (k, if i < 3 { 2 } else { 1 })).collect();
        expected.sort_unstable();
        assert_eq!(blocks, expected);

        let mut restored = RouterIndex::new(99); // another seed: other slots, same answers
        restored.add_replica(2).unwrap();
        assert_eq!(restored.restore_replica(2, &blocks).unwrap(), 41);
        assert_eq!(restored.held(2), 41);
        assert!(stored.iter().all(|&k| restored.holds(2, k)));
        // the copies came along: a block with two copies stays held after one removal
        assert_eq!(restored.remove(2, &stored[..4]).unwrap(), 1);
        assert!(restored.holds(2, stored[0]) && !restored.holds(2, stored[3]));
        assert_eq!(
            restored.counts(),
            RouterCounts { removed: 1, repeated_removals: 3, ..Default::default() }
        );

        // refused, changing nothing: a replica holding blocks, a block of 0 copies, no replica
        assert!(restored.restore_replica(2, &blocks).is_err());
        restored.add_replica(3).unwrap();
        assert!(restored.restore_replica(3, &[(7, 1), (8, 0)]).is_err());
        assert_eq!(restored.held(3), 0);
        assert!(restored.restore_replica(4, &blocks).is_err());
        assert!(index.replica_blocks(4).is_err());
    }

    #[test]
    fn prefix_per_replica_stops_at_the_first_gap() -> CoreResult<()> {
        let mut index = RouterIndex::new(7);
        for r in 0..3 {
            index.add_replica(r)?;
        }
        let all = keys(0..10);
        index.store(0, &all)?;
        index.store(1, all.get(..4).unwrap_or_default())?;
        index.store(2, all.get(1..10).unwrap_or_default())?; // no first block: no prefix
        let mut out = [0; MAX_REPLICAS];
        index.prefix_blocks(&all, &mut out);
        assert_eq!(out.get(..3), Some(&[10, 4, 0][..]));
        index.remove(0, all.get(5..6).unwrap_or_default())?;
        index.prefix_blocks(&all, &mut out);
        assert_eq!(out.get(..3), Some(&[5, 4, 0][..]));
        Ok(())
    }

    #[test]
    fn hostile_input_is_counted_and_changes_nothing() -> CoreResult<()> {
        let mut index = RouterIndex::new(1);
        index.add_replica(3)?;
        let k = keys(0..4);
        assert_eq!(index.remove(3, &k)?, 0);
        assert_eq!(index.store(3, &k)?, 4);
        assert_eq!(index.store(3, &k)?, 0);
        let counts = index.counts();
        assert_eq!((counts.unknown_removals, counts.repeated_stores, counts.stored), (4, 4, 4));
        // Each block is held twice now: one removal leaves it held, the second drops it.
        let first = k.get(..1).unwrap_or_default();
        let key = first.first().copied().unwrap_or_default();
        assert_eq!(index.remove(3, first)?, 0);
        assert!(index.holds(3, key));
        assert_eq!(index.remove(3, first)?, 1);
        assert!(!index.holds(3, key));
        assert_eq!(index.remove(3, first)?, 0);
        let counts = index.counts();
        assert_eq!((counts.repeated_removals, counts.removed, counts.unknown_removals), (1, 1, 5));
        assert_eq!(index.store(3, first)?, 1);
        assert!(index.store(4, &k).is_err());
        assert!(index.add_replica(3).is_err());
        assert!(index.add_replica(MAX_REPLICAS).is_err());
        assert_eq!((index.held(3), index.num_keys()), (4, 4));
        Ok(())
    }

    #[test]
    fn clearing_a_replica_leaves_the_others() -> CoreResult<()> {
        let mut index = RouterIndex::new(2);
        index.add_replica(0)?;
        index.add_replica(1)?;
        let k = keys(0..6);
        index.store(0, &k)?;
        index.store(1, k.get(..3).unwrap_or_default())?;
        assert_eq!(index.clear_replica(0)?, 6);
        assert_eq!(index.num_keys(), 3);
        assert_eq!(index.remove_replica(1)?, 3);
        assert_eq!(index.num_keys(), 0);
        assert!(index.store(1, &k).is_err());
        Ok(())
    }

    /// A replica with a full-attention group 0 and a group 1 of `kind` (4-token blocks).
    fn hybrid(kind: crate::AttentionKind) -> CoreResult<HitRule> {
        use crate::GroupSpec;
        let second = GroupSpec { kind, ..GroupSpec::full(4) };
        HitRule::new(vec![GroupSpec::full(4), second], vec![vec![0], vec![1]], false)
    }

    #[test]
    fn hybrid_hits_follow_each_groups_rule() -> CoreResult<()> {
        use crate::AttentionKind;
        let hashes: Vec<BlockHash> = (0u8..6).map(|i| BlockHash::Sha256([i; 32])).collect();
        let key =
            |i: usize, group: u32| hashes.get(i).map_or(0, |h| block_key(h.as_bytes(), group, 0));
        let mut index = RouterIndex::new(3);
        index.add_replica(0)?;
        index.store(0, &(0..6).map(|i| key(i, 0)).collect::<Vec<_>>())?;
        // A 9-token window reads two 4-token blocks: group 1 has blocks 0, 1, 3 and 4.
        let window = hybrid(AttentionKind::SlidingWindow { window: 9, extra_retained: 0 })?;
        index.store(0, &[0, 1, 3, 4].map(|i| key(i, 1)))?;
        // 23 tokens looked up (the last of 24 is computed): 5 blocks, the window ending there.
        assert_eq!(index.hit_tokens(0, 0, &window, &hashes, 23)?, 20);
        index.remove(0, &[key(4, 1)])?;
        // Blocks 3 alone is no window: the run from block 0 is the hit.
        assert_eq!(index.hit_tokens(0, 0, &window, &hashes, 23)?, 8);
        // In another medium the replica holds nothing.
        assert_eq!(index.hit_tokens(0, 1, &window, &hashes, 23)?, 0);
        // A Mamba state is complete in itself: the latest one held, here after block 3.
        let mamba =
            hybrid(AttentionKind::Mamba { speculative_blocks: 0, checkpoint_alignment: None })?;
        assert_eq!(index.hit_tokens(0, 0, &mamba, &hashes, 23)?, 16);
        // ... bounded by full attention's prefix.
        index.remove(0, &[key(2, 0)])?;
        assert_eq!(index.hit_tokens(0, 0, &mamba, &hashes, 23)?, 8);
        assert!(!mamba.is_plain_prefix());
        assert!(index.hit_tokens(1, 0, &mamba, &hashes, 23).is_err());
        Ok(())
    }

    #[test]
    fn bytes_and_vllms_int_form_give_one_key() {
        let hash: Vec<u8> = (0u8..32).collect();
        let int = u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31]);
        assert_eq!(block_key(&hash, 2, 1), int_block_key(int, 2, 1));
    }

    #[test]
    fn group_and_medium_are_part_of_the_key() {
        let hash = [5u8; 32];
        let keys = [block_key(&hash, 0, 0), block_key(&hash, 1, 0), block_key(&hash, 0, 1)];
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_ne!(keys[1], keys[2]);
    }
}
