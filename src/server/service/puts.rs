//! A put's way: its extent reserved and its key checked, its bytes landing (copied from
//! the request, or received straight into the extent while [`PendingPut`] holds it), then
//! published under a generation (or an import's) and handed to replication.

use super::*;

/// A put whose bytes are still arriving into a reserved extent that is not in the index
/// (no reader or writer can reach it) until [`Service::finish_put`].
pub struct PendingPut {
    pub header: RequestHeader,
    pub kind: Kind,
    pub extent: Extent,
    pub layout: Layout,
    /// Where, from the extent's start, the arriving bytes go, and how many arrive.
    pub dest_offset: u64,
    pub arriving: u64,
    /// Set when the server cut the transfer (it stalled): the extent's other bytes are
    /// already free, and these parts of it, still being written into, go when it ends.
    pub cut: Option<Vec<Extent>>,
    /// When the request arrived, while requests are timed (for the service-time metric).
    pub arrived: Option<Instant>,
    /// A part of a value staged in parts: the id the value is staged under. The extent
    /// is the staged value's, which this transfer owns until it ends.
    pub part: Option<u64>,
    /// The value is streamed to the key's replicas as it lands, under this copy token
    /// ([`Service::stream_put`]); the extent is pinned meanwhile.
    pub stream: Option<u64>,
}

impl PendingPut {
    fn new(
        req: &Request,
        extent: Extent,
        layout: Layout,
        dest_offset: u64,
        arriving: u64,
        arrived: Option<Instant>,
        part: Option<u64>,
    ) -> PendingPut {
        PendingPut {
            header: req.header,
            kind: req.kind,
            extent,
            layout,
            dest_offset,
            arriving,
            cut: None,
            arrived,
            part,
            stream: None,
        }
    }
}

impl Service {
    /// Starts a put whose `arriving` bytes (the value, after the key when the key travels
    /// in the payload) land straight in the arena: checks and reserves.
    pub fn begin_put(&mut self, req: &Request, arriving: u64) -> Result<PendingPut> {
        let arrived = self.metrics.clock();
        self.reserve_put(req, arriving, arrived)
            .inspect_err(|e| self.metrics.record(Some(req.op()), e.status, 0, 0, arrived))
    }

    fn reserve_put(&mut self, req: &Request, arriving: u64, arrived: Option<Instant>) -> Result<PendingPut> {
        let h = req.header;
        if req.op() != Op::Put {
            return Err(Error::new(Status::Invalid, format!("{:?} with a {arriving}-byte payload", req.kind)));
        }
        let key_len = h.key_len as u64;
        let in_payload = h.flags & flags::KEY_IN_PAYLOAD != 0;
        if in_payload && arriving < key_len {
            return Err(Error::new(Status::Invalid, "payload shorter than the key"));
        }
        let value_len = if in_payload { arriving - key_len } else { arriving };
        if value_len > proto::MAX_VALUE_LEN {
            return Err(Error::new(
                Status::ValueTooLarge,
                format!("{value_len} bytes > limit {}", proto::MAX_VALUE_LEN),
            ));
        }
        if req.kind == Kind::StagePart {
            let (extent, layout, id) = self.begin_part(&h, req.inline, arriving)?;
            let dest_offset = u64::from(layout.value_at) + h.range_start as u64;
            return Ok(PendingPut::new(req, extent, layout, dest_offset, arriving, arrived, Some(id)));
        }
        if !in_payload {
            self.check_shard(req.inline)?;
            self.check_placement(&h, req.kind, req.inline)?;
            if req.kind != Kind::Import {
                self.shard.precheck_put(req.inline, &condition(&h))?;
            }
        }
        // A key arriving in the payload is not known yet: no overwrite hint then; and the
        // value arrives right behind it.
        let (layout, extent, dest_offset) = if in_payload {
            let layout = Layout::packed(key_len as usize, value_len);
            (layout, self.shard.reserve(layout.extent_len())?, 0)
        } else {
            let layout = Layout::aligned_to(key_len as usize, value_len, u64::from(h.aux_len));
            let extent = self.shard.reserve_for_put(req.inline, layout.extent_len())?;
            self.shard.extent_mut(extent)[..req.inline.len()].copy_from_slice(req.inline);
            (layout, extent, u64::from(layout.value_at))
        };
        Ok(PendingPut::new(req, extent, layout, dest_offset, arriving, arrived, None))
    }

    /// Where a pending put's bytes go.
    pub fn put_destination(&mut self, p: &PendingPut) -> *mut u8 {
        self.shard.extent_mut(p.extent)[p.dest_offset as usize..].as_mut_ptr()
    }

    /// Publishes a put whose bytes arrived (`arrived`), or frees its slot when the
    /// transfer failed (the client vanished): the server keeps serving either way. In a
    /// cluster the answer may wait for the write's copies ([`Answer::Deferred`]).
    pub fn finish_put(&mut self, p: PendingPut, arrived: bool, out: &mut Vec<u8>) -> Answer {
        let (since, value_len) = (p.arrived, p.layout.value_len);
        let reply = self.publish_put(p, arrived, out);
        if let Some(token) = self.take_deferred(since) {
            return Answer::Deferred(token);
        }
        let received = if reply.status() == Status::Ok { value_len } else { 0 };
        self.metrics.record(Some(Op::Put), reply.status(), received, 0, since);
        Answer::Owned(reply)
    }

    fn publish_put(&mut self, p: PendingPut, arrived: bool, out: &mut Vec<u8>) -> ReplyHeader {
        let id = p.header.request_id;
        if let Some(stage_id) = p.part {
            return self.end_part(p, stage_id, arrived, out);
        }
        if let Some(held) = p.cut {
            for part in held {
                self.shard.release(part);
            }
            self.abort_stream(p.stream);
            return error_reply(
                id,
                &Error::new(Status::Timeout, "value transfer stalled past its deadline; cut by the server"),
                out,
            );
        }
        if !arrived {
            info!("shard {}: a put of {} bytes was aborted in transfer (its client failed or went away); its space is freed", self.index, p.layout.value_len);
            self.shard.release(p.extent);
            self.abort_stream(p.stream);
            return error_reply(id, &Error::new(Status::Transport, "value transfer failed"), out);
        }
        let key_len = p.header.key_len as u64;
        let mut checked = self.check_shard(self.shard.arena().slice(p.extent.offset, key_len));
        // In a cluster, a copy of the key (which the checks read beside the shard; servers
        // outside a cluster make none): checked again now that the value is here, as the key
        // may have been handed over while it arrived, and named in the write's copies.
        let key = self.placement.is_some().then(|| self.shard.arena().slice(p.extent.offset, key_len).to_vec());
        if let Some(key) = key.as_deref().filter(|_| checked.is_ok()) {
            checked = self.check_placement(&p.header, p.kind, key);
        }
        if let Err(e) = checked {
            self.shard.release(p.extent);
            self.abort_stream(p.stream);
            return error_reply(id, &e, out);
        }
        match self.commit(p.extent, p.layout, &p.header, p.kind) {
            Ok(generation) => {
                let reply = ok_reply(id, generation, p.layout.value_len);
                match &key {
                    Some(key) => self
                        .replicate(&p.header, p.kind, key, generation, Some((p.extent, p.layout)), p.stream, reply)
                        .unwrap_or_else(|e| error_reply(id, &e, out)),
                    None => reply,
                }
            }
            Err(e) => {
                self.abort_stream(p.stream);
                error_reply(id, &e, out)
            }
        }
    }

    pub(super) fn eager_put(
        &mut self,
        h: &RequestHeader,
        kind: Kind,
        inline: &[u8],
        payload: &[u8],
    ) -> Result<ReplyHeader> {
        let key = self.key_of(h, inline, payload)?;
        let value = if h.flags & flags::KEY_IN_PAYLOAD != 0 { &payload[key.len()..] } else { payload };
        match kind {
            Kind::StagePart => return self.eager_part(h, key, value),
            Kind::ImportStaged if value.is_empty() => return self.commit_staged_import(h, key),
            Kind::ImportStaged => return Err(Error::new(Status::Invalid, "a staged value's commit carries no bytes")),
            _ => {}
        }
        self.check_placement(h, kind, key)?;
        if kind != Kind::Import {
            self.shard.precheck_put(key, &condition(h))?;
        }
        // Copied here from the receive buffer: aligned to where the value sits in it.
        let layout = Layout::aligned_to(key.len(), value.len() as u64, value.as_ptr() as u64);
        let extent = self.shard.reserve_for_put(key, layout.extent_len())?;
        self.shard.write_put(extent, layout, key, value);
        let generation = self.commit(extent, layout, h, kind)?;
        let reply = ok_reply(h.request_id, generation, value.len() as u64);
        self.replicate(h, kind, key, generation, Some((extent, layout)), None, reply)
    }

    /// Publishes a put's key and value, written into `extent`: under a new generation if
    /// its condition holds, or for an import, under the generation it brings.
    fn commit(&mut self, extent: Extent, layout: Layout, h: &RequestHeader, kind: Kind) -> Result<u64> {
        if kind == Kind::Import {
            let key = self.shard.arena().slice(extent.offset, u64::from(layout.key_len));
            let grant = Grant::Put { generation: h.if_equal, len: layout.value_len, ttl_ms: ttl(h) };
            if let Err(e) = self.check_ticket(h, key, grant) {
                self.shard.release(extent);
                return Err(e);
            }
            self.shard.commit_import(extent, layout, h.if_equal, ttl(h))
        } else {
            self.shard.commit_put(extent, layout, &condition(h), ttl(h))
        }
    }
}
