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
//! shard's worker drives the one for small writes itself, between requests (a hand-off to
//! another thread and back was most of a small copy's cost); threads of the shard's copy
//! large writes and keys that move. The value is read straight from the shard's arena
//! ([`ArenaValue`]): the shard keeps its extent pinned until it hears the copy ended.
//! Copies stream: each is sent as soon as it is handed over, and each replica's answers
//! are taken as they come, so a replica that stops answering holds up only the writes it
//! must take (until the placement moves on without it). Nothing a replicator does
//! sleeps: connections are made, and those given up on closed, on threads of their own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use tracing::{debug, warn};

use super::tunables::{
    COPY_ANSWER_SPIN, COPY_ANSWER_SPIN_MAX, COPY_BATCH, COPY_DEADLINE, COPY_DEPTH, COPY_IDLE_WAIT, COPY_NAP_MAX,
    COPY_NAP_MIN, COPY_PEER_TIMEOUT, COPY_RETRY_MAX, COPY_RETRY_MIN, COPY_SPIN, EXPECTED_BYTES_PER_US,
    MOVE_COPY_DEADLINE,
};
use super::{Routing, ServerRole};
use crate::auth::ClusterSecret;
use crate::client::{Client, ClientOptions, CopyInFlight, ReplicaCopy};
use crate::error::{Error, Result, Status};

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
    /// [`MOVE_COPY_DEADLINE`] (the mover passes again over what failed). None: a write's
    /// copy, to the key's replicas under the placement, tried for up to [`COPY_DEADLINE`].
    pub to: Option<Vec<String>>,
}

/// A copy's outcome: Ok once every replica the key must have holds it.
pub struct Copied {
    pub token: u64,
    pub result: Result<()>,
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
    jobs: Option<Sender<CopyJob>>,
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
        let (work, mut replicator) = Replicator::parts(cfg);
        let stop = work.stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rdram-{role}-{shard}"))
            .spawn(move || {
                crate::server::cores::run_current_thread_on(&cores);
                work.run()
            })
            .map_err(|e| Error::new(Status::Internal, format!("cannot start a replicator thread: {e}")))?;
        replicator.runs = Runs::Thread { stop, thread: Some(thread) };
        Ok(replicator)
    }

    /// A replicator its caller drives ([`Replicator::drive`]) on its own thread.
    pub fn inline(cfg: ReplicatorConfig) -> Replicator {
        let (work, mut replicator) = Replicator::parts(cfg);
        replicator.runs = Runs::Inline(Box::new(work));
        replicator
    }

    fn parts(cfg: ReplicatorConfig) -> (Work, Replicator) {
        let (jobs_tx, jobs) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let wake: Arc<Mutex<Option<Wake>>> = Arc::default();
        let work = Work {
            cfg,
            jobs,
            done: done_tx,
            wake: wake.clone(),
            stop: Arc::new(AtomicBool::new(false)),
            peers: HashMap::new(),
            connecting: HashMap::new(),
            closing: Vec::new(),
            waiting: HashMap::new(),
            delay: std::env::var(TEST_COPY_DELAY_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis),
        };
        let runs = Runs::Thread { stop: work.stop.clone(), thread: None };
        (work, Replicator { jobs: Some(jobs_tx), done, wake, runs })
    }

    /// How the shard's worker is woken when a thread's copies end (without it, the worker
    /// looks while it polls, and at least every millisecond while copies are in flight).
    pub fn set_wake(&self, wake: Wake) {
        *self.wake.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }

    /// Hands a copy over; its outcome comes back through [`Replicator::next_done`].
    pub fn copy(&self, job: CopyJob) -> Result<()> {
        let sent = self.jobs.as_ref().map(|j| j.send(job).is_ok()).unwrap_or(false);
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
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A copy not yet taken by every replica it must reach.
struct Waiting {
    job: CopyJob,
    /// Replicas that hold it.
    holding: Vec<String>,
    /// Replicas its copy is in flight to (its round of sends ends when none is left).
    sending: Vec<String>,
    /// Whether a round of sends is under way.
    in_round: bool,
    /// Due, but a replica it goes to has its fill of copies in flight: sent once one of
    /// those ends.
    blocked: bool,
    /// Why a replica it must reach did not take it in this round.
    missed: Option<String>,
    /// A replica it must reach refused it for good (no room for the value): the copy ends
    /// with this once its round does, rather than being sent again until its deadline.
    refused: Option<Error>,
    started: Instant,
    retry_at: Instant,
    pause: Duration,
    /// Why the last round fell short.
    why: String,
}

/// A replica copies go to: the connection, and the copies in flight on it.
struct Peer {
    // Dropped before the flights: the transport reads their bytes until it is closed.
    client: Client,
    flights: Vec<Flight>,
    /// The connection failed: made anew once its flights ended.
    broken: bool,
    /// A copy on it is overdue, or the replica's lease lapsed: it is closed, with the
    /// copies in flight on it given up (see [`Closing`]).
    given_up: bool,
}

/// A connection given up on with copies in flight, closed on a thread of its own: giving
/// a copy up waits, for up to the transport's abort grace, until the replica stops
/// reading its bytes (their extents stay pinned until then), and nothing else waits
/// meanwhile. The copies' outcomes come back once it is closed.
struct Closing {
    replica: String,
    /// Each copy's token, and whether its key must reach this replica.
    copies: Vec<(u64, bool)>,
    outcomes: Receiver<Vec<Result<()>>>,
}

struct Flight {
    token: u64,
    copy: CopyInFlight,
    /// Whether the copy's key must reach this replica (else it is one the key leaves).
    must: bool,
    /// Until when its answer is looked for without sleeping: the round trip and the time
    /// its bytes take to cross.
    expected_by: Instant,
    sent: Instant,
}

struct Work {
    cfg: ReplicatorConfig,
    jobs: Receiver<CopyJob>,
    done: Sender<Copied>,
    wake: Arc<Mutex<Option<Wake>>>,
    stop: Arc<AtomicBool>,
    /// A connection to each replica copied to, by name.
    peers: HashMap<String, Peer>,
    /// Connections being made, off this thread (one to a stopped server takes seconds to
    /// fail, and copies to every other replica would wait behind it meanwhile).
    connecting: HashMap<String, Receiver<Result<Client>>>,
    /// Connections being closed, off this thread.
    closing: Vec<Closing>,
    /// Copies not yet ended, by the shard's token.
    waiting: HashMap<u64, Waiting>,
    /// See [`TEST_COPY_DELAY_ENV`].
    delay: Duration,
}

impl Drop for Work {
    /// Waits for the connections being closed: until then their transports may read the
    /// bytes of the copies given up on, in extents the arena frees after.
    fn drop(&mut self) {
        for c in self.closing.drain(..) {
            let _ = c.outcomes.recv();
        }
    }
}

/// Where one copy goes under the current placement.
enum Targets {
    /// Replicas that must take it, and those the key leaves whose lease lapsed (sent
    /// where they answer).
    Copy { required: Vec<String>, leaving: Vec<String> },
    /// The write may not last: this server is the key's primary no more, and the write
    /// was taken after the current epoch began.
    Superseded(String),
}

/// What a turn of a replicator left.
struct Turn {
    progressed: bool,
    /// Until when answers are due (the latest of the copies in flight).
    answers_by: Option<Instant>,
    /// When the next copy waiting between its rounds is due.
    next_round: Option<Instant>,
    /// Whether connections are being closed, with copies given up on them.
    closing: bool,
}

impl Work {
    /// A replicator thread's loop: a turn, then a wait for what comes next (see
    /// [`Work::turn`]).
    fn run(mut self) {
        let mut nap = COPY_NAP_MIN;
        while !self.stop.load(Ordering::SeqCst) {
            let turn = self.turn();
            let now = Instant::now();
            let mut until_round = turn.next_round.map_or(COPY_IDLE_WAIT, |at| at.saturating_duration_since(now));
            if turn.closing {
                // Their copies' outcomes come back as the connections close.
                until_round = until_round.min(COPY_NAP_MAX);
            }
            if turn.progressed {
                nap = COPY_NAP_MIN;
            }
            let wait = match turn.answers_by {
                None => until_round,
                // Answers are due: look again at once, giving the CPU up between looks.
                Some(by) if turn.progressed || now < by => Duration::ZERO,
                // Overdue (a replica slow or stopped): nap, woken by a new copy.
                Some(_) => {
                    let n = nap;
                    nap = (nap * 2).min(COPY_NAP_MAX);
                    n.min(until_round)
                }
            };
            if wait.is_zero() && !turn.progressed {
                std::thread::yield_now();
            }
            match self.next_job(wait) {
                Ok(first) => self.take_in(first),
                Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Takes the answers that came in, sends the copies that are due, ends those every
    /// replica they must reach took. Each replica's copies go on their own: one that does
    /// not answer holds up only the writes it must take. Never sleeps.
    fn turn(&mut self) -> Turn {
        let mut progressed = self.collect();
        let now = Instant::now();
        progressed |= self.dispatch(now);
        self.settle(now);
        self.report(now);
        Turn {
            progressed,
            answers_by: self.peers.values().flat_map(|p| &p.flights).map(|f| f.expected_by).max(),
            next_round: self.waiting.values().filter(|w| !w.in_round && !w.blocked).map(|w| w.retry_at).min(),
            closing: !self.closing.is_empty(),
        }
    }

    /// Takes `first` and the copies handed over behind it.
    fn take_in(&mut self, first: Option<CopyJob>) {
        let now = Instant::now();
        for job in first.into_iter().chain(std::iter::from_fn(|| self.jobs.try_recv().ok())).take(COPY_BATCH) {
            let waiting = Waiting {
                holding: Vec::new(),
                sending: Vec::new(),
                in_round: false,
                blocked: false,
                missed: None,
                refused: None,
                started: now,
                retry_at: now + self.delay,
                pause: COPY_RETRY_MIN,
                why: String::new(),
                job,
            };
            self.waiting.insert(waiting.job.token, waiting);
        }
    }

    /// The next copy handed over within `wait`: looked for without sleeping for up to
    /// [`COPY_SPIN`] first (giving the CPU up between looks), as copies come right behind each
    /// other under load and a sleeping thread takes tens of µs to wake.
    fn next_job(&self, wait: Duration) -> std::result::Result<Option<CopyJob>, RecvTimeoutError> {
        let started = Instant::now();
        loop {
            match self.jobs.try_recv() {
                Ok(job) => return Ok(Some(job)),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
            }
            let spun = started.elapsed();
            if spun >= wait {
                return Ok(None);
            }
            if spun >= COPY_SPIN {
                return self.jobs.recv_timeout(wait - spun).map(Some);
            }
            std::thread::yield_now();
        }
    }

    /// Takes the answers that came in; gives up on the connections with a copy past its
    /// request timeout, or to a replica whose lease lapsed (closed off this thread, see
    /// [`Closing`]), and takes the outcomes of those closed since. Whether anything ended.
    fn collect(&mut self) -> bool {
        let mut progressed = false;
        let now = Instant::now();
        let waiting = &mut self.waiting;
        for (name, peer) in self.peers.iter_mut().filter(|(_, p)| !p.flights.is_empty()) {
            peer.client.poll_copies();
            peer.given_up = !self.cfg.role.is_live(name);
            let mut i = 0;
            while i < peer.flights.len() && !peer.given_up {
                let f = &peer.flights[i];
                if now.duration_since(f.sent) >= COPY_PEER_TIMEOUT {
                    peer.given_up = true;
                    break;
                }
                if !peer.client.copy_answered(&f.copy) {
                    i += 1;
                    continue;
                }
                progressed = true;
                let f = peer.flights.swap_remove(i);
                // Answered: returns at once.
                let outcome = peer.client.copy_outcome(f.copy, Duration::ZERO);
                if outcome.as_ref().is_err_and(|e| breaks(e.status)) {
                    peer.broken = true;
                }
                took(waiting, name, f.token, f.must, outcome);
            }
        }
        // Given-up connections are closed, and broken ones without copies in flight made
        // anew on the next copy to their replica.
        let gone: Vec<String> = (self.peers.iter())
            .filter(|(_, p)| (p.given_up && !p.flights.is_empty()) || (p.broken && p.flights.is_empty()))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            let peer = self.peers.remove(&name).unwrap();
            progressed |= !peer.flights.is_empty();
            if let Some(closing) = close_off_thread(name, peer) {
                self.closing.push(closing);
            }
        }
        let waiting = &mut self.waiting;
        self.closing.retain(|c| {
            let outcomes = match c.outcomes.try_recv() {
                Ok(outcomes) => outcomes,
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
                Err(crossbeam_channel::TryRecvError::Disconnected) => Vec::new(),
            };
            let mut outcomes = outcomes.into_iter();
            for &(token, must) in &c.copies {
                let outcome = outcomes.next().unwrap_or_else(|| {
                    Err(Error::new(Status::Internal, "closing the connection ended without a word"))
                });
                took(waiting, &c.replica, token, must, outcome);
            }
            progressed = true;
            false
        });
        progressed
    }

    /// Starts a round of sends for every copy due; whether any was sent.
    fn dispatch(&mut self, now: Instant) -> bool {
        let due: Vec<u64> =
            self.waiting.iter().filter(|(_, w)| !w.in_round && w.retry_at <= now).map(|(t, _)| *t).collect();
        if due.is_empty() {
            return false;
        }
        let Some(current) = self.cfg.role.current() else {
            // Not in a placement yet (or any more): nothing can be copied now.
            for t in due {
                let w = self.waiting.get_mut(&t).unwrap();
                w.why = "this server holds no placement".into();
                w.retry_at = now + COPY_RETRY_MAX;
            }
            return false;
        };
        let (me, routing) = (current.0.as_str(), &current.1);
        let mut sent = false;
        let mut ended = Vec::new();
        for token in due {
            let w = &self.waiting[&token];
            let targets = match &w.job.to {
                Some(to) => Targets::Copy { required: to.clone(), leaving: Vec::new() },
                None => targets(me, routing, &w.job, |m| self.cfg.role.is_live(m)),
            };
            let (required, leaving) = match targets {
                Targets::Superseded(why) => {
                    ended.push((token, Err(Error::new(Status::Unavailable, why))));
                    continue;
                }
                Targets::Copy { required, leaving } => (required, leaving),
            };
            let lacking: Vec<(String, bool)> = (required.into_iter().map(|r| (r, true)))
                .chain(leaving.into_iter().map(|r| (r, false)))
                .filter(|(r, _)| !w.holding.contains(r))
                .collect();
            if lacking.is_empty() {
                ended.push((token, Ok(())));
                continue;
            }
            // A replica with its fill of copies in flight takes this one on a later turn.
            let blocked = lacking.iter().any(|(r, _)| self.peers.get(r).is_some_and(|p| p.flights.len() >= COPY_DEPTH));
            let w = self.waiting.get_mut(&token).unwrap();
            w.blocked = blocked;
            if blocked {
                continue;
            }
            w.in_round = true;
            for (replica, must) in lacking {
                match send(&mut self.peers, &mut self.connecting, &self.cfg, &replica, w, must, now) {
                    Ok(()) => {
                        w.sending.push(replica);
                        sent = true;
                    }
                    Err(e) if must => w.missed = Some(format!("replica {replica}: {}", e.message)),
                    Err(_) => {}
                }
            }
        }
        self.end(ended);
        sent
    }

    /// Ends the rounds whose sends all came back: the copy ended if every replica it must
    /// reach took it (those it leaves were tried once), else it is sent again later.
    fn settle(&mut self, now: Instant) {
        let mut ended = Vec::new();
        for (&token, w) in self.waiting.iter_mut().filter(|(_, w)| w.in_round && w.sending.is_empty()) {
            w.in_round = false;
            if let Some(e) = w.refused.take() {
                ended.push((token, Err(e)));
                continue;
            }
            match w.missed.take() {
                Some(why) => {
                    w.why = why;
                    w.retry_at = now + w.pause;
                    w.pause = (w.pause * 2).min(COPY_RETRY_MAX);
                }
                None => ended.push((token, Ok(()))),
            }
        }
        self.end(ended);
    }

    /// Hands back the copies in `ended` with their outcomes.
    fn end(&mut self, ended: Vec<(u64, Result<()>)>) {
        if ended.is_empty() {
            return;
        }
        for (token, result) in ended {
            self.waiting.remove(&token);
            let _ = self.done.send(Copied { token, result });
        }
        self.wake_worker();
    }

    fn wake_worker(&self) {
        if let Some(wake) = &*self.wake.lock().unwrap_or_else(|e| e.into_inner()) {
            wake();
        }
    }

    /// Gives up on copies past their deadline, between rounds: their writers are told.
    fn report(&mut self, now: Instant) {
        let mut ended = Vec::new();
        for (&token, w) in self.waiting.iter().filter(|(_, w)| !w.in_round) {
            let deadline = match w.job.to {
                Some(_) => MOVE_COPY_DEADLINE,
                None => COPY_DEADLINE,
            };
            if now.duration_since(w.started) < deadline {
                continue;
            }
            let e = match w.job.to {
                // The mover hears why, and passes over the key again.
                Some(_) => Error::new(
                    Status::Unavailable,
                    format!("a copy out could not reach every member named within {deadline:?}: {}", w.why),
                ),
                None => {
                    warn!("a write's copy to its replicas failed for {deadline:?}: {}; its writer is told", w.why);
                    Error::new(
                        Status::Unavailable,
                        format!(
                            "the key's primary took the write but could not copy it to every replica within {deadline:?}: {}",
                            w.why
                        ),
                    )
                }
            };
            ended.push((token, Err(e)));
        }
        self.end(ended);
        if !self.waiting.is_empty() {
            debug!("{} writes wait for their replicas", self.waiting.len());
        }
    }
}

/// Sends `w`'s copy to `replica` over its connection in `peers`, which is made first, off
/// this thread, if there is none (the copy then goes once it is made).
fn send(
    peers: &mut HashMap<String, Peer>,
    connecting: &mut HashMap<String, Receiver<Result<Client>>>,
    cfg: &ReplicatorConfig,
    replica: &str,
    w: &Waiting,
    must: bool,
    now: Instant,
) -> Result<()> {
    if !peers.contains_key(replica) {
        let made = match connecting.get(replica).map(|r| r.try_recv()) {
            Some(Ok(made)) => made,
            Some(Err(crossbeam_channel::TryRecvError::Empty)) => {
                return Err(Error::new(Status::Unavailable, "connecting to it"));
            }
            Some(Err(crossbeam_channel::TryRecvError::Disconnected)) => {
                Err(Error::new(Status::Internal, "its connecting thread ended without a word"))
            }
            None => {
                connecting.insert(replica.to_string(), connect(cfg, replica)?);
                return Err(Error::new(Status::Unavailable, "connecting to it"));
            }
        };
        connecting.remove(replica);
        peers.insert(replica.to_string(), Peer { client: made?, flights: Vec::new(), broken: false, given_up: false });
    }
    let peer = peers.get_mut(replica).unwrap();
    let job = &w.job;
    let value = job.value.as_ref().map(ArenaValue::bytes);
    let copy = ReplicaCopy { key: &job.key, value, generation: job.generation, ttl_ms: job.ttl_ms };
    // SAFETY: the key and value stay put until the copy ends: the job is not ended while a
    // copy of it is in flight (`sending`), and its value's extent stays pinned until then.
    let sent = unsafe { peer.client.send_replica_copy(&copy) };
    let copy = sent.inspect_err(|e| peer.broken |= breaks(e.status))?;
    let crossing = Duration::from_micros(value.map_or(0, |v| v.len() as u64) / EXPECTED_BYTES_PER_US);
    let expected_by = now + (COPY_ANSWER_SPIN + crossing).min(COPY_ANSWER_SPIN_MAX);
    peer.flights.push(Flight { token: job.token, copy, must, expected_by, sent: now });
    Ok(())
}

/// Whether a copy's failure leaves its connection unusable.
fn breaks(status: Status) -> bool {
    matches!(status, Status::Transport | Status::Timeout | Status::Unavailable)
}

/// Records `replica`'s outcome for the copy `token` (whose key must reach it, or leaves it).
fn took(waiting: &mut HashMap<u64, Waiting>, replica: &str, token: u64, must: bool, outcome: Result<()>) {
    let w = waiting.get_mut(&token).expect("a copy in flight is waiting");
    w.sending.retain(|r| r != replica);
    match outcome {
        Ok(()) => w.holding.push(replica.to_string()),
        Err(e) if must && refuses_for_good(e.status) => {
            let what = match w.job.to {
                None => "the key's primary took the write, but replica",
                Some(_) => "member",
            };
            w.refused = Some(Error::new(e.status, format!("{what} {replica} refused it: {}", e.message)));
        }
        Err(e) if must => w.missed = Some(format!("replica {replica}: {}", e.message)),
        Err(_) => {}
    }
}

/// Whether a replica's refusal stands however often the copy is sent: it has no room for
/// the value (in store mode nothing is evicted to make some).
fn refuses_for_good(status: Status) -> bool {
    matches!(status, Status::NoSpace | Status::ValueTooLarge | Status::KeyTooLarge)
}

/// Closes `peer`'s connection on a thread of its own, giving up the copies in flight on
/// it; the [`Closing`] that hands their outcomes back, if there were any.
fn close_off_thread(replica: String, mut peer: Peer) -> Option<Closing> {
    let copies: Vec<(u64, bool)> = peer.flights.iter().map(|f| (f.token, f.must)).collect();
    if !copies.is_empty() {
        warn!("giving up {} copies in flight to {replica} (overdue, or its lease lapsed)", copies.len());
    }
    let (tx, outcomes) = crossbeam_channel::bounded(1);
    let close = move || {
        let flights = std::mem::take(&mut peer.flights);
        // Each returns once the transport reads the copy's bytes no more.
        let outcomes: Vec<Result<()>> =
            flights.into_iter().map(|f| peer.client.copy_outcome(f.copy, Duration::ZERO)).collect();
        drop(peer);
        let _ = tx.send(outcomes);
    };
    if let Err(e) = std::thread::Builder::new().name("rdram-close".into()).spawn(close) {
        // The closure went with the error, and the peer with it (its connection first):
        // the copies are told they failed.
        warn!("cannot start a thread to close a replica's connection ({e}); closed on this one");
    }
    (!copies.is_empty()).then_some(Closing { replica, copies, outcomes })
}

/// Starts a connection to `replica` on a thread of its own: it comes back through the
/// receiver.
fn connect(cfg: &ReplicatorConfig, replica: &str) -> Result<Receiver<Result<Client>>> {
    let opts = ClientOptions {
        auth_token: cfg.auth_token.clone(),
        cluster_secret: Some(cfg.secret.clone()),
        timeout: COPY_PEER_TIMEOUT,
        connect_timeout: COPY_PEER_TIMEOUT.min(Duration::from_secs(2)),
        ..Default::default()
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let replica = replica.to_string();
    std::thread::Builder::new()
        .name("rdram-connect".into())
        .spawn(move || drop(tx.send(Client::connect(&replica, opts))))
        .map_err(|e| Error::new(Status::Internal, format!("cannot start a thread to connect: {e}")))?;
    Ok(rx)
}

/// Where `job`'s copy goes under `routing`, as seen by member `me`; `live`: whether etcd
/// lists a member as live.
fn targets(me: &str, routing: &Routing, job: &CopyJob, live: impl Fn(&str) -> bool) -> Targets {
    let key = &job.key;
    let primary = routing.owner(key) == Some(me) || routing.next_owner(key) == Some(me);
    // A write taken by a server that is the key's primary no more is copied on only if
    // it was taken before the current epoch began: at or below the epoch's floor (the
    // highest generation its old primaries gave out), since the key's new primary gives
    // out only generations above it. Otherwise (this server lost its lease, or was paused, and the
    // placement moved on without it) it may be ordered after writes taken since.
    if !primary && job.generation > routing.placement.generation_floor {
        return Targets::Superseded(format!(
            "the placement changed while the write was copied: {me} took it but is no longer the key's primary, so it may not last; read the key to see"
        ));
    }
    let now: Vec<String> = routing.replicas(key).into_iter().map(String::from).collect();
    let then: Vec<String> = routing.next_replicas(key).into_iter().map(String::from).collect();
    let mut required: Vec<String> = if then.is_empty() { now.clone() } else { then };
    // With one replica per key, the one it leaves hands it over itself (the mover).
    let leaving: Vec<String> =
        now.iter().filter(|s| now.len() > 1 && !required.contains(s) && *s != me).cloned().collect();
    // A replica the key leaves still takes the reads that fail over to it until the move
    // ends, so it must hold every write acknowledged meanwhile; once its lease lapsed it
    // serves no more (it fenced itself first), and the write does not wait for it.
    let (live_leaving, lapsed): (Vec<String>, Vec<String>) = leaving.into_iter().partition(|s| live(s));
    required.extend(live_leaving);
    let required = required.into_iter().filter(|s| s != me).collect();
    Targets::Copy { required, leaving: lapsed }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Placement;

    /// The last write the old primary took before the seal has the floor's generation:
    /// it is copied on after the epoch turns; one above the floor may not last.
    #[test]
    fn a_write_from_before_the_epoch_is_copied_on_and_one_after_it_is_not() {
        let members = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = Placement {
            epoch: 3,
            members: members(&["b", "c"]),
            replicas: 2,
            version: 9,
            generation_floor: 700,
            ..Default::default()
        };
        let routing = Routing::new(placement);
        let job = |generation| CopyJob { token: 1, key: b"k".to_vec(), value: None, generation, ttl_ms: 0, to: None };
        let live = |_: &str| true;
        // "a" left the members: it is the key's primary no more.
        assert!(matches!(targets("a", &routing, &job(700), live), Targets::Copy { .. }), "taken before the epoch");
        assert!(matches!(targets("a", &routing, &job(699), live), Targets::Copy { .. }));
        assert!(matches!(targets("a", &routing, &job(701), live), Targets::Superseded(_)), "taken after it began");
        let Targets::Copy { required, leaving } = targets("a", &routing, &job(700), live) else { unreachable!() };
        assert_eq!((sorted(required), leaving), (vec!["b".to_string(), "c".to_string()], Vec::<String>::new()));
    }

    /// While a key moves, a replica it leaves takes the reads that fail over to it: the
    /// write waits for it as long as etcd lists it live, and is sent where it answers once
    /// its lease lapsed.
    #[test]
    fn a_write_waits_for_a_live_replica_the_key_leaves_and_not_for_a_lapsed_one() {
        let members = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = Placement {
            epoch: 3,
            members: members(&["a", "b", "c"]),
            next: Some(members(&["a", "b", "c", "d"])),
            replicas: 2,
            version: 9,
            ..Default::default()
        };
        let routing = Routing::new(placement);
        // A key whose replicas change during the move, one kept and one replaced.
        let key = (0..10_000u32)
            .map(|i| format!("k{i}").into_bytes())
            .find(|k| {
                let (now, then) = (routing.replicas(k), routing.next_replicas(k));
                now[0] == then[0] && now[1] != then[1]
            })
            .expect("a key whose second replica changes");
        let (primary, leaving, gaining) = (
            routing.replicas(&key)[0].to_string(),
            routing.replicas(&key)[1].to_string(),
            routing.next_replicas(&key)[1].to_string(),
        );
        let job = CopyJob { token: 1, key: key.clone(), value: None, generation: 1, ttl_ms: 0, to: None };
        let Targets::Copy { required, leaving: lapsed } = targets(&primary, &routing, &job, |_| true) else {
            unreachable!()
        };
        assert_eq!((sorted(required), lapsed), (sorted(vec![gaining.clone(), leaving.clone()]), Vec::<String>::new()));
        let Targets::Copy { required, leaving: lapsed } = targets(&primary, &routing, &job, |m| m != leaving) else {
            unreachable!()
        };
        assert_eq!((required, lapsed), (vec![gaining], vec![leaving]));
    }

    fn sorted(mut v: Vec<String>) -> Vec<String> {
        v.sort();
        v
    }
}
