//! Values staged in parts ([`flags::STAGE`] with a range), as device memory is sent: the
//! first part reserves the whole value's extent, later ones arrive in order under its id,
//! and an empty part at the end commits it as an ordinary put (see [`super::Staging`]).

use super::*;

impl Service {
    /// Admits a part of a value staged in parts ([`flags::STAGE`] with a range): the
    /// first (at offset 0) reserves the whole value's extent and stages it under the
    /// request's id, later ones name that id in `if_not_equal`. The extent, the layout and
    /// the id; the part's transfer owns the extent until [`Service::end_part`].
    pub(super) fn begin_part(&mut self, h: &RequestHeader, key: &[u8], len: u64) -> Result<(Extent, Layout, u64)> {
        if h.flags & flags::KEY_IN_PAYLOAD != 0
            || h.range_start < 0
            || h.range_end < h.range_start
            || h.range_end as u64 > proto::MAX_VALUE_LEN
        {
            return Err(Error::new(
                Status::Invalid,
                format!(
                    "a part [{}, {}) of a value staged in parts (its key inline, 0 <= start <= length <= {})",
                    h.range_start,
                    h.range_end,
                    proto::MAX_VALUE_LEN
                ),
            ));
        }
        self.check_shard(key)?;
        self.check_placement(h, Kind::StagePart, key)?;
        let (offset, total) = (h.range_start as u64, h.range_end as u64);
        if offset > 0 {
            let (extent, layout) = self.staging.next_part(h.session, h.if_not_equal, offset, len, total)?;
            if self.shard.arena().slice(extent.offset, key.len() as u64) != key || layout.key_len as usize != key.len()
            {
                self.staging.part_ended(h.session, h.if_not_equal, (offset, 0), true).ok();
                return Err(Error::new(
                    Status::Invalid,
                    format!("the value staged under request id {} is another key's", h.if_not_equal),
                ));
            }
            return Ok((extent, layout, h.if_not_equal));
        }
        if len > total || total == 0 {
            return Err(Error::new(Status::Invalid, format!("a first part of {len} bytes of a {total}-byte value")));
        }
        let layout = Layout::aligned_to(key.len(), total, u64::from(h.aux_len));
        self.staging.admit(h.session, layout.extent_len())?;
        let extent = self.shard.reserve_for_put(key, layout.extent_len())?;
        self.shard.extent_mut(extent)[..key.len()].copy_from_slice(key);
        self.staging.begin_assembly(h.session, h.request_id, (extent, layout), len).map_err(|(extent, e)| {
            self.shard.release(extent);
            e
        })?;
        self.stream_staged(h, extent, layout);
        Ok((extent, layout, h.request_id))
    }

    /// A part's transfer ended: the bytes of the value received so far, or the value is
    /// over (the part failed, or the value was discarded meanwhile) and freed once no
    /// other part arrives into it. (A stalled part is never cut: the extent is the staged
    /// value's, which its other parts in flight may be writing into.)
    pub(super) fn end_part(&mut self, p: PendingPut, stage_id: u64, arrived: bool, out: &mut Vec<u8>) -> ReplyHeader {
        let (h, id) = (p.header, p.header.request_id);
        match self.staging.part_ended(h.session, stage_id, (h.range_start as u64, p.arriving), arrived) {
            Ok((received, landed)) => {
                self.staged_landed(h.session, stage_id, landed);
                ok_reply(id, 0, received)
            }
            Err(over) => {
                if let Some(staged) = over {
                    self.shard.release(staged.extent);
                }
                self.end_staged_stream(h.session, stage_id);
                let why = if arrived {
                    "the value staged in parts lapsed or was discarded while a part arrived"
                } else {
                    "a part's transfer failed; the value staged in parts is discarded"
                };
                error_reply(id, &Error::new(Status::Transport, why), out)
            }
        }
    }

    /// A part that arrived with its request (or the empty part at the value's end, which
    /// commits the value as an ordinary put, with its condition and TTL).
    pub(super) fn eager_part(&mut self, h: &RequestHeader, key: &[u8], part: &[u8]) -> Result<ReplyHeader> {
        if value_is_whole(h, part.len()) {
            return self.commit_parts(h, key);
        }
        let (extent, layout, stage_id) = self.begin_part(h, key, part.len() as u64)?;
        let at = layout.value_at as usize + h.range_start as usize;
        self.shard.extent_mut(extent)[at..][..part.len()].copy_from_slice(part);
        match self.staging.part_ended(h.session, stage_id, (h.range_start as u64, part.len() as u64), true) {
            Ok((received, landed)) => {
                self.staged_landed(h.session, stage_id, landed);
                Ok(ok_reply(h.request_id, 0, received))
            }
            Err(over) => {
                if let Some(staged) = over {
                    self.shard.release(staged.extent);
                }
                self.end_staged_stream(h.session, stage_id);
                Err(Error::new(Status::Missing, "the value staged in parts lapsed"))
            }
        }
    }

    /// Publishes a value whose parts all arrived, as a put under a new generation if its
    /// condition holds. A value streamed to the key's replicas as it arrived is installed
    /// there, or its stream ends.
    fn commit_parts(&mut self, h: &RequestHeader, key: &[u8]) -> Result<ReplyHeader> {
        let stream = self.take_staged_stream(h.session, h.if_not_equal);
        // Checked as the put it is (one sent without a view is refused).
        let committed = self.check_placement(h, Kind::Put, key).and_then(|()| {
            let staged = self.take_whole(h, key, h.range_end as u64)?;
            let generation = self.shard.commit_put(staged.extent, staged.layout, &condition(h), ttl(h))?;
            Ok((staged, generation))
        });
        let (staged, generation) = committed.inspect_err(|_| self.abort_stream(stream))?;
        let reply = ok_reply(h.request_id, generation, staged.layout.value_len);
        self.replicate(h, Kind::StagePart, key, generation, Some((staged.extent, staged.layout)), stream, reply)
    }

    /// A replica's side of [`Kind::ImportStaged`]: installs the value the key's primary
    /// staged here in parts under the generation it gave it, as an import would.
    pub(super) fn commit_staged_import(&mut self, h: &RequestHeader, key: &[u8]) -> Result<ReplyHeader> {
        self.check_placement(h, Kind::ImportStaged, key)?;
        // The ticket first: a frame without one leaves what is staged alone.
        let len = self.staging.value_len(h.session, h.if_not_equal).unwrap_or(0);
        let generation = h.if_equal;
        self.check_ticket(h, key, Grant::Put { generation, len, ttl_ms: ttl(h) })?;
        let staged = self.take_whole(h, key, len)?;
        let generation = self.shard.commit_import(staged.extent, staged.layout, generation, ttl(h))?;
        if let Some(r) = self.replication.as_mut() {
            r.installed_streamed += 1;
        }
        Ok(ok_reply(h.request_id, generation, len))
    }

    /// Takes the value `h`'s session staged under the id in `if_not_equal`, whole, of
    /// `key` and `len` bytes long; it is freed if not.
    fn take_whole(&mut self, h: &RequestHeader, key: &[u8], len: u64) -> Result<Staged> {
        let id = h.if_not_equal;
        let staged = self.staging.take(h.session, id).ok_or_else(|| {
            Error::new(
                Status::Missing,
                format!("no value is staged in parts under request id {id} (it lapsed, or was discarded)"),
            )
        })?;
        let value_len = staged.layout.value_len;
        let whole = staged.assembly.as_ref().is_some_and(|a| a.received == value_len && len == value_len);
        if !whole || self.shard.arena().slice(staged.extent.offset, u64::from(staged.layout.key_len)) != key {
            self.shard.release(staged.extent);
            return Err(Error::new(
                Status::Invalid,
                format!("the value staged under request id {id} is not whole, or is another key's"),
            ));
        }
        Ok(staged)
    }
}

/// The empty part at a value's end, which commits it.
fn value_is_whole(h: &RequestHeader, part_len: usize) -> bool {
    part_len == 0 && h.range_start == h.range_end && h.range_start > 0
}
