//! A watchdog for the locks of libfabric shm regions.
//!
//! libfabric 1.17's shm provider guards each endpoint's region (its receive queue, a file
//! in /dev/shm) with a process-shared spinlock that other processes take: a sender while it
//! copies a message into the receiver's queue, the owner while it reads its own queue. A
//! process that dies or stalls while holding it (SIGKILL, a page fault that never resolves,
//! SIGSTOP) leaves it held for good, and every process that then sends to that region, or
//! polls it, spins in `pthread_spin_lock` inside libfabric: a server whose client was
//! killed inside its own progress spun at 100 % and answered no one again, and clients'
//! timeouts cannot fire while they spin inside a libfabric call.
//!
//! So each process with shm endpoints watches the locks of the regions it has mapped (its
//! own and its peers', found in /proc/self/maps) through a mapping of its own, and releases
//! a lock that stayed held for [`STUCK_AFTER`] (a healthy holder keeps it for microseconds;
//! each probe also waits up to [`PROBE_SPIN`] for it). What the dead holder was writing is
//! lost: a message whose copy it never finished, and the inject buffer it took. A holder
//! that was only stalled and later resumes finishes its critical section beside the next
//! holder; that can garble the queue of the region it held, which beats a shard wedged for
//! good.
//!
//! The lock's place is libfabric's private layout (`struct smr_region` of libfabric 1.17,
//! [`layout`]). The watchdog acts only once a region of this very process matched it
//! (the pid, mapping address, size and name each where the layout puts them), and only on
//! regions whose header matches as far as it can be checked from outside. Where the
//! layout differs (another libfabric) it stands down, and says so once.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use tracing::warn;

use super::shm_region;

/// How often the locks are probed.
const TICK: Duration = Duration::from_millis(100);
/// How often /proc/self/maps is read for regions mapped or unmapped since.
const RESCAN: Duration = Duration::from_millis(250);
/// How long one probe waits for a busy lock before counting it held.
const PROBE_SPIN: Duration = Duration::from_millis(2);
/// A lock found held by every probe for this long is released.
pub const STUCK_AFTER: Duration = Duration::from_secs(1);

/// Offsets in libfabric 1.17's `struct smr_region` (x86-64).
mod layout {
    /// `int pid`: the owner's process id.
    pub const PID: usize = 4;
    /// `void *base_addr`: where the owner mapped the region.
    pub const BASE_ADDR: usize = 16;
    /// `pthread_spinlock_t lock`.
    pub const LOCK: usize = 24;
    /// `size_t total_size`: the file's size.
    pub const TOTAL_SIZE: usize = 40;
    /// `size_t name_offset`: where the region's NUL-terminated name lies.
    pub const NAME_OFFSET: usize = 104;
    /// Bytes read to check a header.
    pub const HEADER: usize = 128;
    /// The longest name (`SMR_NAME_MAX`).
    pub const NAME_MAX: usize = 256;
}

/// Locks released in this process since it started (a metric).
static RELEASED: AtomicU64 = AtomicU64::new(0);

/// How many stuck shm region locks this process released.
pub fn locks_released() -> u64 {
    RELEASED.load(Relaxed)
}

/// Starts the watchdog thread; it ends once `keep_running` says so (no shm endpoint left).
pub fn spawn(keep_running: fn() -> bool) {
    let spawned = std::thread::Builder::new().name("rdram-shm-watch".into()).spawn(move || {
        let mut watch = Watch::default();
        while keep_running() {
            watch.tick();
            std::thread::sleep(TICK);
        }
    });
    if let Err(e) = spawned {
        warn!("cannot start the libfabric shm lock watchdog: {e}; a process that dies inside libfabric can wedge shm peers");
    }
}

/// A region mapped in this process, seen through a mapping of our own.
struct Region {
    name: String,
    owner: i32,
    /// The region's first page: ours, so it stays valid whatever libfabric unmaps.
    header: MmapRaw,
    /// Since when every probe found the lock held.
    held_since: Option<Instant>,
}

impl Region {
    fn lock(&self) -> *mut libc::pthread_spinlock_t {
        // SAFETY: the mapping is a page long and LOCK lies within it.
        unsafe { self.header.as_mut_ptr().add(layout::LOCK).cast() }
    }

    /// Whether the lock can be taken within [`PROBE_SPIN`]; taken, it is given back at once.
    fn lock_is_free(&self) -> bool {
        let deadline = Instant::now() + PROBE_SPIN;
        loop {
            // SAFETY: `lock()` points at a process-shared spinlock in a live shared mapping
            // (layout checked in `open_region`); a lock we take we release at once.
            let taken = unsafe {
                let taken = libc::pthread_spin_trylock(self.lock()) == 0;
                if taken {
                    libc::pthread_spin_unlock(self.lock());
                }
                taken
            };
            if taken {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::yield_now();
        }
    }
}

#[derive(Default)]
struct Watch {
    /// Keyed by (device, inode) as /proc/self/maps gives them.
    regions: HashMap<(String, u64), Region>,
    /// Set once one of this process's own regions matched the layout.
    layout_confirmed: bool,
    /// Set when one of them did not: the watchdog then does nothing.
    stood_down: bool,
    last_scan: Option<Instant>,
}

impl Watch {
    fn tick(&mut self) {
        if self.stood_down {
            return;
        }
        if self.last_scan.is_none_or(|t| t.elapsed() >= RESCAN) {
            self.rescan();
            self.last_scan = Some(Instant::now());
        }
        if !self.layout_confirmed {
            return;
        }
        let now = Instant::now();
        let mut stuck: Vec<(String, u64)> = Vec::new();
        for (key, region) in self.regions.iter_mut() {
            if region.lock_is_free() {
                region.held_since = None;
            } else if now.duration_since(*region.held_since.get_or_insert(now)) >= STUCK_AFTER {
                stuck.push(key.clone());
            }
        }
        // One release per tick: a holder spinning on another stuck lock (a process
        // polling its own region while it sends to a dead peer's) lets go of its own once
        // that one is free. So the dead owners' regions go first, this process's last.
        let me = std::process::id() as i32;
        let order = |r: &Region| {
            if !owner_alive(r.owner) {
                0
            } else if r.owner != me {
                1
            } else {
                2
            }
        };
        let Some(key) = stuck.into_iter().min_by_key(|k| order(&self.regions[k])) else { return };
        let region = &self.regions[&key];
        let held = region.held_since.map_or(Duration::ZERO, |t| t.elapsed());
        // SAFETY: as in `lock_is_free`; the holder is dead or stalled (see the module doc).
        unsafe { libc::pthread_spin_unlock(region.lock()) };
        RELEASED.fetch_add(1, Relaxed);
        warn!(
            "libfabric shm region {} (process {}{}) kept its lock for {:.1} s: released it (a process died or stalled inside libfabric holding it)",
            region.name,
            region.owner,
            if owner_alive(region.owner) { "" } else { ", gone" },
            held.as_secs_f64()
        );
        for r in self.regions.values_mut() {
            r.held_since = None;
        }
    }

    /// Follows the shm regions mapped in this process: new ones are opened, unmapped ones
    /// dropped.
    fn rescan(&mut self) {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
        let mut mapped = std::collections::HashSet::new();
        for line in maps.lines() {
            let Some(path_at) = line.find("/dev/shm/") else { continue };
            let mut fields = line[..path_at].split_ascii_whitespace();
            let (Some(range), Some(perms), Some(offset), Some(dev), Some(inode)) =
                (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            // libfabric maps whole regions, shared and writable.
            if !perms.starts_with("rw") || !perms.contains('s') || offset.bytes().any(|b| b != b'0') {
                continue;
            }
            let Ok(inode) = inode.parse::<u64>() else { continue };
            let key = (dev.to_string(), inode);
            if !self.regions.contains_key(&key) {
                let path = &line[path_at..];
                if let Some(region) = self.open_region(range, path, inode) {
                    self.regions.insert(key.clone(), region);
                }
            }
            mapped.insert(key);
        }
        self.regions.retain(|key, _| mapped.contains(key));
    }

    /// Opens and checks a region mapped at `range` from `path`; None for files that are
    /// not libfabric shm regions (UCX's, for one).
    fn open_region(&mut self, range: &str, path: &str, inode: u64) -> Option<Region> {
        let (path, deleted) = match path.strip_suffix(" (deleted)") {
            Some(p) => (p, true),
            None => (path, false),
        };
        let name = path.strip_prefix("/dev/shm/")?;
        // An unlinked region (its owner's files were swept) is reachable only through the
        // mapping itself (where the kernel lets us).
        let file = if deleted {
            File::options().read(true).write(true).open(format!("/proc/self/map_files/{range}")).ok()?
        } else {
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(path).ok()?
        };
        let size = file.metadata().ok().filter(|m| m.ino() == inode)?.len();
        if size < (layout::HEADER + layout::NAME_MAX) as u64 {
            return None;
        }
        let mut header = [0u8; layout::HEADER];
        file.read_exact_at(&mut header, 0).ok()?;
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
        let owner = i32::from_le_bytes(header[layout::PID..layout::PID + 4].try_into().unwrap());
        let name_offset = word(layout::NAME_OFFSET);
        if word(layout::TOTAL_SIZE) != size
            || owner <= 0
            || name_offset < layout::HEADER as u64
            || name_offset > size - layout::NAME_MAX as u64
        {
            return None;
        }
        let mut stored_name = [0u8; layout::NAME_MAX];
        file.read_exact_at(&mut stored_name, name_offset).ok()?;
        let stored_name = stored_name.split(|&b| b == 0).next()?;
        if stored_name != name.as_bytes() {
            return None;
        }
        // One of our own regions checks the rest: the owner's mapping address is ours.
        if shm_region::is_own(name) {
            let start = usize::from_str_radix(range.split('-').next()?, 16).ok()?;
            if word(layout::BASE_ADDR) != start as u64 || owner != std::process::id() as i32 {
                warn!(
                    "libfabric shm region {name} does not have the layout of libfabric 1.17; \
                     the shm lock watchdog stands down (a process that dies inside libfabric can wedge its shm peers)"
                );
                self.stood_down = true;
                return None;
            }
            self.layout_confirmed = true;
        }
        let header = MmapOptions::new().len(page_size()).map_raw(&file).ok()?;
        Some(Region { name: name.to_string(), owner, header, held_since: None })
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf takes and returns integers.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        page as usize
    } else {
        4096
    }
}

/// Whether process `pid` (in our pid namespace) is alive: exists, and is no zombie.
fn owner_alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // "PID (COMM) STATE ...": COMM may hold anything, so the state follows the last ')'.
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}
