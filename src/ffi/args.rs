//! Audited conversions of what C passes in: the exports' only unsafe steps besides the
//! calls out to C (a list callback) and the registration of caller memory. Each function
//! here states, as its `# Safety`, the part of the header's contract it relies on; an
//! export converts each pointer argument once, in an `unsafe` block whose SAFETY line
//! names that argument's contract, and its body is safe code after that. Out-parameters
//! and option structs need no conversion: the exports take them as `Option<&mut T>` and
//! `Option<&T>`, which are C's nullable pointers.

use std::ffi::{c_char, CStr};
use std::marker::PhantomData;

use super::null_arg;
use crate::client::{Client, GetInto, GetOptions, PutOptions, WriteResult};
use crate::error::{Error, Status};
use crate::gpu::{kind_of, MemoryKind};

/// `n` things of `size` bytes: refused when no object in memory can be that long
/// (`from_raw_parts`' limit), which C's `size_t` can still say.
fn check_len(n: usize, size: usize, name: &str) -> Result<(), Error> {
    match n.checked_mul(size.max(1)) {
        Some(bytes) if bytes <= isize::MAX as usize => Ok(()),
        _ => Err(Error::new(Status::Invalid, format!("{name}'s length {n} is more than memory can hold"))),
    }
}

/// `len` bytes at `ptr`, lent for the call (NULL allowed only when `len` is 0).
///
/// # Safety
/// A non-NULL `ptr` points to `len` readable bytes of host memory that nothing writes
/// while `'a` lasts.
pub(super) unsafe fn bytes<'a>(ptr: *const u8, len: usize, name: &str) -> Result<&'a [u8], Error> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null_arg(name));
    }
    check_len(len, 1, name)?;
    // SAFETY: non-NULL, `len` readable bytes unwritten for `'a` (this function's contract),
    // and `len` fits an object (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// As [`bytes()`], with NULL meaning "not given".
///
/// # Safety
/// As [`bytes()`].
pub(super) unsafe fn optional_bytes<'a>(ptr: *const u8, len: usize, name: &str) -> Result<Option<&'a [u8]>, Error> {
    match ptr.is_null() {
        true => Ok(None),
        // SAFETY: this function's contract is `bytes`'.
        false => unsafe { bytes(ptr, len, name) }.map(Some),
    }
}

/// A key: as [`bytes()`], but never NULL.
///
/// # Safety
/// As [`bytes()`].
pub(super) unsafe fn key<'a>(ptr: *const u8, len: usize) -> Result<&'a [u8], Error> {
    if ptr.is_null() {
        return Err(null_arg("key"));
    }
    // SAFETY: this function's contract is `bytes`'.
    unsafe { bytes(ptr, len, "key") }
}

/// A NUL-terminated UTF-8 string, lent for the call; NULL is refused.
///
/// # Safety
/// A non-NULL `ptr` is a NUL-terminated string that nothing writes while `'a` lasts.
pub(super) unsafe fn c_str<'a>(ptr: *const c_char, name: &str) -> Result<&'a str, Error> {
    if ptr.is_null() {
        return Err(null_arg(name));
    }
    // SAFETY: non-NULL and NUL-terminated, unwritten for `'a` (this function's contract).
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str().map_err(|_| Error::new(Status::Invalid, format!("{name} is not valid UTF-8")))
}

/// As [`c_str`], with NULL meaning "not given".
///
/// # Safety
/// As [`c_str`].
pub(super) unsafe fn optional_c_str<'a>(ptr: *const c_char, name: &str) -> Result<Option<&'a str>, Error> {
    match ptr.is_null() {
        true => Ok(None),
        // SAFETY: this function's contract is `c_str`'s.
        false => unsafe { c_str(ptr, name) }.map(Some),
    }
}

/// `n` values at `ptr`, lent for the call to read (NULL: none, whatever `n` says).
///
/// # Safety
/// A non-NULL `ptr` points to `n` initialised values that nothing writes while `'a` lasts.
pub(super) unsafe fn optional_slice<'a, T>(ptr: *const T, n: usize, name: &str) -> Result<&'a [T], Error> {
    if ptr.is_null() || n == 0 {
        return Ok(&[]);
    }
    check_len(n, std::mem::size_of::<T>(), name)?;
    // SAFETY: non-NULL, `n` initialised values unwritten for `'a` (this function's
    // contract), and their size fits an object (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// `n` items at `ptr`, lent for the call to read and fill in (NULL allowed only when `n`
/// is 0).
///
/// # Safety
/// A non-NULL `ptr` points to `n` initialised items that nothing else reads or writes
/// while `'a` lasts.
pub(super) unsafe fn items<'a, T>(ptr: *mut T, n: usize) -> Result<&'a mut [T], Error> {
    if n == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(null_arg("items"));
    }
    check_len(n, std::mem::size_of::<T>(), "items")?;
    // SAFETY: non-NULL, `n` initialised items that only this call touches for `'a` (this
    // function's contract), and their size fits an object (checked).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, n) })
}

/// Whether `len` bytes at `ptr` are device memory (moved by staging) rather than host memory.
fn on_device(ptr: *const u8, len: usize) -> bool {
    len > 0 && kind_of(ptr as usize) != MemoryKind::Host
}

/// The caller's memory a value is put from, host or CUDA device memory, lent for the call.
pub(super) struct Source<'call> {
    ptr: *const u8,
    len: usize,
    _lent: PhantomData<&'call [u8]>,
}

impl<'call> Source<'call> {
    /// `len` bytes at `ptr` (NULL allowed only when `len` is 0).
    ///
    /// # Safety
    /// A non-NULL `ptr` is `len` bytes of host or CUDA device memory, readable and
    /// unwritten while `'call` lasts.
    pub(super) unsafe fn new(ptr: *const u8, len: usize, name: &str) -> Result<Source<'call>, Error> {
        if ptr.is_null() && len > 0 {
            return Err(null_arg(name));
        }
        check_len(len, 1, name)?;
        Ok(Source { ptr, len, _lent: PhantomData })
    }

    /// The bytes, when they are host memory.
    pub(super) fn host_bytes(&self) -> Option<&'call [u8]> {
        if on_device(self.ptr, self.len) {
            return None;
        }
        // SAFETY: host memory (asked above), readable and unwritten for `'call` (`new`'s
        // contract; NULL only when `len` is 0, which `bytes` takes).
        unsafe { bytes(self.ptr, self.len, "value") }.ok()
    }

    /// Puts the value under `key`; the client reads it only before it returns.
    pub(super) fn put(&self, client: &mut Client, key: &[u8], opts: &PutOptions) -> crate::Result<WriteResult> {
        // SAFETY: `len` bytes of host or device memory readable for the call (`new`'s contract).
        unsafe { client.put_from(key, self.ptr, self.len, opts) }
    }
}

/// The caller's buffer a value is read into, host or CUDA device memory, lent for the call.
pub(super) struct Sink<'call> {
    ptr: *mut u8,
    len: usize,
    _lent: PhantomData<&'call mut [u8]>,
}

impl<'call> Sink<'call> {
    /// `len` bytes at `ptr` (NULL allowed only when `len` is 0).
    ///
    /// # Safety
    /// A non-NULL `ptr` is `len` bytes of host or CUDA device memory, writable and touched
    /// by nothing else while `'call` lasts.
    pub(super) unsafe fn new(ptr: *mut u8, len: usize, name: &str) -> Result<Sink<'call>, Error> {
        if ptr.is_null() && len > 0 {
            return Err(null_arg(name));
        }
        check_len(len, 1, name)?;
        Ok(Sink { ptr, len, _lent: PhantomData })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The buffer as a slice when it is host memory; itself back when it is device memory
    /// (the driver is asked once).
    pub(super) fn into_host(self) -> Result<&'call mut [u8], Sink<'call>> {
        if on_device(self.ptr, self.len) {
            return Err(self);
        }
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: non-NULL host memory (asked above; NULL only when `len` is 0), writable
        // and touched by nothing else for `'call` (`new`'s contract); `self` is consumed,
        // so this is the one slice over it.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Reads `key`'s value into the buffer; the client writes it only before it returns.
    pub(super) fn get_into(&mut self, client: &mut Client, key: &[u8], opts: &GetOptions) -> crate::Result<GetInto> {
        // SAFETY: `len` bytes of host or device memory writable for the call and touched by
        // nothing else (`new`'s contract).
        unsafe { client.get_into_ptr(key, opts, self.ptr, self.len) }
    }
}
