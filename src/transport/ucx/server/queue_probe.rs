//! A watchdog for a UCX shard worker's receive queue.
//!
//! Over UCX's shared-memory transports every local client writes its messages straight into
//! one FIFO in the shard worker's shared memory: a sender claims a slot (an atomic bump of
//! the head), copies its message in, then marks the slot written. A client killed between
//! the two leaves a slot that is never marked, and UCX's reader waits on it for ever: the
//! shard answers no one again, and spins (it cannot arm its event fd past the unread slot).
//! Nothing in UCX's API can skip that slot, so the shard watches for it from outside.
//!
//! The probe is a second UCX worker, on the shard's own thread, connected to the shard's
//! worker like any client (so over shared memory when clients are). Every
//! [`PROBE_INTERVAL`] it sends an [`crate::proto::AM_PROBE`] carrying a random
//! nonce; the shard notes the last nonce it received. A nonce still unseen after
//! [`PROBE_DEADLINE`], while the shard's worker finds nothing to do, means the queue is
//! stuck: the shard then replaces its UCX worker (see `ShardWorker::replace_stuck_worker`).
//! Only a worker that has answered a probe before can be found stuck: where the probe cannot
//! reach the shard at all (a transport without loopback), it never replaces anything, and
//! says so once.

use std::ffi::c_void;
use std::ptr;
use std::time::Instant;

use tracing::{debug, warn};

use crate::error::Result;
use crate::proto::AM_PROBE;
use crate::server::tunables::{PROBE_CLOSE_LIMIT, PROBE_DEADLINE, PROBE_INTERVAL, PROBE_UNANSWERED_WARNING};
use crate::transport::ucx::{self, sys, Started, Worker};

pub struct QueueProbe {
    /// The probe's own worker; its endpoint is closed (in Drop) before it is destroyed.
    worker: Worker,
    /// Null until connected.
    ep: sys::ucp_ep_h,
    /// The probe in flight: its nonce and when it was sent.
    outstanding: Option<(u64, Instant)>,
    last_sent: Option<Instant>,
    /// Whether the current shard worker has received a probe yet, and when it was connected.
    answered: bool,
    connected_at: Instant,
    warned_unanswered: bool,
}

impl QueueProbe {
    pub fn new(tcp: &crate::transport::ucx::Tcp) -> Result<QueueProbe> {
        let worker = Worker::new(tcp)?;
        Ok(QueueProbe {
            worker,
            ep: ptr::null_mut(),
            outstanding: None,
            last_sent: None,
            answered: false,
            connected_at: Instant::now(),
            warned_unanswered: false,
        })
    }

    /// Points the probe at a (new) shard worker; the previous endpoint is closed.
    pub fn connect(&mut self, address: &[u8]) -> Result<()> {
        self.disconnect();
        // SAFETY: no error callback; the endpoint is closed in disconnect() before the worker goes.
        let (ep, _) = unsafe { self.worker.connect(address, None, ptr::null_mut())? };
        self.ep = ep;
        self.outstanding = None;
        self.last_sent = None;
        self.answered = false;
        self.connected_at = Instant::now();
        Ok(())
    }

    fn disconnect(&mut self) {
        if !self.ep.is_null() {
            // SAFETY: ep is this worker's live endpoint, closed once (then nulled).
            if let Some(request) = unsafe { self.worker.close_ep_nb(self.ep) } {
                // A forced close completes locally; progress until it has (bounded: a close
                // that never ends must not hang a shard, and its request then stays UCX's).
                let deadline = Instant::now() + PROBE_CLOSE_LIMIT;
                // SAFETY: request came from close_ep_nb and is freed once, by request_done_free.
                while !unsafe { ucx::request_done_free(request) } && Instant::now() < deadline {
                    self.worker.progress();
                }
            }
            self.ep = ptr::null_mut();
        }
    }

    /// Called at the shard's sweeps with the last nonce the shard received and whether
    /// its worker was idle on its last turn. True when the queue is stuck.
    pub fn tick(&mut self, seen: u64, shard_idle: bool, now: Instant) -> bool {
        self.worker.progress();
        match self.outstanding {
            Some((nonce, _)) if nonce == seen => {
                self.outstanding = None;
                self.answered = true;
            }
            Some((_, sent)) if now.duration_since(sent) < PROBE_DEADLINE => return false,
            // Overdue: the queue is stuck if the shard's worker finds nothing to read. The
            // probe is forgotten, so a replacement that failed is retried only after a new
            // probe is overdue again (not at every sweep).
            Some(_) if self.answered => {
                if shard_idle {
                    self.outstanding = None;
                }
                return shard_idle;
            }
            // Never answered on this worker: the path may not exist; keep trying.
            Some(_) => {
                if !self.warned_unanswered && now.duration_since(self.connected_at) >= PROBE_UNANSWERED_WARNING {
                    self.warned_unanswered = true;
                    warn!("queue probe: the shard worker never received a probe; a stuck receive queue will not be detected");
                }
                self.outstanding = None;
            }
            None => {}
        }
        if self.ep.is_null() || self.last_sent.is_some_and(|t| now.duration_since(t) < PROBE_INTERVAL) {
            return false;
        }
        let nonce = random_nonce();
        let header = Box::into_raw(Box::new(nonce.to_le_bytes()));
        // SAFETY: ep is live; the header box lives until the send completes (freed here when
        // it completed inside the call, else in on_probe_sent).
        let started = unsafe {
            self.worker.am_send(
                self.ep,
                AM_PROBE,
                &*header,
                (ptr::null(), 0, ucx::Memory::Host),
                0,
                Some(on_probe_sent),
                header as *mut c_void,
                ptr::null_mut(),
            )
        };
        match started {
            Ok(Started::Pending) => {}
            // SAFETY: the send is over; the box is reclaimed once, here.
            Ok(Started::Done) => drop(unsafe { Box::from_raw(header) }),
            Err(e) => {
                // SAFETY: as above.
                drop(unsafe { Box::from_raw(header) });
                debug!("queue probe not sent: {e}");
                return false;
            }
        }
        self.outstanding = Some((nonce, now));
        self.last_sent = Some(now);
        false
    }
}

impl Drop for QueueProbe {
    fn drop(&mut self) {
        self.disconnect();
    }
}

fn random_nonce() -> u64 {
    let mut bytes = [0u8; 8];
    // A nonce only has to be unguessable by clients (which could otherwise answer for a
    // stuck queue); on the unlikely failure the clock still differs per probe.
    if getrandom::getrandom(&mut bytes).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        bytes = now.map_or(1, |d| d.as_nanos() as u64).to_le_bytes();
    }
    // Never 0: that is what the shard has "seen" before any probe arrived.
    u64::from_le_bytes(bytes).max(1)
}

unsafe extern "C" fn on_probe_sent(request: *mut c_void, _status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the header box leaked in tick for this send; request is its handle.
    unsafe {
        drop(Box::from_raw(user_data as *mut [u8; 8]));
        ucx::request_free(request);
    }
}

/// The nonce of an [`AM_PROBE`] header (0 for anything malformed, which no probe sends).
pub fn probe_nonce(header: &[u8]) -> u64 {
    header.try_into().map_or(0, u64::from_le_bytes)
}
