//! Transports: how bytes move between a client and a shard worker.
//!
//! [`Transport`] is what the engine's loops need from a network progress engine owned by
//! one thread (a UCX worker today; a libfabric endpoint with its completion queue next):
//! progress it, arm it and sleep on its fd, wake it from another thread, and publish its
//! address for the out-of-band bootstrap. Message movement (active messages, rendezvous
//! receives into arena slots) is specific to each transport's worker module.

pub mod fabric;
pub mod ucx;

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::error::Result;

pub trait Transport {
    /// Name announced in the bootstrap handshake.
    const NAME: &'static str;
    /// Runs completion callbacks; returns true if anything happened.
    fn progress(&self) -> bool;
    /// Prepares the event fd for sleeping; false when events are already pending.
    fn arm(&self) -> Result<bool>;
    fn event_fd(&self) -> RawFd;
    fn address(&self) -> Result<Vec<u8>>;
}

impl Transport for ucx::Worker {
    const NAME: &'static str = "ucx";
    fn progress(&self) -> bool {
        ucx::Worker::progress(self) != 0
    }
    fn arm(&self) -> Result<bool> {
        ucx::Worker::arm(self)
    }
    fn event_fd(&self) -> RawFd {
        ucx::Worker::event_fd(self)
    }
    fn address(&self) -> Result<Vec<u8>> {
        ucx::Worker::address(self)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PollMode {
    /// Spin on progress forever: lowest latency, one core per poller.
    Busy,
    /// Spin for a bounded time, then sleep on the transport's event fd.
    Adaptive,
}

/// Default spin before parking: a wake-up costs ~60 µs on these VMs, so back-to-back
/// requests (a few µs apart) must never pay it.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// Decides, after each progress pass, whether to spin on or to sleep.
pub struct Poller {
    mode: PollMode,
    spin: Duration,
    idle_since: Option<Instant>,
    /// Naps taken in a row (transports without an fd to sleep on).
    naps: u32,
}

impl Poller {
    pub fn new(mode: PollMode, spin: Duration) -> Self {
        Poller { mode, spin, idle_since: None, naps: 0 }
    }

    /// Call after each progress pass. Sleeps at most `max_sleep` once the spin budget is
    /// used up in adaptive mode; a wake-up (traffic or a `Waker`) ends the sleep early.
    pub fn after_progress<T: Transport>(&mut self, t: &T, did_work: bool, max_sleep: Duration) -> Result<()> {
        if did_work || self.mode == PollMode::Busy {
            self.idle_since = None;
            self.naps = 0;
            std::hint::spin_loop();
            return Ok(());
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.spin {
            std::hint::spin_loop();
            return Ok(());
        }
        let fd = t.event_fd();
        if fd < 0 {
            // No fd to sleep on (libfabric's shm): nap, 1 ms then longer (up to 4 ms)
            // while idle, without spinning again in between.
            let nap = fabric::rails::NAP * (1 << self.naps.min(2));
            self.naps += 1;
            std::thread::sleep(nap.min(max_sleep));
            return Ok(());
        }
        if t.arm()? {
            wait_readable(fd, max_sleep);
        }
        self.idle_since = None;
        Ok(())
    }
}

fn wait_readable(fd: RawFd, timeout: Duration) {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd on the stack; EINTR and errors just end the wait early.
    unsafe { libc::poll(&mut pfd, 1, ms.max(1)) };
}
