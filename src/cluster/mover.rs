//! A cluster member's mover: while keys move to a new placement, it copies each key this
//! server is the first replica of that stays a member under `next` (see `copies_key`) to
//! the replicas the key gains under `next`, in
//! batches of many keys with [`MOVE_DEPTH`] requests in flight (at most [`MOVE_BATCH_BYTES`]
//! of values a batch), through the real transport and the cluster's token like any client.
//! It asks its own server to copy each key out ([`Client::copy_out_many`]): the shard hands
//! the value, straight from its memory, to its replicator, which sends it to the members
//! that gain it as it sends a write's copies, preserving generation and TTL (an import,
//! which never replaces a newer value: keys' primaries copy their writes to those replicas
//! too while keys move).
//!
//! With one replica per key, a key whose owner changes is handed over instead: held here
//! and copied out to its new owner (a hand out), then deleted here if it was not
//! rewritten meanwhile ([`Client::handover_delete_many`]). Reads of it are served here until
//! it is deleted, and redirected to its new owner after; writes to it wait while it is
//! held. With more, each shard drops the copies its server no longer needs itself, as
//! the next epoch begins (every new replica holds them by then).
//!
//! Once a pass has copied every key it must, it reports its part done in etcd, and the
//! last report lets the placement be sealed. Sealed, it reports the highest generation
//! its shards gave out; the last of those reports lets the placement move on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::tunables::{
    MOVER_PACE_NAP, MOVER_PEER_TIMEOUT, MOVER_POLL, MOVER_REPORT_EVERY, MOVE_BATCH_BYTES, MOVE_BATCH_KEYS, MOVE_DEPTH,
};
use super::{MoveReport, Registration, Routing, ServerRole};
use crate::client::{Client, ClientOptions, CopyOut, KeyRange};
use crate::error::Result;

/// A key a pass moves: handed over to its new owner (R = 1), or copied to the replicas
/// it gains.
struct Move {
    key: Vec<u8>,
    to: Vec<String>,
    hand_over: bool,
}

/// What the mover hands over with, and how fast.
#[derive(Clone, Debug)]
pub struct MoverConfig {
    /// This server's address, its name in the cluster.
    pub me: String,
    pub auth_token: Option<String>,
    /// Makes the tickets the mover's copies and handovers carry.
    pub cluster_secret: crate::auth::ClusterSecret,
    /// Bytes per second handed over at most (0: no bound).
    pub rate: u64,
}

pub struct Mover {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Mover {
    pub fn start(role: Arc<ServerRole>, registration: Arc<Registration>, cfg: MoverConfig) -> Mover {
        let stop = Arc::new(AtomicBool::new(false));
        let mut work = Work { role, registration, cfg, stop: stop.clone(), own: None };
        let thread = std::thread::Builder::new().name("rdram-mover".into()).spawn(move || work.run()).ok();
        Mover { stop, thread }
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

struct Work {
    role: Arc<ServerRole>,
    registration: Arc<Registration>,
    cfg: MoverConfig,
    stop: Arc<AtomicBool>,
    /// A client of this server: keys are copied out of it.
    own: Option<Client>,
}

/// One pass's count.
#[derive(Default)]
struct Pass {
    keys: u64,
    bytes: u64,
    /// Cut short (the placement changed, or the server stops).
    interrupted: bool,
}

impl Work {
    fn run(&mut self) {
        // The last handover reported done, for the placement's epoch and `next`.
        let mut reported: Option<MoveReport> = None;
        let mut sealed: Option<u64> = None;
        while !self.stop.load(Ordering::SeqCst) {
            let seen = self.role.version();
            // A fenced server's copies may be older than what the cluster acknowledged
            // since (its lease may have lapsed): it copies none out until it is placed again.
            let Some(current) = self.role.current().filter(|_| !self.role.fenced()) else {
                self.role.wait_past(seen, MOVER_POLL);
                continue;
            };
            let routing = &current.1;
            let placement = &routing.placement;
            let due = match &placement.next {
                Some(next) if placement.members.contains(&self.cfg.me) => Some((placement.epoch, next.clone())),
                _ => None,
            };
            let handed_over =
                reported.as_ref().filter(|r| due.as_ref().is_some_and(|(e, n)| r.epoch == *e && r.next == *n));
            // Handed over, and the placement sealed: reports this server sealed, once.
            if let Some(done) = handed_over.filter(|_| placement.sealed && sealed != Some(placement.version)) {
                match self.seal(done, placement.version) {
                    Ok(()) => sealed = Some(placement.version),
                    Err(e) => self.failed("sealing for the next view", e),
                }
                continue;
            }
            if due.is_none() || handed_over.is_some() {
                self.role.moves.active.store(false, Ordering::Relaxed);
                // Woken by the next placement (the seal, or the move's end).
                self.role.wait_past(seen, MOVER_POLL);
                continue;
            }
            let (epoch, next) = due.unwrap();
            self.role.moves.active.store(true, Ordering::Relaxed);
            let started = Instant::now();
            match self.pass(routing, epoch, &next) {
                // With one replica, a pass that found nothing left to hand over; with more,
                // a pass that copied every key it had to.
                Ok(pass) if !pass.interrupted && (pass.keys == 0 || placement.replicas > 1) => {
                    let report = MoveReport {
                        epoch,
                        next: next.clone(),
                        done: true,
                        ..self.report_base(epoch, &next, &pass, started)
                    };
                    match self.registration.report_moves(&report) {
                        Ok(()) => {
                            info!("cluster view {epoch}: every key of this server that moves is copied ({} keys, {} bytes this pass)", pass.keys, pass.bytes);
                            reported = Some(report);
                        }
                        Err(e) => {
                            warn!("cannot report the handover done: {}; trying again", e.message);
                            std::thread::sleep(MOVER_POLL * 4);
                        }
                    }
                }
                Ok(pass) => info!(
                    "cluster view {epoch}: handed over {} keys ({} bytes) in {:.1} s; looking again",
                    pass.keys,
                    pass.bytes,
                    started.elapsed().as_secs_f64()
                ),
                Err(e) => self.failed("handing keys over", e),
            }
        }
    }

    fn failed(&mut self, what: &str, e: crate::error::Error) {
        warn!("{what}: {e}; trying again");
        self.own = None;
        std::thread::sleep(MOVER_POLL * 4);
    }

    fn own_client(&mut self) -> Result<&mut Client> {
        if self.own.is_none() {
            self.own = Some(self.client(&self.cfg.me)?);
        }
        Ok(self.own.as_mut().unwrap())
    }

    fn report_base(&self, epoch: u64, next: &[String], pass: &Pass, started: Instant) -> MoveReport {
        MoveReport {
            epoch,
            next: next.to_vec(),
            done: false,
            keys_moved: pass.keys,
            bytes_moved: pass.bytes,
            bytes_per_second: (pass.bytes as f64 / started.elapsed().as_secs_f64().max(1e-3)) as u64,
            sealed_version: 0,
            last_generation: 0,
        }
    }

    /// Seals this server for the placement's end (its `sealed` version): reports, beside
    /// its handover `done`, the highest generation its shards gave out. Each shard answers
    /// the statistics request after every write it took before, and checks every later
    /// write against the sealed placement, which the role held before the request went.
    fn seal(&mut self, done: &MoveReport, version: u64) -> Result<()> {
        let stats = self.own_client()?.stats()?;
        let shards = stats["servers"].as_array().into_iter().flatten().flat_map(|s| s["shards"].as_array()).flatten();
        // Every shard's, or no report: a floor too low would let the next epoch's primaries
        // give out generations this server gave already.
        let last_generation = shards
            .map(|s| s["last_generation"].as_u64())
            .try_fold(None, |most: Option<u64>, g| g.map(|g| Some(most.map_or(g, |m| m.max(g)))))
            .flatten()
            .ok_or_else(|| {
                crate::error::Error::new(
                    crate::error::Status::Internal,
                    "this server's statistics do not give every shard's last generation; not sealing",
                )
            })?;
        let report = MoveReport { sealed_version: version, last_generation, ..done.clone() };
        self.registration.report_moves(&report)?;
        info!(
            "cluster view {}: sealed for the next view; generations given out here reach {last_generation}",
            done.epoch
        );
        Ok(())
    }

    fn client(&self, address: &str) -> Result<Client> {
        let opts = ClientOptions {
            auth_token: self.cfg.auth_token.clone(),
            cluster_secret: Some(self.cfg.cluster_secret.clone()),
            timeout: MOVER_PEER_TIMEOUT,
            ..Default::default()
        };
        Client::connect(address, opts)
    }

    /// One pass over this server's keys, copying (or handing over) those that gain a
    /// replica; stops early when the placement changed.
    fn pass(&mut self, routing: &Routing, epoch: u64, next: &[String]) -> Result<Pass> {
        let version = self.role.version();
        let started = Instant::now();
        let mut last_report = Instant::now();
        let mut pass = Pass::default();
        let me = self.cfg.me.clone();
        let mut cursor = None;
        let mut batch: Vec<Move> = Vec::new();
        let mut batch_bytes = 0;
        loop {
            let (page, more) = self.own_client()?.list_page(&KeyRange::default(), cursor.as_ref())?;
            let last_page = more.is_none();
            let page_len = page.len();
            for (i, entry) in page.into_iter().enumerate() {
                let key = &entry.key;
                let due = if routing.placement.replicas <= 1 {
                    // Whatever is here goes to its owner under `next`.
                    match routing.next_owner(key) {
                        Some(owner) if owner != me => {
                            Some(Move { key: entry.key.clone(), to: vec![owner.to_string()], hand_over: true })
                        }
                        _ => None,
                    }
                } else {
                    let now = routing.replicas(key);
                    let gaining: Vec<String> =
                        routing.next_replicas(key).into_iter().filter(|m| !now.contains(m)).map(String::from).collect();
                    (!gaining.is_empty() && copies_key(&now, next, &me)).then(|| Move {
                        key: entry.key.clone(),
                        to: gaining,
                        hand_over: false,
                    })
                };
                if let Some(m) = due {
                    batch_bytes += entry.size;
                    batch.push(m);
                }
                let page_done = i + 1 == page_len && last_page;
                if batch.is_empty() || !(page_done || batch.len() >= MOVE_BATCH_KEYS || batch_bytes >= MOVE_BATCH_BYTES)
                {
                    continue;
                }
                if self.stop.load(Ordering::SeqCst) || self.role.version() != version {
                    return Ok(Pass { interrupted: true, ..pass });
                }
                let (keys, bytes) = self.move_batch(&batch)?;
                (batch_bytes, pass.keys, pass.bytes) = (0, pass.keys + keys, pass.bytes + bytes);
                batch.clear();
                self.pace(pass.bytes, started, version);
                if last_report.elapsed() >= MOVER_REPORT_EVERY {
                    let _ = self.registration.report_moves(&self.report_base(epoch, next, &pass, started));
                    last_report = Instant::now();
                }
            }
            match more {
                Some(c) => cursor = Some(c),
                None if batch.is_empty() => return Ok(pass),
                None => {
                    let (keys, bytes) = self.move_batch(&batch)?;
                    return Ok(Pass { keys: pass.keys + keys, bytes: pass.bytes + bytes, ..pass });
                }
            }
        }
    }

    /// Moves a batch of keys: this server copies each from its memory straight to the
    /// members that gain it (holding those handed over), then the handovers end, each
    /// step pipelined. The keys and bytes moved (a key gone meanwhile is not).
    fn move_batch(&mut self, batch: &[Move]) -> Result<(u64, u64)> {
        let (mut keys, mut bytes) = (0, 0);
        let items: Vec<CopyOut> =
            batch.iter().map(|m| CopyOut { key: &m.key, to: &m.to, hand_over: m.hand_over }).collect();
        let mut copied = Vec::with_capacity(batch.len());
        for r in self.own_client()?.copy_out_many(&items, MOVE_DEPTH) {
            copied.push(r?);
        }
        // Not deleted when the key was rewritten meanwhile (its hold lapsed): the next
        // pass hands the newer value over.
        let ends: Vec<(&[u8], u64)> = batch
            .iter()
            .zip(&copied)
            .filter(|(m, _)| m.hand_over)
            .filter_map(|(m, c)| c.map(|c| (&m.key[..], c.generation)))
            .collect();
        for r in self.own_client()?.handover_delete_many(&ends, MOVE_DEPTH) {
            r?;
        }
        for c in copied.iter().flatten() {
            self.count(c.len as usize);
            keys += 1;
            bytes += c.len;
        }
        Ok((keys, bytes))
    }

    fn count(&self, bytes: usize) {
        self.role.moves.keys.fetch_add(1, Ordering::Relaxed);
        self.role.moves.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Sleeps as long as keeps the pass at the configured rate, in naps of at most
    /// [`MOVER_PACE_NAP`]: a stop or a new placement (`version` no longer the role's) ends
    /// the wait, so that a slow `--rebalance-rate` holds up neither a shutdown nor the next
    /// move (a batch at 256 KiB/s is seconds of pace).
    fn pace(&self, bytes: u64, started: Instant, version: u64) {
        if self.cfg.rate == 0 {
            return;
        }
        let due = started + Duration::from_secs_f64(bytes as f64 / self.cfg.rate as f64);
        while !self.stop.load(Ordering::SeqCst) && self.role.version() == version {
            let Some(ahead) = due.checked_duration_since(Instant::now()) else { return };
            std::thread::sleep(ahead.min(MOVER_PACE_NAP));
        }
    }
}

/// Whether member `me` copies a key whose replicas are `now` to the members that gain it
/// under `next` (R ≥ 2): the first of its replicas that stays a member copies it, and only
/// when none stays (they all leave at once) does each of them. The choice rests on the
/// placement alone, which every member reads alike, not on each member's view of who is
/// live: a member back from a pause holds lapsed leases for live a while, and with each
/// leaving a departed member's keys to another, nobody copied them. A member that stays
/// is a live source the move waits for (`next_placement`), or, once its lease lapsed,
/// leaves `next`, and the move starts over.
fn copies_key(now: &[&str], next: &[String], me: &str) -> bool {
    match now.iter().find(|m| next.iter().any(|n| n == *m)) {
        Some(first_staying) => *first_staying == me,
        None => now.contains(&me),
    }
}

#[cfg(test)]
mod tests {
    use super::copies_key;

    fn names(m: &[&str]) -> Vec<String> {
        m.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_first_replica_that_stays_copies_a_key_and_every_one_when_none_stays() {
        // A join: the key's primary copies it.
        let next = names(&["a", "b", "c", "d"]);
        assert!(copies_key(&["a", "b"], &next, "a"));
        assert!(!copies_key(&["a", "b"], &next, "b"));
        // Its primary leaves (dead, drained or paused past its lease, whoever says it is
        // live): the replica that stays copies, and the one that leaves does not.
        let next = names(&["b", "c"]);
        assert!(!copies_key(&["a", "b"], &next, "a"));
        assert!(copies_key(&["a", "b"], &next, "b"));
        // Every replica leaves at once: each copies.
        let next = names(&["c", "d"]);
        assert!(copies_key(&["a", "b"], &next, "a"));
        assert!(copies_key(&["a", "b"], &next, "b"));
        assert!(!copies_key(&["a", "b"], &next, "c"));
    }
}
