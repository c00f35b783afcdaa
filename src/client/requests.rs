//! The requests a link has in flight, by request id.
//!
//! Ids are the connection's own and handed out in order, so those in flight at any moment
//! sit in a narrow window: a ring indexed by an id's low bits finds one with a single
//! compare, where a hash map hashed, probed and compared on every submit, every poll of a
//! wait and every reply. An id whose slot is taken (a request that outlived a ring's worth
//! of younger ones, or an abort, whose ids come from a range of their own) goes to a map
//! beside the ring; lookups try the map only when it holds something.

use rustc_hash::FxHashMap;

/// Slots in the ring: 1 KiB of them, which stays in L1 as the ids sweep it; a caller that
/// keeps more than 64 requests in flight spills the rest to the map.
const RING: usize = 64;

pub(crate) struct Requests<T> {
    ring: Vec<Option<(u64, T)>>,
    overflow: FxHashMap<u64, T>,
}

impl<T> Default for Requests<T> {
    fn default() -> Self {
        Requests { ring: std::iter::repeat_with(|| None).take(RING).collect(), overflow: FxHashMap::default() }
    }
}

fn slot(id: u64) -> usize {
    (id % RING as u64) as usize
}

impl<T> Requests<T> {
    /// Adds request `id`; returns what `id` held before, if anything.
    pub fn insert(&mut self, id: u64, value: T) -> Option<T> {
        match &mut self.ring[slot(id)] {
            Some((held, old)) if *held == id => Some(std::mem::replace(old, value)),
            Some(_) => self.overflow.insert(id, value),
            empty => {
                *empty = Some((id, value));
                // A same id parked in the map while this slot was taken would now be shadowed.
                if self.overflow.is_empty() {
                    None
                } else {
                    self.overflow.remove(&id)
                }
            }
        }
    }

    pub fn get(&self, id: &u64) -> Option<&T> {
        match &self.ring[slot(*id)] {
            Some((held, value)) if held == id => Some(value),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(id),
        }
    }

    pub fn get_mut(&mut self, id: &u64) -> Option<&mut T> {
        match &mut self.ring[slot(*id)] {
            Some((held, value)) if held == id => Some(value),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get_mut(id),
        }
    }

    pub fn remove(&mut self, id: &u64) -> Option<T> {
        let s = &mut self.ring[slot(*id)];
        if s.as_ref().is_some_and(|(held, _)| held == id) {
            return s.take().map(|(_, value)| value);
        }
        if self.overflow.is_empty() {
            None
        } else {
            self.overflow.remove(id)
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &T)> {
        self.ring.iter().flatten().map(|(id, value)| (id, value)).chain(self.overflow.iter())
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, value)| value)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.ring.iter_mut().flatten().map(|(_, value)| value).chain(self.overflow.values_mut())
    }

    /// Takes every request out.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, T)> + '_ {
        self.ring.iter_mut().filter_map(Option::take).chain(self.overflow.drain())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sharing_a_slot_are_kept_apart() {
        let mut r = Requests::default();
        let (a, b, abort) = (5, 5 + RING as u64, (1u64 << 61) + 5);
        assert_eq!(r.insert(a, "a"), None);
        assert_eq!(r.insert(b, "b"), None);
        assert_eq!(r.insert(abort, "abort"), None);
        assert_eq!((r.get(&a), r.get(&b), r.get(&abort)), (Some(&"a"), Some(&"b"), Some(&"abort")));
        assert_eq!(r.get(&(a + 1)), None);
        assert_eq!(r.insert(b, "b2"), Some("b"));
        *r.get_mut(&abort).unwrap() = "abort2";
        let mut all: Vec<_> = r.iter().map(|(&id, &v)| (id, v)).collect();
        all.sort();
        assert_eq!(all, vec![(a, "a"), (b, "b2"), (abort, "abort2")]);
        assert_eq!(r.remove(&a), Some("a"));
        assert_eq!(r.remove(&a), None);
        // The slot is free again while `b` waits in the map: `b` stays findable, and a new
        // insert of `b` lands in the slot without leaving a stale twin behind.
        assert_eq!(r.get(&b), Some(&"b2"));
        assert_eq!(r.insert(b, "b3"), Some("b2"));
        assert_eq!(r.values().count(), 2);
        assert_eq!(r.remove(&b), Some("b3"));
        assert_eq!(r.get(&b), None);
        let drained: Vec<_> = r.drain().collect();
        assert_eq!(drained, vec![(abort, "abort2")]);
        assert_eq!(r.iter().count(), 0);
    }

    #[test]
    fn a_window_of_ids_in_flight_stays_in_the_ring() {
        let mut r = Requests::default();
        for id in 0..10_000u64 {
            assert_eq!(r.insert(id, id), None);
            if id >= 16 {
                assert_eq!(r.remove(&(id - 16)), Some(id - 16));
            }
            assert!(r.overflow.is_empty());
        }
        assert_eq!(r.values_mut().count(), 16);
    }
}
