//! C ABI: the client handle and its operations.

use std::ffi::{c_char, c_void};
use std::sync::{Mutex, TryLockError};
use std::time::Duration;

use super::handles::{free_buffer, hand_out_buffer, Handles};
use super::{args, guard, null_arg, rdram_status, set};
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

/// Connects to one or more servers (`"host:port"` or `"a:7000,b:7001"`), or to the live
/// members of a cluster on etcd (`"etcd://HOST:PORT[,HOST:PORT...]/NAME"`), followed as
/// they change.
///
/// `addresses` must not be NULL. `options` may be NULL (defaults). On success `*out`
/// receives a client owned by the caller, to be freed with `rdram_client_close`.
#[no_mangle]
pub unsafe extern "C" fn rdram_client_connect(
    addresses: *const c_char,
    options: Option<&rdram_client_options>,
    out: Option<&mut *mut rdram_client>,
) -> rdram_status {
    // SAFETY: `addresses` and `options.auth_token` are NULL or NUL-terminated strings for the call (the
    // header's contract).
    let (addresses, auth_token) = unsafe {
        let token = options.map(|o| args::optional_c_str(o.auth_token, "options.auth_token"));
        (args::c_str(addresses, "addresses"), token)
    };
    guard(|| {
        let addresses = addresses?;
        let out = out.ok_or_else(|| null_arg("out"))?;
        let mut opts = ClientOptions::default();
        if let Some(o) = options {
            opts.auth_token = auth_token.transpose()?.flatten().map(str::to_string);
            opts.poll = poll_mode(o.poll_mode, "options.poll_mode")?;
            if o.timeout_ms > 0 {
                opts.timeout = Duration::from_millis(o.timeout_ms as u64);
            }
            if o.connect_timeout_ms > 0 {
                opts.connect_timeout = Duration::from_millis(o.connect_timeout_ms as u64);
            }
        }
        *out = CLIENTS.insert(Mutex::new(Client::connect(addresses, opts)?)) as *mut rdram_client;
        Ok(RDRAM_OK)
    })
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
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` and `value` are readable for their lengths for the call (the header's contract).
    let (key, value) = unsafe { (args::key(key, key_len), args::Source::new(value, value_len, "value")) };
    put(client, key, value, None, generation_out)
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
    options: Option<&rdram_put_options>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` and `value` are readable for their lengths for the call (the header's contract).
    let (key, value) = unsafe { (args::key(key, key_len), args::Source::new(value, value_len, "value")) };
    put(client, key, value, options, generation_out)
}

fn put(
    client: *mut rdram_client,
    key: Result<&[u8], Error>,
    value: Result<args::Source, Error>,
    options: Option<&rdram_put_options>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let (key, value) = (key?, value?);
            let mut opts = PutOptions::default();
            if let Some(o) = options {
                opts.condition = match (o.if_equal, flag(o.if_absent, "options.if_absent")?) {
                    (0, false) => WriteCondition::None,
                    (0, true) => WriteCondition::IfAbsent,
                    (g, false) => WriteCondition::IfEqual(g),
                    (_, true) => return Err(Error::new(Status::Invalid, "if_equal and if_absent are exclusive")),
                };
                opts.ttl = (o.ttl_ms > 0).then(|| Duration::from_millis(o.ttl_ms));
            }
            // Host or CUDA device memory: the client asks the driver.
            match value.put(c, key, &opts)? {
                WriteResult::Written { generation } => {
                    set(generation_out, generation);
                    Ok(RDRAM_OK)
                }
                WriteResult::ConditionFailed => Ok(RDRAM_CONDITION_FAILED),
            }
        })
    })
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
    value_len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` is readable and `buf` writable (and used by nothing else) for their lengths for the call
    // (the header's contract).
    let (key, buf) = unsafe { (args::key(key, key_len), args::Sink::new(buf, buf_len, "buf")) };
    get(client, key, Ok(GetOptions::default()), buf, value_len_out, generation_out)
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
    value_len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` is readable and `buf` writable (and used by nothing else) for their lengths for the call
    // (the header's contract).
    let (key, buf) = unsafe { (args::key(key, key_len), args::Sink::new(buf, buf_len, "buf")) };
    let opts = GetOptions { range: Some(ByteRange { start, end }), ..Default::default() };
    get(client, key, Ok(opts), buf, value_len_out, generation_out)
}

/// Reads a value under conditions and/or a byte range (`options` may be NULL), as
/// `rdram_get`. RDRAM_UNCHANGED: the condition did not match; `*generation_out` then
/// holds the current generation and no bytes were moved.
#[no_mangle]
pub unsafe extern "C" fn rdram_get_cond(
    client: *mut rdram_client,
    key: *const u8,
    key_len: usize,
    options: Option<&rdram_get_options>,
    buf: *mut u8,
    buf_len: usize,
    value_len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` is readable and `buf` writable (and used by nothing else) for their lengths for the call
    // (the header's contract).
    let (key, buf) = unsafe { (args::key(key, key_len), args::Sink::new(buf, buf_len, "buf")) };
    get(client, key, get_options(options), buf, value_len_out, generation_out)
}

fn get(
    client: *mut rdram_client,
    key: Result<&[u8], Error>,
    opts: Result<GetOptions, Error>,
    buf: Result<args::Sink, Error>,
    value_len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let (key, mut buf) = (key?, buf?);
            // Host or CUDA device memory: the client asks the driver.
            match buf.get_into(c, key, &opts?)? {
                GetInto::Value { len, generation, .. } => {
                    set(value_len_out, len);
                    set(generation_out, generation);
                    Ok(RDRAM_OK)
                }
                GetInto::TooSmall { needed } => {
                    set(value_len_out, needed);
                    Err(Error::new(Status::BufferTooSmall, format!("value is {needed} bytes, buffer {}", buf.len())))
                }
                GetInto::Missing => Ok(RDRAM_MISSING),
                GetInto::Unchanged { generation } => {
                    set(generation_out, generation);
                    Ok(RDRAM_UNCHANGED)
                }
            }
        })
    })
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
    buf_out: Option<&mut *mut u8>,
    len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` is readable for `key_len` bytes for the call (the header's contract).
    let key = unsafe { args::key(key, key_len) };
    get_alloc(client, key, None, buf_out, len_out, generation_out)
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
    options: Option<&rdram_get_options>,
    buf_out: Option<&mut *mut u8>,
    len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `key` is readable for `key_len` bytes for the call (the header's contract).
    let key = unsafe { args::key(key, key_len) };
    get_alloc(client, key, options, buf_out, len_out, generation_out)
}

fn get_alloc(
    client: *mut rdram_client,
    key: Result<&[u8], Error>,
    options: Option<&rdram_get_options>,
    buf_out: Option<&mut *mut u8>,
    len_out: Option<&mut usize>,
    generation_out: Option<&mut u64>,
) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let key = key?;
            let (Some(buf_out), Some(len_out)) = (buf_out, len_out) else {
                return Err(null_arg("buf_out/len_out"));
            };
            match c.get_with(key, &get_options(options)?)? {
                GetResult::Value(v) => {
                    (*buf_out, *len_out) = hand_out_buffer(v.data);
                    set(generation_out, v.generation);
                    Ok(RDRAM_OK)
                }
                GetResult::Missing => Ok(RDRAM_MISSING),
                GetResult::Unchanged { generation } => {
                    set(generation_out, generation);
                    Ok(RDRAM_UNCHANGED)
                }
            }
        })
    })
}

/// Frees a buffer returned by `rdram_get_alloc`; `len` is the length returned with it
/// (the library knows it, and frees what it allocated whatever `len` says). NULL, a
/// buffer freed already, or one the library did not allocate is a no-op; but a buffer
/// freed twice after the library handed out another one at the same address frees that
/// one, as the address is all the library is given.
#[no_mangle]
pub extern "C" fn rdram_buf_free(buf: *mut u8, len: usize) {
    let _ = len;
    free_buffer(buf);
}

/// Deletes a key. RDRAM_OK if it existed, RDRAM_MISSING if not.
#[no_mangle]
pub unsafe extern "C" fn rdram_delete(client: *mut rdram_client, key: *const u8, key_len: usize) -> rdram_status {
    // SAFETY: `key` is readable for `key_len` bytes for the call (the header's contract).
    let key = unsafe { args::key(key, key_len) };
    delete(client, key, 0)
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
    // SAFETY: `key` is readable for `key_len` bytes for the call (the header's contract).
    let key = unsafe { args::key(key, key_len) };
    delete(client, key, if_equal)
}

fn delete(client: *mut rdram_client, key: Result<&[u8], Error>, if_equal: u64) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let key = key?;
            let cond = if if_equal == 0 { WriteCondition::None } else { WriteCondition::IfEqual(if_equal) };
            Ok(match c.delete_with(key, cond)? {
                DeleteResult::Deleted { existed: true } => RDRAM_OK,
                DeleteResult::Deleted { existed: false } => RDRAM_MISSING,
                DeleteResult::ConditionFailed => RDRAM_CONDITION_FAILED,
            })
        })
    })
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
    removed_out: Option<&mut u64>,
) -> rdram_status {
    // SAFETY: `min` and a non-NULL `max` are readable for their lengths for the call (the header's contract).
    let range = unsafe { key_range(min, min_len, max, max_len) };
    guard(|| {
        with_client(client, |c| {
            let n = c.delete_range(&range?)?;
            set(removed_out, n);
            Ok(RDRAM_OK)
        })
    })
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
    // SAFETY: `min` and a non-NULL `max` are readable for their lengths for the call (the header's contract).
    let range = unsafe { key_range(min, min_len, max, max_len) };
    list(client, range, callback, userdata)
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
    // SAFETY: `prefix` is readable for `prefix_len` bytes for the call (the header's contract).
    let prefix = unsafe { args::bytes(prefix, prefix_len, "prefix") };
    list(client, prefix.map(KeyRange::prefix), callback, userdata)
}

fn list(
    client: *mut rdram_client,
    range: Result<KeyRange, Error>,
    callback: rdram_list_callback,
    userdata: *mut c_void,
) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let range = range?;
            let callback = callback.ok_or_else(|| null_arg("callback"))?;
            for e in c.list(&range)? {
                // SAFETY: `callback` takes `userdata` and a key valid during its call (the header's
                // contract); the key is `e.key`, alive until the next turn of the loop.
                if unsafe { callback(userdata, e.key.as_ptr(), e.key.len(), e.size) } != 0 {
                    break;
                }
            }
            Ok(RDRAM_OK)
        })
    })
}

/// Server statistics as a NUL-terminated JSON document. On success `*json_out` is owned by
/// the caller and must be freed with `rdram_string_free`.
#[no_mangle]
pub extern "C" fn rdram_stats(client: *mut rdram_client, json_out: Option<&mut *mut c_char>) -> rdram_status {
    guard(|| {
        with_client(client, |c| {
            let json_out = json_out.ok_or_else(|| null_arg("json_out"))?;
            let mut text = c.stats()?.to_string().into_bytes();
            text.push(0);
            *json_out = hand_out_buffer(text).0.cast();
            Ok(RDRAM_OK)
        })
    })
}

/// Frees a string returned by the library (`rdram_stats`). NULL, a string freed already,
/// or one the library did not hand out is a no-op (as for `rdram_buf_free`).
#[no_mangle]
pub extern "C" fn rdram_string_free(s: *mut c_char) {
    free_buffer(s.cast());
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
    guard(|| {
        with_client(client, |c| {
            if addr.is_null() {
                return Err(null_arg("addr"));
            }
            if len == 0 {
                return Err(Error::new(Status::Invalid, "cannot register 0 bytes"));
            }
            // SAFETY: `addr` is `len` bytes of the caller's memory that stay mapped until deregistered or the
            // client is closed: `Client::register`'s contract, which the header states.
            unsafe { c.register(addr.cast(), len) }?;
            Ok(RDRAM_OK)
        })
    })
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

/// [min, max) as C passes it (`max` NULL: unbounded).
///
/// # Safety
/// As [`args::bytes`] for `min` and a non-NULL `max`.
unsafe fn key_range(min: *const u8, min_len: usize, max: *const u8, max_len: usize) -> Result<KeyRange, Error> {
    // SAFETY: this function's contract.
    let (min, max) = unsafe { (args::bytes(min, min_len, "min")?, args::optional_bytes(max, max_len, "max")?) };
    Ok(KeyRange { min: min.to_vec(), max: max.map(<[u8]>::to_vec) })
}

fn get_options(options: Option<&rdram_get_options>) -> Result<GetOptions, Error> {
    Ok(match options {
        None => GetOptions::default(),
        Some(o) => GetOptions {
            if_not_equal: (o.if_not_equal != 0).then_some(o.if_not_equal),
            if_equal: (o.if_equal != 0).then_some(o.if_equal),
            range: flag(o.has_range, "options.has_range")?
                .then_some(ByteRange { start: o.range_start, end: o.range_end }),
        },
    })
}
