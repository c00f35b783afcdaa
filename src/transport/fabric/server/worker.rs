//! A shard worker over libfabric: one pinned thread that owns its rails (one RDM endpoint
//! per NIC domain), the clients' addresses, and one shard. The wire format is in
//! `proto::fabric`; what a request does is decided by [`Service`].
//!
//! Buffer ownership (who may touch which bytes when):
//! - Request buffers are slices of one slab, each posted as a receive; the provider owns a
//!   slice until its completion, after which the request is served and the slice posted
//!   again.
//! - A reply's header (and small payload) lives in a pooled [`ReplyBuf`], owned by the
//!   provider from the send until its completion returns it to the pool.
//! - A large get reply is sent straight from the arena, its extent pinned until every
//!   stripe's send completed, so a concurrent delete or overwrite defers the free.
//! - A large put is read from the client's memory into a reserved extent that is not yet
//!   in the index; when every stripe's read completed it is committed, and when one failed
//!   (the client vanished) the extent is released.
//!
//! This file holds the worker, its loop, completions and how a request is served; the rest
//! is split by concern: `slots` (hellos and clients' slots), `reads` (pulling put values),
//! `replies` (sends, the backlog, aborts) and `recovery` (replacing failed rails).

use rustc_hash::FxHashSet;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::error::{Error, Result, Status};
use crate::proto::fabric::{self as wire, Hello, RemoteValue};
use crate::proto::{flags, Kind, Op, ReplyHeader, RequestHeader, REPLY_HEADER_LEN};
use crate::server::reply_backlog::ReplyBacklog;
use crate::server::service::{self, Answer, PendingPut, Request, Service};
use crate::server::tunables::{
    COPY_WAIT_MAX, FABRIC_RETIRED_GRACE, READ_CHUNK, READ_WINDOW_PER_RAIL, RECV_BUFS, SHUTDOWN_DRAIN,
    STREAM_READ_CHUNK, SWEEP_BATCH, SWEEP_EVERY, SWEEP_INTERVAL,
};
use crate::server::{FreedMemory, RetryBackoff, WorkerInfo};
use crate::transport::doorbell::Doorbell;
use crate::transport::fabric::ops::{Finished, Progress};
use crate::transport::fabric::rails::{stripe_len, stripes};
use crate::transport::fabric::{Completion, InFlight, MemoryRegion, PeerAddr, Rails, RemoteAccess};
use crate::transport::{PollMode, Poller};

mod reads;
mod recovery;
mod replies;
mod slots;

/// A one-sided read of a client's payload, in chunks dealt round-robin over the rails
/// with a bounded window in flight: some providers (shm) copy inside the post, so
/// chunking keeps the worker answering other clients during a 1 GiB put.
struct ReadPlan {
    dest: *mut u8,
    descs: Vec<*mut std::ffi::c_void>,
    peer: Vec<PeerAddr>,
    /// The client's address and key on each rail.
    remote: Vec<(u64, u64)>,
    len: usize,
    chunk: usize,
    next: usize,
    chunks: usize,
    failed: bool,
    /// The client gave up on the request: answer this abort once the reads in flight
    /// are back (none is posted after it).
    abort: Option<u64>,
    /// When the read is given up on if it has not finished (the client stopped progressing).
    deadline: Instant,
    /// Chunks posted and not yet back.
    in_flight: BTreeSet<usize>,
    /// A put whose value is streamed to its replicas as it lands: set to the bytes
    /// landed from its start (see `Service::stream_put`).
    landed: Option<crate::cluster::replication::Landed>,
}

/// Rails given up on, and what their peers may still read through them: reply buffers
/// and pinned extents (over shm with CMA a receiver copies from our memory itself).
struct Retired {
    rails: Rails,
    regions: Vec<Vec<MemoryRegion>>,
    _buffers: Vec<Vec<u8>>,
    _recv_slab: Vec<u8>,
    pinned: Vec<u64>,
    since: Instant,
}

/// A reply message: header, and the payload when it fits.
struct ReplyBuf {
    bytes: Vec<u8>,
    /// Registration of `bytes` on rail 0, when the provider requires local registration.
    mr: Option<Vec<MemoryRegion>>,
}

/// A client that said hello: where it is on each rail, and the credential its requests
/// must carry (so a client cannot act as another by naming its slot).
struct Peer {
    addrs: Vec<PeerAddr>,
    credential: u64,
    /// Its bootstrap connection: when that closes, the slot is freed.
    client_id: u64,
    /// A request arriving in parts (see `proto::fabric`): its id and the bytes so far,
    /// at most REQUEST_MSG_MAX. One per client, freed with its slot.
    joining: Option<(u64, Vec<u8>)>,
}

/// What an operation in flight is, to finish it when it completes.
enum WorkerOp {
    Recv {
        buf: usize,
    },
    /// `owner`/`charged`: the client whose backlog it counts in, and its bytes there.
    Reply {
        msg: ReplyBuf,
        owner: u64,
        charged: u64,
    },
    /// A payload sent on its own (striped): pins its extent or owns its bytes meanwhile.
    /// `key`: its entry in `sends` while it pins an extent.
    Data {
        pinned: Option<u64>,
        key: (u64, u64),
        _owned: Vec<u8>,
        temp_mr: Option<Vec<MemoryRegion>>,
        owner: u64,
        charged: u64,
    },
    /// A put value being read from the client into a reserved extent.
    ReadPut {
        to: Client,
        put: PendingPut,
        plan: ReadPlan,
    },
    /// Any other request whose payload had to be read from the client (admitted on
    /// arrival; served when the payload is here).
    ReadPayload {
        to: Client,
        header: RequestHeader,
        kind: Kind,
        inline: Vec<u8>,
        buf: Vec<u8>,
        temp_mr: Option<Vec<MemoryRegion>>,
        plan: ReadPlan,
    },
}

/// Who an answer goes to: a slot, and the client (bootstrap connection) that held it
/// when the request came. A slot freed and handed to another client meanwhile does not
/// get the first one's late answers.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Client {
    slot: u32,
    id: u64,
}

/// The buffers requests are received into, every page faulted in now (the arena is too, in the background):
/// the provider fills them in turn, so pages left to fault on first use would keep adding
/// to the resident set long after start.
fn recv_slab() -> Vec<u8> {
    // Written with a non-zero byte: zeroed memory may come from pages not faulted in yet.
    let mut slab = Vec::with_capacity(RECV_BUFS * wire::REQUEST_MSG_MAX);
    slab.resize(RECV_BUFS * wire::REQUEST_MSG_MAX, 1u8);
    slab
}

pub struct FabricShardWorker {
    /// First: dropped first, so no endpoint outlives the buffers it may write.
    rails: Rails,
    /// Endpoints replaced by `replace_rails`, never progressed again, kept for a grace.
    retired: Vec<Retired>,
    /// Set when the endpoints must be replaced (see `replace_rails`), until they are.
    replace_due: bool,
    replace_retry: RetryBackoff,
    /// What departed clients held goes back to the system (see [`FreedMemory`]).
    freed: FreedMemory,
    /// How the rails were opened, to open their replacements alike.
    provider: String,
    listen: std::net::IpAddr,
    /// What the bootstrap hands out; changes when the rails are replaced.
    address: crate::server::ShardAddress,
    pub(crate) service: Service,
    arena_mr: Vec<MemoryRegion>,
    recv_mr: Vec<MemoryRegion>,
    recv_slab: Vec<u8>,
    reply_pool: Vec<ReplyBuf>,
    /// Owned reply payload the service writes into (reused).
    scratch: Vec<u8>,
    /// Each client slot's address on every rail and credential.
    peers: Vec<Option<Peer>>,
    free_slots: Vec<u32>,
    ops: InFlight<WorkerOp>,
    /// Reads of client memory in flight, by (client, request id): what an abort names.
    /// Keyed by client, not slot: a reused slot's new holder counts request ids from 1.
    reads: HashMap<(u64, u64), u32>,
    /// Writes whose answer waits for their copies to the keys' other replicas, by the
    /// service's token: the client the answer goes to.
    deferred: HashMap<u64, Client>,
    /// Reply payloads being sent from pinned extents, by (client, request id).
    sends: HashMap<(u64, u64), u32>,
    /// Per client: reply messages not yet completed and their owned bytes. A client that
    /// does not receive stops being served at the bounds below. (Client ids are ours,
    /// counted up: a fast hash is safe.)
    backlog: ReplyBacklog,
    /// Clients a send to which found their queue full for `fabric::POST_STALL_LIMIT` (dead
    /// or stalled): their further requests and replies are dropped at once, not waited on
    /// again, until they depart. One that was only stalled times out and reconnects.
    unresponsive: FxHashSet<u64>,
    /// See [`crate::server::ServerConfig::stall_timeout`].
    stall_timeout: Duration,
    /// Bytes of reply payloads sent since the last poll pass: the receiver copies them
    /// while this loop finds nothing to do (see [`Poller::expect_transfer`]).
    sent_payload: usize,
}

impl FabricShardWorker {
    /// Builds the worker on the calling thread (the one that will run it).
    pub fn new(
        service: Service,
        provider: &str,
        listen: std::net::IpAddr,
        rails: usize,
        stall_timeout: Duration,
    ) -> Result<Box<Self>> {
        let rails = Rails::open(provider, Some(listen), rails)?;
        // No remote access to anything of ours: replies are sends, and put values are
        // read by us from the client. A peer that guesses keys finds nothing to read.
        let arena = service.arena();
        let arena_mr = rails.register(arena.base(), arena.len(), RemoteAccess::None)?;
        let recv_slab = recv_slab();
        let recv_mr = rails.register(recv_slab.as_ptr(), recv_slab.len(), RemoteAccess::None)?;
        let address = crate::server::ShardAddress::new(wire::encode_addresses(&rails.addresses()?));
        let mut w = Box::new(FabricShardWorker {
            rails,
            retired: Vec::new(),
            replace_due: false,
            replace_retry: RetryBackoff::new(),
            freed: FreedMemory::new(),
            provider: provider.to_string(),
            listen,
            address,
            backlog: ReplyBacklog::new(service.reply_budget().clone()),
            service,
            arena_mr,
            recv_mr,
            recv_slab,
            reply_pool: Vec::new(),
            scratch: Vec::new(),
            peers: Vec::new(),
            free_slots: Vec::new(),
            ops: InFlight::default(),
            reads: HashMap::new(),
            deferred: HashMap::new(),
            sends: HashMap::new(),
            unresponsive: FxHashSet::default(),
            stall_timeout,
            sent_payload: 0,
        });
        w.service.set_named_clients(0);
        for buf in 0..RECV_BUFS {
            w.post_recv(buf)?;
        }
        Ok(w)
    }

    pub fn info(&self) -> Result<WorkerInfo> {
        let arena = self.service.arena();
        Ok(WorkerInfo {
            address: self.address.clone(),
            transport: format!("fabric ({})", self.rails.describe()),
            backing: arena.backing(),
            bytes: arena.len() as u64,
            metrics: self.service.metrics().clone(),
        })
    }

    /// Serves until `stop` is set; notices it within [`SWEEP_INTERVAL`].
    pub fn run(mut self: Box<Self>, mode: PollMode, spin: Duration, stop: Arc<AtomicBool>) {
        let mut poller = Poller::new(mode, spin);
        // Rung by the replicator threads as their copies end: libfabric has no way to
        // wake this thread for them.
        match Doorbell::new() {
            Ok(bell) => {
                let bell = Arc::new(bell);
                let ring = bell.clone();
                self.service.set_copy_wake(move || ring.ring());
                poller.wake_on(bell);
            }
            Err(e) => warn!("shard {}: {e}; copies' ends are looked for every millisecond", self.service.index()),
        }
        let mut last_sweep = Instant::now();
        let mut turns = 0u32;
        let mut done: Vec<Completion> = Vec::with_capacity(64);
        while !stop.load(Ordering::Relaxed) {
            let mut did_work = self.rails.poll(&mut done) > 0;
            turns = turns.wrapping_add(1);
            let copying = self.service.copies_in_flight();
            if copying {
                did_work |= self.service.drive_copies();
                did_work |= self.answer_copied();
                if !did_work && self.service.copy_expected_soon() {
                    std::thread::yield_now();
                    continue;
                }
            }
            for c in done.drain(..) {
                match self.ops.progress(c) {
                    Progress::Finished(f) => self.finished(f),
                    Progress::Part { id, part, failed } => {
                        self.chunk_back(id, part, failed);
                        self.pump_reads(id, failed)
                    }
                    Progress::Nothing => {}
                }
            }
            // Swept when idle, and under constant load too (the clock read only every
            // SWEEP_EVERY busy turns, or when the poller says so while idle).
            let clock_due = if did_work { turns % SWEEP_EVERY == 0 } else { poller.clock_due() };
            if clock_due && last_sweep.elapsed() >= SWEEP_INTERVAL {
                self.service.sweep(SWEEP_BATCH);
                self.forget_departed();
                self.cut_stalled_reads();
                self.service.publish_metrics(self.reads.len());
                let now = Instant::now();
                self.freed.return_if_due(now);
                if self.replace_due && self.replace_retry.ready(now) {
                    match self.replace_rails() {
                        Ok(()) => {
                            self.replace_due = false;
                            self.replace_retry.succeeded();
                        }
                        Err(e) => {
                            self.service.metrics().worker_replacement_failed();
                            let again = self.replace_retry.failed(now);
                            warn!(
                                "shard {}: could not replace its endpoints ({}); trying again in {again:?}",
                                self.service.index(),
                                e.message
                            );
                        }
                    }
                }
                self.retire_expired(false);
                last_sweep = Instant::now();
            }
            if self.sent_payload > 0 {
                poller.expect_transfer(std::mem::take(&mut self.sent_payload));
            }
            // The answers to this worker's own copies come on connections it does not sleep
            // on: while copies are in flight it sleeps a millisecond at most.
            let sleep = if copying { COPY_WAIT_MAX } else { SWEEP_INTERVAL };
            if let Err(e) = poller.after_progress(&self.rails, did_work, sleep) {
                warn!("worker: {e}");
            }
        }
        // Shutdown: let reads of client memory and replies from pinned extents end
        // (bounded) before the registrations, the endpoints and then the arena go (Drop).
        let deadline = Instant::now() + SHUTDOWN_DRAIN;
        while (!self.reads.is_empty() || !self.sends.is_empty()) && Instant::now() < deadline {
            self.rails.poll(&mut done);
            for c in done.drain(..) {
                match self.ops.progress(c) {
                    Progress::Finished(f) => self.finished(f),
                    // No new chunk is read once stopping: the put fails and its extent is freed.
                    Progress::Part { id, part, .. } => {
                        self.chunk_back(id, part, true);
                        self.pump_reads(id, true)
                    }
                    Progress::Nothing => {}
                }
            }
        }
    }

    fn post_recv(&mut self, buf: usize) -> Result<()> {
        let id = self.ops.start(WorkerOp::Recv { buf }, 1);
        let ptr = self.recv_slab[buf * wire::REQUEST_MSG_MAX..].as_mut_ptr();
        let ctx = self.ops.ctx(id, 0);
        // SAFETY: the slice belongs to this receive alone until its completion; the slab
        // and the context outlive it (both dropped after the rails are closed).
        let posted = unsafe {
            self.rails.eps[0].recv(
                ptr,
                wire::REQUEST_MSG_MAX,
                self.recv_mr[0].desc,
                wire::REQUEST,
                wire::TO_WORKER_IGNORE,
                ctx,
            )
        };
        if let Err(e) = &posted {
            self.ops.not_posted(id, 1, e.clone());
        }
        posted
    }

    fn finished(&mut self, f: Finished<WorkerOp>) {
        match f.value {
            WorkerOp::Recv { buf } => {
                match f.result {
                    Ok(()) => self.on_message(buf, f.len, f.tag),
                    Err(e) => debug!("shard {}: receive failed: {e}", self.service.index()),
                }
                if let Err(e) = self.post_recv(buf) {
                    warn!("shard {}: cannot repost a request buffer: {e}", self.service.index());
                }
            }
            WorkerOp::Reply { msg, owner, charged } => {
                self.backlog.discharge(owner, charged);
                self.reply_pool.push(msg)
            }
            WorkerOp::Data { pinned, key, temp_mr, owner, charged, .. } => {
                self.backlog.discharge(owner, charged);
                if let Some(extent) = pinned {
                    self.sends.remove(&key);
                    self.service.unpin(extent);
                }
                if let Some(mr) = temp_mr {
                    self.rails.deregister(mr);
                }
            }
            WorkerOp::ReadPut { to, put, plan } => {
                self.reads.remove(&(to.id, put.header.request_id));
                if let Err(e) = &f.result {
                    debug!("shard {}: reading a put value failed ({e}); slot freed", self.service.index());
                }
                // Published only if every byte arrived while its client still wanted it:
                // not after an abort, nor once the client's slot is gone.
                let wanted = plan.abort.is_none() && self.holds(to);
                self.scratch.clear();
                let answer = self.service.finish_put(put, f.result.is_ok() && wanted, &mut self.scratch);
                self.reply(to, answer, None);
                self.confirm_abort(to, plan.abort);
            }
            WorkerOp::ReadPayload { to, header, kind, inline, buf, temp_mr, plan } => {
                self.reads.remove(&(to.id, header.request_id));
                if let Some(mr) = temp_mr {
                    self.rails.deregister(mr);
                }
                self.scratch.clear();
                let answer = match f.result {
                    Ok(()) if plan.abort.is_none() => self.service.serve(
                        &Request { header: clear_remote(header), kind, inline: &inline },
                        &buf,
                        &mut self.scratch,
                    ),
                    Ok(()) => Answer::Owned(service::error_reply(
                        header.request_id,
                        &Error::new(Status::Timeout, "abandoned by the client"),
                        &mut self.scratch,
                    )),
                    Err(e) => {
                        let e = Error::new(Status::Transport, format!("reading the request payload failed: {e}"));
                        Answer::Owned(service::error_reply(header.request_id, &e, &mut self.scratch))
                    }
                };
                self.reply(to, answer, capacity_of(kind.op(), header.ttl_or_limit));
                self.confirm_abort(to, plan.abort);
            }
        }
    }

    /// A message arrived in request buffer `buf`.
    fn on_message(&mut self, buf: usize, len: usize, tag: u64) {
        let at = buf * wire::REQUEST_MSG_MAX;
        let slot = (tag & wire::ID_MASK) as u32;
        match tag & wire::KIND_MASK {
            wire::HELLO => self.on_hello(at, len),
            wire::REQUEST => self.on_request(at, len, slot),
            other => debug!("shard {}: unexpected message kind {other:#x}", self.service.index()),
        }
    }

    fn on_request(&mut self, at: usize, len: usize, slot: u32) {
        let Some((credential, client_id)) = self.holder(slot) else {
            return debug!("shard {}: request from unknown client slot {slot}", self.service.index());
        };
        let to = Client { slot, id: client_id };
        if self.unresponsive.contains(&client_id) {
            return debug!("shard {}: request from unresponsive client {client_id} dropped", self.service.index());
        }
        if self.backlog.is_behind(client_id) {
            // It does not receive what it asked for: stop serving it until it drains.
            return debug!(
                "shard {}: client {client_id} has too many unreceived replies; request dropped",
                self.service.index()
            );
        }
        let msg = &self.recv_slab[at..at + len];
        if msg.get(16..24).map(|b| u64::from_le_bytes(b.try_into().unwrap())) != Some(credential) {
            // Not from that slot's client (a request or one of its parts): answering
            // would send to someone else.
            return debug!("shard {}: request naming slot {slot} without its credential", self.service.index());
        }
        let joined;
        let msg = match (wire::PartHeader::decode(msg), self.peers[slot as usize].as_mut()) {
            (Some(part), Some(peer)) => {
                let Some((id, bytes)) = peer.joining.as_mut().filter(|(id, _)| *id == part.request_id) else {
                    return debug!(
                        "shard {}: a request part from client {client_id} without the parts before it; dropped",
                        self.service.index()
                    );
                };
                let id = *id;
                if bytes.len() + (len - wire::PART_HEADER_LEN) > wire::REQUEST_MSG_MAX {
                    peer.joining = None;
                    let e = Error::new(
                        Status::Invalid,
                        format!("a request in parts longer than {} bytes", wire::REQUEST_MSG_MAX),
                    );
                    self.scratch.clear();
                    let header = service::error_reply(id, &e, &mut self.scratch);
                    return self.reply(to, Answer::Owned(header), None);
                }
                bytes.extend_from_slice(&msg[wire::PART_HEADER_LEN..]);
                if !part.last {
                    return;
                }
                joined = peer.joining.take().unwrap().1;
                &joined[..]
            }
            (None, Some(peer)) if wire::starts_parts(msg) => {
                // Replaces one left unfinished: that client moved on without it.
                let mut bytes = Vec::with_capacity(wire::REQUEST_MSG_MAX);
                bytes.extend_from_slice(msg);
                wire::clear_in_parts(&mut bytes);
                peer.joining = Some((RequestHeader::request_id_in(msg).unwrap_or(0), bytes));
                return;
            }
            _ => msg,
        };
        let mut out = std::mem::take(&mut self.scratch);
        let (answer, capacity) = match self.service.admit_message(msg, credential) {
            Err((Some(id), e)) => (Answer::Owned(service::error_reply(id, &e, &mut out)), None),
            Err((None, e)) => {
                self.scratch = out;
                return debug!("shard {}: unanswerable request: {e}", self.service.index());
            }
            Ok((req, _)) if req.kind == Kind::Abort => {
                let (id, target) = (req.header.request_id, req.header.ttl_or_limit);
                self.scratch = out;
                return self.abort(to, id, target);
            }
            Ok((req, payload)) if req.header.flags & flags::REMOTE_VALUE != 0 => {
                let remote = RemoteValue::decode_tail(payload, self.rails.eps.len()).and_then(|(head, rv)| match head
                    .is_empty()
                {
                    true => Ok(rv),
                    false => Err(Error::new(Status::Invalid, "a remote payload carries the whole payload")),
                });
                match remote {
                    Ok(rv) => {
                        let (header, kind, inline) = (req.header, req.kind, req.inline.to_vec());
                        self.scratch = out;
                        return self.read_remote(to, header, kind, inline, rv);
                    }
                    Err(e) => (Answer::Owned(service::error_reply(req.header.request_id, &e, &mut out)), None),
                }
            }
            Ok((req, payload)) => {
                let capacity = capacity_of(req.op(), req.header.ttl_or_limit);
                out.clear();
                (self.service.serve(&req, payload, &mut out), capacity)
            }
        };
        self.scratch = out;
        self.reply(to, answer, capacity);
    }
}

impl Drop for FabricShardWorker {
    fn drop(&mut self) {
        self.retire_expired(true);
        // Registrations close before their domains (the rails, dropped next).
        self.rails.deregister(std::mem::take(&mut self.arena_mr));
        self.rails.deregister(std::mem::take(&mut self.recv_mr));
        for buf in self.reply_pool.drain(..) {
            if let Some(mr) = buf.mr {
                self.rails.deregister(mr);
            }
        }
    }
}

/// A get's declared reply capacity (`ttl_or_limit` = capacity + 1; 0 = any size).
fn capacity_of(op: Op, ttl_or_limit: u64) -> Option<u64> {
    (op == Op::Get && ttl_or_limit > 0).then(|| ttl_or_limit - 1)
}

fn clear_remote(mut h: RequestHeader) -> RequestHeader {
    h.flags &= !flags::REMOTE_VALUE;
    h
}
