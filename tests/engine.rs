//! Engine behaviour against real server processes over UCX tcp on loopback: the model test,
//! clusters, limits and every error path.
mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{pattern, wait_until, ServerProc, TCP};
use remote_dram::client::{KeyRange, PutOptions};
use remote_dram::proto::{self, flags, Op, RequestHeader, REQUEST_HEADER_LEN};
use remote_dram::{Client, Status};

fn setup() {
    common::init(TCP);
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
    // A listing paged alternately by the two clients (as the gateway pages with whichever
    // of its clients is free) lists every key once, whatever order each was given.
    let range = KeyRange::prefix(b"c/");
    let (mut listed, mut cursor, mut pages) = (Vec::new(), None, 0);
    loop {
        let by = if pages % 2 == 0 { &mut c } else { &mut other };
        let (page, next) = by.list_page(&range, cursor.as_ref()).unwrap();
        listed.extend(page.into_iter().map(|e| e.key));
        pages += 1;
        match next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    assert!(pages >= 2, "one page per server's shard at least: {pages}");
    listed.sort();
    let mut want: Vec<Vec<u8>> = (0..200u64).map(|i| format!("c/{i}").into_bytes()).collect();
    want.sort();
    assert_eq!(listed, want, "every key listed once");
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
    // No fixed sleeps: present while young (checked only if the get came in time),
    // gone once expired, and never back.
    let ttl = Duration::from_millis(1500);
    let put_at = std::time::Instant::now();
    c.put_with(b"t/short", b"x", &PutOptions { ttl: Some(ttl), ..Default::default() }).unwrap();
    c.put_with(b"t/long", b"y", &PutOptions { ttl: Some(Duration::from_secs(3600)), ..Default::default() }).unwrap();
    c.put(b"t/none", b"z").unwrap();
    let young = c.get(b"t/short").unwrap().is_some();
    assert!(young || put_at.elapsed() >= ttl, "a value vanished before its TTL");
    assert!(wait_until(Duration::from_secs(10), || c.get(b"t/short").unwrap().is_none()), "never expired");
    assert!(put_at.elapsed() >= ttl - Duration::from_millis(5), "expired early");
    assert!(c.get(b"t/short").unwrap().is_none(), "an expired value came back");
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
    // Longest keys across list pages (a reply carries at most 1 MiB of keys): a page that
    // ends on one goes on at the least key after it, which is no longer than it.
    let longest: Vec<Vec<u8>> =
        (0..40u8).map(|i| [&[b'p', i][..], &vec![b'x'; proto::MAX_KEY_LEN - 2]].concat()).collect();
    for k in &longest {
        c.put(k, b"").unwrap();
    }
    let listed: Vec<Vec<u8>> = c.list(&KeyRange::prefix(b"p")).unwrap().into_iter().map(|e| e.key).collect();
    assert!(listed == longest, "listed {} of the {} longest keys", listed.len(), longest.len());
    let too_long = vec![b'k'; proto::MAX_KEY_LEN + 1];
    assert_eq!(c.put(&too_long, b"v").unwrap_err().status, Status::KeyTooLarge);
    assert_eq!(c.get(&too_long).unwrap_err().status, Status::KeyTooLarge);
    assert_eq!(c.put(b"", b"v").unwrap_err().status, Status::Invalid);
    // Values above 1 GiB are refused before anything is sent (calloc'd: never touched).
    let too_big = vec![0u8; proto::MAX_VALUE_LEN as usize + 1];
    assert_eq!(c.put(b"big", &too_big).unwrap_err().status, Status::ValueTooLarge);
    drop(too_big);
    // A value larger than the server's shard: refused by the server, which lives on.
    let err = c.put(b"big", &vec![1u8; 40 << 20]).unwrap_err();
    assert_eq!(err.status, Status::ValueTooLarge, "{err}");
    assert!(c.get(b"big").unwrap().is_none());
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
    h.version = proto::PROTOCOL_VERSION + 1;
    let (status, msg) = send(&mut c, h, b"keep", &[]);
    assert_eq!(status, Status::VersionMismatch);
    assert!(
        msg.contains(&format!(
            "server speaks v{}, request is v{}",
            proto::PROTOCOL_VERSION,
            proto::PROTOCOL_VERSION + 1
        )),
        "{msg}"
    );
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
    // The short form (what UCX clients send) is read and checked like the full one.
    let shard = proto::shard_of(b"keep", 2); // ServerProc's two workers
    let send_short = |c: &mut Client, h: RequestHeader, tail: &[u8]| {
        let mut buf = [0u8; REQUEST_HEADER_LEN];
        let len = h.encode_short(&mut buf);
        assert_eq!(len, proto::SHORT_REQUEST_HEADER_LEN);
        let mut msg = buf[..len].to_vec();
        msg.extend_from_slice(tail);
        c.raw_request(shard, &msg, &[], Duration::from_secs(10)).unwrap()
    };
    let h = header(&c, Op::Get, 4);
    assert_eq!(send_short(&mut c, h, b"keep").0, Status::Ok);
    let h = header(&c, Op::Get, 5);
    assert_eq!(send_short(&mut c, h, b"keep").0, Status::Invalid);
    let mut h = header(&c, Op::Get, 4);
    h.session ^= 1;
    assert_eq!(send_short(&mut c, h, b"keep").0, Status::AuthFailed);
    // Garbage whose bytes 8..16 name a request is answered, so its sender does not wait
    // out a timeout; the server lives on.
    let junk = pattern(5, 40);
    let id = c.raw_session().1;
    let mut junk_header = junk.clone();
    junk_header[8..16].copy_from_slice(&id.to_le_bytes());
    let (status, message) = c.raw_request(0, &junk_header, &[], Duration::from_secs(10)).unwrap();
    assert_eq!(status, Status::Invalid, "{message}");
    let mut fresh = server.client();
    assert_eq!(fresh.get(b"keep").unwrap().unwrap().data, b"safe");
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
    assert!(
        line.contains(&format!("protocol version mismatch: server speaks v{}, client v99", proto::PROTOCOL_VERSION)),
        "{line}"
    );
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
        common::skipped(
            "hugepages_off_and_on (its part with huge pages)",
            "cannot reserve 2 MiB pages here (not root?); checking only that --hugepages on fails clearly",
        );
        let out = std::process::Command::new(common::RDRAM)
            .args(["serve", "--listen", "127.0.0.1:0", "--memory", "1TiB", "--workers", "1", "--hugepages", "on"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("nr_hugepages"));
    }
}
