//! The attacker's view: real `rdram serve` processes on loopback, probed by a client that
//! has no token, guesses memory keys, forges hellos, replays another client's session,
//! trickles its handshake, or floods the bootstrap port. Everything must fail cleanly
//! while the server keeps serving its real clients.
mod common;

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{pattern, rdram, ServerProc};
use remote_dram::client::KeyRange;
use remote_dram::proto::bootstrap::{client_handshake, hex_decode, Welcome};
use remote_dram::proto::fabric::{self as wire, decode_addresses};
use remote_dram::proto::{flags, Op, ReplyHeader, RequestHeader, AM_REPLY, AM_REQUEST, REQUEST_HEADER_LEN};
use remote_dram::transport::fabric::{Completion, Endpoint, OpContext, RemoteAccess};
use remote_dram::transport::ucx::{ptr_status, sys as ucx_sys, Tcp, Worker};
use remote_dram::{Client, ClientOptions, Status};

const FABRIC_TCP: [&str; 4] = ["--transport", "fabric", "--provider", "tcp;ofi_rxm"];

/// A token file, owner-only (as the server requires), removed when dropped.
fn token_file(token: &str) -> tempfile::TempPath {
    // tempfile creates it 0600.
    let file = tempfile::Builder::new().prefix("rdram-token-").tempfile().unwrap();
    std::fs::write(file.path(), format!("{token}\n")).unwrap();
    file.into_temp_path()
}

fn with_token(token: &str) -> ClientOptions {
    ClientOptions { auth_token: Some(token.into()), timeout: Duration::from_secs(20), ..Default::default() }
}

/// The bootstrap exchange by hand: what any program that reaches the port can do.
fn bootstrap(addr: &str, token: Option<&str>) -> (Welcome, TcpStream) {
    let mut s = TcpStream::connect(addr).unwrap();
    let w = client_handshake(&mut s, addr, token, Duration::from_secs(5))
        .unwrap_or_else(|e| Welcome::refusal(e.status, e.message));
    (w, s)
}

/// Start addresses of the server process's large read-write anonymous mappings: where
/// its arenas (and everything else big) live. An attacker on the host can read these.
fn large_mappings(pid: u32, min: u64) -> Vec<u64> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let (a, b) = range.split_once('-')?;
            let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
            (perms.starts_with("rw") && b - a >= min).then_some(a)
        })
        .collect()
}

/// Waits for the completion of the single operation in flight on `ep`: true when it
/// succeeded. No completion within the time counts as a failure of the attack.
fn outcome(ep: &Endpoint) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut out = Vec::new();
    while Instant::now() < deadline {
        if ep.poll(&mut out, 1) > 0 {
            return matches!(out[0], Completion::Done { .. });
        }
    }
    false
}

/// 13.1: with keys 1..64, at offset 0 and at the start of every large mapping of the
/// server process, one-sided reads and writes of the server's memory all fail, and the
/// stored value (and its generation) is unchanged afterwards.
#[test]
fn fabric_server_memory_is_neither_readable_nor_writable_remotely() {
    common::init(common::TCP);
    let token = "s3cret-token";
    let file = token_file(token);
    let mut args = FABRIC_TCP.to_vec();
    args.extend(["--auth-token-file", file.to_str().unwrap(), "--workers", "1"]);
    let server = ServerProc::start(&args);
    let mut c = Client::connect(&server.addr, with_token(token)).unwrap();
    let secret = vec![0x5au8; 4096];
    let generation = c.put(b"victim", &secret).unwrap();

    // The attacker knows the worker's address (ss shows its port); the refused bootstrap
    // tells it nothing, so take the address from a welcome as a stand-in for ss.
    let (refused, _s) = bootstrap(&server.addr, None);
    assert!(refused.error.is_some() && refused.shards.is_empty(), "no token, no addresses");
    let (w, _s) = bootstrap(&server.addr, Some(token));
    let worker = decode_addresses(&w.shards[0]).unwrap().remove(0);

    let ep = Endpoint::open("tcp;ofi_rxm", Some("127.0.0.1")).unwrap();
    assert!(ep.rma, "tcp;ofi_rxm offers one-sided operations");
    let peer = ep.insert_peer(&worker).unwrap();
    let mut local = vec![0u8; 4096];
    let mr = ep.register(local.as_ptr(), local.len(), RemoteAccess::None).unwrap();
    let mut targets = vec![0u64];
    targets.extend(large_mappings(server.child.id(), 16 << 20));
    assert!(targets.len() > 1, "the server's arena mapping is visible in /proc");
    let mut tried = 0;
    for key in 1..=64u64 {
        for &addr in &targets {
            let mut ctx = OpContext::default();
            // SAFETY: `local` and `ctx` outlive the operation: `outcome` waits for it.
            if unsafe { ep.read(local.as_mut_ptr(), 64, mr.desc, peer, addr + 5, key, &mut ctx) }.is_ok() {
                assert!(!outcome(&ep), "fi_read with key {key} at {addr:#x} succeeded");
            }
            let mut ctx = OpContext::default();
            // SAFETY: as above.
            if unsafe { ep.write(local.as_ptr(), 64, mr.desc, peer, addr + 5, key, &mut ctx) }.is_ok() {
                assert!(!outcome(&ep), "fi_write with key {key} at {addr:#x} succeeded");
            }
            tried += 2;
        }
    }
    assert!(tried >= 128);
    ep.deregister(mr).unwrap();
    drop(ep);
    match c.get(b"victim").unwrap() {
        Some(v) => assert!(v.data == secret && v.generation == generation, "stored value changed"),
        other => panic!("victim gone: {other:?}"),
    }
}

/// Sends a forged fabric hello to the worker and reports whether any reply came back.
fn forged_hello(ep: &Endpoint, peer: u64, session: u64) -> bool {
    let hello = wire::Hello { session, hello_id: 77, addresses: vec![ep.address().unwrap()] };
    let msg = hello.encode();
    let mut reply = vec![0u8; wire::REPLY_MSG_MAX];
    let (mut rctx, mut sctx) = (OpContext::default(), OpContext::default());
    (rctx.token, sctx.token) = (1, 2);
    // SAFETY: buffers and contexts outlive the operations: we wait (and cancel) below.
    unsafe {
        ep.recv(reply.as_mut_ptr(), reply.len(), std::ptr::null_mut(), wire::REPLY | 77, 0, &mut rctx).unwrap();
        ep.send(msg.as_ptr(), msg.len(), std::ptr::null_mut(), peer, wire::HELLO, &mut sctx).unwrap();
    }
    let deadline = Instant::now() + Duration::from_millis(150);
    let mut out = Vec::new();
    let mut answered = false;
    while Instant::now() < deadline {
        ep.poll(&mut out, 4);
        if out.iter().any(|c| matches!(c, Completion::Done { token: 1, .. })) {
            answered = true;
            break;
        }
    }
    if !answered {
        ep.cancel(&mut rctx);
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until
            && !out.iter().any(|c| matches!(c, Completion::Failed { token: 1, .. } | Completion::Done { token: 1, .. }))
        {
            ep.poll(&mut out, 4);
        }
    }
    answered
}

fn clients_of(c: &mut Client) -> u64 {
    let stats = c.stats().unwrap();
    stats["servers"][0]["shards"].as_array().unwrap().iter().map(|s| s["clients"].as_u64().unwrap()).sum()
}

/// 13.2: a hello gets a slot only with a session the bootstrap issued after the token
/// check, to a client still connected; forged, guessed or revoked sessions get nothing.
#[test]
fn fabric_hellos_need_a_live_session_from_the_bootstrap() {
    common::init(common::TCP);
    let token = "hello-token";
    let file = token_file(token);
    let mut args = FABRIC_TCP.to_vec();
    args.extend(["--auth-token-file", file.to_str().unwrap(), "--workers", "1"]);
    let server = ServerProc::start(&args);
    let mut c = Client::connect(&server.addr, with_token(token)).unwrap();
    assert_eq!(clients_of(&mut c), 1);

    let (w, live) = bootstrap(&server.addr, Some(token));
    let ep = Endpoint::open("tcp;ofi_rxm", Some("127.0.0.1")).unwrap();
    let peer = ep.insert_peer(&decode_addresses(&w.shards[0]).unwrap()[0]).unwrap();
    for guess in 1..=40u64 {
        assert!(!forged_hello(&ep, peer, guess.wrapping_mul(0x9E37_79B9_7F4A_7C15)), "a guessed session got a slot");
    }
    assert_eq!(clients_of(&mut c), 1, "forged hellos took slots");
    // The real session works once; repeating it does not grow the slot table.
    assert!(forged_hello(&ep, peer, w.session), "the issued session is accepted");
    assert!(forged_hello(&ep, peer, w.session));
    assert_eq!(clients_of(&mut c), 2, "one slot per bootstrap connection");
    drop(live);
    assert!(common::wait_until(Duration::from_secs(5), || clients_of(&mut c) == 1), "slot freed with its connection");
    assert!(!forged_hello(&ep, peer, w.session), "a revoked session still gets a slot");
    assert_eq!(clients_of(&mut c), 1);
}

/// 13.3: over UCX each client has its own session; a request with another client's
/// session works only while that client is connected, then is refused as unauthenticated.
#[test]
fn ucx_sessions_are_per_client_and_revoked_on_disconnect() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1"]);
    let a = server.client();
    let mut b = server.client();
    let (session_a, _) = a.raw_session();
    let (session_b, _) = b.raw_session();
    assert_ne!(session_a, session_b, "sessions are per client");
    let stats_with = |c: &mut Client, session: u64| {
        let mut h = RequestHeader::new(Op::Stats, c.raw_session().1, session);
        let mut buf = [0u8; REQUEST_HEADER_LEN];
        h.request_id = c.raw_session().1;
        h.encode(&mut buf);
        c.raw_request(0, &buf, &[], Duration::from_secs(10)).unwrap().0
    };
    assert_eq!(stats_with(&mut b, session_b), Status::Ok);
    assert_eq!(stats_with(&mut b, session_a), Status::Ok, "a's session is valid while a is connected");
    drop(a);
    assert!(
        common::wait_until(Duration::from_secs(5), || stats_with(&mut b, session_a) == Status::AuthFailed),
        "a's session still accepted after a disconnected"
    );
    assert_eq!(stats_with(&mut b, 12345), Status::AuthFailed, "an invented session is refused");
    assert_eq!(stats_with(&mut b, session_b), Status::Ok, "b keeps working");
}

/// A token holder's UCX endpoint that carries stream bytes, which no client of ours sends
/// (a shard worker turns UCX's stream feature on only to hear when UCX drops an endpoint):
/// the shard reads them into scratch and drops them (`transport/ucx/ep_watch.rs`), so the
/// server holds nothing for them, and it keeps answering that client on that endpoint and
/// everyone else.
#[test]
fn stream_bytes_on_a_client_endpoint_are_dropped_over_ucx_tcp() {
    common::init(common::TCP);
    let mut server = ServerProc::start(&["--workers", "1", "--memory", "64MiB"]);
    let pid = server.child.id();
    common::wait_resident(pid, 64 << 20);
    let (welcome, _bootstrap) = bootstrap(&server.addr, None);
    assert!(welcome.error.is_none(), "refused: {:?}", welcome.error);
    let raw = RawUcxClient::connect(&welcome);
    assert_eq!(raw.stats(1), Some(Status::Ok), "the raw client's first request is not answered");

    let before = common::rss_kib(pid).unwrap();
    const SENT: usize = 256 << 20;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..SENT / chunk.len() {
        raw.stream_send(&chunk);
    }
    // Answered after the stream bytes that came before it on the same connection.
    assert_eq!(raw.stats(2), Some(Status::Ok), "the client is not served after its stream bytes");
    let grown = common::rss_kib(pid).unwrap().saturating_sub(before) << 10;
    eprintln!("server RSS grew {} KiB over {} MiB of stream bytes", grown >> 10, SENT >> 20);
    assert!(grown < 32 << 20, "the server kept {grown} bytes of {SENT} stream bytes");

    let mut c = server.client();
    c.put(b"k", b"v").unwrap();
    assert_eq!(c.get(b"k").unwrap().unwrap().data, b"v", "another client is not served");
    drop((c, raw));
    assert_eq!(server.stop().and_then(|s| s.code()), Some(0), "the server did not shut down cleanly");
}

/// A client made by hand over UCX tcp, with UCX's stream feature (which ours lack): one
/// endpoint to shard 0, a session from the bootstrap, and replies taken by id.
struct RawUcxClient {
    worker: Worker,
    ep: ucx_sys::ucp_ep_h,
    session: u64,
    /// (request id, status) of each reply, appended by [`on_raw_reply`].
    replies: Box<std::sync::Mutex<Vec<(u64, u8)>>>,
}

impl RawUcxClient {
    fn connect(welcome: &Welcome) -> RawUcxClient {
        let worker = Worker::serving(&Tcp::On { device: Some("lo".into()) }).unwrap();
        let address = hex_decode(&welcome.shards[0]).unwrap();
        // SAFETY: no error callback; the endpoint is used by this thread only and closed
        // when the worker is destroyed.
        let (ep, _) = unsafe { worker.connect(&address, None, std::ptr::null_mut()) }.unwrap();
        let replies = Box::new(std::sync::Mutex::new(Vec::new()));
        // SAFETY: the boxed list lives as long as the worker (dropped after it: field order).
        unsafe { worker.set_am_handler(AM_REPLY, Some(on_raw_reply), &*replies as *const _ as *mut c_void) }.unwrap();
        RawUcxClient { worker, ep, session: welcome.session, replies }
    }

    /// Asks shard 0 for its stats with this client's session: the reply's status, or None
    /// after 10 s.
    fn stats(&self, id: u64) -> Option<Status> {
        let mut header = [0u8; REQUEST_HEADER_LEN];
        RequestHeader::new(Op::Stats, id, self.session).encode(&mut header);
        let param = ucx_sys::ucp_request_param_t {
            op_attr_mask: ucx_sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: ucx_sys::UCP_AM_SEND_FLAG_REPLY,
            ..Default::default()
        };
        // SAFETY: ep is this worker's; the header outlives the send, progressed to its end.
        unsafe {
            let header = header.as_ptr() as *const c_void;
            let sent = ucx_sys::ucp_am_send_nbx(
                self.ep,
                AM_REQUEST as u32,
                header,
                REQUEST_HEADER_LEN,
                std::ptr::null(),
                0,
                &param,
            );
            self.finish(sent, "ucp_am_send_nbx");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            self.worker.progress();
            let replies = self.replies.lock().unwrap();
            if let Some(&(_, status)) = replies.iter().find(|r| r.0 == id) {
                return Some(Status::from_code(status as i8));
            }
        }
        None
    }

    /// Sends `bytes` as UCX stream data on the endpoint, and progresses until it is sent.
    fn stream_send(&self, bytes: &[u8]) {
        let param = ucx_sys::ucp_request_param_t::default();
        // SAFETY: ep is this worker's; bytes outlive the send, progressed to its end here.
        let request =
            unsafe { ucx_sys::ucp_stream_send_nbx(self.ep, bytes.as_ptr() as *const c_void, bytes.len(), &param) };
        // SAFETY: as above.
        unsafe { self.finish(request, "ucp_stream_send_nbx") };
    }

    /// Progresses the worker until `request`, a send started on it, is done; then frees it.
    ///
    /// # Safety
    /// `request` is what a send on this worker returned, not yet freed.
    unsafe fn finish(&self, request: ucx_sys::ucs_status_ptr_t, what: &str) {
        if request.is_null() {
            return;
        }
        assert!(ptr_status(request).is_none(), "{what} failed");
        // SAFETY: a request UCX returned, checked until done, then freed once.
        unsafe {
            while ucx_sys::ucp_request_check_status(request) == ucx_sys::UCS_INPROGRESS {
                self.worker.progress();
            }
            ucx_sys::ucp_request_free(request);
        }
    }
}

/// Records a reply's request id and status (the AM handler of [`RawUcxClient`]).
unsafe extern "C" fn on_raw_reply(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    length: usize,
    _param: *const ucx_sys::ucp_am_recv_param_t,
) -> ucx_sys::ucs_status_t {
    // SAFETY: arg is the RawUcxClient's boxed list, alive as long as its worker; the
    // header is valid for the call.
    unsafe {
        let header = remote_dram::transport::ucx::am_header(header, header_length);
        if let Ok(h) = ReplyHeader::decode_compact(header, length) {
            (*(arg as *const std::sync::Mutex<Vec<(u64, u8)>>)).lock().unwrap().push((h.request_id, h.status));
        }
    }
    ucx_sys::UCS_OK
}

/// 13.6: an empty token refuses to start (never "token required" while serving anyone);
/// a token file readable by others is warned about.
#[test]
fn empty_tokens_refuse_to_start_and_loose_token_files_warn() {
    common::init(common::TCP);
    let out = std::process::Command::new(common::RDRAM)
        .args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off"])
        .env("RDRAM_AUTH_TOKEN", "")
        .output()
        .unwrap();
    assert!(!out.status.success(), "an empty RDRAM_AUTH_TOKEN must not start an open server");
    assert!(String::from_utf8_lossy(&out.stderr).contains("empty"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening on"));

    let empty = token_file("");
    let out = std::process::Command::new(common::RDRAM)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--memory",
            "64MiB",
            "--hugepages",
            "off",
            "--auth-token-file",
            empty.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an empty token file must not start the server");
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no token"));

    use std::os::unix::fs::PermissionsExt;
    let loose = token_file("loose-token");
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = std::process::Command::new(common::RDRAM);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off", "--workers", "1"])
        .args(["--auth-token-file", loose.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    // Read on a thread: the server keeps running (and its stderr open) after the warning.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 512];
        while let Ok(n) = stderr.read(&mut chunk) {
            if n == 0 || tx.send(String::from_utf8_lossy(&chunk[..n]).into_owned()).is_err() {
                break;
            }
        }
    });
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains("readable by group or others") {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(text) => seen.push_str(&text),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen.contains("readable by group or others"), "no warning: {seen}");
}

/// 13.5: a client that trickles its handshake is cut off at the deadline, connections
/// beyond --max-clients are told the server is at capacity, and a departed client's
/// place is given to the next one.
#[test]
fn bootstrap_has_a_deadline_and_a_client_limit() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1", "--max-clients", "2"]);
    // One byte every 500 ms: the whole handshake must end within its 3 s deadline.
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    let started = Instant::now();
    let line = br#"{"magic":"remote_dram","version":2,"token":null}"#;
    let mut closed_after = None;
    for b in line.iter() {
        if slow.write_all(&[*b]).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
        let mut probe = [0u8; 256];
        slow.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        if let Ok(n) = slow.read(&mut probe) {
            let text = String::from_utf8_lossy(&probe[..n]).into_owned();
            assert!(n == 0 || text.contains("error"), "a trickled handshake was answered: {text}");
            closed_after = Some(started.elapsed());
            break;
        }
    }
    let took = closed_after.expect("a trickling client was never cut off");
    assert!(took < Duration::from_secs(9), "handshake deadline not enforced ({took:?})");

    let a = server.client();
    let b = server.client();
    let err = Client::connect(&server.addr, common::options())
        .err()
        .expect("a third client was admitted past --max-clients 2");
    assert_eq!(err.status, Status::Unavailable);
    assert!(err.message.contains("at capacity"), "{}", err.message);
    drop(a);
    assert!(common::wait_until(Duration::from_secs(5), || Client::connect(&server.addr, common::options()).is_ok()));
    drop(b);
}

/// 13.9: `rdram put --file /dev/zero` stops at the value limit instead of reading
/// forever, and `--ttl-ms 0` is refused rather than meaning "expire at once".
#[test]
fn cli_bounds_its_input_and_refuses_a_zero_ttl() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1"]);
    let (code, _, err) = rdram(&["put", "--server", &server.addr, "zero", "--file", "/dev/zero"], None);
    assert_ne!(code, 0);
    assert!(err.contains("larger than") && err.contains("1 GiB"), "{err}");
    let (code, _, err) = rdram(&["put", "--server", &server.addr, "k", "v", "--ttl-ms", "0"], None);
    assert_ne!(code, 0);
    assert!(err.contains("ttl"), "{err}");
    let (code, _, _) = rdram(&["put", "--server", &server.addr, "k", "v", "--ttl-ms", "60000"], None);
    assert_eq!(code, 0);
    let mut c = server.client();
    assert_eq!(c.list(&KeyRange::prefix(b"")).unwrap().len(), 1, "only the valid put landed");
    let _ = pattern(0, 0);
}

/// 13.4: a client that asks and never receives cannot make the server hold its replies
/// without bound: 3000 LIST requests of ~1 MiB replies each (3 GB if all were built and
/// queued) grow the server's RSS by at most a few hundred MB, and other clients are
/// served meanwhile.
#[test]
fn a_client_that_never_receives_is_bounded_over_ucx() {
    common::init(common::TCP);
    client_that_never_receives(&[]);
}

fn client_that_never_receives(transport: &[&str]) {
    let mut args = vec!["--workers", "1", "--memory", "256MiB"];
    args.extend_from_slice(transport);
    let server = ServerProc::start(&args);
    let mut c = server.client();
    let long_key = |i: u32| [&i.to_be_bytes()[..], &[b'k'; (64 << 10) - 4]].concat();
    for i in 0..16 {
        c.put(&long_key(i), b"v").unwrap();
    }
    let rss = || common::rss_kib(server.child.id()).expect("the server runs");
    common::wait_resident(server.child.id(), 256 << 20);
    let before = rss();
    let mut hog = server.client();
    for _ in 0..3000 {
        common::list_without_reading(&mut hog, 0);
    }
    std::thread::sleep(Duration::from_secs(3));
    let after = rss();
    assert_eq!(c.get(&long_key(3)).unwrap().unwrap().data, b"v", "others are still served");
    assert!(
        after < before + (400 << 10),
        "server RSS grew from {before} KiB to {after} KiB for a client that never receives"
    );
    drop(hog);
}

/// Small replies go by inject over libfabric (copied by the provider, with no completion
/// to count against the client): a client that sends 5,000 small GETs and takes none of
/// their replies is bounded by the provider's own send queue and the socket buffers. The
/// server's RSS stays put and the others are served. (Over shm, a receive queue that
/// fills is `transport_fabric_shm`'s `a_client_that_never_receives_does_not_wedge_the_shard`.)
#[test]
fn a_client_that_never_receives_small_replies_is_bounded_over_fabric_tcp() {
    common::init(common::TCP);
    let mut args = vec!["--workers", "1", "--memory", "256MiB"];
    args.extend_from_slice(&FABRIC_TCP);
    let server = ServerProc::start(&args);
    let mut c = server.client();
    c.put(b"small", b"12345678").unwrap();
    let rss = || common::rss_kib(server.child.id()).expect("the server runs");
    common::wait_resident(server.child.id(), 256 << 20);
    let before = rss();
    let mut hog = server.client();
    let mut sent = 0;
    while sent < 5_000 {
        let (session, id) = hog.raw_session();
        let mut h = RequestHeader::new(Op::Get, id, session);
        h.key_len = 5;
        let mut buf = [0u8; REQUEST_HEADER_LEN];
        h.encode(&mut buf);
        if hog.raw_submit(0, &buf, b"small").is_err() {
            break; // its own queues are full
        }
        sent += 1;
    }
    assert!(sent >= 1000, "the hog sent only {sent} requests");
    std::thread::sleep(Duration::from_secs(3));
    let after = rss();
    for _ in 0..3 {
        assert_eq!(c.get(b"small").expect("others are served").expect("stored").data, b"12345678");
    }
    assert!(
        after < before + (64 << 10),
        "server RSS grew from {before} KiB to {after} KiB for a client that never receives {sent} replies"
    );
    drop(hog);
}

/// A client that starts a large put and then stops progressing (SIGSTOP: alive, silent)
/// holds its reserved extent only until the server's stall deadline: then the transfer is
/// cut, the space comes back, and the server goes on serving everyone else. When the
/// client resumes, its put has either failed or stored exactly its bytes.
fn stalled_put_is_cut_at_its_deadline(transport: &[&str]) {
    let mut args =
        vec!["--workers", "1", "--memory", "128MiB", "--stall-timeout-ms", "1000", "--metrics", "127.0.0.1:0"];
    args.extend_from_slice(transport);
    let server = ServerProc::start(&args);
    let mut c = server.client();
    let dir = std::env::temp_dir().join(format!("rdram-stall-{}-{}", std::process::id(), transport.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("value");
    let value = pattern(11, 120 << 20);
    std::fs::write(&file, &value).unwrap();
    let used = |c: &mut Client| c.stats().unwrap()["used_bytes"].as_u64().unwrap();

    // Stop the writer mid-transfer: once its extent is reserved, before the value lands.
    let mut writer = None;
    for _attempt in 0..10 {
        let mut child = std::process::Command::new(common::RDRAM)
            .args(["put", "stalled", "--file", file.to_str().unwrap(), "--server", &server.addr])
            .spawn()
            .unwrap();
        let reserved = common::wait_until(Duration::from_secs(10), || {
            used(&mut c) >= 100 << 20 || matches!(child.try_wait(), Ok(Some(_)))
        });
        common::signal(child.id(), common::SIGSTOP);
        if reserved && c.get(b"stalled").unwrap().is_none() && matches!(child.try_wait(), Ok(None)) {
            writer = Some(child);
            break;
        }
        // Too late (the put landed) or too early: start over.
        common::signal(child.id(), common::SIGCONT);
        let _ = child.wait();
        c.delete(b"stalled").unwrap();
    }
    let mut writer = writer.expect("could not stop a writer mid-put in 10 tries");
    let held = used(&mut c);
    assert!(held >= 120 << 20, "the stalled put holds {held} bytes");
    let other = pattern(12, 50 << 20);
    assert_eq!(
        c.put(b"other", &other).unwrap_err().status,
        Status::NoSpace,
        "the stalled put should hold the space for now"
    );

    // The deadline (1 s + 120 MiB at 64 MiB/s) passes: the space comes back.
    let started = Instant::now();
    assert!(
        common::wait_until(Duration::from_secs(15), || c.put(b"other", &other).is_ok()),
        "a stalled put still held its extent {:?} after it stopped",
        started.elapsed()
    );
    assert_eq!(c.get(b"other").unwrap().map(|v| v.data).as_deref(), Some(&other[..]));
    assert!(used(&mut c) < 60 << 20, "the cut put's extent was not released: {} bytes used", used(&mut c));
    assert!(server.shard_metric("rdram_transfers_cut_total", 0) >= 1, "the cut is not counted");

    // The writer resumes: its put failed, or stored exactly its bytes; nothing else.
    common::signal(writer.id(), common::SIGCONT);
    let status = writer.wait().unwrap();
    match c.get(b"stalled").unwrap() {
        Some(v) => assert!(
            status.success() && v.data == value,
            "a cut put stored {} wrong bytes (writer {status})",
            v.data.len()
        ),
        None => assert!(!status.success(), "the writer reported success, but nothing was stored"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stalled_put_is_cut_at_its_deadline_over_ucx_tcp() {
    common::init(common::TCP);
    stalled_put_is_cut_at_its_deadline(&[]);
}

#[test]
fn a_stalled_put_is_cut_at_its_deadline_over_fabric_tcp() {
    common::init(common::TCP);
    stalled_put_is_cut_at_its_deadline(&FABRIC_TCP);
}

/// The helper of `a_value_staged_in_parts_outlives_its_stalled_parts`: sends two parts of
/// one staged value side by side, says so, then never drives them (it is stopped).
const PARTS_SENDER_ENV: &str = "RDRAM_TEST_PARTS_SENDER";
const STALLED_PART: usize = 8 << 20;

#[test]
#[ignore = "a helper process of a_value_staged_in_parts_outlives_its_stalled_parts"]
fn parts_sender() {
    let Ok(addr) = std::env::var(PARTS_SENDER_ENV) else { return };
    let mut c =
        Client::connect(&addr, ClientOptions { timeout: Duration::from_secs(60), ..common::options() }).unwrap();
    let part = pattern(21, STALLED_PART);
    let total = 2 * STALLED_PART as i64;
    let mut stage = 0;
    for start in [0, STALLED_PART as i64] {
        let (session, id) = c.raw_session();
        let mut h = RequestHeader::new(Op::Put, id, session);
        h.flags = flags::STAGE | flags::HAS_RANGE;
        h.key_len = 6;
        (h.range_start, h.range_end, h.if_not_equal) = (start, total, stage);
        let mut buf = [0u8; REQUEST_HEADER_LEN].to_vec();
        h.encode((&mut buf[..]).try_into().unwrap());
        buf.extend_from_slice(b"staged");
        c.raw_submit(0, &buf, &part).unwrap();
        if start == 0 {
            stage = id;
        }
    }
    println!("SENT");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

/// A client sends two parts of one staged value side by side over libfabric tcp, then
/// stops (SIGSTOP: alive, silent). The parts' reads are given up at their deadline; the
/// value keeps its whole extent while the reads may still write into it (a cut once freed
/// it under them, and then again), the server serves everyone else, and when the client
/// dies the value goes and the shard's memory is exactly as before.
#[test]
fn a_value_staged_in_parts_outlives_its_stalled_parts() {
    common::init(common::TCP);
    let mut args =
        vec!["--workers", "1", "--memory", "256MiB", "--stall-timeout-ms", "500", "--metrics", "127.0.0.1:0"];
    args.extend_from_slice(&FABRIC_TCP);
    let mut server = ServerProc::start(&args);
    let mut c = server.client();
    let kept = pattern(22, 3 << 20);
    c.put(b"kept", &kept).unwrap();
    let stats = |c: &mut Client| {
        let s = c.stats().unwrap();
        (s["used_bytes"].as_u64().unwrap(), s["servers"][0]["shards"][0]["staged_values"].as_u64().unwrap())
    };
    let before = stats(&mut c);

    // Killed when dropped: a failed assertion leaves no stopped helper behind.
    struct Helper(std::process::Child);
    impl Drop for Helper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut sender = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "parts_sender", "--ignored", "--nocapture", "--test-threads=1"])
        .env(PARTS_SENDER_ENV, &server.addr)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(sender.stdout.take().unwrap());
    let sender = Helper(sender);
    let mut line = String::new();
    while !line.contains("SENT") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0, "the helper ended before sending");
    }
    common::stop_process(sender.0.id());

    // Both parts' reads are given up (one may have landed while the helper sent the other).
    let cut = || server.shard_metric("rdram_transfers_cut_total", 0);
    assert!(
        common::wait_until(Duration::from_secs(10), || cut() >= 1),
        "no part's read was given up at its deadline (did both land before the helper stopped?)"
    );
    let (used, staged) = stats(&mut c);
    assert_eq!(staged, 1, "the value is still staged");
    assert!(used >= before.0 + 2 * STALLED_PART as u64, "the staged value's extent is held whole: {used} bytes used");
    // Everyone else is served meanwhile.
    c.put(b"meanwhile", &pattern(23, 1 << 20)).unwrap();
    assert_eq!(c.get(b"kept").unwrap().unwrap().data, kept);
    assert!(c.delete(b"meanwhile").unwrap());

    drop(sender); // SIGKILL
    assert!(
        common::wait_until(Duration::from_secs(20), || stats(&mut c) == before),
        "the dead client's staged value did not go, or went twice: (used, staged) {:?}, before {before:?}",
        stats(&mut c)
    );
    assert_eq!(c.get(b"staged").unwrap(), None, "the value was never committed");
    // The whole arena is usable again: a value of most of it fits and reads back.
    let big = pattern(24, 200 << 20);
    c.put(b"big", &big).unwrap();
    assert_eq!(c.get(b"big").unwrap().unwrap().data, big);
    assert_eq!(c.get(b"kept").unwrap().unwrap().data, kept);
    drop(c);
    assert!(server.stop().is_some_and(|s| s.success()), "the server exits 0");
}

/// Clients SIGKILLed at every moment of their connection set-up (bootstrap, UCX wireup,
/// first round trip) and of a large put: the server keeps serving and exits 0. (UCX
/// 1.13.1 aborted here in `ucp_request.c:684 ... got REP message`.)
#[test]
fn clients_killed_while_connecting_leave_the_server_serving() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "2", "--memory", "256MiB"]);
    let file = std::env::temp_dir().join(format!("rdram-killed-{}", std::process::id()));
    std::fs::write(&file, pattern(5, 32 << 20)).unwrap();
    // A process takes ~0.5 s to start; spread the kills over start, connect and transfer.
    let started = Instant::now();
    let spawn = || {
        std::process::Command::new(common::RDRAM)
            .args(["put", "k", "--file", file.to_str().unwrap(), "--server", &server.addr])
            .spawn()
            .unwrap()
    };
    assert!(spawn().wait().unwrap().success());
    let typical = started.elapsed();
    for i in 0..24u32 {
        let mut child = spawn();
        std::thread::sleep(typical.mul_f64(0.3 + 0.05 * i as f64));
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut c = server.client();
    let v = pattern(6, 1 << 20);
    c.put(b"after", &v).unwrap();
    assert_eq!(c.get(b"after").unwrap().map(|v| v.data).as_deref(), Some(&v[..]));
    std::fs::remove_file(&file).unwrap();
    // Drop: the server must still exit 0 on SIGTERM.
}

/// A server's shared-memory transports act on what a peer's transport address says: cma
/// reads from the pid a client's UCX or libfabric advertises, posix and sysv map the segment
/// it names. A client with the token that forges them can have the server copy another
/// process's memory into the store (docs/security.md). That stays within what the
/// client's own user could read because a client of another user cannot reach the server
/// over shared memory at all: it cannot map the server's segments. This checks that premise
/// (UCX's and libfabric's, not ours) against the versions we ship, that such a client is
/// told why, and that a client of the server's user (the control) connects.
#[test]
fn clients_of_another_user_cannot_reach_a_server_over_shared_memory() {
    common::init(common::TCP);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        common::skipped(
            "clients_of_another_user_cannot_reach_a_server_over_shared_memory",
            "only root can run a client as another user",
        );
        return;
    }
    // `tls`: the client's UCX_TLS (None: UCX's default, every transport).
    let client = |nobody: bool, tls: Option<&str>, args: &[&str]| {
        let mut cmd = std::process::Command::new(if nobody { "setpriv" } else { common::RDRAM });
        if nobody {
            cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", common::RDRAM]);
        }
        match tls {
            Some(tls) => cmd.env("UCX_TLS", tls),
            None => cmd.env_remove("UCX_TLS"),
        };
        let out = cmd.args(args).output().expect("setpriv (util-linux)");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    if !client(true, None, &["--version"]).0 {
        common::skipped(
            "clients_of_another_user_cannot_reach_a_server_over_shared_memory",
            &format!("user nobody cannot run {}", common::RDRAM),
        );
        return;
    }
    let ucx = ServerProc::start_with_env(&["--workers", "1"], &[("UCX_TLS", common::SHM)]);
    let fabric = ServerProc::start(&["--workers", "1", "--transport", "fabric", "--provider", "shm"]);
    let cases = [
        ("UCX shm, the client forcing shared memory", &ucx, Some(common::SHM), "UCX_TLS allows only shared memory"),
        ("UCX shm, the client's UCX choosing", &ucx, None, "Shared memory error"),
        ("libfabric shm", &fabric, None, "--provider"),
    ];
    for (name, server, tls, says) in cases {
        let put = ["put", "--server", &server.addr, "from-nobody", "v"];
        let (ok, stderr) = client(true, tls, &put);
        assert!(!ok, "{name}: a client of another user stored a value over shared memory");
        assert!(stderr.contains("runs as another user") && stderr.contains(says), "{name}: {stderr}");
        let (ok, stderr) = client(false, tls, &put);
        assert!(ok, "{name}: the server's own user: {stderr}");
    }
}

/// 57.1: a server in no cluster takes no frame that only members send: imports (of a put,
/// with u64::MAX; of a delete; of a value staged in parts), and handover holds and ends;
/// a whole value flagged as staged is no frame at all. Each is refused and changes nothing: the key keeps its value and generation, and
/// the next write's generation follows on from it.
#[test]
fn a_server_outside_a_cluster_takes_no_frame_only_members_send() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1"]);
    let mut c = server.client();
    let g1 = c.put(b"k", b"mine").unwrap();
    type Frame<'a> = (&'a str, Op, &'a [u8], &'a dyn Fn(&mut RequestHeader));
    let frames: [Frame; 5] = [
        ("import of u64::MAX", Op::Put, b"forged", &|h| {
            h.flags |= flags::IMPORT;
            h.if_equal = u64::MAX;
        }),
        ("the install of a value staged in parts", Op::Put, b"", &|h| {
            h.flags |= flags::STAGE | flags::IMPORT;
            h.if_equal = u64::MAX;
            h.if_not_equal = 1;
        }),
        ("import of a delete", Op::Delete, b"", &|h| {
            h.flags |= flags::IMPORT;
            h.if_equal = u64::MAX;
        }),
        ("a handover hold", Op::Get, b"", &|h| h.flags |= flags::MIGRATE),
        ("a handover's end", Op::Delete, b"", &|h| {
            h.flags |= flags::MIGRATE | flags::IF_EQUAL;
            h.if_equal = 1;
        }),
    ];
    for (what, op, value, edit) in frames {
        let (status, message) = common::raw_request(&server.addr, op, b"k", value, edit);
        assert_eq!(status, Status::AuthFailed, "{what}: {message}");
        assert!(message.contains("members of a cluster"), "{what}: {message}");
    }
    // A whole value flagged STAGE is no frame at all.
    let (status, message) =
        common::raw_request(&server.addr, Op::Put, b"k", b"staged", |h: &mut RequestHeader| h.flags |= flags::STAGE);
    assert_eq!(status, Status::Invalid, "a staged whole value: {message}");
    let held = c.get(b"k").unwrap().unwrap();
    assert_eq!((held.data.as_slice(), held.generation), (&b"mine"[..], g1));
    let g2 = c.put(b"k", b"next").unwrap();
    assert!(g2 > g1 && g2 < 1 << 63, "generations follow on: {g1} then {g2}");
}

/// 57.3: the token never crosses the wire. A listener posing as a server (as anyone who
/// can write to etcd, or answer on a server's address, could) gets a client's hello and
/// answers with a proof it cannot have made, or none: the client gives up before sending
/// anything more, says why, and nothing it sent holds the token.
#[test]
fn the_token_never_crosses_the_wire() {
    use remote_dram::proto::bootstrap::{hex_encode, write_line, Challenge, MAGIC};
    common::init(common::TCP);
    let token = "the-token-no-one-else-may-see";
    for (proof, why) in [(Some(hex_encode(&[7u8; 32])), "wrong auth token"), (None, "without an auth token")] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let impostor = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut heard = Vec::new();
            let mut buf = [0u8; 4096];
            // The hello, then our challenge, then whatever else the client sends.
            let n = s.read(&mut buf).unwrap();
            heard.extend_from_slice(&buf[..n]);
            let challenge = Challenge {
                magic: MAGIC.into(),
                version: remote_dram::proto::PROTOCOL_VERSION,
                error: None,
                nonce: hex_encode(&[1u8; 32]),
                proof,
            };
            write_line(&mut s, &challenge).unwrap();
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                heard.extend_from_slice(&buf[..n]);
            }
            heard
        });
        let err = Client::connect(&addr, with_token(token)).err().expect("an impostor was trusted");
        assert_eq!(err.status, Status::AuthFailed, "{err}");
        assert!(err.message.contains("could not prove") && err.message.contains(why), "{err}");
        let heard = String::from_utf8_lossy(&impostor.join().unwrap()).into_owned();
        assert!(
            heard.contains("remote_dram") && heard.lines().count() == 1,
            "the client sent more than its hello: {heard}"
        );
        assert!(!heard.contains(token), "the token crossed the wire: {heard}");
    }
    // Against the real server, both sides prove it, and a wrong token is refused.
    let file = token_file(token);
    let server = ServerProc::start(&["--workers", "1", "--auth-token-file", file.to_str().unwrap()]);
    let mut c = Client::connect(&server.addr, with_token(token)).unwrap();
    c.put(b"k", b"v").unwrap();
    let err = Client::connect(&server.addr, with_token("guess")).err().expect("a wrong token was let in");
    assert_eq!(err.status, Status::AuthFailed, "{err}");
}

/// 57.4: silent handshakes from one address (every local client shares 127.0.0.1) cannot
/// lock a prompt client out: at the bound the oldest is cut.
#[test]
fn held_handshakes_do_not_lock_out_a_prompt_client() {
    use remote_dram::server::tunables::MAX_HANDSHAKES_PER_SOURCE;
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let held: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(&server.addr).unwrap()).collect();
    let holding = || server.metric("rdram_handshakes_in_progress{}") == MAX_HANDSHAKES_PER_SOURCE as u64;
    assert!(common::wait_until(Duration::from_secs(5), holding), "the server holds its bound of silent handshakes");
    let (code, out, err) = rdram(&["put", "--server", &server.addr, "k", "through"], None);
    assert_eq!(code, 0, "a prompt client was locked out: {err} {}", String::from_utf8_lossy(&out));
    let mut c = server.client();
    assert_eq!(c.get(b"k").unwrap().unwrap().data, b"through");
    drop(held);
}

/// 57.4: frames cut short are answered with an error (they used to get no reply, and the
/// sender waited out its timeout): a full header cut to 40 bytes, a short form cut to 31,
/// and a header that is not ours.
#[test]
fn cut_frames_are_answered_with_an_error() {
    common::init(common::TCP);
    let server = ServerProc::start(&["--workers", "1"]);
    let mut c = server.client();
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(Op::Get, id, session);
    h.key_len = 1;
    let mut full = [0u8; REQUEST_HEADER_LEN];
    h.encode(&mut full);
    let mut short = [0u8; REQUEST_HEADER_LEN];
    let short_len = h.encode_short(&mut short);
    assert_eq!(short_len, 32);
    let mut foreign = full;
    foreign[0] ^= 0xff;
    for (what, frame) in
        [("40 bytes", &full[..40]), ("a 31-byte short form", &short[..31]), ("a foreign header", &foreign[..])]
    {
        let mut frame = frame.to_vec();
        frame[8..16].copy_from_slice(&c.raw_session().1.to_le_bytes());
        let started = Instant::now();
        let (status, message) = c.raw_request(0, &frame, &[], Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::Invalid, "{what}: {message}");
        assert!(!message.is_empty() && started.elapsed() < Duration::from_secs(5), "{what}: {message}");
    }
    c.put(b"k", b"v").unwrap();
}
