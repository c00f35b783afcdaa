//! Replication by servers: a write that a cluster key's primary takes from a client is
//! copied by the primary itself to the key's other replicas, and the writer is answered
//! once every replica the key must have holds it. Until then no client reads the key on
//! the primary (the shard answers "replicating", and the client asks again): no reader
//! sees a write that a replica lacks, so a primary that dies mid-copy leaves nothing a
//! reader saw and the survivors lack.
//!
//! The mover's copies of keys to the members that gain them go the same way
//! ([`CopyJob::to`]), straight from the arena, through a second replicator of the shard's
//! (so that neither kind of copy waits behind the other's).
//!
//! Each shard worker hands its copies to a replicator thread of its own ([`Replicator`]),
//! which sends them, many in flight, over the real transport to the replicas (as a
//! cluster member: each copy carries a ticket made with the cluster's secret, which
//! clients never hold), and hands the outcomes back. The value is read straight from the
//! shard's arena ([`ArenaValue`]): the shard keeps its extent pinned until it hears the
//! copy ended.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use tracing::{debug, warn};

use super::tunables::{
    COPY_BATCH, COPY_DEADLINE, COPY_DEPTH, COPY_IDLE_WAIT, COPY_PEER_TIMEOUT, COPY_RETRY_MAX, COPY_RETRY_MIN,
    COPY_SPIN, MOVE_COPY_DEADLINE,
};
use super::{Routing, ServerRole};
use crate::auth::ClusterSecret;
use crate::client::{Client, ClientOptions, ReplicaCopy};
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

/// A shard's replicator thread (see the module's doc).
pub struct Replicator {
    jobs: Option<Sender<CopyJob>>,
    done: Receiver<Copied>,
    wake: Arc<Mutex<Option<Wake>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Replicator {
    /// Starts shard `shard`'s replicator thread, `rdram-{role}-{shard}`.
    pub fn start(shard: usize, role: &str, cfg: ReplicatorConfig) -> Result<Replicator> {
        let (jobs_tx, jobs) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let cores = cfg.cores.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let wake: Arc<Mutex<Option<Wake>>> = Arc::default();
        let work = Work {
            cfg,
            jobs,
            done: done_tx,
            wake: wake.clone(),
            stop: stop.clone(),
            peers: HashMap::new(),
            waiting: Vec::new(),
            delay: std::env::var(TEST_COPY_DELAY_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis),
        };
        let thread = std::thread::Builder::new()
            .name(format!("rdram-{role}-{shard}"))
            .spawn(move || {
                crate::server::cores::run_current_thread_on(&cores);
                work.run()
            })
            .map_err(|e| Error::new(Status::Internal, format!("cannot start a replicator thread: {e}")))?;
        Ok(Replicator { jobs: Some(jobs_tx), done, wake, stop, thread: Some(thread) })
    }

    /// How the shard's worker is woken when copies end (without it, the worker looks
    /// while it polls, and at least every millisecond while copies are in flight).
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

    /// An ended copy, if one is waiting.
    pub fn next_done(&self) -> Option<Copied> {
        self.done.try_recv().ok()
    }
}

impl Drop for Replicator {
    /// Stops the thread and waits for it: the arena its copies read from is freed after.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A copy not yet taken by every replica it must reach.
struct Waiting {
    job: CopyJob,
    /// Replicas that hold it.
    holding: Vec<String>,
    started: Instant,
    retry_at: Instant,
    pause: Duration,
    /// Why the last attempt fell short.
    why: String,
}

struct Work {
    cfg: ReplicatorConfig,
    jobs: Receiver<CopyJob>,
    done: Sender<Copied>,
    wake: Arc<Mutex<Option<Wake>>>,
    stop: Arc<AtomicBool>,
    /// A connection to each replica copied to.
    peers: HashMap<String, Client>,
    waiting: Vec<Waiting>,
    /// See [`TEST_COPY_DELAY_ENV`].
    delay: Duration,
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

impl Work {
    fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            let wait = self
                .waiting
                .iter()
                .map(|w| w.retry_at)
                .min()
                .map_or(COPY_IDLE_WAIT, |at| at.saturating_duration_since(now));
            let first = match self.next_job(wait) {
                Ok(job) => job,
                Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => None,
            };
            let now = Instant::now();
            for job in first.into_iter().chain(std::iter::from_fn(|| self.jobs.try_recv().ok())).take(COPY_BATCH) {
                let retry_at = now + self.delay;
                let waiting = Waiting {
                    job,
                    holding: Vec::new(),
                    started: now,
                    retry_at,
                    pause: COPY_RETRY_MIN,
                    why: String::new(),
                };
                self.waiting.push(waiting);
            }
            self.copy_due();
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

    /// Sends every copy due, to every replica that lacks it, and reports those that ended.
    fn copy_due(&mut self) {
        let now = Instant::now();
        let Some(current) = self.cfg.role.current() else {
            // Not in a placement yet (or any more): nothing can be copied now.
            for w in self.waiting.iter_mut().filter(|w| w.retry_at <= now) {
                w.why = "this server holds no placement".into();
                w.retry_at = now + COPY_RETRY_MAX;
            }
            return self.report(now);
        };
        let (me, routing) = (current.0.as_str(), &current.1);
        // Per replica: the copies (indices into `waiting`) it lacks.
        let mut sends: HashMap<String, Vec<(usize, bool)>> = HashMap::new();
        let mut ended = Vec::new();
        for (i, w) in self.waiting.iter_mut().enumerate().filter(|(_, w)| w.retry_at <= now) {
            let targets = match &w.job.to {
                Some(to) => Targets::Copy { required: to.clone(), leaving: Vec::new() },
                None => targets(me, routing, &w.job, |m| self.cfg.role.is_live(m)),
            };
            match targets {
                Targets::Superseded(why) => ended.push((i, Err(Error::new(Status::Unavailable, why)))),
                Targets::Copy { required, leaving } => {
                    let lacking = |r: &String| !w.holding.contains(r);
                    if !required.iter().any(lacking) && leaving.is_empty() {
                        ended.push((i, Ok(())));
                        continue;
                    }
                    for r in required.iter().filter(|r| lacking(r)) {
                        sends.entry(r.clone()).or_default().push((i, true));
                    }
                    for r in leaving.iter().filter(|r| lacking(r)) {
                        sends.entry(r.clone()).or_default().push((i, false));
                    }
                }
            }
        }
        let mut settled = vec![false; self.waiting.len()];
        for &(i, _) in &ended {
            settled[i] = true;
        }
        let mut missed: HashMap<usize, String> = HashMap::new();
        for (replica, items) in sends {
            for ((i, must), outcome) in items.iter().copied().zip(self.send(&replica, &items)) {
                match outcome {
                    Ok(()) => self.waiting[i].holding.push(replica.clone()),
                    Err(e) if must => drop(missed.insert(i, format!("replica {replica}: {}", e.message))),
                    Err(_) => {}
                }
            }
        }
        for (i, w) in self.waiting.iter_mut().enumerate().filter(|(_, w)| w.retry_at <= now) {
            if settled[i] {
                continue;
            }
            match missed.remove(&i) {
                Some(why) => {
                    w.why = why;
                    w.retry_at = now + w.pause;
                    w.pause = (w.pause * 2).min(COPY_RETRY_MAX);
                }
                // Every replica it must reach holds it (leaving ones were tried once).
                None => ended.push((i, Ok(()))),
            }
        }
        self.end(ended);
        self.report(now);
    }

    /// Sends `items` (copies in `waiting`) to `replica`, many in flight: each one's outcome.
    fn send(&mut self, replica: &str, items: &[(usize, bool)]) -> Vec<Result<()>> {
        let client = match peer(&mut self.peers, &self.cfg, replica) {
            Ok(c) => c,
            Err(e) => return items.iter().map(|_| Err(e.clone())).collect(),
        };
        let copies: Vec<ReplicaCopy> = items
            .iter()
            .map(|&(i, _)| {
                let job = &self.waiting[i].job;
                ReplicaCopy {
                    key: &job.key,
                    value: job.value.as_ref().map(ArenaValue::bytes),
                    generation: job.generation,
                    ttl_ms: job.ttl_ms,
                }
            })
            .collect();
        let outcomes = client.replicate_many(&copies, COPY_DEPTH);
        if outcomes.iter().any(|r| r.as_ref().is_err_and(|e| matches!(e.status, Status::Transport | Status::Timeout))) {
            // Connected anew on the next attempt.
            self.peers.remove(replica);
        }
        outcomes
    }

    /// Hands back the copies in `ended` (indices into `waiting`) with their outcomes.
    fn end(&mut self, mut ended: Vec<(usize, Result<()>)>) {
        ended.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, result) in ended {
            let w = self.waiting.swap_remove(i);
            let _ = self.done.send(Copied { token: w.job.token, result });
        }
        self.wake_worker();
    }

    fn wake_worker(&self) {
        if let Some(wake) = &*self.wake.lock().unwrap_or_else(|e| e.into_inner()) {
            wake();
        }
    }

    /// Gives up on copies past their deadline: their writers are told.
    fn report(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.waiting.len() {
            let deadline = match self.waiting[i].job.to {
                Some(_) => MOVE_COPY_DEADLINE,
                None => COPY_DEADLINE,
            };
            if now.duration_since(self.waiting[i].started) < deadline {
                i += 1;
                continue;
            }
            let w = self.waiting.swap_remove(i);
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
            let _ = self.done.send(Copied { token: w.job.token, result: Err(e) });
            self.wake_worker();
        }
        if !self.waiting.is_empty() {
            debug!("{} writes wait for their replicas", self.waiting.len());
        }
    }
}

/// The connection to `replica` in `peers`, made first if there is none.
fn peer<'a>(peers: &'a mut HashMap<String, Client>, cfg: &ReplicatorConfig, replica: &str) -> Result<&'a mut Client> {
    if !peers.contains_key(replica) {
        let opts = ClientOptions {
            auth_token: cfg.auth_token.clone(),
            cluster_secret: Some(cfg.secret.clone()),
            timeout: COPY_PEER_TIMEOUT,
            connect_timeout: COPY_PEER_TIMEOUT.min(Duration::from_secs(2)),
            ..Default::default()
        };
        peers.insert(replica.to_string(), Client::connect(replica, opts)?);
    }
    Ok(peers.get_mut(replica).unwrap())
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
