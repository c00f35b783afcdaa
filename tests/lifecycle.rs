//! Starting and stopping under load (issue 12.6, 12.7): SIGTERM with a large put in flight
//! exits 0, an embedded server stops with a put in flight without aborting, and a client
//! that connects while a server is still starting is answered at once.
mod common;

use std::time::{Duration, Instant};

use common::{pattern, ServerProc};
use remote_dram::{Client, ClientOptions, Server, ServerConfig, Status};

/// Puts `len`-byte values in a loop until told to stop; returns how many were acknowledged.
fn putter(addr: String, len: usize, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let value = pattern(3, len);
        let Ok(mut c) = Client::connect(&addr, common::options()) else { return 0 };
        let mut acked = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            match c.put(b"big", &value) {
                Ok(_) => acked += 1,
                Err(_) => break,
            }
        }
        acked
    })
}

fn sigterm_with_a_put_in_flight(extra: &[&str]) {
    let mut args = vec!["--workers", "1", "--memory", "1GiB"];
    args.extend_from_slice(extra);
    let mut server = ServerProc::start(&args);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = putter(server.addr.clone(), 256 << 20, stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let status = server.stop().expect("no exit within 10 s of SIGTERM");
    assert!(status.success(), "exit status {status} after SIGTERM with a put in flight");
    assert!(started.elapsed() < Duration::from_secs(8), "shutdown took {:?}", started.elapsed());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    worker.join().unwrap();
}

#[test]
fn sigterm_with_a_put_in_flight_exits_zero_over_ucx_shm() {
    common::init(common::SHM);
    sigterm_with_a_put_in_flight(&[]);
}

#[test]
fn sigterm_with_a_put_in_flight_exits_zero_over_fabric_tcp() {
    common::init(common::SHM);
    sigterm_with_a_put_in_flight(&["--transport", "fabric", "--provider", "tcp;ofi_rxm"]);
}

/// `Server::stop` (what `rdram_server_stop` and the C++ driver's server mode call) with a
/// rendezvous put in flight: the process does not abort, and the put's caller gets an
/// answer (stored, or an error) instead of hanging.
#[test]
fn embedded_server_stops_with_a_put_in_flight() {
    common::init(common::SHM);
    let server = Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        workers: 1,
        memory: 1 << 30,
        hugepages: remote_dram::store::HugePages::Off,
        ..Default::default()
    })
    .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = putter(server.local_addr().to_string(), 256 << 20, stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    server.stop();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    worker.join().unwrap();
}

/// A client connecting while the server is still starting (pre-faulting a large arena)
/// is refused at once (connection refused: Unavailable), or served; never left waiting.
#[test]
fn connecting_during_start_is_answered_at_once() {
    common::init(common::SHM);
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap().to_string();
    drop(probe);
    let mut cmd = std::process::Command::new(common::RDRAM);
    cmd.args(["serve", "--listen", &addr, "--workers", "1", "--memory", "3GiB", "--hugepages", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let quick = ClientOptions { connect_timeout: Duration::from_secs(5), ..common::options() };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut refused = 0;
    loop {
        let t = Instant::now();
        match Client::connect(&addr, quick.clone()) {
            Ok(_) => break,
            Err(e) => {
                assert_eq!(e.status, Status::Unavailable, "{e}");
                assert!(t.elapsed() < Duration::from_millis(500), "a connect during start waited {:?}: {e}", t.elapsed());
                refused += 1;
            }
        }
        assert!(Instant::now() < deadline, "the server never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    eprintln!("{refused} connects refused while the server started");
}
