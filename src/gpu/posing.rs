//! Host memory posing as device memory, for tests on machines without a GPU.
//!
//! A test names ranges of its own host memory with [`Posing::pose`]; [`super::kind_of`]
//! then calls them device memory, and the staging copies them only through
//! [`super::Stream`]s whose copies run on a thread of their own, after a delay that a
//! test may set, and fail when a test says so: the same order, overlap and failure
//! paths as a GPU's copy engine, with a plain copy.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::{Device, HostBuffer, MemoryKind, Stream};
use crate::error::{Error, Result, Status};

/// The posing device, with counters that tests read.
#[derive(Default)]
pub struct Posing {
    ranges: Mutex<Vec<(usize, usize)>>,
    copy_delay_us: AtomicU64,
    /// Copies left before one fails; negative: none fails.
    fail_in: AtomicI64,
    /// Copies queued and not finished, over every stream.
    pub in_flight: AtomicI64,
    /// Copies run, over every stream.
    pub copies: AtomicU64,
    /// Streams and host buffers not dropped yet.
    pub streams: AtomicUsize,
    pub host_buffers: AtomicUsize,
}

static POSING: OnceLock<&'static Posing> = OnceLock::new();

/// The process's posing device, installed as its device on the first call. None when a
/// device was fixed before (the process asked for one already).
pub fn install() -> Option<&'static Posing> {
    let posing = *POSING.get_or_init(|| {
        let p = Box::leak(Box::new(Posing::default()));
        p.fail_in.store(-1, Ordering::Relaxed);
        p
    });
    (super::install(posing) || super::device().is_some_and(|d| std::ptr::addr_eq(d, posing))).then_some(posing)
}

impl Posing {
    /// Calls `[addr, addr+len)` device memory (of GPU 0) until [`Posing::unpose`].
    pub fn pose(&self, addr: usize, len: usize) {
        self.ranges.lock().unwrap().push((addr, len));
    }

    pub fn unpose(&self, addr: usize) {
        self.ranges.lock().unwrap().retain(|r| r.0 != addr);
    }

    /// Each copy waits this long before it runs.
    pub fn set_copy_delay(&self, delay: Duration) {
        self.copy_delay_us.store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// The copy after the next `n` fails (and later ones run); None: none fails.
    pub fn fail_after(&self, n: Option<u64>) {
        self.fail_in.store(n.map_or(-1, |n| n as i64), Ordering::Relaxed);
    }

    fn posed(&self, addr: usize, len: usize) -> bool {
        self.ranges.lock().unwrap().iter().any(|&(a, l)| addr >= a && addr.saturating_add(len) <= a + l)
    }

    fn run(&self, copy: &Copy) -> Result<()> {
        std::thread::sleep(Duration::from_micros(self.copy_delay_us.load(Ordering::Relaxed)));
        self.copies.fetch_add(1, Ordering::Relaxed);
        if self.fail_in.fetch_sub(1, Ordering::Relaxed) == 0 {
            return Err(Error::new(Status::Io, "posing device: a copy failed, as the test asked"));
        }
        // SAFETY: `Stream::to_host`/`to_device`'s contract keeps both ranges valid until the
        // stream is synchronized, which waits for this copy; they are distinct memory.
        unsafe { std::ptr::copy_nonoverlapping(copy.src as *const u8, copy.dst as *mut u8, copy.len) };
        Ok(())
    }
}

impl Device for Posing {
    fn kind(&self, addr: usize) -> MemoryKind {
        if self.posed(addr, 1) {
            MemoryKind::Device { ordinal: 0 }
        } else {
            MemoryKind::Host
        }
    }

    fn stream(&'static self, ordinal: i32) -> Result<Box<dyn Stream>> {
        if ordinal != 0 {
            return Err(Error::new(Status::Invalid, format!("posing device: no GPU {ordinal}")));
        }
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let thread =
            std::thread::Builder::new().name("posing-stream".into()).spawn(move || copy_engine(self, queue))?;
        self.streams.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(PosingStream { posing: self, jobs: Some(jobs), thread: Some(thread) }))
    }

    fn wait_for_stream(&self, _ordinal: i32, _stream: usize) -> Result<()> {
        // Nothing else queues work on the posing device.
        Ok(())
    }

    fn host_buffer(&'static self, len: usize) -> Result<HostBuffer> {
        let memory: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
        let counter = &self.host_buffers;
        counter.fetch_add(1, Ordering::Relaxed);
        let free = Box::new(move |p: *mut u8, len: usize| {
            // SAFETY: `p`/`len` are the leaked slice's, given back once (on the buffer's drop).
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) });
            counter.fetch_sub(1, Ordering::Relaxed);
        });
        // SAFETY: a leaked boxed slice of `len` bytes, owned by the buffer alone.
        Ok(unsafe { HostBuffer::new(memory.as_mut_ptr(), len, free) })
    }

    fn poses_host_memory(&self) -> bool {
        true
    }
}

struct Copy {
    dst: usize,
    src: usize,
    len: usize,
}

enum Job {
    Copy(Copy),
    /// Answers the first failure since the last one, once every copy before it ran.
    Sync(Sender<Result<()>>),
}

fn copy_engine(posing: &Posing, queue: Receiver<Job>) {
    let mut failed: Option<Error> = None;
    for job in queue {
        match job {
            Job::Copy(copy) => {
                // A stream stops at its first failure, as a CUDA stream does: later copies are dropped.
                if failed.is_none() {
                    failed = posing.run(&copy).err();
                }
                posing.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            Job::Sync(answer) => {
                let _ = answer.send(failed.take().map_or(Ok(()), Err));
            }
        }
    }
}

struct PosingStream {
    posing: &'static Posing,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl PosingStream {
    fn queue(&mut self, copy: Copy, device: usize) -> Result<()> {
        if !self.posing.posed(device, copy.len) {
            return Err(Error::new(
                Status::Invalid,
                format!("posing device: {device:#x}+{} is not device memory", copy.len),
            ));
        }
        self.posing.in_flight.fetch_add(1, Ordering::Relaxed);
        self.jobs
            .as_ref()
            .unwrap()
            .send(Job::Copy(copy))
            .map_err(|_| Error::new(Status::Internal, "posing device: the stream's thread is gone"))
    }
}

impl Stream for PosingStream {
    unsafe fn to_host(&mut self, host: *mut u8, device: usize, len: usize) -> Result<()> {
        self.queue(Copy { dst: host as usize, src: device, len }, device)
    }

    unsafe fn to_device(&mut self, device: usize, host: *const u8, len: usize) -> Result<()> {
        self.queue(Copy { dst: device, src: host as usize, len }, device)
    }

    fn synchronize(&mut self) -> Result<()> {
        let (answer, answered) = crossbeam_channel::bounded(1);
        self.jobs
            .as_ref()
            .unwrap()
            .send(Job::Sync(answer))
            .map_err(|_| Error::new(Status::Internal, "posing device: the stream's thread is gone"))?;
        answered.recv().map_err(|_| Error::new(Status::Internal, "posing device: the stream's thread is gone"))?
    }
}

impl Drop for PosingStream {
    fn drop(&mut self) {
        // The thread runs what is queued, then ends.
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.posing.streams.fetch_sub(1, Ordering::Relaxed);
    }
}
