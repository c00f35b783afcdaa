//! The transport suite: the same tests over every UCX transport. Each test binary that
//! includes it fixes the transport with `common::init` first.

use std::time::{Duration, Instant};

use crate::common::{self, pattern, rdram, wait_until, ServerProc};
use remote_dram::client::{ByteRange, GetInto, GetOptions, GetResult};
use remote_dram::{Client, ClientOptions, Status};

pub const SIZES: [usize; 5] = [0, 1, 8 << 10, 1 << 20, 64 << 20];

/// The original plan's scenario: a writer process puts and exits, a separate reader
/// process gets the same bytes, and the server's stats show the keys.
pub fn writer_then_reader_processes(tls: &str) {
    common::init(tls);
    let server = ServerProc::start(&["--memory", "512MiB"]);
    let dir = std::env::temp_dir().join(format!("rdram-wr-{}-{}", std::process::id(), tls.len()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, size) in SIZES.iter().enumerate() {
        let path = dir.join(format!("in{i}"));
        std::fs::write(&path, pattern(i as u64, *size)).unwrap();
        let (code, out, err) = rdram(&["put", "--server", &server.addr, &format!("tensor/{size}"), "--file", path.to_str().unwrap()], None);
        assert_eq!(code, 0, "writer failed: {err}");
        assert!(String::from_utf8_lossy(&out).trim().parse::<u64>().is_ok(), "put prints the generation");
    }
    for (i, size) in SIZES.iter().enumerate() {
        let path = dir.join(format!("out{i}"));
        let (code, _, err) = rdram(&["get", "--server", &server.addr, &format!("tensor/{size}"), "--out", path.to_str().unwrap()], None);
        assert_eq!(code, 0, "reader failed: {err}");
        assert!(std::fs::read(&path).unwrap() == pattern(i as u64, *size), "reader got different bytes for {size}");
    }
    let (code, out, _) = rdram(&["stats", "--server", &server.addr], None);
    assert_eq!(code, 0);
    let stats: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(stats["keys"], SIZES.len());
    let (_, out, _) = rdram(&["ls", "--server", &server.addr, "--prefix", "tensor/"], None);
    let listed = String::from_utf8(out).unwrap();
    let mut expected: Vec<String> = SIZES.iter().map(|s| format!("{s}\ttensor/{s}")).collect();
    expected.sort_by(|a, b| a.split('\t').nth(1).cmp(&b.split('\t').nth(1)));
    assert_eq!(listed.lines().collect::<Vec<_>>(), expected);
    let (code, _, err) = rdram(&["get", "--server", &server.addr, "tensor/none"], None);
    assert_eq!(code, 3, "missing key exits 3");
    assert!(err.contains("not found"));
    std::fs::remove_dir_all(&dir).ok();
}

/// In-process client: every size round-trips, overwrites change the generation, and
/// byte ranges of large values are exact.
pub fn sizes_and_ranges(tls: &str) {
    common::init(tls);
    let server = ServerProc::start(&["--memory", "512MiB"]);
    let mut c = server.client();
    for (i, size) in SIZES.iter().enumerate() {
        let key = format!("v/{size}");
        let value = pattern(100 + i as u64, *size);
        let g1 = c.put(key.as_bytes(), &value).unwrap();
        let got = c.get(key.as_bytes()).unwrap().expect("value present");
        assert!(got.data == value, "size {size}");
        assert_eq!((got.generation, got.size), (g1, *size as u64));
        // Straight into a caller's buffer; a too-small buffer loses nothing.
        if *size > 0 {
            let mut small = vec![0u8; size - 1];
            let r = c.get_into(key.as_bytes(), &GetOptions::default(), &mut small).unwrap();
            assert_eq!(r, GetInto::TooSmall { needed: *size });
        }
        let mut buf = vec![0u8; size + 3];
        let r = c.get_into(key.as_bytes(), &GetOptions::default(), &mut buf).unwrap();
        assert_eq!(r, GetInto::Value { len: *size, generation: g1, size: *size as u64 });
        assert!(buf[..*size] == value[..]);
        let g2 = c.put(key.as_bytes(), &value).unwrap();
        assert_ne!(g1, g2, "rewriting identical bytes still changes the generation");
        if *size >= 16 {
            let mid = ByteRange { start: (*size / 4) as i64, end: (*size / 2) as i64 };
            let r = c.get_with(key.as_bytes(), &GetOptions { range: Some(mid), ..Default::default() }).unwrap();
            let GetResult::Value(v) = r else { panic!("range get: {r:?}") };
            assert!(v.data == value[size / 4..size / 2]);
            let suffix = ByteRange { start: -7, end: -1 };
            let GetResult::Value(v) = c.get_with(key.as_bytes(), &GetOptions { range: Some(suffix), ..Default::default() }).unwrap() else { panic!() };
            assert_eq!(v.data, value[size - 7..]);
        }
    }
}

/// A client killed in the middle of a large put: the server frees the slot and keeps
/// serving everyone else.
pub fn killed_client_mid_transfer(tls: &str) {
    common::init(tls);
    let server = ServerProc::start(&["--memory", "1GiB", "--workers", "1"]);
    let mut observer = server.client();
    let used = |c: &mut Client| {
        let s = c.stats().unwrap();
        (s["used_bytes"].as_u64().unwrap(), s["keys"].as_u64().unwrap())
    };
    assert_eq!(used(&mut observer), (0, 0));
    let path = std::env::temp_dir().join(format!("rdram-kill-{}-{}", std::process::id(), tls.len()));
    std::fs::write(&path, pattern(7, 768 << 20)).unwrap();
    let mut killed_mid_transfer = false;
    for _attempt in 0..5 {
        let mut child = std::process::Command::new(common::RDRAM)
            .args(["put", "--server", &server.addr, "big", "--file", path.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The extent is reserved (used > 0) but the key not yet published (keys == 0)
        // exactly while the value is in flight.
        let mut seen_in_flight = false;
        wait_until(Duration::from_secs(20), || {
            let (u, k) = used(&mut observer);
            seen_in_flight = u > 0 && k == 0;
            seen_in_flight || matches!(child.try_wait(), Ok(Some(_)))
        });
        child.kill().ok();
        child.wait().ok();
        killed_mid_transfer = seen_in_flight;
        // Either way, the slot must end up free or published, never leaked.
        assert!(
            wait_until(Duration::from_secs(30), || {
                let (u, k) = used(&mut observer);
                (k == 0 && u == 0) || (k == 1 && u >= 768 << 20)
            }),
            "slot leaked: {:?}",
            used(&mut observer)
        );
        observer.delete(b"big").unwrap();
        if killed_mid_transfer && used(&mut observer) == (0, 0) {
            break;
        }
    }
    std::fs::remove_file(&path).ok();
    assert!(killed_mid_transfer, "never managed to kill the client mid-transfer");
    // Everyone else is still served.
    observer.put(b"after", b"still serving").unwrap();
    assert_eq!(observer.get(b"after").unwrap().unwrap().data, b"still serving");
}

/// A server that is gone: the client fails within a bounded time, never hangs.
pub fn server_gone(tls: &str) {
    common::init(tls);
    let mut server = ServerProc::start(&[]);
    let opts = ClientOptions { timeout: Duration::from_secs(3), ..Default::default() };
    let mut c = Client::connect(&server.addr, opts.clone()).unwrap();
    c.put(b"k", b"v").unwrap();
    server.kill();
    let start = Instant::now();
    let err = c.get(b"k").unwrap_err();
    assert!(matches!(err.status, Status::Unavailable | Status::Timeout | Status::Transport), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    // Later calls fail at once, and a new connection is refused with a clear message.
    assert!(c.get(b"k").is_err());
    let err = Client::connect(&server.addr, opts).err().expect("connect to a dead server fails");
    assert_eq!(err.status, Status::Unavailable, "{err}");
}

#[macro_export]
macro_rules! transport_suite {
    ($tls:expr) => {
        #[test]
        fn writer_then_reader_processes() {
            suite::writer_then_reader_processes($tls)
        }
        #[test]
        fn sizes_and_ranges() {
            suite::sizes_and_ranges($tls)
        }
        #[test]
        fn killed_client_mid_transfer() {
            suite::killed_client_mid_transfer($tls)
        }
        #[test]
        fn server_gone() {
            suite::server_gone($tls)
        }
    };
}
