//! Giving up: on a server (its requests failed, their receives cancelled) and on a
//! request whose caller stops waiting (nothing touches the caller's memory once that
//! returns).

// The rest of the link's impl, in a file of its own: everything of the parent is in scope.
use super::*;

impl FabricLink {
    /// Gives up on a server: cancels our receives still posted for its requests, waits
    /// briefly for the provider to hand their buffers back, and fails those requests.
    /// After a timeout (the server is alive but slow, or stalled) the receives of
    /// abandoned requests stay posted, so that their replies are still taken (see
    /// `forget_request`).
    pub(super) fn fail_server(&mut self, server: usize, status: Status, why: String) {
        if self.servers[server].dead.is_none() {
            self.servers[server].dead = Some(why.clone());
        }
        let keep_abandoned = status == Status::Timeout;
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.server == server && !(keep_abandoned && p.abandoned))
            .map(|(id, _)| *id)
            .collect();
        self.cancel_receives(&ids);
        for id in ids {
            if self.pending.get(&id).is_some_and(|p| p.abandoned) {
                self.discard(id);
                continue;
            }
            if let Some(fresh) = self.retire(id) {
                self.pending.insert(id, fresh);
            }
            if let Some(p) = self.pending.get_mut(&id) {
                if !matches!(p.reply, Some(Ok(_))) {
                    p.reply = Some(Err(Error::new(status, why.clone())));
                }
            }
        }
    }

    /// Cancels the receives still posted for requests `ids` and waits briefly for the
    /// provider to hand their buffers back.
    pub(super) fn cancel_receives(&mut self, ids: &[u64]) {
        for id in ids {
            let Some(p) = self.pending.get(id) else { continue };
            if let Some(op) = p.header_op {
                self.rails.eps[0].cancel(self.ops.ctx(op, 0));
            }
            if let Some((op, parts)) = p.data_op {
                for part in 0..parts {
                    self.rails.eps[part].cancel(self.ops.ctx(op, part));
                }
            }
        }
        let deadline = Instant::now() + CANCEL_DRAIN;
        while Instant::now() < deadline
            && ids.iter().any(|id| self.pending.get(id).is_some_and(|p| p.header_op.is_some() || p.data_op.is_some()))
        {
            self.progress();
        }
    }

    /// When the provider still holds request `id`'s buffers (a receive not returned, or a
    /// send to a dead peer not completed), takes it out: its registrations are closed (the
    /// caller's memory must not stay readable once the call returns), its own buffers are
    /// leaked rather than reused, and a receive into the caller's buffer that could not be
    /// cancelled closes the endpoints, so nothing can write there any more. Returns a
    /// fresh entry to answer the caller from; None when nothing was held.
    pub(super) fn retire(&mut self, id: u64) -> Option<Box<Pending>> {
        let p = self.pending.get(&id)?;
        if p.header_op.is_none() && p.data_op.is_none() && p.sent {
            return None;
        }
        let mut stale = self.pending.remove(&id).unwrap();
        for mrs in stale.temp_mr.drain(..) {
            self.rails.deregister(mrs);
        }
        if stale.data_op.is_some() && stale.sink.is_some() {
            // A receive into the caller's buffer that neither completed nor could be
            // cancelled. Closing the endpoint under it crashes libfabric 1.17 (rxm), so
            // nothing here progresses these endpoints again: the link is given up whole
            // and its endpoints are never closed or driven (leaked with it).
            tracing::warn!("a reply into the caller's buffer could not be cancelled: this connection is given up (its endpoints are left alone)");
            self.poisoned = true;
            for s in &mut self.servers {
                s.dead.get_or_insert_with(|| "a reply could not be cancelled; connection given up".into());
            }
        }
        let server = stale.server;
        std::mem::forget(stale);
        let mut fresh = self.take_pending(server);
        fresh.sent = true;
        Some(fresh)
    }

    /// Takes request `id` out for good, after its receives were cancelled: released when
    /// the provider holds none of its buffers, else retired (see `retire`).
    pub(super) fn discard(&mut self, id: u64) {
        match self.retire(id) {
            Some(fresh) => self.pool.push(fresh),
            None => {
                if let Some(p) = self.pending.remove(&id) {
                    self.release(p);
                }
            }
        }
    }

    /// Drops request `id`, which nobody waits for any more. Once this returns nothing is
    /// written into the caller's buffer. What the server still sends for it is received
    /// into our own buffers and dropped, not left unanswered: libfabric shm's sender of a
    /// large message waits for the receiver's answer in one in-order queue, and a reply
    /// left there made the server replace its endpoints once we went (which costs every
    /// one of its clients a failed call).
    pub(super) fn forget_request(&mut self, id: u64) {
        // A receive into the caller's buffer that already matched cannot be cancelled;
        // while its server lives it completes: let it, for up to the abort grace.
        let deadline = Instant::now() + ABORT_GRACE;
        while Instant::now() < deadline
            && self.pending.get(&id).is_some_and(|p| p.data_op.is_some() && p.sink.is_some())
            && !self.poisoned
        {
            if !self.progress() {
                std::thread::yield_now();
            }
        }
        if self.pending.get(&id).is_some_and(|p| p.remote_payload) {
            // A put whose value the worker read from the caller's memory (its reply is a
            // small one): its registration closes now, and nothing of it is driven again.
            self.cancel_receives(&[id]);
            return self.discard(id);
        }
        let Some(p) = self.pending.get_mut(&id) else { return };
        p.abandoned = true;
        // A payload still to come goes into our own buffer from now on.
        let into_sink = p.sink.take().is_some() && p.data_op.is_some();
        let payload_len = match &p.reply {
            Some(Ok(r)) => r.len,
            _ => 0,
        };
        if into_sink {
            self.cancel_receives(&[id]);
            if self.pending.get(&id).is_some_and(|p| p.data_op.is_some()) {
                // Neither completed nor cancelled: only closing the link ends it.
                return self.discard(id);
            }
        }
        let Some(mut p) = self.pending.remove(&id) else { return };
        if into_sink {
            // The caller's buffer is registered no longer (nothing is posted into it).
            for mrs in p.temp_mr.drain(..) {
                self.rails.deregister(mrs);
            }
        }
        if into_sink && matches!(p.reply, Some(Err(_))) && !self.poisoned {
            // Cancelled before it matched: the payload is still on its way.
            self.receive_payload(id, &mut p, payload_len);
        }
        self.pending.insert(id, p);
        self.release_if_abandoned(id);
    }

    /// Ends request `id` for a caller who stops waiting, so that once this returns nothing
    /// reads or writes the caller's memory again. A payload the worker may still be
    /// reading is aborted: the worker answers once its reads are back, and discards the
    /// value; then its registration is closed. A reply receive into the caller's buffer is
    /// cancelled. What the server does not confirm within [`ABORT_GRACE`] is cut off:
    /// the server is given up on and the registration closed regardless.
    pub(super) fn give_up(&mut self, id: u64, err: Error) -> Error {
        let Some(p) = self.pending.get(&id) else { return err };
        let (server, shard) = (p.server, p.shard);
        // A payload the worker may still read, or a reply payload it still sends from a
        // pinned extent (which it releases on the abort).
        let in_flight = (p.remote_payload && p.reply.is_none()) || p.data_op.is_some();
        if in_flight && self.servers[server].dead.is_none() {
            let (abort_id, header) = abort_request(id, &p.msg);
            let mut a = self.take_pending(server);
            a.msg.extend_from_slice(&header);
            let confirmed = self.post(abort_id, a, shard, wire::REQUEST).is_ok() && {
                let deadline = Instant::now() + ABORT_GRACE;
                let settled =
                    |l: &Self| [id, abort_id].iter().any(|i| l.pending.get(i).is_some_and(|p| p.reply.is_some()));
                while !settled(self) && Instant::now() < deadline && self.servers[server].dead.is_none() {
                    if !self.progress() {
                        std::thread::yield_now();
                    }
                }
                settled(self)
            };
            self.forget_request(abort_id);
            if !confirmed {
                let why =
                    format!("{} did not confirm the abort of a timed-out request; given up", self.servers[server].node);
                self.fail_server(server, Status::Timeout, why);
            }
        }
        // Its receives (maybe into the caller's buffer) are cancelled, its registration closed.
        self.forget_request(id);
        // As over UCX: the next call connects again.
        if self.servers[server].dead.is_none() {
            let why = format!("{} did not answer in time; the next call reconnects", self.servers[server].node);
            self.fail_server(server, Status::Timeout, why);
        }
        err
    }
}
