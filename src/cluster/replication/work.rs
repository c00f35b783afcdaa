//! A replicator's work: the copies waiting for their replicas, and the turns that send
//! them, take their answers and end them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use tracing::warn;

use super::peers::{breaks, close_off_thread, send, send_discard, send_part, Closing, Peer};
use super::targets::{named_off, targets, Targets};
use super::{ArenaValue, Copied, CopyJob, Handed, Landed, ReplicatorConfig, StreamStart, Wake, TEST_COPY_DELAY_ENV};
use crate::client::Client;
use crate::cluster::placement::Members;
use crate::cluster::tunables::{
    COPY_BATCH, COPY_DEADLINE, COPY_DEPTH, COPY_FULL_TURN_EVERY, COPY_IDLE_WAIT, COPY_NAP_MAX, COPY_NAP_MIN,
    COPY_PEER_TIMEOUT, COPY_RETRY_MAX, COPY_RETRY_MIN, COPY_SPIN, MOVE_COPY_DEADLINE, STREAM_PART_MAX, STREAM_PART_MIN,
};
use crate::error::{Error, Result, Status};
use crate::server::tunables::STAGE_PARTS_IN_FLIGHT;
use crate::transport::doorbell::{sleep_on, Doorbell};

/// A copy not yet taken by every replica it must reach.
pub(super) struct Waiting {
    pub(super) job: CopyJob,
    /// Replicas that hold it.
    holding: Vec<String>,
    /// Replicas its copy is in flight to (its round of sends ends when none is left).
    sending: Vec<String>,
    /// Whether a round of sends is under way.
    in_round: bool,
    /// Due, but a replica it goes to has its fill of copies in flight: sent once one of
    /// those ends.
    blocked: bool,
    /// Why a replica it must reach did not take it, in the round of sends under way.
    missed: Option<String>,
    /// A replica it must reach refused it for good (no room for the value): the copy ends
    /// with this once its round does, rather than being sent again until its deadline.
    refused: Option<Error>,
    started: Instant,
    retry_at: Instant,
    pause: Duration,
    /// Why the last round fell short.
    why: String,
    /// See [`Copied::sent_whole`].
    sent_whole: u32,
}

/// A write's value staged on its replicas as it lands (see [`StreamStart`]).
struct Stream {
    key: Vec<u8>,
    value: ArenaValue,
    landed: Landed,
    /// Each replica it is staged on, and how far.
    to: Vec<StagedOn>,
    /// The write failed: its outcome goes once no part is in flight.
    aborted: bool,
}

/// How far a streamed value is staged on one replica.
struct StagedOn {
    replica: String,
    /// The id the replica stages it under: its first part's request id.
    stage_id: Option<u64>,
    /// Bytes of the value sent in parts, from its start.
    sent: usize,
    /// Bytes of them the replica took.
    staged: usize,
    /// Parts in flight.
    parts: usize,
    /// Staging failed, or its commit was sent: the write's copy sends the replica the
    /// whole value (again).
    over: bool,
}

impl Stream {
    /// Whether a part is in flight, or one is still to go to a replica.
    fn staging(&self) -> bool {
        self.to.iter().any(|t| t.parts > 0 || (!t.over && t.sent < self.value.len()))
    }

    /// The id under which `replica` holds the whole value staged, if it does (then
    /// taken: a commit installs it once).
    fn take_whole(&mut self, replica: &str) -> Option<u64> {
        let len = self.value.len();
        let t = self.to.iter_mut().find(|t| t.replica == replica && !t.over && t.parts == 0 && t.staged == len)?;
        t.over = true;
        t.stage_id
    }
}

pub(super) struct Work {
    cfg: ReplicatorConfig,
    jobs: Receiver<Handed>,
    /// A thread's: rung as copies are handed over and streamed values land.
    doorbell: Option<Arc<Doorbell>>,
    done: Sender<Copied>,
    wake: Arc<Mutex<Option<Wake>>>,
    pub(super) stop: Arc<AtomicBool>,
    /// A connection to each replica copied to, by name. (Fx hashing here and in the maps
    /// below: their keys are members' names and the shard's tokens, which no client
    /// chooses.)
    peers: FxHashMap<String, Peer>,
    /// Connections being made, off this thread (one to a stopped server takes seconds to
    /// fail, and copies to every other replica would wait behind it meanwhile).
    connecting: FxHashMap<String, Receiver<Result<Client>>>,
    /// Connections being closed, off this thread.
    closing: Vec<Closing>,
    /// Copies not yet ended, by the shard's token.
    waiting: FxHashMap<u64, Waiting>,
    /// Values staged as they land, by their write's token.
    streams: FxHashMap<u64, Stream>,
    /// See [`TEST_COPY_DELAY_ENV`].
    delay: Duration,
    /// Something was handed over since the last full turn.
    handed: bool,
    /// What the last full turn left, and until when a turn that finds nothing new may
    /// return it as it is ([`Work::turn`]).
    last: Turn,
    quiet_until: Instant,
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

/// What a turn of a replicator left.
#[derive(Clone, Copy, Default)]
pub(super) struct Turn {
    pub(super) progressed: bool,
    /// Until when answers are due (the latest of the copies in flight).
    pub(super) answers_by: Option<Instant>,
    /// When the next copy waiting between its rounds is due.
    pub(super) next_round: Option<Instant>,
    /// Whether connections are being closed, with copies given up on them.
    pub(super) closing: bool,
}

impl Work {
    pub(super) fn new(
        cfg: ReplicatorConfig,
        jobs: Receiver<Handed>,
        doorbell: Option<Arc<Doorbell>>,
        done: Sender<Copied>,
        wake: Arc<Mutex<Option<Wake>>>,
    ) -> Work {
        Work {
            cfg,
            jobs,
            doorbell,
            done,
            wake,
            stop: Arc::new(AtomicBool::new(false)),
            peers: FxHashMap::default(),
            connecting: FxHashMap::default(),
            closing: Vec::new(),
            waiting: FxHashMap::default(),
            streams: FxHashMap::default(),
            delay: std::env::var(TEST_COPY_DELAY_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis),
            handed: false,
            last: Turn::default(),
            quiet_until: Instant::now(),
        }
    }

    /// A replicator thread's loop: a turn, then a wait for what comes next (see
    /// [`Work::turn`]).
    pub(super) fn run(mut self) {
        let mut nap = COPY_NAP_MIN;
        while !self.stop.load(Ordering::SeqCst) {
            // Cleared before the turn looks: a ring meanwhile ends the wait below at once.
            if let Some(doorbell) = &self.doorbell {
                doorbell.clear();
            }
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
                // Overdue, but the replicas' answers and reads wake this thread (see
                // `next_job`): it sleeps until then, a millisecond at most.
                Some(_) if self.replicas_wake_it() => until_round.min(COPY_NAP_MAX),
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
    ///
    /// A turn that finds no answer and nothing handed over, with no value streaming, no
    /// connection closing and no copy's next round due, only looks for answers (and
    /// returns what the last full turn left), for up to [`COPY_FULL_TURN_EVERY`] after
    /// it: the worker turns once per pass while its copies' answers are due, and that
    /// look is what a small write's answer waits for.
    pub(super) fn turn(&mut self) -> Turn {
        let mut progressed = self.collect();
        let now = Instant::now();
        let quiet = !progressed && !self.handed && self.streams.is_empty() && self.closing.is_empty();
        if quiet && now < self.quiet_until {
            return Turn { progressed: false, ..self.last };
        }
        self.handed = false;
        progressed |= self.stream_parts(now);
        progressed |= self.dispatch(now);
        self.settle(now);
        self.report(now);
        self.end_aborted_streams(now);
        let between_rounds = self.waiting.values().filter(|w| !w.in_round && !w.blocked).map(|w| w.retry_at);
        self.last = Turn {
            progressed,
            answers_by: self.peers.values().flat_map(|p| &p.flights).map(|f| f.expected_by).max(),
            next_round: between_rounds.min(),
            closing: !self.closing.is_empty(),
        };
        let full_by = now + COPY_FULL_TURN_EVERY;
        self.quiet_until = self.last.next_round.map_or(full_by, |at| at.min(full_by));
        self.last
    }

    /// Takes `first` and what was handed over behind it.
    pub(super) fn take_in(&mut self, first: Option<Handed>) {
        let now = Instant::now();
        let jobs = self.jobs.clone();
        for handed in first.into_iter().chain(std::iter::from_fn(|| jobs.try_recv().ok())).take(COPY_BATCH) {
            self.handed = true;
            let job = match handed {
                Handed::Copy(job) => job,
                Handed::Stream(start) => {
                    self.open_stream(start);
                    continue;
                }
                Handed::Abort(token) => {
                    if let Some(s) = self.streams.get_mut(&token) {
                        s.aborted = true;
                    }
                    continue;
                }
            };
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
                sent_whole: 0,
                job,
            };
            self.waiting.insert(waiting.job.token, waiting);
        }
    }

    /// Whether every connection with copies in flight wakes this thread when it has
    /// progress to make (it has an fd to sleep on).
    fn replicas_wake_it(&self) -> bool {
        self.doorbell.is_some()
            && self.peers.values().filter(|p| !p.flights.is_empty()).all(|p| p.client.copies_can_sleep())
    }

    /// The next copy handed over within `wait`: looked for without sleeping for up to
    /// [`COPY_SPIN`] first (giving the CPU up between looks), as copies come right behind each
    /// other under load and a sleeping thread takes tens of µs to wake. The sleep ends
    /// early when the doorbell rings (a copy handed over, more of a streamed value landed)
    /// or a connection with copies in flight has progress to make: over libfabric tcp, a
    /// copy's bytes move only while this thread drives its connection.
    fn next_job(&self, wait: Duration) -> std::result::Result<Option<Handed>, RecvTimeoutError> {
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
                let Some(doorbell) = &self.doorbell else {
                    return self.jobs.recv_timeout(wait - spun).map(Some);
                };
                let mut fds = vec![doorbell.fd()];
                for peer in self.peers.values().filter(|p| !p.flights.is_empty()) {
                    match peer.client.copies_wait_fd() {
                        Some(fd) => fds.push(fd),
                        // Progress is pending: made on the next turn.
                        None if peer.client.copies_can_sleep() => return Ok(None),
                        // No fd (shm): `wait` bounds the nap.
                        None => {}
                    }
                }
                sleep_on(&fds, wait - spun);
                return match self.jobs.try_recv() {
                    Ok(job) => Ok(Some(job)),
                    Err(crossbeam_channel::TryRecvError::Empty) => Ok(None),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
                };
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
                took(waiting, &mut self.streams, name, (f.token, f.must, f.part), outcome);
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
        let (waiting, streams) = (&mut self.waiting, &mut self.streams);
        self.closing.retain(|c| {
            let outcomes = match c.outcomes.try_recv() {
                Ok(outcomes) => outcomes,
                Err(crossbeam_channel::TryRecvError::Empty) => return true,
                Err(crossbeam_channel::TryRecvError::Disconnected) => Vec::new(),
            };
            let mut outcomes = outcomes.into_iter();
            for &sent in &c.copies {
                let outcome = outcomes.next().unwrap_or_else(|| {
                    Err(Error::new(Status::Internal, "closing the connection ended without a word"))
                });
                took(waiting, streams, &c.replica, sent, outcome);
            }
            progressed = true;
            false
        });
        progressed
    }

    /// Opens the staging of a value as it lands, on the replicas the key has (or moves
    /// to) under the placement now. A replica it does not reach gets the whole value
    /// once the write is committed, as any copy.
    fn open_stream(&mut self, start: StreamStart) {
        let replicas: Vec<String> = match self.cfg.role.current() {
            Some(current) => {
                let (me, routing) = (current.0.as_str(), &current.1);
                let next = routing.next_replicas(&start.key);
                let set = if next.is_empty() { routing.replicas(&start.key) } else { next };
                set.into_iter().filter(|r| *r != me).map(String::from).collect()
            }
            None => Vec::new(),
        };
        let to = replicas
            .into_iter()
            .map(|replica| StagedOn { replica, stage_id: None, sent: 0, staged: 0, parts: 0, over: false })
            .collect();
        let stream = Stream { key: start.key, value: start.value, landed: start.landed, to, aborted: false };
        self.streams.insert(start.token, stream);
    }

    /// Sends each replica the next parts of the streamed values that landed, in order, up
    /// to [`STAGE_PARTS_IN_FLIGHT`] in flight per value and replica; whether any was sent.
    fn stream_parts(&mut self, now: Instant) -> bool {
        let mut sent = false;
        for (&token, s) in self.streams.iter_mut().filter(|(_, s)| !s.aborted) {
            let len = s.value.len();
            let landed = (s.landed.get() as usize).min(len);
            for t in s.to.iter_mut() {
                if t.over || t.parts >= STAGE_PARTS_IN_FLIGHT || t.sent >= landed {
                    continue;
                }
                let ready = landed - t.sent;
                if ready < STREAM_PART_MIN && landed < len {
                    continue;
                }
                let part = &s.value.bytes()[t.sent..][..ready.min(STREAM_PART_MAX)];
                // SAFETY: the key is the stream's, and the part's bytes landed (nothing
                // writes them again) in an extent the shard keeps pinned until this
                // stream's outcome goes, which waits for every part in flight.
                let posted = unsafe {
                    let what = (&s.key[..], part, t.sent, len);
                    send_part(
                        &mut self.peers,
                        &mut self.connecting,
                        &self.cfg,
                        &t.replica,
                        token,
                        what,
                        t.stage_id,
                        now,
                    )
                };
                match posted {
                    Ok(stage_id) => {
                        t.stage_id = Some(stage_id);
                        (t.sent, t.parts) = (t.sent + part.len(), t.parts + 1);
                        sent = true;
                    }
                    // Connecting, or its fill in flight: on a later turn.
                    Err(_) if self.connecting.contains_key(&t.replica) => {}
                    Err(_)
                        if self.peers.get(&t.replica).is_some_and(|p| !p.broken && p.flights.len() >= COPY_DEPTH) => {}
                    Err(_) => t.over = true,
                }
            }
        }
        sent
    }

    /// Hands back the outcome of each failed write's stream once no part of it is in
    /// flight (the shard frees its value then), and has its replicas free what they
    /// staged of it (else held until it lapses).
    fn end_aborted_streams(&mut self, now: Instant) {
        let over: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.aborted && !s.to.iter().any(|t| t.parts > 0))
            .map(|(t, _)| *t)
            .collect();
        for token in &over {
            let s = &self.streams[token];
            for t in &s.to {
                if let Some(stage_id) = t.stage_id {
                    send_discard(&mut self.peers, &t.replica, *token, &s.key, stage_id, now);
                }
            }
        }
        let why = || Err(Error::new(Status::Transport, "the write failed before its value had arrived"));
        self.end(over.into_iter().map(|t| (t, why())).collect());
    }

    /// Starts a round of sends for every copy due; whether any was sent.
    fn dispatch(&mut self, now: Instant) -> bool {
        let due: SmallVec<[u64; 8]> =
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
            if w.job.streamed && self.streams.get(&token).is_some_and(Stream::staging) {
                // Its last parts are on their way: then the replicas that staged the whole
                // value install it, and only the others are sent it.
                continue;
            }
            // A mover's copy names its members (owned here: the job is changed below).
            let named = w.job.to.clone();
            let targets = match &named {
                // The mover hears why, and passes over the key again under the new placement.
                Some(to) => match named_off(routing, &w.job.key, to) {
                    Some(off) => Targets::Superseded(format!(
                        "the placement changed while the key was handed over: {off} is to hold no replica of it"
                    )),
                    None => {
                        Targets::Copy { required: to.iter().map(String::as_str).collect(), leaving: Members::new() }
                    }
                },
                None => targets(me, routing, &w.job, |m| self.cfg.role.is_live(m)),
            };
            let (required, leaving) = match targets {
                Targets::Superseded(why) => {
                    ended.push((token, Err(Error::new(Status::Unavailable, why))));
                    continue;
                }
                Targets::Copy { required, leaving } => (required, leaving),
            };
            let lacking: SmallVec<[(&str, bool); 4]> = (required.into_iter().map(|r| (r, true)))
                .chain(leaving.into_iter().map(|r| (r, false)))
                .filter(|(r, _)| !w.holding.iter().any(|h| h == r))
                .collect();
            if lacking.is_empty() {
                ended.push((token, Ok(())));
                continue;
            }
            // A replica with its fill of copies in flight takes this one on a later turn.
            let blocked =
                lacking.iter().any(|(r, _)| self.peers.get(*r).is_some_and(|p| p.flights.len() >= COPY_DEPTH));
            let w = self.waiting.get_mut(&token).unwrap();
            w.blocked = blocked;
            if blocked {
                continue;
            }
            w.in_round = true;
            for (replica, must) in lacking {
                let staged = self.streams.get_mut(&token).and_then(|s| s.take_whole(replica));
                match send(&mut self.peers, &mut self.connecting, &self.cfg, replica, w, must, staged, now) {
                    Ok(()) => {
                        w.sent_whole += u32::from(w.job.streamed && staged.is_none());
                        w.sending.push(replica.to_string());
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
            let sent_whole = self.waiting.remove(&token).map_or(0, |w| w.sent_whole);
            self.streams.remove(&token);
            let _ = self.done.send(Copied { token, result, sent_whole });
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
        let parts_in_flight = |t: &u64| self.streams.get(t).is_some_and(|s| s.to.iter().any(|t| t.parts > 0));
        for (&token, w) in self.waiting.iter().filter(|(t, w)| !w.in_round && !parts_in_flight(t)) {
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
    }
}

/// Records `replica`'s outcome for the copy `token` (whose key must reach it, or leaves
/// it), or for a part of `token`'s streamed value.
fn took(
    waiting: &mut FxHashMap<u64, Waiting>,
    streams: &mut FxHashMap<u64, Stream>,
    replica: &str,
    (token, must, part): (u64, bool, Option<usize>),
    outcome: Result<()>,
) {
    if let Some(len) = part {
        // A stream stays open while a part of it is in flight.
        if let Some(t) = streams.get_mut(&token).and_then(|s| s.to.iter_mut().find(|t| t.replica == replica)) {
            t.parts -= 1;
            match outcome {
                Ok(()) => t.staged += len,
                Err(_) => t.over = true,
            }
        }
        return;
    }
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
