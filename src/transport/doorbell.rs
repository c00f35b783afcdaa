//! What wakes a sleeping thread when work reaches it from another thread: an eventfd, so
//! that the thread sleeps on it and on its transports' fds at once. A replicator thread's
//! rings when a copy is handed over or more of a streamed value landed (over libfabric tcp
//! a copy's bytes move only while its sender drives progress, so the thread sleeps on its
//! connections too); a libfabric shard worker's, when a replicator thread's copy ended.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result, Status};

pub(crate) struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    pub(crate) fn new() -> Result<Doorbell> {
        // SAFETY: a plain syscall; the fd it returns is ours alone.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            let why = std::io::Error::last_os_error();
            return Err(Error::new(Status::Internal, format!("cannot make an eventfd to wake a thread: {why}")));
        }
        // SAFETY: a valid fd that nothing else owns.
        Ok(Doorbell { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Makes the fd readable until [`Doorbell::clear`].
    pub(crate) fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our own eventfd. It fails only with EAGAIN, when the
        // counter is near its limit, and then the fd is readable already.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Makes the fd unreadable again. Call before looking for what rang it: a ring after
    /// the look then ends the next sleep at once.
    pub(crate) fn clear(&self) {
        let mut count = [0u8; 8];
        // SAFETY: an 8-byte read from our own nonblocking eventfd (EAGAIN when not rung).
        unsafe { libc::read(self.fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Sleeps until one of `fds` is readable, or `timeout` passed.
pub(crate) fn sleep_on(fds: &[RawFd], timeout: std::time::Duration) {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let timeout = timeout.min(std::time::Duration::from_secs(3600));
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: `pfds` is a valid array of its length and `ts` a valid timespec; EINTR and
    // errors end the sleep early.
    unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, &ts, std::ptr::null()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_ring_ends_the_sleep_until_cleared() {
        let bell = Doorbell::new().unwrap();
        bell.ring();
        bell.ring();
        let t = Instant::now();
        sleep_on(&[bell.fd()], Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(4), "a rung bell wakes the sleeper");
        bell.clear();
        let t = Instant::now();
        sleep_on(&[bell.fd()], Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(19), "cleared, it no longer does");
    }
}
