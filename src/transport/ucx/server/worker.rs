//! A shard worker over UCX: one pinned thread that owns one UCX worker, the endpoints its clients
//! reach it by, and one shard. Requests are served inside the active-message callback, on
//! this thread, with no lock: the worker is the only one who ever touches its shard.
//!
//! Buffer ownership (who may touch which bytes when):
//! - Reply headers and owned reply payloads live in pooled [`ReplyMsg`] boxes; a box is
//!   owned by UCX from a pending send until its completion callback returns it to the pool.
//! - A get reply sends straight from the arena; the extent is pinned until the send
//!   completes, so a concurrent delete or overwrite defers the free.
//! - A rendezvous put receives into a reserved extent that is not yet in the index; on
//!   completion it is committed (condition re-checked) or released, also when the client
//!   vanished mid-transfer (the callback then carries an error status).
//!
//! A stuck receive queue (a shared-memory client killed while writing into it; see
//! [`super::queue_probe`]) is survived by replacing the UCX worker: the old one
//! is retired (still progressed, so what was in flight on it ends, but no longer handed out
//! to clients), a new one takes its place under a new address, and clients reconnect.
//!
//! The same machinery, without telling anyone, bounds what departed shared-memory clients
//! leave behind (see [`ReplyEps`]): after [`crate::server::ServerConfig::stranded_endpoint_limit`]
//! of them, new clients are handed a fresh worker, and the old one serves the clients it
//! has until the last one leaves, then goes with everything the departed ones left.
//!
//! This file holds the worker, its loop and how a request is served; the rest is split by
//! concern: `replies` (sends and the backlog), `puts` (rendezvous receives of put values)
//! and `recovery` (retiring and replacing the UCX worker).

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::incarnations::{PerIncarnation, ReplyEps};
use super::queue_probe::{self, QueueProbe};
use crate::error::{Error, Result};
use crate::proto::{self, ReplyHeader, REPLY_HEADER_LEN};
use crate::server::reply_backlog::ReplyBacklog;
use crate::server::service::{self, Answer, PendingPut, Service};
use crate::server::tunables::{
    COPY_WAIT_MAX, IDLE_RECYCLE_AFTER, MAX_RECYCLED, SHUTDOWN_DRAIN, SWEEP_BATCH, SWEEP_EVERY, SWEEP_INTERVAL,
    UCX_RETIRED_GRACE,
};
use crate::server::{FreedMemory, RetryBackoff, ShardAddress, WorkerInfo};
use crate::transport::ucx::ep_watch::LostEps;
use crate::transport::ucx::{self, sys, Started, Worker};
use crate::transport::{PollMode, Poller};

mod puts;
mod recovery;
mod replies;

use replies::Orphans;

struct PutInFlight {
    worker: *mut ShardWorker,
    /// The worker it arrives by (see [`Arrival`]).
    incarnation: u64,
    /// Null once the endpoint was closed (see [`ShardWorker::cut_stalled_puts`]).
    reply_ep: sys::ucp_ep_h,
    /// When the transfer is cut if it has not finished (its client stopped progressing).
    deadline: Instant,
    put: PendingPut,
    /// Set when the client gave up on this put: the abort request to answer once the
    /// rendezvous receive (which reads the client's memory) has ended.
    abort: Option<u64>,
}

/// Where a deferred answer goes (see [`Answer::Deferred`]).
struct DeferredReply {
    ep: sys::ucp_ep_h,
    incarnation: u64,
    client: u64,
}

/// A UCX worker no longer handed out to clients, with its mapping of the arena.
struct Retired {
    worker: Worker,
    memh: sys::ucp_mem_h,
    /// After `worker`: its callbacks may run until it is destroyed.
    _arrival: ArrivalBox,
    incarnation: u64,
    since: Instant,
    why: Retirement,
    /// Recycled: clients connected when it was, that had sent this shard nothing yet (so
    /// may hold its address and send their first request to it later).
    unheard: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Retirement {
    /// Its receive queue got stuck: clients were told to reconnect.
    Stuck,
    /// Too many departed clients' endpoints stranded on it: it serves the clients it
    /// has until they leave (nobody was told).
    Recycled,
}

impl Drop for Retired {
    fn drop(&mut self) {
        // SAFETY: mapped on this worker when it was created; unmapped once, before it is destroyed.
        unsafe { self.worker.mem_unmap(self.memh) };
    }
}

struct ReplyMsg {
    worker: *mut ShardWorker,
    /// The reply header, its first `header_len` bytes (a compact form, when it fits).
    header: [u8; REPLY_HEADER_LEN],
    header_len: usize,
    payload: Vec<u8>,
    /// Arena extent the payload is sent from, if any (pinned while in flight).
    pinned: Option<u64>,
    /// The client it goes to (0: not known), so its departure can release the extent.
    client: u64,
    /// Owned payload bytes charged to that client while the send is pending.
    charged: u64,
    /// The worker it is sent by (see [`Arrival`]).
    incarnation: u64,
}

impl ReplyMsg {
    fn key(&self) -> usize {
        self as *const ReplyMsg as usize
    }
}

/// What a UCX worker's request callbacks are given: the shard, which of its workers the
/// request came by, and that worker's handle and mapping of the arena (the one a send from
/// or a receive into the arena must name: mappings belong to a worker's own context).
#[derive(Clone, Copy)]
struct Arrival {
    shard: *mut ShardWorker,
    incarnation: u64,
    /// The worker itself: a rendezvous descriptor is received through the worker it came by.
    worker: ucx::WorkerHandle,
    memh: sys::ucp_mem_h,
}

/// Keeps an [`Arrival`] at a stable address for as long as its worker may call back; the
/// callbacks only copy it out.
struct ArrivalBox(*mut Arrival);

impl ArrivalBox {
    fn new(arrival: Arrival) -> ArrivalBox {
        ArrivalBox(Box::into_raw(Box::new(arrival)))
    }

    fn arg(&self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

impl Drop for ArrivalBox {
    fn drop(&mut self) {
        // SAFETY: from Box::into_raw in new(), freed once, here, after the worker it served.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

pub struct ShardWorker {
    /// Before `service`: the UCX workers are destroyed before the arena they move bytes of.
    retired: Vec<Retired>,
    worker: Worker,
    pub(crate) service: Service,
    memh: sys::ucp_mem_h,
    /// What the current worker's callbacks are given; after `worker`.
    arrival: ArrivalBox,
    /// The current worker's number: each replacement takes the next.
    incarnation: u64,
    /// The current worker's address as the bootstrap hands it out.
    address: ShardAddress,
    probe: QueueProbe,
    /// The last probe nonce received (see [`queue_probe`]).
    probe_seen: u64,
    /// Replies whose send UCX has not completed yet, per worker.
    replies_in_flight: PerIncarnation,
    #[allow(clippy::vec_box)] // boxed: UCX holds their addresses while in flight
    reply_pool: Vec<Box<ReplyMsg>>,
    /// Writes whose answer waits for their copies to the keys' other replicas, by the
    /// service's token: where the answer goes.
    deferred: HashMap<u64, DeferredReply>,
    /// Rendezvous puts being received, by (client session, request id): what an abort
    /// names. The boxes are owned by their UCX receive until its callback.
    puts: HashMap<(u64, u64), *mut PutInFlight>,
    /// Replies not yet completed, by box address -> client (0: not known).
    sending: HashMap<usize, u64>,
    /// Replies given up on, not yet completed (see [`ShardWorker::orphan`]); after
    /// `retired` and `worker`.
    orphans: Orphans,
    /// Per client: replies whose send is pending, and their owned bytes. A client that
    /// does not receive its replies stops being served at the bounds below.
    backlog: ReplyBacklog,
    /// See [`crate::server::ServerConfig::stall_timeout`].
    stall_timeout: Duration,
    /// Endpoints closed because a transfer on them stalled, until UCX finishes the close.
    /// With the worker (incarnation) the endpoint belonged to.
    closing: Vec<(sys::ucs_status_ptr_t, u64)>,
    reply_eps: ReplyEps,
    /// Clients' endpoints UCX dropped, not yet taken into `reply_eps` (see [`ucx::ep_watch`]).
    lost_eps: Arc<LostEps>,
    /// Departed clients' endpoints stranded on the current worker (see [`ReplyEps`]), and
    /// how many make it hand new clients a fresh one
    /// ([`crate::server::ServerConfig::stranded_endpoint_limit`]).
    stranded: usize,
    /// Since when endpoints are stranded on the current worker.
    stranded_since: Option<Instant>,
    stranded_limit: usize,
    recycle_retry: RetryBackoff,
    /// What departed clients held goes back to the system (see [`FreedMemory`]).
    freed: FreedMemory,
    /// The helper thread starting a fresh worker (see [`ShardWorker::prepare_spare`]);
    /// joined when the worker is taken, or when the shard stops.
    spare: Option<std::thread::JoinHandle<Result<Worker>>>,
    /// Whether this shard's workers run UCX's tcp transport (its replacements too).
    tcp: ucx::Tcp,
}

impl ShardWorker {
    /// Builds the worker on the calling thread (the one that will run it).
    pub fn new(
        service: Service,
        stall_timeout: Duration,
        stranded_limit: usize,
        tcp: ucx::Tcp,
    ) -> Result<Box<ShardWorker>> {
        let worker = Worker::serving(&tcp)?;
        let probe = QueueProbe::new(&tcp)?;
        let arena = service.arena();
        let memh = worker.mem_map(arena.base(), arena.len())?;
        let address = worker.address()?;
        let handle = worker.handle();
        let mut w = Box::new(ShardWorker {
            backlog: ReplyBacklog::new(service.reply_budget().clone()),
            service,
            tcp,
            retired: Vec::new(),
            worker,
            memh,
            arrival: ArrivalBox::new(Arrival { shard: ptr::null_mut(), incarnation: 0, worker: handle, memh }),
            incarnation: 0,
            address: ShardAddress::new(crate::proto::bootstrap::hex_encode(&address)),
            probe,
            probe_seen: 0,
            replies_in_flight: PerIncarnation::default(),
            reply_pool: Vec::new(),
            puts: HashMap::new(),
            deferred: HashMap::new(),
            sending: HashMap::new(),
            orphans: Orphans::default(),
            stall_timeout,
            closing: Vec::new(),
            reply_eps: ReplyEps::default(),
            lost_eps: Arc::default(),
            stranded: 0,
            stranded_since: None,
            stranded_limit: stranded_limit.max(1),
            recycle_retry: RetryBackoff::new(),
            freed: FreedMemory::new(),
            spare: None,
        });
        let me = &mut *w as *mut ShardWorker;
        // SAFETY: the box was allocated just above and is not read by anyone yet.
        unsafe { (*w.arrival.0).shard = me };
        Self::install_handlers(&w.worker, &w.arrival)?;
        w.probe.connect(&address)?;
        let waker = w.worker.waker();
        w.service.set_copy_wake(move || waker.wake());
        Ok(w)
    }

    /// Serves requests and probes arriving at `worker` (the current one, or its successor)
    /// with this ShardWorker, as `arrival` says.
    fn install_handlers(worker: &Worker, arrival: &ArrivalBox) -> Result<()> {
        let arg = arrival.arg();
        // SAFETY: the ShardWorker is boxed, never moved out of, and outlives its UCX workers
        // (destroyed in its drop before the box's memory is freed); the arrival is dropped
        // only after the worker it was installed on.
        unsafe {
            worker.set_am_handler(proto::AM_REQUEST, Some(on_request), arg)?;
            worker.set_am_handler(proto::AM_PROBE, Some(on_probe), arg)
        }
    }

    pub fn info(&self) -> Result<WorkerInfo> {
        let arena = self.service.arena();
        Ok(WorkerInfo {
            address: self.address.clone(),
            transport: "ucx".into(),
            backing: arena.backing(),
            bytes: arena.len() as u64,
            metrics: self.service.metrics().clone(),
        })
    }

    pub fn waker(&self) -> ucx::Waker {
        self.worker.waker()
    }

    /// Serves until `stop` is set (and the worker woken).
    pub fn run(self: Box<Self>, mode: PollMode, spin: Duration, stop: Arc<AtomicBool>) {
        let this = Box::into_raw(self);
        // Progress runs callbacks that take `&mut ShardWorker` through `this`: no reference
        // into the ShardWorker may be live meanwhile, so progress goes through raw handles.
        let mut poller = Poller::new(mode, spin);
        let mut last_sweep = Instant::now();
        let mut turns = 0u32;
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: the worker lives in the box until after this loop; this is its thread.
            let mut did_work = unsafe { Self::progress_all(this) };
            // SAFETY: as above; answering sends, but progresses nothing.
            let copying = unsafe { (*this).service.copies_in_flight() };
            if copying {
                // SAFETY: as above; sending copies progresses only the replicas' connections.
                did_work |= unsafe { (*this).service.drive_copies() };
                // SAFETY: as above.
                did_work |= unsafe { (*this).answer_copied() };
                // SAFETY: as above.
                if !did_work && unsafe { (*this).service.copy_expected_soon() } {
                    std::thread::yield_now();
                    continue;
                }
            }
            turns = turns.wrapping_add(1);
            // Swept when idle, and under constant load too (the clock read only every
            // SWEEP_EVERY busy turns, or when the poller says so while idle): departed
            // clients and stalled transfers are released either way.
            let clock_due = if did_work { turns % SWEEP_EVERY == 0 } else { poller.clock_due() };
            if clock_due && last_sweep.elapsed() >= SWEEP_INTERVAL {
                // SAFETY: as above; the reference ends with the call, and no callback runs
                // during it (see `sweep`).
                unsafe { (*this).sweep(!did_work) };
                last_sweep = Instant::now();
            }
            // SAFETY: as above; the reference ends before the next progress.
            let worker = unsafe { &(*this).worker };
            // The replicator wakes the worker as copies end; a millisecond bounds a wake lost
            // to a worker replaced meanwhile.
            let sleep = if copying { COPY_WAIT_MAX } else { SWEEP_INTERVAL };
            if let Err(e) = poller.after_progress(worker, did_work, sleep) {
                warn!("worker: {e}");
            }
        }
        // Shutdown: let the transfers in flight end (bounded), so that the UCX worker is
        // destroyed with nothing of ours in flight, then the arena is freed (field order).
        let deadline = Instant::now() + SHUTDOWN_DRAIN;
        // SAFETY: as in the loop above.
        while unsafe { (*this).in_flight() } && Instant::now() < deadline {
            // SAFETY: as in the loop above.
            unsafe { Self::progress_all(this) };
        }
        // SAFETY: reclaim the box leaked above; no callback can run after this point
        // because nothing progresses the worker any more.
        let mut w = unsafe { Box::from_raw(this) };
        if !w.puts.is_empty() || w.replies_in_flight.total() > 0 {
            warn!(
                "shard {}: stopping with {} puts and {} replies still in flight",
                w.service.index(),
                w.puts.len(),
                w.replies_in_flight.total()
            );
        }
        // Replies still unsent (their client stopped taking them) are given up on: their
        // boxes are freed once the workers are destroyed (`Orphans`).
        let unsent: Vec<usize> = w.sending.keys().copied().collect();
        for m in unsent {
            w.orphan(m);
        }
        drop(w);
    }

    /// One progress pass over the current UCX worker and any retired ones; true if
    /// anything happened.
    ///
    /// # Safety
    /// `this` is the live, leaked ShardWorker and this is its thread; no reference into
    /// it is live (the callbacks make their own).
    unsafe fn progress_all(this: *mut ShardWorker) -> bool {
        // SAFETY: as the caller promises; each handle is copied out before progressing.
        unsafe {
            let mut did_work = (*this).worker.handle().progress() != 0;
            let mut i = 0;
            while i < (*this).retired.len() {
                let handle = (&(*this).retired)[i].worker.handle();
                did_work |= handle.progress() != 0;
                i += 1;
            }
            did_work
        }
    }

    /// The periodic chores: expired values, departed clients, stalled puts, a stuck
    /// receive queue (`idle`: nothing happened this turn), orphaned endpoints, metrics.
    /// Nothing here progresses a served UCX worker (the probe's worker has no callback
    /// into this one), so no callback runs meanwhile.
    fn sweep(&mut self, idle: bool) {
        self.service.sweep(SWEEP_BATCH);
        self.forget_departed();
        self.cut_stalled_puts();
        let gone = self.watch_queue(idle);
        let incarnations: Vec<u64> = gone.iter().map(|r| r.incarnation).collect();
        drop(gone);
        self.absorb_lost_eps();
        for &incarnation in &incarnations {
            self.reclaim_orphans(incarnation);
        }
        if !incarnations.is_empty() {
            self.freed.freed();
        }
        self.freed.return_if_due(Instant::now());
        self.service.publish_metrics(self.puts.len());
    }

    /// Whether anything of ours is still in flight on any UCX worker of this shard.
    fn in_flight(&mut self) -> bool {
        !self.puts.is_empty() || self.replies_in_flight.total() > 0 || self.reap_closed()
    }

    /// Sends the answers of writes whose copies ended; true if there were any.
    fn answer_copied(&mut self) -> bool {
        let mut any = false;
        let mut m = self.take_reply();
        while let Some((token, header)) = self.service.next_copied(&mut m.payload) {
            any = true;
            let Some(to) = self.deferred.remove(&token) else { continue };
            // A client that left gets nothing, nor one whose endpoint UCX dropped (it
            // does so as soon as it sees the peer fail, which the bootstrap may hear of
            // only later): see `ucx::ep_watch`.
            self.absorb_lost_eps();
            if !self.service.is_still_live(to.client) || !self.reply_eps.reaches(to.ep, to.client) {
                continue;
            }
            m.client = to.client;
            self.send_reply(to.ep, to.incarnation, header, m, None);
            m = self.take_reply();
        }
        self.finish_reply(m);
        any
    }

    /// Whether anything of ours is still in flight on worker `incarnation` (which may be
    /// destroyed only once nothing is: its callbacks would never come).
    fn in_flight_on(&self, incarnation: u64) -> bool {
        // SAFETY: boxes in `puts` are alive until their receive's callback removes them.
        self.replies_in_flight.count(incarnation) > 0
            || self.deferred.values().any(|d| d.incarnation == incarnation)
            || self.puts.values().any(|&p| unsafe { (*p).incarnation } == incarnation)
            || self.closing.iter().any(|&(_, g)| g == incarnation)
    }

    /// Handles one request from the AM callback. `data` is the eager payload, or the
    /// rendezvous descriptor when `rendezvous`.
    fn handle(
        &mut self,
        header: &[u8],
        data: *mut c_void,
        length: usize,
        info: ucx::AmInfo,
        came_by: Arrival,
    ) -> sys::ucs_status_t {
        let ep = info.reply_ep;
        let (req, client) = match self.service.admit(header) {
            Ok(r) => {
                self.absorb_lost_eps();
                let worker = &self.worker;
                // SAFETY: UCX handed ep to the request callback running now: it is live.
                let strands = || unsafe { worker.ep_lacks_failure_detection(ep) };
                if self.reply_eps.note(ep, r.1, came_by.incarnation, strands) {
                    self.watch_ep(ep);
                }
                r
            }
            Err((id, e)) => {
                debug!("shard {}: refused request: {}", self.service.index(), e.message);
                if let Some(id) = id {
                    self.reply_error(ep, came_by.incarnation, id, &e);
                }
                return sys::UCS_OK;
            }
        };
        if req.kind == proto::Kind::Abort {
            let target = (req.header.session, req.header.ttl_or_limit);
            match self.puts.get(&target) {
                // SAFETY: the box stays valid until its receive's callback removes it from `puts`.
                Some(&p) => unsafe { (*p).abort = Some(req.header.request_id) },
                None => {
                    let mut m = self.take_reply();
                    let answer = self.service.serve(&req, &[], &mut m.payload);
                    self.answer(ep, came_by, answer, m);
                }
            }
            return sys::UCS_OK;
        }
        if info.rendezvous {
            // Only puts carry large payloads; returning UCS_OK without receiving drops the
            // descriptor and releases the sender.
            match self.service.begin_put(&req, length as u64) {
                Ok(p) => self.receive_put(ep, came_by, p, data),
                Err(e) => self.reply_error(ep, came_by.incarnation, req.header.request_id, &e),
            }
            return sys::UCS_OK;
        }
        // SAFETY: for an eager message UCX hands us `length` readable bytes at `data`,
        // valid for the duration of this callback.
        let payload: &[u8] =
            if length == 0 { &[] } else { unsafe { std::slice::from_raw_parts(data as *const u8, length) } };
        if self.backlog.is_behind(client) {
            // It does not receive what it asked for: stop serving it (its memory would
            // pile up here) until it drains.
            debug!("shard {}: client {client} has too many unreceived replies; request dropped", self.service.index());
            return sys::UCS_OK;
        }
        let mut m = self.take_reply();
        m.client = client;
        let answer = self.service.serve(&req, payload, &mut m.payload);
        self.answer(ep, came_by, answer, m);
        sys::UCS_OK
    }
}

impl Drop for ShardWorker {
    fn drop(&mut self) {
        // SAFETY: mapped in new(), unmapped once here.
        unsafe { self.worker.mem_unmap(self.memh) };
        // No helper thread outlives the shard (it would be inside UCX as the process exits).
        if let Some(thread) = self.spare.take() {
            drop(thread.join());
        }
    }
}

unsafe extern "C" fn on_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: arg is the Arrival installed with this handler (copied out at once); its
    // ShardWorker outlives the worker. UCX calls us on its thread, inside progress, when no
    // other borrow of the ShardWorker is live. header/param are valid for the call.
    unsafe {
        let came_by = *(arg as *const Arrival);
        let w = &mut *came_by.shard;
        let header = ucx::am_header(header, header_length);
        let info = ucx::am_info(param);
        catch_unwind(AssertUnwindSafe(|| w.handle(header, data, length, info, came_by))).unwrap_or_else(|_| {
            warn!("request handler panicked; request dropped");
            sys::UCS_OK
        })
    }
}

unsafe extern "C" fn on_probe(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: as in on_request; only one field is written.
    unsafe {
        let w = (*(arg as *const Arrival)).shard;
        (*w).probe_seen = queue_probe::probe_nonce(ucx::am_header(header, header_length));
    }
    sys::UCS_OK
}
