//! Posting operations on an endpoint: sends, receives and one-sided reads and writes,
//! each retried while the provider takes nothing (`retry_on_eagain`), and giving up on a
//! peer that stopped making progress or is gone.

use std::os::raw::c_void;
use std::ptr;

use super::{check, sys, Endpoint, OpContext, PeerAddr, POST_NAP, POST_SPIN};
use crate::error::{Error, Result, Status};

impl Endpoint {
    /// Posts a tagged send.
    ///
    /// # Safety
    /// `buf..buf+len` and `ctx` must stay valid and unmoved until `ctx`'s completion.
    pub unsafe fn send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        peer: PeerAddr,
        tag: u64,
        ctx: *mut OpContext,
    ) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract.
        unsafe { self.send_unless(buf, len, desc, peer, tag, ctx, &|| false) }
    }

    /// [`Endpoint::send`], giving up as soon as `peer_gone` says the peer is gone while
    /// the provider takes nothing (see `retry_on_eagain`).
    ///
    /// # Safety
    /// As for [`Endpoint::send`].
    #[allow(clippy::too_many_arguments)] // fi_tsend's own, and the watch
    pub unsafe fn send_unless(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        peer: PeerAddr,
        tag: u64,
        ctx: *mut OpContext,
        peer_gone: &dyn Fn() -> bool,
    ) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract (buffers and context valid until the completion).
        unsafe {
            self.retry_on_eagain(
                "fi_tsend",
                || sys::rdram_fi_tsend(self.ep, buf.cast(), len, desc, peer, tag, ctx.cast()),
                peer_gone,
            )
        }
    }

    /// Sends a message of at most [`Endpoint::inject_size`] bytes, copied before this
    /// returns: no completion follows, and `buf` is free again at once.
    pub fn inject(&self, buf: &[u8], peer: PeerAddr, tag: u64) -> Result<()> {
        self.inject_unless(buf, peer, tag, &|| false)
    }

    /// [`Endpoint::inject`], giving up as soon as `peer_gone` says the peer is gone while
    /// the provider takes nothing (see `retry_on_eagain`).
    pub fn inject_unless(&self, buf: &[u8], peer: PeerAddr, tag: u64, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        debug_assert!(buf.len() <= self.inject_size);
        self.retry_on_eagain(
            "fi_tinject",
            // SAFETY: libfabric copies `buf` before fi_tinject returns and keeps no reference.
            || unsafe { sys::rdram_fi_tinject(self.ep, buf.as_ptr().cast(), buf.len(), peer, tag) },
            peer_gone,
        )
    }

    /// Posts a tagged receive matching `tag` (bits set in `ignore` are wildcards) from any
    /// peer.
    ///
    /// # Safety
    /// As for [`Endpoint::send`].
    pub unsafe fn recv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        tag: u64,
        ignore: u64,
        ctx: *mut OpContext,
    ) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract (buffers and context valid until the completion).
        unsafe {
            let any: PeerAddr = u64::MAX; // FI_ADDR_UNSPEC (a macro bindgen cannot see)
            self.retry_on_eagain(
                "fi_trecv",
                || sys::rdram_fi_trecv(self.ep, buf.cast(), len, desc, any, tag, ignore, ctx.cast()),
                &|| false,
            )
        }
    }

    /// One-sided read of `len` bytes at `remote_addr` (see [`MemoryRegion::remote_base`](super::MemoryRegion::remote_base))
    /// of the peer's region `key` into `buf`.
    ///
    /// # Safety
    /// As for [`Endpoint::send`]; `desc` belongs to a region covering `buf` when the
    /// provider requires FI_MR_LOCAL.
    #[allow(clippy::too_many_arguments)] // fi_read's own, one for one
    pub unsafe fn read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        peer: PeerAddr,
        remote_addr: u64,
        key: u64,
        ctx: *mut OpContext,
    ) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract (buffers and context valid until the completion).
        unsafe {
            if !self.rma {
                return Err(Error::new(
                    Status::Invalid,
                    format!("provider {} offers no one-sided reads", self.provider),
                ));
            }
            self.retry_on_eagain(
                "fi_read",
                || sys::rdram_fi_read(self.ep, buf.cast(), len, desc, peer, remote_addr, key, ctx.cast()),
                &|| false,
            )?;
            self.reads.borrow_mut().push_back(ctx as usize);
            Ok(())
        }
    }

    /// One-sided write of `buf` to the peer's region `key` at `remote_addr`. The engine
    /// never writes remotely (no registration of ours allows it); the security tests use
    /// this to check exactly that.
    ///
    /// # Safety
    /// As for [`Endpoint::read`].
    #[allow(clippy::too_many_arguments)] // fi_write's own, one for one
    pub unsafe fn write(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        peer: PeerAddr,
        remote_addr: u64,
        key: u64,
        ctx: *mut OpContext,
    ) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract (buffers and context valid until the completion).
        unsafe {
            if !self.rma {
                return Err(Error::new(
                    Status::Invalid,
                    format!("provider {} offers no one-sided writes", self.provider),
                ));
            }
            self.retry_on_eagain(
                "fi_write",
                || sys::rdram_fi_write(self.ep, buf.cast(), len, desc, peer, remote_addr, key, ctx.cast()),
                &|| false,
            )
        }
    }

    /// Forgets a completed read's context (see `reads`).
    pub(super) fn read_done(&self, ctx: usize) {
        let mut reads = self.reads.borrow_mut();
        if let Some(i) = reads.iter().position(|&c| c == ctx) {
            reads.remove(i);
        }
    }

    /// Cancels a posted receive; its completion then reports an error (or, when the
    /// receive had already matched, its normal completion follows).
    pub fn cancel(&self, ctx: *mut OpContext) {
        // SAFETY: ctx is the context of an operation posted on this endpoint.
        unsafe { sys::rdram_fi_cancel(&mut (*self.ep).fid, ctx.cast()) };
    }

    /// Sets how long a post waits for the provider to take it: a client waits as long as
    /// it waits for an answer, since a server may be held up for about a second (releasing
    /// a dead peer's shm lock, replacing its endpoints) without being gone.
    pub fn set_post_stall_limit(&mut self, limit: std::time::Duration) {
        self.post_stall_limit = limit;
    }

    /// FI_EAGAIN means the provider cannot take the operation until it makes progress
    /// (queues full, or shm still mapping the peer, which needs the peer to progress
    /// too): drive our side and retry, for at most `post_stall_limit`. A peer that died
    /// or stopped never drains its queue: retrying for good wedged a server that answered
    /// a client killed with requests in flight. `peer_gone`, asked between naps, ends it
    /// sooner: libfabric tcp's rxm takes nothing for a peer that died before it connected
    /// to it, for as long as one retries.
    fn retry_on_eagain(&self, what: &str, mut post: impl FnMut() -> isize, peer_gone: &dyn Fn() -> bool) -> Result<()> {
        let mut since: Option<std::time::Instant> = None;
        loop {
            let rc = post() as i64;
            if rc != -(sys::FI_EAGAIN as i64) {
                return check(what, rc);
            }
            let limit = self.post_stall_limit;
            let waited = since.get_or_insert_with(std::time::Instant::now).elapsed();
            if waited >= limit {
                return Err(Error::new(
                    Status::Unavailable,
                    format!("{what}: the peer took nothing for {limit:?} (it stopped making progress)"),
                ));
            }
            if waited >= POST_SPIN {
                if peer_gone() {
                    return Err(Error::new(Status::Unavailable, format!("{what}: the peer is gone")));
                }
                // A peer held up this long is not coming back within microseconds: nap
                // instead of spinning a core for the rest of the limit.
                std::thread::sleep(POST_NAP);
            }
            // SAFETY: a zero-count read only drives progress for providers that need it.
            unsafe { sys::rdram_fi_cq_read(self.cq, ptr::null_mut(), 0) };
        }
    }
}
