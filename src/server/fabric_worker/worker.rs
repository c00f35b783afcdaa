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

use rustc_hash::FxHashSet;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::error::{Error, Result, Status};
use crate::proto::fabric::{self as wire, Hello, RemoteValue};
use crate::proto::{flags, Op, ReplyHeader, RequestHeader, REPLY_HEADER_LEN};
use crate::server::reply_backlog::{ReplyBacklog, ReplyBudget};
use crate::server::service::{self, Answer, Membership, PendingPut, Request, Service};
use crate::server::tunables::{
    FABRIC_RETIRED_GRACE, READ_CHUNK, READ_WINDOW_PER_RAIL, RECV_BUFS, SHUTDOWN_DRAIN, SWEEP_BATCH, SWEEP_EVERY,
    SWEEP_INTERVAL,
};
use crate::server::{FreedMemory, RetryBackoff, WorkerInfo};
use crate::store::Shard;
use crate::transport::fabric::ops::{Finished, Progress};
use crate::transport::fabric::rails::{stripe_len, stripes};
use crate::transport::fabric::{Completion, InFlight, MemoryRegion, PeerAddr, Rails, RemoteAccess};
use crate::transport::{PollMode, Poller};

/// A reply message: header, and the payload when it fits.
struct ReplyBuf {
    bytes: Vec<u8>,
    /// Registration of `bytes` on rail 0, when the provider requires local registration.
    mr: Option<Vec<MemoryRegion>>,
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
        op: Op,
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
}

impl ReadPlan {
    fn new(
        dest: *mut u8,
        descs: Vec<*mut std::ffi::c_void>,
        peer: Vec<PeerAddr>,
        remote: Vec<(u64, u64)>,
        len: usize,
        stall_timeout: Duration,
    ) -> ReadPlan {
        let chunk = stripe_len(len, peer.len()).clamp(1, READ_CHUNK);
        let deadline = service::transfer_deadline(stall_timeout, len as u64);
        ReadPlan {
            dest,
            descs,
            peer,
            remote,
            len,
            chunk,
            next: 0,
            chunks: len.div_ceil(chunk).max(1),
            failed: false,
            abort: None,
            deadline,
            in_flight: BTreeSet::new(),
        }
    }
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
    pub(in crate::server) service: Service,
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

impl FabricShardWorker {
    /// Builds the worker on the calling thread (the one that will run it).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: usize,
        shards: usize,
        membership: crossbeam_channel::Receiver<Membership>,
        shard: Shard,
        provider: &str,
        listen: std::net::IpAddr,
        rails: usize,
        stall_timeout: Duration,
        reply_budget: Arc<ReplyBudget>,
    ) -> Result<Box<Self>> {
        let rails = Rails::open(provider, Some(listen), rails)?;
        // No remote access to anything of ours: replies are sends, and put values are
        // read by us from the client. A peer that guesses keys finds nothing to read.
        let arena_mr = rails.register(shard.arena().base(), shard.arena().len(), RemoteAccess::None)?;
        let recv_slab = vec![0u8; RECV_BUFS * wire::REQUEST_MSG_MAX];
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
            backlog: ReplyBacklog::new(reply_budget.clone()),
            service: Service::new(index, shards, membership, shard, reply_budget),
            arena_mr,
            recv_mr,
            recv_slab,
            reply_pool: Vec::new(),
            scratch: Vec::new(),
            peers: Vec::new(),
            free_slots: Vec::new(),
            ops: InFlight::default(),
            reads: HashMap::new(),
            sends: HashMap::new(),
            unresponsive: FxHashSet::default(),
            stall_timeout,
            sent_payload: 0,
        });
        w.service.clients = Some(0);
        for buf in 0..RECV_BUFS {
            w.post_recv(buf)?;
        }
        Ok(w)
    }

    pub fn info(&self) -> Result<WorkerInfo> {
        let arena = self.service.shard.arena();
        Ok(WorkerInfo {
            address: self.address.clone(),
            transport: format!("fabric ({})", self.rails.describe()),
            backing: arena.backing(),
            bytes: arena.len() as u64,
            metrics: self.service.metrics.clone(),
        })
    }

    /// Serves until `stop` is set; notices it within [`SWEEP_INTERVAL`].
    pub fn run(mut self: Box<Self>, mode: PollMode, spin: Duration, stop: Arc<AtomicBool>) {
        let mut poller = Poller::new(mode, spin);
        let mut last_sweep = Instant::now();
        let mut turns = 0u32;
        let mut done: Vec<Completion> = Vec::with_capacity(64);
        while !stop.load(Ordering::Relaxed) {
            let did_work = self.rails.poll(&mut done) > 0;
            turns = turns.wrapping_add(1);
            for c in done.drain(..) {
                match self.ops.progress(c) {
                    Progress::Finished(f) => self.finished(f),
                    Progress::Part { id, part, failed } => {
                        self.chunk_back(id, part);
                        self.pump_reads(id, failed)
                    }
                    Progress::Nothing => {}
                }
            }
            // Swept when idle, and under constant load too (the clock read only every
            // SWEEP_EVERY busy turns, or when the poller says so while idle).
            let clock_due = if did_work { turns % SWEEP_EVERY == 0 } else { poller.clock_due() };
            if clock_due && last_sweep.elapsed() >= SWEEP_INTERVAL {
                self.service.shard.expire_due(SWEEP_BATCH);
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
                            let again = self.replace_retry.failed(now);
                            warn!(
                                "shard {}: could not replace its endpoints ({}); trying again in {again:?}",
                                self.service.index, e.message
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
            if let Err(e) = poller.after_progress(&self.rails, did_work, SWEEP_INTERVAL) {
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
                        self.chunk_back(id, part);
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
                    Err(e) => debug!("shard {}: receive failed: {e}", self.service.index),
                }
                if let Err(e) = self.post_recv(buf) {
                    warn!("shard {}: cannot repost a request buffer: {e}", self.service.index);
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
                    self.service.shard.unpin(extent);
                }
                if let Some(mr) = temp_mr {
                    self.rails.deregister(mr);
                }
            }
            WorkerOp::ReadPut { to, put, plan } => {
                self.reads.remove(&(to.id, put.header.request_id));
                if let Err(e) = &f.result {
                    debug!("shard {}: reading a put value failed ({e}); slot freed", self.service.index);
                }
                // Published only if every byte arrived while its client still wanted it:
                // not after an abort, nor once the client's slot is gone.
                let wanted = plan.abort.is_none() && self.holds(to);
                self.scratch.clear();
                let header = self.service.finish_put(put, f.result.is_ok() && wanted, &mut self.scratch);
                self.reply(to, Answer::Owned(header), None);
                self.confirm_abort(to, plan.abort);
            }
            WorkerOp::ReadPayload { to, header, op, inline, buf, temp_mr, plan } => {
                self.reads.remove(&(to.id, header.request_id));
                if let Some(mr) = temp_mr {
                    self.rails.deregister(mr);
                }
                self.scratch.clear();
                let answer = match f.result {
                    Ok(()) if plan.abort.is_none() => self.service.serve(
                        &Request { header: clear_remote(header), op, inline: &inline },
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
                self.reply(to, answer, capacity_of(op, header.ttl_or_limit));
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
            other => debug!("shard {}: unexpected message kind {other:#x}", self.service.index),
        }
    }

    fn on_hello(&mut self, at: usize, len: usize) {
        let hello = match Hello::decode(&self.recv_slab[at..at + len]) {
            Ok(h) => h,
            Err(e) => return debug!("shard {}: {e}", self.service.index),
        };
        // Only a session the bootstrap issued (after the token check) to a client still
        // connected gets a slot, bound to that client: it dies with its connection.
        let client_id = match self.service.client_of(hello.session) {
            Some(c) if hello.addresses.len() == self.rails.eps.len() => c,
            // Without a valid session we do not even learn the sender's address.
            _ => return debug!("shard {}: hello refused (bad session or rail count)", self.service.index),
        };
        self.forget_departed();
        // One slot per client: a repeated hello replaces the earlier one.
        if let Some(old) = self.peers.iter().position(|p| p.as_ref().is_some_and(|p| p.client_id == client_id)) {
            self.forget(old as u32);
        }
        let mut addrs = Vec::with_capacity(hello.addresses.len());
        for (ep, a) in self.rails.eps.iter().zip(&hello.addresses) {
            match ep.insert_peer(a) {
                Ok(p) => addrs.push(p),
                Err(e) => return warn!("shard {}: {e}", self.service.index),
            }
        }
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.peers.push(None);
            (self.peers.len() - 1) as u32
        });
        let mut random = [0u8; 8];
        if let Err(e) = getrandom::getrandom(&mut random) {
            return warn!("shard {}: no randomness for a credential: {e}", self.service.index);
        }
        let credential = u64::from_le_bytes(random) | 1;
        self.peers[slot as usize] = Some(Peer { addrs, credential, client_id, joining: None });
        *self.service.clients.get_or_insert(0) += 1;
        let mut header = ReplyHeader::new(hello.hello_id, Status::Ok);
        header.generation = slot as u64;
        header.value_size = credential;
        self.scratch.clear();
        self.reply(Client { slot, id: client_id }, Answer::Owned(header), None);
    }

    /// The slot's credential and the client holding it.
    fn holder(&self, slot: u32) -> Option<(u64, u64)> {
        self.peers.get(slot as usize).and_then(|p| p.as_ref()).map(|p| (p.credential, p.client_id))
    }

    /// Whether `to`'s client still holds its slot.
    fn holds(&self, to: Client) -> bool {
        self.holder(to.slot).is_some_and(|(_, id)| id == to.id)
    }

    /// Answers an abort, now that nothing of the request it names reads client memory.
    fn confirm_abort(&mut self, to: Client, abort: Option<u64>) {
        if let Some(id) = abort {
            debug!("shard {}: request abandoned by its client; discarded", self.service.index);
            self.scratch.clear();
            self.reply(to, Answer::Owned(ReplyHeader::new(id, Status::Ok)), None);
        }
    }

    /// A reply payload its client will never receive (it gave up on the request, or left):
    /// the send may stay posted for good (shm never fails it), so its extent is unpinned
    /// now. Only that client could still match the send, and it cancelled its receive.
    fn orphan_send(&mut self, client: u64, request: u64) {
        let Some(op) = self.sends.remove(&(client, request)) else { return };
        if let Some(WorkerOp::Data { pinned, .. }) = self.ops.value_mut(op) {
            if let Some(extent) = pinned.take() {
                self.service.shard.unpin(extent);
            }
        }
    }

    /// The client gave up on request `target`: stop reading its payload; the abort is
    /// answered when the reads in flight are back (at once if none are).
    fn abort(&mut self, to: Client, abort_id: u64, target: u64) {
        self.orphan_send(to.id, target);
        if let Some(&op) = self.reads.get(&(to.id, target)) {
            if let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(op) {
                plan.abort = Some(abort_id);
                plan.failed = true;
                return;
            }
        }
        self.scratch.clear();
        self.reply(to, Answer::Owned(ReplyHeader::new(abort_id, Status::Ok)), None);
    }

    fn forget(&mut self, slot: u32) {
        if let Some(peer) = self.peers.get_mut(slot as usize).and_then(Option::take) {
            let orphans: Vec<u64> = self.sends.keys().filter(|k| k.0 == peer.client_id).map(|k| k.1).collect();
            for request in orphans {
                self.orphan_send(peer.client_id, request);
            }
            for (ep, a) in self.rails.eps.iter().zip(peer.addrs) {
                let _ = ep.remove_peer(a);
            }
            self.free_slots.push(slot);
            self.service.clients = self.service.clients.map(|n| n - 1);
        }
    }

    /// Frees the slots of clients whose bootstrap connection closed. Runs when idle and
    /// before each hello, so the slot table never grows past the clients alive.
    fn forget_departed(&mut self) {
        for client in self.service.take_departed() {
            self.freed.freed();
            if self.large_sends_to(client) {
                self.replace_due = true;
            }
            self.backlog.forget(client);
            self.unresponsive.remove(&client);
            for slot in 0..self.peers.len() as u32 {
                if self.peers[slot as usize].as_ref().is_some_and(|p| p.client_id == client) {
                    self.forget(slot);
                }
            }
        }
    }

    fn on_request(&mut self, at: usize, len: usize, slot: u32) {
        let Some((credential, client_id)) = self.holder(slot) else {
            return debug!("shard {}: request from unknown client slot {slot}", self.service.index);
        };
        let to = Client { slot, id: client_id };
        if self.unresponsive.contains(&client_id) {
            return debug!("shard {}: request from unresponsive client {client_id} dropped", self.service.index);
        }
        if self.backlog.is_behind(client_id) {
            // It does not receive what it asked for: stop serving it until it drains.
            return debug!(
                "shard {}: client {client_id} has too many unreceived replies; request dropped",
                self.service.index
            );
        }
        let msg = &self.recv_slab[at..at + len];
        if msg.get(16..24).map(|b| u64::from_le_bytes(b.try_into().unwrap())) != Some(credential) {
            // Not from that slot's client (a request or one of its parts): answering
            // would send to someone else.
            return debug!("shard {}: request naming slot {slot} without its credential", self.service.index);
        }
        let joined;
        let msg = match (wire::PartHeader::decode(msg), self.peers[slot as usize].as_mut()) {
            (Some(part), Some(peer)) => {
                let Some((id, bytes)) = peer.joining.as_mut().filter(|(id, _)| *id == part.request_id) else {
                    return debug!(
                        "shard {}: a request part from client {client_id} without the parts before it; dropped",
                        self.service.index
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
                peer.joining = Some((u64::from_le_bytes(msg[8..16].try_into().unwrap()), bytes));
                return;
            }
            _ => msg,
        };
        let mut out = std::mem::take(&mut self.scratch);
        let (answer, capacity) = match self.service.admit_message(msg, credential) {
            Err((Some(id), e)) => (Answer::Owned(service::error_reply(id, &e, &mut out)), None),
            Err((None, e)) => {
                self.scratch = out;
                return debug!("shard {}: unanswerable request: {e}", self.service.index);
            }
            Ok((req, _)) if req.op == Op::Abort => {
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
                        let (header, op, inline) = (req.header, req.op, req.inline.to_vec());
                        self.scratch = out;
                        return self.read_remote(to, header, op, inline, rv);
                    }
                    Err(e) => (Answer::Owned(service::error_reply(req.header.request_id, &e, &mut out)), None),
                }
            }
            Ok((req, payload)) => {
                let capacity = capacity_of(req.op, req.header.ttl_or_limit);
                out.clear();
                (self.service.serve(&req, payload, &mut out), capacity)
            }
        };
        self.scratch = out;
        self.reply(to, answer, capacity);
    }

    /// A request whose payload stays in the client's memory: read it, striped over the rails.
    fn read_remote(&mut self, to: Client, h: RequestHeader, op: Op, inline: Vec<u8>, rv: RemoteValue) {
        let id = h.request_id;
        let len = rv.len as usize;
        let peer = self.peers[to.slot as usize].as_ref().map(|p| p.addrs.clone()).unwrap_or_default();
        let op_value = if op == Op::Put {
            let req = Request { header: h, op, inline: &inline };
            match self.service.begin_put(&req, rv.len) {
                Ok(put) => {
                    let dest = self.service.put_destination(&put);
                    let plan = ReadPlan::new(
                        dest,
                        self.arena_mr.iter().map(|m| m.desc).collect(),
                        peer,
                        rv.rails,
                        len,
                        self.stall_timeout,
                    );
                    WorkerOp::ReadPut { to, put, plan }
                }
                Err(e) => {
                    let header = service::error_reply(id, &e, &mut self.scratch);
                    return self.reply(to, Answer::Owned(header), None);
                }
            }
        } else {
            if len > 2 * crate::proto::MAX_KEY_LEN {
                let header = service::error_reply(
                    id,
                    &Error::new(Status::Invalid, format!("{op:?} with a {len}-byte payload")),
                    &mut self.scratch,
                );
                return self.reply(to, Answer::Owned(header), None);
            }
            let mut buf = vec![0u8; len];
            let temp_mr = self.local_registration(buf.as_ptr(), len);
            let descs = temp_mr
                .as_ref()
                .map_or(vec![std::ptr::null_mut(); self.rails.eps.len()], |m| m.iter().map(|r| r.desc).collect());
            let plan = ReadPlan::new(buf.as_mut_ptr(), descs, peer, rv.rails, len, self.stall_timeout);
            WorkerOp::ReadPayload { to, header: h, op, inline, buf, temp_mr, plan }
        };
        let chunks = match &op_value {
            WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. } => plan.chunks,
            _ => unreachable!(),
        };
        let op_id = self.ops.start(op_value, chunks);
        self.reads.insert((to.id, id), op_id);
        for _ in 0..READ_WINDOW_PER_RAIL * self.rails.eps.len() {
            self.pump_reads(op_id, false);
        }
    }

    /// Gives up on reads of client memory past their deadline: no further chunk is posted,
    /// and the request fails (its extent freed) once the chunks in flight are back.
    fn cut_stalled_reads(&mut self) {
        let now = Instant::now();
        for &op in self.reads.values() {
            let (plan, put) = match self.ops.value_mut(op) {
                Some(WorkerOp::ReadPut { plan, put, .. }) => (plan, Some(put)),
                Some(WorkerOp::ReadPayload { plan, .. }) => (plan, None),
                _ => continue,
            };
            if plan.deadline > now || plan.failed {
                continue;
            }
            warn!("shard {}: a read of client memory made no progress before its deadline; cut", self.service.index);
            plan.failed = true;
            // Keep only what the reads still in flight write into: the rest of the
            // extent is free again now, even if they never come back.
            if let Some(put) = put.filter(|p| p.cut.is_none()) {
                let keep: Vec<(u64, u64)> = plan
                    .in_flight
                    .iter()
                    .map(|&k| {
                        (put.dest_offset + (k * plan.chunk) as u64, plan.chunk.min(plan.len - k * plan.chunk) as u64)
                    })
                    .collect();
                put.cut = Some(self.service.shard.release_except(put.extent, &keep));
            }
        }
    }

    /// Chunk `part` of read `id` is back (done or failed).
    fn chunk_back(&mut self, id: u32, part: usize) {
        if let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id) {
            plan.in_flight.remove(&part);
        }
    }

    /// Posts the next chunk of read `id`, if any remain (none after a failure: the op
    /// then finishes when the chunks in flight are back).
    fn pump_reads(&mut self, id: u32, failed: bool) {
        let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id) else {
            return;
        };
        plan.failed |= failed;
        if plan.next == plan.chunks {
            return;
        }
        if plan.failed {
            let unposted = plan.chunks - plan.next;
            plan.next = plan.chunks;
            if let Some(f) = self.ops.not_posted(id, unposted, Error::new(Status::Transport, "read abandoned")) {
                self.finished(f);
            }
            return;
        }
        let k = plan.next;
        plan.next += 1;
        plan.in_flight.insert(k);
        let (off, rail) = (k * plan.chunk, k % plan.peer.len());
        let part_len = plan.chunk.min(plan.len - off.min(plan.len));
        let (addr, key) = plan.remote[rail];
        // SAFETY: dest..dest+len is the reserved extent or the op's own buffer, untouched
        // by anyone else until the op finishes; the context lives in `ops`.
        let (dest, desc, peer) = unsafe { (plan.dest.add(off), plan.descs[rail], plan.peer[rail]) };
        let ctx = self.ops.ctx(id, k);
        let posted = unsafe { self.rails.eps[rail].read(dest, part_len, desc, peer, addr + off as u64, key, ctx) };
        if let Err(e) = posted {
            let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id)
            else {
                return;
            };
            let unposted = plan.chunks - k;
            plan.next = plan.chunks;
            plan.failed = true;
            plan.in_flight.remove(&k);
            if let Some(f) = self.ops.not_posted(id, unposted, e) {
                self.finished(f);
            }
        }
    }

    /// Registers an owned buffer when the provider requires local registration.
    fn local_registration(&self, ptr: *const u8, len: usize) -> Option<Vec<MemoryRegion>> {
        if !self.rails.needs_local_registration() || len == 0 {
            return None;
        }
        self.rails.register(ptr, len, RemoteAccess::None).map_err(|e| warn!("{e}")).ok()
    }

    fn take_reply_buf(&mut self) -> ReplyBuf {
        self.reply_pool.pop().unwrap_or_else(|| {
            let bytes = Vec::with_capacity(wire::REPLY_MSG_MAX);
            let mr = self.local_registration(bytes.as_ptr(), wire::REPLY_MSG_MAX);
            ReplyBuf { bytes, mr }
        })
    }

    /// After a send that failed because the client took nothing (see `unresponsive`).
    fn note_unresponsive(&mut self, client: u64, e: &Error) {
        if e.status == Status::Unavailable && self.unresponsive.insert(client) {
            info!("shard {}: client {client} takes no replies ({}); dropping its requests and replies until it reconnects", self.service.index, e.message);
            // Over shm its stuck large sends hold up everyone's (see `replace_rails`).
            self.replace_due |= self.large_sends_to(client);
        }
    }

    /// Whether a message too large to be copied inline is on its way to `client` over
    /// libfabric's shm (whose sender then waits for the receiver's answer).
    fn large_sends_to(&self, client: u64) -> bool {
        let inject = self.rails.eps[0].inject_size;
        self.rails.provider() == "shm"
            && self.ops.values().any(|op| match op {
                WorkerOp::Data { owner, .. } => *owner == client,
                WorkerOp::Reply { msg, owner, .. } => *owner == client && msg.bytes.len() > inject,
                _ => false,
            })
    }

    /// Replaces the endpoints (rails) with new ones under a new address, which the
    /// bootstrap hands out and tells connected clients of (they reconnect). Stored data is
    /// kept.
    ///
    /// Why: libfabric 1.17's shm sender of a message too large to copy inline waits for
    /// the receiver's answer in one queue of its own region, read strictly in order. A
    /// receiver that died (or stopped) before answering holds up every later large send
    /// to anyone for good: a client killed during a 3 MiB GET left the shard unable to send
    /// any large value again. Nothing in libfabric's API clears that queue.
    ///
    /// The old rails are never progressed again: reads of client memory in flight stop
    /// there (their puts fail and free their extents), replies are dropped. What peers may
    /// still read through them (reply buffers, pinned extents) is kept for
    /// [`FABRIC_RETIRED_GRACE`].
    fn replace_rails(&mut self) -> Result<()> {
        tracing::error!(
            "shard {}: a client left with large messages in flight, which stalls every later large send of libfabric's shm; \
             replacing the shard's endpoints: clients reconnect, stored data is kept",
            self.service.index
        );
        let rails = Rails::open(&self.provider, Some(self.listen), self.rails.eps.len())?;
        let arena = self.service.shard.arena();
        let arena_mr = rails.register(arena.base(), arena.len(), RemoteAccess::None)?;
        let recv_slab = vec![0u8; RECV_BUFS * wire::REQUEST_MSG_MAX];
        let recv_mr = rails.register(recv_slab.as_ptr(), recv_slab.len(), RemoteAccess::None)?;
        let address = wire::encode_addresses(&rails.addresses()?);

        let old_rails = std::mem::replace(&mut self.rails, rails);
        let mut regions =
            vec![std::mem::replace(&mut self.arena_mr, arena_mr), std::mem::replace(&mut self.recv_mr, recv_mr)];
        let old_slab = std::mem::replace(&mut self.recv_slab, recv_slab);
        let (mut buffers, mut pinned) = (Vec::new(), Vec::new());
        for buf in self.reply_pool.drain(..) {
            regions.extend(buf.mr);
        }
        for op in self.ops.drain() {
            match op {
                WorkerOp::Recv { .. } => {}
                WorkerOp::Reply { msg, .. } => {
                    regions.extend(msg.mr);
                    buffers.push(msg.bytes);
                }
                WorkerOp::Data { pinned: extent, _owned, temp_mr, .. } => {
                    pinned.extend(extent);
                    regions.extend(temp_mr);
                    buffers.push(_owned);
                }
                WorkerOp::ReadPut { put, .. } => {
                    self.scratch.clear();
                    let _ = self.service.finish_put(put, false, &mut self.scratch);
                }
                WorkerOp::ReadPayload { temp_mr, buf, .. } => {
                    regions.extend(temp_mr);
                    buffers.push(buf);
                }
            }
        }
        self.retired.push(Retired {
            rails: old_rails,
            regions,
            _buffers: buffers,
            _recv_slab: old_slab,
            pinned,
            since: Instant::now(),
        });
        // Every client goes: their addresses were in the old endpoints' address vectors.
        for peer in self.peers.iter_mut().filter(|p| p.is_some()) {
            *peer = None;
        }
        self.free_slots = (0..self.peers.len() as u32).rev().collect();
        self.service.clients = Some(0);
        self.reads.clear();
        self.sends.clear();
        self.backlog.clear();
        self.unresponsive.clear();
        for buf in 0..RECV_BUFS {
            self.post_recv(buf)?;
        }
        self.address.set(address);
        self.service.metrics.worker_replaced();
        Ok(())
    }

    /// Closes retired rails once their grace has passed (all of them with `all`),
    /// unpinning what their peers could still read.
    fn retire_expired(&mut self, all: bool) {
        if self.retired.is_empty() {
            return;
        }
        let (expired, kept): (Vec<Retired>, Vec<Retired>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|r| all || r.since.elapsed() >= FABRIC_RETIRED_GRACE);
        self.retired = kept;
        for r in expired {
            for extent in &r.pinned {
                self.service.shard.unpin(*extent);
            }
            for mr in r.regions {
                r.rails.deregister(mr);
            }
        }
    }

    /// Sends an answer to a client (if it still holds its slot): owned payload bytes are
    /// in `self.scratch`. `capacity`: the most payload the client can take (a get into a
    /// caller's buffer).
    fn reply(&mut self, to: Client, answer: Answer, capacity: Option<u64>) {
        let slot = to.slot;
        let Some(peer0) =
            self.peers.get(slot as usize).and_then(|p| p.as_ref()).filter(|p| p.client_id == to.id).map(|p| p.addrs[0])
        else {
            return;
        };
        if self.unresponsive.contains(&to.id) {
            return debug!("shard {}: reply to unresponsive client {} dropped", self.service.index, to.id);
        }
        let (mut header, arena) = match answer {
            Answer::Owned(h) => (h, None),
            Answer::Arena { header, offset, len, extent } => (header, Some((offset, len, extent))),
        };
        let payload_len = arena.map_or(self.scratch.len() as u64, |a| a.1);
        header.payload_len = payload_len;
        let inline = REPLY_HEADER_LEN as u64 + payload_len <= self.rails.one_message_max(wire::REPLY_MSG_MAX) as u64;
        let mut msg = self.take_reply_buf();
        msg.bytes.clear();
        msg.bytes.extend_from_slice(&header.encode());
        if inline {
            match arena {
                Some((offset, len, _)) => msg.bytes.extend_from_slice(self.service.shard.arena().slice(offset, len)),
                None => msg.bytes.extend_from_slice(&self.scratch),
            }
        }
        let tag = wire::REPLY | (header.request_id & wire::ID_MASK);
        // Messages up to the inject size are copied by the provider before the call
        // returns: nothing of them stays in flight, and no completion follows.
        let inject_size = self.rails.eps[0].inject_size;
        if msg.bytes.len() <= inject_size {
            let sent = self.rails.eps[0].inject(&msg.bytes, peer0, tag);
            self.reply_pool.push(msg);
            if let Err(e) = sent {
                debug!("shard {}: reply not sent: {e}", self.service.index);
                return self.note_unresponsive(to.id, &e);
            }
        } else {
            let desc = msg.mr.as_ref().map_or(std::ptr::null_mut(), |m| m[0].desc);
            let (ptr, len) = (msg.bytes.as_ptr(), msg.bytes.len());
            self.backlog.charge(to.id, len as u64);
            let id = self.ops.start(WorkerOp::Reply { msg, owner: to.id, charged: len as u64 }, 1);
            let ctx = self.ops.ctx(id, 0);
            // SAFETY: the bytes live in the ReplyBuf's heap buffer, owned by the op until completion.
            if let Err(e) = unsafe { self.rails.eps[0].send(ptr, len, desc, peer0, tag, ctx) } {
                debug!("shard {}: reply not sent: {e}", self.service.index);
                self.note_unresponsive(to.id, &e);
                if let Some(f) = self.ops.not_posted(id, 1, e) {
                    self.finished(f);
                }
                return;
            }
        }
        if inline || capacity.is_some_and(|c| payload_len > c) {
            return; // all sent, or withheld: the client's buffer is too small
        }
        let data_tag = wire::DATA | (header.request_id & wire::ID_MASK);
        if payload_len as usize <= inject_size {
            // One message on the first rail, as `stripes` gives a payload this short.
            let bytes = match arena {
                Some((offset, len, _)) => self.service.shard.arena().slice(offset, len),
                None => &self.scratch[..],
            };
            if let Err(e) = self.rails.eps[0].inject(bytes, peer0, data_tag) {
                debug!("shard {}: reply data not sent: {e}", self.service.index);
                self.note_unresponsive(to.id, &e);
            }
            return;
        }
        let peer = self.peers[slot as usize].as_ref().map(|p| p.addrs.clone()).unwrap_or_default();
        let (ptr, descs, value) = match arena {
            Some((offset, len, extent)) => {
                self.service.shard.pin(extent);
                let ptr = self.service.shard.arena().slice(offset, len).as_ptr();
                (
                    ptr,
                    self.arena_mr.iter().map(|m| m.desc).collect::<Vec<_>>(),
                    WorkerOp::Data {
                        pinned: Some(extent),
                        key: (to.id, header.request_id),
                        _owned: Vec::new(),
                        temp_mr: None,
                        owner: to.id,
                        charged: 0,
                    },
                )
            }
            None => {
                let owned = std::mem::take(&mut self.scratch);
                let temp_mr = self.local_registration(owned.as_ptr(), owned.len());
                let descs = temp_mr
                    .as_ref()
                    .map_or(vec![std::ptr::null_mut(); peer.len()], |m| m.iter().map(|r| r.desc).collect());
                let charged = owned.len() as u64;
                (
                    owned.as_ptr(),
                    descs,
                    WorkerOp::Data {
                        pinned: None,
                        key: (to.id, header.request_id),
                        _owned: owned,
                        temp_mr,
                        owner: to.id,
                        charged,
                    },
                )
            }
        };
        let parts: Vec<_> = stripes(payload_len as usize, peer.len()).collect();
        let pins = matches!(value, WorkerOp::Data { pinned: Some(_), .. });
        if let WorkerOp::Data { charged, .. } = &value {
            self.backlog.charge(to.id, *charged);
        }
        let id = self.ops.start(value, parts.len());
        self.sent_payload += payload_len as usize;
        if pins {
            self.sends.insert((to.id, header.request_id), id);
        }
        for (p, &(off, part_len)) in parts.iter().enumerate() {
            let ctx = self.ops.ctx(id, p);
            // SAFETY: pinned arena bytes or the op's owned Vec, unchanged until completion.
            if let Err(e) = unsafe { self.rails.eps[p].send(ptr.add(off), part_len, descs[p], peer[p], data_tag, ctx) }
            {
                debug!("shard {}: reply data not sent: {e}", self.service.index);
                self.note_unresponsive(to.id, &e);
                if let Some(f) = self.ops.not_posted(id, parts.len() - p, e) {
                    self.finished(f);
                }
                return;
            }
        }
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
