//! Puts from and gets into CUDA device memory, staged through pinned host buffers.
//!
//! A pointer's memory kind is asked of the driver per call ([`gpu::kind_of`]); host
//! memory takes the ordinary path. Device memory moves in two steps, on a stream of the
//! client's own:
//! - a put of more than [`DEVICE_CHUNK`] bytes sends the value in parts of that size, staged on
//!   the server ([`crate::proto::flags::STAGE`] with a range), from two pinned chunk
//!   buffers in turn: while one part crosses the network, the GPU copies the next into
//!   the other buffer; an empty part at the end commits the value as an ordinary put.
//!   Smaller values, values for a cluster, and values the server has no staging room for
//!   are copied whole into a pinned buffer (kept for the next put up to
//!   `KEEP_PUT_BUFFER`) and put from there;
//! - a get receives the value in [`DEVICE_CHUNK`]-byte ranges pinned to its generation, into two
//!   pinned chunk buffers in turn: while the network fills one, the GPU copies the other
//!   into place. A value that changes while it is read is read again.
//!
//! Every call synchronizes the stream before it returns, whatever happened: no copy
//! touches the caller's device memory afterwards.
//!
//! With [`super::DevicePath::Transport`], a connection whose transport moves device memory
//! itself ([`super::link::Link::takes_device_memory`]: UCX with its CUDA transports) is
//! given the caller's device memory instead, as a put's value and a get's destination; a
//! reply UCX delivers eagerly arrives in host memory and is copied in on the stream. Off
//! by default until measured against staging on a GPU host (docs/gpu.md).

use super::device_staging::DeviceStaging;
use super::link::{Payload, Receive, Sink};
use super::tunables::{DEVICE_CHUNK, READ_ATTEMPTS};
use super::{
    check_key, error_of, get_header, get_into_result, Client, DevicePath, GetInto, GetOptions, PutOptions, WriteResult,
};
use crate::error::{Error, Result, Status};
use crate::gpu::{self, MemoryKind};
use crate::proto::ByteRange;
use crate::proto::{INLINE_KEY_MAX, MAX_VALUE_LEN};

/// How a chunked read ended.
enum Chunked {
    Done(GetInto),
    /// The value changed between two chunks: read it again.
    Changed,
}

impl Client {
    /// Stores the `len` bytes at `ptr`, host memory or CUDA device memory (asked of the
    /// driver), as `key`'s value. See [`Client::put_with`].
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is host memory valid for reads, or device memory of one GPU,
    /// and no one writes it until the call returns (`ptr` may be null when `len` is 0).
    pub unsafe fn put_from(
        &mut self,
        key: &[u8],
        ptr: *const u8,
        len: usize,
        opts: &PutOptions,
    ) -> Result<WriteResult> {
        match device_kind(ptr as usize, len) {
            // SAFETY: host memory valid for reads of `len` bytes (this function's contract).
            MemoryKind::Host => self.put_with(key, unsafe { host_slice(ptr, len) }, opts),
            MemoryKind::Device { ordinal } => self.put_from_device(key, ptr as usize, len, ordinal, opts),
        }
    }

    /// Reads a value (or a byte range of it) into the `len` bytes at `ptr`, host memory or
    /// CUDA device memory (asked of the driver). See [`Client::get_into`].
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is host memory valid for writes, or device memory of one GPU,
    /// and no one else reads or writes it until the call returns (`ptr` may be null when
    /// `len` is 0).
    pub unsafe fn get_into_ptr(&mut self, key: &[u8], opts: &GetOptions, ptr: *mut u8, len: usize) -> Result<GetInto> {
        match device_kind(ptr as usize, len) {
            // SAFETY: host memory valid for writes of `len` bytes, ours for the call
            // (this function's contract).
            MemoryKind::Host => self.get_into(key, opts, unsafe { host_slice_mut(ptr, len) }),
            MemoryKind::Device { ordinal } => self.get_into_device(key, opts, ptr as usize, len, ordinal),
        }
    }

    fn staging(&mut self) -> Result<Box<DeviceStaging>> {
        match self.device_staging.take() {
            Some(s) => Ok(s),
            None => {
                let device =
                    gpu::device().ok_or_else(|| Error::new(Status::Internal, "device memory without a device"))?;
                Ok(Box::new(DeviceStaging::new(device)?))
            }
        }
    }

    fn put_from_device(
        &mut self,
        key: &[u8],
        addr: usize,
        len: usize,
        ordinal: i32,
        opts: &PutOptions,
    ) -> Result<WriteResult> {
        check_key(key)?;
        if len as u64 > MAX_VALUE_LEN {
            return Err(Error::new(Status::ValueTooLarge, format!("{len} bytes > limit {MAX_VALUE_LEN}")));
        }
        if self.device_memory_by_transport(key) {
            // SAFETY: `len` bytes of the caller's device memory, unchanged until the call
            // returns (`put_from`'s contract), which only the transport reads.
            let value = unsafe { Payload::device(addr as *const u8, len) };
            return self.put_payload(key, value, opts);
        }
        let mut staging = self.staging()?;
        let mut result = Err(Error::new(Status::Unavailable, "not sent in parts"));
        if len > DEVICE_CHUNK && self.cluster.is_none() && key.len() <= INLINE_KEY_MAX {
            let mut stage_id = None;
            result = self.put_in_parts(&mut staging, key, addr, len, ordinal, opts, &mut stage_id);
            // Discarded where the server answered (a refused part, a failed copy here).
            if let Err(e) = &result {
                self.discard_parts_if_answered(key, e, stage_id);
            }
        }
        // The server had no staging room, or the value lapsed or the connection was
        // replaced while its parts arrived (a part names the session's value): sent whole.
        if result.as_ref().is_err_and(|e| {
            matches!(e.status, Status::NoRoom | Status::Unavailable | Status::Missing | Status::Transport)
        }) {
            result = match staging.copy_to_host(addr, len, ordinal) {
                Ok(value) => self.put_with(key, value, opts),
                Err(e) => Err(e),
            };
        }
        // Whatever happened, no copy runs after the return.
        let synchronized = staging.stream(ordinal).and_then(|s| s.synchronize());
        staging.trim();
        self.device_staging = Some(staging);
        result.and_then(|r| synchronized.map(|()| r))
    }

    /// Sends a value of device memory in parts of [`DEVICE_CHUNK`] bytes, the GPU copying the next
    /// part into one chunk buffer while the other's part crosses the network, then commits
    /// it. `stage_id` receives the id the server stages the value under once it does.
    #[allow(clippy::too_many_arguments)]
    fn put_in_parts(
        &mut self,
        staging: &mut DeviceStaging,
        key: &[u8],
        addr: usize,
        len: usize,
        ordinal: i32,
        opts: &PutOptions,
        stage_id: &mut Option<u64>,
    ) -> Result<WriteResult> {
        let parts = len.div_ceil(DEVICE_CHUNK);
        let part_len = |k: usize| DEVICE_CHUNK.min(len - k * DEVICE_CHUNK);
        let first = staging.chunks[0].as_mut_ptr();
        let stream = staging.stream(ordinal)?;
        // SAFETY: the chunk buffer holds DEVICE_CHUNK bytes used by nothing else; the caller's
        // device range holds `len` bytes; synchronized right after.
        unsafe { stream.to_host(first, addr, part_len(0))? };
        stream.synchronize()?;
        for k in 0..parts {
            if k + 1 < parts {
                let next = staging.chunks[(k + 1) % 2].as_mut_ptr();
                // SAFETY: the other chunk buffer, whose part was sent (its call returned);
                // synchronized before that buffer is sent or the call returns.
                unsafe { staging.stream(ordinal)?.to_host(next, addr + (k + 1) * DEVICE_CHUNK, part_len(k + 1))? };
            }
            self.stage_part(key, k * DEVICE_CHUNK, len, stage_id, &staging.chunks[k % 2].as_slice()[..part_len(k)])?;
            // The next part is in its buffer.
            staging.stream(ordinal)?.synchronize()?;
        }
        self.commit_parts(key, len, stage_id.take(), opts)
    }

    fn get_into_device(
        &mut self,
        key: &[u8],
        opts: &GetOptions,
        addr: usize,
        len: usize,
        ordinal: i32,
    ) -> Result<GetInto> {
        check_key(key)?;
        if self.device_memory_by_transport(key) {
            // SAFETY: `len` bytes of the caller's device memory, ours until the call
            // returns (`get_into_ptr`'s contract), which only the transport writes.
            let sink = unsafe { Sink::device(addr as *mut u8, len) };
            return self.get_into_device_by_transport(key, opts, sink, ordinal);
        }
        let mut staging = self.staging()?;
        let mut result = Ok(Chunked::Changed);
        for _ in 0..READ_ATTEMPTS {
            result = self.read_chunks(&mut staging, key, opts, addr, len, ordinal);
            if !matches!(result, Ok(Chunked::Changed)) {
                break;
            }
        }
        // Whatever happened, no copy runs after the return.
        let synchronized = staging.stream(ordinal).and_then(|s| s.synchronize());
        self.device_staging = Some(staging);
        match result? {
            Chunked::Done(got) => synchronized.map(|()| got),
            Chunked::Changed => Err(Error::new(
                Status::Unavailable,
                format!("the value changed during each of {READ_ATTEMPTS} reads in chunks"),
            )),
        }
    }

    /// Whether `key`'s device memory goes to the transport itself (see the module's doc).
    fn device_memory_by_transport(&self, key: &[u8]) -> bool {
        self.opts.device_path == DevicePath::Transport && key.len() <= INLINE_KEY_MAX && self.conn.takes_device_memory()
    }

    /// A get whose transport receives the value into the caller's device memory itself;
    /// a value it delivered eagerly (into host memory) is copied in on the stream.
    fn get_into_device_by_transport(
        &mut self,
        key: &[u8],
        opts: &GetOptions,
        sink: Sink,
        ordinal: i32,
    ) -> Result<GetInto> {
        let reply = self.call_key_into(key, get_header(opts), Payload::empty(), Receive::Into(sink))?;
        if reply.header.status() == Status::Ok && !reply.withheld && !reply.payload.is_empty() {
            let mut staging = self.staging()?;
            let copied = staging.stream(ordinal).and_then(|s| {
                // SAFETY: the reply's bytes, no more than the sink holds (a longer reply is
                // withheld), into the caller's device range; synchronized right after,
                // whether the copy was queued or not.
                let queued = unsafe { s.to_device(sink.ptr as usize, reply.payload.as_ptr(), reply.payload.len()) };
                queued.and(s.synchronize())
            });
            self.device_staging = Some(staging);
            copied?;
        }
        get_into_result(reply)
    }

    /// One read of a value into device memory: the first request learns its generation
    /// and length (and carries the value when it fits in a chunk); longer values follow in
    /// ranges pinned to that generation.
    fn read_chunks(
        &mut self,
        staging: &mut DeviceStaging,
        key: &[u8],
        opts: &GetOptions,
        addr: usize,
        len: usize,
        ordinal: i32,
    ) -> Result<Chunked> {
        let DeviceStaging { chunks, .. } = &mut *staging;
        let first = self.call_key_into(
            key,
            get_header(opts),
            Payload::empty(),
            Receive::Into(Sink::new(chunks[0].as_mut_slice())),
        )?;
        if first.header.status() != Status::Ok {
            return get_into_result(first).map(Chunked::Done);
        }
        let (generation, size, total) = (first.header.generation, first.header.value_size, first.len);
        if total > len {
            return Ok(Chunked::Done(GetInto::TooSmall { needed: total }));
        }
        let done = GetInto::Value { len: total, generation, size };
        if !first.withheld {
            let host = staging.chunks[0].as_mut_ptr();
            // SAFETY: the chunk holds `total` bytes received; `total <= len` bytes of the
            // caller's device memory (its contract); synchronized before the return.
            unsafe { staging.stream(ordinal)?.to_device(addr, host, total)? };
            return Ok(Chunked::Done(done));
        }
        let start = match opts.range {
            Some(r) => r.resolve(size)?.0,
            None => 0,
        };
        let mut at = 0;
        for turn in 0.. {
            if at == total {
                break;
            }
            let n = DEVICE_CHUNK.min(total - at);
            let chunk = &mut staging.chunks[turn % 2];
            let range = ByteRange { start: (start + at as u64) as i64, end: (start + (at + n) as u64) as i64 };
            let pinned = GetOptions { if_equal: Some(generation), if_not_equal: None, range: Some(range) };
            // The chunk buffer is free: the copy out of it (two turns ago) was waited for.
            let reply = self.call_key_into(
                key,
                get_header(&pinned),
                Payload::empty(),
                Receive::Into(Sink::new(&mut chunk.as_mut_slice()[..n])),
            )?;
            match reply.header.status() {
                Status::Ok if !reply.withheld && reply.len == n => {}
                Status::Ok | Status::Unchanged | Status::Missing | Status::OutOfRange => return Ok(Chunked::Changed),
                s => return Err(error_of(s, &reply)),
            }
            let host = chunk.as_mut_ptr();
            let stream = staging.stream(ordinal)?;
            // The copy out of the other buffer ran while this chunk arrived; it must end
            // before that buffer takes the next chunk.
            stream.synchronize()?;
            // SAFETY: `n` bytes received into the chunk, to `[addr+at, addr+at+n)` within
            // the caller's `len` bytes; synchronized before the chunk is reused or the
            // call returns.
            unsafe { stream.to_device(addr + at, host, n)? };
            at += n;
        }
        Ok(Chunked::Done(done))
    }
}

/// The kind of memory of a caller's range (its first byte's).
fn device_kind(addr: usize, len: usize) -> MemoryKind {
    if len == 0 {
        return MemoryKind::Host;
    }
    gpu::kind_of(addr)
}

/// # Safety
/// `ptr` is valid for reads of `len` bytes (or `len` is 0).
unsafe fn host_slice<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// # Safety
/// `ptr` is valid for writes of `len` bytes and unaliased (or `len` is 0).
unsafe fn host_slice_mut<'a>(ptr: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}
