//! Extent allocator for a shard's arena: best fit over a coalescing map of free extents.
//!
//! Every allocation is rounded up to [`GRANULE`] bytes (cache-line aligned values). Free
//! extents are indexed twice, by offset (to merge neighbours on free) and by size (to find
//! the smallest extent that fits), so both operations are O(log n) and fragmentation stays
//! bounded by merging: two free extents are never adjacent.

use std::collections::{BTreeMap, BTreeSet};

pub const GRANULE: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

pub struct ExtentAllocator {
    capacity: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl ExtentAllocator {
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity / GRANULE * GRANULE;
        let mut a = ExtentAllocator { capacity, by_offset: BTreeMap::new(), by_size: BTreeSet::new(), free_bytes: 0 };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    pub fn rounded(len: u64) -> u64 {
        len.max(1).div_ceil(GRANULE) * GRANULE
    }

    pub fn alloc(&mut self, len: u64) -> Option<Extent> {
        let len = Self::rounded(len);
        let &(size, offset) = self.by_size.range((len, 0)..).next()?;
        self.remove_free(offset, size);
        if size > len {
            self.insert_free(offset + len, size - len);
        }
        Some(Extent { offset, len })
    }

    pub fn free(&mut self, e: Extent) {
        let (mut offset, mut len) = (e.offset, e.len);
        debug_assert!(offset + len <= self.capacity);
        if let Some((&prev_off, &prev_len)) = self.by_offset.range(..offset).next_back() {
            debug_assert!(prev_off + prev_len <= offset, "double free of {offset}");
            if prev_off + prev_len == offset {
                self.remove_free(prev_off, prev_len);
                offset = prev_off;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.by_offset.get(&(offset + len)) {
            self.remove_free(offset + len, next_len);
            len += next_len;
        }
        self.insert_free(offset, len);
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    pub fn largest_free(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(len, _)| len)
    }

    /// 0 when all free space is one extent, approaching 1 when it is scattered.
    pub fn fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free() as f64 / self.free_bytes as f64
        }
    }

    pub fn free_extents(&self) -> usize {
        self.by_offset.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesces_back_to_one_extent() {
        let mut a = ExtentAllocator::new(64 * 100);
        let xs: Vec<_> = (0..10).map(|i| a.alloc(1 + i * 100).unwrap()).collect();
        assert!(xs.windows(2).all(|w| w[0].offset + w[0].len <= w[1].offset));
        for x in xs.iter().step_by(2) {
            a.free(*x);
        }
        assert!(a.fragmentation() > 0.0);
        for x in xs.iter().skip(1).step_by(2) {
            a.free(*x);
        }
        assert_eq!((a.free_bytes(), a.free_extents(), a.fragmentation()), (6400, 1, 0.0));
    }

    #[test]
    fn best_fit_and_exhaustion() {
        let mut a = ExtentAllocator::new(640);
        let x = a.alloc(640).unwrap();
        assert!(a.alloc(1).is_none());
        a.free(x);
        let small = a.alloc(64).unwrap();
        let big = a.alloc(256).unwrap();
        a.free(small);
        // The 64-byte hole is the best fit for a 10-byte request.
        assert_eq!(a.alloc(10).unwrap().offset, small.offset);
        assert_eq!(big.len, 256);
    }
}
