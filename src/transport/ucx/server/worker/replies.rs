//! Replies: pooled reply boxes, sends from the arena with the extent pinned until they end,
//! the per-client backlog they count in, and what departed clients' replies leave behind.

use super::*;

/// Bytes of the arena a reply is sent from, and the arena's mapping on the worker that sends.
#[derive(Clone, Copy)]
pub(super) struct ArenaSlice {
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) extent: u64,
    pub(super) memh: sys::ucp_mem_h,
}

pub(super) unsafe extern "C" fn on_reply_sent(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the ReplyMsg box leaked in send_reply for this pending send.
    unsafe {
        let m = Box::from_raw(user_data as *mut ReplyMsg);
        let w = &mut *m.worker;
        // A reply to a departed client was counted out when it left.
        if w.orphans.remove(&m.key()).is_none() {
            w.replies_in_flight.remove(m.incarnation);
        }
        w.sending.remove(&m.key());
        // Zero for a reply to a departed client (discharged when it left).
        w.backlog.discharge(m.client, m.charged);
        w.finish_reply(m);
        ucx::request_free(request);
    }
}

impl ShardWorker {
    pub(super) fn take_reply(&mut self) -> Box<ReplyMsg> {
        let me = self as *mut ShardWorker;
        let mut m = self.reply_pool.pop().unwrap_or_else(|| {
            Box::new(ReplyMsg {
                worker: me,
                header: [0; REPLY_HEADER_LEN],
                header_len: 0,
                payload: Vec::new(),
                pinned: None,
                client: 0,
                charged: 0,
                incarnation: 0,
            })
        });
        m.payload.clear();
        m.pinned = None;
        m.client = 0;
        m.charged = 0;
        m
    }

    pub(super) fn finish_reply(&mut self, mut m: Box<ReplyMsg>) {
        if let Some(extent) = m.pinned.take() {
            self.service.unpin(extent);
        }
        if m.payload.capacity() > 1 << 20 {
            m.payload = Vec::new();
        }
        self.reply_pool.push(m);
    }

    /// Watches a client's endpoint that UCX made, to hear when it drops it.
    pub(super) fn watch_ep(&mut self, ep: sys::ucp_ep_h) {
        // SAFETY: UCX handed ep to the request callback running now (it is live), on a
        // worker of this shard (made by `Worker::serving`), on its thread.
        if let Err(e) = unsafe { ucx::ep_watch::watch(ep, &self.lost_eps) } {
            debug!(
                "shard {}: cannot watch a client's endpoint ({}); nothing is sent on it later",
                self.service.index(),
                e.message
            );
            self.reply_eps.fail(ep);
        }
    }

    /// Takes the endpoints UCX dropped into `reply_eps`, before a reply goes on an endpoint
    /// kept from an earlier callback.
    pub(super) fn absorb_lost_eps(&mut self) {
        for ep in self.lost_eps.take() {
            self.reply_eps.lost(ep);
        }
    }

    /// Sends a reply on `ep` of worker `incarnation`. `arena`: bytes of the arena to send
    /// instead of the owned payload.
    pub(super) fn send_reply(
        &mut self,
        ep: sys::ucp_ep_h,
        incarnation: u64,
        header: ReplyHeader,
        mut m: Box<ReplyMsg>,
        arena: Option<ArenaSlice>,
    ) {
        self.absorb_lost_eps();
        if ep.is_null() || self.reply_eps.failed(ep) {
            self.finish_reply(m);
            return;
        }
        let sent = arena.map_or(m.payload.len(), |a| a.len as usize);
        m.header_len = header.encode_compact(sent, &mut m.header);
        m.incarnation = incarnation;
        let raw = Box::into_raw(m);
        // SAFETY: header and payload live in the box (heap, stable while leaked) or the
        // arena (pinned below while in flight), untouched until the completion; ep is the
        // reply endpoint UCX gave us.
        let started = unsafe {
            let (payload, memh): (&[u8], _) = match arena {
                Some(a) => (self.service.arena().slice(a.offset, a.len), a.memh),
                None => ((*raw).payload.as_slice(), ptr::null_mut()),
            };
            let header = &(&(*raw).header)[..(*raw).header_len];
            self.worker.am_send(
                ep,
                proto::AM_REPLY,
                header,
                (payload.as_ptr(), payload.len(), ucx::Memory::Host),
                0,
                Some(on_reply_sent),
                raw as *mut c_void,
                memh,
            )
        };
        // SAFETY: raw came from Box::into_raw above and is reclaimed exactly once: here when
        // the send finished (or failed) inside the call, else in on_reply_sent.
        match started {
            Ok(Started::Pending) => {
                self.replies_in_flight.add(incarnation);
                // SAFETY: raw is the live box leaked above, owned by the pending send.
                let (client, owned) = unsafe { ((*raw).client, (*raw).payload.len() as u64) };
                if client != 0 {
                    self.backlog.charge(client, owned);
                    // SAFETY: as above.
                    unsafe { (*raw).charged = owned };
                }
                self.sending.insert(raw as usize, client);
                if let Some(ArenaSlice { extent, .. }) = arena {
                    self.service.pin(extent);
                    // SAFETY: raw is the live box leaked above, owned by the pending send.
                    unsafe { (*raw).pinned = Some(extent) };
                }
            }
            Ok(Started::Done) => self.finish_reply(unsafe { Box::from_raw(raw) }),
            Err(e) => {
                debug!("reply not sent: {e}");
                // The endpoint failed: UCX may destroy it at any time now.
                self.reply_eps.fail(ep);
                self.finish_reply(unsafe { Box::from_raw(raw) })
            }
        }
    }

    /// Sends what the service answered to a request that `came_by`; `m.payload` holds its
    /// owned bytes.
    pub(super) fn answer(&mut self, ep: sys::ucp_ep_h, came_by: Arrival, answer: Answer, m: Box<ReplyMsg>) {
        match answer {
            Answer::Deferred(token) => {
                self.defer(token, ep, came_by.incarnation, m.client);
                self.finish_reply(m);
            }
            Answer::Owned(header) => self.send_reply(ep, came_by.incarnation, header, m, None),
            Answer::Arena { header, offset, len, extent } => self.send_reply(
                ep,
                came_by.incarnation,
                header,
                m,
                Some(ArenaSlice { offset, len, extent, memh: came_by.memh }),
            ),
        }
    }

    /// Keeps where the answer under `token` goes until its copies end.
    pub(super) fn defer(&mut self, token: u64, ep: sys::ucp_ep_h, incarnation: u64, client: u64) {
        self.deferred.insert(token, DeferredReply { ep, incarnation, client });
    }

    pub(super) fn reply_error(&mut self, ep: sys::ucp_ep_h, incarnation: u64, request_id: u64, err: &Error) {
        let mut m = self.take_reply();
        let header = service::error_reply(request_id, err, &mut m.payload);
        self.send_reply(ep, incarnation, header, m, None);
    }

    /// Releases what departed clients held. A reply being sent to one from a pinned
    /// extent may never complete (over shared memory the client itself pulls the bytes,
    /// and it is gone): its extent is unpinned now; the send's box stays UCX's.
    pub(super) fn forget_departed(&mut self) {
        let departed = self.service.take_departed();
        if departed.is_empty() {
            return;
        }
        self.freed.freed();
        let incarnation = self.incarnation;
        self.stranded += self.reply_eps.departed(&departed).into_iter().filter(|&g| g == incarnation).count();
        if self.stranded > 0 && self.stranded_since.is_none() {
            self.stranded_since = Some(Instant::now());
        }
        self.deferred.retain(|_, d| !departed.contains(&d.client));
        for client in departed {
            self.backlog.forget(client);
            let sends: Vec<usize> = self.sending.iter().filter(|(_, &c)| c == client).map(|(&m, _)| m).collect();
            for m in sends {
                self.orphan(m);
            }
        }
    }

    /// Gives up on the reply in box `m` (in `sending`): its send may never end (a departed
    /// shared-memory client pulls the bytes itself, or the worker stops), so its extent is
    /// unpinned and its bytes uncharged now, and it keeps no worker from being destroyed.
    /// The box stays UCX's until its callback, or until its worker is destroyed
    /// ([`ShardWorker::reclaim_orphans`], or [`Orphans`]' drop when the shard stops).
    pub(super) fn orphan(&mut self, m: usize) {
        let Some(client) = self.sending.remove(&m) else { return };
        // SAFETY: boxes in `sending` are alive until their send's callback, which removes
        // them from `sending` (or `orphans`) first.
        let msg = unsafe { &mut *(m as *mut ReplyMsg) };
        if let Some(extent) = msg.pinned.take() {
            self.service.unpin(extent);
        }
        self.backlog.discharge(client, std::mem::take(&mut msg.charged));
        self.replies_in_flight.remove(msg.incarnation);
        self.orphans.insert(m, msg.incarnation);
    }
}

/// Replies given up on ([`ShardWorker::orphan`]), by box address -> worker incarnation.
/// Declared after the UCX workers in [`ShardWorker`]: those left when the shard stops are
/// freed once every worker is destroyed, when no callback of theirs can come any more.
#[derive(Default)]
pub(super) struct Orphans(HashMap<usize, u64>);

impl std::ops::Deref for Orphans {
    type Target = HashMap<usize, u64>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Orphans {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Orphans {
    fn drop(&mut self) {
        for (m, _) in self.0.drain() {
            // SAFETY: an orphan's box is owned by its send until the callback, which never
            // comes now that the workers are destroyed (fields dropped before this one).
            drop(unsafe { Box::from_raw(m as *mut ReplyMsg) });
        }
    }
}
