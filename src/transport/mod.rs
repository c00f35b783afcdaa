//! Transports: how bytes move between a client and a shard worker.
//!
//! [`Transport`] is what the engine's idle loops need from a network progress engine owned
//! by one thread (a UCX worker, or libfabric rails with their completion queues): arm it
//! and sleep on its fd. How
//! messages move differs too much to share one interface (UCX: active messages with
//! rendezvous received in callbacks; libfabric: tagged messages into posted buffers and
//! one-sided reads), so what is shared sits one level up: the server's `Service` decides
//! what a request does for both `ucx_worker` and `fabric_worker`, and the client's
//! `Connection` drives either link through its `Link` trait.

pub mod fabric;
pub mod ucx;

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::error::Result;

/// What an idle loop needs from its thread's progress engine to sleep until traffic.
pub trait Transport {
    /// Prepares the event fd for sleeping; false when events are already pending.
    fn arm(&self) -> Result<bool>;
    /// The fd to sleep on, or -1 when there is none (then the poller naps).
    fn event_fd(&self) -> RawFd;
}

impl Transport for ucx::Worker {
    fn arm(&self) -> Result<bool> {
        ucx::Worker::arm(self)
    }
    fn event_fd(&self) -> RawFd {
        ucx::Worker::event_fd(self)
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

/// Turns between clock reads while spinning. Reading the clock costs as much as a progress
/// pass that finds nothing (on these VMs more: it was 28 % of a busy-polling server's and
/// client's cycles), and what it measures here — spin budgets, sweeps, deadlines — is
/// counted in hundreds of microseconds or more.
pub const CLOCK_EVERY: u32 = 16;

/// Decides, after each progress pass, whether to spin on or to sleep.
pub struct Poller {
    mode: PollMode,
    spin: Duration,
    idle_since: Option<Instant>,
    /// Progress passes in a row that found nothing.
    idle_turns: u32,
    /// Naps taken in a row (transports without an fd to sleep on).
    naps: u32,
    /// All passes, for [`Poller::clock_due`].
    turns: u32,
    /// Whether the last pass ended in a sleep (or a wait on the fd).
    slept: bool,
}

impl Poller {
    pub fn new(mode: PollMode, spin: Duration) -> Self {
        Poller { mode, spin, idle_since: None, idle_turns: 0, naps: 0, turns: 0, slept: false }
    }

    /// Whether the caller's own clock checks (deadlines, sweeps) are due before this pass:
    /// on the first pass, every [`CLOCK_EVERY`] passes, and after a sleep.
    pub fn clock_due(&self) -> bool {
        self.slept || self.turns % CLOCK_EVERY == 0
    }

    /// Call after each progress pass. Sleeps at most `max_sleep` once the spin budget is
    /// used up in adaptive mode; a wake-up (traffic or a `Waker`) ends the sleep early.
    pub fn after_progress<T: Transport>(&mut self, t: &T, did_work: bool, max_sleep: Duration) -> Result<()> {
        self.turns = self.turns.wrapping_add(1);
        self.slept = false;
        if did_work || self.mode == PollMode::Busy {
            // No pause instruction here: it lengthens each pass (tens of cycles on these
            // CPUs), and with it the time until the next message is seen.
            self.idle_since = None;
            self.idle_turns = 0;
            self.naps = 0;
            return Ok(());
        }
        self.idle_turns = self.idle_turns.wrapping_add(1);
        if self.idle_turns % CLOCK_EVERY != 0 {
            std::hint::spin_loop();
            return Ok(());
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.spin {
            std::hint::spin_loop();
            return Ok(());
        }
        self.slept = true;
        let fd = t.event_fd();
        if fd < 0 {
            // No fd to sleep on (libfabric's shm): nap, 1 ms then longer (up to 4 ms)
            // while idle, without spinning again in between.
            let nap = fabric::rails::NAP * (1 << self.naps.min(2));
            self.naps += 1;
            std::thread::sleep(nap.min(max_sleep));
            self.idle_turns = CLOCK_EVERY - 1;
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
