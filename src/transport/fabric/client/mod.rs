//! The client's libfabric link: rails (one RDM endpoint per NIC domain), every shard
//! worker's addresses in their address vectors, our slot at each worker (from the hello),
//! and the requests in flight. The wire format is in `proto::fabric`.
//!
//! Buffer ownership: a request's message and reply buffer live in its pooled, boxed
//! `Pending`; the reply receive is posted before the request is sent. A payload too large
//! for one message stays in the caller's buffer (registered, for the worker's one-sided
//! reads) until the reply arrives, which the worker sends only after its reads finished.
//! A large reply payload is received straight into the caller's sink (or a Vec). When a
//! server is given up on, receives still posted are cancelled before `wait` returns.
//!
//! RDM endpoints do not report a peer that died, so while waiting the link watches each
//! server's bootstrap connection ([`Liveness`]).

mod completions;
mod connect;
mod giving_up;

use crate::client::requests::Requests;
use std::time::{Duration, Instant};

use crate::client::link::{
    abort_request, gone_reason, shares_no_memory, Deadline, Link, Liveness, Payload, Receive, Reply, Sink,
};
use crate::client::tunables::{ABORT_GRACE, CANCEL_DRAIN};
use crate::client::ClientOptions;
use crate::error::{Error, Result, Status};
use crate::proto::bootstrap::Welcome;
use crate::proto::fabric::{self as wire, Hello, RemoteValue};
use crate::proto::{flags, Op, ReplyHeader, RequestHeader, REPLY_HEADER_LEN, REQUEST_HEADER_LEN};
use crate::transport::fabric::ops::Finished;
use crate::transport::fabric::rails::stripes;
use crate::transport::fabric::{Completion, InFlight, MemoryRegion, PeerAddr, Rails, RemoteAccess};
use crate::transport::Poller;

/// Hello ids live apart from request ids (which count up from 1).
const HELLO_ID_BASE: u64 = 1 << 60;

struct Shard {
    /// The worker's address on each rail, our slot at the worker and the credential our
    /// requests carry there (in the header's session field).
    peers: Vec<PeerAddr>,
    slot: u32,
    credential: u64,
}

struct Server {
    node: String,
    shards: Vec<Shard>,
    dead: Option<String>,
}

#[derive(Clone, Copy)]
enum Step {
    Send,
    ReplyHeader,
    ReplyData,
}

struct LinkOp {
    request: u64,
    step: Step,
}

struct Pending {
    server: usize,
    shard: usize,
    /// Its payload stays in the caller's memory, registered for the worker to read.
    remote_payload: bool,
    msg: Vec<u8>,
    /// Where each part of `msg` ends when it travels in parts (see
    /// `proto::fabric::split_request`); empty when it goes as one message.
    part_ends: Vec<usize>,
    reply_buf: Vec<u8>,
    /// Registrations of `msg` and `reply_buf` when the provider requires local ones.
    own_mr: Option<(Vec<MemoryRegion>, Vec<MemoryRegion>)>,
    /// A registration made just for this request (a remote payload or a sink).
    temp_mr: Vec<Vec<MemoryRegion>>,
    sink: Option<Sink>,
    /// The longest successful payload this request takes (see `Receive::limit`).
    limit: Option<usize>,
    sent: bool,
    header_op: Option<u32>,
    data_op: Option<(u32, usize)>,
    data_buf: Vec<u8>,
    reply: Option<Result<Reply>>,
    /// Nobody waits for it any more (see `forget_request`): what still arrives for it is
    /// received into our own buffers and dropped.
    abandoned: bool,
}

struct Region {
    base: usize,
    len: usize,
    mrs: Vec<MemoryRegion>,
}

pub struct FabricLink {
    /// Dropped explicitly at the end of Drop (after every registration was released and
    /// before the buffers below are freed), so nothing in flight outlives its memory;
    /// never, when the link is poisoned.
    rails: std::mem::ManuallyDrop<Rails>,
    /// A receive into a caller's buffer could not be ended: nothing may drive or close
    /// these endpoints again (see `retire`).
    poisoned: bool,
    servers: Vec<Server>,
    /// By request id.
    pending: Requests<Box<Pending>>,
    #[allow(clippy::vec_box)] // boxed: the provider holds their buffers' addresses
    pool: Vec<Box<Pending>>,
    ops: InFlight<LinkOp>,
    registered: Vec<Region>,
    completions: Vec<Completion>,
    poller: Poller,
    liveness: Liveness,
}

// SAFETY: the domains are opened `FI_THREAD_SAFE`, so their endpoints may be driven from
// any thread; a link is driven through `&mut self` only and is not Sync, and its raw
// pointers point at buffers the link owns.
unsafe impl Send for FabricLink {}

impl FabricLink {
    fn take_pending(&mut self, server: usize) -> Box<Pending> {
        let mut p = self.pool.pop().unwrap_or_else(|| {
            let msg = Vec::with_capacity(wire::REQUEST_MSG_MAX);
            let reply_buf = vec![0u8; wire::REPLY_MSG_MAX];
            let own_mr = if self.rails.needs_local_registration() {
                let local = |ptr, len| self.rails.register(ptr, len, RemoteAccess::None).ok();
                local(msg.as_ptr(), wire::REQUEST_MSG_MAX).zip(local(reply_buf.as_ptr(), reply_buf.len()))
            } else {
                None
            };
            Box::new(Pending {
                server,
                shard: 0,
                remote_payload: false,
                msg,
                part_ends: Vec::new(),
                reply_buf,
                own_mr,
                temp_mr: Vec::new(),
                sink: None,
                limit: None,
                sent: false,
                header_op: None,
                data_op: None,
                data_buf: Vec::new(),
                reply: None,
                abandoned: false,
            })
        });
        p.server = server;
        p.remote_payload = false;
        p.msg.clear();
        p.part_ends.clear();
        p.sink = None;
        p.limit = None;
        p.sent = false;
        p.header_op = None;
        p.data_op = None;
        p.reply = None;
        p.abandoned = false;
        p
    }

    /// The registration covering `[ptr, ptr+len)` on every rail, kept in `temp` for the
    /// request's lifetime. For local use a caller-registered region serves; memory a
    /// worker will read (`RemoteAccess::Read`) always gets a registration of its own, so
    /// it is readable only while its request is in flight, and only that range.
    fn registration_for(
        &self,
        ptr: *const u8,
        len: usize,
        remote: RemoteAccess,
        temp: &mut Vec<Vec<MemoryRegion>>,
    ) -> Result<Vec<(*mut std::ffi::c_void, u64, u64)>> {
        let (p, end) = (ptr as usize, ptr as usize + len);
        let describe = |mrs: &[MemoryRegion], base: usize| {
            mrs.iter().map(|m| (m.desc, m.key, m.remote_base + (p - base) as u64)).collect()
        };
        if remote == RemoteAccess::None {
            if let Some(r) = self.registered.iter().find(|r| r.base <= p && end <= r.base + r.len) {
                return Ok(describe(&r.mrs, r.base));
            }
        }
        let mrs = self.rails.register(ptr, len.max(1), remote)?;
        let d = describe(&mrs, p);
        temp.push(mrs);
        Ok(d)
    }

    /// Posts the reply receive, then sends `p.msg` to a shard with `kind` in the tag.
    fn post(&mut self, id: u64, mut p: Box<Pending>, shard: usize, kind: u64) -> Result<()> {
        let server = p.server;
        p.shard = shard;
        let target = &self.servers[server].shards[shard];
        let (peer, slot) = (target.peers[0], target.slot);
        let (msg_desc, reply_desc) =
            p.own_mr.as_ref().map_or((std::ptr::null_mut(), std::ptr::null_mut()), |(m, r)| (m[0].desc, r[0].desc));
        let header_op = self.ops.start(LinkOp { request: id, step: Step::ReplyHeader }, 1);
        let ctx = self.ops.ctx(header_op, 0);
        // SAFETY: reply_buf lives in the boxed Pending, kept (or leaked, see fail_server)
        // until this receive completes.
        let posted = unsafe {
            self.rails.eps[0].recv(
                p.reply_buf.as_mut_ptr(),
                p.reply_buf.len(),
                reply_desc,
                wire::REPLY | (id & wire::ID_MASK),
                0,
                ctx,
            )
        };
        if let Err(e) = posted {
            self.ops.not_posted(header_op, 1, e.clone());
            self.release(p);
            return Err(e);
        }
        p.header_op = Some(header_op);
        let tag = kind | if kind == wire::HELLO { 0 } else { slot as u64 };
        let whole = [p.msg.len()];
        let ends = if p.part_ends.is_empty() { &whole[..] } else { &p.part_ends[..] };
        let part = |k: usize| (if k == 0 { 0 } else { ends[k - 1] })..ends[k];
        let mut failed = None;
        let liveness = &self.liveness;
        let gone = || liveness.is_gone(server);
        if (0..ends.len()).all(|k| part(k).len() <= self.rails.eps[0].inject_size) {
            // Copied by the provider before each call returns: sent, and no completion
            // follows (one less to reap on each side of a small request's round trip).
            for k in 0..ends.len() {
                if let Err(e) = self.rails.eps[0].inject_unless(&p.msg[part(k)], peer, tag, &gone) {
                    failed = Some((k, e));
                    break;
                }
            }
            p.sent = true;
        } else {
            let send_op = self.ops.start(LinkOp { request: id, step: Step::Send }, ends.len());
            for k in 0..ends.len() {
                let range = part(k);
                let ctx = self.ops.ctx(send_op, k);
                // SAFETY: msg lives in the boxed Pending until every part's send completes
                // (`sent`); the range lies within it.
                if let Err(e) = unsafe {
                    self.rails.eps[0].send_unless(
                        p.msg.as_ptr().add(range.start),
                        range.len(),
                        msg_desc,
                        peer,
                        tag,
                        ctx,
                        &gone,
                    )
                } {
                    self.ops.not_posted(send_op, ends.len() - k, e.clone());
                    failed = Some((k, e));
                    break;
                }
            }
        }
        self.pending.insert(id, p);
        if let Some((k, e)) = failed {
            self.fail_server(
                server,
                Status::Unavailable,
                format!("sending to {} failed: {e}", self.servers[server].node),
            );
            if k > 0 {
                // Parts are on their way from `msg` (or were injected): the request stays
                // pending (failed) until their sends complete, and its waiter gets the
                // error then.
                return Ok(());
            }
            let p = self.pending.remove(&id);
            if let Some(p) = p {
                self.release(p);
            }
            return Err(e);
        }
        Ok(())
    }

    fn release(&mut self, mut p: Box<Pending>) {
        for mrs in p.temp_mr.drain(..) {
            self.rails.deregister(mrs);
        }
        if p.data_buf.capacity() > 0 {
            p.data_buf = Vec::new();
        }
        self.pool.push(p);
    }
}

impl Link for FabricLink {
    fn submit(
        &mut self,
        id: u64,
        server: usize,
        shard: usize,
        header: &[u8],
        header_tail: &[u8],
        payload: Payload,
        receive: Receive,
    ) -> Result<()> {
        // Device memory is staged by the caller: this link moves host memory only.
        let (Some(payload), false) = (payload.host_bytes(), receive.sink().is_some_and(|s| s.device)) else {
            return Err(Error::new(Status::Invalid, "a libfabric link takes no device memory"));
        };
        if let Some(why) = &self.servers[server].dead {
            return Err(Error::new(
                Status::Unavailable,
                format!("connection to {} lost: {why}", self.servers[server].node),
            ));
        }
        let mut p = self.take_pending(server);
        p.sink = receive.sink();
        p.limit = receive.limit();
        p.msg.extend_from_slice(header);
        p.msg.extend_from_slice(header_tail);
        let credential = self.servers[server].shards.get(shard).map_or(0, |s| s.credential);
        RequestHeader::set_session_in(&mut p.msg, credential);
        if let (Some(limit), Some(&op)) = (p.limit, header.get(3)) {
            if op == Op::Get as u8 && p.msg.len() >= REQUEST_HEADER_LEN {
                // Declare what the request takes: a longer value is not sent, only its size.
                p.msg[56..64].copy_from_slice(&(limit as u64 + 1).to_le_bytes());
            }
        }
        let part_max = self.rails.one_message_max(wire::REQUEST_MSG_MAX);
        if wire::split_len(p.msg.len() + payload.len(), part_max) <= wire::REQUEST_MSG_MAX {
            p.msg.extend_from_slice(payload);
            // Longer than shm's inline size: in parts that each go inline.
            wire::split_request(&mut p.msg, part_max, &mut p.part_ends);
        } else {
            // Too long for one message: the worker reads it from our memory.
            let mut temp = std::mem::take(&mut p.temp_mr);
            let regs = match self.registration_for(payload.as_ptr(), payload.len(), RemoteAccess::Read, &mut temp) {
                Ok(r) => r,
                Err(e) => {
                    p.temp_mr = temp;
                    self.release(p);
                    return Err(e);
                }
            };
            p.temp_mr = temp;
            p.remote_payload = true;
            // The worker reads it while we wait for its reply.
            self.poller.expect_transfer(payload.len());
            if p.msg.len() >= 8 {
                let flags_now = u32::from_le_bytes(p.msg[4..8].try_into().unwrap()) | flags::REMOTE_VALUE;
                p.msg[4..8].copy_from_slice(&flags_now.to_le_bytes());
            }
            RemoteValue { len: payload.len() as u64, rails: regs.iter().map(|r| (r.2, r.1)).collect() }
                .encode(&mut p.msg);
        }
        self.post(id, p, shard, wire::REQUEST)
    }

    fn wait_for(&mut self, id: u64, timeout: Duration) -> Result<Reply> {
        let mut deadline = Deadline::new(timeout);
        loop {
            let (done, server) = match self.pending.get(&id) {
                Some(p) => (p.sent && p.reply.is_some() && p.header_op.is_none() && p.data_op.is_none(), p.server),
                None => return Err(Error::new(Status::Internal, format!("unknown request {id}"))),
            };
            if done {
                let mut p = self.pending.remove(&id).unwrap();
                let reply = p.reply.take().unwrap();
                self.release(p);
                return reply;
            }
            if self.poller.clock_due() {
                let (now, passed) = deadline.read();
                if passed {
                    let why = format!("no answer from {} within {timeout:?}", self.servers[server].node);
                    return Err(self.give_up(id, Error::new(Status::Timeout, why)));
                }
                if let Some(gone) = self.liveness.next_gone(now) {
                    self.fail_server(gone, Status::Unavailable, gone_reason(&self.servers[gone].node));
                    continue;
                }
            }
            let did = self.progress();
            self.poller.after_progress(&*self.rails, did, deadline.max_sleep())?;
        }
    }

    unsafe fn register(&mut self, base: *mut u8, len: usize) -> Result<()> {
        if self.registered.iter().any(|r| r.base == base as usize) {
            return Err(Error::new(Status::Invalid, "region already registered"));
        }
        // Local descriptors only: a put from this region still gets a short-lived
        // readable registration of its own (see registration_for).
        let mrs = self.rails.register(base, len, RemoteAccess::None)?;
        self.registered.push(Region { base: base as usize, len, mrs });
        Ok(())
    }

    fn deregister(&mut self, base: *mut u8) -> Result<()> {
        let i = self
            .registered
            .iter()
            .position(|r| r.base == base as usize)
            .ok_or_else(|| Error::new(Status::Invalid, "region not registered"))?;
        let r = self.registered.remove(i);
        self.rails.deregister(r.mrs);
        Ok(())
    }

    fn is_dead(&self, server: usize) -> bool {
        self.servers[server].dead.is_some()
    }

    fn poll(&mut self) {
        if let Some(gone) = self.liveness.next_gone(Instant::now()) {
            self.fail_server(gone, Status::Unavailable, gone_reason(&self.servers[gone].node));
        }
        self.progress();
    }

    fn answered(&self, id: u64) -> bool {
        self.pending
            .get(&id)
            .is_none_or(|p| p.sent && p.reply.is_some() && p.header_op.is_none() && p.data_op.is_none())
    }

    fn add_servers(
        &mut self,
        welcomes: &[Welcome],
        bootstraps: Vec<std::net::TcpStream>,
        timeout: Duration,
    ) -> Result<()> {
        for (w, stream) in welcomes.iter().zip(bootstraps) {
            self.liveness.add(stream, &w.node)?;
        }
        self.connect_servers(welcomes, timeout)
    }

    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        let fd = crate::transport::Transport::event_fd(&*self.rails);
        (fd >= 0).then_some(fd)
    }

    fn arm(&self) -> bool {
        crate::transport::Transport::arm(&*self.rails).unwrap_or(false)
    }

    fn set_spin(&mut self, spin: Duration) {
        // Without an fd to sleep on (shm), an idle wait naps a millisecond at a time once
        // its spin is spent: a spin shorter than the one it was made with would make
        // replies wait for the naps. It keeps that one.
        if crate::transport::Transport::event_fd(&*self.rails) >= 0 {
            self.poller.set_spin(spin);
        }
    }
}

impl Drop for FabricLink {
    fn drop(&mut self) {
        // Replies given up on that are on their way (or already here) are taken before
        // the endpoints close (see `forget_request`); a server that sends nothing within
        // the bound is not waited for.
        let deadline = Instant::now() + CANCEL_DRAIN;
        while !self.poisoned && self.pending.values().any(|p| p.abandoned) && Instant::now() < deadline {
            if !self.progress() {
                std::thread::yield_now();
            }
        }
        // What did not come is cancelled: closing an rxm endpoint with receives still
        // posted crashed libfabric 1.17.
        let left: Vec<u64> = self.pending.iter().filter(|(_, p)| p.abandoned).map(|(&id, _)| id).collect();
        if !self.poisoned && !left.is_empty() {
            self.cancel_receives(&left);
            // One that neither came nor could be cancelled: the endpoints are left alone.
            self.poisoned = left
                .iter()
                .any(|id| self.pending.get(id).is_some_and(|p| p.header_op.is_some() || p.data_op.is_some()));
            if !self.poisoned {
                for id in left {
                    self.discard(id);
                }
            }
        }
        if self.poisoned {
            // Endpoints, registrations and the buffers they may still write are leaked
            // on purpose (see `retire`).
            for p in self.pool.drain(..).chain(self.pending.drain().map(|(_, p)| p)) {
                std::mem::forget(p);
            }
            return;
        }
        // Registrations close before their domains (the rails, dropped last here). Our
        // slots at the workers are freed when the bootstrap connections (in `liveness`)
        // close.
        for r in std::mem::take(&mut self.registered) {
            self.rails.deregister(r.mrs);
        }
        for p in self.pool.drain(..).chain(self.pending.drain().map(|(_, p)| p)) {
            for mrs in p.temp_mr {
                self.rails.deregister(mrs);
            }
            if let Some((m, r)) = p.own_mr {
                self.rails.deregister(m);
                self.rails.deregister(r);
            }
        }
        // SAFETY: dropped once, here; nothing uses the rails afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.rails) };
    }
}
