//! What a client keeps once it has met device memory: a stream per GPU and pinned host
//! buffers that device memory is staged through (see `device`).

use super::tunables::{DEVICE_CHUNK, KEEP_PUT_BUFFER};
use crate::error::Result;
use crate::gpu::{Device, HostBuffer, Stream};

/// What a client keeps once it has met device memory.
pub(super) struct DeviceStaging {
    pub(super) device: &'static dyn Device,
    /// One stream per GPU met, by ordinal.
    pub(super) streams: Vec<(i32, Box<dyn Stream>)>,
    /// The two buffers a get's chunks arrive in, in turn.
    pub(super) chunks: [HostBuffer; 2],
    /// A put's value, whole.
    pub(super) put_buffer: Option<HostBuffer>,
}

impl DeviceStaging {
    pub(super) fn new(device: &'static dyn Device) -> Result<DeviceStaging> {
        let chunks = [device.host_buffer(DEVICE_CHUNK)?, device.host_buffer(DEVICE_CHUNK)?];
        Ok(DeviceStaging { device, streams: Vec::new(), chunks, put_buffer: None })
    }

    pub(super) fn stream(&mut self, ordinal: i32) -> Result<&mut dyn Stream> {
        let at = match self.streams.iter().position(|s| s.0 == ordinal) {
            Some(i) => i,
            None => {
                self.streams.push((ordinal, self.device.stream(ordinal)?));
                self.streams.len() - 1
            }
        };
        Ok(&mut *self.streams[at].1)
    }

    /// Copies `len` bytes of device memory at `addr` into a pinned buffer.
    pub(super) fn copy_to_host(&mut self, addr: usize, len: usize, ordinal: i32) -> Result<&[u8]> {
        if self.put_buffer.as_ref().is_none_or(|b| b.len() < len) {
            self.put_buffer = None;
            self.put_buffer = Some(self.device.host_buffer(len)?);
        }
        let host = self.put_buffer.as_mut().unwrap().as_mut_ptr();
        let stream = self.stream(ordinal)?;
        // SAFETY: the put buffer holds `len` bytes and is used by nothing else; the caller
        // of `put_from` keeps the device range valid; the stream is synchronized below,
        // before either is used again or the call returns.
        let queued = unsafe { stream.to_host(host, addr, len) };
        let synchronized = stream.synchronize();
        queued.and(synchronized)?;
        Ok(&self.put_buffer.as_ref().unwrap().as_slice()[..len])
    }

    /// Drops a put buffer larger than is kept between calls.
    pub(super) fn trim(&mut self) {
        if self.put_buffer.as_ref().is_some_and(|b| b.len() > KEEP_PUT_BUFFER) {
            self.put_buffer = None;
        }
    }
}
