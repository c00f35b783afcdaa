//! What a shard worker does with a request, whatever transport brought it: validate it,
//! apply it to the shard, and say what to send back. The transport workers
//! (`transport/ucx/server/`, `transport/fabric/server/`) only move bytes and call in here.

use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Instant;

mod admission;
mod parts;
mod placement;
mod puts;
pub use puts::PendingPut;
mod replication;

use super::staging::{Staged, Staging};
use crate::auth::{ClusterSecret, Grant};
use crate::cluster::placement::ServerRole;
use crate::cluster::replication::{Replicator, ReplicatorConfig};
use crate::error::{Error, Result, Status};
use crate::metrics::ShardMetrics;
use crate::proto::ByteRange;
use crate::proto::{self, flags, Kind, Op, ReplyHeader, RequestHeader};
use crate::server::reply_backlog::ReplyBudget;
use crate::server::tunables::{MIN_TRANSFER_RATE, PRESSURE_LOG_EVERY, STALE_SWEEP_BATCH};
use crate::store::alloc::Extent;
use crate::store::{Condition, GetOutcome, Layout, Shard};
use placement::PlacementCheck;
use replication::{ArenaBytes, Replication};
use tracing::{info, warn};

/// Why a request was not admitted, with its id when that could be read (so that the
/// sender still gets an answer).
pub type Refusal = (Option<u64>, Error);

/// A decoded, authenticated request.
pub struct Request<'a> {
    pub header: RequestHeader,
    /// What it asks, decoded from the header's op and flags.
    pub kind: Kind,
    /// The key when it travels in the header (empty otherwise).
    pub inline: &'a [u8],
}

impl Request<'_> {
    pub fn op(&self) -> Op {
        self.kind.op()
    }
}

/// The reply to send: a header, plus either the bytes the service wrote to the caller's
/// `out` buffer or a slice of the arena.
pub enum Answer {
    Owned(ReplyHeader),
    /// `len` bytes at `offset` of the arena, inside `extent`; the sender pins the extent
    /// while the bytes are in flight.
    Arena {
        header: ReplyHeader,
        offset: u64,
        len: u64,
        extent: u64,
    },
    /// A write the key's primary took, answered once every replica holds it: the
    /// transport keeps where the answer goes under this token until
    /// [`Service::next_copied`] gives it.
    Deferred(u64),
}

/// When a transfer of `len` bytes started now is given up on.
pub fn transfer_deadline(stall_timeout: std::time::Duration, len: u64) -> std::time::Instant {
    std::time::Instant::now()
        + stall_timeout
        + std::time::Duration::from_secs_f64(len as f64 / MIN_TRANSFER_RATE as f64)
}

/// What the bootstrap tells every worker about clients: each welcomed client's secret
/// session (issued after the token check), and its departure (its bootstrap connection
/// closed), which revokes the session.
#[derive(Clone, Copy, Debug)]
pub enum Membership {
    Joined { client: u64, session: u64 },
    Left { client: u64 },
}

pub struct Service {
    /// In a cluster: the writes this shard took as their keys' primary while they are
    /// copied to the keys' other replicas. First: its thread reads the arena, and stops
    /// (joined) before the shard below frees it.
    replication: Option<Replication>,
    /// Set while a request is answered, when its answer waits for its copies.
    deferred: Option<u64>,
    index: usize,
    shards: usize,
    /// Live clients' sessions -> client number; a request must carry one of them: the
    /// bootstrap's, or one a transport worker issued in its place ([`Service::open_session`]).
    /// Session secrets are drawn by the server, so a fast hash is safe here (lookups of
    /// guessed values cannot collide their way into a slow path: nothing they insert).
    sessions: FxHashMap<u64, u64>,
    membership: crossbeam_channel::Receiver<Membership>,
    /// Clients that left since the transport worker last asked (`take_departed`).
    departed: Vec<u64>,
    shard: Shard,
    /// Clients known to this worker by name (libfabric slots), reported in stats; None
    /// where the transport does not track them (UCX).
    clients: Option<usize>,
    list_scratch: Vec<(Vec<u8>, u64)>,
    /// What this worker counts; only this worker writes it (see `metrics`).
    metrics: Arc<ShardMetrics>,
    pressure: Pressure,
    /// The server's reply bytes held for clients, shared by every shard.
    reply_budget: Arc<ReplyBudget>,
    /// In a cluster: the placement that requests routed with a view are checked against.
    placement: Option<PlacementCheck>,
    /// Values staged in parts, until their last part commits them ([`flags::STAGE`]).
    staging: Staging,
}

/// Arena pressure as log lines: crossing 90 % full (once, until it drops below 80 %), and
/// evictions or refused puts, summed over at most one line per [`PRESSURE_LOG_EVERY`].
#[derive(Default)]
struct Pressure {
    nearly_full: bool,
    last_line: Option<Instant>,
    /// Evictions and refusals counted up to the last line.
    evictions: u64,
    no_space: u64,
}

impl Pressure {
    fn observe(&mut self, shard: usize, s: &crate::store::ShardStats) {
        let full = s.used_bytes as f64 / s.capacity_bytes.max(1) as f64;
        if full >= 0.9 && !self.nearly_full {
            warn!(
                "shard {shard}: arena {:.0} % full ({} of {} MiB used, largest free extent {} KiB)",
                full * 100.0,
                s.used_bytes >> 20,
                s.capacity_bytes >> 20,
                s.largest_free_bytes >> 10
            );
        } else if full < 0.8 && self.nearly_full {
            info!("shard {shard}: arena back below 80 % full");
        }
        self.nearly_full = if full >= 0.9 { true } else { self.nearly_full && full >= 0.8 };
        let (evicted, refused) = (s.counters.evictions - self.evictions, s.counters.no_space - self.no_space);
        if (evicted > 0 || refused > 0) && self.last_line.is_none_or(|t| t.elapsed() >= PRESSURE_LOG_EVERY) {
            let since = self
                .last_line
                .map_or_else(|| "so far".into(), |t| format!("in the last {:.0} s", t.elapsed().as_secs_f64()));
            warn!("shard {shard}: memory pressure {since}: {evicted} values evicted, {refused} puts refused for lack of space");
            self.last_line = Some(Instant::now());
            (self.evictions, self.no_space) = (s.counters.evictions, s.counters.no_space);
        }
    }
}

impl Service {
    pub fn new(
        index: usize,
        shards: usize,
        membership: crossbeam_channel::Receiver<Membership>,
        shard: Shard,
        reply_budget: Arc<ReplyBudget>,
    ) -> Service {
        // A quarter of the arena at most waits for publishes: the rest stays for values.
        let staging = Staging::new(shard.stats().capacity_bytes / 4);
        Service {
            replication: None,
            deferred: None,
            staging,
            index,
            shards,
            sessions: FxHashMap::default(),
            membership,
            departed: Vec::new(),
            shard,
            clients: None,
            list_scratch: Vec::new(),
            metrics: Arc::default(),
            pressure: Pressure::default(),
            reply_budget,
            placement: None,
        }
    }

    /// Makes this shard a cluster member's: requests routed with a view are checked
    /// against the placement `role` holds, and the writes it takes as their keys' primary
    /// are copied to the keys' other replicas (as a member: with `secret`, and the
    /// cluster's `auth_token`) before they are answered, by this shard's worker; the
    /// mover's copies by a replicator thread that runs on `helper_cores` (empty: where this
    /// thread may). Where sending a large copy costs the sender (`copies_cost_the_sender`:
    /// UCX's tcp transport writes its bytes into the socket, libfabric registers its range
    /// for the replica to read, per copy), writes larger than
    /// [`SMALL_COPY_MAX`](crate::cluster::tunables::SMALL_COPY_MAX) are copied by a
    /// replicator thread of their own, so that the worker does not spend its time on
    /// them; elsewhere (UCX over shared memory or RDMA) the replica pulls the bytes, and a
    /// large copy costs the worker no more than a small one.
    pub fn set_cluster_role(
        &mut self,
        role: Arc<ServerRole>,
        secret: ClusterSecret,
        auth_token: Option<String>,
        helper_cores: Vec<usize>,
        copies_cost_the_sender: bool,
    ) -> Result<()> {
        let cfg = ReplicatorConfig { role: role.clone(), secret: secret.clone(), auth_token, cores: helper_cores };
        let large_writes = match copies_cost_the_sender {
            true => Some(Replicator::start(self.index, "copy", cfg.clone())?),
            false => None,
        };
        self.replication = Some(Replication {
            writes: Replicator::inline(cfg.clone()),
            large_writes,
            mover: Replicator::start(self.index, "move", cfg)?,
            look_until: None,
            next_token: 1,
            last_handed: Instant::now(),
            copies: FxHashMap::default(),
            keys: FxHashMap::default(),
            staged_streams: FxHashMap::default(),
            streamed: 0,
            installed_streamed: 0,
            streamed_sent_whole: 0,
        });
        self.placement = Some(PlacementCheck {
            forgotten: role.forgotten(),
            role,
            secret,
            seen: u64::MAX,
            current: None,
            handovers: FxHashMap::default(),
            moves_seen: u64::MAX,
            last_move: None,
            stale: None,
        });
        Ok(())
    }

    /// Applies what the bootstrap said about clients since the last call. Rare (a client
    /// came or went): kept out of line, off the request path it is reached from.
    #[cold]
    #[inline(never)]
    pub fn sync_membership(&mut self) {
        while let Ok(m) = self.membership.try_recv() {
            match m {
                Membership::Joined { client, session } => drop(self.sessions.insert(session, client)),
                Membership::Left { client } => {
                    self.sessions.retain(|_, c| *c != client);
                    self.departed.push(client);
                }
            }
        }
        self.free_staged();
    }

    /// Frees staged values that lapsed or whose session ended.
    fn free_staged(&mut self) {
        if self.staging.is_empty() {
            return;
        }
        let sessions = &self.sessions;
        for extent in self.staging.drain(Instant::now(), |session| !sessions.contains_key(&session)) {
            self.shard.release(extent);
        }
        self.end_orphaned_streams();
    }

    /// The client a session belongs to, if that client is still connected. A session
    /// the worker has not heard of yet may have been issued a moment ago: look again.
    pub fn client_of(&mut self, session: u64) -> Option<u64> {
        self.sync_membership_if_told();
        self.sessions.get(&session).copied()
    }

    /// Applies what the bootstrap said since the last look, if anything: one atomic load
    /// when nothing changed, and a departure queued counts at once.
    fn sync_membership_if_told(&mut self) {
        if !self.membership.is_empty() {
            self.sync_membership();
        }
    }

    /// Takes `session`, drawn by the transport worker for `client` (libfabric's per-slot
    /// credential), as that client's: what it stages lives as long as the client does.
    pub fn open_session(&mut self, session: u64, client: u64) {
        self.sessions.insert(session, client);
    }

    /// Ends a session opened with [`Service::open_session`]; what it staged goes.
    pub fn close_session(&mut self, session: u64) {
        self.sessions.remove(&session);
        self.free_staged();
    }

    /// The clients connected as far as this worker has heard.
    pub fn live_clients(&self) -> impl Iterator<Item = u64> + '_ {
        self.sessions.values().copied()
    }

    /// Whether `client` is connected as far as this worker has heard.
    pub fn is_live(&self, client: u64) -> bool {
        self.sessions.values().any(|&c| c == client)
    }

    /// [`Service::is_live`], with what the bootstrap said since the last look applied
    /// first: a departure it queued counts at once.
    pub fn is_still_live(&mut self, client: u64) -> bool {
        self.sync_membership_if_told();
        self.is_live(client)
    }

    /// The shard's number in the server.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The shard's arena: what replies are sent from and transfers land in.
    pub fn arena(&self) -> &crate::store::arena::Arena {
        self.shard.arena()
    }

    /// Keeps the extent at `offset` where it is while a send reads it (a write to its key
    /// meanwhile frees it only at the last [`Service::unpin`]).
    pub fn pin(&mut self, offset: u64) {
        self.shard.pin(offset);
    }

    /// Ends one [`Service::pin`] of the extent at `offset`.
    pub fn unpin(&mut self, offset: u64) {
        self.shard.unpin(offset);
    }

    /// Frees a put's reserved extent except what a cut transfer still writes into (see
    /// [`crate::store::Shard::release_except`]).
    pub fn release_except(&mut self, extent: Extent, keep: &[(u64, u64)]) -> Vec<Extent> {
        self.shard.release_except(extent, keep)
    }

    /// The worker's periodic chores on its shard: drops up to `max` values whose TTL
    /// passed, and looks at [`STALE_SWEEP_BATCH`] keys for copies a move made stale (a
    /// scan begun here when the placement moved and no request came since).
    pub fn sweep(&mut self, max: usize) {
        self.shard.expire_due(max);
        self.drop_stale_copies_if_the_placement_moved();
        self.drop_stale_copies(STALE_SWEEP_BATCH);
    }

    /// What this shard counts (only its worker writes it).
    pub fn metrics(&self) -> &Arc<ShardMetrics> {
        &self.metrics
    }

    /// The server's reply bytes held for clients, which every shard shares.
    pub fn reply_budget(&self) -> &Arc<ReplyBudget> {
        &self.reply_budget
    }

    /// Sets how many clients the transport worker knows by name (libfabric slots), for
    /// stats; UCX workers never do.
    pub fn set_named_clients(&mut self, n: usize) {
        self.clients = Some(n);
    }

    /// How many clients the transport worker knows by name, if it counts them.
    pub fn named_clients(&self) -> Option<usize> {
        self.clients
    }

    /// Clients that left since the last call (their slots and transfers can go).
    pub fn take_departed(&mut self) -> Vec<u64> {
        self.sync_membership();
        std::mem::take(&mut self.departed)
    }

    /// Publishes the shard's state for metric scrapes and logs what an operator should
    /// hear about (called on the worker's sweeps).
    pub fn publish_metrics(&mut self, transfers_in_flight: usize) {
        self.free_staged();
        let stats = self.shard.stats();
        self.metrics.publish(&stats, transfers_in_flight);
        self.pressure.observe(self.index, &stats);
    }

    /// Serves a request whose payload is all here. Owned reply bytes go to `out`.
    pub fn serve(&mut self, req: &Request, payload: &[u8], out: &mut Vec<u8>) -> Answer {
        let arrived = self.metrics.clock();
        let answer = self.answer(req, payload, out);
        if let Some(token) = self.take_deferred(arrived) {
            return Answer::Deferred(token);
        }
        let (status, received, sent) = match &answer {
            Answer::Owned(h) if h.status() != Status::Ok => (h.status(), 0, 0),
            Answer::Owned(h) if req.op() == Op::Put => (h.status(), h.value_size, 0),
            Answer::Owned(h) => (h.status(), 0, out.len() as u64),
            Answer::Arena { header, len, .. } => (header.status(), 0, *len),
            Answer::Deferred(_) => unreachable!("taken above"),
        };
        self.metrics.record(Some(req.op()), status, received, sent, arrived);
        answer
    }

    fn answer(&mut self, req: &Request, payload: &[u8], out: &mut Vec<u8>) -> Answer {
        let h = &req.header;
        if h.flags & flags::REMOTE_VALUE != 0 {
            let e = Error::new(Status::Invalid, "this transport does not read values from client memory");
            return Answer::Owned(error_reply(h.request_id, &e, out));
        }
        let kind = req.kind;
        let result = match kind {
            Kind::Put | Kind::StagePart | Kind::Import | Kind::ImportStaged => {
                self.eager_put(h, kind, req.inline, payload)
            }
            Kind::Get | Kind::CopyRead | Kind::HandoverHold | Kind::CopyOut | Kind::HandOut => {
                return self.get(h, kind, req.inline, payload, out)
            }
            Kind::Delete | Kind::StageDiscard | Kind::ImportDelete | Kind::HandoverEnd => {
                self.delete(h, kind, req.inline, payload)
            }
            Kind::DeleteRange | Kind::List => self.range_op(h, kind.op(), payload, out),
            Kind::Stats => self.stats(h, out),
            // The transport found nothing of that request in flight: it finished (and was
            // answered) or failed already, so the client's memory is out of reach.
            Kind::Abort => Ok(ReplyHeader::new(h.request_id, Status::Ok)),
        };
        Answer::Owned(result.unwrap_or_else(|e| error_reply(h.request_id, &e, out)))
    }

    fn check_shard(&self, key: &[u8]) -> Result<()> {
        let owner = proto::shard_of(key, self.shards);
        if owner != self.index {
            return Err(Error::new(Status::WrongShard, format!("key belongs to shard {owner}, not {}", self.index)));
        }
        Ok(())
    }

    fn key_of<'a>(&self, h: &RequestHeader, inline: &'a [u8], payload: &'a [u8]) -> Result<&'a [u8]> {
        let key = if h.flags & flags::KEY_IN_PAYLOAD != 0 {
            payload
                .get(..h.key_len as usize)
                .ok_or_else(|| Error::new(Status::Invalid, "payload shorter than the key"))?
        } else {
            inline
        };
        self.check_shard(key)?;
        Ok(key)
    }

    fn get(&mut self, h: &RequestHeader, kind: Kind, inline: &[u8], payload: &[u8], out: &mut Vec<u8>) -> Answer {
        let range = (h.flags & flags::HAS_RANGE != 0).then_some(ByteRange { start: h.range_start, end: h.range_end });
        let checked = self.key_of(h, inline, payload).and_then(|key| {
            self.check_placement(h, kind, key)?;
            self.check_replicated(kind, key)?;
            Ok(key)
        });
        let key = match checked {
            Ok(key) => key,
            Err(e) => return Answer::Owned(error_reply(h.request_id, &e, out)),
        };
        let outcome = self.shard.get(key, &condition(h), range);
        let mut reply = ReplyHeader::new(h.request_id, Status::Ok);
        if kind.members_only() {
            if let Ok(GetOutcome::Value { value_size, .. }) = outcome {
                let allowed = match kind {
                    Kind::HandoverHold | Kind::HandOut => {
                        self.check_ticket(h, key, Grant::Hold).and_then(|()| self.hold_for_handover(key, value_size))
                    }
                    Kind::CopyOut => self.check_ticket(h, key, Grant::CopyOut),
                    _ => Ok(()),
                };
                if let Err(e) = allowed {
                    return Answer::Owned(error_reply(h.request_id, &e, out));
                }
                reply.more = self.shard.ttl_left_ms(key).min(u32::MAX as u64) as u32;
            }
        }
        match outcome {
            Err(e) => return Answer::Owned(error_reply(h.request_id, &e, out)),
            Ok(GetOutcome::Missing) => reply.status = Status::Missing as u8,
            Ok(GetOutcome::Unchanged { generation }) => {
                reply.status = Status::Unchanged as u8;
                reply.generation = generation;
            }
            Ok(GetOutcome::Value { generation, value_size, offset, len, extent }) => {
                reply.generation = generation;
                reply.value_size = value_size;
                if kind.forwards() {
                    // Answered once copied (deferred), or now with why it cannot be.
                    let value = ArenaBytes { extent, offset, len };
                    if let Err(e) = self.copy_out(h, key, payload, value, reply) {
                        if kind == Kind::HandOut {
                            self.end_handover(key);
                        }
                        return Answer::Owned(error_reply(h.request_id, &e, out));
                    }
                    return Answer::Owned(reply);
                }
                return Answer::Arena { header: reply, offset, len, extent };
            }
        }
        Answer::Owned(reply)
    }

    fn delete(&mut self, h: &RequestHeader, kind: Kind, inline: &[u8], payload: &[u8]) -> Result<ReplyHeader> {
        let key = self.key_of(h, inline, payload)?;
        if kind == Kind::StageDiscard {
            // Discards what the client's session staged (the key's primary refused the write):
            // only the session's own value, so no placement to check.
            let staged = self.staging.take(h.session, h.if_not_equal);
            let found = staged.is_some();
            if let Some(s) = staged {
                self.shard.release(s.extent);
            }
            self.end_orphaned_streams();
            return Ok(ok_reply(h.request_id, 0, found as u64));
        }
        self.check_placement(h, kind, key)?;
        if kind == Kind::HandoverEnd {
            self.check_ticket(h, key, Grant::EndHold { generation: h.if_equal })?;
            self.end_handover(key);
        }
        if kind == Kind::ImportDelete {
            self.check_ticket(h, key, Grant::Delete { generation: h.if_equal })?;
            // The generation the key keeps goes back when it is newer than the delete.
            let (generation, existed) = match self.shard.delete_unless_newer(key, h.if_equal)? {
                Ok(existed) => (h.if_equal, existed),
                Err(newer) => (newer, false),
            };
            return Ok(ok_reply(h.request_id, generation, existed as u64));
        }
        if h.flags & flags::VIEW == 0 || self.placement.is_none() {
            let generation = self.shard.generation_of(key).unwrap_or(0);
            let existed = self.shard.delete(key, &condition(h))?;
            return Ok(ok_reply(h.request_id, if existed { generation } else { 0 }, existed as u64));
        }
        // A client's delete, taken as the key's primary: copied to the key's other replicas
        // even when this shard lacked the key (one of them may hold it: a new primary the
        // mover had not copied it to yet), at a generation of its own that they delete up
        // to and remember.
        let (existed, generation) = self.shard.delete_as_primary(key, &condition(h))?;
        let reply = ok_reply(h.request_id, generation, existed as u64);
        self.replicate(h, kind, key, generation, None, None, reply)
    }

    fn range_op(&mut self, h: &RequestHeader, op: Op, payload: &[u8], out: &mut Vec<u8>) -> Result<ReplyHeader> {
        let (min_len, max_len) = (h.key_len as usize, h.aux_len as usize);
        if payload.len() != min_len + max_len {
            return Err(Error::new(Status::Invalid, "range bounds do not match their lengths"));
        }
        let min = &payload[..min_len];
        let max = (h.flags & flags::MAX_UNBOUNDED == 0).then(|| &payload[min_len..]);
        if op == Op::DeleteRange {
            if self.placement.is_some() {
                // Each replica deleting on its own would leave replicas that differ: a
                // write acknowledged meanwhile kept by one, a copy in flight landing after.
                return Err(Error::new(
                    Status::Invalid,
                    "this server is a member of a cluster: a range is deleted through the cluster (connect with its etcd:// string), key by key through each key's primary",
                ));
            }
            let (n, more) = self.shard.delete_range(min, max, proto::DELETE_RANGE_BATCH);
            let mut reply = ok_reply(h.request_id, 0, n);
            reply.more = more as u32;
            return Ok(reply);
        }
        let limit = (h.ttl_or_limit as usize).clamp(1, proto::LIST_BATCH as usize);
        let mut entries = std::mem::take(&mut self.list_scratch);
        entries.clear();
        let more = self.shard.list(min, max, limit, proto::LIST_REPLY_MAX_KEY_BYTES, &mut entries);
        for (k, size) in &entries {
            proto::encode_list_entry(out, k, *size);
        }
        let mut reply = ok_reply(h.request_id, 0, entries.len() as u64);
        reply.more = more as u32;
        self.list_scratch = entries;
        Ok(reply)
    }

    fn stats(&mut self, h: &RequestHeader, out: &mut Vec<u8>) -> Result<ReplyHeader> {
        let mut stats = serde_json::to_value(self.shard.stats()).unwrap_or_default();
        stats["shard"] = self.index.into();
        if let Some(n) = self.clients {
            stats["clients"] = n.into();
        }
        stats["reply_backlog_bytes"] = self.reply_budget.held().into();
        stats["reply_budget_bytes"] = self.reply_budget.limit().into();
        // What `rdram top` shows besides the shard's own counters: every request answered,
        // the failed ones, value bytes moved, and the server's connected clients (every
        // worker hears of every client's session).
        let (received, sent) = self.metrics.bytes();
        let requests = self.metrics.requests();
        stats["requests"] = requests.iter().map(|r| r.2).sum::<u64>().into();
        stats["errors"] = requests.iter().filter(|r| (r.1 as i8) < 0).map(|r| r.2).sum::<u64>().into();
        stats["received_bytes"] = received.into();
        stats["sent_bytes"] = sent.into();
        stats["server_clients"] = self.sessions.len().into();
        stats["last_generation"] = self.shard.last_generation().into();
        let (staged, staged_bytes) = self.staging.held();
        stats["staged_values"] = staged.into();
        stats["staged_bytes"] = staged_bytes.into();
        if let Some(r) = &self.replication {
            stats["streamed_writes"] = r.streamed.into();
            stats["installed_streamed"] = r.installed_streamed.into();
            stats["streamed_sent_whole"] = r.streamed_sent_whole.into();
        }
        if let Some(p) = &self.placement {
            // The server's, not the shard's: the same on every shard.
            let moves = &p.role.moves;
            stats["cluster_view"] = p.role.epoch().into();
            stats["placement_version"] = p.role.current().map_or(0, |c| c.1.placement.version).into();
            stats["handing_over"] = moves.active.load(std::sync::atomic::Ordering::Relaxed).into();
            stats["handed_over_keys"] = moves.keys.load(std::sync::atomic::Ordering::Relaxed).into();
            stats["handed_over_bytes"] = moves.bytes.load(std::sync::atomic::Ordering::Relaxed).into();
        }
        serde_json::to_writer(&mut *out, &stats).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        Ok(ReplyHeader::new(h.request_id, Status::Ok))
    }
}

/// The reply for a failed request: its status, and the message as the payload in `out`.
pub fn error_reply(request_id: u64, err: &Error, out: &mut Vec<u8>) -> ReplyHeader {
    out.clear();
    out.extend_from_slice(err.message.as_bytes());
    ReplyHeader::new(request_id, err.status)
}

fn ok_reply(request_id: u64, generation: u64, value_size: u64) -> ReplyHeader {
    let mut h = ReplyHeader::new(request_id, Status::Ok);
    h.generation = generation;
    h.value_size = value_size;
    h
}

fn condition(h: &RequestHeader) -> Condition {
    Condition {
        if_equal: (h.flags & flags::IF_EQUAL != 0).then_some(h.if_equal),
        if_not_equal: (h.flags & flags::IF_NOT_EQUAL != 0).then_some(h.if_not_equal),
        if_absent: h.flags & flags::IF_ABSENT != 0,
    }
}

fn ttl(h: &RequestHeader) -> u64 {
    if h.flags & flags::HAS_TTL != 0 {
        h.ttl_or_limit.max(1)
    } else {
        0
    }
}

#[cfg(test)]
mod tests;
