//! Replies: pooled reply buffers, large values sent from the arena striped over the rails
//! with their extent pinned, the per-client backlog they count in, and a client's aborts.

use super::*;

impl FabricShardWorker {
    pub(super) fn take_reply_buf(&mut self) -> ReplyBuf {
        self.reply_pool.pop().unwrap_or_else(|| {
            let bytes = Vec::with_capacity(wire::REPLY_MSG_MAX);
            let mr = self.local_registration(bytes.as_ptr(), wire::REPLY_MSG_MAX);
            ReplyBuf { bytes, mr }
        })
    }

    /// Sends an answer to a client (if it still holds its slot): owned payload bytes are
    /// in `self.scratch`. `capacity`: the most payload the client can take (a get into a
    /// caller's buffer).
    pub(super) fn reply(&mut self, to: Client, answer: Answer, capacity: Option<u64>) {
        if let Answer::Deferred(token) = answer {
            // Answered once its copies end (`answer_copied`).
            self.deferred.insert(token, to);
            return;
        }
        let slot = to.slot;
        let Some(peer0) =
            self.peers.get(slot as usize).and_then(|p| p.as_ref()).filter(|p| p.client_id == to.id).map(|p| p.addrs[0])
        else {
            return;
        };
        if self.unresponsive.contains(&to.id) {
            return debug!("shard {}: reply to unresponsive client {} dropped", self.service.index(), to.id);
        }
        let (mut header, arena) = match answer {
            Answer::Owned(h) => (h, None),
            Answer::Arena { header, offset, len, extent } => (header, Some((offset, len, extent))),
            Answer::Deferred(_) => unreachable!("kept above"),
        };
        let payload_len = arena.map_or(self.scratch.len() as u64, |a| a.1);
        header.payload_len = payload_len;
        let inline = REPLY_HEADER_LEN as u64 + payload_len <= self.rails.one_message_max(wire::REPLY_MSG_MAX) as u64;
        let mut msg = self.take_reply_buf();
        msg.bytes.clear();
        msg.bytes.extend_from_slice(&header.encode());
        if inline {
            match arena {
                Some((offset, len, _)) => msg.bytes.extend_from_slice(self.service.arena().slice(offset, len)),
                None => msg.bytes.extend_from_slice(&self.scratch),
            }
        }
        let tag = wire::REPLY | (header.request_id & wire::ID_MASK);
        // Messages up to the inject size are copied by the provider before the call
        // returns: nothing of them stays in flight, and no completion follows.
        let inject_size = self.rails.eps[0].inject_size;
        if msg.bytes.len() <= inject_size {
            let sent = self.rails.eps[0].inject(&msg.bytes, peer0, tag);
            self.reply_pool.push(msg);
            if let Err(e) = sent {
                debug!("shard {}: reply not sent: {e}", self.service.index());
                return self.note_unresponsive(to.id, &e);
            }
        } else {
            let desc = msg.mr.as_ref().map_or(std::ptr::null_mut(), |m| m[0].desc);
            let (ptr, len) = (msg.bytes.as_ptr(), msg.bytes.len());
            self.backlog.charge(to.id, len as u64);
            let id = self.ops.start(WorkerOp::Reply { msg, owner: to.id, charged: len as u64 }, 1);
            let ctx = self.ops.ctx(id, 0);
            // SAFETY: the bytes live in the ReplyBuf's heap buffer, owned by the op until completion.
            if let Err(e) = unsafe { self.rails.eps[0].send(ptr, len, desc, peer0, tag, ctx) } {
                debug!("shard {}: reply not sent: {e}", self.service.index());
                self.note_unresponsive(to.id, &e);
                if let Some(f) = self.ops.not_posted(id, 1, e) {
                    self.finished(f);
                }
                return;
            }
        }
        if inline || capacity.is_some_and(|c| payload_len > c) {
            return; // all sent, or withheld: the client's buffer is too small
        }
        let data_tag = wire::DATA | (header.request_id & wire::ID_MASK);
        if payload_len as usize <= inject_size {
            // One message on the first rail, as `stripes` gives a payload this short.
            let bytes = match arena {
                Some((offset, len, _)) => self.service.arena().slice(offset, len),
                None => &self.scratch[..],
            };
            if let Err(e) = self.rails.eps[0].inject(bytes, peer0, data_tag) {
                debug!("shard {}: reply data not sent: {e}", self.service.index());
                self.note_unresponsive(to.id, &e);
            }
            return;
        }
        let peer = self.peers[slot as usize].as_ref().map(|p| p.addrs.clone()).unwrap_or_default();
        let (ptr, descs, value) = match arena {
            Some((offset, len, extent)) => {
                self.service.pin(extent);
                let ptr = self.service.arena().slice(offset, len).as_ptr();
                (
                    ptr,
                    self.arena_mr.iter().map(|m| m.desc).collect::<Vec<_>>(),
                    WorkerOp::Data {
                        pinned: Some(extent),
                        key: (to.id, header.request_id),
                        _owned: Vec::new(),
                        temp_mr: None,
                        owner: to.id,
                        charged: 0,
                    },
                )
            }
            None => {
                let owned = std::mem::take(&mut self.scratch);
                let temp_mr = self.local_registration(owned.as_ptr(), owned.len());
                let descs = temp_mr
                    .as_ref()
                    .map_or(vec![std::ptr::null_mut(); peer.len()], |m| m.iter().map(|r| r.desc).collect());
                let charged = owned.len() as u64;
                (
                    owned.as_ptr(),
                    descs,
                    WorkerOp::Data {
                        pinned: None,
                        key: (to.id, header.request_id),
                        _owned: owned,
                        temp_mr,
                        owner: to.id,
                        charged,
                    },
                )
            }
        };
        let parts: Vec<_> = stripes(payload_len as usize, peer.len()).collect();
        let pins = matches!(value, WorkerOp::Data { pinned: Some(_), .. });
        if let WorkerOp::Data { charged, .. } = &value {
            self.backlog.charge(to.id, *charged);
        }
        let id = self.ops.start(value, parts.len());
        self.sent_payload += payload_len as usize;
        if pins {
            self.sends.insert((to.id, header.request_id), id);
        }
        for (p, &(off, part_len)) in parts.iter().enumerate() {
            let ctx = self.ops.ctx(id, p);
            // SAFETY: pinned arena bytes or the op's owned Vec, unchanged until completion.
            if let Err(e) = unsafe { self.rails.eps[p].send(ptr.add(off), part_len, descs[p], peer[p], data_tag, ctx) }
            {
                debug!("shard {}: reply data not sent: {e}", self.service.index());
                self.note_unresponsive(to.id, &e);
                if let Some(f) = self.ops.not_posted(id, parts.len() - p, e) {
                    self.finished(f);
                }
                return;
            }
        }
    }

    /// Whether a message too large to be copied inline is on its way to `client` over
    /// libfabric's shm (whose sender then waits for the receiver's answer).
    /// Sends the answers of writes whose copies ended; true if there were any.
    pub(super) fn answer_copied(&mut self) -> bool {
        let mut any = false;
        let mut out = std::mem::take(&mut self.scratch);
        while let Some((token, header)) = self.service.next_copied(&mut out) {
            any = true;
            if let Some(to) = self.deferred.remove(&token) {
                self.scratch = std::mem::take(&mut out);
                self.reply(to, Answer::Owned(header), None);
                out = std::mem::take(&mut self.scratch);
            }
        }
        self.scratch = out;
        any
    }

    pub(super) fn large_sends_to(&self, client: u64) -> bool {
        let inject = self.rails.eps[0].inject_size;
        self.rails.provider() == "shm"
            && self.ops.values().any(|op| match op {
                WorkerOp::Data { owner, .. } => *owner == client,
                WorkerOp::Reply { msg, owner, .. } => *owner == client && msg.bytes.len() > inject,
                _ => false,
            })
    }

    /// Answers an abort, now that nothing of the request it names reads client memory.
    pub(super) fn confirm_abort(&mut self, to: Client, abort: Option<u64>) {
        if let Some(id) = abort {
            debug!("shard {}: request abandoned by its client; discarded", self.service.index());
            self.scratch.clear();
            self.reply(to, Answer::Owned(ReplyHeader::new(id, Status::Ok)), None);
        }
    }

    /// A reply payload its client will never receive (it gave up on the request, or left):
    /// the send may stay posted for good (shm never fails it), so its extent is unpinned
    /// now. Only that client could still match the send, and it cancelled its receive.
    pub(super) fn orphan_send(&mut self, client: u64, request: u64) {
        let Some(op) = self.sends.remove(&(client, request)) else { return };
        if let Some(WorkerOp::Data { pinned, .. }) = self.ops.value_mut(op) {
            if let Some(extent) = pinned.take() {
                self.service.unpin(extent);
            }
        }
    }

    /// The client gave up on request `target`: stop reading its payload; the abort is
    /// answered when the reads in flight are back (at once if none are).
    pub(super) fn abort(&mut self, to: Client, abort_id: u64, target: u64) {
        self.orphan_send(to.id, target);
        if let Some(&op) = self.reads.get(&(to.id, target)) {
            if let Some(WorkerOp::ReadPut { plan, .. } | WorkerOp::ReadPayload { plan, .. }) = self.ops.value_mut(op) {
                plan.abort = Some(abort_id);
                plan.failed = true;
                return;
            }
        }
        self.scratch.clear();
        self.reply(to, Answer::Owned(ReplyHeader::new(abort_id, Status::Ok)), None);
    }
}
