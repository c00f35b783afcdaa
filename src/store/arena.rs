//! A shard's DRAM: one anonymous mapping, backed by the best pages we can get, pre-faulted
//! so that no request pays a page fault.

use memmap2::{MmapMut, MmapOptions};
use serde::Serialize;

use crate::error::{Error, Result, Status};

pub const HUGE_PAGE: usize = 2 << 20;
const SMALL_PAGE: usize = 4096;

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HugePages {
    /// hugetlb pages if reserved, else transparent huge pages, else 4 KiB pages.
    Auto,
    /// hugetlb 2 MiB pages or fail.
    On,
    /// 4 KiB pages only.
    Off,
}

/// What backs the mapping in the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Backing {
    #[serde(rename = "hugetlb_2m")]
    Hugetlb2M,
    #[serde(rename = "transparent_huge")]
    TransparentHuge,
    #[serde(rename = "pages_4k")]
    Pages4K,
}

impl Backing {
    pub fn describe(self) -> &'static str {
        match self {
            Backing::Hugetlb2M => "hugetlb 2 MiB pages",
            Backing::TransparentHuge => "transparent huge pages",
            Backing::Pages4K => "4 KiB pages",
        }
    }
}

pub struct Arena {
    map: MmapMut,
    backing: Backing,
}

impl Arena {
    pub fn new(size: usize, hugepages: HugePages) -> Result<Arena> {
        if size == 0 {
            return Err(Error::new(Status::Invalid, "shard memory must be larger than 0"));
        }
        if hugepages != HugePages::Off {
            let rounded = size.div_ceil(HUGE_PAGE) * HUGE_PAGE;
            // MAP_HUGETLB fails at mmap time when not enough pages are reserved; MAP_POPULATE
            // faults them all in now.
            match MmapOptions::new().len(rounded).huge(Some(21)).populate().map_anon() {
                Ok(map) => return Ok(Arena { map, backing: Backing::Hugetlb2M }),
                Err(e) if hugepages == HugePages::On => {
                    return Err(Error::new(
                        Status::NoSpace,
                        format!("--hugepages on: cannot map {rounded} bytes of hugetlb pages ({e}); reserve more in /proc/sys/vm/nr_hugepages"),
                    ))
                }
                Err(_) => {}
            }
        }
        let map = MmapOptions::new().len(size).map_anon()?;
        let mut backing = Backing::Pages4K;
        if hugepages == HugePages::Auto && map.advise(memmap2::Advice::HugePage).is_ok() && thp_enabled() {
            backing = Backing::TransparentHuge;
        }
        let mut arena = Arena { map, backing };
        arena.prefault();
        Ok(arena)
    }

    /// Touches every page once so the kernel backs it now rather than on a request's path.
    fn prefault(&mut self) {
        let step = SMALL_PAGE;
        let base = self.map.as_mut_ptr();
        let len = self.map.len();
        let mut at = 0;
        while at < len {
            // SAFETY: at < len, inside our own writable mapping; a volatile write keeps the
            // compiler from eliding the touch.
            unsafe { base.add(at).write_volatile(0) };
            at += step;
        }
    }

    pub fn backing(&self) -> Backing {
        self.backing
    }

    #[allow(clippy::len_without_is_empty)] // never empty: new() refuses size 0
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }

    pub fn slice(&self, offset: u64, len: u64) -> &[u8] {
        &self.map[offset as usize..(offset + len) as usize]
    }

    pub fn slice_mut(&mut self, offset: u64, len: u64) -> &mut [u8] {
        &mut self.map[offset as usize..(offset + len) as usize]
    }
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.contains("[always]") || s.contains("[madvise]"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_without_hugepages_is_4k_and_writable() {
        let mut a = Arena::new(1 << 20, HugePages::Off).unwrap();
        assert_eq!(a.backing(), Backing::Pages4K);
        a.slice_mut(100, 3).copy_from_slice(b"abc");
        assert_eq!(a.slice(100, 3), b"abc");
    }
}
