//! The UCX callbacks of the link: a send completed, an endpoint failed, a reply (or its
//! rendezvous data) arrived.

// The rest of the link's code, in a file of its own: everything of the parent is in scope.
use super::*;

pub(super) unsafe extern "C" fn on_sent(request: *mut c_void, _status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the boxed Pending of this send, alive until `wait` sees `sent`.
    unsafe {
        // A failed send also surfaces through the endpoint error callback, which fails the request.
        (*(user_data as *mut Pending)).sent = true;
        ucx::request_free(request);
    }
}

pub(super) unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: arg is the EpTag registered with this endpoint, alive while the ep is open.
    unsafe {
        let tag = &*(arg as *const EpTag);
        let state = &mut *tag.state;
        if state.failed[tag.server].is_none() {
            state.failed[tag.server] = Some(ucx::status_string(status));
        }
    }
}

pub(super) unsafe extern "C" fn on_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: arg is the boxed State registered in connect(); called on the client's thread
    // from progress. header/data are valid for the call (data is a descriptor if rendezvous).
    unsafe {
        let state = &mut *(arg as *mut State);
        let header = ucx::am_header(header, header_length);
        let info = ucx::am_info(param);
        catch_unwind(AssertUnwindSafe(|| {
            let h = match ReplyHeader::decode_compact(header, length) {
                Ok(h) => h,
                Err(_) => return sys::UCS_OK, // not ours to answer; drop it
            };
            let Some(p) = state.pending.get_mut(&h.request_id) else { return sys::UCS_OK };
            if p.reply.is_some() {
                return sys::UCS_OK;
            }
            if h.status() == Status::Ok && p.limit.is_some_and(|limit| length > limit) {
                // Longer than the request takes: report its length; it stays on the server.
                p.reply = Some(Ok(Reply { header: h, payload: Vec::new(), len: length, withheld: true }));
                return sys::UCS_OK;
            }
            let sink = p.sink.filter(|_| h.status() == Status::Ok);
            let (dest, buf) = match sink {
                // Eager data into device memory: handed back for the caller to copy in
                // with the GPU (the CPU cannot write device memory).
                Some(sink) if !sink.device || info.rendezvous => (sink.ptr, Vec::new()),
                _ if !info.rendezvous => {
                    let payload = if length == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(data as *const u8, length).to_vec()
                    };
                    p.reply = Some(Ok(Reply::owned(h, payload)));
                    return sys::UCS_OK;
                }
                _ => {
                    let mut buf = Vec::<u8>::with_capacity(length);
                    (buf.as_mut_ptr(), buf)
                }
            };
            p.reply = Some(Ok(Reply { header: h, payload: buf, len: length, withheld: false }));
            if !info.rendezvous {
                if length > 0 {
                    // SAFETY: eager data holds `length` bytes; the sink holds at least as many.
                    ptr::copy_nonoverlapping(data as *const u8, dest, length);
                }
                return sys::UCS_OK;
            }
            p.receiving = true;
            let tag = Box::into_raw(Box::new(RecvTag { state, id: h.request_id }));
            // SAFETY: dest is the caller's sink or the Vec now owned by the pending reply; it is
            // neither read nor freed while `receiving` is set (fail_server closes the endpoint
            // first, which completes this receive).
            let (memory, memh) = match sink {
                Some(sink) if sink.device => (state.device_memory, ptr::null_mut()),
                _ => (Memory::Host, state.memh_for(dest, length)),
            };
            match (*state.worker).handle().am_recv_data(
                data,
                dest,
                length,
                memory,
                Some(on_reply_data),
                tag as *mut c_void,
                memh,
            ) {
                Ok(Started::Pending) => {}
                Ok(Started::Done) => finish_recv(*Box::from_raw(tag), sys::UCS_OK, length),
                Err(_) => finish_recv(*Box::from_raw(tag), sys::UCS_ERR_IO_ERROR, 0),
            }
            sys::UCS_OK
        }))
        .unwrap_or(sys::UCS_OK)
    }
}

unsafe fn finish_recv(tag: RecvTag, status: sys::ucs_status_t, length: usize) {
    // SAFETY: UCX calls this on the client's thread, inside progress, with the arguments its callback type documents; the user pointers are the boxes registered with the operation (see each step).
    unsafe {
        let state = &mut *tag.state;
        let Some(p) = state.pending.get_mut(&tag.id) else { return };
        if !p.receiving {
            return;
        }
        p.receiving = false;
        if status == sys::UCS_OK {
            if let Some(Ok(r)) = &mut p.reply {
                if p.sink.is_none() {
                    // SAFETY: UCX wrote `length` bytes (the capacity) into the buffer.
                    r.payload.set_len(length);
                }
                r.len = length;
            }
        } else {
            p.reply = Some(Err(Error::new(
                Status::Transport,
                format!("receiving the reply failed: {}", ucx::status_string(status)),
            )));
        }
    }
}

pub(super) unsafe extern "C" fn on_reply_data(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the RecvTag leaked in on_reply for this receive.
    unsafe {
        finish_recv(*Box::from_raw(user_data as *mut RecvTag), status, length);
        ucx::request_free(request);
    }
}
