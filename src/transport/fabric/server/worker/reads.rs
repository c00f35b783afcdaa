//! Put pulls: a large put's value read from the client's registered memory into a reserved
//! extent, in chunks striped over the rails, committed when every chunk arrived and cut when
//! the client stops progressing.

use super::*;
use crate::cluster::replication::Landed;

impl ReadPlan {
    fn new(
        dest: *mut u8,
        descs: Vec<*mut std::ffi::c_void>,
        peer: Vec<PeerAddr>,
        remote: Vec<(u64, u64)>,
        len: usize,
        stall_timeout: Duration,
        landed: Option<Landed>,
    ) -> ReadPlan {
        // A value streamed on as it lands is read in smaller chunks, which it follows.
        let max_chunk = if landed.is_some() { STREAM_READ_CHUNK } else { READ_CHUNK };
        let chunk = stripe_len(len, peer.len()).clamp(1, max_chunk);
        let deadline = service::transfer_deadline(stall_timeout, len as u64);
        ReadPlan {
            dest,
            descs,
            peer,
            remote,
            len,
            chunk,
            next: 0,
            chunks: len.div_ceil(chunk).max(1),
            failed: false,
            abort: None,
            deadline,
            in_flight: BTreeSet::new(),
            landed,
        }
    }
}

impl FabricShardWorker {
    /// A request whose payload stays in the client's memory: read it, striped over the rails.
    pub(super) fn read_remote(&mut self, to: Client, h: RequestHeader, kind: Kind, inline: Vec<u8>, rv: RemoteValue) {
        let id = h.request_id;
        let len = rv.len as usize;
        let peer = self.peers[to.slot as usize].as_ref().map(|p| p.addrs.clone()).unwrap_or_default();
        let op_value = if kind.op() == Op::Put {
            let req = Request { header: h, kind, inline: &inline };
            match self.service.begin_put(&req, rv.len) {
                Ok(mut put) => {
                    let dest = self.service.put_destination(&put);
                    let landed = self.service.stream_put(&mut put);
                    let plan = ReadPlan::new(
                        dest,
                        self.arena_mr.iter().map(|m| m.desc).collect(),
                        peer,
                        rv.rails,
                        len,
                        self.stall_timeout,
                        landed,
                    );
                    WorkerOp::ReadPut { to, put, plan }
                }
                Err(e) => {
                    let header = service::error_reply(id, &e, &mut self.scratch);
                    return self.reply(to, Answer::Owned(header), None);
                }
            }
        } else {
            if len > 2 * crate::proto::MAX_KEY_LEN {
                let header = service::error_reply(
                    id,
                    &Error::new(Status::Invalid, format!("{kind:?} with a {len}-byte payload")),
                    &mut self.scratch,
                );
                return self.reply(to, Answer::Owned(header), None);
            }
            let mut buf = vec![0u8; len];
            let temp_mr = self.local_registration(buf.as_ptr(), len);
            let descs = temp_mr
                .as_ref()
                .map_or(vec![std::ptr::null_mut(); self.rails.eps.len()], |m| m.iter().map(|r| r.desc).collect());
            let plan = ReadPlan::new(buf.as_mut_ptr(), descs, peer, rv.rails, len, self.stall_timeout, None);
            WorkerOp::ReadPayload { to, header: h, kind, inline, buf, temp_mr, plan }
        };
        let (chunks, streamed) = match &op_value {
            WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. } => (plan.chunks, plan.landed.is_some()),
            _ => unreachable!(),
        };
        // A streamed value's smaller chunks keep as many bytes in flight as any read's, as
        // a fast NIC needs; over a TCP socket, which serves reads one after the other, more
        // in flight only end later together, and the replicas follow later.
        let window = match streamed && !self.rails.provider().contains("tcp") {
            true => READ_WINDOW_PER_RAIL * READ_CHUNK / STREAM_READ_CHUNK,
            false => READ_WINDOW_PER_RAIL,
        };
        let op_id = self.ops.start(op_value, chunks);
        self.reads.insert((to.id, id), op_id);
        for _ in 0..window * self.rails.eps.len() {
            self.pump_reads(op_id, false);
        }
    }

    /// Gives up on reads of client memory past their deadline: no further chunk is posted,
    /// and the request fails (its extent freed) once the chunks in flight are back.
    pub(super) fn cut_stalled_reads(&mut self) {
        let now = Instant::now();
        for &op in self.reads.values() {
            let (plan, put) = match self.ops.value_mut(op) {
                Some(WorkerOp::ReadPut { plan, put, .. }) => (plan, Some(put)),
                Some(WorkerOp::ReadPayload { plan, .. }) => (plan, None),
                _ => continue,
            };
            if plan.deadline > now || plan.failed {
                continue;
            }
            warn!("shard {}: a read of client memory made no progress before its deadline; cut", self.service.index());
            plan.failed = true;
            self.service.metrics().transfers_cut(1);
            // Keep only what the reads still in flight write into: the rest of the
            // extent is free again now, even if they never come back. (A streamed value's
            // extent stays whole: its replicator may be reading what landed. So does a
            // value staged in parts: its other parts may be arriving into it, and it is
            // freed once the last of them ended, within its session's staging bounds.)
            if let Some(put) = put.filter(|p| p.cut.is_none() && p.stream.is_none() && p.part.is_none()) {
                let keep: Vec<(u64, u64)> = plan
                    .in_flight
                    .iter()
                    .map(|&k| {
                        (put.dest_offset + (k * plan.chunk) as u64, plan.chunk.min(plan.len - k * plan.chunk) as u64)
                    })
                    .collect();
                put.cut = Some(self.service.release_except(put.extent, &keep));
            }
        }
    }

    /// Chunk `part` of read `id` is back (done, or `failed`). A streamed value's landed
    /// bytes are those of every chunk before the first still in flight, while none failed.
    pub(super) fn chunk_back(&mut self, id: u32, part: usize, failed: bool) {
        if let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id) {
            plan.in_flight.remove(&part);
            plan.failed |= failed;
            if let Some(landed) = plan.landed.as_ref().filter(|_| !plan.failed) {
                let before = plan.in_flight.first().copied().unwrap_or(plan.next);
                landed.advance_to((before * plan.chunk).min(plan.len) as u64);
            }
        }
    }

    /// Posts the next chunk of read `id`, if any remain (none after a failure: the op
    /// then finishes when the chunks in flight are back).
    pub(super) fn pump_reads(&mut self, id: u32, failed: bool) {
        let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id) else {
            return;
        };
        plan.failed |= failed;
        if plan.next == plan.chunks {
            return;
        }
        if plan.failed {
            let unposted = plan.chunks - plan.next;
            plan.next = plan.chunks;
            if let Some(f) = self.ops.not_posted(id, unposted, Error::new(Status::Transport, "read abandoned")) {
                self.finished(f);
            }
            return;
        }
        let k = plan.next;
        plan.next += 1;
        plan.in_flight.insert(k);
        let (off, rail) = (k * plan.chunk, k % plan.peer.len());
        let part_len = plan.chunk.min(plan.len - off.min(plan.len));
        let (addr, key) = plan.remote[rail];
        // SAFETY: dest..dest+len is the reserved extent or the op's own buffer, untouched
        // by anyone else until the op finishes; the context lives in `ops`.
        let (dest, desc, peer) = unsafe { (plan.dest.add(off), plan.descs[rail], plan.peer[rail]) };
        let ctx = self.ops.ctx(id, k);
        let posted = unsafe { self.rails.eps[rail].read(dest, part_len, desc, peer, addr + off as u64, key, ctx) };
        if let Err(e) = posted {
            let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(id)
            else {
                return;
            };
            let unposted = plan.chunks - k;
            plan.next = plan.chunks;
            plan.failed = true;
            plan.in_flight.remove(&k);
            if let Some(f) = self.ops.not_posted(id, unposted, e) {
                self.finished(f);
            }
        }
    }

    /// Registers an owned buffer when the provider requires local registration.
    pub(super) fn local_registration(&self, ptr: *const u8, len: usize) -> Option<Vec<MemoryRegion>> {
        if !self.rails.needs_local_registration() || len == 0 {
            return None;
        }
        self.rails.register(ptr, len, RemoteAccess::None).map_err(|e| warn!("{e}")).ok()
    }
}
