//! A shard's key index: a hash map from key to a slot in a slab of entries (point lookups,
//! the hot path), the same keys in an ordered map (listing and range deletes), the slab's
//! entries linked in least-recently-used order (for cache mode), and an expiry queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use ahash::RandomState;

use super::alloc::Extent;

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
pub struct Entry {
    /// Arena extent holding the key at its start and the value at `value_at`.
    pub extent: Extent,
    pub key_len: u32,
    /// Where the value starts, from the extent's start: right after the key, or a little
    /// further for a large value (see `shard::Layout`).
    pub value_at: u32,
    pub value_len: u64,
    pub generation: u64,
    /// Monotonic nanoseconds; 0 = never expires.
    pub expires_at: u64,
    prev: u32,
    next: u32,
}

impl Entry {
    pub fn new(extent: Extent, key_len: u32, value_at: u32, value_len: u64, generation: u64, expires_at: u64) -> Self {
        Entry { extent, key_len, value_at, value_len, generation, expires_at, prev: NIL, next: NIL }
    }

    pub fn value_offset(&self) -> u64 {
        self.extent.offset + self.value_at as u64
    }
}

/// Heap bytes an entry costs beyond its key's bytes (the key's shared header, hash and
/// ordered map shares, slot, LRU links): an estimate, for the index budget.
pub const ENTRY_OVERHEAD: usize = 160;

#[derive(Default)]
pub struct Index {
    /// Point lookups. Keys are chosen by clients: the hasher is keyed at random (aHash: made
    /// for DoS-resistant hash maps, and cheaper than SipHash), so no client can make them
    /// collide on purpose. A lookup costs a miss or two where the ordered map's costs one
    /// per level and key compared: with a million keys, a GET 8 B through the ordered map
    /// alone took three times as long as with 64 keys.
    by_key: HashMap<Arc<[u8]>, u32, RandomState>,
    /// The same keys (shared bytes), in order.
    keys: BTreeMap<Arc<[u8]>, u32>,
    /// Heap bytes the index holds (key copies plus [`ENTRY_OVERHEAD`] per key).
    bytes: usize,
    slots: Vec<Option<Entry>>,
    free_slots: Vec<u32>,
    /// Most recently used end.
    head: u32,
    /// Least recently used end.
    tail: u32,
    expiry: BTreeSet<(u64, u32)>,
}

impl Index {
    pub fn new() -> Self {
        Index { head: NIL, tail: NIL, ..Default::default() }
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    pub fn entry(&self, slot: u32) -> &Entry {
        self.slots[slot as usize].as_ref().expect("live slot")
    }

    /// Inserts a new key (which must be absent); returns its slot.
    pub fn insert(&mut self, key: &[u8], entry: Entry) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        if entry.expires_at != 0 {
            self.expiry.insert((entry.expires_at, slot));
        }
        self.slots[slot as usize] = Some(entry);
        self.link_front(slot);
        self.bytes += key.len() + ENTRY_OVERHEAD;
        let key: Arc<[u8]> = key.into();
        let old = self.by_key.insert(key.clone(), slot);
        debug_assert!(old.is_none());
        self.keys.insert(key, slot);
        slot
    }

    /// Puts `entry` in a live slot and returns what it held. The slot keeps its place in
    /// least-recently-used order: a caller that keeps that order (cache mode) touches it.
    pub fn replace(&mut self, slot: u32, mut entry: Entry) -> Entry {
        let old = self.slots[slot as usize].take().expect("live slot");
        if old.expires_at != 0 {
            self.expiry.remove(&(old.expires_at, slot));
        }
        if entry.expires_at != 0 {
            self.expiry.insert((entry.expires_at, slot));
        }
        entry.prev = old.prev;
        entry.next = old.next;
        self.slots[slot as usize] = Some(entry);
        old
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let slot = self.by_key.remove(key)?;
        self.keys.remove(key);
        self.bytes -= key.len() + ENTRY_OVERHEAD;
        self.unlink(slot);
        let old = self.slots[slot as usize].take().expect("live slot");
        if old.expires_at != 0 {
            self.expiry.remove(&(old.expires_at, slot));
        }
        self.free_slots.push(slot);
        Some(old)
    }

    /// Marks `slot` most recently used.
    pub fn touch(&mut self, slot: u32) {
        if self.head != slot {
            self.unlink(slot);
            self.link_front(slot);
        }
    }

    pub fn least_recently_used(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The slot whose expiry is earliest, if it is due by `now`.
    pub fn first_expired(&self, now: u64) -> Option<u32> {
        self.expiry.iter().next().filter(|(at, _)| *at <= now).map(|&(_, slot)| slot)
    }

    /// Keys in `[min, max)` (`max = None`: unbounded), in order, with their slots.
    pub fn range<'a>(&'a self, min: &[u8], max: Option<&[u8]>) -> impl Iterator<Item = (&'a [u8], u32)> + 'a {
        let upper: Bound<&[u8]> = match max {
            Some(m) => Bound::Excluded(m),
            None => Bound::Unbounded,
        };
        let empty = matches!(max, Some(m) if m <= min);
        let lower: Bound<&[u8]> = Bound::Included(min);
        let iter = if empty { None } else { Some(self.keys.range::<[u8], _>((lower, upper))) };
        iter.into_iter().flatten().map(|(k, &s)| (&k[..], s))
    }

    fn link_front(&mut self, slot: u32) {
        let old_head = self.head;
        {
            let e = self.slots[slot as usize].as_mut().unwrap();
            e.prev = NIL;
            e.next = old_head;
        }
        if old_head != NIL {
            self.slots[old_head as usize].as_mut().unwrap().prev = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = {
            let e = self.slots[slot as usize].as_ref().unwrap();
            (e.prev, e.next)
        };
        if prev != NIL {
            self.slots[prev as usize].as_mut().unwrap().next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.slots[next as usize].as_mut().unwrap().prev = prev;
        } else {
            self.tail = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(gen: u64) -> Entry {
        Entry::new(Extent { offset: 0, len: 64 }, 1, 1, 1, gen, 0)
    }

    #[test]
    fn lru_order_follows_touches() {
        let mut ix = Index::new();
        let a = ix.insert(b"a", e(1));
        let b = ix.insert(b"b", e(2));
        let c = ix.insert(b"c", e(3));
        assert_eq!(ix.least_recently_used(), Some(a));
        ix.touch(a);
        assert_eq!(ix.least_recently_used(), Some(b));
        // A replaced entry keeps its place until touched.
        let b_old = ix.replace(b, e(4));
        assert_eq!((b_old.generation, ix.entry(b).generation), (2, 4));
        assert_eq!(ix.least_recently_used(), Some(b));
        ix.touch(b);
        assert_eq!(ix.least_recently_used(), Some(c));
        ix.remove(b"b");
        ix.remove(b"c");
        assert_eq!(ix.least_recently_used(), Some(a));
        ix.remove(b"a");
        assert_eq!(ix.least_recently_used(), None);
    }

    #[test]
    fn range_is_ordered_and_half_open() {
        let mut ix = Index::new();
        for k in [&b"b"[..], b"a", b"c", b"bb"] {
            ix.insert(k, e(1));
        }
        let keys: Vec<_> = ix.range(b"a", Some(b"c")).map(|(k, _)| k.to_vec()).collect();
        assert_eq!(keys, vec![b"a".to_vec(), b"b".to_vec(), b"bb".to_vec()]);
        assert_eq!(ix.range(b"b", None).count(), 3);
        assert_eq!(ix.range(b"c", Some(b"a")).count(), 0);
    }
}
