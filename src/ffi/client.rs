//! C ABI: the client handle and its operations.

use std::ffi::{c_char, c_void};
use std::sync::{Mutex, TryLockError};
use std::time::Duration;

use super::handles::{free_buffer, hand_out_buffer, Handles};
use super::{bytes, c_str, guard, null_arg, rdram_status};
use crate::client::{
    ByteRange, DeleteResult, GetInto, GetOptions, GetResult, KeyRange, PutOptions, WriteCondition, WriteResult,
};
use crate::error::{Error, Status};
use crate::transport::PollMode;
use crate::{Client, ClientOptions};

use rdram_status::*;

/// An open client connection to one or more servers. Created by `rdram_client_connect`,
/// freed by `rdram_client_close`. A client serves one call at a time (it may move between
/// threads); open one per thread for parallelism. A call made while another call is using
/// the same client (from another thread, or from a list callback) returns
/// RDRAM_INVALID_ARGUMENT without touching it.
pub struct rdram_client {
    _opaque: [u8; 0],
}

/// Polling mode of the client's (or embedded server's) transport.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum rdram_poll_mode {
    /// Spin for a bounded time, then sleep on the transport's event fd (default).
    RDRAM_POLL_ADAPTIVE = 0,
    /// Spin continuously: lowest latency, one core per poller.
    RDRAM_POLL_BUSY = 1,
}

/// A poll mode as C passes it (an `rdram_poll_mode` value in an int32_t), validated.
pub(super) fn poll_mode(v: i32, what: &str) -> Result<PollMode, Error> {
    match v {
        x if x == rdram_poll_mode::RDRAM_POLL_ADAPTIVE as i32 => Ok(PollMode::Adaptive),
        x if x == rdram_poll_mode::RDRAM_POLL_BUSY as i32 => Ok(PollMode::Busy),
        other => Err(Error::new(Status::Invalid, format!("{what} = {other} is not an rdram_poll_mode"))),
    }
}

/// A flag as C passes it (0 or 1 in a uint8_t), validated.
pub(super) fn flag(v: u8, what: &str) -> Result<bool, Error> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Error::new(Status::Invalid, format!("{what} = {other}: use 0 or 1"))),
    }
}

/// Client options. Zero-initialise (`= {0}`) for defaults, then set what you need.
#[repr(C)]
pub struct rdram_client_options {
    /// NUL-terminated auth token, or NULL for none. Borrowed for the call only.
    pub auth_token: *const c_char,
    /// An `rdram_poll_mode` value (others are refused).
    pub poll_mode: i32,
    /// Upper bound on one operation in milliseconds; 0 = 30000.
    pub timeout_ms: u32,
    /// Upper bound on connecting in milliseconds; 0 = 5000.
    pub connect_timeout_ms: u32,
}

/// Options of a conditional put. Zero-initialise for "unconditional, no TTL".
#[repr(C)]
pub struct rdram_put_options {
    /// Only write if the current generation equals this (0 = no such condition).
    pub if_equal: u64,
    /// 1: only write if the key does not exist (0 or 1).
    pub if_absent: u8,
    /// Expire the value after this many milliseconds (0 = never).
    pub ttl_ms: u64,
}

/// Options of a conditional or ranged get. Zero-initialise for a plain get.
#[repr(C)]
pub struct rdram_get_options {
    /// Answer RDRAM_UNCHANGED (without the value) if the generation equals this (0 = none).
    pub if_not_equal: u64,
    /// Answer RDRAM_UNCHANGED if the generation differs from this (0 = none).
    pub if_equal: u64,
    /// 1: read only bytes [range_start, range_end) of the value (0 or 1).
    pub has_range: u8,
    /// Negative: counted from the end (a suffix).
    pub range_start: i64,
    /// -1: to the end of the value.
    pub range_end: i64,
}

/// Called once per listed key, in key order. `key` is valid only during the call.
/// Return 0 to continue, nonzero to stop listing.
pub type rdram_list_callback =
    Option<unsafe extern "C" fn(userdata: *mut c_void, key: *const u8, key_len: usize, value_size: u64) -> i32>;

/// Open clients by handle: a closed, stale or invented handle is refused
/// (RDRAM_INVALID_ARGUMENT), so closing twice or using a closed client cannot crash the
/// process.
static CLIENTS: Handles<Mutex<Client>> = Handles::new();

/// Runs `f` on the client behind `handle`, which one call uses at a time: a second call
/// while one runs (from another thread, or from a list callback) is refused, not
/// serialized, since it breaks the header's one-thread-at-a-time contract. A close during
/// a call takes the handle away at once; the client is freed when that call returns.
pub(super) fn with_client<R>(
    handle: *mut rdram_client,
    f: impl FnOnce(&mut Client) -> Result<R, Error>,
) -> Result<R, Error> {
    if handle.is_null() {
        return Err(null_arg("client"));
    }
    let entry = CLIENTS
        .get(handle as usize)
        .ok_or_else(|| Error::new(Status::Invalid, "not an open client handle (closed already, or never opened)"))?;
    let mut client = match entry.try_lock() {
        Ok(client) => client,
        Err(TryLockError::WouldBlock) => {
            return Err(Error::new(
                Status::Invalid,
                "the client is in use by another call (use a client from one thread at a time, and not from its own list callback)",
            ))
        }
        Err(TryLockError::Poisoned(_)) => {
            return Err(Error::new(Status::Internal, "an earlier call panicked inside this client: close it"))
        }
    };
    f(&mut client)
}

unsafe fn write<T>(out: *mut T, v: T) {
    // SAFETY: `out` is NULL or writable for a `T` (the exports' contract for out-parameters).
    unsafe {
        if !out.is_null() {
            out.write(v);
        }
    }
}

/// Connects to one or more servers (`"host:port"` or `"a:7000,b:7001"`), or to the live
/// members of a cluster on etcd (`"etcd://HOST:PORT[,HOST:PORT...]/NAME"`), followed as
/// they change.
///
/// `addresses` must not be NULL. `options` may be NULL (defaults). On success `*out`
/// receives a client owned by the caller, to be freed with `rdram_client_close`.
#[no_mangle]
pub unsafe extern "C" fn rdram_client_connect(
    addresses: *const c_char,
    options: *const rdram_client_options,
    out: *mut *mut rdram_client,
) -> rdram_status {
    // SAFETY: `addresses` and the option strings are NUL-terminated strings or NULL (refused), `options` is
    // NULL or points to an `rdram_client_options`, and `out` is written only after its NULL check, as the
    // header requires.
    unsafe {
        guard(|| {
            let addresses = c_str(addresses, "addresses")?;
            if out.is_null() {
                return Err(null_arg("out"));
            }
            let mut opts = ClientOptions::default();
            if let Some(o) = options.as_ref() {
                if !o.auth_token.is_null() {
                    opts.auth_token = Some(c_str(o.auth_token, "options.auth_token")?.to_string());
                }
                opts.poll = poll_mode(o.poll_mode, "options.poll_mode")?;
                if o.timeout_ms > 0 {
                    opts.timeout = Duration::from_millis(o.timeout_ms as u64);
                }
                if o.connect_timeout_ms > 0 {
                    opts.connect_timeout = Duration::from_millis(o.connect_timeout_ms as u64);
                }
            }
            let id = CLIENTS.insert(Mutex::new(Client::connect(addresses, opts)?));
            out.write(id as *mut rdram_client);
            Ok(RDRAM_OK)
        })
    }
}

/// Closes a client and frees it. NULL, or a handle closed already, is a no-op. Calls
/// with a closed handle return RDRAM_INVALID_ARGUMENT.
#[no_mangle]
pub extern "C" fn rdram_client_close(client: *mut rdram_client) {
    let entry = CLIENTS.remove(client as usize);
    // Freed here, or by the call using it when that call returns.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(entry)));
}

/// Stores a value. `key` (1 B–64 KiB) must not be NULL; `value` may be NULL when
/// `value_len` is 0, and may be host memory or CUDA device memory (asked of the CUDA
/// driver, when the machine has one). `generation_out` may be NULL; on success it
/// receives the new generation. Both buffers are borrowed for the call only.
#[no_mangle]
pub unsafe extern "C" fn rdram_put(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: the arguments go unchanged to `rdram_put_cond`, whose contract is this one's.
    unsafe { rdram_put_cond(client, key, key_len, value, value_len, std::ptr::null(), generation_out) }
}

/// Stores a value under a condition and/or with a TTL (`options` may be NULL). Returns
/// RDRAM_CONDITION_FAILED (nothing written) when the condition does not hold.
#[no_mangle]
pub unsafe extern "C" fn rdram_put_cond(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
    options: *const rdram_put_options,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: `key` and `value` point to `key_len` and `value_len` readable bytes (or are NULL, refused unless
    // the length is 0) and `options` is NULL or an `rdram_put_options`, all for the call, as the header
    // requires; the client reads `value` only before it returns.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let key = key_arg(key, key_len)?;
                if value.is_null() && value_len > 0 {
                    return Err(null_arg("value"));
                }
                let mut opts = PutOptions::default();
                if let Some(o) = options.as_ref() {
                    opts.condition = match (o.if_equal, flag(o.if_absent, "options.if_absent")?) {
                        (0, false) => WriteCondition::None,
                        (0, true) => WriteCondition::IfAbsent,
                        (g, false) => WriteCondition::IfEqual(g),
                        (_, true) => return Err(Error::new(Status::Invalid, "if_equal and if_absent are exclusive")),
                    };
                    opts.ttl = (o.ttl_ms > 0).then(|| Duration::from_millis(o.ttl_ms));
                }
                // Host or CUDA device memory: the client asks the driver.
                match c.put_from(key, value, value_len, &opts)? {
                    WriteResult::Written { generation } => {
                        write(generation_out, generation);
                        Ok(RDRAM_OK)
                    }
                    WriteResult::ConditionFailed => Ok(RDRAM_CONDITION_FAILED),
                }
            })
        })
    }
}

/// Reads a value into the caller's buffer `buf` of `buf_len` bytes (`buf` may be NULL when
/// `buf_len` is 0), host memory or CUDA device memory. On RDRAM_OK, `*value_len_out` is the value's length. On
/// RDRAM_BUFFER_TOO_SMALL, `*value_len_out` is the size needed and the value is untouched
/// on the server: call again with a big enough buffer. RDRAM_MISSING: no such key.
/// `value_len_out` and `generation_out` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn rdram_get(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    buf: *mut u8,
    buf_len: usize,
    value_len_out: *mut usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: the arguments go unchanged to `rdram_get_cond`, whose contract is this one's.
    unsafe { rdram_get_cond(client, key, key_len, std::ptr::null(), buf, buf_len, value_len_out, generation_out) }
}

/// Reads bytes [start, end) of a value (start < 0: from the end; end = -1: to the end)
/// into `buf`, as `rdram_get`. An invalid range gives RDRAM_OUT_OF_RANGE.
#[no_mangle]
pub unsafe extern "C" fn rdram_get_range(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    start: i64,
    end: i64,
    buf: *mut u8,
    buf_len: usize,
    value_len_out: *mut usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: `opts` lives until `rdram_get_cond` returns; the other arguments go to it unchanged.
    unsafe {
        let opts = rdram_get_options { if_not_equal: 0, if_equal: 0, has_range: 1, range_start: start, range_end: end };
        rdram_get_cond(client, key, key_len, &opts, buf, buf_len, value_len_out, generation_out)
    }
}

/// Reads a value under conditions and/or a byte range (`options` may be NULL), as
/// `rdram_get`. RDRAM_UNCHANGED: the condition did not match; `*generation_out` then
/// holds the current generation and no bytes were moved.
#[no_mangle]
pub unsafe extern "C" fn rdram_get_cond(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    options: *const rdram_get_options,
    buf: *mut u8,
    buf_len: usize,
    value_len_out: *mut usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: `key` has `key_len` readable bytes, `buf` has `buf_len` writable bytes (NULL refused unless 0)
    // that nothing else touches during the call, `options` is NULL or an `rdram_get_options`, and the
    // out-parameters are NULL or writable, as the header requires; the client writes `buf` only before it
    // returns.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let key = key_arg(key, key_len)?;
                if buf.is_null() && buf_len > 0 {
                    return Err(null_arg("buf"));
                }
                let opts = get_options(options)?;
                // Host or CUDA device memory: the client asks the driver.
                match c.get_into_ptr(key, &opts, buf, buf_len)? {
                    GetInto::Value { len, generation, .. } => {
                        write(value_len_out, len);
                        write(generation_out, generation);
                        Ok(RDRAM_OK)
                    }
                    GetInto::TooSmall { needed } => {
                        write(value_len_out, needed);
                        Err(Error::new(Status::BufferTooSmall, format!("value is {needed} bytes, buffer {buf_len}")))
                    }
                    GetInto::Missing => Ok(RDRAM_MISSING),
                    GetInto::Unchanged { generation } => {
                        write(generation_out, generation);
                        Ok(RDRAM_UNCHANGED)
                    }
                }
            })
        })
    }
}

/// Reads a value into a buffer the library allocates. On RDRAM_OK, `*buf_out` (never
/// NULL, even for an empty value) is owned by the caller and must be freed with
/// `rdram_buf_free(*buf_out, *len_out)`. `buf_out` and `len_out` must not be NULL;
/// `generation_out` may be.
#[no_mangle]
pub unsafe extern "C" fn rdram_get_alloc(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    buf_out: *mut *mut u8,
    len_out: *mut usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: the arguments go unchanged to `rdram_get_cond_alloc`, whose contract is this one's.
    unsafe { rdram_get_cond_alloc(client, key, key_len, std::ptr::null(), buf_out, len_out, generation_out) }
}

/// `rdram_get_cond` into a buffer the library allocates, as `rdram_get_alloc`: one round
/// trip whatever the value's size, and no buffer to size (or clear) beforehand.
/// RDRAM_UNCHANGED: the condition did not match; `*generation_out` then holds the current
/// generation, and `*buf_out` is left as it was.
#[no_mangle]
pub unsafe extern "C" fn rdram_get_cond_alloc(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    options: *const rdram_get_options,
    buf_out: *mut *mut u8,
    len_out: *mut usize,
    generation_out: *mut u64,
) -> rdram_status {
    // SAFETY: `key` has `key_len` readable bytes, `options` is NULL or an `rdram_get_options`, and the
    // out-parameters are writable (`buf_out` and `len_out` checked for NULL), as the header requires.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let key = key_arg(key, key_len)?;
                if buf_out.is_null() || len_out.is_null() {
                    return Err(null_arg("buf_out/len_out"));
                }
                let opts = get_options(options)?;
                match c.get_with(key, &opts)? {
                    GetResult::Value(v) => {
                        let (buf, len) = hand_out_buffer(v.data);
                        len_out.write(len);
                        buf_out.write(buf);
                        write(generation_out, v.generation);
                        Ok(RDRAM_OK)
                    }
                    GetResult::Missing => Ok(RDRAM_MISSING),
                    GetResult::Unchanged { generation } => {
                        write(generation_out, generation);
                        Ok(RDRAM_UNCHANGED)
                    }
                }
            })
        })
    }
}

/// Frees a buffer returned by `rdram_get_alloc`; `len` is the length returned with it
/// (the library knows it, and frees what it allocated whatever `len` says). NULL, a
/// buffer freed already, or one the library did not allocate is a no-op; but a buffer
/// freed twice after the library handed out another one at the same address frees that
/// one, as the address is all the library is given.
#[no_mangle]
pub extern "C" fn rdram_buf_free(buf: *mut u8, len: usize) {
    let _ = len;
    if !buf.is_null() {
        free_buffer(buf);
    }
}

/// Deletes a key. RDRAM_OK if it existed, RDRAM_MISSING if not.
#[no_mangle]
pub unsafe extern "C" fn rdram_delete(client: *mut rdram_client, key: *const u8, key_len: usize) -> rdram_status {
    // SAFETY: the arguments go unchanged to `rdram_delete_cond`, whose contract is this one's.
    unsafe { rdram_delete_cond(client, key, key_len, 0) }
}

/// Deletes a key only if its generation equals `if_equal` (0 = unconditional).
/// RDRAM_CONDITION_FAILED when it does not (or the key is missing); nothing changed.
#[no_mangle]
pub unsafe extern "C" fn rdram_delete_cond(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    if_equal: u64,
) -> rdram_status {
    // SAFETY: `key` has `key_len` readable bytes for the call (NULL refused), as the header requires.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let key = key_arg(key, key_len)?;
                let cond = if if_equal == 0 { WriteCondition::None } else { WriteCondition::IfEqual(if_equal) };
                Ok(match c.delete_with(key, cond)? {
                    DeleteResult::Deleted { existed: true } => RDRAM_OK,
                    DeleteResult::Deleted { existed: false } => RDRAM_MISSING,
                    DeleteResult::ConditionFailed => RDRAM_CONDITION_FAILED,
                })
            })
        })
    }
}

/// Deletes every key in [min, max). `max` NULL means unbounded (then `max_len` is
/// ignored). `removed_out` may be NULL; it receives the number of keys removed.
#[no_mangle]
pub unsafe extern "C" fn rdram_delete_range(
    client: *mut rdram_client,
    min: *const u8,
    min_len: usize,
    max: *const u8,
    max_len: usize,
    removed_out: *mut u64,
) -> rdram_status {
    // SAFETY: `min` and `max` have `min_len` and `max_len` readable bytes for the call (NULL `max`: unbounded),
    // and `removed_out` is NULL or writable, as the header requires.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let range = key_range(min, min_len, max, max_len)?;
                let n = c.delete_range(&range)?;
                write(removed_out, n);
                Ok(RDRAM_OK)
            })
        })
    }
}

/// Lists the keys in [min, max) (`max` NULL: unbounded) in key order, calling `callback`
/// with `userdata` for each, with the value's size. `callback` must not be NULL; a call on
/// this client from inside it returns RDRAM_INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn rdram_list(
    client: *mut rdram_client,
    min: *const u8,
    min_len: usize,
    max: *const u8,
    max_len: usize,
    callback: rdram_list_callback,
    userdata: *mut c_void,
) -> rdram_status {
    // SAFETY: `min` and `max` are readable for their lengths for the call, and `callback` is a function that
    // takes `userdata` and a key valid during its call, as the header requires.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                let range = key_range(min, min_len, max, max_len)?;
                let cb = callback.ok_or_else(|| null_arg("callback"))?;
                for e in c.list(&range)? {
                    if cb(userdata, e.key.as_ptr(), e.key.len(), e.size) != 0 {
                        break;
                    }
                }
                Ok(RDRAM_OK)
            })
        })
    }
}

/// Lists the keys starting with `prefix` (may be NULL when `prefix_len` is 0), as
/// `rdram_list`.
#[no_mangle]
pub unsafe extern "C" fn rdram_list_prefix(
    client: *mut rdram_client,
    prefix: *const u8,
    prefix_len: usize,
    callback: rdram_list_callback,
    userdata: *mut c_void,
) -> rdram_status {
    // SAFETY: `prefix` has `prefix_len` readable bytes for the call; the range built from it lives until
    // `rdram_list` returns.
    unsafe {
        guard(|| {
            let p = bytes(prefix, prefix_len, "prefix")?;
            let range = KeyRange::prefix(p);
            let (max, max_len) = range.max.as_ref().map_or((std::ptr::null(), 0), |m| (m.as_ptr(), m.len()));
            Ok(rdram_list(client, range.min.as_ptr(), range.min.len(), max, max_len, callback, userdata))
        })
    }
}

/// Server statistics as a NUL-terminated JSON document. On success `*json_out` is owned by
/// the caller and must be freed with `rdram_string_free`.
#[no_mangle]
pub unsafe extern "C" fn rdram_stats(client: *mut rdram_client, json_out: *mut *mut c_char) -> rdram_status {
    // SAFETY: `json_out` is writable (checked for NULL), as the header requires.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                if json_out.is_null() {
                    return Err(null_arg("json_out"));
                }
                let text = c.stats()?.to_string();
                json_out.write(
                    std::ffi::CString::new(text).map_err(|e| Error::new(Status::Internal, e.to_string()))?.into_raw(),
                );
                Ok(RDRAM_OK)
            })
        })
    }
}

/// Frees a string returned by the library (`rdram_stats`). NULL is allowed.
#[no_mangle]
pub unsafe extern "C" fn rdram_string_free(s: *mut c_char) {
    // SAFETY: `s` came from `CString::into_raw` in `rdram_stats` and is given back once.
    unsafe {
        if !s.is_null() {
            drop(std::ffi::CString::from_raw(s));
        }
    }
}

/// Registers caller memory [addr, addr+len) with the transport, so that puts from it and
/// gets into it move without per-call registration. The memory stays owned by the
/// caller, who must keep it mapped until `rdram_deregister(client, addr)` or
/// `rdram_client_close` returns: the registration holds the transport's (on RDMA
/// transports, the NIC's) translation of those pages, and a call that moves bytes from or
/// to that range after they were unmapped could move other memory's bytes. Between calls
/// nothing touches the memory.
#[no_mangle]
pub unsafe extern "C" fn rdram_register(client: *mut rdram_client, addr: *mut c_void, len: usize) -> rdram_status {
    // SAFETY: `addr` is `len` bytes of the caller's memory that stay valid until deregistered or the client is
    // closed: the contract of `Client::register`, stated in the header.
    unsafe {
        guard(|| {
            with_client(client, |c| {
                if addr.is_null() {
                    return Err(null_arg("addr"));
                }
                if len == 0 {
                    return Err(Error::new(Status::Invalid, "cannot register 0 bytes"));
                }
                c.register(addr as *mut u8, len)?;
                Ok(RDRAM_OK)
            })
        })
    }
}

/// Deregisters memory registered with `rdram_register` at `addr`.
#[no_mangle]
pub extern "C" fn rdram_deregister(client: *mut rdram_client, addr: *mut c_void) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            c.deregister(addr as *mut u8)?;
            Ok(RDRAM_OK)
        })
    })
}

pub(super) unsafe fn key_arg<'a>(key: *const u8, key_len: usize) -> Result<&'a [u8], Error> {
    // SAFETY: a non-NULL `key` points to `key_len` readable bytes (the exports' contract).
    unsafe {
        if key.is_null() {
            return Err(null_arg("key"));
        }
        bytes(key, key_len, "key")
    }
}

unsafe fn key_range(min: *const u8, min_len: usize, max: *const u8, max_len: usize) -> Result<KeyRange, Error> {
    // SAFETY: `min` and a non-NULL `max` point to `min_len` and `max_len` readable bytes (the exports'
    // contract).
    unsafe {
        Ok(KeyRange {
            min: bytes(min, min_len, "min")?.to_vec(),
            max: if max.is_null() { None } else { Some(bytes(max, max_len, "max")?.to_vec()) },
        })
    }
}

unsafe fn get_options(options: *const rdram_get_options) -> Result<GetOptions, Error> {
    // SAFETY: `options` is NULL or points to an `rdram_get_options` (the exports' contract).
    unsafe {
        Ok(match options.as_ref() {
            None => GetOptions::default(),
            Some(o) => GetOptions {
                if_not_equal: (o.if_not_equal != 0).then_some(o.if_not_equal),
                if_equal: (o.if_equal != 0).then_some(o.if_equal),
                range: flag(o.has_range, "options.has_range")?
                    .then_some(ByteRange { start: o.range_start, end: o.range_end }),
            },
        })
    }
}
