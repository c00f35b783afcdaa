//! A cluster member's shard's side of replication (see [`crate::cluster::replication`]):
//! the writes it took as their keys' primary, their answers deferred until every replica
//! holds them, and the reads of those keys refused meanwhile; and the mover's copies of
//! keys from this shard's memory to the members that gain them ([`Kind::CopyOut`]).

use rustc_hash::FxHashMap;
use std::time::Instant;

use super::PendingPut;
use super::{error_reply, ttl, Service};
use crate::cluster::replication::{ArenaValue, CopyJob, Landed, Replicator, StreamStart};
use crate::cluster::tunables::{SMALL_COPY_MAX, STREAM_MIN};
use crate::error::{Error, Result, Status};
use crate::proto::{self, flags, Kind, Op, ReplyHeader, RequestHeader};
use crate::server::tunables::COPY_SPIN;
use crate::store::alloc::Extent;
use crate::store::Layout;

/// A cluster member's shard's copies in flight (see [`crate::cluster::replication`]).
pub(super) struct Replication {
    /// Copies the writes this shard takes as their keys' primary, driven by the shard's
    /// worker ([`Service::drive_copies`]).
    pub(super) writes: Replicator,
    /// Where sending a large copy costs the sender (see [`Service::set_cluster_role`]):
    /// copies the writes larger than [`SMALL_COPY_MAX`] instead, on a thread of its own.
    pub(super) large_writes: Option<Replicator>,
    /// Copies keys out for the mover ([`Kind::CopyOut`]): apart from the writes' copies,
    /// so that neither waits behind the other (a paused replica holds a write's copy up
    /// for a request's timeout; the move goes on without it).
    pub(super) mover: Replicator,
    pub(super) next_token: u64,
    pub(super) copies: FxHashMap<u64, Copying>,
    /// When the last copy was handed over (see [`Service::copy_expected_soon`]).
    pub(super) last_handed: Instant,
    /// Until when the worker looks for the small writes' answers without sleeping.
    pub(super) look_until: Option<Instant>,
    /// Keys with writes' copies in flight, and how many: no client reads them meanwhile.
    pub(super) keys: FxHashMap<Vec<u8>, u32>,
    /// Values staged in parts by clients (by session and stage id) that are streamed to
    /// their keys' replicas as the parts land, and their copies' tokens.
    pub(super) staged_streams: FxHashMap<(u64, u64), u64>,
    /// Writes whose values were streamed to their replicas as they arrived, and values
    /// streamed here that were installed ([`Kind::ImportStaged`]).
    pub(super) streamed: u64,
    pub(super) installed_streamed: u64,
    /// Replicas that streamed writes' copies sent the whole value to after all
    /// ([`crate::cluster::replication::Copied::sent_whole`]).
    pub(super) streamed_sent_whole: u64,
}

/// A committed value's bytes in the arena: `len` of them at `offset`, in the extent at
/// `extent`.
pub(super) struct ArenaBytes {
    pub(super) extent: u64,
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// A write waiting for its copies: its answer, and what it holds.
pub(super) struct Copying {
    reply: ReplyHeader,
    key: Vec<u8>,
    /// The value's extent, pinned while the replicator reads it.
    pinned: Option<u64>,
    op: Op,
    arrived: Option<Instant>,
    received: u64,
    /// A write whose value is streamed to the replicas as it arrives.
    stream: Option<Streamed>,
}

/// A write's value streamed to its replicas as it arrives ([`Service::stream_put`]).
pub(super) struct Streamed {
    /// How much of it landed (see [`StreamStart::landed`]).
    landed: Landed,
    /// Where it starts in the arena.
    value_at: u64,
    /// Whether the write is committed: before that no one waits for its answer, and no
    /// read for its key.
    committed: bool,
}

impl Copying {
    /// A committed write's copy, counted in [`Replication::keys`]; a mover's copy out
    /// (recorded as the get it is) is not, nor a value still arriving.
    fn gates_reads(&self) -> bool {
        self.op != Op::Get && self.stream.as_ref().is_none_or(|s| s.committed)
    }
}

impl Service {
    /// As the key's primary under a view, while keys have more than one replica or move:
    /// hands a client's write (committed: `generation`, and the value's extent and layout,
    /// None for a delete) to the replicator, and defers `reply` until every replica holds
    /// it. Otherwise (one replica and nothing moving, or not a client's write) `reply`
    /// goes at once.
    /// `stream`: the token under which the value was streamed to the replicas as it
    /// arrived ([`Service::stream_put`]), which the copy goes on under.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn replicate(
        &mut self,
        h: &RequestHeader,
        kind: Kind,
        key: &[u8],
        generation: u64,
        value: Option<(Extent, Layout)>,
        stream: Option<u64>,
        reply: ReplyHeader,
    ) -> Result<ReplyHeader> {
        let client_write = h.flags & flags::VIEW != 0 && kind.is_client_write();
        let copied = self.copies_writes();
        let Some(r) = self.replication.as_mut().filter(|_| client_write && copied) else {
            self.abort_stream(stream);
            return Ok(reply);
        };
        if let Some(token) = stream {
            return self.replicate_streamed(token, key, generation, ttl(h), reply);
        }
        let token = r.next_token;
        r.next_token += 1;
        let job_value = value.map(|(extent, layout)| {
            let at = extent.offset + u64::from(layout.value_at);
            // SAFETY: the committed value's bytes, which nothing writes again; its extent
            // is pinned below until `next_copied` hears this copy ended, and the
            // replicator stops before the arena is freed (field order of `Service`).
            unsafe { ArenaValue::new(self.shard.arena().base().add(at as usize), layout.value_len as usize) }
        });
        let large = job_value.as_ref().map_or(0, ArenaValue::len) > SMALL_COPY_MAX;
        let job = CopyJob {
            token,
            key: key.to_vec(),
            value: job_value,
            generation,
            ttl_ms: ttl(h),
            to: None,
            streamed: false,
        };
        // (Only a replicator thread that died refuses: the write stays here, on one replica.)
        match r.large_writes.as_ref().filter(|_| large) {
            Some(thread) => thread.copy(job)?,
            None => r.writes.copy(job)?,
        }
        let pinned = value.map(|(extent, _)| extent.offset);
        if let Some(offset) = pinned {
            self.shard.pin(offset);
        }
        *r.keys.entry(key.to_vec()).or_insert(0) += 1;
        let (op, received) = match value {
            Some((_, layout)) => (Op::Put, layout.value_len),
            None => (Op::Delete, 0),
        };
        let copying = Copying { reply, key: key.to_vec(), pinned, op, arrived: None, received, stream: None };
        r.copies.insert(token, copying);
        r.last_handed = Instant::now();
        self.deferred = Some(token);
        Ok(reply)
    }

    /// Whether this shard's writes are copied to other replicas under its placement now.
    fn copies_writes(&self) -> bool {
        self.placement
            .as_ref()
            .and_then(|p| p.current.as_deref())
            .is_some_and(|c| c.1.placement.replicas > 1 || c.1.placement.next.is_some())
    }

    /// As a large write's primary, where a replicator thread copies large writes: starts
    /// staging its value on the key's replicas as it lands (see
    /// [`crate::cluster::replication`]). The transport sets the counter returned to how
    /// many bytes of the value landed, from its start; [`Service::finish_put`] then
    /// commits the copy or ends it. None: the value is copied once it is whole, as usual.
    pub fn stream_put(&mut self, p: &mut PendingPut) -> Option<Landed> {
        let h = &p.header;
        let whole_put = p.kind == Kind::Put && p.part.is_none() && h.flags & flags::KEY_IN_PAYLOAD == 0;
        if !whole_put || p.dest_offset != u64::from(p.layout.value_at) {
            return None;
        }
        let (token, landed) = self.open_stream(h, p.extent, p.layout)?;
        p.stream = Some(token);
        Some(landed)
    }

    /// As the key's primary, where a replicator thread copies large writes: streams a
    /// value a client stages in parts (its first part's extent and layout) to the key's
    /// replicas as the parts land ([`Service::staged_landed`]); its commit then installs
    /// it there ([`Service::take_staged_stream`]).
    pub(super) fn stream_staged(&mut self, h: &RequestHeader, extent: Extent, layout: Layout) {
        if let Some((token, _)) = self.open_stream(h, extent, layout) {
            let r = self.replication.as_mut().expect("a stream was opened");
            r.staged_streams.insert((h.session, h.request_id), token);
        }
    }

    /// The bytes of a value staged in parts that arrived from its start with no gap: sent
    /// on to the replicas, where it is streamed.
    pub(super) fn staged_landed(&mut self, session: u64, stage_id: u64, landed: u64) {
        let Some(r) = self.replication.as_ref() else { return };
        let Some(token) = r.staged_streams.get(&(session, stage_id)) else { return };
        if let Some(s) = r.copies.get(token).and_then(|c| c.stream.as_ref()) {
            s.landed.advance_to(landed);
        }
    }

    /// The stream of a value staged in parts, taken for its commit.
    pub(super) fn take_staged_stream(&mut self, session: u64, stage_id: u64) -> Option<u64> {
        self.replication.as_mut()?.staged_streams.remove(&(session, stage_id))
    }

    /// Ends the stream of a value staged in parts that is over (a part failed, or it was
    /// discarded or lapsed).
    pub(super) fn end_staged_stream(&mut self, session: u64, stage_id: u64) {
        let stream = self.take_staged_stream(session, stage_id);
        self.abort_stream(stream);
    }

    /// Ends the streams of values staged in parts that are no longer staged (discarded,
    /// lapsed, or their session ended).
    pub(super) fn end_orphaned_streams(&mut self) {
        let Some(r) = self.replication.as_mut().filter(|r| !r.staged_streams.is_empty()) else { return };
        let staging = &self.staging;
        let mut over = Vec::new();
        r.staged_streams.retain(|&(session, id), token| {
            let staged = staging.value_len(session, id).is_some();
            if !staged {
                over.push(*token);
            }
            staged
        });
        for token in over {
            self.abort_stream(Some(token));
        }
    }

    /// Opens a stream of a client's write of a large value into `extent` (see
    /// [`Service::stream_put`]): its token, and the counter of its landed bytes.
    fn open_stream(&mut self, h: &RequestHeader, extent: Extent, layout: Layout) -> Option<(u64, Landed)> {
        let eligible = h.flags & flags::VIEW != 0 && layout.value_len >= STREAM_MIN as u64 && self.copies_writes();
        let r = self.replication.as_mut().filter(|_| eligible)?;
        let thread = r.large_writes.as_ref()?;
        let key = self.shard.arena().slice(extent.offset, u64::from(layout.key_len)).to_vec();
        let at = extent.offset + u64::from(layout.value_at);
        // SAFETY: the reserved extent's value bytes, of which the replicator reads only
        // those landed (each written once, never again); the extent is pinned below until
        // `next_copied` hears the stream's copy ended, and the replicator stops before the
        // arena is freed (field order of `Service`).
        let value = unsafe { ArenaValue::new(self.shard.arena().base().add(at as usize), layout.value_len as usize) };
        let landed = thread.landed()?;
        let token = r.next_token;
        thread.stream(StreamStart { token, key: key.clone(), value, landed: landed.clone() }).ok()?;
        r.next_token += 1;
        let copying = Copying {
            reply: ReplyHeader::default(),
            key,
            pinned: Some(extent.offset),
            op: Op::Put,
            arrived: None,
            received: layout.value_len,
            stream: Some(Streamed { landed: landed.clone(), value_at: at, committed: false }),
        };
        r.copies.insert(token, copying);
        r.streamed += 1;
        self.shard.pin(extent.offset);
        Some((token, landed))
    }

    /// The copy of a committed write whose value was streamed under `token`: the
    /// replicas that staged it whole install it, the others are sent it.
    fn replicate_streamed(
        &mut self,
        token: u64,
        key: &[u8],
        generation: u64,
        ttl_ms: u64,
        reply: ReplyHeader,
    ) -> Result<ReplyHeader> {
        let lost = || Error::new(Status::Internal, "the copy of a write streamed to its replicas was lost");
        let r = self.replication.as_mut().ok_or_else(lost)?;
        let thread = r.large_writes.as_ref().ok_or_else(lost)?;
        let c = r.copies.get_mut(&token).ok_or_else(lost)?;
        let streamed = c.stream.as_mut().ok_or_else(lost)?;
        streamed.committed = true;
        // Every byte is in: the last part goes.
        streamed.landed.advance_to(c.received);
        c.reply = reply;
        // SAFETY: as in `stream_put`: the committed value's bytes, which nothing writes
        // again, its extent pinned until the copy ends.
        let value =
            unsafe { ArenaValue::new(self.shard.arena().base().add(streamed.value_at as usize), c.received as usize) };
        let job =
            CopyJob { token, key: key.to_vec(), value: Some(value), generation, ttl_ms, to: None, streamed: true };
        if let Err(e) = thread.copy(job) {
            // Its replicator stopped: the write stays here, on one replica.
            if let Some(offset) = r.copies.remove(&token).and_then(|c| c.pinned) {
                self.shard.unpin(offset);
            }
            return Err(e);
        }
        *r.keys.entry(key.to_vec()).or_insert(0) += 1;
        r.last_handed = Instant::now();
        self.deferred = Some(token);
        Ok(reply)
    }

    /// Ends a stream whose write failed (its value is freed once the replicator hears).
    pub(super) fn abort_stream(&mut self, stream: Option<u64>) {
        let (Some(token), Some(r)) = (stream, self.replication.as_mut()) else { return };
        let stopped = r.large_writes.as_ref().is_none_or(|t| t.abort_stream(token).is_err());
        if stopped {
            if let Some(offset) = r.copies.remove(&token).and_then(|c| c.pinned) {
                self.shard.unpin(offset);
            }
        }
    }

    /// A mover's [`Kind::CopyOut`] or [`Kind::HandOut`] of `key`, whose committed value is
    /// `value`: hands a copy of it (generation and TTL left as `reply` says) to the
    /// replicator for the members `payload` names, each of which must hold the key under
    /// the placement, and defers `reply` until every one holds it. The value goes from
    /// the arena, with no copy on this server.
    pub(super) fn copy_out(
        &mut self,
        h: &RequestHeader,
        key: &[u8],
        payload: &[u8],
        value: ArenaBytes,
        reply: ReplyHeader,
    ) -> Result<()> {
        // After the key, when the key travels in the payload.
        let targets = match h.flags & flags::KEY_IN_PAYLOAD != 0 {
            true => &payload[key.len()..],
            false => payload,
        };
        let targets = proto::decode_members(targets).map_err(|e| Error::new(Status::Invalid, e))?;
        let Some(current) = self.placement.as_ref().and_then(|p| p.role.current()) else {
            return Err(Error::new(Status::ViewChanged, "this server has not read the cluster's placement yet"));
        };
        let (me, routing) = (current.0.as_str(), &current.1);
        if let Some(t) = targets.iter().find(|t| *t == me || !routing.holds(t, key)) {
            return Err(Error::new(
                Status::ViewChanged,
                format!(
                    "a copy out to {t}, which is to hold no replica of the key in placement version {}",
                    routing.placement.version
                ),
            ));
        }
        // SAFETY: the committed value's bytes, which nothing writes again; its extent is
        // pinned below until `next_copied` hears this copy ended, and the replicator stops
        // before the arena is freed (field order of `Service`).
        let bytes =
            unsafe { ArenaValue::new(self.shard.arena().base().add(value.offset as usize), value.len as usize) };
        let r = self.replication.as_mut().expect("a member's shard has a replicator");
        let token = r.next_token;
        r.next_token += 1;
        let ttl_ms = u64::from(reply.more);
        let job = CopyJob {
            token,
            key: key.to_vec(),
            value: Some(bytes),
            generation: reply.generation,
            ttl_ms,
            to: Some(targets),
            streamed: false,
        };
        r.mover.copy(job)?;
        let copying = Copying {
            reply,
            key: key.to_vec(),
            pinned: Some(value.extent),
            op: Op::Get,
            arrived: None,
            received: 0,
            stream: None,
        };
        r.copies.insert(token, copying);
        r.last_handed = Instant::now();
        self.shard.pin(value.extent);
        self.deferred = Some(token);
        Ok(())
    }

    /// A deferred answer whose copies ended: its token and header (an error's message in
    /// `out`). None when no copy ended since the last call.
    pub fn next_copied(&mut self, out: &mut Vec<u8>) -> Option<(u64, ReplyHeader)> {
        let r = self.replication.as_mut()?;
        if r.copies.is_empty() {
            return None;
        }
        let done = (r.writes.next_done())
            .or_else(|| r.large_writes.as_ref().and_then(Replicator::next_done))
            .or_else(|| r.mover.next_done())?;
        let c = r.copies.remove(&done.token)?;
        r.streamed_sent_whole += u64::from(done.sent_whole);
        if let Some(n) = r.keys.get_mut(&c.key).filter(|_| c.gates_reads()) {
            *n -= 1;
            if *n == 0 {
                r.keys.remove(&c.key);
            }
        }
        if let Some(offset) = c.pinned {
            self.shard.unpin(offset);
        }
        out.clear();
        if c.stream.as_ref().is_some_and(|s| !s.committed) {
            // A failed write's stream: its writer was answered when it failed.
            return Some((done.token, c.reply));
        }
        let header = match done.result {
            Ok(()) => c.reply,
            Err(e) => error_reply(c.reply.request_id, &e, out),
        };
        let received = if header.status() == Status::Ok { c.received } else { 0 };
        self.metrics.record(Some(c.op), header.status(), received, 0, c.arrived);
        Some((done.token, header))
    }

    /// The answer deferred while a request was served, if it was: its copy then records
    /// the request's metrics when it ends, from `arrived` on.
    pub(super) fn take_deferred(&mut self, arrived: Option<Instant>) -> Option<u64> {
        let token = self.deferred.take()?;
        if let Some(c) = self.replication.as_mut().and_then(|r| r.copies.get_mut(&token)) {
            c.arrived = arrived;
        }
        Some(token)
    }

    /// How the replicator threads wake this shard's worker when copies end.
    pub fn set_copy_wake(&self, wake: impl Fn() + Clone + Send + Sync + 'static) {
        if let Some(r) = &self.replication {
            if let Some(thread) = &r.large_writes {
                thread.set_wake(Box::new(wake.clone()));
            }
            r.mover.set_wake(Box::new(wake));
        }
    }

    /// The worker's turn at the writes' copies ([`Replicator::drive`]): whether any
    /// was sent or ended. Never sleeps.
    pub fn drive_copies(&mut self) -> bool {
        let Some(r) = self.replication.as_mut() else { return false };
        let drive = r.writes.drive();
        r.look_until = drive.look_until;
        drive.progressed
    }

    /// Whether answers wait for copies.
    pub fn copies_in_flight(&self) -> bool {
        self.replication.as_ref().is_some_and(|r| !r.copies.is_empty())
    }

    /// Whether a copy's answer is likely a round trip away: the worker's own copies' are
    /// due, or a copy was handed to a replicator thread within the last [`COPY_SPIN`]. The
    /// worker then looks again rather than sleep (giving the CPU up between looks, for the
    /// replicators and the replica).
    pub fn copy_expected_soon(&self) -> bool {
        self.replication.as_ref().is_some_and(|r| {
            !r.copies.is_empty()
                && (r.look_until.is_some_and(|at| Instant::now() < at) || r.last_handed.elapsed() < COPY_SPIN)
        })
    }

    /// Refuses a client's read of a key whose last write is not on every replica yet.
    pub(super) fn check_replicated(&self, kind: Kind, key: &[u8]) -> Result<()> {
        let Some(r) = &self.replication else { return Ok(()) };
        if r.keys.is_empty() || kind != Kind::Get || !r.keys.contains_key(key) {
            return Ok(());
        }
        Err(Error::new(
            Status::Replicating,
            "the key's last write is being copied to its replicas; it is read once every replica holds it",
        ))
    }
}
