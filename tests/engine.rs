//! Engine behaviour against real server processes over UCX tcp on loopback: the model test,
//! clusters, limits and every error path.
mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{pattern, rdram, wait_until, ServerProc, TCP};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use remote_dram::client::{ByteRange, DeleteResult, GetOptions, GetResult, KeyRange, PutOptions, WriteCondition, WriteResult};
use remote_dram::proto::{self, flags, Op, RequestHeader, REQUEST_HEADER_LEN};
use remote_dram::{Client, ClientOptions, Status};

fn setup() {
    common::init(TCP);
}

/// Thousands of random operations from several client threads, each compared exactly
/// against a BTreeMap model of that thread's own key space.
#[test]
fn randomized_model() {
    setup();
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

/// Two server processes as one cluster: keys spread across both, all readable.
#[test]
fn two_server_cluster() {
    setup();
    let (a, b) = (ServerProc::start(&[]), ServerProc::start(&[]));
    let both = format!("{},{}", a.addr, b.addr);
    let mut c = common::connect(&both);
    for i in 0..200u64 {
        c.put(format!("c/{i}").as_bytes(), &pattern(i, 100)).unwrap();
    }
    let per_server: Vec<u64> = [&a, &b].iter().map(|s| s.client().stats().unwrap()["keys"].as_u64().unwrap()).collect();
    assert_eq!(per_server.iter().sum::<u64>(), 200);
    assert!(per_server.iter().all(|&n| n > 40), "keys spread over both servers: {per_server:?}");
    // A client listing the servers in the other order routes identically.
    let mut other = common::connect(&format!("{},{}", b.addr, a.addr));
    for i in 0..200u64 {
        assert_eq!(other.get(format!("c/{i}").as_bytes()).unwrap().unwrap().data, pattern(i, 100));
    }
    assert_eq!(other.list(&KeyRange::prefix(b"c/")).unwrap().len(), 200);
}

/// Store mode: a full arena answers "no space" and loses nothing already stored.
#[test]
fn store_mode_full_arena() {
    setup();
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
    // Too large for the shard at all.
    let err = c.put(b"huge", &vec![0u8; 5 << 20]).unwrap_err();
    assert_eq!(err.status, Status::ValueTooLarge, "{err}");
    // Freeing space makes room again.
    c.delete(b"f/0").unwrap();
    c.put(b"again", &value).unwrap();
}

/// Cache mode: a full arena evicts the least recently used values.
#[test]
fn cache_mode_evicts_lru() {
    setup();
    let server = ServerProc::start(&["--memory", "4MiB", "--workers", "1", "--mode", "cache"]);
    let mut c = server.client();
    let value = pattern(2, 256 << 10);
    for i in 0..12 {
        c.put(format!("e/{i}").as_bytes(), &value).unwrap();
    }
    // Keep e/0 hot while filling far past capacity.
    for i in 12..40 {
        assert!(c.get(b"e/0").unwrap().is_some(), "hot key evicted at {i}");
        c.put(format!("e/{i}").as_bytes(), &value).unwrap();
    }
    assert!(c.get(b"e/1").unwrap().is_none(), "cold key survived");
    assert_eq!(c.get(b"e/39").unwrap().unwrap().data, value);
    let stats = c.stats().unwrap();
    assert!(stats["servers"][0]["shards"][0]["evictions"].as_u64().unwrap() >= 20);
}

#[test]
fn ttl_expiry() {
    setup();
    let server = ServerProc::start(&[]);
    let mut c = server.client();
    c.put_with(b"t/short", b"x", &PutOptions { ttl: Some(Duration::from_millis(200)), ..Default::default() }).unwrap();
    c.put_with(b"t/long", b"y", &PutOptions { ttl: Some(Duration::from_secs(3600)), ..Default::default() }).unwrap();
    c.put(b"t/none", b"z").unwrap();
    assert!(c.get(b"t/short").unwrap().is_some());
    std::thread::sleep(Duration::from_millis(400));
    assert!(c.get(b"t/short").unwrap().is_none());
    assert!(c.get(b"t/long").unwrap().is_some());
    assert_eq!(c.list(&KeyRange::prefix(b"t/")).unwrap().len(), 2);
    // The background sweep removes expired keys nobody reads.
    c.put_with(b"t/swept", b"x", &PutOptions { ttl: Some(Duration::from_millis(50)), ..Default::default() }).unwrap();
    assert!(wait_until(Duration::from_secs(5), || c.stats().unwrap()["keys"] == 2));
}

#[test]
fn oversize_and_boundary_inputs() {
    setup();
    let server = ServerProc::start(&[]);
    let mut c = server.client();
    let max_key = vec![b'k'; proto::MAX_KEY_LEN];
    let g = c.put(&max_key, b"long key").unwrap();
    assert_eq!(c.get(&max_key).unwrap().unwrap().generation, g);
    assert_eq!(c.list(&KeyRange::prefix(b"kkkk")).unwrap()[0].key.len(), proto::MAX_KEY_LEN);
    assert!(c.delete(&max_key).unwrap());
    let too_long = vec![b'k'; proto::MAX_KEY_LEN + 1];
    assert_eq!(c.put(&too_long, b"v").unwrap_err().status, Status::KeyTooLarge);
    assert_eq!(c.get(&too_long).unwrap_err().status, Status::KeyTooLarge);
    assert_eq!(c.put(b"", b"v").unwrap_err().status, Status::Invalid);
    // Binary keys and an empty value.
    c.put(&[0, 255, 0], b"").unwrap();
    let v = c.get(&[0, 255, 0]).unwrap().unwrap();
    assert!(v.data.is_empty() && v.size == 0);
    // The server enforces the limits too, whatever the client checked.
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(Op::Get, id, session);
    h.key_len = (proto::MAX_KEY_LEN + 1) as u32;
    h.flags = flags::KEY_IN_PAYLOAD;
    let mut buf = [0u8; REQUEST_HEADER_LEN];
    h.encode(&mut buf);
    let (status, msg) = c.raw_request(0, &buf, &too_long, Duration::from_secs(10)).unwrap();
    assert_eq!(status, Status::KeyTooLarge, "{msg}");
}

/// Malformed active messages get an error reply (or are dropped when unanswerable) and
/// never disturb the shard.
#[test]
fn garbage_requests_are_refused_and_server_keeps_serving() {
    setup();
    let server = ServerProc::start(&[]);
    let mut c = server.client();
    c.put(b"keep", b"safe").unwrap();
    let (session, _) = c.raw_session();
    let header = |c: &Client, op: Op, key_len: u32| {
        let mut h = RequestHeader::new(op, c.raw_session().1, session);
        h.key_len = key_len;
        h
    };
    let send = |c: &mut Client, h: RequestHeader, tail: &[u8], payload: &[u8]| {
        let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
        h.encode((&mut buf[..]).try_into().unwrap());
        buf.extend_from_slice(tail);
        c.raw_request(0, &buf, payload, Duration::from_secs(10)).unwrap()
    };
    // Wrong protocol version: a clear message.
    let mut h = header(&c, Op::Get, 4);
    h.version = 9;
    let (status, msg) = send(&mut c, h, b"keep", &[]);
    assert_eq!(status, Status::VersionMismatch);
    assert!(msg.contains("server speaks v1, request is v9"), "{msg}");
    // Unknown op, unknown flags, key length not matching the bytes sent, bad session.
    let mut h = header(&c, Op::Get, 4);
    h.op = 77;
    assert_eq!(send(&mut c, h, b"keep", &[]).0, Status::Invalid);
    let mut h = header(&c, Op::Get, 4);
    h.flags = 1 << 30;
    assert_eq!(send(&mut c, h, b"keep", &[]).0, Status::Invalid);
    let h = header(&c, Op::Get, 9);
    assert_eq!(send(&mut c, h, b"keep", &[]).0, Status::Invalid);
    let mut h = header(&c, Op::Get, 4);
    h.session ^= 1;
    assert_eq!(send(&mut c, h, b"keep", &[]).0, Status::AuthFailed);
    let h = header(&c, Op::List, 3);
    assert_eq!(send(&mut c, h, &[], b"ab").0, Status::Invalid, "range bounds shorter than declared");
    // Pure garbage has no request id to answer: nothing comes back, and the server lives on.
    let junk = pattern(5, 40);
    let id = c.raw_session().1;
    let mut junk_header = junk.clone();
    junk_header[8..16].copy_from_slice(&id.to_le_bytes());
    let err = c.raw_request(0, &junk_header, &[], Duration::from_millis(500)).unwrap_err();
    assert_eq!(err.status, Status::Timeout);
    let mut fresh = server.client();
    assert_eq!(fresh.get(b"keep").unwrap().unwrap().data, b"safe");
}

#[test]
fn auth_token_required() {
    setup();
    let dir = std::env::temp_dir().join(format!("rdram-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let server = ServerProc::start(&["--auth-token-file", token_file.to_str().unwrap()]);
    let with = |token: Option<&str>| Client::connect(&server.addr, ClientOptions { auth_token: token.map(String::from), ..common::options() });
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
    let out = std::process::Command::new(common::RDRAM).args(["get", "--server", &server.addr, "a"]).env("RDRAM_AUTH_TOKEN", "s3cret").output().unwrap();
    assert_eq!(out.stdout, b"b");
    std::fs::remove_dir_all(&dir).ok();
}

/// A peer speaking another protocol version is refused at the handshake with a message.
#[test]
fn bootstrap_version_mismatch() {
    setup();
    let server = ServerProc::start(&[]);
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"{\"magic\":\"remote_dram\",\"version\":99}\n").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.contains("protocol version mismatch: server speaks v1, client v99"), "{line}");
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    assert!(line.contains("does not speak the remote_dram bootstrap protocol"), "{line}");
    // And the server still serves.
    server.client().put(b"k", b"v").unwrap();
}

#[test]
fn hugepages_off_and_on() {
    setup();
    let off = ServerProc::start(&["--workers", "1", "--hugepages", "off"]);
    assert_eq!(off.client().stats().unwrap()["servers"][0]["shards"][0]["backing"], "pages_4k");
    drop(off);
    // Reserve 2 MiB pages when we can (root); otherwise check that `on` fails clearly.
    let path = "/proc/sys/vm/nr_hugepages";
    let before: u64 = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    let reserved = std::fs::write(path, format!("{}", before + 40)).is_ok()
        && std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0) >= before + 32;
    if reserved {
        let on = ServerProc::start(&["--workers", "2", "--memory", "64MiB", "--hugepages", "on"]);
        let mut c = on.client();
        let stats = c.stats().unwrap();
        for shard in stats["servers"][0]["shards"].as_array().unwrap() {
            assert_eq!(shard["backing"], "hugetlb_2m");
        }
        c.put(b"h", &pattern(3, 3 << 20)).unwrap();
        assert_eq!(c.get(b"h").unwrap().unwrap().data, pattern(3, 3 << 20));
        drop(on);
        std::fs::write(path, format!("{before}")).ok();
    } else {
        let out = std::process::Command::new(common::RDRAM)
            .args(["serve", "--listen", "127.0.0.1:0", "--memory", "1TiB", "--workers", "1", "--hugepages", "on"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("nr_hugepages"));
    }
}
