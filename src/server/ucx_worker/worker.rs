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
//! [`queue_probe`](super::queue_probe)) is survived by replacing the UCX worker: the old one
//! is retired (still progressed, so what was in flight on it ends, but no longer handed out
//! to clients), a new one takes its place under a new address, and clients reconnect.
//!
//! The same machinery, without telling anyone, bounds what departed shared-memory clients
//! leave behind (see [`ReplyEps`]): after [`crate::server::ServerConfig::stranded_endpoint_limit`]
//! of them, new clients are handed a fresh worker, and the old one serves the clients it
//! has until the last one leaves, then goes with everything the departed ones left.

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
use crate::server::reply_backlog::{ReplyBacklog, ReplyBudget};
use crate::server::service::{self, Answer, Membership, PendingPut, Service};
use crate::server::tunables::{
    IDLE_RECYCLE_AFTER, MAX_RECYCLED, SHUTDOWN_DRAIN, SWEEP_BATCH, SWEEP_EVERY, SWEEP_INTERVAL, UCX_RETIRED_GRACE,
};
use crate::server::{FreedMemory, RetryBackoff, ShardAddress, WorkerInfo};
use crate::store::Shard;
use crate::transport::ucx::{self, sys, Started, Worker};
use crate::transport::{PollMode, Poller};

/// Bytes of the arena a reply is sent from, and the arena's mapping on the worker that sends.
#[derive(Clone, Copy)]
struct ArenaSlice {
    offset: u64,
    len: u64,
    extent: u64,
    memh: sys::ucp_mem_h,
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

impl Drop for Retired {
    fn drop(&mut self) {
        // SAFETY: mapped on this worker when it was created; unmapped once, before it is destroyed.
        unsafe { self.worker.mem_unmap(self.memh) };
    }
}

pub struct ShardWorker {
    /// Before `service`: the UCX workers are destroyed before the arena they move bytes of.
    retired: Vec<Retired>,
    worker: Worker,
    pub(in crate::server) service: Service,
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
    /// Rendezvous puts being received, by (client session, request id): what an abort
    /// names. The boxes are owned by their UCX receive until its callback.
    puts: HashMap<(u64, u64), *mut PutInFlight>,
    /// Replies to known clients not yet completed, by box address -> client.
    sending: HashMap<usize, u64>,
    /// Replies to departed clients not yet completed, by box address -> worker incarnation:
    /// they may never complete (over shared memory the client pulls the bytes itself), so
    /// they keep no worker from being destroyed, and are freed here if the worker's
    /// destruction did not end them (see [`ShardWorker::reclaim_orphans`]).
    orphans: HashMap<usize, u64>,
    /// Per client: replies whose send is pending, and their owned bytes. A client that
    /// does not receive its replies stops being served at the bounds below.
    backlog: ReplyBacklog,
    /// See [`crate::server::ServerConfig::stall_timeout`].
    stall_timeout: Duration,
    /// Endpoints closed because a transfer on them stalled, until UCX finishes the close.
    /// With the worker (incarnation) the endpoint belonged to.
    closing: Vec<(sys::ucs_status_ptr_t, u64)>,
    reply_eps: ReplyEps,
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
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: usize,
        shards: usize,
        membership: crossbeam_channel::Receiver<Membership>,
        shard: Shard,
        stall_timeout: Duration,
        stranded_limit: usize,
        tcp: ucx::Tcp,
        reply_budget: Arc<ReplyBudget>,
    ) -> Result<Box<ShardWorker>> {
        let worker = Worker::new(&tcp)?;
        let probe = QueueProbe::new(&tcp)?;
        let arena = shard.arena();
        let memh = worker.mem_map(arena.base(), arena.len())?;
        let address = worker.address()?;
        let handle = worker.handle();
        let mut w = Box::new(ShardWorker {
            backlog: ReplyBacklog::new(reply_budget.clone()),
            service: Service::new(index, shards, membership, shard, reply_budget),
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
            sending: HashMap::new(),
            orphans: HashMap::new(),
            stall_timeout,
            closing: Vec::new(),
            reply_eps: ReplyEps::default(),
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
        let arena = self.service.shard.arena();
        Ok(WorkerInfo {
            address: self.address.clone(),
            transport: "ucx".into(),
            backing: arena.backing(),
            bytes: arena.len() as u64,
            metrics: self.service.metrics.clone(),
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
            let did_work = unsafe { Self::progress_all(this) };
            turns = turns.wrapping_add(1);
            // Swept when idle, and under constant load too (the clock read only every
            // SWEEP_EVERY busy turns, or when the poller says so while idle): departed
            // clients and stalled transfers are released either way.
            let clock_due = if did_work { turns % SWEEP_EVERY == 0 } else { poller.clock_due() };
            if clock_due && last_sweep.elapsed() >= SWEEP_INTERVAL {
                // SAFETY: as above; no callback runs during these calls (they do not progress
                // the served workers; the probe's worker has no callback into this one).
                unsafe {
                    (*this).service.shard.expire_due(SWEEP_BATCH);
                    (*this).forget_departed();
                    (*this).cut_stalled_puts();
                    let gone = (*this).watch_queue(!did_work);
                    let incarnations: Vec<u64> = gone.iter().map(|r| r.incarnation).collect();
                    drop(gone);
                    for &incarnation in &incarnations {
                        (*this).reclaim_orphans(incarnation);
                    }
                    if !incarnations.is_empty() {
                        (*this).freed.freed();
                    }
                    (*this).freed.return_if_due(Instant::now());
                    (*this).service.publish_metrics((*this).puts.len());
                }
                last_sweep = Instant::now();
            }
            // SAFETY: as above; the reference ends before the next progress.
            let worker = unsafe { &(*this).worker };
            if let Err(e) = poller.after_progress(worker, did_work, SWEEP_INTERVAL) {
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
        let w = unsafe { Box::from_raw(this) };
        if !w.puts.is_empty() || w.replies_in_flight.total() > 0 {
            warn!(
                "shard {}: stopping with {} puts and {} replies still in flight",
                w.service.index,
                w.puts.len(),
                w.replies_in_flight.total()
            );
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

    /// Whether anything of ours is still in flight on any UCX worker of this shard.
    fn in_flight(&mut self) -> bool {
        !self.puts.is_empty() || self.replies_in_flight.total() > 0 || self.reap_closed()
    }

    /// Whether anything of ours is still in flight on worker `incarnation` (which may be
    /// destroyed only once nothing is: its callbacks would never come).
    fn in_flight_on(&self, incarnation: u64) -> bool {
        // SAFETY: boxes in `puts` are alive until their receive's callback removes them.
        self.replies_in_flight.count(incarnation) > 0
            || self.puts.values().any(|&p| unsafe { (*p).incarnation } == incarnation)
            || self.closing.iter().any(|&(_, g)| g == incarnation)
    }

    /// Probes the receive queue and replaces a stuck worker; hands out a fresh worker once
    /// too many endpoints are stranded on the current one; destroys retired workers once
    /// nothing is in flight and their time has come (see [`ShardWorker::retirement_over`]).
    ///
    /// Returns the retired workers to destroy, which the caller drops with no reference into
    /// this ShardWorker live (destroying a worker may run its callbacks), then passes to
    /// [`ShardWorker::reclaim_orphans`].
    #[must_use]
    fn watch_queue(&mut self, idle: bool) -> Vec<Retired> {
        let now = Instant::now();
        self.prepare_spare();
        if self.probe.tick(self.probe_seen, idle, now) {
            if let Err(e) = self.replace_worker(Retirement::Stuck) {
                warn!("shard {}: could not replace a stuck worker: {}", self.service.index, e.message);
            }
        } else if (self.stranded >= self.stranded_limit || self.idle_with_stranded(now))
            && self.recycle_retry.ready(now)
        {
            match self.replace_worker(Retirement::Recycled) {
                Ok(()) => self.recycle_retry.succeeded(),
                Err(e) => {
                    let again = self.recycle_retry.failed(now);
                    warn!(
                        "shard {}: could not start a fresh worker ({}); trying again in {again:?}",
                        self.service.index, e.message
                    );
                }
            }
        }
        if !self.retired.is_empty() {
            let over: Vec<bool> = self.retired.iter().map(|r| self.retirement_over(r, now)).collect();
            let mut over = over.into_iter();
            let (gone, kept): (Vec<Retired>, Vec<Retired>) =
                std::mem::take(&mut self.retired).into_iter().partition(|_| over.next() == Some(true));
            self.retired = kept;
            for r in &gone {
                debug!("shard {}: {:?} worker {} destroyed", self.service.index, r.why, r.incarnation);
                self.reply_eps.forget_incarnation(r.incarnation);
            }
            return gone;
        }
        Vec::new()
    }

    /// Whether endpoints have been stranded on the current worker for a while and no client
    /// is left to serve: then recycling disturbs no one. Not while an earlier worker is
    /// still retiring, so that clients that come and go one at a time keep at most two
    /// workers alive.
    fn idle_with_stranded(&self, now: Instant) -> bool {
        self.retired.is_empty()
            && self.stranded_since.is_some_and(|since| now.duration_since(since) >= IDLE_RECYCLE_AFTER)
            && self.service.live_clients().next().is_none()
    }

    /// Frees the replies to departed clients that worker `incarnation` still had in flight
    /// when it was destroyed without ending them (their callbacks will never come).
    fn reclaim_orphans(&mut self, incarnation: u64) {
        let left: Vec<usize> = self.orphans.iter().filter(|&(_, &g)| g == incarnation).map(|(&m, _)| m).collect();
        for m in left {
            self.orphans.remove(&m);
            // SAFETY: an orphan's box is owned by its send until the callback, which never
            // comes now that the worker is destroyed; reclaimed once (removed just above).
            self.finish_reply(unsafe { Box::from_raw(m as *mut ReplyMsg) });
        }
    }

    /// Whether a retired worker may be destroyed (with nothing in flight). One that was
    /// stuck goes after [`UCX_RETIRED_GRACE`]. One that was recycled serves its clients until
    /// the last has left, but at most [`MAX_RECYCLED`] of them wait for that: beyond, the
    /// oldest goes, and all clients are told to reconnect (as for a stuck worker). A worker
    /// is destroyed only with nothing of ours in flight on it.
    fn retirement_over(&self, r: &Retired, now: Instant) -> bool {
        if now.duration_since(r.since) < UCX_RETIRED_GRACE || self.in_flight_on(r.incarnation) {
            return false;
        }
        match r.why {
            Retirement::Stuck => true,
            Retirement::Recycled => {
                let waited_for = |c: &u64| self.service.is_live(*c) && !self.reply_eps.knows(*c);
                if !self.reply_eps.serves(r.incarnation) && !r.unheard.iter().any(waited_for) {
                    return true;
                }
                let newer_waiting = self
                    .retired
                    .iter()
                    .filter(|o| {
                        o.why == Retirement::Recycled
                            && o.incarnation > r.incarnation
                            && self.reply_eps.serves(o.incarnation)
                    })
                    .count();
                if newer_waiting >= MAX_RECYCLED {
                    warn!(
                        "shard {}: clients of a recycled worker told to reconnect ({} recycled workers kept at most)",
                        self.service.index, MAX_RECYCLED
                    );
                    self.address.tell_moved();
                    return true;
                }
                false
            }
        }
    }

    /// Starts a fresh worker on a helper thread once the current one is three quarters of
    /// the way to its stranded limit, so that recycling does not stall the shard for the
    /// 10-30 ms a UCX context takes to start (a worker is used by one thread at a time,
    /// not necessarily the one that made it).
    fn prepare_spare(&mut self) {
        if self.spare.is_some() || self.stranded * 4 < self.stranded_limit * 3 {
            return;
        }
        let tcp = self.tcp.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rdram-spare-{}", self.service.index))
            .spawn(move || Worker::new(&tcp));
        match spawned {
            Ok(thread) => self.spare = Some(thread),
            Err(e) => debug!(
                "shard {}: no helper thread for a spare worker ({e}); it will start on the shard's",
                self.service.index
            ),
        }
    }

    /// The spare worker (waiting for the rest of its start if need be: less than starting
    /// another), else a new one started here.
    fn take_fresh_worker(&mut self) -> Result<Worker> {
        match self.spare.take().map(|thread| thread.join()) {
            Some(Ok(Ok(worker))) => Ok(worker),
            Some(Ok(Err(e))) => {
                debug!(
                    "shard {}: the spare worker did not start ({}); starting one here",
                    self.service.index, e.message
                );
                Worker::new(&self.tcp)
            }
            _ => Worker::new(&self.tcp),
        }
    }

    /// Replaces the current UCX worker with a new one under a new address, which new
    /// clients are handed. Stored data is kept.
    ///
    /// A stuck worker (its receive queue will never move): the rendezvous puts in flight are
    /// cut (their extents come back as the old worker fails them); replies in flight end on
    /// the old worker, which stays progressed until it is destroyed; clients are told, and
    /// reconnect.
    ///
    /// A recycled one (too many stranded endpoints) goes on serving the clients it has.
    fn replace_worker(&mut self, why: Retirement) -> Result<()> {
        match why {
            Retirement::Stuck => tracing::error!(
                "shard {}: its receive queue is stuck (a shared-memory client died while writing into it); \
                 replacing its UCX worker: clients reconnect, stored data is kept",
                self.service.index
            ),
            Retirement::Recycled => {}
        }
        let started = Instant::now();
        let mut fresh = self.take_fresh_worker()?;
        let arena = self.service.shard.arena();
        let memh = fresh.mem_map(arena.base(), arena.len())?;
        let incarnation = self.incarnation + 1;
        let arrival =
            ArrivalBox::new(Arrival { shard: self as *mut ShardWorker, incarnation, worker: fresh.handle(), memh });
        let address = match fresh.address().and_then(|a| Self::install_handlers(&fresh, &arrival).map(|()| a)) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: mapped just above on this worker, unmapped once.
                unsafe { fresh.mem_unmap(memh) };
                return Err(e);
            }
        };
        if why == Retirement::Stuck {
            self.cut_puts(|_| true);
        }
        self.worker.hand_waker_to(&mut fresh);
        let old = std::mem::replace(&mut self.worker, fresh);
        let old_memh = std::mem::replace(&mut self.memh, memh);
        let old_arrival = std::mem::replace(&mut self.arrival, arrival);
        let hex = crate::proto::bootstrap::hex_encode(&address);
        let mut unheard = Vec::new();
        match why {
            Retirement::Stuck => {
                self.address.set(hex);
                self.service.metrics.worker_replaced();
            }
            Retirement::Recycled => {
                self.address.hand_out(hex);
                self.service.metrics.worker_recycled();
                let message = format!(
                    "shard {}: {} departed shared-memory clients' endpoints held by its UCX worker (UCX frees them only with the worker); \
                     new clients get a fresh worker (the switch took {:.1} ms), the old one goes when its last client leaves",
                    self.service.index,
                    self.stranded,
                    started.elapsed().as_secs_f64() * 1e3
                );
                if self.stranded >= self.stranded_limit {
                    tracing::info!("{message}");
                } else {
                    debug!("{message} (no client was left)");
                }
                // Everyone welcomed with the old address joined before this (the bootstrap
                // tells the workers before it reads the address).
                self.service.sync_membership();
                unheard = self.service.live_clients().filter(|&c| !self.reply_eps.knows(c)).collect();
            }
        }
        self.retired.push(Retired {
            worker: old,
            memh: old_memh,
            _arrival: old_arrival,
            incarnation: self.incarnation,
            since: Instant::now(),
            why,
            unheard,
        });
        self.incarnation = incarnation;
        self.stranded = 0;
        self.stranded_since = None;
        if let Err(e) = self.probe.connect(&address) {
            warn!(
                "shard {}: queue probe cannot reach the new worker ({}); a stuck queue will not be detected",
                self.service.index, e.message
            );
        }
        Ok(())
    }

    fn take_reply(&mut self) -> Box<ReplyMsg> {
        let me = self as *mut ShardWorker;
        let mut m = self.reply_pool.pop().unwrap_or_else(|| {
            Box::new(ReplyMsg {
                worker: me,
                header: [0; REPLY_HEADER_LEN],
                header_len: 0,
                payload: Vec::new(),
                pinned: None,
                client: 0,
                charged: 0,
                incarnation: 0,
            })
        });
        m.payload.clear();
        m.pinned = None;
        m.client = 0;
        m.charged = 0;
        m
    }

    fn finish_reply(&mut self, mut m: Box<ReplyMsg>) {
        if let Some(extent) = m.pinned.take() {
            self.service.shard.unpin(extent);
        }
        if m.payload.capacity() > 1 << 20 {
            m.payload = Vec::new();
        }
        self.reply_pool.push(m);
    }

    /// Sends a reply on `ep` of worker `incarnation`. `arena`: bytes of the arena to send
    /// instead of the owned payload.
    fn send_reply(
        &mut self,
        ep: sys::ucp_ep_h,
        incarnation: u64,
        header: ReplyHeader,
        mut m: Box<ReplyMsg>,
        arena: Option<ArenaSlice>,
    ) {
        if ep.is_null() {
            self.finish_reply(m);
            return;
        }
        let sent = arena.map_or(m.payload.len(), |a| a.len as usize);
        m.header_len = header.encode_compact(sent, &mut m.header);
        m.incarnation = incarnation;
        let raw = Box::into_raw(m);
        // SAFETY: header and payload live in the box (heap, stable while leaked) or the
        // arena (pinned below while in flight), untouched until the completion; ep is the
        // reply endpoint UCX gave us.
        let started = unsafe {
            let (payload, memh): (&[u8], _) = match arena {
                Some(a) => (self.service.shard.arena().slice(a.offset, a.len), a.memh),
                None => ((*raw).payload.as_slice(), ptr::null_mut()),
            };
            let header = &(&(*raw).header)[..(*raw).header_len];
            self.worker.am_send(ep, proto::AM_REPLY, header, payload, 0, Some(on_reply_sent), raw as *mut c_void, memh)
        };
        // SAFETY: raw came from Box::into_raw above and is reclaimed exactly once: here when
        // the send finished (or failed) inside the call, else in on_reply_sent.
        match started {
            Ok(Started::Pending) => {
                self.replies_in_flight.add(incarnation);
                // SAFETY: raw is the live box leaked above, owned by the pending send.
                let (client, owned) = unsafe { ((*raw).client, (*raw).payload.len() as u64) };
                if client != 0 {
                    self.backlog.charge(client, owned);
                    // SAFETY: as above.
                    unsafe { (*raw).charged = owned };
                    self.sending.insert(raw as usize, client);
                }
                if let Some(ArenaSlice { extent, .. }) = arena {
                    self.service.shard.pin(extent);
                    // SAFETY: raw is the live box leaked above, owned by the pending send.
                    unsafe { (*raw).pinned = Some(extent) };
                }
            }
            Ok(Started::Done) => self.finish_reply(unsafe { Box::from_raw(raw) }),
            Err(e) => {
                debug!("reply not sent: {e}");
                self.finish_reply(unsafe { Box::from_raw(raw) })
            }
        }
    }

    /// Sends what the service answered to a request that `came_by`; `m.payload` holds its
    /// owned bytes.
    fn answer(&mut self, ep: sys::ucp_ep_h, came_by: Arrival, answer: Answer, m: Box<ReplyMsg>) {
        match answer {
            Answer::Owned(header) => self.send_reply(ep, came_by.incarnation, header, m, None),
            Answer::Arena { header, offset, len, extent } => self.send_reply(
                ep,
                came_by.incarnation,
                header,
                m,
                Some(ArenaSlice { offset, len, extent, memh: came_by.memh }),
            ),
        }
    }

    fn reply_error(&mut self, ep: sys::ucp_ep_h, incarnation: u64, request_id: u64, err: &Error) {
        let mut m = self.take_reply();
        let header = service::error_reply(request_id, err, &mut m.payload);
        self.send_reply(ep, incarnation, header, m, None);
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
                self.reply_eps.note(&self.worker, ep, r.1, came_by.incarnation);
                r
            }
            Err((id, e)) => {
                debug!("shard {}: refused request: {}", self.service.index, e.message);
                if let Some(id) = id {
                    self.reply_error(ep, came_by.incarnation, id, &e);
                }
                return sys::UCS_OK;
            }
        };
        if req.op == proto::Op::Abort {
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
            debug!("shard {}: client {client} has too many unreceived replies; request dropped", self.service.index);
            return sys::UCS_OK;
        }
        let mut m = self.take_reply();
        m.client = client;
        let answer = self.service.serve(&req, payload, &mut m.payload);
        self.answer(ep, came_by, answer, m);
        sys::UCS_OK
    }

    /// Releases what departed clients held. A reply being sent to one from a pinned
    /// extent may never complete (over shared memory the client itself pulls the bytes,
    /// and it is gone): its extent is unpinned now; the send's box stays UCX's.
    fn forget_departed(&mut self) {
        let departed = self.service.take_departed();
        if departed.is_empty() {
            return;
        }
        self.freed.freed();
        let incarnation = self.incarnation;
        self.stranded += self.reply_eps.departed(&departed).into_iter().filter(|&g| g == incarnation).count();
        if self.stranded > 0 && self.stranded_since.is_none() {
            self.stranded_since = Some(Instant::now());
        }
        for client in departed {
            self.backlog.forget(client);
            let orphans: Vec<usize> = self.sending.iter().filter(|(_, &c)| c == client).map(|(&m, _)| m).collect();
            for m in orphans {
                self.sending.remove(&m);
                // SAFETY: boxes in `sending` are alive until their send's callback, which
                // removes them from `sending` (or `orphans`) first.
                let msg = unsafe { &mut *(m as *mut ReplyMsg) };
                if let Some(extent) = msg.pinned.take() {
                    self.service.shard.unpin(extent);
                }
                // Its send may never end (a dead shared-memory peer): uncharged now.
                self.backlog.discharge(client, std::mem::take(&mut msg.charged));
                self.replies_in_flight.remove(msg.incarnation);
                self.orphans.insert(m, msg.incarnation);
            }
        }
    }

    /// Closes the endpoint of every rendezvous put past its deadline: UCX cannot cancel the
    /// receive itself, but a forced close fails it (its callback then releases the extent),
    /// and with it everything else in flight to that client, which reconnects on its next call.
    fn cut_stalled_puts(&mut self) {
        self.reap_closed();
        let now = Instant::now();
        if self.cut_puts(|p| p.deadline <= now) > 0 {
            warn!(
                "shard {}: a put made no progress before its deadline; its client's endpoint is closed",
                self.service.index
            );
        }
    }

    /// Closes the endpoints of the puts in flight that `which` selects; returns how many
    /// endpoints were closed.
    fn cut_puts(&mut self, which: impl Fn(&PutInFlight) -> bool) -> usize {
        // SAFETY: boxes in `puts` are alive until their receive's callback removes them.
        let doomed: Vec<(sys::ucp_ep_h, u64)> = self
            .puts
            .values()
            .map(|&p| unsafe { &*p })
            .filter(|p| which(p) && !p.reply_ep.is_null())
            .map(|p| (p.reply_ep, p.incarnation))
            .collect();
        let mut closed = 0;
        for (ep, incarnation) in doomed {
            // Several puts may share the endpoint: close it once.
            // SAFETY: as above.
            let on_ep: Vec<*mut PutInFlight> =
                self.puts.values().copied().filter(|&p| unsafe { (*p).reply_ep } == ep).collect();
            if on_ep.is_empty() {
                continue;
            }
            for p in on_ep {
                // SAFETY: as above; the endpoint is never used again once closed.
                unsafe { (*p).reply_ep = ptr::null_mut() };
            }
            // SAFETY: ep is a live endpoint (no put referred to a closed one). Closing goes
            // through the endpoint's own worker whichever `Worker` value starts it.
            if let Some(request) = unsafe { self.worker.close_ep_nb(ep) } {
                self.closing.push((request, incarnation));
            }
            closed += 1;
        }
        closed
    }

    /// Frees the close requests UCX has finished; true while some are still going.
    fn reap_closed(&mut self) -> bool {
        // SAFETY: each request came from close_ep_nb and is freed once, here.
        self.closing.retain(|&(r, _)| unsafe { !ucx::request_done_free(r) });
        !self.closing.is_empty()
    }

    fn receive_put(&mut self, ep: sys::ucp_ep_h, came_by: Arrival, put: PendingPut, desc: *mut c_void) {
        let dest = self.service.put_destination(&put);
        let length = put.arriving as usize;
        let key = (put.header.session, put.header.request_id);
        let deadline = service::transfer_deadline(self.stall_timeout, put.arriving);
        let pending = Box::into_raw(Box::new(PutInFlight {
            worker: self,
            incarnation: came_by.incarnation,
            reply_ep: ep,
            deadline,
            put,
            abort: None,
        }));
        // SAFETY: the extent is reserved for this transfer only (see PendingPut) until
        // finish_put runs.
        // The descriptor is received through the worker it came by, which may be a retired one.
        let started = unsafe {
            came_by.worker.am_recv_data(desc, dest, length, Some(on_put_received), pending as *mut c_void, came_by.memh)
        };
        match started {
            Ok(Started::Pending) => drop(self.puts.insert(key, pending)),
            // SAFETY: pending reclaimed once: here, or in on_put_received when pending.
            Ok(Started::Done) => self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_OK),
            Err(e) => {
                warn!("rendezvous receive failed to start: {e}");
                self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_ERR_IO_ERROR)
            }
        }
    }

    fn finish_put(&mut self, p: PutInFlight, status: sys::ucs_status_t) {
        self.puts.remove(&(p.put.header.session, p.put.header.request_id));
        if status != sys::UCS_OK {
            debug!("shard {}: rendezvous put failed ({}); slot freed", self.service.index, ucx::status_string(status));
        }
        // Published only if every byte arrived while the client still wanted it: not
        // after it gave up (abort) or went away (its session revoked).
        let wanted = p.abort.is_none() && self.service.client_of(p.put.header.session).is_some();
        let mut m = self.take_reply();
        let header = self.service.finish_put(p.put, status == sys::UCS_OK && wanted, &mut m.payload);
        self.send_reply(p.reply_ep, p.incarnation, header, m, None);
        if let Some(abort) = p.abort {
            debug!("shard {}: put abandoned by its client; discarded", self.service.index);
            let m = self.take_reply();
            self.send_reply(p.reply_ep, p.incarnation, ReplyHeader::new(abort, crate::error::Status::Ok), m, None);
        }
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

unsafe extern "C" fn on_reply_sent(request: *mut c_void, _status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the ReplyMsg box leaked in send_reply for this pending send.
    unsafe {
        let m = Box::from_raw(user_data as *mut ReplyMsg);
        let w = &mut *m.worker;
        // A reply to a departed client was counted out when it left.
        if w.orphans.remove(&m.key()).is_none() {
            w.replies_in_flight.remove(m.incarnation);
        }
        w.sending.remove(&m.key());
        // Zero for a reply to a departed client (discharged when it left).
        w.backlog.discharge(m.client, m.charged);
        w.finish_reply(m);
        ucx::request_free(request);
    }
}

unsafe extern "C" fn on_put_received(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the PutInFlight box leaked in receive_put.
    unsafe {
        let p = Box::from_raw(user_data as *mut PutInFlight);
        let w = &mut *p.worker;
        let _ = catch_unwind(AssertUnwindSafe(|| w.finish_put(*p, status)));
        ucx::request_free(request);
    }
}
