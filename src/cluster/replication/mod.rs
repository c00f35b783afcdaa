//! Replication by servers: a write that a cluster key's primary takes from a client is
//! copied by the primary itself to the key's other replicas, and the writer is answered
//! once every replica the key must have holds it. Until then no client reads the key on
//! the primary (the shard answers "replicating", and the client asks again): no reader
//! sees a write that a replica lacks, so a primary that dies mid-copy leaves nothing a
//! reader saw and the survivors lack.
//!
//! The mover's copies of keys to the members that gain them go the same way
//! ([`CopyJob::to`]), straight from the arena, through a replicator of their own (so that
//! neither kind of copy waits behind the other's).
//!
//! A shard's replicators ([`Replicator`]) send its copies, many in flight, over the real
//! transport to the replicas, as a cluster member (each copy carries a ticket made with
//! the cluster's secret, which clients never hold), and hand the outcomes back. The
//! shard's worker drives the one for writes itself, between requests (a hand-off to
//! another thread and back was most of a small copy's cost); a thread of the shard's
//! copies keys that move, and another large writes where sending one costs the sender
//! (see `Service::set_cluster_role` in src/server/service.rs). The value is read
//! straight from the shard's arena ([`ArenaValue`]): the shard keeps its extent pinned
//! until it hears the copy ended.
//! Copies stream: each is sent as soon as it is handed over, and each replica's answers
//! are taken as they come, so a replica that stops answering holds up only the writes it
//! must take (until the placement moves on without it). Nothing a replicator does
//! sleeps: connections are made, and those given up on closed, on threads of their own.
//!
//! A large write's value can go to the replicas while it still reaches the primary
//! ([`StreamStart`]): the replicator stages what has landed on each replica in parts, in
//! order, and once the primary commits the write ([`CopyJob::streamed`]) installs the
//! staged value there under its generation ([`Kind::ImportStaged`]), so that one write
//! crosses the two links nearly at once instead of one after the other. A replica whose
//! staging failed (no room, a lost connection) gets the whole value instead, as any copy.
//!
//! [`Kind::ImportStaged`]: crate::proto::Kind::ImportStaged

mod peers;
mod targets;
mod work;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::tunables::COPY_SPIN;
use super::ServerRole;
use crate::auth::ClusterSecret;
use crate::error::{Error, Result, Status};
use crate::transport::doorbell::Doorbell;
use work::Work;

/// Tests only: holds every copy this many milliseconds before it is sent, so that a test
/// can act while a write is on its primary alone.
pub const TEST_COPY_DELAY_ENV: &str = "RDRAM_TEST_COPY_DELAY_MS";

/// The bytes of a value in a shard's arena that a copy reads.
pub struct ArenaValue {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes are a committed value's, which nothing writes again (a later write
// to the key goes to another extent), and the shard keeps their extent pinned (neither
// freed nor reused) until the replicator reports the copy ended (see `ArenaValue::new`).
unsafe impl Send for ArenaValue {}

impl ArenaValue {
    /// No bytes (a delete's copy).
    pub fn none() -> ArenaValue {
        ArenaValue { ptr: std::ptr::null(), len: 0 }
    }

    /// # Safety
    /// `ptr..ptr + len` stays valid, and unwritten, until the copy it goes with is
    /// reported ended ([`Replicator::next_done`]) or the replicator is dropped.
    pub unsafe fn new(ptr: *const u8, len: usize) -> ArenaValue {
        ArenaValue { ptr, len }
    }

    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid and unwritten while the copy lasts, as `new`'s caller promised.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A write its primary took, to copy to the key's other replicas.
pub struct CopyJob {
    /// The shard's name for it, handed back with the outcome.
    pub token: u64,
    pub key: Vec<u8>,
    /// None: a delete (of the generation below).
    pub value: Option<ArenaValue>,
    pub generation: u64,
    pub ttl_ms: u64,
    /// A mover's copy: the members it goes to, tried until they hold it for up to
    /// [`MOVE_COPY_DEADLINE`](super::tunables::MOVE_COPY_DEADLINE) (the mover passes
    /// again over what failed). None: a write's copy, to the key's replicas under the
    /// placement, tried for up to [`COPY_DEADLINE`](super::tunables::COPY_DEADLINE).
    pub to: Option<Vec<String>>,
    /// The write's value was streamed to the replicas as it arrived, under this copy's
    /// token ([`Replicator::stream`]): where that staged it whole, it is installed there.
    pub streamed: bool,
}

/// A large write's value on its way into the primary's arena: staged on the key's
/// replicas as it lands, until the write is committed ([`CopyJob::streamed`]) or
/// given up ([`Replicator::abort_stream`]).
pub struct StreamStart {
    /// The write's copy's token, which its [`CopyJob`] then carries.
    pub token: u64,
    pub key: Vec<u8>,
    /// The whole value's place, of which the first `landed` bytes have arrived.
    pub value: ArenaValue,
    pub landed: Landed,
}

/// How many bytes of a streamed value arrived, from its start: set by the shard's worker
/// as they land, each advance waking the replicator thread that sends them on.
#[derive(Clone)]
pub struct Landed {
    bytes: Arc<AtomicU64>,
    doorbell: Arc<Doorbell>,
}

impl Landed {
    pub fn advance_to(&self, bytes: u64) {
        if self.bytes.swap(bytes, Ordering::Release) != bytes {
            self.doorbell.ring();
        }
    }

    pub(super) fn get(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }
}

/// What a shard hands its replicator.
enum Handed {
    Copy(CopyJob),
    Stream(StreamStart),
    /// The streamed write with this token failed: its staging ends, and its outcome
    /// (an error) says that the replicator reads its value no more.
    Abort(u64),
}

/// A copy's outcome: Ok once every replica the key must have holds it.
pub struct Copied {
    pub token: u64,
    pub result: Result<()>,
    /// Replicas that a streamed write's copy sent the whole value to, their staging of it
    /// having failed (no room, a lost connection, a placement that changed meanwhile).
    pub sent_whole: u32,
}

/// What a replicator copies as.
#[derive(Clone)]
pub struct ReplicatorConfig {
    pub role: Arc<ServerRole>,
    pub secret: ClusterSecret,
    /// The cluster's token, which its servers take from each other as from any client.
    pub auth_token: Option<String>,
    /// Where the replicator runs: the cores no worker is pinned to (empty: wherever its
    /// worker may). Started by its shard's worker, it would otherwise share the worker's
    /// core when that is pinned.
    pub cores: Vec<usize>,
}

/// Wakes a shard's worker from its sleep, to hand an ended copy's answer out.
pub type Wake = Box<dyn Fn() + Send + Sync>;

/// A shard's replicator (see the module's doc): a thread of its own
/// ([`Replicator::start`]), or driven by the shard's worker between requests
/// ([`Replicator::inline`]), which saves a small write's copy two hand-offs between threads.
pub struct Replicator {
    jobs: Option<Sender<Handed>>,
    /// A thread's: rung with each hand-over (an inline replicator's worker looks itself).
    doorbell: Option<Arc<Doorbell>>,
    done: Receiver<Copied>,
    wake: Arc<Mutex<Option<Wake>>>,
    runs: Runs,
}

enum Runs {
    Thread { stop: Arc<AtomicBool>, thread: Option<JoinHandle<()>> },
    Inline(Box<Work>),
}

/// What a turn of an inline replicator left: whether it did anything, and until when its
/// caller should look again without sleeping (answers due, or a copy about to be sent).
pub struct Drive {
    pub progressed: bool,
    pub look_until: Option<Instant>,
}

impl Replicator {
    /// Starts shard `shard`'s replicator thread, `rdram-{role}-{shard}`.
    pub fn start(shard: usize, role: &str, cfg: ReplicatorConfig) -> Result<Replicator> {
        let cores = cfg.cores.clone();
        let (work, replicator) = Replicator::parts(cfg, Some(Arc::new(Doorbell::new()?)));
        let stop = work.stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rdram-{role}-{shard}"))
            .spawn(move || {
                crate::server::cores::run_current_thread_on(&cores);
                work.run()
            })
            .map_err(|e| Error::new(Status::Internal, format!("cannot start a replicator thread: {e}")))?;
        Ok(replicator(Runs::Thread { stop, thread: Some(thread) }))
    }

    /// A replicator its caller drives ([`Replicator::drive`]) on its own thread.
    pub fn inline(cfg: ReplicatorConfig) -> Replicator {
        let (work, replicator) = Replicator::parts(cfg, None);
        replicator(Runs::Inline(Box::new(work)))
    }

    /// The work, and what makes the replicator once the work runs somewhere.
    fn parts(cfg: ReplicatorConfig, doorbell: Option<Arc<Doorbell>>) -> (Work, impl FnOnce(Runs) -> Replicator) {
        let (jobs_tx, jobs) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let wake: Arc<Mutex<Option<Wake>>> = Arc::default();
        let work = Work::new(cfg, jobs, doorbell.clone(), done_tx, wake.clone());
        (work, move |runs| Replicator { jobs: Some(jobs_tx), doorbell, done, wake, runs })
    }

    /// A counter of a streamed value's landed bytes for [`StreamStart::landed`]; None for
    /// an inline replicator, which streams nothing.
    pub fn landed(&self) -> Option<Landed> {
        let doorbell = self.doorbell.clone()?;
        Some(Landed { bytes: Arc::default(), doorbell })
    }

    /// How the shard's worker is woken when a thread's copies end (without it, the worker
    /// looks while it polls, and at least every millisecond while copies are in flight).
    pub fn set_wake(&self, wake: Wake) {
        *self.wake.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }

    /// Hands a copy over; its outcome comes back through [`Replicator::next_done`].
    pub fn copy(&self, job: CopyJob) -> Result<()> {
        self.hand(Handed::Copy(job))
    }

    /// Starts staging a write's value on its replicas as it lands (see the module's
    /// doc). One outcome comes back under its token: the [`CopyJob`] that follows once
    /// the write is committed, or the abort's.
    pub fn stream(&self, start: StreamStart) -> Result<()> {
        self.hand(Handed::Stream(start))
    }

    /// The streamed write `token` failed; its outcome comes back once no part of its
    /// value is read any more.
    pub fn abort_stream(&self, token: u64) -> Result<()> {
        self.hand(Handed::Abort(token))
    }

    fn hand(&self, handed: Handed) -> Result<()> {
        let sent = self.jobs.as_ref().map(|j| j.send(handed).is_ok()).unwrap_or(false);
        if let Some(doorbell) = &self.doorbell {
            doorbell.ring();
        }
        match sent {
            true => Ok(()),
            false => Err(Error::new(Status::Internal, "this shard's replicator stopped")),
        }
    }

    /// An inline replicator's turn: takes the copies handed over, sends those due, takes
    /// the answers that came in. Never sleeps (a replica's connection is made, and one
    /// given up on is closed, off this thread). A thread's replicator does nothing here.
    pub fn drive(&mut self) -> Drive {
        match &mut self.runs {
            Runs::Inline(work) => {
                work.take_in(None);
                let turn = work.turn();
                let soon = [turn.answers_by, turn.next_round.filter(|at| *at <= Instant::now() + COPY_SPIN)];
                Drive { progressed: turn.progressed, look_until: soon.into_iter().flatten().max() }
            }
            Runs::Thread { .. } => Drive { progressed: false, look_until: None },
        }
    }

    /// An ended copy, if one is waiting.
    pub fn next_done(&self) -> Option<Copied> {
        self.done.try_recv().ok()
    }
}

impl Drop for Replicator {
    /// Stops the thread and waits for it (an inline replicator's work is dropped with it):
    /// the arena its copies read from is freed after.
    fn drop(&mut self) {
        self.jobs = None;
        if let Runs::Thread { stop, thread } = &mut self.runs {
            stop.store(true, Ordering::SeqCst);
            if let Some(doorbell) = &self.doorbell {
                doorbell.ring();
            }
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}
