//! The transport suite: the same engine tests over every transport (UCX tcp and shared
//! memory, libfabric tcp;ofi_rxm and shm). Each test binary that includes it fixes the
//! transport with `common::init` first.

#![allow(dead_code)] // each binary runs the part of the suite its transport supports

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use crate::common::{self, pattern, rdram, wait_until, ServerProc};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use remote_dram::client::{
    ByteRange, DeleteResult, GetAtMost, GetInto, GetOptions, GetResult, KeyRange, PutOptions, WriteCondition,
    WriteResult,
};
use remote_dram::proto::{flags, Op, RequestHeader, MAX_KEY_LEN, REQUEST_HEADER_LEN};
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
        let (code, out, err) = rdram(
            &["put", "--server", &server.addr, &format!("tensor/{size}"), "--file", path.to_str().unwrap()],
            None,
        );
        assert_eq!(code, 0, "writer failed: {err}");
        assert!(String::from_utf8_lossy(&out).trim().parse::<u64>().is_ok(), "put prints the generation");
    }
    for (i, size) in SIZES.iter().enumerate() {
        let path = dir.join(format!("out{i}"));
        let (code, _, err) =
            rdram(&["get", "--server", &server.addr, &format!("tensor/{size}"), "--out", path.to_str().unwrap()], None);
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
        // A get capped below the value's length: only its length and generation come back;
        // at or above it, the value.
        if *size > 0 {
            let r = c.get_at_most(key.as_bytes(), &GetOptions::default(), size - 1).unwrap();
            assert_eq!(r, GetAtMost::TooLong { len: *size, generation: g1, size: *size as u64 }, "size {size}");
        }
        match c.get_at_most(key.as_bytes(), &GetOptions::default(), *size).unwrap() {
            GetAtMost::Got(GetResult::Value(v)) => {
                assert!(v.data == value && v.generation == g1, "size {size}, capped get")
            }
            other => panic!("size {size}, capped get: {other:?}"),
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
            // The cap applies to the range, not the whole value.
            let capped = c
                .get_at_most(key.as_bytes(), &GetOptions { range: Some(mid), ..Default::default() }, size / 4)
                .unwrap();
            assert!(
                matches!(capped, GetAtMost::Got(GetResult::Value(ref v)) if v.data == value[size / 4..size / 2]),
                "capped range: {capped:?}"
            );
            let capped = c
                .get_at_most(key.as_bytes(), &GetOptions { range: Some(mid), ..Default::default() }, size / 4 - 1)
                .unwrap();
            assert_eq!(capped, GetAtMost::TooLong { len: size / 2 - size / 4, generation: g2, size: *size as u64 });
            let suffix = ByteRange { start: -7, end: -1 };
            let GetResult::Value(v) =
                c.get_with(key.as_bytes(), &GetOptions { range: Some(suffix), ..Default::default() }).unwrap()
            else {
                panic!()
            };
            assert_eq!(v.data, value[size - 7..]);
        }
    }
    // Values withheld (too long for the buffer or the cap) keep nothing pinned on the
    // server: its send of them ended.
    let pinned = |c: &mut Client| {
        let stats = c.stats().unwrap();
        stats["servers"][0]["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["pinned_extents"].as_u64().unwrap())
            .sum::<u64>()
    };
    assert!(wait_until(Duration::from_secs(10), || pinned(&mut c) == 0), "{} extents still pinned", pinned(&mut c));
    // Large values from sources at every offset within a cache line (the server stores
    // them alike, a few bytes past their key) and keys of several lengths: whole, ranged,
    // and into a caller's buffer at an odd offset.
    let backing = pattern(7, (300 << 10) + 64);
    for (shift, key) in [(0, "a"), (1, "bb/1"), (15, "ccc/15"), (16, "d/16"), (17, "eeeee/17"), (63, "f/63")] {
        let value = &backing[shift..shift + (300 << 10)];
        let g = c.put(key.as_bytes(), value).unwrap();
        let got = c.get(key.as_bytes()).unwrap().expect("value present");
        assert!(got.data == value, "source offset {shift}");
        let mut buf = vec![0u8; value.len() + 5];
        let r = c.get_into(key.as_bytes(), &GetOptions::default(), &mut buf[5..]).unwrap();
        assert_eq!(r, GetInto::Value { len: value.len(), generation: g, size: value.len() as u64 });
        assert!(buf[5..] == *value, "source offset {shift}, into a buffer at offset 5");
        let tail = ByteRange { start: -100_000, end: -1 };
        let GetResult::Value(v) =
            c.get_with(key.as_bytes(), &GetOptions { range: Some(tail), ..Default::default() }).unwrap()
        else {
            panic!()
        };
        assert!(v.data == value[value.len() - 100_000..], "source offset {shift}, suffix");
    }
    let listed = c.list(&KeyRange::prefix(b"")).unwrap();
    for key in ["a", "bb/1", "ccc/15", "d/16", "eeeee/17", "f/63"] {
        assert!(listed.iter().any(|e| e.key == key.as_bytes() && e.size == 300 << 10), "{key} listed intact");
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

/// A server that is gone: the client fails within a bounded time, never hangs, and says
/// the server is unavailable (not a timeout: its closed bootstrap connection tells it,
/// also on transports that cannot see a peer die).
pub fn server_gone(tls: &str) {
    common::init(tls);
    let mut server = ServerProc::start(&[]);
    let opts = ClientOptions { timeout: Duration::from_secs(3), ..Default::default() };
    let mut c = Client::connect(&server.addr, opts.clone()).unwrap();
    c.put(b"k", b"v").unwrap();
    server.kill();
    let start = Instant::now();
    let err = c.get(b"k").unwrap_err();
    assert_eq!(err.status, Status::Unavailable, "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    // Later calls fail at once, and a new connection is refused with a clear message.
    assert!(c.get(b"k").is_err());
    let err = Client::connect(&server.addr, opts).err().expect("connect to a dead server fails");
    assert_eq!(err.status, Status::Unavailable, "{err}");
}

/// Thousands of random operations from several client threads, each compared exactly
/// against a BTreeMap model of that thread's own key space.
pub fn randomized_model(transport: &str) {
    common::init(transport);
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let addr = server.addr.clone();
            std::thread::spawn(move || model_thread(&addr, t, 1500))
        })
        .collect();
    for t in threads {
        t.join().expect("model thread");
    }
    let stats = server.client().stats().unwrap();
    assert!(stats["keys"].as_u64().unwrap() > 0);
    shared_counters(&server.addr);
}

/// Keys shared by every thread, so conditions conflict: 4 threads increment 8 counters
/// by compare-and-swap (get, then put if-equal the generation read; retry on a failed
/// condition). Linearizable puts lose no increment: the totals match exactly.
fn shared_counters(addr: &str) {
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 150;
    let mut c = common::connect(addr);
    for k in 0..8 {
        c.put(format!("shared/{k}").as_bytes(), &0u64.to_le_bytes()).unwrap();
    }
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let addr = addr.to_string();
            std::thread::spawn(move || {
                let mut c = common::connect(&addr);
                let mut rng = SmallRng::seed_from_u64(t);
                let mut conflicts = 0;
                for _ in 0..PER_THREAD {
                    let key = format!("shared/{}", rng.gen_range(0..8));
                    loop {
                        let v = c.get(key.as_bytes()).unwrap().unwrap();
                        let n = u64::from_le_bytes(v.data[..8].try_into().unwrap());
                        let opts = PutOptions { condition: WriteCondition::IfEqual(v.generation), ttl: None };
                        match c.put_with(key.as_bytes(), &(n + 1).to_le_bytes(), &opts).unwrap() {
                            WriteResult::Written { generation } => {
                                assert!(generation > v.generation);
                                break;
                            }
                            WriteResult::ConditionFailed => conflicts += 1,
                        }
                    }
                }
                conflicts
            })
        })
        .collect();
    let conflicts: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let total: u64 = (0..8)
        .map(|k| {
            u64::from_le_bytes(c.get(format!("shared/{k}").as_bytes()).unwrap().unwrap().data[..8].try_into().unwrap())
        })
        .sum();
    assert_eq!(total, THREADS * PER_THREAD, "increments lost ({conflicts} conflicts retried)");
}

fn model_thread(addr: &str, t: u64, ops: usize) {
    let mut rng = SmallRng::seed_from_u64(0xC0FFEE + t);
    let mut c = common::connect(addr);
    let prefix = format!("m{t}/");
    let mut model: BTreeMap<Vec<u8>, (Vec<u8>, u64)> = BTreeMap::new();
    let key = |rng: &mut SmallRng| format!("{prefix}{:03}", rng.gen_range(0..60)).into_bytes();
    for i in 0..ops {
        let k = key(&mut rng);
        let current = model.get(&k).cloned();
        match rng.gen_range(0..100) {
            0..=24 => {
                let size = if rng.gen_bool(0.05) { rng.gen_range(10_000..200_000) } else { rng.gen_range(0..600) };
                let v = pattern(rng.gen(), size);
                let g = c.put(&k, &v).unwrap();
                if let Some((_, old)) = &current {
                    assert!(g > *old, "generation must grow");
                }
                model.insert(k, (v, g));
            }
            25..=34 => {
                // Conditional put: right generation, wrong generation, or if-absent.
                let (cond, expect_ok) = match (rng.gen_range(0..3), &current) {
                    (0, Some((_, g))) => (WriteCondition::IfEqual(*g), true),
                    (0, None) => (WriteCondition::IfEqual(12345), false),
                    (1, Some((_, g))) => (WriteCondition::IfEqual(g + 1), false),
                    (1, None) => (WriteCondition::IfAbsent, true),
                    (_, cur) => (WriteCondition::IfAbsent, cur.is_none()),
                };
                let v = pattern(rng.gen(), rng.gen_range(0..300));
                match c.put_with(&k, &v, &PutOptions { condition: cond, ttl: None }).unwrap() {
                    WriteResult::Written { generation } => {
                        assert!(expect_ok, "op {i}: {cond:?} should have failed");
                        model.insert(k, (v, generation));
                    }
                    WriteResult::ConditionFailed => assert!(!expect_ok, "op {i}: {cond:?} should have held"),
                }
            }
            35..=54 => {
                let got = c.get(&k).unwrap().map(|v| (v.data, v.generation));
                assert_eq!(got, current, "op {i}: get {}", String::from_utf8_lossy(&k));
            }
            55..=62 => {
                // Conditional get: if_not_equal the current (unchanged) or another generation.
                let probe = match &current {
                    Some((_, g)) if rng.gen_bool(0.5) => *g,
                    _ => 7,
                };
                let r = c.get_with(&k, &GetOptions { if_not_equal: Some(probe), ..Default::default() }).unwrap();
                match (&current, r) {
                    (None, GetResult::Missing) => {}
                    (Some((_, g)), GetResult::Unchanged { generation }) => assert!(*g == probe && generation == *g),
                    (Some((v, g)), GetResult::Value(got)) => assert!(*g != probe && got.data == *v),
                    (cur, r) => panic!("op {i}: conditional get {r:?} with model {cur:?}"),
                }
            }
            63..=72 => {
                let start: i64 = rng.gen_range(-700..700);
                let end: i64 = if rng.gen_bool(0.3) { -1 } else { rng.gen_range(0..700) };
                let r = c.get_with(&k, &GetOptions { range: Some(ByteRange { start, end }), ..Default::default() });
                match (&current, r) {
                    (None, Ok(GetResult::Missing)) => {}
                    (Some((v, _)), r) => {
                        let n = v.len() as i64;
                        let s = if start < 0 { start + n } else { start };
                        let e = if end == -1 { n } else { end };
                        if s < 0 || e > n || s > e {
                            assert_eq!(r.unwrap_err().status, Status::OutOfRange, "op {i}");
                        } else {
                            let Ok(GetResult::Value(got)) = r else { panic!("op {i}: {r:?}") };
                            assert_eq!(got.data, v[s as usize..e as usize]);
                            assert_eq!(got.size, n as u64);
                        }
                    }
                    (cur, r) => panic!("op {i}: range get {r:?} with model {cur:?}"),
                }
            }
            73..=82 => {
                if rng.gen_bool(0.5) {
                    assert_eq!(c.delete(&k).unwrap(), current.is_some(), "op {i}");
                    model.remove(&k);
                } else {
                    let (cond, ok) = match &current {
                        Some((_, g)) if rng.gen_bool(0.5) => (WriteCondition::IfEqual(*g), true),
                        Some((_, g)) => (WriteCondition::IfEqual(g + 1), false),
                        None => (WriteCondition::IfEqual(99), false),
                    };
                    match c.delete_with(&k, cond).unwrap() {
                        DeleteResult::Deleted { existed } => {
                            assert!(ok && existed, "op {i}");
                            model.remove(&k);
                        }
                        DeleteResult::ConditionFailed => assert!(!ok, "op {i}"),
                    }
                }
            }
            83..=86 => {
                let (a, b) = (key(&mut rng), key(&mut rng));
                let (min, max) = if a <= b { (a, b) } else { (b, a) };
                let removed = c.delete_range(&KeyRange { min: min.clone(), max: Some(max.clone()) }).unwrap();
                let doomed: Vec<_> = model.range(min..max).map(|(k, _)| k.clone()).collect();
                assert_eq!(removed, doomed.len() as u64, "op {i}");
                for k in doomed {
                    model.remove(&k);
                }
            }
            _ => {
                let listed = c.list(&KeyRange::prefix(prefix.as_bytes())).unwrap();
                let expected: Vec<_> = model.iter().map(|(k, (v, _))| (k.clone(), v.len() as u64)).collect();
                let got: Vec<_> = listed.into_iter().map(|e| (e.key, e.size)).collect();
                assert_eq!(got, expected, "op {i}: list");
            }
        }
    }
}

/// Store mode: a full arena answers "no space" and loses nothing already stored.
pub fn store_mode_full_arena(transport: &str) {
    common::init(transport);
    let server = ServerProc::start(&["--memory", "4MiB", "--workers", "1"]);
    let mut c = server.client();
    let value = pattern(1, 512 << 10);
    let mut stored = 0;
    let err = loop {
        match c.put(format!("f/{stored}").as_bytes(), &value) {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored < 100, "arena never filled");
    };
    assert_eq!(err.status, Status::NoSpace, "{err}");
    assert!(stored >= 6);
    for i in 0..stored {
        assert_eq!(c.get(format!("f/{i}").as_bytes()).unwrap().unwrap().data, value, "f/{i} intact");
    }
    // Overwriting needs room for the old and the new value at once: the error says so.
    let big = pattern(2, 3 << 20);
    for i in 0..stored {
        c.delete(format!("f/{i}").as_bytes()).unwrap();
    }
    c.put(b"big", &big).unwrap();
    let err = c.put(b"big", &big).unwrap_err();
    assert_eq!(err.status, Status::NoSpace, "{err}");
    assert!(err.message.contains("old and the new"), "{err}");
    assert_eq!(c.get(b"big").unwrap().unwrap().data, big, "the old value stays whole");
    c.delete(b"big").unwrap();
    for i in 0..stored {
        c.put(format!("f/{i}").as_bytes(), &value).unwrap();
    }
    // Too large for the shard at all.
    let err = c.put(b"huge", &vec![0u8; 5 << 20]).unwrap_err();
    assert_eq!(err.status, Status::ValueTooLarge, "{err}");
    // Freeing space makes room again.
    c.delete(b"f/0").unwrap();
    c.put(b"again", &value).unwrap();
}

/// Hand-made requests whose key travels inline in the request header, 1 KiB to 1 MiB long,
/// from a live session and from one already revoked: each is answered by the server (a
/// result or a clear error), or, past what the client's transport carries in a header
/// (UCX: about 8 KiB), refused by the client before anything is sent; the server keeps
/// serving. (The client used to hand UCX such headers, which UCX sent garbled: a
/// 32,000-byte inline key corrupted the receiving server's memory.)
pub fn inline_keys_of_any_length_are_answered(transport: &str) {
    common::init(transport);
    let mut server = ServerProc::start(&["--workers", "1"]);
    let mut c = server.client();
    let live = c.raw_session().0;
    let revoked = server.client().raw_session().0;
    let stats_with = |c: &mut Client, session: u64| {
        let h = RequestHeader::new(Op::Stats, c.raw_session().1, session);
        let mut buf = [0u8; REQUEST_HEADER_LEN];
        h.encode(&mut buf);
        c.raw_request(0, &buf, &[], Duration::from_secs(10)).map(|r| r.0)
    };
    assert!(
        wait_until(Duration::from_secs(5), || stats_with(&mut c, revoked).ok() == Some(Status::AuthFailed)),
        "the departed client's session was not revoked"
    );
    let mut answered = BTreeMap::new();
    for len in [1 << 10, 4 << 10, 8000, 16_000, 32_000, 60_000, 64 << 10, (64 << 10) + 1, 1 << 20] {
        for (session, what) in [(live, "live"), (revoked, "revoked")] {
            let mut h = RequestHeader::new(Op::Put, c.raw_session().1, session);
            h.key_len = len as u32;
            let mut fixed = [0u8; REQUEST_HEADER_LEN];
            h.encode(&mut fixed);
            let mut frame = fixed.to_vec();
            frame.resize(REQUEST_HEADER_LEN + len, b'k');
            match c.raw_request(0, &frame, b"value", Duration::from_secs(20)) {
                Ok((status, message)) if session == revoked => {
                    // A key longer than any key is refused as the header is read, before
                    // the session is looked at.
                    let refused = if len > MAX_KEY_LEN { Status::KeyTooLarge } else { Status::AuthFailed };
                    assert_eq!(status, refused, "inline key of {len} B: {message}");
                    *answered.entry(len).or_insert(0) += 1;
                }
                Ok((status, message)) => {
                    assert!(
                        matches!(status, Status::Ok | Status::KeyTooLarge | Status::Invalid),
                        "inline key of {len} B: {status:?} {message}"
                    );
                    assert!(status == Status::Ok || !message.is_empty(), "an error says why");
                    *answered.entry(len).or_insert(0) += 1;
                }
                Err(e) => assert!(
                    e.status == Status::Invalid && e.message.contains("longer than"),
                    "{what} session, inline key of {len} B: neither answered nor refused here: {e}"
                ),
            }
            assert!(server.child.try_wait().unwrap().is_none(), "the server died on an inline key of {len} B");
        }
    }
    assert!(answered.get(&(4 << 10)) == Some(&2), "keys of 1 and 4 KiB reach the server: {answered:?}");
    c.put(b"after", b"still serving").unwrap();
    assert_eq!(c.get(b"after").unwrap().unwrap().data, b"still serving");
    assert!(server.stop().is_some_and(|s| s.success()), "the server exits 0");
}

/// A value staged in parts (as device memory is sent) outlives the worker's sweeps, which
/// free what lapsed or lost its client: parts 300 ms apart, across several sweeps, commit.
/// (Over libfabric, requests carry a per-slot credential as their session; every sweep
/// once took it for a session that had ended, and a GPU's 64 MiB puts failed with
/// "no value is staged in parts".)
pub fn values_in_parts_outlast_sweeps(transport: &str) {
    common::init(transport);
    let server = ServerProc::start(&["--memory", "64MiB"]);
    let mut c = server.client();
    let key = b"in-parts";
    let shard = remote_dram::proto::shard_of(key, 2); // ServerProc's two workers
    let value = pattern(5, 3000);
    let mut stage = 0;
    for start in (0..=3000).step_by(1000) {
        let (session, id) = c.raw_session();
        let mut h = RequestHeader::new(Op::Put, id, session);
        h.flags = flags::STAGE | flags::HAS_RANGE;
        h.key_len = key.len() as u32;
        (h.range_start, h.range_end, h.if_not_equal) = (start as i64, 3000, stage);
        let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
        h.encode((&mut buf[..]).try_into().unwrap());
        buf.extend_from_slice(key);
        let part = &value[start..(start + 1000).min(3000)];
        let (status, msg) = c.raw_request(shard, &buf, part, Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::Ok, "the part at {start}: {msg}");
        if start == 0 {
            stage = id;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(c.get(key).unwrap().expect("committed").data, value);
}

/// Values of a header and a body staged side by side (`put_parts_many`) on a server whose
/// staging room holds three of them per shard at once: those it has no room for wait for
/// the others (the server refuses them `NoRoom`, counted in its metrics) instead of being
/// copied and put whole; every value reads back, and nothing stays staged.
pub fn values_in_parts_side_by_side(transport: &str) {
    common::init(transport);
    // 32 MiB shards stage 8 MiB, 4 MiB for one session.
    let server = ServerProc::start(&["--memory", "64MiB", "--metrics", "127.0.0.1:0"]);
    let mut c = server.client();
    let headers: Vec<Vec<u8>> = (0..12).map(|i| format!("header {i:02}").into_bytes()).collect();
    let bodies: Vec<Vec<u8>> = (0..12u64).map(|i| pattern(40 + i, 1_200_000)).collect();
    let keys: Vec<String> = (0..12).map(|i| format!("side-by-side/{i}")).collect();
    let parts: Vec<[&[u8]; 2]> = headers.iter().zip(&bodies).map(|(h, b)| [&h[..], &b[..]]).collect();
    let items: Vec<(&[u8], &[&[u8]])> = keys.iter().zip(&parts).map(|(k, p)| (k.as_bytes(), &p[..])).collect();
    for (i, r) in c.put_parts_many(&items, &Default::default(), 16).into_iter().enumerate() {
        assert!(matches!(r, Ok(WriteResult::Written { .. })), "value {i}: {r:?}");
    }
    for i in 0..12 {
        let got = c.get(keys[i].as_bytes()).unwrap().expect("stored").data;
        assert_eq!(got, [&headers[i][..], &bodies[i][..]].concat(), "value {i}");
    }
    let stats = c.stats().unwrap();
    let shards = stats["servers"][0]["shards"].as_array().unwrap();
    assert_eq!(shards.iter().map(|s| s["staged_values"].as_u64().unwrap()).sum::<u64>(), 0);
    let text = server.scrape();
    let puts = |status: &str| -> u64 {
        let status = format!("status=\"{status}\"");
        text.lines()
            .filter(|l| l.starts_with("rdram_requests_total") && l.contains("op=\"put\"") && l.contains(&status))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert!(puts("no_room") > 0, "the server never ran out of staging room: the test proves nothing");
    // Each value staged: its header, its body and the commit; none sent whole.
    assert_eq!(puts("ok"), 3 * 12, "values put whole instead of waiting for room");
}

pub fn auth_token_required(transport: &str) {
    common::init(transport);
    let dir = std::env::temp_dir().join(format!("rdram-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let server = ServerProc::start(&["--auth-token-file", token_file.to_str().unwrap()]);
    let with = |token: Option<&str>| {
        Client::connect(&server.addr, ClientOptions { auth_token: token.map(String::from), ..common::options() })
    };
    let err = with(None).err().expect("no token is refused");
    assert_eq!(err.status, Status::AuthFailed);
    assert!(err.message.contains("requires an auth token"), "{err}");
    let err = with(Some("guess")).err().expect("wrong token is refused");
    assert_eq!(err.status, Status::AuthFailed);
    assert!(err.message.contains("wrong auth token"), "{err}");
    let mut c = with(Some("s3cret")).unwrap();
    c.put(b"a", b"b").unwrap();
    // The command line takes the token from the environment.
    let (code, _, stderr) = rdram(&["get", "--server", &server.addr, "a"], None);
    assert_eq!(code, 1);
    assert!(stderr.contains("authentication failed"), "{stderr}");
    let out = std::process::Command::new(common::RDRAM)
        .args(["get", "--server", &server.addr, "a"])
        .env("RDRAM_AUTH_TOKEN", "s3cret")
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"b");
    std::fs::remove_dir_all(&dir).ok();
}

/// Several rails per worker (as on a multi-NIC host; here they share one domain): large
/// values are striped both ways, small ones use one rail, and every byte arrives intact,
/// also into a caller's buffer and for byte ranges crossing stripe boundaries.
pub fn striped_over_rails(transport: &str, rails: usize) {
    common::init(transport);
    let server = ServerProc::start(&["--memory", "512MiB", "--domains", &rails.to_string()]);
    let mut c = server.client();
    for (i, size) in [1usize, 300 << 10, (1 << 20) + 12_345, 64 << 20].into_iter().enumerate() {
        let key = format!("striped/{size}");
        let value = pattern(500 + i as u64, size);
        c.put(key.as_bytes(), &value).unwrap();
        assert!(c.get(key.as_bytes()).unwrap().unwrap().data == value, "{size} B over {rails} rails");
        let mut buf = vec![0u8; size];
        let r = c.get_into(key.as_bytes(), &GetOptions::default(), &mut buf).unwrap();
        assert!(matches!(r, GetInto::Value { len, .. } if len == size));
        assert!(buf == value, "{size} B into a caller's buffer");
        if size > 1 {
            let range = ByteRange { start: 7, end: size as i64 - 3 };
            let GetResult::Value(v) =
                c.get_with(key.as_bytes(), &GetOptions { range: Some(range), ..Default::default() }).unwrap()
            else {
                panic!()
            };
            assert!(v.data == value[7..size - 3], "range of {size} B");
        }
    }
    // A second process reads what the first wrote.
    let (code, out, err) = rdram(&["get", "--server", &server.addr, &format!("striped/{}", 64 << 20)], None);
    assert_eq!(code, 0, "{err}");
    assert!(out == pattern(503, 64 << 20));
}

/// libfabric workers know their clients by slot: a client that exits and one that is
/// killed both close their bootstrap connection, which frees the slot.
pub fn departed_clients_free_their_slots(transport: &str) {
    common::init(transport);
    let server = ServerProc::start(&["--workers", "1", "--memory", "256MiB"]);
    let mut observer = server.client();
    let clients =
        |c: &mut Client| c.stats().unwrap()["servers"][0]["shards"][0]["clients"].as_u64().expect("clients in stats");
    assert_eq!(clients(&mut observer), 1, "the observer itself");
    let (code, _, err) = rdram(&["put", "--server", &server.addr, "k", "v"], None);
    assert_eq!(code, 0, "{err}");
    assert!(wait_until(Duration::from_secs(5), || clients(&mut observer) == 1), "a client that exited keeps its slot");
    // A client killed while connected: the bench, running for a minute.
    let out = tempfile::Builder::new().prefix("rdram-departed-").tempdir().unwrap();
    let mut bench = std::process::Command::new(common::bench_binary("rdram-bench"))
        .args([
            "--server",
            &server.addr,
            "--poll",
            "adaptive",
            "--ops",
            "get",
            "--sizes",
            "8",
            "--seconds",
            "60",
            "--warmup",
            "0",
        ])
        .arg("--out")
        .arg(out.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || clients(&mut observer) == 2), "the bench connected");
    bench.kill().unwrap();
    bench.wait().unwrap();
    assert!(wait_until(Duration::from_secs(5), || clients(&mut observer) == 1), "a killed client keeps its slot");
}

/// The bench binary against a server on this transport: it runs and reports every size.
pub fn bench_against_server(transport: &str) {
    common::init(transport);
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let plots = tempfile::Builder::new().prefix("rdram-bench-").tempdir().unwrap();
    let out = std::process::Command::new(common::bench_binary("rdram-bench"))
        .args([
            "--server",
            &server.addr,
            "--poll",
            "adaptive",
            "--json",
            "--ops",
            "get,put",
            "--sizes",
            "8,1MiB",
            "--depth",
            "4",
            "--seconds",
            "0.3",
            "--warmup",
            "0.05",
        ])
        .arg("--out")
        .arg(plots.path())
        .output()
        .expect("run rdram-bench");
    assert!(out.status.success(), "rdram-bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<String> = rows.iter().map(|r| format!("{}-{}", r["op"].as_str().unwrap(), r["size"])).collect();
    assert_eq!(names, ["get-8", "get-1048576", "put-8", "put-1048576"]);
    assert!(rows.iter().all(|r| r["ops_per_s"].as_f64().unwrap() > 0.0), "{rows:?}");
}

/// Issue 12.1: once a call returns, whatever it returned, nothing touches the caller's
/// buffer. A put of 256 MiB that times out after 1 ms: the caller then overwrites its
/// buffer with 0xEE, and the key afterwards holds either nothing or exactly the bytes the
/// buffer held during the call. A get into a caller's buffer that times out: the buffer,
/// overwritten after the return, is never written again. The handle keeps working.
///
/// Each round needs a call that gives up before its transfer ends. On a loaded machine the
/// transfer can still win (the client thread is descheduled between posting and its first
/// clock read, and the server copies meanwhile); such a call must have stored or fetched
/// exactly the caller's bytes, and the round tries again, `TRIES` times at most.
pub fn timed_out_calls_leave_caller_memory_alone(transport: &str) {
    common::init(transport);
    const LEN: usize = 256 << 20;
    const TRIES: usize = 5;
    let server = ServerProc::start(&["--workers", "1", "--memory", "1GiB"]);
    let hasty = ClientOptions { timeout: Duration::from_millis(1), ..common::options() };
    let mut checker =
        Client::connect(&server.addr, ClientOptions { timeout: Duration::from_secs(5), ..common::options() }).unwrap();
    let original = pattern(12, LEN);
    for round in 0..3 {
        let mut c = Client::connect(&server.addr, hasty.clone()).unwrap();
        let put_gave_up = gives_up_within(TRIES, &format!("round {round}, put"), |attempt| {
            let key = format!("abandoned/{round}/{attempt}");
            let mut buf = original.clone();
            let outcome = c.put(key.as_bytes(), &buf);
            buf.fill(0xEE);
            if round == 0 {
                // A client that closes right after its put timed out (UCX 1.13.1 aborted the
                // server when the endpoint closed with the rendezvous still in flight).
                c = Client::connect(&server.addr, hasty.clone()).unwrap();
            }
            // Give a server that would still pull from `buf` the time to do it.
            std::thread::sleep(Duration::from_millis(1500));
            match checker.get(key.as_bytes()).unwrap() {
                None => assert!(outcome.is_err(), "an acknowledged put is missing"),
                Some(v) => {
                    assert!(
                        v.data == original,
                        "round {round}: the stored value has bytes written after the call returned"
                    )
                }
            }
            checker.delete(key.as_bytes()).unwrap();
            outcome.err().map(|e| e.status)
        });
        assert!(put_gave_up, "round {round}: every one of {TRIES} puts of 256 MiB ended within 1 ms");
        // Gets: a reply still arriving must not land in the caller's buffer afterwards.
        checker.put(b"big", &original).unwrap();
        let get_gave_up = gives_up_within(TRIES, &format!("round {round}, get"), |_| {
            let mut out = vec![0u8; LEN];
            let got = c.get_into(b"big", &GetOptions::default(), &mut out);
            if got.is_ok() {
                assert!(out == original, "round {round}: a get that succeeded returned other bytes");
            }
            out.fill(0x11);
            std::thread::sleep(Duration::from_millis(500));
            assert!(
                out.iter().all(|&b| b == 0x11),
                "round {round}: the buffer was written after get_into returned ({got:?})"
            );
            got.err().map(|e| e.status)
        });
        assert!(get_gave_up, "round {round}: every one of {TRIES} gets of 256 MiB ended within 1 ms");
        checker.delete(b"big").unwrap();
    }
    // The server kept serving, and held nothing back for the abandoned transfers.
    let stats = checker.stats().unwrap();
    let used: u64 =
        stats["servers"][0]["shards"].as_array().unwrap().iter().map(|s| s["used_bytes"].as_u64().unwrap_or(0)).sum();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let stats = checker.stats().unwrap();
            stats["servers"][0]["shards"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["used_bytes"].as_u64().unwrap_or(0))
                .sum::<u64>()
                == 0
        }),
        "extents still held after every key was deleted (used {used}): {stats}"
    );
}

/// Runs `attempt` (given its number) until it fails with a timeout, `tries` times at
/// most; an attempt that succeeded (None) is tried again, and any other error fails the
/// test. Whether one timed out.
fn gives_up_within(tries: usize, what: &str, mut attempt: impl FnMut(usize) -> Option<Status>) -> bool {
    for i in 0..tries {
        match attempt(i) {
            Some(Status::Timeout) => return true,
            None => eprintln!("{what} {i}: the transfer ended before the timeout; trying again"),
            Some(other) => panic!("{what} {i}: failed with {other:?}, not a timeout"),
        }
    }
    false
}

/// Issue 12.7: a handle survives a stalled server (SIGSTOP: its calls time out; after
/// SIGCONT the same handle works) and a restarted one (SIGKILL: calls fail with
/// Unavailable, never a timeout; once a new server listens on the same port, the handle
/// reconnects by itself).
pub fn clients_recover(transport: &str) {
    common::init(transport);
    let mut server = ServerProc::start(&["--workers", "1"]);
    let port = server.addr.rsplit(':').next().unwrap().to_string();
    let quick = ClientOptions { timeout: Duration::from_millis(500), ..common::options() };
    let mut c = Client::connect(&server.addr, quick).unwrap();
    c.put(b"k", b"v1").unwrap();

    common::stop_process(server.child.id());
    let stalled = c.get(b"k").unwrap_err();
    assert_eq!(stalled.status, Status::Timeout, "{stalled}");
    common::signal(server.child.id(), common::SIGCONT);
    assert!(
        wait_until(Duration::from_secs(10), || matches!(c.get(b"k"), Ok(Some(v)) if v.data == b"v1")),
        "the handle did not recover after the server resumed"
    );

    server.kill();
    let started = Instant::now();
    for _ in 0..3 {
        let e = c.get(b"k").unwrap_err();
        assert_eq!(e.status, Status::Unavailable, "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "a dead server took {:?} to report", started.elapsed());
    let listen = format!("127.0.0.1:{port}");
    let _restarted = ServerProc::start(&["--workers", "1", "--listen", &listen]);
    assert!(
        wait_until(Duration::from_secs(10), || c.put(b"k", b"v2").is_ok()),
        "the handle did not reconnect to the restarted server"
    );
    assert_eq!(c.get(b"k").unwrap().unwrap().data, b"v2");
}

#[macro_export]
macro_rules! transport_suite {
    ($tls:expr) => {
        #[test]
        fn clients_recover() {
            suite::clients_recover($tls)
        }
        #[test]
        fn timed_out_calls_leave_caller_memory_alone() {
            suite::timed_out_calls_leave_caller_memory_alone($tls)
        }
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
        #[test]
        fn randomized_model() {
            suite::randomized_model($tls)
        }
        #[test]
        fn store_mode_full_arena() {
            suite::store_mode_full_arena($tls)
        }
        #[test]
        fn auth_token_required() {
            suite::auth_token_required($tls)
        }
        #[test]
        fn values_in_parts_outlast_sweeps() {
            suite::values_in_parts_outlast_sweeps($tls)
        }
        #[test]
        fn values_in_parts_side_by_side() {
            suite::values_in_parts_side_by_side($tls)
        }
    };
}

/// The transport suite plus what libfabric adds: slots of departed clients, and striping
/// over 3 rails.
#[macro_export]
macro_rules! fabric_suite {
    ($t:expr) => {
        transport_suite!($t);
        #[test]
        fn departed_clients_free_their_slots() {
            suite::departed_clients_free_their_slots($t)
        }
        #[test]
        fn striped_over_three_rails() {
            suite::striped_over_rails($t, 3)
        }
    };
}
