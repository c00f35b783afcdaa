//! Device (GPU) memory through the client's staging, against a real server over UCX shared
//! memory, on machines without a GPU: host buffers pose as device memory
//! (`remote_dram::gpu::posing`), and every byte of theirs moves through the posing device's
//! copy thread, as a GPU's would move through its copy engine. `bench/gpu-check` runs the
//! same paths with real CUDA memory on the GPU machine.
mod common;

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use common::{pattern, wait_until, ServerProc, SHM};
use remote_dram::client::{ByteRange, GetInto, GetOptions, PutOptions, WriteResult, DEVICE_CHUNK};
use remote_dram::gpu::posing::{self, Posing};
use remote_dram::{Client, ClientOptions, Status};

/// The posing device is the process's; its counters are read by one test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn setup() -> (std::sync::MutexGuard<'static, ()>, &'static Posing) {
    common::init(SHM);
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let posing = posing::install().expect("no device was fixed before the posing one");
    posing.set_copy_delay(Duration::ZERO);
    posing.fail_after(None);
    (guard, posing)
}

/// Host memory that poses as device memory while it lives.
struct DeviceBuffer {
    memory: Vec<u8>,
    posing: &'static Posing,
}

impl DeviceBuffer {
    fn new(posing: &'static Posing, len: usize, fill: u8) -> DeviceBuffer {
        let memory = vec![fill; len];
        posing.pose(memory.as_ptr() as usize, len);
        DeviceBuffer { memory, posing }
    }

    fn with(posing: &'static Posing, bytes: &[u8]) -> DeviceBuffer {
        let mut b = DeviceBuffer::new(posing, bytes.len(), 0);
        b.memory.copy_from_slice(bytes);
        b
    }

    fn put(&self, c: &mut Client, key: &[u8]) -> remote_dram::Result<WriteResult> {
        // SAFETY: memory of this buffer, unchanged for the call.
        unsafe { c.put_from(key, self.memory.as_ptr(), self.memory.len(), &PutOptions::default()) }
    }

    fn get(&mut self, c: &mut Client, key: &[u8], opts: &GetOptions) -> remote_dram::Result<GetInto> {
        // SAFETY: memory of this buffer, used by nothing else during the call.
        unsafe { c.get_into_ptr(key, opts, self.memory.as_mut_ptr(), self.memory.len()) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.posing.unpose(self.memory.as_ptr() as usize);
    }
}

fn generation(w: WriteResult) -> u64 {
    match w {
        WriteResult::Written { generation } => generation,
        other => panic!("{other:?}"),
    }
}

/// Values of 0 B to several chunks go device → server → device byte-exact, through the
/// device's copies only, and cross between device and host memory either way; ranges,
/// a too-small buffer and a missing key answer as for host memory.
#[test]
fn device_values_round_trip_through_staging() {
    let (_one, posing) = setup();
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let mut c = server.client();
    let sizes = [0, 1, 4095, DEVICE_CHUNK - 1, DEVICE_CHUNK, DEVICE_CHUNK + 1, 3 * DEVICE_CHUNK + 12_345];
    for (i, &len) in sizes.iter().enumerate() {
        let key = format!("dev/{len}");
        let value = pattern(i as u64, len);
        let copies = posing.copies.load(Ordering::Relaxed);
        let g = generation(DeviceBuffer::with(posing, &value).put(&mut c, key.as_bytes()).unwrap());
        assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0, "no copy runs after the put returned");
        // Device → host: the stored bytes are the device buffer's.
        let stored = c.get(key.as_bytes()).unwrap().unwrap();
        assert_eq!((stored.data == value, stored.generation), (true, g), "{len} bytes put from device memory");
        // Host → device, in chunks when longer than one.
        let mut dst = DeviceBuffer::new(posing, len, 0xEE);
        let got = dst.get(&mut c, key.as_bytes(), &GetOptions::default()).unwrap();
        assert_eq!(got, GetInto::Value { len, generation: g, size: len as u64 });
        assert!(dst.memory == value, "{len} bytes read into device memory differ");
        assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0, "no copy runs after the get returned");
        let expected_copies = if len == 0 { 0 } else { 1 + len.div_ceil(DEVICE_CHUNK) as u64 };
        assert_eq!(posing.copies.load(Ordering::Relaxed) - copies, expected_copies, "{len} bytes: one copy for the put, one per chunk for the get");
    }

    // A value put from host memory reads into device memory; a byte range from the middle
    // of a multi-chunk value, and a suffix, land at the buffer's start.
    let len = 2 * DEVICE_CHUNK + 777;
    let value = pattern(99, len);
    c.put(b"host/big", &value).unwrap();
    for (range, expect) in [
        (ByteRange { start: 3, end: -1 }, &value[3..]),
        (ByteRange { start: DEVICE_CHUNK as i64 - 5, end: 2 * DEVICE_CHUNK as i64 + 9 }, &value[DEVICE_CHUNK - 5..2 * DEVICE_CHUNK + 9]),
        (ByteRange { start: -100, end: -1 }, &value[len - 100..]),
    ] {
        let mut dst = DeviceBuffer::new(posing, len, 0);
        let got = dst.get(&mut c, b"host/big", &GetOptions { range: Some(range), ..Default::default() }).unwrap();
        assert!(matches!(got, GetInto::Value { len: n, size, .. } if n == expect.len() && size == len as u64), "{range:?}: {got:?}");
        assert!(&dst.memory[..expect.len()] == expect, "{range:?}: the bytes differ");
    }

    // Too small a device buffer: nothing written, the size needed answered.
    let mut small = DeviceBuffer::new(posing, len - 1, 0x5A);
    assert_eq!(small.get(&mut c, b"host/big", &GetOptions::default()).unwrap(), GetInto::TooSmall { needed: len });
    assert!(small.memory.iter().all(|&b| b == 0x5A), "a too-small buffer was written");
    assert_eq!(small.get(&mut c, b"nothing", &GetOptions::default()).unwrap(), GetInto::Missing);
    let g = c.get(b"host/big").unwrap().unwrap().generation;
    let unchanged = small.get(&mut c, b"host/big", &GetOptions { if_not_equal: Some(g), ..Default::default() }).unwrap();
    assert_eq!(unchanged, GetInto::Unchanged { generation: g });

    // Registering device memory is accepted (it needs none).
    // SAFETY: the buffer outlives the registration (deregistered below).
    unsafe { c.register(small.memory.as_mut_ptr(), small.memory.len()).unwrap() };
    c.deregister(small.memory.as_mut_ptr()).unwrap();

    drop(c);
    assert_eq!(posing.streams.load(Ordering::Relaxed), 0, "the client's stream went with it");
    assert_eq!(posing.host_buffers.load(Ordering::Relaxed), 0, "the client's pinned buffers went with it");
}

/// A failed device copy fails the call and stores nothing; a get whose network request
/// times out while a chunk is being copied into the caller's device memory returns only
/// once that copy ended, and nothing writes the buffer afterwards.
#[test]
fn device_failures_and_timeouts_leave_no_copy_behind() {
    let (_one, posing) = setup();
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let opts = ClientOptions { timeout: Duration::from_millis(500), ..common::options() };
    let mut c = Client::connect(&server.addr, opts).unwrap();
    let len = 2 * DEVICE_CHUNK;
    let value = pattern(7, len);

    posing.fail_after(Some(0));
    let e = DeviceBuffer::with(posing, &value).put(&mut c, b"k").unwrap_err();
    assert_eq!(e.status, Status::Io, "{e}");
    assert_eq!(c.get(b"k").unwrap(), None, "a put whose device copy failed stored something");

    c.put(b"k", &value).unwrap();
    posing.fail_after(Some(1));
    let mut dst = DeviceBuffer::new(posing, len, 0);
    let e = dst.get(&mut c, b"k", &GetOptions::default()).unwrap_err();
    assert_eq!(e.status, Status::Io, "{e}");
    assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0);
    posing.fail_after(None);
    assert!(matches!(dst.get(&mut c, b"k", &GetOptions::default()).unwrap(), GetInto::Value { .. }));
    assert!(dst.memory == value);

    // Chunk copies are slow; the server stops while the first runs (the get waits for it
    // before the next chunk), so the third chunk's request times out while the second
    // chunk is being copied.
    let len = 3 * DEVICE_CHUNK;
    let value = pattern(8, len);
    c.put(b"k", &value).unwrap();
    posing.set_copy_delay(Duration::from_millis(800));
    let pid = server.child.id();
    let stopper = std::thread::spawn(move || {
        let copying = wait_until(Duration::from_secs(10), || posing.in_flight.load(Ordering::Relaxed) > 0);
        common::stop_process(pid);
        copying
    });
    let mut dst = DeviceBuffer::new(posing, len, 0);
    let e = dst.get(&mut c, b"k", &GetOptions::default()).unwrap_err();
    assert!(stopper.join().unwrap(), "no chunk copy started");
    assert_eq!(e.status, Status::Timeout, "{e}");
    assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0, "a copy into the caller's memory outlived the call");
    let after_return = dst.memory.clone();
    std::thread::sleep(Duration::from_millis(300));
    assert!(dst.memory == after_return, "the caller's device memory changed after the call returned");
    assert!(dst.memory[..2 * DEVICE_CHUNK] == value[..2 * DEVICE_CHUNK], "the chunk copies queued finished before the return");
    common::signal(pid, common::SIGCONT);
    posing.set_copy_delay(Duration::ZERO);
}
