//! Borrowing the memory of Python objects through the buffer protocol, without a copy.
//!
//! PyO3 exposes the buffer protocol under the stable ABI only from Python 3.11 on, and
//! its typed `PyBuffer<T>` insists on an element format. We want one abi3 wheel for
//! Python ≥ 3.9 and the raw bytes of any C-contiguous buffer (float32 arrays included),
//! so we declare the two functions ourselves. `PyObject_GetBuffer`, `PyBuffer_Release`
//! and the `Py_buffer` layout below have been unchanged since CPython 3.3; 3.11 only
//! promised them in the stable ABI.

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;

#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut pyo3::ffi::PyObject,
    len: pyo3::ffi::Py_ssize_t,
    itemsize: pyo3::ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut pyo3::ffi::Py_ssize_t,
    strides: *mut pyo3::ffi::Py_ssize_t,
    suboffsets: *mut pyo3::ffi::Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut pyo3::ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

/// A C-contiguous byte view of a Python object, exported for as long as this lives: the
/// exporter keeps the memory where it is (a `bytearray` refuses to resize, numpy refuses
/// to reallocate) until the view is dropped, with the GIL held.
pub struct Buffer {
    view: PyBufferView,
}

/// The address and length of a [`Buffer`], to carry into code that runs without the GIL
/// (raw pointers are not `Send`). Valid only while its `Buffer` lives.
#[derive(Clone, Copy)]
pub struct RawBytes {
    addr: usize,
    len: usize,
}

impl RawBytes {
    /// The bytes of a `bytes` object (immutable once shared: only for one being built).
    pub fn of_bytes(b: &Bound<'_, pyo3::types::PyBytes>) -> RawBytes {
        let bytes = b.as_bytes();
        RawBytes { addr: bytes.as_ptr() as usize, len: bytes.len() }
    }

    /// # Safety
    /// The `Buffer` this came from must still be alive.
    pub unsafe fn as_slice<'a>(self) -> &'a [u8] {
        // SAFETY: the live export pins `len` readable bytes at `addr` (the caller's contract);
        // a zero-length view may have a null pointer, which `from_raw_parts` does not allow.
        unsafe { if self.len == 0 { &[] } else { std::slice::from_raw_parts(self.addr as *const u8, self.len) } }
    }

    /// # Safety
    /// The `Buffer` this came from must still be alive, writable, and not read or written
    /// through any other path meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [u8] {
        // SAFETY: as for `as_slice`, and the view was requested writable.
        unsafe { if self.len == 0 { &mut [] } else { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) } }
    }

    pub fn len(self) -> usize {
        self.len
    }

    pub fn addr(self) -> usize {
        self.addr
    }
}

impl Buffer {
    /// Borrows `obj`'s bytes for reading: bytes, bytearray, memoryview, a C-contiguous
    /// numpy array, or a CPU torch tensor (through its `.numpy()` view).
    pub fn readable(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        Self::export(obj, PYBUF_C_CONTIGUOUS, "a value")
    }

    /// Borrows `obj`'s bytes for writing: bytearray, a writable memoryview, a C-contiguous
    /// numpy array or a CPU torch tensor.
    pub fn writable(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        Self::export(obj, PYBUF_C_CONTIGUOUS | PYBUF_WRITABLE, "an output buffer")
    }

    fn export(obj: &Bound<'_, PyAny>, flags: c_int, what: &str) -> PyResult<Buffer> {
        let exporter = torch_cpu_view(obj)?.unwrap_or_else(|| obj.clone());
        let mut view = std::mem::MaybeUninit::<PyBufferView>::zeroed();
        // SAFETY: `exporter` is a live object (we hold a reference and the GIL); on success
        // CPython fills `view` and takes a reference that `PyBuffer_Release` gives back.
        let rc = unsafe { PyObject_GetBuffer(exporter.as_ptr(), view.as_mut_ptr(), flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py());
            let kind = if flags & PYBUF_WRITABLE != 0 { "a writable, C-contiguous buffer" } else { "a C-contiguous buffer" };
            let py = obj.py();
            let err = match cause {
                Some(e) if !e.is_instance_of::<PyTypeError>(py) => PyBufferError::new_err(format!("{what} must be {kind}: {e}")),
                _ => PyTypeError::new_err(format!("{what} must support the buffer protocol ({kind}), not {}", type_name(obj))),
            };
            return Err(err);
        }
        // SAFETY: PyObject_GetBuffer succeeded, so the view is initialised.
        Ok(Buffer { view: unsafe { view.assume_init() } })
    }

    pub fn raw(&self) -> RawBytes {
        RawBytes { addr: self.view.buf as usize, len: self.view.len.max(0) as usize }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Buffers are created and dropped by #[pymethods] code, which holds the GIL.
        // SAFETY: the view came from a successful PyObject_GetBuffer and is released once.
        unsafe { PyBuffer_Release(&mut self.view) }
    }
}

/// A torch CPU tensor has no buffer protocol; its `.numpy()` shares its memory. Device
/// tensors are refused here (the GPU path is separate).
fn torch_cpu_view<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let ty = obj.get_type();
    let module: String = ty.getattr("__module__").and_then(|m| m.extract()).unwrap_or_default();
    if !(module == "torch" || module.starts_with("torch.")) || !obj.hasattr("numpy")? {
        return Ok(None);
    }
    if obj.getattr("device")?.getattr("type")?.extract::<String>()? != "cpu" {
        return Err(PyTypeError::new_err("only CPU torch tensors are supported; copy the tensor to the CPU first"));
    }
    if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyBufferError::new_err("the torch tensor must be contiguous (call .contiguous())"));
    }
    // A byte view works for every dtype (numpy has no bfloat16) and shares the storage.
    let flat = obj.call_method0("detach")?.call_method1("reshape", (-1,))?;
    let torch = obj.py().import("torch")?;
    Ok(Some(flat.call_method1("view", (torch.getattr("uint8")?,))?.call_method0("numpy")?))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "this object".into())
}
