//! The CUDA driver API, loaded at run time from `libcuda.so.1`: the few calls
//! [`super::Device`] needs, resolved once. No CUDA headers or libraries at build time.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Mutex;

use libloading::Library;

use super::{Device, HostBuffer, MemoryKind, Stream};
use crate::error::{Error, Result, Status};

type CuResult = c_int;
type CuDevicePtr = u64;
type CuContext = *mut c_void;
type CuStream = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
// CUpointer_attribute and CUmemorytype (cuda.h).
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;

/// The driver's entry points (their `_v2` names where the ABI has them).
struct Api {
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pointer_get_attributes: unsafe extern "C" fn(c_uint, *const c_int, *mut *mut c_void, CuDevicePtr) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult,
    ctx_push: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    memcpy_htod_async: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// A symbol of `library` as a function pointer of type `T`.
///
/// # Safety
/// `T` is the C type of the symbol's declaration.
unsafe fn symbol<T: Copy>(library: &Library, name: &[u8]) -> Option<T> {
    // SAFETY: the caller names the symbol's type.
    unsafe { library.get::<T>(name).ok().map(|s| *s) }
}

/// The CUDA driver, with a primary context retained per GPU used.
pub struct Cuda {
    api: Api,
    /// Primary contexts by device ordinal (retained for the life of the process).
    contexts: Mutex<Vec<(c_int, usize)>>,
    _library: Library,
}

impl Cuda {
    /// Loads and initializes the driver; None when there is none (or it has no GPU).
    pub fn load() -> Option<Cuda> {
        // SAFETY: loading the CUDA driver runs its initializers, which have no
        // requirements on the caller; the symbols are resolved with the C types of
        // cuda.h's declarations and copied out as plain function pointers, which stay
        // valid while `_library` is kept (for the life of the `Cuda`).
        unsafe {
            let library = Library::new("libcuda.so.1").ok()?;
            let init: libloading::Symbol<unsafe extern "C" fn(c_uint) -> CuResult> = library.get(b"cuInit\0").ok()?;
            if init(0) != CUDA_SUCCESS {
                return None;
            }
            macro_rules! sym {
                ($name:literal) => {
                    symbol(&library, concat!($name, "\0").as_bytes())?
                };
            }
            let api = Api {
                get_error_string: sym!("cuGetErrorString"),
                pointer_get_attributes: sym!("cuPointerGetAttributes"),
                device_get: sym!("cuDeviceGet"),
                primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
                ctx_push: sym!("cuCtxPushCurrent_v2"),
                ctx_pop: sym!("cuCtxPopCurrent_v2"),
                stream_create: sym!("cuStreamCreate"),
                stream_destroy: sym!("cuStreamDestroy_v2"),
                stream_synchronize: sym!("cuStreamSynchronize"),
                memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
                memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
                mem_host_alloc: sym!("cuMemHostAlloc"),
                mem_free_host: sym!("cuMemFreeHost"),
            };
            Some(Cuda { api, contexts: Mutex::new(Vec::new()), _library: library })
        }
    }

    fn check(&self, what: &str, r: CuResult) -> Result<()> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves null.
        let known = unsafe { (self.api.get_error_string)(r, &mut text) } == CUDA_SUCCESS && !text.is_null();
        // SAFETY: a non-null result of cuGetErrorString is a static NUL-terminated string.
        let text =
            if known { unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned() } else { "unknown error".into() };
        Err(Error::new(Status::Io, format!("CUDA {what}: {text} ({r})")))
    }

    /// GPU `ordinal`'s primary context (the one CUDA's runtime, PyTorch and CuPy use).
    fn context(&self, ordinal: c_int) -> Result<CuContext> {
        let mut contexts = self.contexts.lock().unwrap();
        if let Some(&(_, ctx)) = contexts.iter().find(|c| c.0 == ordinal) {
            return Ok(ctx as CuContext);
        }
        let (mut device, mut ctx): (c_int, CuContext) = (0, std::ptr::null_mut());
        // SAFETY: out-pointers to locals; the ordinal is checked by the driver.
        self.check("cuDeviceGet", unsafe { (self.api.device_get)(&mut device, ordinal) })?;
        // SAFETY: as above; the context is retained for the life of the process.
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.api.primary_ctx_retain)(&mut ctx, device) })?;
        contexts.push((ordinal, ctx as usize));
        Ok(ctx)
    }

    /// Runs `f` with GPU `ordinal`'s primary context current on this thread.
    fn in_context<T>(&self, ordinal: c_int, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let ctx = self.context(ordinal)?;
        // SAFETY: a retained context, pushed and popped on this thread around `f`.
        self.check("cuCtxPushCurrent", unsafe { (self.api.ctx_push)(ctx) })?;
        let result = f();
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        let pop = self.check("cuCtxPopCurrent", unsafe { (self.api.ctx_pop)(&mut popped) });
        result.and_then(|v| pop.map(|()| v))
    }
}

impl Device for Cuda {
    fn kind(&self, addr: usize) -> MemoryKind {
        let attrs =
            [CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL];
        let (mut mem_type, mut managed, mut ordinal): (c_uint, c_uint, c_int) = (0, 0, -1);
        let mut data = [
            &mut mem_type as *mut c_uint as *mut c_void,
            &mut managed as *mut c_uint as *mut c_void,
            &mut ordinal as *mut c_int as *mut c_void,
        ];
        // SAFETY: three attributes, each with an out-pointer to a local of the size the
        // driver writes (CUmemorytype and booleans: 32 bits; the ordinal: int). For memory
        // unknown to CUDA the call succeeds and leaves the type 0.
        let mut ask = || unsafe {
            (self.api.pointer_get_attributes)(
                attrs.len() as c_uint,
                attrs.as_ptr(),
                data.as_mut_ptr(),
                addr as CuDevicePtr,
            )
        };
        let mut r = ask();
        if r != CUDA_SUCCESS {
            // A thread with no context current (one that never used CUDA): asked again
            // with a primary context current, rather than taking device memory for host.
            r = self.in_context(0, || Ok(ask())).unwrap_or(r);
        }
        if r == CUDA_SUCCESS && mem_type == CU_MEMORYTYPE_DEVICE && managed == 0 && ordinal >= 0 {
            MemoryKind::Device { ordinal }
        } else {
            MemoryKind::Host
        }
    }

    fn stream(&'static self, ordinal: i32) -> Result<Box<dyn Stream>> {
        let stream = self.in_context(ordinal, || {
            let mut stream: CuStream = std::ptr::null_mut();
            // SAFETY: an out-pointer to a local, in the GPU's context made current above.
            self.check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING) })?;
            Ok(stream)
        })?;
        Ok(Box::new(CudaStream { cuda: self, stream, ordinal }))
    }

    fn host_buffer(&'static self, len: usize) -> Result<HostBuffer> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        self.in_context(0, || {
            // SAFETY: an out-pointer to a local; portable memory is pinned for every context.
            self.check("cuMemHostAlloc", unsafe {
                (self.api.mem_host_alloc)(&mut ptr, len.max(1), CU_MEMHOSTALLOC_PORTABLE)
            })
        })?;
        let free = move |p: *mut u8, _len: usize| {
            // SAFETY: memory from cuMemHostAlloc, freed once (on the buffer's drop), with
            // the context it was allocated in current.
            let _ = self.in_context(0, || self.check("cuMemFreeHost", unsafe { (self.api.mem_free_host)(p.cast()) }));
        };
        // SAFETY: cuMemHostAlloc returned `len` bytes of host memory that only this buffer owns.
        Ok(unsafe { HostBuffer::new(ptr.cast(), len, Box::new(free)) })
    }

    fn wait_for_stream(&self, ordinal: i32, stream: usize) -> Result<()> {
        self.in_context(ordinal, || {
            // SAFETY: a stream handle another library gave for this GPU (or the legacy
            // default stream, 1), its context current.
            self.check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream as CuStream) })
        })
    }
}

/// A non-blocking stream of one GPU's primary context.
struct CudaStream {
    cuda: &'static Cuda,
    stream: CuStream,
    ordinal: c_int,
}

// SAFETY: the CUDA driver API is thread-safe, and a stream may be used from any thread
// with its context current (every call below makes it current); `&mut self` keeps one
// user at a time.
unsafe impl Send for CudaStream {}

impl Stream for CudaStream {
    unsafe fn to_host(&mut self, host: *mut u8, device: usize, len: usize) -> Result<()> {
        let (api, stream) = (&self.cuda.api, self.stream);
        self.cuda.in_context(self.ordinal, || {
            // SAFETY: the caller keeps both ranges valid until the next synchronize.
            self.cuda.check("cuMemcpyDtoHAsync", unsafe {
                (api.memcpy_dtoh_async)(host.cast(), device as CuDevicePtr, len, stream)
            })
        })
    }

    unsafe fn to_device(&mut self, device: usize, host: *const u8, len: usize) -> Result<()> {
        let (api, stream) = (&self.cuda.api, self.stream);
        self.cuda.in_context(self.ordinal, || {
            // SAFETY: the caller keeps both ranges valid until the next synchronize.
            self.cuda.check("cuMemcpyHtoDAsync", unsafe {
                (api.memcpy_htod_async)(device as CuDevicePtr, host.cast(), len, stream)
            })
        })
    }

    fn synchronize(&mut self) -> Result<()> {
        let (api, stream) = (&self.cuda.api, self.stream);
        // SAFETY: a stream created by this value and not yet destroyed.
        self.cuda.in_context(self.ordinal, || {
            self.cuda.check("cuStreamSynchronize", unsafe { (api.stream_synchronize)(stream) })
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let (api, stream) = (&self.cuda.api, self.stream);
        let _ = self.cuda.in_context(self.ordinal, || {
            // SAFETY: a stream created by this value; copies still queued finish first.
            let _ = self.cuda.check("cuStreamSynchronize", unsafe { (api.stream_synchronize)(stream) });
            // SAFETY: the stream is idle now, and destroyed once.
            self.cuda.check("cuStreamDestroy", unsafe { (api.stream_destroy)(stream) })
        });
    }
}
