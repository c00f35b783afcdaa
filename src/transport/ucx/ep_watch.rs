//! Hearing that UCX dropped an endpoint it made for a peer.
//!
//! A server answers on the endpoint a request came by, which UCX made when the client
//! connected. When UCX sees that peer fail it destroys such an endpoint at once
//! (`ucp_ep_set_failed`: "destroy endpoint which is not exposed to a user") and calls no
//! error callback, since no one asked for one; a reply sent on it later (a write answered
//! once its copies end) uses freed memory. UCX does complete the endpoint's stream
//! receives, with the failure, right before it destroys the endpoint (and with
//! `UCS_ERR_CANCELED` whenever else it destroys one: a close, the worker's destruction).
//! So each such endpoint gets one stream receive that no peer of ours ever fills; its
//! callback says the endpoint is gone. The worker needs `UCP_FEATURE_STREAM`
//! ([`super::Worker::serving`]).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::sys::*;
use super::{ptr_status, status_string};
use crate::error::{Error, Result, Status};

/// The endpoints UCX dropped since they were last taken, by address.
#[derive(Default)]
pub struct LostEps {
    any: AtomicBool,
    eps: Mutex<Vec<usize>>,
}

impl LostEps {
    /// Takes the endpoints lost so far (cheap when there are none).
    pub fn take(&self) -> Vec<usize> {
        if !self.any.load(Ordering::Acquire) || !self.any.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.eps.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push(&self, ep: usize) {
        self.eps.lock().unwrap_or_else(|p| p.into_inner()).push(ep);
        self.any.store(true, Ordering::Release);
    }
}

/// One watch: owned by its pending receive, freed by the callback that ends it.
struct Watch {
    lost: Arc<LostEps>,
    ep: ucp_ep_h,
    /// Where stray stream bytes land (our clients send none; a client that does only has
    /// them dropped).
    scratch: [u8; 64],
}

/// Starts watching `ep`: `lost` hears of it once UCX drops it.
///
/// # Safety
/// `ep` is a live endpoint of a worker made by [`super::Worker::serving`], used on that
/// worker's thread.
pub unsafe fn watch(ep: ucp_ep_h, lost: &Arc<LostEps>) -> Result<()> {
    let watch = Box::into_raw(Box::new(Watch { lost: lost.clone(), ep, scratch: [0; 64] }));
    // SAFETY: watch is the live box leaked above; ep as the caller promises.
    match unsafe { post(watch) } {
        Ok(()) => Ok(()),
        Err(e) => {
            // SAFETY: no receive took the box: it is ours to free.
            drop(unsafe { Box::from_raw(watch) });
            Err(e)
        }
    }
}

/// Posts the watch's receive; bytes already buffered are dropped and it posts again, until
/// a receive stays pending (it then owns the box).
///
/// # Safety
/// `watch` is a live box from [`watch`], not owned by a pending receive.
unsafe fn post(watch: *mut Watch) -> Result<()> {
    loop {
        let param = ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            cb: ucp_request_param_t__bindgen_ty_1 { recv_stream: Some(on_watch_ended) },
            user_data: watch as *mut c_void,
            ..Default::default()
        };
        let mut length = 0usize;
        // SAFETY: the scratch buffer lives in the box, which the pending receive owns until
        // its callback; ep and the thread as the caller promises.
        let request = unsafe {
            ucp_stream_recv_nbx((*watch).ep, (*watch).scratch.as_mut_ptr() as *mut c_void, 64, &mut length, &param)
        };
        if request.is_null() {
            continue; // stray bytes taken at once: drop them and post again
        }
        if let Some(status) = ptr_status(request) {
            return Err(Error::new(Status::Transport, format!("ucp_stream_recv_nbx: {}", status_string(status))));
        }
        return Ok(());
    }
}

unsafe extern "C" fn on_watch_ended(
    request: *mut c_void,
    status: ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    let watch = user_data as *mut Watch;
    // SAFETY: UCX hands back the request it created for the box leaked in `watch`; the
    // request is freed once, here, and the box once: here, or by the next receive.
    unsafe {
        ucp_request_free(request);
        if status == UCS_OK && post(watch).is_ok() {
            return; // stray bytes: dropped, and the next receive owns the box
        }
        let watch = Box::from_raw(watch);
        watch.lost.push(watch.ep as usize);
    }
}
