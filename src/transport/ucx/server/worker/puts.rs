//! Put pulls: rendezvous receives of put values into reserved extents, committed or
//! released when they end, and cut when their client stops progressing.

use super::*;

pub(super) unsafe extern "C" fn on_put_received(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the PutInFlight box leaked in receive_put.
    unsafe {
        let p = Box::from_raw(user_data as *mut PutInFlight);
        let w = &mut *p.worker;
        let _ = catch_unwind(AssertUnwindSafe(|| w.finish_put(*p, status)));
        ucx::request_free(request);
    }
}

impl ShardWorker {
    /// Closes the endpoint of every rendezvous put past its deadline: UCX cannot cancel the
    /// receive itself, but a forced close fails it (its callback then releases the extent),
    /// and with it everything else in flight to that client, which reconnects on its next call.
    pub(super) fn cut_stalled_puts(&mut self) {
        self.reap_closed();
        let now = Instant::now();
        let cut = self.cut_puts(|p| p.deadline <= now);
        if cut > 0 {
            self.service.metrics().transfers_cut(cut as u64);
            warn!(
                "shard {}: a put made no progress before its deadline; its client's endpoint is closed",
                self.service.index()
            );
        }
    }

    /// Closes the endpoints of the puts in flight that `which` selects; returns how many
    /// endpoints were closed.
    pub(super) fn cut_puts(&mut self, which: impl Fn(&PutInFlight) -> bool) -> usize {
        // SAFETY: boxes in `puts` are alive until their receive's callback removes them.
        let doomed: Vec<(sys::ucp_ep_h, u64)> = self
            .puts
            .values()
            .map(|&p| unsafe { &*p })
            .filter(|p| which(p) && !p.reply_ep.is_null())
            .map(|p| (p.reply_ep, p.incarnation))
            .collect();
        let mut closed = 0;
        for (ep, incarnation) in doomed {
            // Several puts may share the endpoint: close it once.
            // SAFETY: as above.
            let on_ep: Vec<*mut PutInFlight> =
                self.puts.values().copied().filter(|&p| unsafe { (*p).reply_ep } == ep).collect();
            if on_ep.is_empty() {
                continue;
            }
            for p in on_ep {
                // SAFETY: as above; the endpoint is never used again once closed.
                unsafe { (*p).reply_ep = ptr::null_mut() };
            }
            // Nor by the answers deferred to it.
            self.reply_eps.fail(ep);
            // SAFETY: ep is a live endpoint (no put referred to a closed one). Closing goes
            // through the endpoint's own worker whichever `Worker` value starts it.
            if let Some(request) = unsafe { self.worker.close_ep_nb(ep) } {
                self.closing.push((request, incarnation));
            }
            closed += 1;
        }
        closed
    }

    /// Frees the close requests UCX has finished; true while some are still going.
    pub(super) fn reap_closed(&mut self) -> bool {
        // SAFETY: each request came from close_ep_nb and is freed once, here.
        self.closing.retain(|&(r, _)| unsafe { !ucx::request_done_free(r) });
        !self.closing.is_empty()
    }

    pub(super) fn receive_put(&mut self, ep: sys::ucp_ep_h, came_by: Arrival, put: PendingPut, desc: *mut c_void) {
        let dest = self.service.put_destination(&put);
        let length = put.arriving as usize;
        let key = (put.header.session, put.header.request_id);
        let deadline = service::transfer_deadline(self.stall_timeout, put.arriving);
        let pending = Box::into_raw(Box::new(PutInFlight {
            worker: self,
            incarnation: came_by.incarnation,
            reply_ep: ep,
            deadline,
            put,
            abort: None,
        }));
        // SAFETY: the extent is reserved for this transfer only (see PendingPut) until
        // finish_put runs.
        // The descriptor is received through the worker it came by, which may be a retired one.
        let started = unsafe {
            came_by.worker.am_recv_data(
                desc,
                dest,
                length,
                ucx::Memory::Host,
                Some(on_put_received),
                pending as *mut c_void,
                came_by.memh,
            )
        };
        match started {
            Ok(Started::Pending) => drop(self.puts.insert(key, pending)),
            // SAFETY: pending reclaimed once: here, or in on_put_received when pending.
            Ok(Started::Done) => self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_OK),
            Err(e) => {
                warn!("rendezvous receive failed to start: {e}");
                self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_ERR_IO_ERROR)
            }
        }
    }

    pub(super) fn finish_put(&mut self, p: PutInFlight, status: sys::ucs_status_t) {
        self.puts.remove(&(p.put.header.session, p.put.header.request_id));
        if status != sys::UCS_OK {
            debug!(
                "shard {}: rendezvous put failed ({}); slot freed",
                self.service.index(),
                ucx::status_string(status)
            );
            // A receive fails when its endpoint did (or was closed): no reply goes on it,
            // nor on any later (UCX destroys an endpoint of a failed peer it made).
            self.reply_eps.fail(p.reply_ep);
        }
        // Published only if every byte arrived while the client still wanted it: not
        // after it gave up (abort) or went away (its session revoked).
        let wanted = p.abort.is_none() && self.service.client_of(p.put.header.session).is_some();
        let client = self.service.client_of(p.put.header.session).unwrap_or(0);
        let mut m = self.take_reply();
        match self.service.finish_put(p.put, status == sys::UCS_OK && wanted, &mut m.payload) {
            Answer::Deferred(token) => {
                self.defer(token, p.reply_ep, p.incarnation, client);
                self.finish_reply(m);
            }
            Answer::Owned(header) => self.send_reply(p.reply_ep, p.incarnation, header, m, None),
            Answer::Arena { .. } => unreachable!("a put's answer carries no value"),
        }
        if let Some(abort) = p.abort {
            debug!("shard {}: put abandoned by its client; discarded", self.service.index());
            let m = self.take_reply();
            self.send_reply(p.reply_ep, p.incarnation, ReplyHeader::new(abort, crate::error::Status::Ok), m, None);
        }
    }
}
