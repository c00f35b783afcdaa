//! Names for libfabric shm regions, and clean-up of the regions of processes that died.
//!
//! libfabric's shm provider backs each endpoint with a file in /dev/shm (16 MiB with the
//! default queue sizes) that it unlinks when the endpoint closes, or from its signal
//! handlers. A process killed outright (SIGKILL, OOM) leaves the file, and its memory, on
//! the host for good. By default the file is named after the process id, so once the pid
//! comes round again (pid_max is often 32768), the new process finds the stale file with
//! its own, living pid inside, and `fi_enable` fails with EBUSY.
//!
//! So every shm endpoint of ours names its region itself, `rdram-PID-NONCE`, and holds an
//! exclusive `flock` on a lock file `rdram-PID-NONCE.lock` beside it while it lives. Each
//! new shm endpoint first sweeps /dev/shm: a lock file it can lock is one whose owner is
//! gone (the kernel drops a dead process's locks), and its region files go with it. A
//! lock, unlike a pid, also tells the living from the dead across pid namespaces that
//! share /dev/shm (containers).

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use crate::error::{Error, Result, Status};

/// Where libfabric's shm provider keeps its regions (its `SMR_DIR`).
const SHM_DIR: &str = "/dev/shm";
const PREFIX: &str = "rdram-";
const LOCK_SUFFIX: &str = ".lock";

/// A region name claimed for one endpoint: the lock that marks its owner alive. Dropped
/// after the endpoint is closed (libfabric has unlinked the region by then).
pub struct RegionClaim {
    /// What to pass libfabric as the endpoint's source name.
    pub name: String,
    lock_path: PathBuf,
    _lock: File,
}

impl RegionClaim {
    /// Removes what dead owners left, then claims a fresh name.
    pub fn new() -> Result<RegionClaim> {
        sweep_dead_owners();
        // A sweeper may unlink our lock file between its creation and our flock; then
        // the path no longer names the file we hold, and we take another name.
        for _ in 0..8 {
            let name = format!("{PREFIX}{}-{:016x}", std::process::id(), random_u64()?);
            let lock_path = PathBuf::from(SHM_DIR).join(format!("{name}{LOCK_SUFFIX}"));
            let lock = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&lock_path)
                .map_err(|e| Error::new(Status::Internal, format!("cannot create {}: {e}", lock_path.display())))?;
            if !try_lock(&lock) {
                continue;
            }
            if same_file(&lock, &lock_path) {
                return Ok(RegionClaim { name, lock_path, _lock: lock });
            }
        }
        Err(Error::new(Status::Internal, format!("cannot claim a shm region name in {SHM_DIR}")))
    }
}

impl Drop for RegionClaim {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.lock_path);
    }
}

/// Whether the region named `name` is one of this process's.
pub fn is_own(name: &str) -> bool {
    name.starts_with(&format!("{PREFIX}{}-", std::process::id()))
}

/// Unlinks the region files and lock file of every owner whose lock is free.
fn sweep_dead_owners() {
    let Ok(dir) = fs::read_dir(SHM_DIR) else { return };
    let names: Vec<String> = dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    for lock_name in names.iter().filter(|n| n.starts_with(PREFIX) && n.ends_with(LOCK_SUFFIX)) {
        let lock_path = PathBuf::from(SHM_DIR).join(lock_name);
        let Ok(lock) = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&lock_path) else { continue };
        // Held: its owner lives. Gone from the path: another sweeper took it.
        if !try_lock(&lock) || !same_file(&lock, &lock_path) {
            continue;
        }
        let stem = &lock_name[..lock_name.len() - LOCK_SUFFIX.len()];
        let region_prefix = format!("{stem}:");
        for region in names.iter().filter(|n| n.starts_with(&region_prefix)) {
            let _ = fs::remove_file(PathBuf::from(SHM_DIR).join(region));
        }
        let _ = fs::remove_file(&lock_path);
    }
}

/// An exclusive lock, without waiting.
fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a descriptor `file` owns; no memory is passed.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Whether `path` still names the open `file`.
fn same_file(file: &File, path: &PathBuf) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

fn random_u64() -> Result<u64> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| Error::new(Status::Internal, format!("no randomness for a shm region name: {e}")))?;
    Ok(u64::from_le_bytes(bytes))
}
