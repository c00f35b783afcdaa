//! Borrowing the memory of Python objects without a copy: host memory through the buffer
//! protocol, CUDA device memory through `__cuda_array_interface__`, a CUDA DLPack capsule
//! (`__dlpack__`) or a torch CUDA tensor's `data_ptr()`. The client asks the CUDA driver
//! which memory an address is in, and stages device memory itself.
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
pub struct PyBufferView {
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
/// to reallocate, a device array is kept alive) until the view is dropped, with the GIL held.
pub enum Buffer {
    Host(PyBufferView),
    /// Device memory (or what the object says is): its range, and the object (array,
    /// tensor or DLPack capsule) that keeps it alive.
    Device {
        addr: usize,
        len: usize,
        _owner: Py<PyAny>,
    },
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
        unsafe {
            if self.len == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(self.addr as *const u8, self.len)
            }
        }
    }

    /// # Safety
    /// The `Buffer` this came from must still be alive, writable, and not read or written
    /// through any other path meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<'a>(self) -> &'a mut [u8] {
        // SAFETY: as for `as_slice`, and the view was requested writable.
        unsafe {
            if self.len == 0 {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len)
            }
        }
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
        if let Some(device) = device_view(obj, flags & PYBUF_WRITABLE != 0)? {
            return Ok(device);
        }
        let exporter = torch_cpu_view(obj)?.unwrap_or_else(|| obj.clone());
        let mut view = std::mem::MaybeUninit::<PyBufferView>::zeroed();
        // SAFETY: `exporter` is a live object (we hold a reference and the GIL); on success
        // CPython fills `view` and takes a reference that `PyBuffer_Release` gives back.
        let rc = unsafe { PyObject_GetBuffer(exporter.as_ptr(), view.as_mut_ptr(), flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py());
            let kind =
                if flags & PYBUF_WRITABLE != 0 { "a writable, C-contiguous buffer" } else { "a C-contiguous buffer" };
            let py = obj.py();
            let err = match cause {
                Some(e) if !e.is_instance_of::<PyTypeError>(py) => {
                    PyBufferError::new_err(format!("{what} must be {kind}: {e}"))
                }
                _ => PyTypeError::new_err(format!(
                    "{what} must support the buffer protocol ({kind}), not {}",
                    type_name(obj)
                )),
            };
            return Err(err);
        }
        // SAFETY: PyObject_GetBuffer succeeded, so the view is initialised.
        Ok(Buffer::Host(unsafe { view.assume_init() }))
    }

    pub fn raw(&self) -> RawBytes {
        match self {
            Buffer::Host(view) => RawBytes { addr: view.buf as usize, len: view.len.max(0) as usize },
            &Buffer::Device { addr, len, .. } => RawBytes { addr, len },
        }
    }

    /// Whether the object gave device memory (the client then moves it staged).
    pub fn on_device(&self) -> bool {
        matches!(self, Buffer::Device { .. })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Buffer::Host(view) = self {
            // Buffers are created and dropped by #[pymethods] code, which holds the GIL.
            // SAFETY: the view came from a successful PyObject_GetBuffer and is released once.
            unsafe { PyBuffer_Release(view) }
        }
    }
}

/// Device memory an object offers: a torch CUDA tensor, an object with
/// `__cuda_array_interface__` (CuPy, Numba, …), or one whose `__dlpack_device__` is a
/// CUDA device (JAX, …). Work the producer queued on its stream is waited for first.
fn device_view(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Option<Buffer>> {
    let py = obj.py();
    if is_torch_tensor(obj) {
        if obj.getattr("device")?.getattr("type")?.extract::<String>()? != "cuda" {
            return Ok(None);
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyBufferError::new_err("the torch tensor must be contiguous (call .contiguous())"));
        }
        // Kernels that write the tensor run on torch's current stream: done before we read it
        // (or write it, for a get).
        py.import("torch")?
            .getattr("cuda")?
            .call_method1("current_stream", (obj.getattr("device")?,))?
            .call_method0("synchronize")?;
        let addr: usize = obj.call_method0("data_ptr")?.extract()?;
        let len =
            obj.call_method0("numel")?.extract::<usize>()? * obj.call_method0("element_size")?.extract::<usize>()?;
        return Ok(Some(Buffer::Device { addr, len, _owner: obj.clone().unbind() }));
    }
    if let Ok(cai) = obj.getattr("__cuda_array_interface__") {
        let (addr, readonly): (usize, bool) = cai.get_item("data")?.extract()?;
        if writable && readonly {
            return Err(PyBufferError::new_err("an output buffer must be writable; this device array is read-only"));
        }
        let shape: Vec<usize> = cai.get_item("shape")?.extract()?;
        let typestr: String = cai.get_item("typestr")?.extract()?;
        let itemsize: usize = typestr
            .get(2..)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| PyTypeError::new_err(format!("__cuda_array_interface__ typestr {typestr:?}")))?;
        let strides: Option<Vec<isize>> = cai.get_item("strides").ok().and_then(|s| s.extract().ok());
        if strides.is_some_and(|s| !c_contiguous(&shape, &s, itemsize)) {
            return Err(PyBufferError::new_err("the device array must be C-contiguous"));
        }
        // Version 3: work on `stream` must end before the consumer touches the memory.
        if let Some(stream) = cai.get_item("stream").ok().and_then(|s| s.extract::<usize>().ok()) {
            remote_dram::gpu::wait_for_stream(addr, stream).map_err(|e| PyBufferError::new_err(e.to_string()))?;
        }
        return Ok(Some(Buffer::Device {
            addr,
            len: shape.iter().product::<usize>() * itemsize,
            _owner: obj.clone().unbind(),
        }));
    }
    if obj.hasattr("__dlpack__")? && obj.hasattr("__dlpack_device__")? {
        let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if matches!(device_type, DL_CUDA | DL_CUDA_MANAGED) {
            return dlpack_view(obj).map(Some);
        }
    }
    Ok(None)
}

// DLPack (dlpack.h): device types, and the layout of a `DLManagedTensor`.
const DL_CUDA: i32 = 2;
const DL_CUDA_MANAGED: i32 = 13;
/// The legacy default stream, on which a producer asked for no stream makes its work visible.
const CU_STREAM_LEGACY: usize = 1;

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: [i32; 2],
    ndim: i32,
    dtype: [u8; 4],
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// The memory of a DLPack capsule's tensor; the capsule (whose destructor gives the tensor
/// back to its producer) is kept until the view is dropped.
fn dlpack_view(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
    let capsule = obj.call_method0("__dlpack__")?;
    // SAFETY: a capsule named "dltensor" holds a DLManagedTensor, whose first member is
    // the DLTensor; it stays valid while the capsule lives (held in the buffer).
    let tensor = unsafe {
        let managed = pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr());
        if managed.is_null() {
            return Err(PyErr::fetch(obj.py()));
        }
        &*(managed as *const DlTensor)
    };
    let ndim = tensor.ndim.max(0) as usize;
    // SAFETY: `shape` (and `strides`, when not null) hold `ndim` entries (dlpack.h).
    let shape: Vec<usize> = (0..ndim).map(|i| unsafe { *tensor.shape.add(i) }.max(0) as usize).collect();
    let itemsize =
        (tensor.dtype[1] as usize * u16::from_le_bytes([tensor.dtype[2], tensor.dtype[3]]) as usize).div_ceil(8);
    if !tensor.strides.is_null() {
        // SAFETY: as above; DLPack strides count elements.
        let strides: Vec<isize> =
            (0..ndim).map(|i| (unsafe { *tensor.strides.add(i) } as isize) * itemsize as isize).collect();
        if !c_contiguous(&shape, &strides, itemsize) {
            return Err(PyBufferError::new_err("the DLPack tensor must be C-contiguous"));
        }
    }
    // The producer made its work visible on the legacy default stream (no stream was asked for).
    let addr = tensor.data as usize + tensor.byte_offset as usize;
    remote_dram::gpu::wait_for_stream(addr, CU_STREAM_LEGACY).map_err(|e| PyBufferError::new_err(e.to_string()))?;
    Ok(Buffer::Device { addr, len: shape.iter().product::<usize>() * itemsize, _owner: capsule.unbind() })
}

/// Whether byte `strides` describe a C-contiguous array of `shape` (dimensions of one
/// element or less may have any stride).
fn c_contiguous(shape: &[usize], strides: &[isize], itemsize: usize) -> bool {
    let mut expected = itemsize as isize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n > 1 && s != expected {
            return false;
        }
        expected *= n as isize;
    }
    shape.len() == strides.len()
}

fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> bool {
    let module: String = obj.get_type().getattr("__module__").and_then(|m| m.extract()).unwrap_or_default();
    (module == "torch" || module.starts_with("torch.")) && obj.hasattr("data_ptr").unwrap_or(false)
}

/// A torch CPU tensor has no buffer protocol; its `.numpy()` shares its memory. (CUDA
/// tensors are taken by `device_view`.)
fn torch_cpu_view<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if !is_torch_tensor(obj) || !obj.hasattr("numpy")? {
        return Ok(None);
    }
    if obj.getattr("device")?.getattr("type")?.extract::<String>()? != "cpu" {
        return Err(PyTypeError::new_err(
            "torch tensors on the CPU or on CUDA devices only; copy the tensor to one of those first",
        ));
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
