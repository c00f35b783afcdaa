//! Device (GPU) memory: which memory a caller's pointer is in, and copies between device
//! memory and host memory on a stream of the library's own.
//!
//! The client reads and writes CUDA device memory by staging it through pinned host
//! buffers (`client/device.rs`); everything it needs from the GPU is the small
//! [`Device`] interface here:
//! - [`cuda::Cuda`] drives the CUDA driver, loaded at run time (`dlopen("libcuda.so.1")`):
//!   there is no build-time CUDA dependency, and on a machine without a driver every
//!   pointer is host memory, at the cost of one check per call;
//! - [`posing::Posing`] lets tests name ranges of host memory that then pose as device
//!   memory, with a plain copy, run on a thread of its own, as the "device" copy. The
//!   staging code runs against it in CI for real: chunking, overlap, failures, timeouts.

pub mod cuda;
#[cfg(feature = "test-util")]
pub mod posing;

use std::sync::OnceLock;

use crate::error::Result;

/// Where a caller's memory lives, as the driver says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory, also host memory registered with or allocated by the driver, and
    /// managed (unified) memory, which the host may read and write too.
    Host,
    /// Memory of the GPU with this ordinal, which only the driver's copies reach.
    Device { ordinal: i32 },
}

/// The driver calls the staging uses.
pub trait Device: Send + Sync {
    /// The kind of memory `addr` points into.
    fn kind(&self, addr: usize) -> MemoryKind;
    /// A new stream on GPU `ordinal`, on which copies run in order.
    fn stream(&'static self, ordinal: i32) -> Result<Box<dyn Stream>>;
    /// `len` bytes of host memory the GPU copies to and from at full speed (pinned).
    fn host_buffer(&'static self, len: usize) -> Result<HostBuffer>;
    /// Whether what this device calls device memory is host memory (tests' posing
    /// device), which a transport moves as host memory.
    fn poses_host_memory(&self) -> bool {
        false
    }
    /// Waits for the work queued on a stream of another library's (given as its CUDA
    /// handle; 1 is the legacy default stream) on GPU `ordinal`.
    fn wait_for_stream(&self, ordinal: i32, stream: usize) -> Result<()>;
}

/// A queue of copies that run in order, while the calling thread goes on.
///
/// Every pointer given stays valid, and host memory untouched by anyone else, until a
/// later [`Stream::synchronize`] returns: the copy may run at any moment until then.
pub trait Stream: Send {
    /// Queues a copy of `len` bytes from device address `device` into `host`.
    ///
    /// # Safety
    /// `host` is valid for writes of `len` bytes and `device` for reads of `len` bytes
    /// on this stream's GPU, until the next `synchronize` returns.
    unsafe fn to_host(&mut self, host: *mut u8, device: usize, len: usize) -> Result<()>;
    /// Queues a copy of `len` bytes from `host` to device address `device`.
    ///
    /// # Safety
    /// As [`Stream::to_host`], the other way round.
    unsafe fn to_device(&mut self, device: usize, host: *const u8, len: usize) -> Result<()>;
    /// Waits until every copy queued has finished; the first that failed since the last
    /// call is the error. After it returns, no copy of this stream touches any memory.
    fn synchronize(&mut self) -> Result<()>;
}

/// Host memory from [`Device::host_buffer`], freed on drop.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    free: Box<dyn Fn(*mut u8, usize) + Send>,
}

// SAFETY: the buffer is plain host memory owned by this value alone; `free` is Send.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    /// Takes ownership of `[ptr, ptr+len)`, which `free` gives back.
    ///
    /// # Safety
    /// The range is host memory valid for reads and writes, owned by no one else, until
    /// `free` is called with it (once, on drop).
    pub unsafe fn new(ptr: *mut u8, len: usize, free: Box<dyn Fn(*mut u8, usize) + Send>) -> HostBuffer {
        HostBuffer { ptr, len, free }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `new`'s contract: valid for `len` bytes and owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        (self.free)(self.ptr, self.len);
    }
}

static DEVICE: OnceLock<Option<&'static dyn Device>> = OnceLock::new();

/// The process's device: the CUDA driver when it loads (and `RDRAM_CUDA` is not `off`),
/// none otherwise (every pointer is host memory then). Fixed at the first call, which
/// initializes the driver.
pub fn device() -> Option<&'static dyn Device> {
    *DEVICE.get_or_init(|| {
        if std::env::var("RDRAM_CUDA").is_ok_and(|v| v == "off") {
            return None;
        }
        cuda::Cuda::load().map(|c| &*Box::leak(Box::new(c)) as &'static dyn Device)
    })
}

/// Makes `device` the process's device, in place of the CUDA driver: for tests, before
/// any call asks ([`posing::Posing`]). False when the device was fixed already.
#[doc(hidden)]
pub fn install(device: &'static dyn Device) -> bool {
    DEVICE.set(Some(device)).is_ok()
}

/// Whether the process's device, once fixed, calls host memory device memory (see
/// [`Device::poses_host_memory`]). Loads no driver.
pub fn device_memory_is_host_memory() -> bool {
    DEVICE.get().copied().flatten().is_some_and(|d| d.poses_host_memory())
}

/// The kind of memory at `addr`: host memory when no driver is loaded.
pub fn kind_of(addr: usize) -> MemoryKind {
    device().map_or(MemoryKind::Host, |d| d.kind(addr))
}

/// Waits for the work queued on another library's stream (its CUDA handle) that uses the
/// device memory at `addr`, before the client reads or writes it: nothing to wait for in
/// host memory.
pub fn wait_for_stream(addr: usize, stream: usize) -> Result<()> {
    match (device(), kind_of(addr)) {
        (Some(d), MemoryKind::Device { ordinal }) => d.wait_for_stream(ordinal, stream),
        _ => Ok(()),
    }
}
