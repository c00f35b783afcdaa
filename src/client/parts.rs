//! Values sent in parts ([`flags::STAGE`] with a range): staged on the server in order
//! (this client sends one at a time), then committed as one ordinary put. The device path
//! sends GPU memory so, a part at a time through pinned buffers; [`Client::put_parts`]
//! sends a value that lies in several of the caller's buffers (a header and a body)
//! without copying them together; in a cluster over UCX between hosts, a large write goes
//! to its primary so, its parts in flight together, for the primary to stream it on to
//! the key's other replicas as it lands.

use std::collections::VecDeque;

use super::link::{Payload, Receive, Reply};
use super::tunables::{
    GATHER_COPY_MAX, STREAM_PUT_MIN, STREAM_PUT_PARTS, STREAM_PUT_PARTS_IN_FLIGHT, STREAM_PUT_PART_MAX,
    STREAM_PUT_PART_MIN,
};
use super::{apply_write_condition, check_key, error_of, Client, PutOptions, WriteCondition, WriteResult};
use crate::error::{Error, Result, Status};
use crate::proto::{flags, Op, RequestHeader, INLINE_KEY_MAX, MAX_VALUE_LEN};

impl Client {
    /// Stores the concatenation of `parts` under `key`, as [`Client::put_with`] would, without
    /// joining them in memory: each part is staged on the server, then the value is
    /// committed. Small values, values for a cluster and values the server has no staging
    /// room for are joined here and put whole.
    pub fn put_parts(&mut self, key: &[u8], parts: &[&[u8]], opts: &PutOptions) -> Result<WriteResult> {
        check_key(key)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total as u64 > MAX_VALUE_LEN {
            return Err(Error::new(Status::ValueTooLarge, format!("{total} bytes > limit {MAX_VALUE_LEN}")));
        }
        let nonempty: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
        if nonempty.len() <= 1 {
            return self.put_with(key, nonempty.first().copied().unwrap_or_default(), opts);
        }
        if self.stages_in_parts(key, parts) {
            let mut stage_id = None;
            let mut result = Ok(());
            let mut offset = 0;
            for part in &nonempty {
                result = self.stage_part(key, offset, total, &mut stage_id, part);
                if result.is_err() {
                    break;
                }
                offset += part.len();
            }
            let result = result.and_then(|()| self.commit_parts(key, total, stage_id.take(), opts));
            match result {
                Err(e) if sent_whole_instead(&e) => self.discard_parts_if_answered(key, &e, stage_id),
                Err(e) => {
                    self.discard_parts_if_answered(key, &e, stage_id);
                    return Err(e);
                }
                done => return done,
            }
        }
        self.put_with(key, &parts.concat(), opts)
    }

    /// [`Client::put_parts`] of many values, with up to `depth` requests in flight: each
    /// value's parts and its commit go one after another, the values side by side. A value
    /// that [`Client::put_parts`] would join (or whose parts the server could not stage)
    /// is put whole, after the others.
    pub fn put_parts_many(
        &mut self,
        items: &[(&[u8], &[&[u8]])],
        opts: &PutOptions,
        depth: usize,
    ) -> Vec<Result<WriteResult>> {
        let mut results: Vec<Option<Result<WriteResult>>> = (0..items.len()).map(|_| None).collect();
        let staged: Vec<usize> = (0..items.len()).filter(|&i| self.stages_in_parts(items[i].0, items[i].1)).collect();
        match self.live() {
            Ok(_) => self.stage_many(items, &staged, opts, depth, &mut results),
            Err(e) => staged.iter().for_each(|&i| results[i] = Some(Err(e.clone()))),
        }
        for (i, result) in results.iter_mut().enumerate() {
            let (key, parts) = items[i];
            match result {
                None => *result = Some(self.put_parts(key, parts, opts)),
                Some(Err(e)) if sent_whole_instead(e) => *result = Some(self.put_with(key, &parts.concat(), opts)),
                Some(_) => {}
            }
        }
        results.into_iter().map(|r| r.expect("every value has an outcome")).collect()
    }

    /// Whether [`Client::put_parts`] stages these parts on the server: two or more that
    /// are not empty, more than [`GATHER_COPY_MAX`] bytes together, a key that travels
    /// inline, and a server given by address (a cluster's primary copies whole values).
    fn stages_in_parts(&self, key: &[u8], parts: &[&[u8]]) -> bool {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        check_key(key).is_ok()
            && parts.iter().filter(|p| !p.is_empty()).count() > 1
            && total > GATHER_COPY_MAX
            && total as u64 <= MAX_VALUE_LEN
            && self.cluster.is_none()
            && key.len() <= INLINE_KEY_MAX
    }

    /// The values `staged` (indices into `items`) in parts, `depth` values at a time, one
    /// request of each in flight; their outcomes into `results`.
    fn stage_many(
        &mut self,
        items: &[(&[u8], &[&[u8]])],
        staged: &[usize],
        opts: &PutOptions,
        depth: usize,
        results: &mut [Option<Result<WriteResult>>],
    ) {
        let mut chains: Vec<PartChain> = staged.iter().map(|&i| PartChain::new(i, items[i].1)).collect();
        let mut in_flight: VecDeque<(usize, u64)> = VecDeque::new();
        let mut refused = Vec::new();
        let (mut next_chain, mut limit) = (0, depth.max(1));
        // Values the server had no staging room for while others of this batch held it:
        // sent again once one of those is done.
        let mut waiting: VecDeque<usize> = VecDeque::new();
        loop {
            while in_flight.len() < limit {
                let c = match waiting.pop_front() {
                    Some(c) => c,
                    None if next_chain < chains.len() => {
                        next_chain += 1;
                        next_chain - 1
                    }
                    None => break,
                };
                match self.submit_step(items[chains[c].item].0, &chains[c], opts) {
                    Ok(id) => in_flight.push_back((c, id)),
                    Err(e) => results[chains[c].item] = Some(Err(e)),
                }
            }
            let Some((c, id)) = in_flight.pop_front() else { break };
            let chain = &mut chains[c];
            let key = items[chain.item].0;
            let committing = chain.next == chain.parts.len();
            let outcome = self.conn.wait(id).and_then(|reply| match reply.header.status() {
                Status::Ok if committing => Ok(Some(WriteResult::Written { generation: reply.header.generation })),
                Status::ConditionFailed if committing => Ok(Some(WriteResult::ConditionFailed)),
                Status::Ok => {
                    chain.stage_id.get_or_insert(reply.header.request_id);
                    chain.offset += chain.parts[chain.next].len();
                    chain.next += 1;
                    Ok(None)
                }
                _ => Err(part_refused(&reply)),
            });
            let outcome = match outcome {
                // Refused at its first part, so nothing of it is staged: the server holds as
                // many values staged by this client's connection as it takes (this batch's
                // values in flight). The value waits for one of them to end, and the batch keeps at
                // most that many in flight.
                Err(e) if e.status == Status::NoRoom && chains[c].next == 0 && !in_flight.is_empty() => {
                    limit = in_flight.len();
                    waiting.push_back(c);
                    continue;
                }
                Ok(None) => self.submit_step(key, &chains[c], opts).map(|id| in_flight.push_back((c, id))),
                Ok(Some(written)) => {
                    results[chains[c].item] = Some(Ok(written));
                    Ok(())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = outcome {
                refused.push((chains[c].item, chains[c].stage_id, e.clone()));
                results[chains[c].item] = Some(Err(e));
            }
        }
        // Once nothing is in flight: what the server staged for values it refused goes.
        for (item, stage_id, e) in refused {
            self.discard_parts_if_answered(items[item].0, &e, stage_id);
        }
    }

    /// In a cluster over UCX between hosts ([`Connection::stages_large_writes`]): whether
    /// a put of `len` bytes for `key` goes to its primary in parts ([`Client::put_streamed`]),
    /// and that primary: an unconditional put of a large value for a key with other replicas.
    ///
    /// [`Connection::stages_large_writes`]: super::conn::Connection::stages_large_writes
    pub(super) fn streams(&mut self, key: &[u8], len: usize, opts: &PutOptions) -> Option<usize> {
        let streams = self.cluster.is_some()
            && opts.condition == WriteCondition::None
            && len >= STREAM_PUT_MIN
            && key.len() <= INLINE_KEY_MAX
            && self.live().is_ok_and(|c| c.stages_large_writes() && c.replicas_of(key).0.len() > 1);
        // Not to a primary whose connection is lost: the value goes whole, where a single
        // call's write goes (`Client::target`).
        let primary = self.conn.primary(key);
        (streams && !self.conn.is_dead(primary)).then_some(primary)
    }

    /// A put that [`Client::streams`]: its value goes to its primary in parts (about
    /// [`STREAM_PUT_PARTS`]), then its commit; the primary sends each part on to the
    /// replicas as it lands (over UCX a value sent whole reaches the primary whole, and
    /// only then could its copy start). None: the value goes whole instead (not such a
    /// put, or its parts were refused before it was committed: the view changed, the
    /// primary had no staging room, a connection broke).
    pub(super) fn put_streamed(&mut self, key: &[u8], value: &[u8], opts: &PutOptions) -> Option<Result<WriteResult>> {
        let server = self.streams(key, value.len(), opts)?;
        self.put_streamed_all(&[(key, value, server)], opts).pop().flatten()
    }

    /// [`Client::put_streamed`] of `writes` (key, value, and the primary [`Client::streams`]
    /// gave), one after another with [`STREAM_PUT_PARTS_IN_FLIGHT`] requests in flight in
    /// all: a value's parts in order, its commit once they are all answered, and meanwhile
    /// the next value's parts. Every request ends (answered, or given up on at its timeout)
    /// before the call returns: none reads a caller's value after.
    pub(super) fn put_streamed_all(
        &mut self,
        writes: &[(&[u8], &[u8], usize)],
        opts: &PutOptions,
    ) -> Vec<Option<Result<WriteResult>>> {
        let mut values: Vec<StreamedValue> = writes.iter().map(|w| StreamedValue::new(w.1.len())).collect();
        let mut in_flight: VecDeque<(usize, u64)> = VecDeque::new();
        let mut sending = 0;
        loop {
            while in_flight.len() < STREAM_PUT_PARTS_IN_FLIGHT {
                let Some(v) = (sending..values.len()).find(|&v| values[v].sends_more(writes[v].1.len())) else { break };
                sending = v;
                let ((key, value, server), s) = (writes[v], &mut values[v]);
                let part = &value[s.sent..][..s.part_len.min(value.len() - s.sent)];
                let h = part_header(s.sent, value.len(), s.stage_id);
                match self.submit_key(key, h, part.into(), Receive::Owned, server) {
                    Ok(id) => {
                        // The value is staged under its first part's request id.
                        s.stage_id.get_or_insert(id);
                        s.sent += part.len();
                        s.unanswered += 1;
                        in_flight.push_back((v, id));
                    }
                    Err(e) => s.failed = Some(e),
                }
            }
            let Some((v, id)) = in_flight.pop_front() else { break };
            let ((key, value, server), s) = (writes[v], &mut values[v]);
            let reply = self.conn.wait(id);
            s.unanswered -= 1;
            if s.committed {
                s.outcome = Some(reply.and_then(|reply| match reply.header.status() {
                    Status::Ok => Ok(WriteResult::Written { generation: reply.header.generation }),
                    _ => Err(part_refused(&reply)),
                }));
                continue;
            }
            match reply {
                Ok(r) if r.header.status() == Status::Ok => {}
                Ok(r) => {
                    s.failed.get_or_insert_with(|| part_refused(&r));
                }
                Err(e) => {
                    s.failed.get_or_insert(e);
                }
            }
            if s.failed.is_none() && s.sent == value.len() && s.unanswered == 0 {
                let h = commit_header(value.len(), s.stage_id, opts);
                match self.submit_key(key, h, Payload::empty(), Receive::Owned, server) {
                    Ok(id) => {
                        (s.committed, s.unanswered) = (true, 1);
                        in_flight.push_back((v, id));
                    }
                    Err(e) => s.failed = Some(e),
                }
            }
        }
        let ended = writes.iter().zip(values);
        ended.map(|(&(key, value, server), s)| self.streamed_outcome(key, value.len(), server, s)).collect()
    }

    /// A streamed put's outcome: None where its value goes whole instead (see
    /// [`Client::put_streamed`]), after what the primary staged of it was discarded.
    fn streamed_outcome(
        &mut self,
        key: &[u8],
        total: usize,
        server: usize,
        s: StreamedValue,
    ) -> Option<Result<WriteResult>> {
        let outcome = s.outcome.unwrap_or_else(|| {
            Err(s.failed.unwrap_or_else(|| Error::new(Status::Internal, "a streamed put ended uncommitted")))
        });
        let e = match outcome {
            Ok(written) => return Some(Ok(written)),
            Err(e) => e,
        };
        let answered = !matches!(e.status, Status::Timeout | Status::Unavailable | Status::Transport);
        if let (true, Some(id)) = (answered, s.stage_id) {
            // Freed at once on the server that staged it (else it lapses there).
            let discard = self.submit_key(key, discard_header(id), Payload::empty(), Receive::Owned, server);
            let _ = discard.and_then(|id| self.conn.wait(id));
        }
        let not_committed = matches!(
            e.status,
            Status::Moved | Status::ViewChanged | Status::KeyMoving | Status::NoRoom | Status::Missing
        );
        // A lost server's write may have been taken: sent again whole, as any write is.
        let lost = matches!(e.status, Status::Unavailable | Status::Transport);
        if not_committed || lost {
            tracing::debug!("a streamed put of {total} bytes goes whole: {e}");
            return None;
        }
        Some(Err(e))
    }

    /// Sends a value's next part, or once every part is there its commit, to the key's
    /// primary, where the value is staged (never where a lost primary's requests fail over
    /// to: the stage is not there).
    fn submit_step(&mut self, key: &[u8], chain: &PartChain, opts: &PutOptions) -> Result<u64> {
        let server = self.conn.primary(key);
        match chain.parts.get(chain.next) {
            Some(part) => {
                let h = part_header(chain.offset, chain.total, chain.stage_id);
                self.submit_inline(h, key, part, Receive::Owned, server)
            }
            None => {
                let h = commit_header(chain.total, chain.stage_id, opts);
                self.submit_inline(h, key, &[], Receive::Owned, server)
            }
        }
    }

    /// Sends `bytes` as the part at `offset` of a value of `total` bytes staged under
    /// `stage_id` (set by the first part's answer).
    pub(super) fn stage_part(
        &mut self,
        key: &[u8],
        offset: usize,
        total: usize,
        stage_id: &mut Option<u64>,
        bytes: &[u8],
    ) -> Result<()> {
        let reply = self.call_key(key, part_header(offset, total, *stage_id), bytes)?;
        if reply.header.status() != Status::Ok {
            return Err(part_refused(&reply));
        }
        stage_id.get_or_insert(reply.header.request_id);
        Ok(())
    }

    /// Commits a value of `total` bytes staged in parts under `stage_id`, with `opts`'
    /// condition and TTL.
    pub(super) fn commit_parts(
        &mut self,
        key: &[u8],
        total: usize,
        stage_id: Option<u64>,
        opts: &PutOptions,
    ) -> Result<WriteResult> {
        let reply = self.call_key(key, commit_header(total, stage_id, opts), &[])?;
        match reply.header.status() {
            Status::Ok => Ok(WriteResult::Written { generation: reply.header.generation }),
            Status::ConditionFailed => Ok(WriteResult::ConditionFailed),
            _ => Err(part_refused(&reply)),
        }
    }

    /// Frees what a put in parts that failed with `e` left on the server, where the server
    /// answered (a refused part); one that did not answer frees the parts when they lapse
    /// or the session ends, and is not waited for a second time.
    pub(super) fn discard_parts_if_answered(&mut self, key: &[u8], e: &Error, stage_id: Option<u64>) {
        let answered = !matches!(e.status, Status::Timeout | Status::Unavailable | Status::Transport);
        if let (true, Some(id)) = (answered, stage_id) {
            let _ = self.call_key(key, discard_header(id), &[]);
        }
    }
}

/// Why a server refused a part of a value staged in parts, or its commit: `Missing` (the
/// value lapsed or was discarded) stays itself, so that the caller sends the value whole.
fn part_refused(reply: &Reply) -> Error {
    match reply.header.status() {
        Status::Missing => Error::new(Status::Missing, String::from_utf8_lossy(&reply.payload)),
        s => error_of(s, reply),
    }
}

/// A value of [`Client::put_streamed_all`] on its way.
struct StreamedValue {
    part_len: usize,
    /// Its bytes whose parts were sent.
    sent: usize,
    /// Its requests in flight.
    unanswered: usize,
    stage_id: Option<u64>,
    /// Whether its commit was sent.
    committed: bool,
    /// Why a part failed, or its commit could not be sent.
    failed: Option<Error>,
    /// Its commit's answer.
    outcome: Option<Result<WriteResult>>,
}

impl StreamedValue {
    fn new(total: usize) -> StreamedValue {
        StreamedValue {
            part_len: (total / STREAM_PUT_PARTS).clamp(STREAM_PUT_PART_MIN, STREAM_PUT_PART_MAX),
            sent: 0,
            unanswered: 0,
            stage_id: None,
            committed: false,
            failed: None,
            outcome: None,
        }
    }

    /// Whether more of its `total` bytes' parts go.
    fn sends_more(&self, total: usize) -> bool {
        self.failed.is_none() && self.sent < total
    }
}

/// A value of [`Client::put_parts_many`] on its way: its parts (none empty), the next one
/// to send (`parts.len()`: the commit), where it goes, and the id the value is staged under.
struct PartChain<'a> {
    item: usize,
    parts: Vec<&'a [u8]>,
    total: usize,
    next: usize,
    offset: usize,
    stage_id: Option<u64>,
}

impl<'a> PartChain<'a> {
    fn new(item: usize, parts: &[&'a [u8]]) -> PartChain<'a> {
        let parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
        PartChain { item, total: parts.iter().map(|p| p.len()).sum(), parts, next: 0, offset: 0, stage_id: None }
    }
}

/// The part at `offset` of a value of `total` bytes staged under `stage_id` (none: the
/// first part, which stages it under its own request id).
pub(super) fn part_header(offset: usize, total: usize, stage_id: Option<u64>) -> RequestHeader {
    let mut h = RequestHeader::new(Op::Put, 0, 0);
    h.flags |= flags::STAGE | flags::HAS_RANGE;
    (h.range_start, h.range_end, h.if_not_equal) = (offset as i64, total as i64, stage_id.unwrap_or(0));
    h
}

/// Discards the value staged in parts under `stage_id`.
pub(super) fn discard_header(stage_id: u64) -> RequestHeader {
    let mut h = RequestHeader::new(Op::Delete, 0, 0);
    h.flags |= flags::STAGE;
    h.if_not_equal = stage_id;
    h
}

/// The empty part at a value's end, which commits it with `opts`' condition and TTL.
fn commit_header(total: usize, stage_id: Option<u64>, opts: &PutOptions) -> RequestHeader {
    let mut h = part_header(total, total, stage_id);
    apply_write_condition(&mut h, opts.condition);
    if let Some(ttl) = opts.ttl {
        h.flags |= flags::HAS_TTL;
        h.ttl_or_limit = (ttl.as_millis() as u64).max(1);
    }
    h
}

/// A failure after which the value is put whole instead: no staging room, or the value
/// lapsed, or the connection was lost or replaced while its parts arrived.
fn sent_whole_instead(e: &Error) -> bool {
    matches!(e.status, Status::NoRoom | Status::Unavailable | Status::Missing | Status::Transport)
}
