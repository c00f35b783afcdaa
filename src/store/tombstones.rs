//! What a replica remembers of the deletes that its keys' primaries copied to it: each
//! key's generation, for a while. A copy of an earlier write to the key that lands after
//! the delete (a large value's copy, which travels on another connection than a small
//! delete's; a copy sent again after a failure; a mover's copy of the key as it read it)
//! is then refused like a copy older than the value it would replace, instead of bringing
//! the deleted value back.
//!
//! Bounded by time, [`TOMBSTONE_HOLD`]: longer than any copy is tried, so no earlier
//! copy can land after it; and by bytes, [`TOMBSTONE_BYTES_MAX`]: past them the oldest
//! are forgotten first (under a flood of deletes, a copy that lands that late is the one
//! left unguarded).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// How long a delete is remembered: past the longest a copy of an earlier write can still
/// land (`cluster::tunables::COPY_DEADLINE`, plus its last request's timeout, checked there).
pub const TOMBSTONE_HOLD: Duration = Duration::from_secs(40);

/// Heap bytes one shard's tombstones take at most (keys and bookkeeping).
pub const TOMBSTONE_BYTES_MAX: usize = 8 << 20;

/// What one tombstone costs beside its key, twice stored (map and queue).
const TOMBSTONE_OVERHEAD: usize = 96;

#[derive(Default)]
pub struct Tombstones {
    /// Each key's deleted generation, and when (ns on the shard's clock). Keys are
    /// clients' choice: the map keeps its default, keyed hash.
    by_key: HashMap<Box<[u8]>, (u64, u64)>,
    /// The same, oldest first, to forget them in order.
    order: VecDeque<(Box<[u8]>, u64)>,
    bytes: usize,
}

impl Tombstones {
    /// Remembers that `key` was deleted at `generation`, at `now` (ns).
    pub fn remember(&mut self, key: &[u8], generation: u64, now: u64) {
        self.forget_expired(now);
        let held = self.by_key.entry(key.into()).or_insert((generation, now));
        *held = (held.0.max(generation), now);
        self.order.push_back((key.into(), now));
        self.bytes += 2 * key.len() + TOMBSTONE_OVERHEAD;
        while self.bytes > TOMBSTONE_BYTES_MAX {
            self.forget_oldest();
        }
    }

    /// The generation `key` was deleted at, if that is remembered at `now`.
    pub fn generation(&self, key: &[u8], now: u64) -> Option<u64> {
        let (generation, at) = *self.by_key.get(key)?;
        (now.saturating_sub(at) < TOMBSTONE_HOLD.as_nanos() as u64).then_some(generation)
    }

    /// Forgets the tombstones older than [`TOMBSTONE_HOLD`] at `now`.
    pub fn forget_expired(&mut self, now: u64) {
        let hold = TOMBSTONE_HOLD.as_nanos() as u64;
        while self.order.front().is_some_and(|(_, at)| now.saturating_sub(*at) >= hold) {
            self.forget_oldest();
        }
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    fn forget_oldest(&mut self) {
        let Some((key, at)) = self.order.pop_front() else { return };
        self.bytes -= 2 * key.len() + TOMBSTONE_OVERHEAD;
        // A later delete of the key left an entry of its own in the queue: kept until then.
        if self.by_key.get(&key).is_some_and(|&(_, last)| last == at) {
            self.by_key.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn a_delete_is_remembered_for_its_hold_and_the_latest_counts() {
        let mut t = Tombstones::default();
        t.remember(b"k", 7, SECOND);
        assert_eq!(t.generation(b"k", SECOND), Some(7));
        assert_eq!(t.generation(b"other", SECOND), None);
        // A later delete of the same key keeps it remembered from then on.
        t.remember(b"k", 5, 30 * SECOND);
        assert_eq!(t.generation(b"k", 60 * SECOND), Some(7), "the higher generation, from the later delete on");
        assert_eq!(t.generation(b"k", 70 * SECOND), None, "past its hold");
        t.forget_expired(41 * SECOND);
        assert_eq!(t.len(), 1, "the first delete's queue entry went, the key stays");
        t.forget_expired(71 * SECOND);
        assert!(t.is_empty() && t.order.is_empty() && t.bytes == 0);
    }

    #[test]
    fn past_their_bytes_the_oldest_are_forgotten_first() {
        let mut t = Tombstones::default();
        let key = |i: usize| format!("{i:0>1000}").into_bytes();
        let fit = TOMBSTONE_BYTES_MAX / (2 * 1000 + TOMBSTONE_OVERHEAD);
        for i in 0..fit + 10 {
            t.remember(&key(i), i as u64 + 1, SECOND);
        }
        assert!(t.bytes <= TOMBSTONE_BYTES_MAX);
        assert_eq!(t.len(), fit);
        assert_eq!(t.generation(&key(0), SECOND), None, "the oldest went");
        assert_eq!(t.generation(&key(fit + 9), SECOND), Some(fit as u64 + 10));
    }
}
