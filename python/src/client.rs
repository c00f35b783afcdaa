//! `remote_dram.Client`: the Rust [`Client`] behind a mutex, with the GIL released for
//! every call that touches the network.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use remote_dram::client::{
    ByteRange, Client, ClientOptions, DeleteResult, GetInto, GetOptions, KeyRange, PutOptions, WriteCondition,
    WriteResult,
};
use remote_dram::error::{Error, Status};
use remote_dram::transport::PollMode;

use crate::buffer::{Buffer, RawBytes};
use crate::errors::{buffer_too_small, in_batch, invalid, to_py};
use remote_dram::client::tunables::{BATCH_DEPTH, PARTS_BATCH_DEPTH};

/// A put's generation; an unconditional put whose condition failed is an internal error.
fn written(w: remote_dram::Result<WriteResult>) -> remote_dram::Result<u64> {
    match w? {
        WriteResult::Written { generation } => Ok(generation),
        WriteResult::ConditionFailed => {
            Err(Error::new(Status::Internal, "an unconditional put reported a failed condition"))
        }
    }
}

/// A connection to one or more remote_dram servers.
///
/// ``Client("127.0.0.1:7000")`` or ``Client("a:7000,b:7000", auth_token=...)`` for a
/// cluster (keys are spread over servers by rendezvous hashing). ``timeout`` and
/// ``connect_timeout`` are in seconds (defaults 30 and 5). ``poll="busy"`` spins on
/// the network instead of sleeping between replies: lower latency for benchmarks on a
/// dedicated core; the default, ``"adaptive"``, spins briefly and then sleeps.
///
/// Keys are ``bytes`` or ``str`` (UTF-8). Values are anything with the buffer protocol
/// (bytes, bytearray, memoryview, C-contiguous numpy arrays) or CPU torch tensors, and
/// move without a copy. CUDA device memory is taken too: torch CUDA tensors, objects with
/// ``__cuda_array_interface__`` (CuPy) or a CUDA ``__dlpack__`` (JAX); it is staged
/// through pinned host buffers of the client's own.
///
/// Every call releases the GIL while it waits for the network. One client may be shared
/// by threads: its calls are serialised, one at a time. For parallel transfers open one
/// client per thread (each has its own connection to every server).
///
/// A lost server makes the calls in flight to it raise ``Unavailable``; the next call
/// connects again. Use as a context manager, or call ``close()``.
#[pyclass(module = "remote_dram", name = "Client", frozen)]
pub struct PyClient {
    /// `None` once closed.
    connected: Mutex<Option<Connected>>,
    addresses: String,
}

struct Connected {
    client: Client,
    /// Where `get` and `get_many` receive values of unknown size, one slot of
    /// `SCRATCH_LEN` per request in flight: reused, so its pages stay mapped and registered
    /// (a fresh allocation per call costs page faults and a registration). Grown on use.
    slots: Vec<u8>,
}

/// The first `n` slots of `slots`, grown to hold them.
fn first_slots(slots: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if slots.len() < n * SCRATCH_LEN {
        slots.resize(n * SCRATCH_LEN, 0);
    }
    &mut slots[..n * SCRATCH_LEN]
}

/// Values up to this size are received into a slot and copied into `bytes`;
/// larger ones go straight into a `bytes` object of the size the first reply reported.
const SCRATCH_LEN: usize = 64 << 10;

/// What a `get` found.
enum Fetched<'py> {
    Value { bytes: Bound<'py, PyBytes>, generation: u64, size: u64 },
    Missing,
    Unchanged { generation: u64 },
}

/// A stored value with its metadata, as ``get_entry`` returns it.
#[pyclass(module = "remote_dram", name = "Entry", frozen, get_all)]
pub struct Entry {
    /// The bytes (of the range, if one was asked for), or ``None`` when the generation
    /// matched ``if_not_equal`` (unchanged; no bytes moved).
    value: Option<Py<PyBytes>>,
    /// The value's generation: it grows with every write of the key.
    generation: u64,
    /// The size of the whole stored value (``value`` may be a range of it); 0 when
    /// unchanged.
    size: u64,
}

#[pymethods]
impl Entry {
    fn __repr__(&self, py: Python<'_>) -> String {
        let value = match &self.value {
            Some(v) => format!("<{} bytes>", v.bind(py).as_bytes().len()),
            None => "None (unchanged)".into(),
        };
        format!("Entry(value={value}, generation={}, size={})", self.generation, self.size)
    }
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (addresses, *, auth_token=None, timeout=None, connect_timeout=None, poll="adaptive"))]
    fn new(
        py: Python<'_>,
        addresses: String,
        auth_token: Option<String>,
        timeout: Option<f64>,
        connect_timeout: Option<f64>,
        poll: &str,
    ) -> PyResult<Self> {
        let poll = match poll {
            "adaptive" => PollMode::Adaptive,
            "busy" => PollMode::Busy,
            other => return Err(invalid(py, format!("poll must be \"adaptive\" or \"busy\", not {other:?}"))),
        };
        let mut opts = ClientOptions { auth_token, poll, ..ClientOptions::default() };
        if let Some(t) = timeout {
            opts.timeout = seconds(py, t, "timeout")?;
        }
        if let Some(t) = connect_timeout {
            opts.connect_timeout = seconds(py, t, "connect_timeout")?;
        }
        let client = py.detach(|| Client::connect(&addresses, opts)).map_err(|e| to_py(py, e))?;
        Ok(PyClient { connected: Mutex::new(Some(Connected { client, slots: Vec::new() })), addresses })
    }

    /// Closes the connections. Later calls raise ``InvalidArgument``; closing twice is fine.
    fn close(&self, py: Python<'_>) {
        // Closing talks to the servers: without the GIL, like every call.
        py.detach(|| drop(self.lock().take()));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("remote_dram.Client({:?})", self.addresses)
    }

    /// Stores ``value`` under ``key`` and returns its new generation.
    ///
    /// ``if_equal=g`` writes only if the current generation is ``g``; ``if_absent=True``
    /// only if the key does not exist. When the condition does not hold nothing changes
    /// and the result is ``None``. ``ttl`` (seconds) makes the value expire.
    ///
    /// The value is read in place, without a copy, while the GIL is released: do not
    /// change it from another thread during the call. After the call returns (even with
    /// ``Timeout``) the server never reads it again.
    #[pyo3(signature = (key, value, *, if_equal=None, if_absent=false, ttl=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: Key,
        value: &Bound<'_, PyAny>,
        if_equal: Option<u64>,
        if_absent: bool,
        ttl: Option<f64>,
    ) -> PyResult<Option<u64>> {
        let opts = put_options(py, if_equal, if_absent, ttl)?;
        let value = Buffer::readable(value)?;
        let bytes = value.raw();
        // SAFETY: `value` stays exported until after the call returns; host or device
        // memory, as the client asks the driver.
        let written =
            self.call(py, |c| unsafe { c.put_from(&key.0, bytes.addr() as *const u8, bytes.len(), &opts) })?;
        Ok(generation_of(written))
    }

    /// Stores the concatenation of ``parts`` (buffers in host memory: a header and a body,
    /// say) under ``key``, as ``put`` would, without joining them in memory: large values
    /// are staged on the server a part at a time, then committed whole; readers see the
    /// value whole or not at all. Conditions, TTL and result as ``put``'s.
    #[pyo3(signature = (key, parts, *, if_equal=None, if_absent=false, ttl=None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: Key,
        parts: Vec<Bound<'_, PyAny>>,
        if_equal: Option<u64>,
        if_absent: bool,
        ttl: Option<f64>,
    ) -> PyResult<Option<u64>> {
        let opts = put_options(py, if_equal, if_absent, ttl)?;
        let parts = parts.iter().map(Buffer::readable).collect::<PyResult<Vec<_>>>()?;
        if parts.iter().any(Buffer::on_device) {
            return Err(invalid(py, "put_parts takes host memory only: put a device buffer with put"));
        }
        let raw: Vec<RawBytes> = parts.iter().map(Buffer::raw).collect();
        let written = self.call(py, |c| {
            // SAFETY: every part stays exported (and so unchanged in place) until after the
            // call returns, and is host memory (checked above).
            let slices: Vec<&[u8]> = raw.iter().map(|b| unsafe { b.as_slice() }).collect();
            c.put_parts(&key.0, &slices, &opts)
        })?;
        Ok(generation_of(written))
    }

    /// ``put_parts`` of many values, pipelined (8 values at a time): ``items`` is
    /// an iterable of ``(key, parts)``. Each value's parts go one after another, the values
    /// side by side. Returns the new generations in order; ``ttl`` as ``put``'s. If an item
    /// fails, its exception is raised after the whole batch has been sent, with ``.index``
    /// naming the item.
    #[pyo3(signature = (items, *, ttl=None))]
    fn put_parts_many(&self, py: Python<'_>, items: &Bound<'_, PyAny>, ttl: Option<f64>) -> PyResult<Vec<u64>> {
        let opts = put_options(py, None, false, ttl)?;
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for item in items.try_iter()? {
            let (key, parts): (Key, Vec<Bound<'_, PyAny>>) = item?.extract()?;
            let parts = parts.iter().map(Buffer::readable).collect::<PyResult<Vec<_>>>()?;
            if parts.iter().any(Buffer::on_device) {
                return Err(invalid(py, "put_parts_many takes host memory only: put a device buffer with put"));
            }
            keys.push(key.0);
            values.push(parts);
        }
        let raw: Vec<Vec<RawBytes>> = values.iter().map(|parts| parts.iter().map(Buffer::raw).collect()).collect();
        let results = self.call(py, |c| {
            // SAFETY: every part stays exported (and so unchanged in place) until after the
            // call returns, and is host memory (checked above).
            let slices: Vec<Vec<&[u8]>> =
                raw.iter().map(|parts| parts.iter().map(|b| unsafe { b.as_slice() }).collect()).collect();
            let items: Vec<(&[u8], &[&[u8]])> =
                keys.iter().zip(&slices).map(|(k, parts)| (k.as_slice(), parts.as_slice())).collect();
            Ok(c.put_parts_many(&items, &opts, PARTS_BATCH_DEPTH))
        })?;
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.map(|w| generation_of(w).unwrap_or(0)).map_err(|e| in_batch(py, e, i)))
            .collect()
    }

    /// The value of ``key`` as ``bytes``, or ``None`` when it does not exist.
    ///
    /// ``byte_range=(start, stop)`` reads part of it: a negative ``start`` counts from the
    /// end (``(-16, None)`` is the last 16 bytes), ``stop=None`` reads to the end.
    #[pyo3(signature = (key, *, byte_range=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: Key,
        byte_range: Option<(i64, Option<i64>)>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let opts = GetOptions { range: range(py, byte_range)?, ..GetOptions::default() };
        match self.fetch(py, &key.0, &opts)? {
            Fetched::Value { bytes, .. } => Ok(Some(bytes)),
            Fetched::Missing => Ok(None),
            Fetched::Unchanged { .. } => {
                Err(to_py(py, Error::new(Status::Internal, "an unconditional get reported unchanged")))
            }
        }
    }

    /// The value of ``key`` with its generation and size (an :class:`Entry`), or ``None``
    /// when it does not exist. With ``if_not_equal=g`` and a current generation of ``g``,
    /// ``Entry.value`` is ``None``: the caller's copy is current and no bytes moved.
    #[pyo3(signature = (key, *, if_not_equal=None, byte_range=None))]
    fn get_entry(
        &self,
        py: Python<'_>,
        key: Key,
        if_not_equal: Option<u64>,
        byte_range: Option<(i64, Option<i64>)>,
    ) -> PyResult<Option<Entry>> {
        let opts = GetOptions { if_not_equal, range: range(py, byte_range)?, ..GetOptions::default() };
        Ok(match self.fetch(py, &key.0, &opts)? {
            Fetched::Value { bytes, generation, size } => Some(Entry { value: Some(bytes.unbind()), generation, size }),
            Fetched::Unchanged { generation } => Some(Entry { value: None, generation, size: 0 }),
            Fetched::Missing => None,
        })
    }

    /// Reads ``key`` (or ``byte_range`` of it) straight into ``out``, a writable buffer
    /// (bytearray, numpy array, CPU torch tensor), and returns how many bytes were
    /// written; ``None`` when the key does not exist. Raises ``BufferTooSmall`` (with
    /// ``.needed``) when the bytes do not fit; then nothing was written.
    ///
    /// After the call returns, whatever it returned, nothing writes into ``out``.
    #[pyo3(signature = (key, out, *, byte_range=None))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: Key,
        out: &Bound<'_, PyAny>,
        byte_range: Option<(i64, Option<i64>)>,
    ) -> PyResult<Option<usize>> {
        let opts = GetOptions { range: range(py, byte_range)?, ..GetOptions::default() };
        let out = Buffer::writable(out)?;
        let bytes = out.raw();
        // SAFETY: `out` stays exported (and so pinned) until after the call returns; host
        // or device memory, as the client asks the driver.
        let result =
            self.call(py, |c| unsafe { c.get_into_ptr(&key.0, &opts, bytes.addr() as *mut u8, bytes.len()) })?;
        into_result(py, result, bytes.len())
    }

    /// Deletes ``key``; ``True`` if it existed. With ``if_equal=g`` only when its
    /// generation is ``g`` (``False`` otherwise).
    #[pyo3(signature = (key, *, if_equal=None))]
    fn delete(&self, py: Python<'_>, key: Key, if_equal: Option<u64>) -> PyResult<bool> {
        let condition = if_equal.map_or(WriteCondition::None, WriteCondition::IfEqual);
        Ok(match self.call(py, |c| c.delete_with(&key.0, condition))? {
            DeleteResult::Deleted { existed } => existed,
            DeleteResult::ConditionFailed => false,
        })
    }

    /// Deletes every key in ``[start, stop)`` (``stop=None``: to the last key) on every
    /// server and returns how many were removed.
    #[pyo3(signature = (start, stop=None))]
    fn delete_range(&self, py: Python<'_>, start: Key, stop: Option<Key>) -> PyResult<u64> {
        let range = KeyRange { min: start.0, max: stop.map(|k| k.0) };
        self.call(py, |c| c.delete_range(&range))
    }

    /// The keys starting with ``prefix`` and within ``[start, stop)``, in key order, as an
    /// iterator of ``(key: bytes, size: int)``.
    #[pyo3(signature = (prefix=None, *, start=None, stop=None))]
    fn list<'py>(
        &self,
        py: Python<'py>,
        prefix: Option<Key>,
        start: Option<Key>,
        stop: Option<Key>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut range = prefix.map(|p| KeyRange::prefix(&p.0)).unwrap_or_default();
        if let Some(s) = start {
            range.min = range.min.max(s.0);
        }
        if let Some(s) = stop {
            range.max = Some(match range.max {
                Some(m) => m.min(s.0),
                None => s.0,
            });
        }
        let entries = self.call(py, |c| c.list(&range))?;
        let items: Vec<(Bound<'py, PyBytes>, u64)> =
            entries.into_iter().map(|e| (PyBytes::new(py, &e.key), e.size)).collect();
        PyList::new(py, items)?.as_any().try_iter().map(|i| i.into_any())
    }

    /// Statistics of every server and shard, with totals, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json = self.call(py, |c| c.stats())?.to_string();
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Stores many values, pipelined (up to 64 requests in flight): ``items`` is a dict
    /// or an iterable of ``(key, value)`` pairs. Returns the new generations in order.
    /// If an item fails, its exception is raised after the whole batch has been sent,
    /// with ``.index`` naming the item.
    fn put_many(&self, py: Python<'_>, items: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let items = match items.cast::<PyDict>() {
            Ok(d) => d.items().into_any(),
            Err(_) => items.clone(),
        };
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for item in items.try_iter()? {
            let (key, value): (Key, Bound<'_, PyAny>) = item?.extract()?;
            keys.push(key.0);
            values.push(Buffer::readable(&value)?);
        }
        let raw: Vec<RawBytes> = values.iter().map(Buffer::raw).collect();
        let results = if values.iter().any(Buffer::on_device) {
            // Device memory is staged one value at a time.
            let opts = PutOptions::default();
            self.call(py, |c| {
                // SAFETY: every value stays exported until after the call returns.
                let put =
                    |(k, v): (&Vec<u8>, &RawBytes)| unsafe { c.put_from(k, v.addr() as *const u8, v.len(), &opts) };
                Ok(keys.iter().zip(&raw).map(put).map(written).collect::<Vec<_>>())
            })?
        } else {
            self.call(py, |c| {
                // SAFETY: every value stays exported until after the call returns.
                let pairs: Vec<(&[u8], &[u8])> =
                    keys.iter().zip(&raw).map(|(k, v)| (k.as_slice(), unsafe { v.as_slice() })).collect();
                Ok(c.put_many(&pairs, BATCH_DEPTH))
            })?
        };
        results.into_iter().enumerate().map(|(i, r)| r.map_err(|e| in_batch(py, e, i))).collect()
    }

    /// Reads many values, pipelined: a list with ``bytes`` or ``None`` (missing) per key.
    fn get_many<'py>(&self, py: Python<'py>, keys: Vec<Key>) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let mut values = Vec::with_capacity(keys.len());
        // Groups of BATCH_DEPTH keys go into reused slots of SCRATCH_LEN bytes; a value that
        // does not fit is then read on its own, straight into a `bytes` of its size.
        for (g, group) in keys.chunks(BATCH_DEPTH).enumerate() {
            let results = self.call_connected(py, |c| {
                let refs: Vec<&[u8]> = group.iter().map(Vec::as_slice).collect();
                let mut slots: Vec<&mut [u8]> =
                    first_slots(&mut c.slots, group.len()).chunks_mut(SCRATCH_LEN).collect();
                let results = c.client.get_many_into(&refs, &mut slots, BATCH_DEPTH);
                Ok(results
                    .into_iter()
                    .zip(&slots)
                    .map(|(r, slot)| {
                        r.map(|r| match r {
                            GetInto::Value { len, .. } => (r, slot[..len].to_vec()),
                            other => (other, Vec::new()),
                        })
                    })
                    .collect::<Vec<_>>())
            })?;
            for (j, r) in results.into_iter().enumerate() {
                let i = g * BATCH_DEPTH + j;
                values.push(match r.map_err(|e| in_batch(py, e, i))? {
                    (GetInto::Value { .. }, data) => Some(PyBytes::new(py, &data)),
                    (GetInto::TooSmall { .. }, _) => match self.fetch(py, &keys[i], &GetOptions::default())? {
                        Fetched::Value { bytes, .. } => Some(bytes),
                        _ => None,
                    },
                    _ => None,
                });
            }
        }
        Ok(values)
    }

    /// Reads many values straight into ``outs`` (one writable buffer per key), pipelined.
    /// Returns the length written per key, ``None`` where the key is missing.
    /// ``byte_ranges`` (one ``(start, stop)`` or ``None`` per key, as ``get``'s
    /// ``byte_range``) reads parts of them: two ranges of one key read a header and a body
    /// into buffers of their own in one round trip.
    #[pyo3(signature = (keys, outs, *, byte_ranges=None))]
    fn get_many_into(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        outs: Vec<Bound<'_, PyAny>>,
        byte_ranges: Option<Vec<Option<PyByteRange>>>,
    ) -> PyResult<Vec<Option<usize>>> {
        if keys.len() != outs.len() {
            return Err(invalid(
                py,
                format!("{} keys but {} buffers: give one buffer per key", keys.len(), outs.len()),
            ));
        }
        let opts = per_key_options(py, keys.len(), byte_ranges)?;
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let outs = outs.iter().map(Buffer::writable).collect::<PyResult<Vec<_>>>()?;
        let raw: Vec<RawBytes> = outs.iter().map(Buffer::raw).collect();
        if overlapping(&raw) {
            return Err(invalid(py, "the output buffers overlap: give each key its own memory"));
        }
        let results = if outs.iter().any(Buffer::on_device) {
            // Device memory is staged one value at a time.
            self.call(py, |c| {
                // SAFETY: every buffer stays exported until after the call returns, and no
                // two overlap (checked above).
                let get = |((k, b), o): ((&Vec<u8>, &RawBytes), &GetOptions)| unsafe {
                    c.get_into_ptr(k, o, b.addr() as *mut u8, b.len())
                };
                Ok(keys.iter().zip(&raw).zip(&opts).map(get).collect::<Vec<_>>())
            })?
        } else {
            self.call(py, |c| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                // SAFETY: every buffer stays exported until after the call returns, and no two
                // overlap (checked above), so the mutable slices do not alias.
                let mut bufs: Vec<&mut [u8]> = raw.iter().map(|b| unsafe { b.as_mut_slice() }).collect();
                Ok(c.get_many_into_with(&refs, &opts, &mut bufs, BATCH_DEPTH))
            })?
        };
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| match r {
                Ok(r) => into_result(py, r, raw[i].len()).inspect_err(|e| {
                    let _ = e.value(py).setattr("index", i);
                }),
                Err(e) => Err(in_batch(py, e, i)),
            })
            .collect()
    }

    /// The size in bytes of each key's value, ``None`` where the key is missing, pipelined;
    /// no value's bytes move.
    fn sizes(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<Vec<Option<u64>>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let none = GetOptions { range: Some(ByteRange { start: 0, end: 0 }), ..GetOptions::default() };
        let results = self.call(py, |c| {
            let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let mut bufs: Vec<&mut [u8]> = (0..keys.len()).map(|_| &mut [][..]).collect();
            Ok(c.get_many_into_with(&refs, &vec![none; keys.len()], &mut bufs, BATCH_DEPTH))
        })?;
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| match r {
                Ok(GetInto::Value { size, .. }) => Ok(Some(size)),
                Ok(GetInto::Missing) => Ok(None),
                Ok(other) => Err(to_py(py, Error::new(Status::Internal, format!("a size read answered {other:?}")))),
                Err(e) => Err(in_batch(py, e, i)),
            })
            .collect()
    }
}

impl PyClient {
    fn lock(&self) -> MutexGuard<'_, Option<Connected>> {
        // A panic inside a call poisons the mutex but leaves the client usable.
        self.connected.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the client with the GIL released. The mutex is only ever taken without
    /// the GIL, so a thread waiting for it never blocks one that needs the GIL.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Client) -> remote_dram::error::Result<T> + Send,
    ) -> PyResult<T> {
        self.call_connected(py, |c| f(&mut c.client))
    }

    fn call_connected<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Connected) -> remote_dram::error::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| match self.lock().as_mut() {
            Some(connected) => f(connected),
            None => Err(Error::new(Status::Invalid, "the client is closed")),
        })
        .map_err(|e| to_py(py, e))
    }

    /// A value of unknown size as `bytes`, without a `Vec` per call: small values land in
    /// the first slot (one round trip); for a larger one the reply says its size, and
    /// a second request reads it straight into a `bytes` object of that size.
    fn fetch<'py>(&self, py: Python<'py>, key: &[u8], opts: &GetOptions) -> PyResult<Fetched<'py>> {
        let first = self.call_connected(py, |c| {
            let slot = first_slots(&mut c.slots, 1);
            Ok(match c.client.get_into(key, opts, slot)? {
                GetInto::Value { len, generation, size } => {
                    (GetInto::Value { len, generation, size }, slot[..len].to_vec())
                }
                other => (other, Vec::new()),
            })
        })?;
        let mut needed = match first {
            (GetInto::Value { generation, size, .. }, data) => {
                return Ok(Fetched::Value { bytes: PyBytes::new(py, &data), generation, size })
            }
            (GetInto::Missing, _) => return Ok(Fetched::Missing),
            (GetInto::Unchanged { generation }, _) => return Ok(Fetched::Unchanged { generation }),
            (GetInto::TooSmall { needed }, _) => needed,
        };
        // The value may change size between the two requests; follow it.
        loop {
            let bytes = uninit_bytes(py, needed)?;
            let raw = RawBytes::of_bytes(&bytes);
            // SAFETY: `bytes` is ours alone (not yet returned to Python code) and alive until
            // after the call; filling it before anyone sees it is how `bytes` are built.
            match self.call(py, |c| c.get_into(key, opts, unsafe { raw.as_mut_slice() }))? {
                GetInto::Value { len, generation, size } if len == needed => {
                    return Ok(Fetched::Value { bytes, generation, size })
                }
                GetInto::Value { len, generation, size } => {
                    return Ok(Fetched::Value { bytes: PyBytes::new(py, &bytes.as_bytes()[..len]), generation, size })
                }
                GetInto::TooSmall { needed: n } => needed = n,
                GetInto::Missing => return Ok(Fetched::Missing),
                GetInto::Unchanged { generation } => return Ok(Fetched::Unchanged { generation }),
            }
        }
    }
}

/// A `bytes` object of `len` bytes whose contents are not yet written.
fn uninit_bytes(py: Python<'_>, len: usize) -> PyResult<Bound<'_, PyBytes>> {
    let len = pyo3::ffi::Py_ssize_t::try_from(len).map_err(|_| invalid(py, "value too large for this platform"))?;
    // SAFETY: a NULL source asks CPython for an uninitialised object of `len` bytes; the
    // result is a new reference (or NULL with an exception set).
    unsafe {
        Ok(Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len))?
            .cast_into_unchecked())
    }
}

/// A key: `bytes` as they are, `str` as UTF-8.
pub struct Key(Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for Key {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<PyBytes>() {
            return Ok(Key(b.as_bytes().to_vec()));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(Key(s.to_cow()?.as_bytes().to_vec()));
        }
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "a key must be bytes or str, not {}",
            obj.get_type().name()?
        )))
    }
}

fn into_result(py: Python<'_>, result: GetInto, have: usize) -> PyResult<Option<usize>> {
    match result {
        GetInto::Value { len, .. } => Ok(Some(len)),
        GetInto::Missing => Ok(None),
        GetInto::TooSmall { needed } => Err(buffer_too_small(py, have, needed)),
        GetInto::Unchanged { .. } => {
            Err(to_py(py, Error::new(Status::Internal, "an unconditional get reported unchanged")))
        }
    }
}

/// Whether any two non-empty buffers share a byte.
fn overlapping(bufs: &[RawBytes]) -> bool {
    let mut spans: Vec<(usize, usize)> =
        bufs.iter().filter(|b| b.len() > 0).map(|b| (b.addr(), b.addr() + b.len())).collect();
    spans.sort_unstable();
    spans.windows(2).any(|w| w[1].0 < w[0].1)
}

/// A put's options from its keyword arguments.
fn put_options(py: Python<'_>, if_equal: Option<u64>, if_absent: bool, ttl: Option<f64>) -> PyResult<PutOptions> {
    let condition = match (if_equal, if_absent) {
        (Some(_), true) => return Err(invalid(py, "give if_equal or if_absent, not both")),
        (Some(g), false) => WriteCondition::IfEqual(g),
        (None, true) => WriteCondition::IfAbsent,
        (None, false) => WriteCondition::None,
    };
    Ok(PutOptions { condition, ttl: ttl.map(|t| seconds(py, t, "ttl")).transpose()? })
}

/// A put's result as Python gets it: the new generation, or None when the condition failed.
fn generation_of(written: WriteResult) -> Option<u64> {
    match written {
        WriteResult::Written { generation } => Some(generation),
        WriteResult::ConditionFailed => None,
    }
}

/// A byte range as Python gives it: `(start, stop)`, `stop` None for the end.
type PyByteRange = (i64, Option<i64>);

/// Options per key of a batch: its byte range, if any.
fn per_key_options(py: Python<'_>, n: usize, ranges: Option<Vec<Option<PyByteRange>>>) -> PyResult<Vec<GetOptions>> {
    let Some(ranges) = ranges else { return Ok(vec![GetOptions::default(); n]) };
    if ranges.len() != n {
        return Err(invalid(py, format!("{n} keys but {} byte ranges: give one (or None) per key", ranges.len())));
    }
    ranges.into_iter().map(|r| Ok(GetOptions { range: range(py, r)?, ..GetOptions::default() })).collect()
}

/// `(start, stop)` as the wire's byte range: a negative start counts from the end, `stop`
/// is exclusive, `None` reads to the end.
fn range(py: Python<'_>, r: Option<(i64, Option<i64>)>) -> PyResult<Option<ByteRange>> {
    match r {
        None => Ok(None),
        Some((_, Some(stop))) if stop < 0 => {
            Err(invalid(py, "byte_range stop must be ≥ 0 or None (a negative start reads a suffix)"))
        }
        Some((start, stop)) => Ok(Some(ByteRange { start, end: stop.unwrap_or(-1) })),
    }
}

pub(crate) fn seconds(py: Python<'_>, s: f64, what: &str) -> PyResult<Duration> {
    if !(s.is_finite() && s > 0.0) {
        return Err(invalid(py, format!("{what} must be a positive number of seconds, not {s}")));
    }
    Duration::try_from_secs_f64(s).map_err(|e| invalid(py, format!("{what}: {e}")))
}
