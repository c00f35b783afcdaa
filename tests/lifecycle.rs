//! Starting and stopping under load (issue 12.6, 12.7): SIGTERM with a large put in flight
//! exits 0, an embedded server stops with a put in flight without aborting, and a client
//! that connects while a server is still starting is answered at once. And which transports
//! a client takes to a server on its own host.
mod common;

use std::time::{Duration, Instant};

use common::{pattern, ServerProc};
use remote_dram::{Client, ClientOptions, Server, ServerConfig, Status};

/// Puts `len`-byte values in a loop until told to stop; returns how many were acknowledged.
fn putter(
    addr: String,
    len: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
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
    let mut args = vec!["--workers", "1", "--memory", "1GiB", "--metrics", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let mut server = ServerProc::start(&args);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = putter(server.addr.clone(), 256 << 20, stop.clone());
    // The premise: the server is receiving puts (the putter starts the next at once).
    assert!(
        common::wait_until(Duration::from_secs(20), || server.shard_metric("rdram_transfers_in_flight", 0) >= 1),
        "no put was seen in flight"
    );
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
                // Well under the 5 s connect timeout (a loaded CI machine is slow to fail too).
                assert!(t.elapsed() < Duration::from_secs(2), "a connect during start waited {:?}: {e}", t.elapsed());
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

/// A one-shot `rdram` command reaches a UCX server that shares its host, namespaces and
/// user over posix shared memory alone (its context then skips tcp discovery, ~25 ms),
/// and one whose server offers no shared memory, or not the posix kind, over what that
/// server offers, quietly.
#[test]
fn one_shot_commands_take_shared_memory_only_where_the_server_offers_it() {
    use std::process::{Command, Stdio};
    let value = pattern(8, 3 << 20);
    for (server_tls, narrowed) in [(None, true), (Some("tcp"), false), (Some("sysv,cma,self,tcp"), false)] {
        let mut cmd = Command::new(common::RDRAM);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--workers", "1", "--memory", "64MiB", "--hugepages", "off"])
            .env("UCX_NET_DEVICES", "lo");
        match server_tls {
            // UCX's tcp transport is a trusted-network opt-in.
            Some(tls) => cmd.env("UCX_TLS", tls).env("RDRAM_UCX_TCP", "1"),
            None => cmd.env_remove("UCX_TLS"),
        };
        let mut server = ServerProc::spawn_listening(cmd);
        let cli = |args: &[&str], stdin: Option<&[u8]>| {
            use std::io::Write;
            let mut child = Command::new(common::RDRAM)
                .args(args)
                .args(["--server", &server.addr])
                .env_remove("UCX_TLS")
                .env("UCX_NET_DEVICES", "lo")
                .env("RUST_LOG", "remote_dram=debug")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(stdin.unwrap_or_default()).unwrap();
            let out = child.wait_with_output().unwrap();
            (out.status.code(), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
        };
        let (put, _, put_log) = cli(&["put", "big"], Some(&value));
        let (get, got, get_log) = cli(&["get", "big"], None);
        assert_eq!((put, get), (Some(0), Some(0)), "server UCX_TLS {server_tls:?}:\n{put_log}\n{get_log}");
        assert!(got == value, "server UCX_TLS {server_tls:?}: the value came back changed");
        for log in [&put_log, &get_log] {
            assert_eq!(log.contains("UCX over shared memory only"), narrowed, "server UCX_TLS {server_tls:?}:\n{log}");
            assert!(!log.contains("ERROR"), "server UCX_TLS {server_tls:?}:\n{log}");
        }
        assert_eq!(server.stop().and_then(|s| s.code()), Some(0));
    }
}

/// With UCX left to its defaults (no `UCX_TLS`), a library client with the default options
/// reaches a server on its own host over shared memory: with every transport enabled, UCX
/// chose tcp for endpoints that ask for peer-failure detection, which its shared-memory
/// transports lack, and GET 8 B took 7.2 µs instead of 0.62 here (9-12 µs instead of 1.1
/// on the 16-core GPU host). Seen from the server: only a shared-memory client's endpoint is
/// stranded when it leaves, so with `--stranded-endpoint-limit 1` its departure recycles
/// the worker; a tcp client's would not.
#[test]
fn a_default_library_client_reaches_a_local_server_over_shared_memory() {
    use std::process::Command;
    let mut cmd = Command::new(common::RDRAM);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--workers", "1", "--memory", "64MiB", "--hugepages", "off"])
        .args(["--metrics", "127.0.0.1:0", "--stranded-endpoint-limit", "1"])
        .env_remove("UCX_TLS")
        .env("UCX_NET_DEVICES", "lo");
    let mut server = ServerProc::spawn_listening(cmd);
    assert_eq!(server.shard_metric("rdram_worker_recycles_total", 0), 0);
    // rdram-bench: a long-lived client of the library, its options the defaults but for polling.
    let plots = tempfile::tempdir().unwrap();
    let out = Command::new(common::bench_binary("rdram-bench"))
        .args([
            "--server",
            &server.addr,
            "--ops",
            "get,put",
            "--sizes",
            "8,300000",
            "--count",
            "200",
            "--warmup",
            "0",
            "--poll",
            "adaptive",
        ])
        .args(["--out", plots.path().to_str().unwrap()])
        .env_remove("UCX_TLS")
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .unwrap();
    assert!(out.status.success(), "rdram-bench failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        common::wait_until(Duration::from_secs(10), || server.shard_metric("rdram_worker_recycles_total", 0) >= 1),
        "the departed client's endpoint was not stranded: it did not come over shared memory"
    );
    assert_eq!(server.stop().and_then(|s| s.code()), Some(0), "the server did not shut down cleanly");
}

/// The CPUs a task may run on, as `/proc` lists them (`Cpus_allowed_list`).
fn cpus_allowed(task: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{task}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string()
}

/// The `/proc` paths of a server process's worker threads.
fn shard_threads(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    let paths = tasks.map(|t| format!("{pid}/task/{}", t.unwrap().file_name().to_string_lossy()));
    paths
        .filter(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.starts_with("rdram-shard-")))
        .collect()
}

/// Workers run wherever the process may run unless cores are given, so that servers which
/// share a host never pile onto one core (each would wait out the other's adaptive spin);
/// `--cores` pins each worker, in order; a core the process may not use is refused at start.
#[test]
fn workers_are_pinned_only_to_the_cores_given() {
    common::init(common::SHM);
    let own = cpus_allowed("self");
    let server = ServerProc::start(&[]);
    let threads = shard_threads(server.child.id());
    assert_eq!(threads.len(), 2, "{threads:?}");
    for t in &threads {
        assert_eq!(cpus_allowed(t), own, "{t}: a worker was pinned without --cores");
    }
    drop(server);

    let first: usize = own.split([',', '-']).next().unwrap().parse().unwrap();
    let server = ServerProc::start(&["--cores", &first.to_string()]);
    let threads = shard_threads(server.child.id());
    assert_eq!(threads.len(), 2, "{threads:?}");
    for t in &threads {
        assert_eq!(cpus_allowed(t), first.to_string(), "{t}: not pinned to --cores {first}");
    }
    drop(server);

    let out = std::process::Command::new(common::RDRAM)
        .args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off", "--cores", "100000"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a core out of reach must not start a server");
    assert!(stderr.contains("core 100000 is not one this process may run on"), "{stderr}");
}
