//! A cluster member's mover: while keys move to a new placement, it hands over each of
//! this server's keys whose owner changes, one at a time, through the real transport and
//! the cluster's token like any client: it holds the key here ([`Client::handover_get`]),
//! stores it on its new owner under the same generation and TTL
//! ([`Client::handover_import`]), then deletes it here if it was not rewritten
//! meanwhile ([`Client::handover_delete`]). Reads of a key being moved are served here
//! until it is deleted, and redirected to its new owner after; writes to it wait while it
//! is held. Once a pass over every key here finds none left to move, it reports its part
//! done in etcd, and the last report lets the placement move on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{MoveReport, Registration, Routing, ServerRole};
use crate::client::{Client, ClientOptions, KeyRange};
use crate::error::Result;

/// How often the mover looks for a placement to move keys for, and reports progress.
const POLL: Duration = Duration::from_millis(50);
const REPORT_EVERY: Duration = Duration::from_millis(500);

/// What the mover hands over with, and how fast.
#[derive(Clone, Debug)]
pub struct MoverConfig {
    /// This server's address, its name in the cluster.
    pub me: String,
    pub auth_token: Option<String>,
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
        let mut work = Work { role, registration, cfg, stop: stop.clone(), own: None, owners: HashMap::new() };
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
    /// A client of this server, and of each new owner keys went to.
    own: Option<Client>,
    owners: HashMap<String, Client>,
}

/// One pass's count.
#[derive(Default)]
struct Pass {
    keys: u64,
    bytes: u64,
}

impl Work {
    fn run(&mut self) {
        let mut reported: Option<(u64, Vec<String>)> = None;
        while !self.stop.load(Ordering::SeqCst) {
            let Some(current) = self.role.current() else {
                std::thread::sleep(POLL);
                continue;
            };
            let routing = &current.1;
            let placement = &routing.placement;
            let due = match &placement.next {
                Some(next) if placement.members.contains(&self.cfg.me) => Some((placement.epoch, next.clone())),
                _ => None,
            };
            if due.is_none() || due == reported {
                self.role.moves.active.store(false, Ordering::Relaxed);
                std::thread::sleep(POLL);
                continue;
            }
            let (epoch, next) = due.unwrap();
            self.role.moves.active.store(true, Ordering::Relaxed);
            let started = Instant::now();
            match self.pass(routing, epoch, &next) {
                Ok(pass) if pass.keys == 0 => {
                    let report = MoveReport { epoch, next: next.clone(), done: true, ..self.report_base(epoch, &next, &Pass::default(), started) };
                    match self.registration.report_moves(&report) {
                        Ok(()) => {
                            info!("cluster view {epoch}: every key of this server that moves is handed over");
                            reported = Some((epoch, next));
                        }
                        Err(e) => {
                            warn!("cannot report the handover done: {}; trying again", e.message);
                            std::thread::sleep(POLL * 4);
                        }
                    }
                }
                Ok(pass) => info!("cluster view {epoch}: handed over {} keys ({} bytes) in {:.1} s; looking again", pass.keys, pass.bytes, started.elapsed().as_secs_f64()),
                Err(e) => {
                    warn!("handing keys over: {e}; trying again");
                    self.own = None;
                    self.owners.clear();
                    std::thread::sleep(POLL * 4);
                }
            }
        }
    }

    fn report_base(&self, epoch: u64, next: &[String], pass: &Pass, started: Instant) -> MoveReport {
        MoveReport {
            epoch,
            next: next.to_vec(),
            done: false,
            keys_moved: pass.keys,
            bytes_moved: pass.bytes,
            bytes_per_second: (pass.bytes as f64 / started.elapsed().as_secs_f64().max(1e-3)) as u64,
        }
    }

    fn client(&self, address: &str) -> Result<Client> {
        let opts = ClientOptions { auth_token: self.cfg.auth_token.clone(), timeout: Duration::from_secs(10), ..Default::default() };
        Client::connect(address, opts)
    }

    /// One pass over this server's keys, handing over those whose owner changes; stops
    /// early (counting what it moved) when the placement changed.
    fn pass(&mut self, routing: &Routing, epoch: u64, next: &[String]) -> Result<Pass> {
        let version = self.role.version();
        let started = Instant::now();
        let mut last_report = Instant::now();
        let mut pass = Pass::default();
        if self.own.is_none() {
            self.own = Some(self.client(&self.cfg.me)?);
        }
        let mut cursor = None;
        loop {
            let (page, more) = self.own.as_mut().unwrap().list_page(&KeyRange::default(), cursor.as_ref())?;
            for entry in page {
                if self.stop.load(Ordering::SeqCst) || self.role.version() != version {
                    return Ok(Pass { keys: pass.keys.max(1), ..pass });
                }
                let Some(owner) = routing.next_owner(&entry.key) else { continue };
                if owner == self.cfg.me {
                    continue;
                }
                let owner = owner.to_string();
                pass.bytes += self.hand_over(&entry.key, &owner)?;
                pass.keys += 1;
                self.pace(pass.bytes, started);
                if last_report.elapsed() >= REPORT_EVERY {
                    let _ = self.registration.report_moves(&self.report_base(epoch, next, &pass, started));
                    last_report = Instant::now();
                }
            }
            match more {
                Some(c) => cursor = Some(c),
                None => return Ok(pass),
            }
        }
    }

    /// Hands one key over to `owner`; returns the bytes moved (0: it was gone).
    fn hand_over(&mut self, key: &[u8], owner: &str) -> Result<u64> {
        let Some((value, generation, ttl_ms)) = self.own.as_mut().unwrap().handover_get(key)? else { return Ok(0) };
        if !self.owners.contains_key(owner) {
            let c = self.client(owner)?;
            self.owners.insert(owner.to_string(), c);
        }
        self.owners.get_mut(owner).unwrap().handover_import(key, &value, generation, ttl_ms)?;
        // Not deleted when the key was rewritten meanwhile (its hold lapsed): the next
        // pass hands the newer value over.
        self.own.as_mut().unwrap().handover_delete(key, generation)?;
        self.role.moves.keys.fetch_add(1, Ordering::Relaxed);
        self.role.moves.bytes.fetch_add(value.len() as u64, Ordering::Relaxed);
        Ok(value.len() as u64)
    }

    /// Sleeps as long as keeps the pass at the configured rate.
    fn pace(&self, bytes: u64, started: Instant) {
        if self.cfg.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(bytes as f64 / self.cfg.rate as f64);
        if let Some(ahead) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(ahead);
        }
    }
}
