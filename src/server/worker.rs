//! A shard worker: one pinned thread that owns one UCX worker, the endpoints its clients
//! reach it by, and one shard. Requests are served inside the active-message callback, on
//! this thread, with no lock: the worker is the only one who ever touches its shard.
//!
//! Buffer ownership (who may touch which bytes when):
//! - Reply headers and owned reply payloads live in pooled [`ReplyMsg`] boxes; a box is
//!   owned by UCX from a pending send until its completion callback returns it to the pool.
//! - A get reply sends straight from the arena; the extent is pinned until the send
//!   completes, so a concurrent delete or overwrite defers the free.
//! - A rendezvous put receives into a reserved extent that is not yet in the index; on
//!   completion it is committed (condition re-checked) or released, also when the client
//!   vanished mid-transfer (the callback then carries an error status).

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use crate::error::{Error, Result, Status};
use crate::proto::{self, flags, Op, ReplyHeader, RequestHeader, REPLY_HEADER_LEN, REQUEST_HEADER_LEN};
use crate::store::alloc::Extent;
use crate::store::{ByteRange, Condition, GetOutcome, Shard};
use crate::transport::ucx::{self, sys, Started, Worker};
use crate::transport::{PollMode, Poller};

/// How often an idle worker wakes to expire TTL'd keys.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);
const SWEEP_BATCH: usize = 256;

struct ReplyMsg {
    worker: *mut ShardWorker,
    header: [u8; REPLY_HEADER_LEN],
    payload: Vec<u8>,
    /// Arena extent the payload is sent from, if any (pinned while in flight).
    pinned: Option<u64>,
}

struct PendingPut {
    worker: *mut ShardWorker,
    reply_ep: sys::ucp_ep_h,
    header: RequestHeader,
    extent: Extent,
    value_len: u64,
}

pub struct ShardWorker {
    pub index: usize,
    shards: usize,
    session: u64,
    worker: Worker,
    memh: sys::ucp_mem_h,
    shard: Shard,
    #[allow(clippy::vec_box)] // boxed: UCX holds their addresses while in flight
    reply_pool: Vec<Box<ReplyMsg>>,
    list_scratch: Vec<(Vec<u8>, u64)>,
}

pub struct WorkerInfo {
    pub address: Vec<u8>,
    pub backing: crate::store::Backing,
    pub bytes: u64,
}

impl ShardWorker {
    /// Builds the worker on the calling thread (the one that will run it).
    pub fn new(index: usize, shards: usize, session: u64, shard: Shard) -> Result<Box<ShardWorker>> {
        let worker = Worker::new()?;
        let arena = shard.arena();
        let memh = worker.mem_map(arena.base(), arena.len())?;
        let mut w = Box::new(ShardWorker {
            index,
            shards,
            session,
            worker,
            memh,
            shard,
            reply_pool: Vec::new(),
            list_scratch: Vec::new(),
        });
        let arg = &mut *w as *mut ShardWorker as *mut c_void;
        // SAFETY: the box is never moved out of and outlives the UCX worker it owns (the
        // worker is destroyed in Drop before the box's memory is freed).
        unsafe { w.worker.set_am_handler(proto::AM_REQUEST, Some(on_request), arg)? };
        Ok(w)
    }

    pub fn info(&self) -> Result<WorkerInfo> {
        Ok(WorkerInfo { address: self.worker.address()?, backing: self.shard.arena().backing(), bytes: self.shard.arena().len() as u64 })
    }

    pub fn waker(&self) -> ucx::Waker {
        self.worker.waker()
    }

    /// Serves until `stop` is set (and the worker woken).
    pub fn run(self: Box<Self>, mode: PollMode, spin: Duration, stop: Arc<AtomicBool>) {
        let this = Box::into_raw(self);
        let mut poller = Poller::new(mode, spin);
        let mut last_sweep = std::time::Instant::now();
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: `this` is the only handle to the worker; borrows taken here end before
            // progress runs callbacks that take their own short borrow through the same pointer.
            let did_work = unsafe { (*this).worker.progress() } != 0;
            if !did_work && last_sweep.elapsed() >= SWEEP_INTERVAL {
                unsafe { (*this).shard.expire_due(SWEEP_BATCH) };
                last_sweep = std::time::Instant::now();
            }
            let worker = unsafe { &(*this).worker };
            if let Err(e) = poller.after_progress(worker, did_work, SWEEP_INTERVAL) {
                warn!("worker: {e}");
            }
        }
        // SAFETY: reclaim the box leaked above; no callback can run after this point
        // because nothing progresses the worker any more.
        drop(unsafe { Box::from_raw(this) });
    }

    fn take_reply(&mut self) -> Box<ReplyMsg> {
        let me = self as *mut ShardWorker;
        let mut m = self.reply_pool.pop().unwrap_or_else(|| {
            Box::new(ReplyMsg { worker: me, header: [0; REPLY_HEADER_LEN], payload: Vec::new(), pinned: None })
        });
        m.payload.clear();
        m.pinned = None;
        m
    }

    fn finish_reply(&mut self, mut m: Box<ReplyMsg>) {
        if let Some(extent) = m.pinned.take() {
            self.shard.unpin(extent);
        }
        if m.payload.capacity() > 1 << 20 {
            m.payload = Vec::new();
        }
        self.reply_pool.push(m);
    }

    /// Sends a reply. `arena`: bytes of the arena to send instead of the owned payload.
    fn send_reply(&mut self, ep: sys::ucp_ep_h, header: ReplyHeader, mut m: Box<ReplyMsg>, arena: Option<(u64, u64, u64)>) {
        if ep.is_null() {
            self.finish_reply(m);
            return;
        }
        m.header = header.encode();
        let raw = Box::into_raw(m);
        // SAFETY: header and payload live in the box (heap, stable while leaked) or the
        // arena (pinned below while in flight), untouched until the completion; ep is the
        // reply endpoint UCX gave us.
        let started = unsafe {
            let (payload, memh): (&[u8], _) = match arena {
                Some((offset, len, _)) => (self.shard.arena().slice(offset, len), self.memh),
                None => ((*raw).payload.as_slice(), ptr::null_mut()),
            };
            self.worker.am_send(ep, proto::AM_REPLY, &(*raw).header, payload, 0, Some(on_reply_sent), raw as *mut c_void, memh)
        };
        // SAFETY: raw came from Box::into_raw above and is reclaimed exactly once: here when
        // the send finished (or failed) inside the call, else in on_reply_sent.
        match started {
            Ok(Started::Pending) => {
                if let Some((_, _, extent)) = arena {
                    self.shard.pin(extent);
                    unsafe { (*raw).pinned = Some(extent) };
                }
            }
            Ok(Started::Done) => self.finish_reply(unsafe { Box::from_raw(raw) }),
            Err(e) => {
                debug!("reply not sent: {e}");
                self.finish_reply(unsafe { Box::from_raw(raw) })
            }
        }
    }

    fn reply_status(&mut self, ep: sys::ucp_ep_h, request_id: u64, err: &Error) {
        let mut m = self.take_reply();
        m.payload.extend_from_slice(err.message.as_bytes());
        self.send_reply(ep, ReplyHeader::new(request_id, err.status), m, None);
    }

    fn reply_ok(&mut self, ep: sys::ucp_ep_h, request_id: u64, generation: u64, value_size: u64) {
        let m = self.take_reply();
        let mut h = ReplyHeader::new(request_id, Status::Ok);
        h.generation = generation;
        h.value_size = value_size;
        self.send_reply(ep, h, m, None);
    }

    /// Handles one request from the AM callback. `data` is the eager payload, or the
    /// rendezvous descriptor when `rendezvous`.
    fn handle(&mut self, header: &[u8], data: *mut c_void, length: usize, info: ucx::AmInfo) -> sys::ucs_status_t {
        let ep = info.reply_ep;
        let (h, op) = match RequestHeader::decode(header) {
            Ok(v) => v,
            Err(e) => {
                debug!("shard {}: malformed request: {}", self.index, e.message);
                if let Some(id) = e.request_id {
                    self.reply_status(ep, id, &Error::new(e.status, e.message));
                }
                return sys::UCS_OK;
            }
        };
        if h.session != self.session {
            self.reply_status(ep, h.request_id, &Error::new(Status::AuthFailed, "request without a valid session: connect through the bootstrap handshake with the right token"));
            return sys::UCS_OK;
        }
        let key_in_payload = h.flags & flags::KEY_IN_PAYLOAD != 0;
        let inline = &header[REQUEST_HEADER_LEN..];
        let expected_inline = match op {
            Op::Put | Op::Get | Op::Delete if !key_in_payload => h.key_len as usize,
            _ => 0,
        };
        if inline.len() != expected_inline {
            self.reply_status(ep, h.request_id, &Error::new(Status::Invalid, format!("header carries {} key bytes, expected {expected_inline}", inline.len())));
            return sys::UCS_OK;
        }
        if info.rendezvous {
            if op == Op::Put {
                self.begin_rendezvous_put(ep, h, inline, data, length);
            } else {
                // Only puts carry large payloads; dropping the descriptor frees the sender.
                self.reply_status(ep, h.request_id, &Error::new(Status::Invalid, format!("{op:?} with a {length}-byte payload")));
            }
            return sys::UCS_OK;
        }
        // SAFETY: for an eager message UCX hands us `length` readable bytes at `data`,
        // valid for the duration of this callback.
        let payload: &[u8] = if length == 0 { &[] } else { unsafe { std::slice::from_raw_parts(data as *const u8, length) } };
        let result = match op {
            Op::Put => self.eager_put(ep, &h, inline, payload),
            Op::Get => self.get(ep, &h, inline, payload),
            Op::Delete => self.delete(ep, &h, inline, payload),
            Op::DeleteRange | Op::List => self.range_op(ep, &h, op, payload),
            Op::Stats => self.stats(ep, &h),
        };
        if let Err(e) = result {
            self.reply_status(ep, h.request_id, &e);
        }
        sys::UCS_OK
    }

    fn key_of<'a>(&self, h: &RequestHeader, inline: &'a [u8], payload: &'a [u8]) -> Result<&'a [u8]> {
        let key = if h.flags & flags::KEY_IN_PAYLOAD != 0 {
            payload.get(..h.key_len as usize).ok_or_else(|| Error::new(Status::Invalid, "payload shorter than the key"))?
        } else {
            inline
        };
        if proto::shard_of(key, self.shards) != self.index {
            return Err(Error::new(Status::WrongShard, format!("key belongs to shard {}, not {}", proto::shard_of(key, self.shards), self.index)));
        }
        Ok(key)
    }

    fn eager_put(&mut self, ep: sys::ucp_ep_h, h: &RequestHeader, inline: &[u8], payload: &[u8]) -> Result<()> {
        let key = self.key_of(h, inline, payload)?;
        let value = if h.flags & flags::KEY_IN_PAYLOAD != 0 { &payload[key.len()..] } else { payload };
        let cond = condition(h);
        self.shard.precheck_put(key, &cond)?;
        let extent = self.shard.reserve((key.len() + value.len()) as u64)?;
        let slot = self.shard.extent_mut(extent);
        slot[..key.len()].copy_from_slice(key);
        slot[key.len()..key.len() + value.len()].copy_from_slice(value);
        let generation = self.shard.commit_put(extent, key.len() as u32, value.len() as u64, &cond, ttl(h))?;
        self.reply_ok(ep, h.request_id, generation, value.len() as u64);
        Ok(())
    }

    fn begin_rendezvous_put(&mut self, ep: sys::ucp_ep_h, h: RequestHeader, inline: &[u8], desc: *mut c_void, length: usize) {
        let key_len = h.key_len as u64;
        let in_payload = h.flags & flags::KEY_IN_PAYLOAD != 0;
        let value_len = if in_payload { (length as u64).saturating_sub(key_len) } else { length as u64 };
        let prepared = (|| {
            if in_payload && (length as u64) < key_len {
                return Err(Error::new(Status::Invalid, "payload shorter than the key"));
            }
            if value_len > proto::MAX_VALUE_LEN {
                return Err(Error::new(Status::ValueTooLarge, format!("{value_len} bytes > limit {}", proto::MAX_VALUE_LEN)));
            }
            if !in_payload {
                self.key_of(&h, inline, &[])?;
                self.shard.precheck_put(inline, &condition(&h))?;
            }
            self.shard.reserve(key_len + value_len)
        })();
        let extent = match prepared {
            Ok(e) => e,
            Err(e) => {
                self.reply_status(ep, h.request_id, &e);
                return; // returning UCS_OK drops the descriptor and releases the sender
            }
        };
        let dest_off = if in_payload { 0 } else { key_len };
        if !in_payload {
            self.shard.extent_mut(extent)[..inline.len()].copy_from_slice(inline);
        }
        let dest = self.shard.extent_mut(extent)[dest_off as usize..].as_mut_ptr();
        let pending = Box::into_raw(Box::new(PendingPut { worker: self, reply_ep: ep, header: h, extent, value_len }));
        // SAFETY: the extent is reserved for this transfer only (not in the index, so no
        // reader or writer can reach it) until finish_put runs.
        let started = unsafe { self.worker.am_recv_data(desc, dest, length, Some(on_put_received), pending as *mut c_void, self.memh) };
        match started {
            Ok(Started::Pending) => {}
            // SAFETY: pending reclaimed once: here, or in on_put_received when pending.
            Ok(Started::Done) => self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_OK),
            Err(e) => {
                warn!("rendezvous receive failed to start: {e}");
                self.finish_put(unsafe { *Box::from_raw(pending) }, sys::UCS_ERR_IO_ERROR)
            }
        }
    }

    fn finish_put(&mut self, p: PendingPut, status: sys::ucs_status_t) {
        if status != sys::UCS_OK {
            // The client vanished or the transfer failed: free the slot, keep serving.
            debug!("shard {}: rendezvous put failed ({}); slot freed", self.index, ucx::status_string(status));
            self.shard.release(p.extent);
            self.reply_status(p.reply_ep, p.header.request_id, &Error::new(Status::Transport, "value transfer failed"));
            return;
        }
        let key_len = p.header.key_len as usize;
        let key = self.shard.arena().slice(p.extent.offset, key_len as u64);
        if proto::shard_of(key, self.shards) != self.index {
            self.shard.release(p.extent);
            self.reply_status(p.reply_ep, p.header.request_id, &Error::new(Status::WrongShard, "key belongs to another shard"));
            return;
        }
        match self.shard.commit_put(p.extent, key_len as u32, p.value_len, &condition(&p.header), ttl(&p.header)) {
            Ok(generation) => self.reply_ok(p.reply_ep, p.header.request_id, generation, p.value_len),
            Err(e) => self.reply_status(p.reply_ep, p.header.request_id, &e),
        }
    }

    fn get(&mut self, ep: sys::ucp_ep_h, h: &RequestHeader, inline: &[u8], payload: &[u8]) -> Result<()> {
        let key = self.key_of(h, inline, payload)?;
        let range = (h.flags & flags::HAS_RANGE != 0).then_some(ByteRange { start: h.range_start, end: h.range_end });
        let mut reply = ReplyHeader::new(h.request_id, Status::Ok);
        match self.shard.get(key, &condition(h), range)? {
            GetOutcome::Missing => reply.status = Status::Missing as u8,
            GetOutcome::Unchanged { generation } => {
                reply.status = Status::Unchanged as u8;
                reply.generation = generation;
            }
            GetOutcome::Value { generation, value_size, offset, len, extent } => {
                reply.generation = generation;
                reply.value_size = value_size;
                let m = self.take_reply();
                self.send_reply(ep, reply, m, Some((offset, len, extent)));
                return Ok(());
            }
        }
        let m = self.take_reply();
        self.send_reply(ep, reply, m, None);
        Ok(())
    }

    fn delete(&mut self, ep: sys::ucp_ep_h, h: &RequestHeader, inline: &[u8], payload: &[u8]) -> Result<()> {
        let key = self.key_of(h, inline, payload)?;
        let existed = self.shard.delete(key, &condition(h))?;
        self.reply_ok(ep, h.request_id, 0, existed as u64);
        Ok(())
    }

    fn range_op(&mut self, ep: sys::ucp_ep_h, h: &RequestHeader, op: Op, payload: &[u8]) -> Result<()> {
        let (min_len, max_len) = (h.key_len as usize, h.aux_len as usize);
        if payload.len() != min_len + max_len {
            return Err(Error::new(Status::Invalid, "range bounds do not match their lengths"));
        }
        let min = &payload[..min_len];
        let max = (h.flags & flags::MAX_UNBOUNDED == 0).then(|| &payload[min_len..]);
        if op == Op::DeleteRange {
            let n = self.shard.delete_range(min, max);
            self.reply_ok(ep, h.request_id, 0, n);
            return Ok(());
        }
        let limit = (h.ttl_or_limit as usize).clamp(1, proto::LIST_BATCH as usize);
        let mut entries = std::mem::take(&mut self.list_scratch);
        entries.clear();
        let more = self.shard.list(min, max, limit, &mut entries);
        let mut m = self.take_reply();
        for (k, size) in &entries {
            proto::encode_list_entry(&mut m.payload, k, *size);
        }
        let mut reply = ReplyHeader::new(h.request_id, Status::Ok);
        reply.value_size = entries.len() as u64;
        reply.more = more as u32;
        self.list_scratch = entries;
        self.send_reply(ep, reply, m, None);
        Ok(())
    }

    fn stats(&mut self, ep: sys::ucp_ep_h, h: &RequestHeader) -> Result<()> {
        let mut m = self.take_reply();
        let mut stats = serde_json::to_value(self.shard.stats()).unwrap_or_default();
        stats["shard"] = self.index.into();
        serde_json::to_writer(&mut m.payload, &stats).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        self.send_reply(ep, ReplyHeader::new(h.request_id, Status::Ok), m, None);
        Ok(())
    }
}

impl Drop for ShardWorker {
    fn drop(&mut self) {
        // SAFETY: mapped in new(), unmapped once here.
        unsafe { self.worker.mem_unmap(self.memh) };
    }
}

fn condition(h: &RequestHeader) -> Condition {
    Condition {
        if_equal: (h.flags & flags::IF_EQUAL != 0).then_some(h.if_equal),
        if_not_equal: (h.flags & flags::IF_NOT_EQUAL != 0).then_some(h.if_not_equal),
        if_absent: h.flags & flags::IF_ABSENT != 0,
    }
}

fn ttl(h: &RequestHeader) -> u64 {
    if h.flags & flags::HAS_TTL != 0 {
        h.ttl_or_limit.max(1)
    } else {
        0
    }
}

unsafe extern "C" fn on_request(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: arg is the ShardWorker registered in new(); UCX calls us on its thread,
    // inside progress, when no other borrow of the worker is live. header/param are valid
    // for the duration of the call.
    let w = &mut *(arg as *mut ShardWorker);
    let header = ucx::am_header(header, header_length);
    let info = ucx::am_info(param);
    catch_unwind(AssertUnwindSafe(|| w.handle(header, data, length, info))).unwrap_or_else(|_| {
        warn!("request handler panicked; request dropped");
        sys::UCS_OK
    })
}

unsafe extern "C" fn on_reply_sent(request: *mut c_void, _status: sys::ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is the ReplyMsg box leaked in send_reply for this pending send.
    let m = Box::from_raw(user_data as *mut ReplyMsg);
    let w = &mut *m.worker;
    w.finish_reply(m);
    ucx::request_free(request);
}

unsafe extern "C" fn on_put_received(request: *mut c_void, status: sys::ucs_status_t, _length: usize, user_data: *mut c_void) {
    // SAFETY: user_data is the PendingPut box leaked in begin_rendezvous_put.
    let p = Box::from_raw(user_data as *mut PendingPut);
    let w = &mut *p.worker;
    let _ = catch_unwind(AssertUnwindSafe(|| w.finish_put(*p, status)));
    ucx::request_free(request);
}
