//! What the client's transports share: a request's reply and where its payload goes, the
//! [`Link`] trait each transport implements for a [`super::conn::Connection`], waiting
//! deadlines, the abort protocol's constants, and the servers' liveness as their bootstrap
//! connections show it.

use std::marker::PhantomData;
use std::net::TcpStream;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tunables::LIVENESS_CHECK;
use crate::error::Result;
use crate::proto::bootstrap::Welcome;
use crate::proto::{ReplyHeader, RequestHeader, REQUEST_HEADER_LEN};

pub struct Reply {
    pub header: ReplyHeader,
    /// The payload, unless it went to the request's sink.
    pub payload: Vec<u8>,
    /// Payload length: bytes received, or the length of a payload that was `withheld`.
    pub len: usize,
    /// The payload was longer than the request takes (its sink, or its
    /// [`Receive::OwnedAtMost`] limit): it stayed on the server and nothing was written.
    pub withheld: bool,
}

impl Reply {
    pub(crate) fn owned(header: ReplyHeader, payload: Vec<u8>) -> Reply {
        Reply { header, len: payload.len(), payload, withheld: false }
    }
}

/// A caller's buffer that a successful reply's payload is received into directly.
#[derive(Clone, Copy)]
pub struct Sink {
    pub(crate) ptr: *mut u8,
    pub(crate) cap: usize,
    /// CUDA device memory, which only the transport writes: a payload that arrives in
    /// the link's own memory (UCX's eager data) is handed back in [`Reply::payload`]
    /// instead, for the caller to copy in with the GPU.
    pub(crate) device: bool,
}

impl Sink {
    /// The buffer must stay valid, and unused by anyone else, until the request's
    /// `wait` returns.
    pub fn new(buf: &mut [u8]) -> Sink {
        Sink { ptr: buf.as_mut_ptr(), cap: buf.len(), device: false }
    }

    /// `cap` bytes of device memory at `ptr`, for a link that takes it
    /// ([`Link::takes_device_memory`]).
    ///
    /// # Safety
    /// The range is device memory that stays valid, and unused by anyone else, until the
    /// request's `wait` returns.
    pub unsafe fn device(ptr: *mut u8, cap: usize) -> Sink {
        Sink { ptr, cap, device: true }
    }
}

/// A request's payload: host memory, or CUDA device memory that only a link that takes it
/// ([`Link::takes_device_memory`]) is given, and that nothing on the CPU reads.
#[derive(Clone, Copy)]
pub struct Payload<'a> {
    ptr: *const u8,
    len: usize,
    device: bool,
    _borrow: PhantomData<&'a [u8]>,
}

impl<'a> Payload<'a> {
    pub fn empty() -> Payload<'a> {
        Payload::host(&[])
    }

    pub fn host(bytes: &'a [u8]) -> Payload<'a> {
        Payload { ptr: bytes.as_ptr(), len: bytes.len(), device: false, _borrow: PhantomData }
    }

    /// `len` bytes of device memory at `ptr`.
    ///
    /// # Safety
    /// The range is device memory that stays valid and unchanged until the request's
    /// `wait` returns.
    pub unsafe fn device(ptr: *const u8, len: usize) -> Payload<'a> {
        Payload { ptr, len, device: true, _borrow: PhantomData }
    }

    /// The bytes, when they are host memory.
    pub fn host_bytes(&self) -> Option<&'a [u8]> {
        if self.device {
            return None;
        }
        // SAFETY: made by `host` from a slice borrowed for 'a.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_device(&self) -> bool {
        self.device
    }
}

impl<'a> From<&'a [u8]> for Payload<'a> {
    fn from(bytes: &'a [u8]) -> Payload<'a> {
        Payload::host(bytes)
    }
}

/// Where a request's successful reply payload goes.
#[derive(Clone, Copy)]
pub enum Receive {
    /// Into a `Vec` the link allocates for it.
    Owned,
    /// The same when it is at most this many bytes; a longer one stays on the server and
    /// the reply gives only its length (`Reply::withheld`), so a caller bounds what one
    /// request can make it hold before knowing the value's size.
    OwnedAtMost(usize),
    /// Straight into a caller's buffer; a payload longer than the buffer is withheld alike.
    Into(Sink),
}

impl Receive {
    pub(crate) fn sink(self) -> Option<Sink> {
        match self {
            Receive::Into(s) => Some(s),
            Receive::Owned | Receive::OwnedAtMost(_) => None,
        }
    }

    /// The longest payload the request takes.
    pub(crate) fn limit(self) -> Option<usize> {
        match self {
            Receive::Owned => None,
            Receive::OwnedAtMost(n) => Some(n),
            Receive::Into(s) => Some(s.cap),
        }
    }
}

/// Ids of a link's own abort requests: apart from the connection's request ids (counted
/// from 1) and from libfabric's hello ids (from 1 << 60).
const ABORT_ID_BASE: u64 = 1 << 59;

/// The abort of request `id`, whose encoded header is `request`: its id, and its header
/// (the session is the request's).
pub(crate) fn abort_request(id: u64, request: &[u8]) -> (u64, [u8; REQUEST_HEADER_LEN]) {
    let abort_id = ABORT_ID_BASE + id;
    let session = RequestHeader::session_in(request).unwrap_or(0);
    let mut header = [0u8; REQUEST_HEADER_LEN];
    RequestHeader::abort(abort_id, id, session).encode(&mut header);
    (abort_id, header)
}

/// What a transport does for a connection: one thread drives it, through `&mut self`.
pub(crate) trait Link: Send {
    /// Starts request `id` to a server's shard: `header` (with `header_tail` after it) and
    /// `payload` must stay valid until `wait_for(id)` returns.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        id: u64,
        server: usize,
        shard: usize,
        header: &[u8],
        header_tail: &[u8],
        payload: Payload,
        receive: Receive,
    ) -> Result<()>;
    /// Waits for request `id` to complete; a server that does not answer in `timeout` is
    /// declared gone (as is one whose connection failed).
    fn wait_for(&mut self, id: u64, timeout: Duration) -> Result<Reply>;
    /// # Safety
    /// The memory must stay valid until deregistered (or the link is dropped).
    unsafe fn register(&mut self, base: *mut u8, len: usize) -> Result<()>;
    fn deregister(&mut self, base: *mut u8) -> Result<()>;
    fn is_dead(&self, server: usize) -> bool;
    /// Connects to more servers (their welcomes and bootstrap connections), numbered after
    /// those connected already; in use once this returns.
    fn add_servers(&mut self, welcomes: &[Welcome], bootstraps: Vec<TcpStream>, timeout: Duration) -> Result<()>;
    /// One pass of progress, without sleeping, and the look for lost servers that
    /// `wait_for` makes: for callers that keep requests to several servers in flight.
    fn poll(&mut self);
    /// Whether `wait_for(id)` returns at once: request `id` was answered, failed, or is
    /// unknown.
    fn answered(&self, id: u64) -> bool;
    /// Sets how long a wait spins before it sleeps (see [`crate::ClientOptions::spin`]).
    fn set_spin(&mut self, spin: Duration);
    /// The fd that turns readable when this connection has progress to make, for callers
    /// that sleep on several things at once ([`Link::arm`] first); None where the
    /// transport has none (libfabric's shm).
    fn wait_fd(&self) -> Option<RawFd>;
    /// Prepares a sleep on [`Link::wait_fd`]: false when progress is pending already.
    fn arm(&self) -> bool;
    /// Whether requests may go with their header in its short form (see
    /// [`crate::proto::flags::SHORT_FORM`]). Not over libfabric, whose link writes fields of
    /// the full form in place (the credential, a read's limit).
    fn takes_short_headers(&self) -> bool {
        false
    }
    /// Whether a connection makes one round trip with every shard before it is used.
    fn round_trip_before_use(&self) -> bool {
        false
    }
    /// Whether device memory may be given to this link as a request's payload or sink
    /// ([`Payload::device`], [`Sink::device`]): its transport moves it itself.
    fn takes_device_memory(&self) -> bool {
        false
    }
}

/// A waiting call's deadline, started at its first clock read rather than at the call:
/// wait loops read the clock only on passes the poller marks due (within
/// [`CLOCK_EVERY`](crate::transport::CLOCK_EVERY) passes), and most small requests are
/// answered before the first one.
pub(crate) struct Deadline {
    timeout: Duration,
    at: Option<Instant>,
    /// Time left as of the last read.
    left: Duration,
}

impl Deadline {
    pub fn new(timeout: Duration) -> Deadline {
        Deadline { timeout, at: None, left: timeout }
    }

    /// Reads the clock: the time now, and whether the deadline has passed.
    pub fn read(&mut self) -> (Instant, bool) {
        let now = Instant::now();
        let at = *self.at.get_or_insert(now + self.timeout);
        self.left = at.saturating_duration_since(now);
        (now, now >= at)
    }

    /// The longest a wait may sleep now (as of the last read; at most 100 ms, so that
    /// liveness checks go on).
    pub fn max_sleep(&self) -> Duration {
        self.left.min(Duration::from_millis(100))
    }
}

/// The servers' bootstrap connections, which each server holds open while it runs: one
/// that closes means that server process is gone. Transports that cannot see a peer die
/// (libfabric RDM, UCX over shared memory) learn it here instead of at a timeout.
pub(crate) struct Liveness {
    streams: Vec<TcpStream>,
    gone: Vec<bool>,
    newly_gone: Vec<usize>,
    last_check: Instant,
    /// In a cluster: the servers' names, and those whose lease lapsed (a server stopped
    /// but not dead keeps its connection open), with the version last looked at.
    lost: Option<(Vec<String>, Arc<crate::cluster::LostServers>, u64)>,
}

impl Liveness {
    pub fn new(
        streams: Vec<TcpStream>,
        nodes: Vec<String>,
        lost: Option<Arc<crate::cluster::LostServers>>,
    ) -> Result<Liveness> {
        for s in &streams {
            s.set_nonblocking(true)?;
        }
        let lost = lost.map(|l| (nodes, l, 0));
        Ok(Liveness {
            gone: vec![false; streams.len()],
            streams,
            newly_gone: Vec::new(),
            last_check: Instant::now(),
            lost,
        })
    }

    /// Watches one more server's bootstrap connection (a server added to the connection).
    pub fn add(&mut self, stream: TcpStream, node: &str) -> Result<()> {
        stream.set_nonblocking(true)?;
        self.streams.push(stream);
        self.gone.push(false);
        if let Some((nodes, _, _)) = &mut self.lost {
            nodes.push(node.to_string());
        }
        Ok(())
    }

    /// Whether server `i` is known gone now: reported by [`Liveness::next_gone`], its
    /// bootstrap connection closed, or (in a cluster) its lease lapsed. For a post the
    /// provider takes nothing of, asked between its naps.
    pub fn is_gone(&self, i: usize) -> bool {
        let mut byte = [0u8; 1];
        self.gone[i]
            || match self.streams[i].peek(&mut byte) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            }
            || self.lost.as_ref().is_some_and(|(nodes, lost, _)| lost.contains(&nodes[i]))
    }

    /// Whether this connection is a cluster's: a member that is gone (or does not answer)
    /// while connecting is connected to as lost rather than failing the connect.
    pub fn in_cluster(&self) -> bool {
        self.lost.is_some()
    }

    /// A server whose connection closed, or that moved a shard to new endpoints
    /// ([`crate::proto::bootstrap::MOVED_NOTICE`]), each reported once; checks at most every
    /// [`LIVENESS_CHECK`], so it is cheap to call on every turn of a wait loop.
    pub fn next_gone(&mut self, now: Instant) -> Option<usize> {
        if self.newly_gone.is_empty() && now - self.last_check >= LIVENESS_CHECK {
            self.last_check = now;
            let mut byte = [0u8; 1];
            for (i, s) in self.streams.iter().enumerate() {
                let closed = match s.peek(&mut byte) {
                    Ok(0) => true,
                    Ok(_) => byte[0] == crate::proto::bootstrap::MOVED_NOTICE,
                    Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                };
                if closed && !self.gone[i] {
                    self.gone[i] = true;
                    self.newly_gone.push(i);
                }
            }
            if let Some((nodes, lost, seen)) = &mut self.lost {
                let version = lost.version();
                if version != *seen {
                    *seen = version;
                    for (i, node) in nodes.iter().enumerate() {
                        if lost.contains(node) && !self.gone[i] {
                            self.gone[i] = true;
                            self.newly_gone.push(i);
                        }
                    }
                }
            }
        }
        self.newly_gone.pop()
    }
}

/// Why requests to a server that [`Liveness::next_gone`] reported failed.
pub(crate) fn gone_reason(node: &str) -> String {
    format!("server {node} went away or moved a shard to new endpoints; the next call reconnects")
}

/// Why a server that offers shared memory cannot share it with this client (see
/// [`Welcome::shared_memory_scope`]), for the links' connect errors.
pub(crate) fn shares_no_memory(node: &str) -> String {
    format!("server {node} runs as another user, or on another host or in other namespaces, where the OS lets it share no memory with this client")
}
