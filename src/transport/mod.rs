//! Transports: how bytes move between a client and a shard worker.
//!
//! [`Transport`] is what the engine's idle loops need from a network progress engine owned
//! by one thread (a UCX worker, or libfabric rails with their completion queues): arm it
//! and sleep on its fd. How
//! messages move differs too much to share one interface (UCX: active messages with
//! rendezvous received in callbacks; libfabric: tagged messages into posted buffers and
//! one-sided reads), so what is shared sits one level up: the server's `Service` decides
//! what a request does for both shard workers (`ucx::server`, `fabric::server`), and the client's
//! `Connection` drives either link through its `Link` trait.

pub(crate) mod doorbell;
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

/// This process's place for shared memory, whatever its transports: two processes with the
/// same one can map each other's segments, over UCX's shared-memory transports or
/// libfabric's `shm` (whose regions are their owner's alone).
pub fn local_scope() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let ns = |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).ok().map(|p| p.to_string_lossy().into_owned());
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    // Hashed: peers compare it, and need not learn the host's boot id or namespaces.
    let scope = format!("{} {} {} uid:{uid}", boot.trim(), ns("ipc")?, ns("pid")?);
    Some(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(scope.as_bytes())))
}

/// The name of the network interface that holds `ip` ("lo" for 127.0.0.1), if any.
pub fn interface_of(ip: std::net::IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a chain it allocates, freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = list;
    while !at.is_null() && found.is_none() {
        // SAFETY: `at` is a node of the chain getifaddrs returned, alive until freeifaddrs.
        let node = unsafe { &*at };
        at = node.ifa_next;
        if node.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says how long it is.
        let addr: Option<std::net::IpAddr> = unsafe {
            match (*node.ifa_addr).sa_family as i32 {
                libc::AF_INET => Some(
                    std::net::Ipv4Addr::from(u32::from_be(
                        (*(node.ifa_addr as *const libc::sockaddr_in)).sin_addr.s_addr,
                    ))
                    .into(),
                ),
                libc::AF_INET6 => Some(
                    std::net::Ipv6Addr::from((*(node.ifa_addr as *const libc::sockaddr_in6)).sin6_addr.s6_addr).into(),
                ),
                _ => None,
            }
        };
        if addr == Some(ip) {
            // SAFETY: ifa_name is a NUL-terminated string of the node.
            found = Some(unsafe { std::ffi::CStr::from_ptr(node.ifa_name) }.to_string_lossy().into_owned());
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PollMode {
    /// Spin on progress forever: lowest latency, one core per poller.
    Busy,
    /// Spin for a bounded time, then sleep on the transport's event fd.
    Adaptive,
}

/// Default spin before parking: a wake-up from a sleep costs tens of µs on a VM, so
/// back-to-back requests (a few µs apart) must never pay it.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// Turns between clock reads while spinning. Reading the clock costs as much as a progress
/// pass that finds nothing (on a VM more: a quarter of a busy-polling server's and client's
/// cycles went to it), and what it measures here — spin budgets, sweeps, deadlines — is
/// counted in hundreds of microseconds or more.
pub const CLOCK_EVERY: u32 = 16;

/// The same for busy polling, where a pass that finds nothing is shorter still and the
/// clock read sat on the path between a message's arrival and its detection.
pub const BUSY_CLOCK_EVERY: u32 = 256;

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
    /// Until when a transfer this side posted may still be under way (see
    /// [`Poller::expect_transfer`]).
    transfer_until: Option<Instant>,
    /// Rung by other threads with work for this one: a sleep ends when it rings.
    doorbell: Option<std::sync::Arc<doorbell::Doorbell>>,
}

/// The copy rate assumed for [`Poller::expect_transfer`] (1 GB/s): well below what shared
/// memory copies, so a transfer ends before its spin does.
const EXPECTED_BYTES_PER_US: u64 = 1000;
/// The longest spin a transfer buys: a peer that stalls costs at most this much CPU.
const TRANSFER_SPIN_MAX: Duration = Duration::from_millis(20);

impl Poller {
    pub fn new(mode: PollMode, spin: Duration) -> Self {
        Poller {
            mode,
            spin,
            idle_since: None,
            idle_turns: 0,
            naps: 0,
            turns: 0,
            slept: false,
            transfer_until: None,
            doorbell: None,
        }
    }

    /// Makes each sleep end when `doorbell` rings too (the transport has no way to wake
    /// this thread for work that another thread finished). It is cleared after each sleep,
    /// before the caller looks for that work.
    pub(crate) fn wake_on(&mut self, doorbell: std::sync::Arc<doorbell::Doorbell>) {
        self.doorbell = Some(doorbell);
    }

    /// Changes how long an idle wait spins before it sleeps (adaptive mode), from its next
    /// clock check on, the idle spell under way included.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Whether the caller's own clock checks (deadlines, sweeps) are due before this pass:
    /// on the first pass, every [`CLOCK_EVERY`] passes ([`BUSY_CLOCK_EVERY`] when busy
    /// polling), and after a sleep.
    pub fn clock_due(&self) -> bool {
        let every = if self.mode == PollMode::Busy { BUSY_CLOCK_EVERY } else { CLOCK_EVERY };
        self.slept || self.turns % every == 0
    }

    /// Says that a transfer of `bytes` was just posted and will end in progress passes
    /// that find nothing before it does. On a transport without an fd to sleep on
    /// (libfabric's shm), an idle loop naps a millisecond at a time, and one that naps
    /// while a large copy runs (the peer copies from or into our memory) answers up to a
    /// millisecond late, which tripled a 4 MiB GET's time. So the spin lasts until
    /// the copy should be over, bounded by `TRANSFER_SPIN_MAX`.
    pub fn expect_transfer(&mut self, bytes: usize) {
        let expected = self.spin + Duration::from_micros(bytes as u64 / EXPECTED_BYTES_PER_US);
        let until = Instant::now() + expected.min(TRANSFER_SPIN_MAX);
        self.transfer_until = Some(self.transfer_until.map_or(until, |t| t.max(until)));
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
        let idle = since.elapsed();
        if idle < self.spin {
            if idle >= YIELD_AFTER && self.idle_turns % YIELD_EVERY == 0 {
                // Where spinning threads outnumber free CPUs, the thread with work waits
                // for this one's spin to end unless it gives the CPU up now and then.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        let fd = t.event_fd();
        if fd < 0 {
            if let Some(until) = self.transfer_until {
                if Instant::now() < until {
                    std::hint::spin_loop();
                    return Ok(());
                }
                self.transfer_until = None;
            }
            self.slept = true;
            // No fd to sleep on (libfabric's shm): nap, 1 ms then longer (up to 4 ms)
            // while idle, without spinning again in between.
            let nap = NAP * (1 << self.naps.min(2));
            self.naps += 1;
            match &self.doorbell {
                Some(bell) => {
                    doorbell::sleep_on(&[bell.fd()], nap.min(max_sleep));
                    bell.clear();
                }
                None => std::thread::sleep(nap.min(max_sleep)),
            }
            self.idle_turns = CLOCK_EVERY - 1;
            return Ok(());
        }
        self.slept = true;
        if t.arm()? {
            // poll(2) skips a negative fd: without a doorbell, the transport's alone.
            let bell = self.doorbell.as_ref().map_or(-1, |bell| bell.fd());
            doorbell::sleep_on(&[fd, bell], max_sleep.max(Duration::from_millis(1)));
            if let Some(bell) = &self.doorbell {
                bell.clear();
            }
        }
        self.idle_since = None;
        Ok(())
    }
}

/// How long an idle spin runs before it starts to yield its CPU: back-to-back requests,
/// a few µs apart, never pay for a yield.
const YIELD_AFTER: Duration = Duration::from_micros(10);
/// Idle passes between yields once it does (a multiple of [`CLOCK_EVERY`]): rare enough
/// that a request seldom arrives while the thread is in the system call.
const YIELD_EVERY: u32 = 8 * CLOCK_EVERY;

/// How long an idle loop first naps when the transport has no fd to sleep on.
const NAP: Duration = Duration::from_millis(1);

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport like libfabric's shm: nothing to sleep on.
    struct NoFd;
    impl Transport for NoFd {
        fn arm(&self) -> Result<bool> {
            Ok(true)
        }
        fn event_fd(&self) -> RawFd {
            -1
        }
    }

    /// Idle passes until the poller naps; None if it had not within `passes`.
    fn passes_before_nap(p: &mut Poller, passes: u32) -> Option<u32> {
        (1..=passes).find(|_| {
            p.after_progress(&NoFd, false, Duration::from_millis(1)).unwrap();
            p.slept
        })
    }

    #[test]
    fn an_expected_transfer_keeps_a_fd_less_poller_spinning_then_lets_it_nap() {
        let mut idle = Poller::new(PollMode::Adaptive, Duration::ZERO);
        assert_eq!(
            passes_before_nap(&mut idle, 1000),
            Some(CLOCK_EVERY),
            "with nothing expected it naps once the spin is used up"
        );

        let mut waiting = Poller::new(PollMode::Adaptive, Duration::ZERO);
        waiting.expect_transfer(64 << 20); // the cap: TRANSFER_SPIN_MAX of spin
        assert_eq!(passes_before_nap(&mut waiting, 4 * CLOCK_EVERY), None, "it spins while the transfer may still run");
        std::thread::sleep(TRANSFER_SPIN_MAX);
        assert!(passes_before_nap(&mut waiting, CLOCK_EVERY).is_some(), "the spin a transfer buys is bounded");
        assert!(waiting.transfer_until.is_none());
    }

    /// A transport with an fd that never becomes readable: no traffic.
    struct Quiet(doorbell::Doorbell);
    impl Transport for Quiet {
        fn arm(&self) -> Result<bool> {
            Ok(true)
        }
        fn event_fd(&self) -> RawFd {
            self.0.fd()
        }
    }

    /// Idle passes until the poller sleeps once; how long that pass took.
    fn sleep_once(p: &mut Poller, t: &Quiet, max_sleep: Duration) -> Duration {
        loop {
            let started = Instant::now();
            p.after_progress(t, false, max_sleep).unwrap();
            if p.slept {
                return started.elapsed();
            }
        }
    }

    #[test]
    fn a_doorbell_ends_a_sleep_on_the_transport_and_is_cleared_after() {
        let quiet = Quiet(doorbell::Doorbell::new().unwrap());
        let bell = std::sync::Arc::new(doorbell::Doorbell::new().unwrap());
        let mut p = Poller::new(PollMode::Adaptive, Duration::ZERO);
        p.wake_on(bell.clone());
        let ringer = {
            let bell = bell.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                bell.ring();
            })
        };
        assert!(sleep_once(&mut p, &quiet, Duration::from_secs(30)) < Duration::from_secs(20), "the ring woke it");
        ringer.join().unwrap();
        let slept = sleep_once(&mut p, &quiet, Duration::from_millis(30));
        assert!(slept >= Duration::from_millis(29), "cleared, the bell no longer ends a sleep ({slept:?})");
    }

    #[test]
    fn a_spin_set_later_holds_from_the_next_clock_check() {
        let mut p = Poller::new(PollMode::Adaptive, Duration::from_secs(60));
        assert_eq!(passes_before_nap(&mut p, 4 * CLOCK_EVERY), None, "it spins out its minute");
        p.set_spin(Duration::ZERO);
        assert_eq!(
            passes_before_nap(&mut p, 4 * CLOCK_EVERY),
            Some(CLOCK_EVERY),
            "with no spin left it naps at its first clock check"
        );
    }
}
