//! A shard's DRAM: one anonymous mapping, backed by the best pages we can get, faulted in
//! ahead of use so that requests rarely pay a page fault.
//!
//! Faulting in gigabytes takes seconds, so it does not hold the server's start: where the
//! kernel can fault pages in without touching their bytes (`MADV_POPULATE_WRITE`, Linux
//! 5.14), a thread of the shard's (on its worker's cores, so the pages land on its NUMA
//! node) does it in the background once the server listens ([`fault_in_from_now_on`]:
//! start-up's own work, mmaps included, does not wait behind it), while the shard serves;
//! values written meanwhile are untouched by it. Elsewhere every page is touched before the shard starts. hugetlb pages
//! are mapped populated.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use memmap2::{MmapMut, MmapOptions};
use serde::Serialize;

use crate::error::{Error, Result, Status};

pub const HUGE_PAGE: usize = 2 << 20;
const SMALL_PAGE: usize = 4096;
/// How much the background thread faults in per system call. The call holds the process's
/// memory-map lock (for reading) throughout, which every mmap of other threads waits for:
/// one huge page at a time keeps those waits short.
const POPULATE_STEP: usize = 2 << 20;

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
    /// The thread faulting the mapping in, stopped and joined before the mapping goes.
    populating: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
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
                Ok(map) => return Ok(Arena { map, backing: Backing::Hugetlb2M, populating: None }),
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
        let mut arena = Arena { map, backing, populating: None };
        let first = POPULATE_STEP.min(arena.len());
        if arena.map.advise_range(memmap2::Advice::PopulateWrite, 0, first).is_ok() {
            if first < arena.len() {
                arena.populate_in_background(first);
            }
        } else {
            arena.prefault();
        }
        Ok(arena)
    }

    /// Faults in the mapping from `from` on, `POPULATE_STEP` at a time, on a thread of its own.
    fn populate_in_background(&mut self, from: usize) {
        let (base, len) = (self.map.as_mut_ptr() as usize, self.map.len());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let populate = move || {
            // At normal priority, so that no call is preempted for long while it holds the
            // memory-map lock (a holder starved at idle priority, or at nice 19 beside busy
            // threads, stalled every other thread's mmap: a new client's connect waited for
            // it for up to 0.8 s); paced instead, so that it never takes a CPU whole.
            if !wait_for_fault_in(&stopped) {
                return;
            }
            let mut at = from;
            while at < len && !stopped.load(Ordering::Relaxed) {
                let step = POPULATE_STEP.min(len - at);
                let started = std::time::Instant::now();
                // SAFETY: [base + at, base + at + step) lies in the arena's mapping, which stays
                // mapped until Arena::drop has joined this thread; MADV_POPULATE_WRITE faults
                // pages in without reading or writing their bytes.
                if unsafe { libc::madvise((base + at) as *mut libc::c_void, step, libc::MADV_POPULATE_WRITE) } != 0 {
                    tracing::warn!(
                        "faulting the shard's memory in stopped at {} of {} MiB: {}; the rest faults in on use",
                        at >> 20,
                        len >> 20,
                        std::io::Error::last_os_error()
                    );
                    return;
                }
                at += step;
                // Half of one CPU at most: the rest is the workers' and their first clients'.
                std::thread::sleep(started.elapsed());
            }
        };
        match std::thread::Builder::new().name("rdram-fault-in".into()).spawn(populate) {
            Ok(thread) => self.populating = Some((stop, thread)),
            Err(_) => self.prefault(),
        }
    }

    /// Waits until the whole mapping is faulted in.
    #[cfg(test)]
    fn wait_faulted_in(&mut self) {
        if let Some((_, thread)) = self.populating.take() {
            let _ = thread.join();
        }
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

impl Drop for Arena {
    fn drop(&mut self) {
        // The mapping goes with `map`, after this: no thread may still be faulting it in.
        if let Some((stop, thread)) = self.populating.take() {
            stop.store(true, Ordering::Relaxed);
            FAULT_IN.1.notify_all();
            let _ = thread.join();
        }
    }
}

/// Whether arenas may fault themselves in yet: closed until a server of this process
/// listens, then open for good.
static FAULT_IN: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

/// Lets every arena of this process fault itself in in the background, from now on: a
/// server calls it once it listens.
pub fn fault_in_from_now_on() {
    *FAULT_IN.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
    FAULT_IN.1.notify_all();
}

/// Waits until arenas may fault themselves in; false if `stop` came first.
fn wait_for_fault_in(stop: &AtomicBool) -> bool {
    let mut open = FAULT_IN.0.lock().unwrap_or_else(|p| p.into_inner());
    while !*open {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        open =
            FAULT_IN.1.wait_timeout(open, std::time::Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
    }
    !stop.load(Ordering::Relaxed)
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

    #[test]
    fn an_arena_faulted_in_meanwhile_keeps_what_was_written() {
        let len = 40 * POPULATE_STEP + SMALL_PAGE;
        let mut a = Arena::new(len, HugePages::Off).unwrap();
        let at = (len - SMALL_PAGE) as u64;
        a.slice_mut(at, 5).copy_from_slice(b"early");
        a.slice_mut(POPULATE_STEP as u64 + 7, 4).copy_from_slice(b"mid!");
        fault_in_from_now_on();
        a.wait_faulted_in();
        assert_eq!(a.slice(at, 5), b"early");
        assert_eq!(a.slice(POPULATE_STEP as u64 + 7, 4), b"mid!");
        assert!(a.slice(0, 4096).iter().all(|&b| b == 0));
        // Dropped while faulting in: stopped and joined first.
        drop(Arena::new(len, HugePages::Off).unwrap());
    }

    #[test]
    fn an_arena_waiting_to_fault_in_can_go() {
        // Whether or not another test opened the gate, the waiting thread ends with it.
        drop(Arena::new(8 * POPULATE_STEP, HugePages::Off).unwrap());
    }
}
