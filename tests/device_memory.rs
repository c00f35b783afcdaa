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
use remote_dram::client::{ByteRange, GetInto, GetOptions, PutOptions, WriteCondition, WriteResult, DEVICE_CHUNK};
use remote_dram::gpu::posing::{self, Posing};
use remote_dram::proto::{flags, Op, RequestHeader, REQUEST_HEADER_LEN};
use remote_dram::{Client, ClientOptions, DevicePath, Status};

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

/// Values staged on the server's shards (a put in parts left none behind).
fn staged(c: &mut Client) -> u64 {
    let stats = c.stats().unwrap();
    stats["servers"][0]["shards"].as_array().unwrap().iter().map(|s| s["staged_values"].as_u64().unwrap()).sum()
}

fn generation(w: WriteResult) -> u64 {
    match w {
        WriteResult::Written { generation } => generation,
        other => panic!("{other:?}"),
    }
}

/// Puts `value` from device memory under `key`, reads it back from host memory and into
/// device memory, each byte-exact with the put's generation, no copy running after either
/// call: the device copies the put and the get made.
fn round_trip(c: &mut Client, posing: &'static Posing, key: &[u8], value: &[u8]) -> (u64, u64) {
    let len = value.len();
    let copies = posing.copies.load(Ordering::Relaxed);
    let g = generation(DeviceBuffer::with(posing, value).put(c, key).unwrap());
    let put = posing.copies.load(Ordering::Relaxed) - copies;
    assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0, "no copy runs after the put returned");
    let stored = c.get(key).unwrap().unwrap();
    assert_eq!((stored.data == value, stored.generation), (true, g), "{len} bytes put from device memory");
    let mut dst = DeviceBuffer::new(posing, len, 0xEE);
    let got = dst.get(c, key, &GetOptions::default()).unwrap();
    assert_eq!(got, GetInto::Value { len, generation: g, size: len as u64 });
    assert!(dst.memory == value, "{len} bytes read into device memory differ");
    assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0, "no copy runs after the get returned");
    (put, posing.copies.load(Ordering::Relaxed) - copies - put)
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
        // Host → device, in chunks when longer than one.
        let (put, get) = round_trip(&mut c, posing, key.as_bytes(), &pattern(i as u64, len));
        let per_chunk = len.div_ceil(DEVICE_CHUNK) as u64;
        assert_eq!(
            (put, get),
            (per_chunk, per_chunk),
            "{len} bytes: one copy per chunk for the put (in parts), and for the get"
        );
    }
    assert_eq!(staged(&mut c), 0, "nothing is left staged by puts in parts");

    // A put in parts keeps its condition and TTL, which the commit carries.
    let len = 2 * DEVICE_CHUNK + 1;
    let key = format!("dev/{}", DEVICE_CHUNK + 1);
    let absent = PutOptions { condition: WriteCondition::IfAbsent, ..Default::default() };
    let src = DeviceBuffer::with(posing, &pattern(50, len));
    // SAFETY: memory of `src`, unchanged for the call.
    assert_eq!(
        unsafe { c.put_from(key.as_bytes(), src.memory.as_ptr(), len, &absent) }.unwrap(),
        WriteResult::ConditionFailed
    );
    assert_eq!(
        c.get(key.as_bytes()).unwrap().unwrap().data.len(),
        DEVICE_CHUNK + 1,
        "a failed condition wrote nothing"
    );
    let brief = PutOptions { ttl: Some(Duration::from_millis(300)), ..Default::default() };
    // SAFETY: as above.
    assert!(matches!(
        unsafe { c.put_from(b"dev/brief", src.memory.as_ptr(), len, &brief) }.unwrap(),
        WriteResult::Written { .. }
    ));
    assert_eq!(c.get(b"dev/brief").unwrap().unwrap().data, pattern(50, len));
    assert!(
        wait_until(Duration::from_secs(5), || c.get(b"dev/brief").unwrap().is_none()),
        "the TTL given with the parts holds"
    );
    assert_eq!(staged(&mut c), 0);

    // A value put from host memory reads into device memory; a byte range from the middle
    // of a multi-chunk value, and a suffix, land at the buffer's start.
    let len = 2 * DEVICE_CHUNK + 777;
    let value = pattern(99, len);
    c.put(b"host/big", &value).unwrap();
    for (range, expect) in [
        (ByteRange { start: 3, end: -1 }, &value[3..]),
        (
            ByteRange { start: DEVICE_CHUNK as i64 - 5, end: 2 * DEVICE_CHUNK as i64 + 9 },
            &value[DEVICE_CHUNK - 5..2 * DEVICE_CHUNK + 9],
        ),
        (ByteRange { start: -100, end: -1 }, &value[len - 100..]),
    ] {
        let mut dst = DeviceBuffer::new(posing, len, 0);
        let got = dst.get(&mut c, b"host/big", &GetOptions { range: Some(range), ..Default::default() }).unwrap();
        assert!(
            matches!(got, GetInto::Value { len: n, size, .. } if n == expect.len() && size == len as u64),
            "{range:?}: {got:?}"
        );
        assert!(&dst.memory[..expect.len()] == expect, "{range:?}: the bytes differ");
    }

    // Too small a device buffer: nothing written, the size needed answered.
    let mut small = DeviceBuffer::new(posing, len - 1, 0x5A);
    assert_eq!(small.get(&mut c, b"host/big", &GetOptions::default()).unwrap(), GetInto::TooSmall { needed: len });
    assert!(small.memory.iter().all(|&b| b == 0x5A), "a too-small buffer was written");
    assert_eq!(small.get(&mut c, b"nothing", &GetOptions::default()).unwrap(), GetInto::Missing);
    let g = c.get(b"host/big").unwrap().unwrap().generation;
    let unchanged =
        small.get(&mut c, b"host/big", &GetOptions { if_not_equal: Some(g), ..Default::default() }).unwrap();
    assert_eq!(unchanged, GetInto::Unchanged { generation: g });

    // Registering device memory is accepted (it needs none).
    // SAFETY: the buffer outlives the registration (deregistered below).
    unsafe { c.register(small.memory.as_mut_ptr(), small.memory.len()).unwrap() };
    c.deregister(small.memory.as_mut_ptr()).unwrap();

    drop(c);
    assert_eq!(posing.streams.load(Ordering::Relaxed), 0, "the client's stream went with it");
    assert_eq!(posing.host_buffers.load(Ordering::Relaxed), 0, "the client's pinned buffers went with it");
}

/// With `DevicePath::Transport`, UCX is handed the device memory itself: a put's value
/// and a large get's destination move without a copy of the client's (here UCX moves the
/// posing memory as the host memory it is; on a GPU host, as CUDA memory), and a small
/// reply, which UCX delivers into its own memory, is copied in on the stream. A value
/// longer than the destination writes nothing.
#[test]
fn device_values_round_trip_through_the_transport() {
    let (_one, posing) = setup();
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let opts = ClientOptions { device_path: DevicePath::Transport, ..common::options() };
    let mut c = Client::connect(&server.addr, opts).unwrap();
    for (i, len) in [0, 1, 4095, 65_543, (1 << 20) + 3, 3 * DEVICE_CHUNK + 5].into_iter().enumerate() {
        let key = format!("dev/transport/{len}");
        let (put, copied) = round_trip(&mut c, posing, key.as_bytes(), &pattern(100 + i as u64, len));
        assert_eq!(put, 0, "{len} bytes: the put staged nothing");
        match len {
            0 => assert_eq!(copied, 0, "an empty value needs no copy"),
            1 => assert_eq!(copied, 1, "{len} bytes arrive eagerly: one copy in"),
            l if l > DEVICE_CHUNK => assert_eq!(copied, 0, "{len} bytes arrive by rendezvous, into the buffer"),
            _ => assert!(copied <= 1, "{len} bytes: {copied} copies"),
        }
    }

    let value = pattern(120, 5000);
    c.put(b"dev/transport/long", &value).unwrap();
    for short in [100, 4999] {
        let mut dst = DeviceBuffer::new(posing, short, 0xAB);
        let got = dst.get(&mut c, b"dev/transport/long", &GetOptions::default()).unwrap();
        assert_eq!(got, GetInto::TooSmall { needed: 5000 });
        assert!(dst.memory.iter().all(|&b| b == 0xAB), "a value longer than the buffer wrote into it");
    }
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

    // The first part's copy fails; then the second's, once the first part was sent.
    for fail_after in [0, 1] {
        posing.fail_after(Some(fail_after));
        let e = DeviceBuffer::with(posing, &value).put(&mut c, b"k").unwrap_err();
        assert_eq!(e.status, Status::Io, "{e}");
        assert_eq!(posing.in_flight.load(Ordering::Relaxed), 0);
        assert_eq!(c.get(b"k").unwrap(), None, "a put whose device copy failed stored something");
        assert_eq!(staged(&mut c), 0, "a put in parts that failed left its parts staged");
    }
    posing.fail_after(None);

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
    assert!(
        dst.memory[..2 * DEVICE_CHUNK] == value[..2 * DEVICE_CHUNK],
        "the chunk copies queued finished before the return"
    );
    common::signal(pid, common::SIGCONT);
    posing.set_copy_delay(Duration::ZERO);
}

/// A server with too little staging room for a value's parts takes it whole; parts that
/// name another session's value, come out of order or commit an incomplete value are
/// refused.
#[test]
fn puts_in_parts_fall_back_and_refuse_what_is_out_of_order() {
    let (_one, posing) = setup();
    // 32 MiB shards stage at most 8 MiB, 4 MiB per session: 3 chunks do not fit.
    let server = ServerProc::start(&["--memory", "64MiB"]);
    let mut c = server.client();
    let len = 3 * DEVICE_CHUNK;
    let value = pattern(11, len);
    let copies = posing.copies.load(Ordering::Relaxed);
    generation(DeviceBuffer::with(posing, &value).put(&mut c, b"whole").unwrap());
    assert_eq!(
        posing.copies.load(Ordering::Relaxed) - copies,
        3,
        "the first two parts' copies, refused, then the value whole in one copy"
    );
    assert_eq!(c.get(b"whole").unwrap().unwrap().data, value);
    assert_eq!(staged(&mut c), 0);

    let key = b"parts";
    let shard = remote_dram::proto::shard_of(key, 2); // ServerProc's two workers
    let send = |c: &mut Client, start: i64, end: i64, stage: u64, payload: &[u8]| {
        let (session, id) = c.raw_session();
        let mut h = RequestHeader::new(Op::Put, id, session);
        h.flags = flags::STAGE | flags::HAS_RANGE;
        h.key_len = key.len() as u32;
        (h.range_start, h.range_end, h.if_not_equal) = (start, end, stage);
        let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
        h.encode((&mut buf[..]).try_into().unwrap());
        buf.extend_from_slice(key);
        let (status, msg) = c.raw_request(shard, &buf, payload, Duration::from_secs(10)).unwrap();
        (status, msg, id)
    };
    let part = pattern(12, 1000);
    // More than the session may stage: a bound, not an outage.
    let (status, msg, _) = send(&mut c, 0, 6 << 20, 0, &part);
    assert_eq!(status, Status::NoRoom, "{msg}");
    let (status, msg, stage) = send(&mut c, 0, 3000, 0, &part);
    assert_eq!(status, Status::Ok, "{msg}");
    assert_eq!(send(&mut c, 2000, 3000, stage, &part).0, Status::Invalid, "out of order");
    assert_eq!(send(&mut c, 1000, 3000, stage + 99, &part).0, Status::Missing, "no such value");
    let mut other = server.client();
    assert_eq!(send(&mut other, 1000, 3000, stage, &part).0, Status::Missing, "another session's value");
    // Installing a value staged in parts as an import is for a cluster's members, with a
    // ticket: this server is in no cluster.
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(Op::Put, id, session);
    h.flags = flags::STAGE | flags::IMPORT;
    (h.key_len, h.if_not_equal, h.if_equal) = (key.len() as u32, stage, 5);
    let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
    h.encode((&mut buf[..]).try_into().unwrap());
    buf.extend_from_slice(key);
    assert_eq!(
        c.raw_request(shard, &buf, &[], Duration::from_secs(10)).unwrap().0,
        Status::AuthFailed,
        "an import of a value staged in parts"
    );
    // Refused at the door, it left the value staged: discarded, as a client does.
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(Op::Delete, id, session);
    h.flags = flags::STAGE;
    (h.key_len, h.if_not_equal) = (key.len() as u32, stage);
    let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
    h.encode((&mut buf[..]).try_into().unwrap());
    buf.extend_from_slice(key);
    assert_eq!(c.raw_request(shard, &buf, &[], Duration::from_secs(10)).unwrap().0, Status::Ok);
    assert_eq!(c.get(key).unwrap(), None);
    let (_, _, stage) = send(&mut c, 0, 3000, 0, &part);
    assert_eq!(send(&mut c, 3000, 3000, stage, &[]).0, Status::Invalid, "a commit of an incomplete value");
    assert_eq!(c.get(key).unwrap(), None);
    assert_eq!(staged(&mut c), 0, "the refused commit freed the value");
    // Whole, in order: committed as an ordinary put.
    let (_, _, stage) = send(&mut c, 0, 2000, 0, &part);
    assert_eq!(send(&mut c, 1000, 2000, stage, &part).0, Status::Ok);
    let (status, msg, _) = send(&mut c, 2000, 2000, stage, &[]);
    assert_eq!(status, Status::Ok, "{msg}");
    assert_eq!(c.get(key).unwrap().unwrap().data, [&part[..], &part[..]].concat());
    // A value left unfinished goes with its session.
    send(&mut other, 0, 3000, 0, &part);
    assert_eq!(staged(&mut c), 1);
    drop(other);
    assert!(wait_until(Duration::from_secs(5), || staged(&mut c) == 0), "an ended session's parts were freed");
    assert!(c.delete(key).unwrap() && c.delete(b"whole").unwrap());
    assert_eq!(c.stats().unwrap()["used_bytes"].as_u64(), Some(0), "nothing staged or stored is left");
}

/// The C ABI's declarations this test calls (include/remote_dram.h), linked from the crate.
mod c_abi {
    use std::ffi::{c_char, c_void};

    #[repr(C)]
    pub struct PutItem {
        pub key: *const u8,
        pub key_len: usize,
        pub value: *const u8,
        pub value_len: usize,
        pub generation: u64,
        pub status: i32,
    }

    #[repr(C)]
    pub struct GetItem {
        pub key: *const u8,
        pub key_len: usize,
        pub buf: *mut u8,
        pub buf_len: usize,
        pub value_len: usize,
        pub generation: u64,
        pub status: i32,
    }

    extern "C" {
        pub fn rdram_client_connect(addresses: *const c_char, options: *const c_void, out: *mut *mut c_void) -> i32;
        pub fn rdram_client_close(client: *mut c_void);
        pub fn rdram_put(
            client: *mut c_void,
            key: *const u8,
            key_len: usize,
            value: *const u8,
            value_len: usize,
            generation_out: *mut u64,
        ) -> i32;
        pub fn rdram_get(
            client: *mut c_void,
            key: *const u8,
            key_len: usize,
            buf: *mut u8,
            buf_len: usize,
            value_len_out: *mut usize,
            generation_out: *mut u64,
        ) -> i32;
        pub fn rdram_mput(client: *mut c_void, items: *mut PutItem, n: usize) -> i32;
        pub fn rdram_mget(client: *mut c_void, items: *mut GetItem, n: usize) -> i32;
        pub fn rdram_register(client: *mut c_void, addr: *mut c_void, len: usize) -> i32;
    }
}

/// The C ABI takes device pointers: single calls and batches mixing device and host buffers.
#[test]
fn c_abi_takes_device_pointers() {
    let (_one, posing) = setup();
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let addr = std::ffi::CString::new(server.addr.clone()).unwrap();
    let len = 2 * DEVICE_CHUNK + 5;
    let value = pattern(21, len);
    let src = DeviceBuffer::with(posing, &value);
    let mut dst = DeviceBuffer::new(posing, len, 0);
    let host_value = pattern(22, 1000);
    let mut host_dst = vec![0u8; 1000];
    let mut dst2 = DeviceBuffer::new(posing, 1000, 0);
    // SAFETY: every pointer is to live memory of the lengths given; the handle is closed last.
    unsafe {
        let mut c = std::ptr::null_mut();
        assert_eq!(c_abi::rdram_client_connect(addr.as_ptr(), std::ptr::null(), &mut c), 0);
        let (mut generation, mut got) = (0u64, 0usize);
        assert_eq!(c_abi::rdram_put(c, b"c/dev".as_ptr(), 5, src.memory.as_ptr(), len, &mut generation), 0);
        assert_eq!(
            c_abi::rdram_get(c, b"c/dev".as_ptr(), 5, dst.memory.as_mut_ptr(), len, &mut got, std::ptr::null_mut()),
            0
        );
        assert!(got == len && dst.memory == value, "rdram_get into device memory");
        assert_eq!(
            c_abi::rdram_register(c, dst.memory.as_mut_ptr().cast(), len),
            0,
            "registering device memory is accepted"
        );

        let mut puts = [
            c_abi::PutItem {
                key: b"c/b1".as_ptr(),
                key_len: 4,
                value: src.memory.as_ptr(),
                value_len: 1000,
                generation: 0,
                status: -99,
            },
            c_abi::PutItem {
                key: b"c/b2".as_ptr(),
                key_len: 4,
                value: host_value.as_ptr(),
                value_len: 1000,
                generation: 0,
                status: -99,
            },
        ];
        assert_eq!(c_abi::rdram_mput(c, puts.as_mut_ptr(), 2), 0);
        assert!(puts.iter().all(|p| p.status == 0 && p.generation > 0));
        let mut gets = [
            c_abi::GetItem {
                key: b"c/b2".as_ptr(),
                key_len: 4,
                buf: dst2.memory.as_mut_ptr(),
                buf_len: 1000,
                value_len: 0,
                generation: 0,
                status: -99,
            },
            c_abi::GetItem {
                key: b"c/b1".as_ptr(),
                key_len: 4,
                buf: host_dst.as_mut_ptr(),
                buf_len: 1000,
                value_len: 0,
                generation: 0,
                status: -99,
            },
        ];
        assert_eq!(c_abi::rdram_mget(c, gets.as_mut_ptr(), 2), 0);
        assert!(gets.iter().all(|g| g.status == 0 && g.value_len == 1000));
        c_abi::rdram_client_close(c);
    }
    assert!(dst2.memory == host_value, "a batch item read into device memory");
    assert!(host_dst[..] == value[..1000], "a batch item put from device memory");
}
