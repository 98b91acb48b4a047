//! The routing index's table: block key -> the set of replicas holding it, in 12 bytes a slot
//! while every replica is below 32 (16 bytes after), with no per-slot control byte.
//!
//! Open addressing with linear probing, at most 7/8 of the slots used; any number of slots
//! (a key's home is its mix scaled to the slot count), so that a table reserved for a fleet's
//! pools is sized to them, and a growing table grows by an eighth (so a table just grown has 7/9 of
//! its slots used: at most 15.5 bytes a key with 12-byte slots until removals thin it; a growth moves
//! every key, about eight moves per key over a table's growth, and briefly holds 2.1 times the
//! table). Keys and replica sets live in two arrays (so a narrow set is 4 bytes, not padded
//! to 8 next to its key); key 0 marks an empty slot, and the set of a key that is 0 is kept
//! beside the arrays. A slot's home is a seeded mix of its key, so that a publisher that chooses its hashes
//! cannot pile them into one run of slots. Removal shifts the following entries of the run
//! back (no tombstones), so probe runs never grow with churn.

/// The fewest slots a table has.
const MIN_SLOTS: usize = 16;

/// splitmix64's finalizer: a bijection that spreads every input bit over the output.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The replica sets of the slots: 32 bits each while no replica id is 32 or more.
enum Sets {
    Narrow(Vec<u32>),
    Wide(Vec<u64>),
}

impl Sets {
    fn empty(slots: usize, wide: bool) -> Self {
        if wide {
            Sets::Wide(vec![0; slots])
        } else {
            Sets::Narrow(vec![0; slots])
        }
    }

    fn get(&self, slot: usize) -> u64 {
        match self {
            Sets::Narrow(v) => v.get(slot).map_or(0, |&s| u64::from(s)),
            Sets::Wide(v) => v.get(slot).copied().unwrap_or(0),
        }
    }

    /// `set` fits: the table widens before a replica id of 32 or more is stored.
    fn put(&mut self, slot: usize, set: u64) {
        match self {
            Sets::Narrow(v) => {
                if let Some(s) = v.get_mut(slot) {
                    *s = set as u32;
                }
            }
            Sets::Wide(v) => {
                if let Some(s) = v.get_mut(slot) {
                    *s = set;
                }
            }
        }
    }

    fn is_wide(&self) -> bool {
        matches!(self, Sets::Wide(_))
    }

    fn bytes(&self) -> usize {
        match self {
            Sets::Narrow(v) => v.capacity() * 4,
            Sets::Wide(v) => v.capacity() * 8,
        }
    }
}

/// Block key -> replica set (one bit per replica, never 0 for a stored key).
pub(crate) struct HolderTable {
    keys: Vec<u64>,
    sets: Sets,
    /// The set of key 0 (0 marks an empty slot in `keys`).
    zero: u64,
    len: usize,
    seed: u64,
}

impl HolderTable {
    pub(crate) fn new(seed: u64) -> Self {
        Self::with_slots(seed, MIN_SLOTS, false)
    }

    fn with_slots(seed: u64, slots: usize, wide: bool) -> Self {
        HolderTable { keys: vec![0; slots], sets: Sets::empty(slots, wide), zero: 0, len: 0, seed }
    }

    fn slots(&self) -> usize {
        self.keys.len()
    }

    /// A key's first slot: its seeded mix scaled to the slot count.
    fn home(&self, key: u64) -> usize {
        ((u128::from(mix(key ^ self.seed)) * self.slots() as u128) >> 64) as usize
    }

    fn after(&self, slot: usize) -> usize {
        if slot + 1 == self.slots() {
            0
        } else {
            slot + 1
        }
    }

    /// How many slots `to` lies after `from`, wrapping past the last slot.
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.slots() - from
        }
    }

    /// The slot holding `key` (`Ok`), or the empty slot that ends its run (`Err`).
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mut slot = self.home(key);
        loop {
            match self.keys.get(slot).copied().unwrap_or(0) {
                0 => return Err(slot),
                k if k == key => return Ok(slot),
                _ => slot = self.after(slot),
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The replicas holding `key` (0 for none).
    pub(crate) fn get(&self, key: u64) -> u64 {
        if key == 0 {
            return self.zero;
        }
        self.find(key).map_or(0, |slot| self.sets.get(slot))
    }

    /// Adds `bit` to `key`'s set (creating it); returns whether the bit was new.
    pub(crate) fn insert_bit(&mut self, key: u64, bit: u64) -> bool {
        if bit > u64::from(u32::MAX) && !self.sets.is_wide() {
            self.rebuild(self.slots(), true);
        }
        if key == 0 {
            let new = self.zero & bit == 0;
            self.len += usize::from(self.zero == 0);
            self.zero |= bit;
            return new;
        }
        match self.find(key) {
            Ok(slot) => {
                let set = self.sets.get(slot);
                self.sets.put(slot, set | bit);
                set & bit == 0
            }
            Err(mut slot) => {
                if (self.len - usize::from(self.zero != 0) + 1) * 8 > self.slots() * 7 {
                    self.rebuild(self.slots() + self.slots() / 8, self.sets.is_wide());
                    slot = self.find(key).err().unwrap_or(0);
                }
                if let Some(k) = self.keys.get_mut(slot) {
                    *k = key;
                }
                self.sets.put(slot, bit);
                self.len += 1;
                true
            }
        }
    }

    /// Takes `bit` out of `key`'s set (dropping an emptied key); returns whether it was there.
    pub(crate) fn remove_bit(&mut self, key: u64, bit: u64) -> bool {
        if key == 0 {
            let had = self.zero & bit != 0;
            self.zero &= !bit;
            self.len -= usize::from(had && self.zero == 0);
            return had;
        }
        let Ok(slot) = self.find(key) else {
            return false;
        };
        let set = self.sets.get(slot);
        if set & bit == 0 {
            return false;
        }
        if set == bit {
            self.vacate(slot);
        } else {
            self.sets.put(slot, set & !bit);
        }
        true
    }

    /// The keys whose set has `bit`, in slot order.
    pub(crate) fn keys_with_bit(&self, bit: u64) -> Vec<u64> {
        let mut keys: Vec<u64> = Vec::new();
        if self.zero & bit != 0 {
            keys.push(0);
        }
        for (slot, &key) in self.keys.iter().enumerate() {
            if key != 0 && self.sets.get(slot) & bit != 0 {
                keys.push(key);
            }
        }
        keys
    }

    /// Takes `bit` out of every set, dropping the keys it emptied.
    pub(crate) fn remove_bit_everywhere(&mut self, bit: u64) {
        self.remove_bit(0, bit);
        let mut slot = 0;
        while slot < self.slots() {
            let set = self.sets.get(slot);
            if self.keys.get(slot).copied().unwrap_or(0) != 0 && set & bit != 0 {
                if set == bit {
                    // The run's next entries shift back into this slot: look at it again.
                    // (An entry may also shift from the table's start to its end, one
                    // already seen; taking the bit out again changes nothing.)
                    self.vacate(slot);
                    continue;
                }
                self.sets.put(slot, set & !bit);
            }
            slot += 1;
        }
    }

    /// Empties `slot`, moving back the entries after it in its run that may live there.
    fn vacate(&mut self, mut hole: usize) {
        let mut next = hole;
        loop {
            next = self.after(next);
            let key = self.keys.get(next).copied().unwrap_or(0);
            if key == 0 {
                break;
            }
            let home = self.home(key);
            // The entry may move to the hole only if its home is not between them.
            if self.distance(home, next) >= self.distance(hole, next) {
                let set = self.sets.get(next);
                if let Some(k) = self.keys.get_mut(hole) {
                    *k = key;
                }
                self.sets.put(hole, set);
                hole = next;
            }
        }
        if let Some(k) = self.keys.get_mut(hole) {
            *k = 0;
        }
        self.sets.put(hole, 0);
        self.len -= 1;
    }

    /// Room for `keys` keys in all without growing.
    pub(crate) fn reserve(&mut self, keys: usize) {
        let needed = keys.saturating_mul(8).div_ceil(7).max(MIN_SLOTS);
        if needed > self.slots() {
            self.rebuild(needed, self.sets.is_wide());
        }
    }

    fn rebuild(&mut self, slots: usize, wide: bool) {
        let mut table = Self::with_slots(self.seed, slots, wide);
        table.zero = self.zero;
        table.len = usize::from(self.zero != 0);
        for (slot, &key) in self.keys.iter().enumerate() {
            if key != 0 {
                if let Err(to) = table.find(key) {
                    if let Some(k) = table.keys.get_mut(to) {
                        *k = key;
                    }
                    table.sets.put(to, self.sets.get(slot));
                    table.len += 1;
                }
            }
        }
        *self = table;
    }

    /// Bytes the table's arrays hold.
    pub(crate) fn bytes(&self) -> usize {
        self.keys.capacity() * 8 + self.sets.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64, u32),
        RemoveEverywhere(u32),
        Reserve(usize),
    }

    /// Keys mostly from a small set (so removals hit), 0 among them; the small table sizes the
    /// operations pass through make long and wrapping runs likely.
    fn op() -> impl Strategy<Value = Op> {
        let key = prop_oneof![Just(0u64), 1u64..200, any::<u64>()];
        let replica = prop_oneof![0u32..4, 30u32..34, Just(63u32)];
        prop_oneof![
            6 => (key.clone(), replica.clone()).prop_map(|(k, r)| Op::Insert(k, r)),
            4 => (key, replica.clone()).prop_map(|(k, r)| Op::Remove(k, r)),
            1 => replica.prop_map(Op::RemoveEverywhere),
            1 => (0usize..300).prop_map(Op::Reserve),
        ]
    }

    fn check(table: &HolderTable, model: &HashMap<u64, u64>) {
        assert_eq!(table.len(), model.len());
        for (&key, &set) in model {
            assert_eq!(table.get(key), set, "key {key}");
        }
        let in_slots = table.keys.iter().filter(|&&k| k != 0).count();
        assert_eq!(in_slots + usize::from(table.zero != 0), model.len());
        assert!(in_slots * 8 <= table.slots() * 7);
    }

    proptest! {
        #[test]
        fn agrees_with_a_map_of_sets(seed in any::<u64>(), ops in prop::collection::vec(op(), 0..400)) {
            let mut table = HolderTable::new(seed);
            let mut model: HashMap<u64, u64> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, r) => {
                        let bit = 1u64 << r;
                        let set = model.entry(k).or_insert(0);
                        let new = *set & bit == 0;
                        *set |= bit;
                        prop_assert_eq!(table.insert_bit(k, bit), new);
                    }
                    Op::Remove(k, r) => {
                        let bit = 1u64 << r;
                        let had = model.get(&k).is_some_and(|s| s & bit != 0);
                        if had {
                            let set = model.get(&k).copied().unwrap_or(0) & !bit;
                            if set == 0 { model.remove(&k); } else { model.insert(k, set); }
                        }
                        prop_assert_eq!(table.remove_bit(k, bit), had);
                    }
                    Op::RemoveEverywhere(r) => {
                        let bit = 1u64 << r;
                        model.retain(|_, set| { *set &= !bit; *set != 0 });
                        table.remove_bit_everywhere(bit);
                    }
                    Op::Reserve(n) => table.reserve(n),
                }
                check(&table, &model);
            }
        }
    }

    #[test]
    fn runs_wrapping_past_the_last_slot_survive_removals() {
        // Every key homed in the last slots: their run wraps to the table's start.
        let mut table = HolderTable::new(5);
        let last = table.slots() - 1;
        let keys: Vec<u64> = (1u64..).filter(|&k| table.home(k) >= last - 1).take(6).collect();
        assert!(keys.iter().any(|&k| table.home(k) == last));
        for &k in &keys {
            assert!(table.insert_bit(k, 1));
        }
        for (i, &k) in keys.iter().enumerate() {
            assert!(table.remove_bit(k, 1));
            for &rest in keys.get(i + 1..).unwrap_or_default() {
                assert_eq!(table.get(rest), 1);
            }
        }
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_slot_is_12_bytes_until_a_replica_id_reaches_32() {
        let mut table = HolderTable::new(1);
        table.reserve(7_000);
        assert_eq!((table.slots(), table.bytes()), (8000, 8000 * 12));
        table.insert_bit(9, 1 << 31);
        assert_eq!(table.bytes(), 8000 * 12);
        table.insert_bit(9, 1 << 32);
        assert_eq!((table.get(9), table.bytes()), ((1 << 31) | (1 << 32), 8000 * 16));
    }
}
