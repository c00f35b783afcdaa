//! Completions: what a finished send, receive or one-sided read means for its request,
//! and a reply header taken in.

// The rest of the link's impl, in a file of its own: everything of the parent is in scope.
use super::*;

impl FabricLink {
    pub(super) fn progress(&mut self) -> bool {
        if self.poisoned {
            return false;
        }
        let mut done = std::mem::take(&mut self.completions);
        let any = self.rails.poll(&mut done) > 0;
        for c in done.drain(..) {
            if let Some(f) = self.ops.complete(c) {
                self.finished(f);
            }
        }
        self.completions = done;
        any
    }

    pub(super) fn finished(&mut self, f: Finished<LinkOp>) {
        let id = f.value.request;
        let Some(p) = self.pending.get_mut(&id) else { return };
        let abandoned = p.abandoned;
        match f.value.step {
            Step::Send => {
                p.sent = true;
                if let Err(e) = f.result {
                    let server = p.server;
                    let why = format!("sending to {} failed: {e}", self.servers[server].node);
                    self.fail_server(server, Status::Unavailable, why);
                }
            }
            Step::ReplyHeader => {
                p.header_op = None;
                match f.result {
                    Ok(()) => {
                        if let Some(payload_len) = accept_reply(p, f.len) {
                            // Taken out while receiving posts through `self`.
                            let mut p = self.pending.remove(&id).unwrap();
                            self.receive_payload(id, &mut p, payload_len);
                            self.pending.insert(id, p);
                        }
                    }
                    Err(e) if p.reply.is_none() => {
                        p.reply = Some(Err(Error::new(Status::Transport, format!("receiving the reply failed: {e}"))))
                    }
                    Err(_) => {}
                }
            }
            Step::ReplyData => {
                p.data_op = None;
                if let Some(Ok(r)) = &mut p.reply {
                    match f.result {
                        Ok(()) if f.len == r.len => {
                            if p.sink.is_none() {
                                // SAFETY: data_buf was allocated with room for r.len bytes
                                // (receive_payload), and its stripes' receives, none of
                                // which can overrun its own range, delivered r.len bytes
                                // in all: every byte is written.
                                unsafe { p.data_buf.set_len(r.len) };
                                r.payload = std::mem::take(&mut p.data_buf);
                            }
                        }
                        Ok(()) => {
                            p.reply = Some(Err(Error::new(
                                Status::Transport,
                                format!("reply payload of {} bytes, {} announced", f.len, r.len),
                            )))
                        }
                        Err(e) => {
                            p.reply = Some(Err(Error::new(
                                Status::Transport,
                                format!("receiving the reply payload failed: {e}"),
                            )))
                        }
                    }
                }
            }
        }
        if abandoned {
            self.release_if_abandoned(id);
        }
    }

    /// Releases request `id` once nobody waits for it and the provider holds none of its
    /// buffers any more.
    pub(super) fn release_if_abandoned(&mut self, id: u64) {
        if self.pending.get(&id).is_some_and(|p| p.abandoned && p.sent && p.header_op.is_none() && p.data_op.is_none())
        {
            let p = self.pending.remove(&id).unwrap();
            self.release(p);
        }
    }

    /// Receives a reply's payload sent as its own message, striped over the rails,
    /// straight into the sink (or a Vec).
    pub(super) fn receive_payload(&mut self, id: u64, p: &mut Pending, payload_len: usize) {
        let sink = p.sink.filter(|_| matches!(&p.reply, Some(Ok(r)) if r.header.status() == Status::Ok));
        let dest = match sink {
            Some(s) => s.ptr,
            None => {
                // Not zero-filled: the receive writes every byte before the length is set.
                p.data_buf = Vec::with_capacity(payload_len);
                p.data_buf.as_mut_ptr()
            }
        };
        let descs: Vec<_> = if self.rails.needs_local_registration() {
            match self.registration_for(dest, payload_len, RemoteAccess::None, &mut p.temp_mr) {
                Ok(d) => d.into_iter().map(|d| d.0).collect(),
                Err(e) => return p.reply = Some(Err(e)),
            }
        } else {
            vec![std::ptr::null_mut(); self.rails.eps.len()]
        };
        let parts: Vec<_> = stripes(payload_len, self.rails.eps.len()).collect();
        self.poller.expect_transfer(payload_len);
        let op = self.ops.start(LinkOp { request: id, step: Step::ReplyData }, parts.len());
        for (i, &(off, part_len)) in parts.iter().enumerate() {
            let ctx = self.ops.ctx(op, i);
            // SAFETY: dest is the caller's sink (valid until wait returns) or data_buf,
            // which the Pending owns; neither is touched until the receive completes.
            let posted = unsafe {
                self.rails.eps[i].recv(dest.add(off), part_len, descs[i], wire::DATA | (id & wire::ID_MASK), 0, ctx)
            };
            if let Err(e) = posted {
                p.reply = Some(Err(e.clone()));
                if self.ops.not_posted(op, parts.len() - i, e).is_some() {
                    return; // nothing of it in flight
                }
                break;
            }
        }
        p.data_op = Some((op, parts.len()));
    }
}

/// Takes a reply header (and inline payload) that arrived in `p.reply_buf`. Returns the
/// payload length when the payload follows as its own message.
pub(super) fn accept_reply(p: &mut Pending, len: usize) -> Option<usize> {
    let h = match ReplyHeader::decode(&p.reply_buf[..len.min(p.reply_buf.len())]) {
        Ok(h) => h,
        Err(e) => {
            p.reply = Some(Err(Error::new(Status::Transport, e)));
            return None;
        }
    };
    let payload_len = h.payload_len as usize;
    let sink = p.sink.filter(|_| h.status() == Status::Ok);
    if h.status() == Status::Ok && p.limit.is_some_and(|limit| payload_len > limit) {
        // Longer than the request takes: report its length; the server withheld it.
        p.reply = Some(Ok(Reply { header: h, payload: Vec::new(), len: payload_len, withheld: true }));
        return None;
    }
    // The worker sends the payload after the header in one message, or (longer than one
    // message takes on this provider) as its own message: the length says which.
    if len == REPLY_HEADER_LEN && payload_len > 0 {
        p.reply = Some(Ok(Reply { header: h, payload: Vec::new(), len: payload_len, withheld: false }));
        return Some(payload_len);
    }
    let bytes = &p.reply_buf[REPLY_HEADER_LEN.min(len)..len];
    p.reply = Some(if bytes.len() != payload_len {
        Err(Error::new(Status::Transport, "reply shorter than its payload length"))
    } else if let Some(s) = sink {
        // SAFETY: the sink holds at least payload_len bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.ptr, payload_len) };
        Ok(Reply { header: h, payload: Vec::new(), len: payload_len, withheld: false })
    } else {
        Ok(Reply::owned(h, bytes.to_vec()))
    });
    None
}
