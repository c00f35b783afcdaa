//! What a server exposes to peers that have not authenticated, played by an attacker on
//! loopback: which ports it listens on (read from /proc, never by connecting elsewhere),
//! sockets that connect and stay silent or send one byte, floods under a lowered file
//! descriptor limit, idle connections held on the metrics port, and clients that never
//! take their replies. The server must keep serving its real clients throughout, and
//! stop cleanly at once afterwards.
mod common;

use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{rdram, ServerProc, RDRAM};
use remote_dram::client::KeyRange;

/// The attacker's source address: loopback, but not the one real clients use, so that
/// per-address bounds can be told apart from overall ones. Traffic still goes to 127.0.0.1.
const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A TCP connection to `to` from `from` (port chosen by the kernel).
fn connect_from(from: Ipv4Addr, to: &str) -> std::io::Result<TcpStream> {
    let to: SocketAddrV4 = to.parse().expect("an IPv4 address");
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor owned by `fd` from its creation on.
    unsafe {
        let raw = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(raw);
        let local = sockaddr(SocketAddrV4::new(from, 0));
        if libc::bind(raw, &local as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sockaddr(to);
        if libc::connect(raw, &remote as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(TcpStream::from(fd))
    }
}

/// The TCP sockets process `pid` listens on, as `ip:port`.
fn listeners(pid: u32) -> Vec<String> {
    let mut found: Vec<String> = common::tcp_sockets(pid)
        .into_iter()
        .filter(|s| s.state == "0A")
        .map(|s| {
            let (ip, port) = s.local.split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            let ip = if ip.len() == 8 {
                Ipv4Addr::from(u32::from_str_radix(ip, 16).unwrap().swap_bytes()).to_string()
            } else {
                format!("[{ip}]") // IPv6, raw: any such listener is a failure below
            };
            format!("{ip}:{port}")
        })
        .collect();
    found.sort();
    found
}

/// `rdram serve` on 127.0.0.1 with UCX left to its defaults (no UCX_TLS, no
/// UCX_NET_DEVICES, no opt-in from the environment), plus `args`; `shell` runs before it
/// (e.g. a lower fd limit).
fn default_server(args: &[&str], shell: &str) -> ServerProc {
    let mut serve =
        format!("{shell} exec {RDRAM} serve --listen 127.0.0.1:0 --workers 2 --memory 64MiB --hugepages off");
    for a in args {
        serve.push_str(&format!(" '{a}'"));
    }
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &serve]).env_remove("UCX_TLS").env_remove("UCX_NET_DEVICES").env_remove("RDRAM_UCX_TCP");
    ServerProc::spawn_listening(cmd)
}

/// By default a UCX server runs no UCX tcp transport: the only port it listens on is its
/// bootstrap port, on the --listen address, and clients on this host are served (over
/// shared memory). With --ucx-tcp, UCX's tcp listeners bind to the --listen interface too,
/// not to every interface of the machine.
#[test]
fn a_default_server_listens_on_its_bootstrap_port_only() {
    common::init(common::SHM);
    let server = default_server(&[], "");
    assert_eq!(
        listeners(server.child.id()),
        vec![server.addr.clone()],
        "a default server listens on its bootstrap port alone"
    );
    let (put, _, err) = rdram(&["put", "--server", &server.addr, "k", "v"], None);
    assert_eq!(put, 0, "{err}");
    let (get, out, err) = rdram(&["get", "--server", &server.addr, "k"], None);
    assert_eq!((get, out.as_slice()), (0, &b"v"[..]), "{err}");

    let trusted = default_server(&["--ucx-tcp"], "");
    let open = listeners(trusted.child.id());
    assert!(open.len() > 1, "--ucx-tcp opens UCX's tcp listeners: {open:?}");
    assert!(open.iter().all(|l| l.starts_with("127.0.0.1:")), "every listener on the --listen interface: {open:?}");
}

/// A server whose environment enables UCX's tcp transport without the opt-in refuses to
/// start, and says what to do.
#[test]
fn ucx_tcp_without_the_opt_in_is_refused_at_start() {
    common::init(common::SHM);
    let out = Command::new(RDRAM)
        .args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off"])
        .env("UCX_TLS", "tcp")
        .env_remove("RDRAM_UCX_TCP")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--ucx-tcp"), "{err}");
}

/// 64 sockets from one address, each sending one byte of a handshake and no more, do not
/// take every handshake place: the server holds the newest 8 of them (its bound per
/// source), cuts the rest, and real clients from another address connect meanwhile.
#[test]
fn one_byte_handshake_holders_do_not_lock_others_out() {
    use remote_dram::server::tunables::MAX_HANDSHAKES_PER_SOURCE;
    common::init(common::SHM);
    let server = ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut s = connect_from(ATTACKER, &server.addr).unwrap();
        let _ = std::io::Write::write_all(&mut s, b"{");
        held.push(s);
    }
    let cut = r#"rdram_handshakes_total{outcome="refused",reason="capacity"}"#;
    assert!(
        common::wait_until(Duration::from_secs(2), || server.metric(cut) == (64 - MAX_HANDSHAKES_PER_SOURCE) as u64),
        "the server took the 64 sockets and cut all but the newest {MAX_HANDSHAKES_PER_SOURCE}: {} cut",
        server.metric(cut)
    );
    assert_eq!(server.metric("rdram_handshakes_in_progress{}"), MAX_HANDSHAKES_PER_SOURCE as u64, "the rest are held");
    for i in 0..20 {
        let (code, _, err) = rdram(&["ls", "--server", &server.addr], None);
        assert_eq!(code, 0, "rdram ls #{i} while 64 handshakes are held from {ATTACKER}: {err}");
    }
    drop(held);
}

/// Silent connections flood a libfabric tcp server under a lowered fd limit (its
/// provider's port accepts them and never lets go): the client connected before keeps
/// being served, a new client is refused with a clear reason instead of timing out,
/// and SIGTERM stops the server at once with status 0.
#[test]
fn a_server_out_of_descriptors_serves_its_clients_refuses_new_ones_and_stops() {
    common::init(common::SHM);
    // The flood needs descriptors of its own in this process.
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let mut server =
        default_server(&["--transport", "fabric", "--provider", "tcp;ofi_rxm", "--workers", "1"], "ulimit -n 256;");
    let mut established = server.client();
    established.put(b"before", b"flood").unwrap();
    let pid = server.child.id();
    let ports: Vec<String> = listeners(pid).into_iter().filter(|l| *l != server.addr).collect();
    assert!(!ports.is_empty(), "libfabric's tcp provider listens on a port of its own");
    let mut flood = Vec::new();
    'flood: for round in 0..400 {
        for port in &ports {
            match connect_from(ATTACKER, port) {
                Ok(s) => flood.push(s),
                Err(e) => panic!("connection {round} to {port}: {e}"),
            }
            if flood.len() >= 300 {
                break 'flood;
            }
        }
    }
    let open = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    common::wait_until(Duration::from_secs(5), || open() >= 256 - remote_dram::server::tunables::FD_HEADROOM);
    let open = open();
    assert!(
        open >= 256 - remote_dram::server::tunables::FD_HEADROOM,
        "the flood took the server's descriptors ({open} open of 256)"
    );
    assert_eq!(established.get(b"before").unwrap().unwrap().data, b"flood", "the established client is served");
    established.put(b"during", b"flood").unwrap();
    let started = Instant::now();
    let (code, _, err) = rdram(&["ls", "--server", &server.addr], None);
    assert_ne!(code, 0, "a new client cannot be served without descriptors");
    assert!(err.contains("out of file descriptors"), "a new client is told why: {err}");
    assert!(started.elapsed() < Duration::from_secs(5), "refused at once, not at a timeout ({:?})", started.elapsed());
    drop(established);
    let started = Instant::now();
    let status = server.stop().expect("the server stops on SIGTERM");
    let took = started.elapsed();
    assert!(status.success(), "exit status {status} after SIGTERM");
    assert!(took < Duration::from_secs(2), "stopped {took:?} after SIGTERM");
    drop(flood);
}

/// Idle connections held open on the metrics port (reopened as they are cut) do not keep
/// a scraper out.
#[test]
fn idle_connections_do_not_hold_the_metrics_endpoint_shut() {
    common::init(common::SHM);
    let server = ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let metrics = server.metrics.clone().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // How many idle connections the holder has open, as it last counted.
    let holding = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let holder = {
        let (stop, metrics, holding) = (stop.clone(), metrics.clone(), holding.clone());
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Keep 32 idle connections, replacing those the endpoint cut.
                held.retain(|s| {
                    let mut b = [0u8; 1];
                    s.set_nonblocking(true).unwrap();
                    !matches!(std::io::Read::read(&mut &*s, &mut b), Ok(0))
                });
                while held.len() < 32 {
                    match connect_from(ATTACKER, &metrics) {
                        Ok(s) => held.push(s),
                        Err(_) => break,
                    }
                }
                holding.store(held.len(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let all_held = || holding.load(std::sync::atomic::Ordering::Relaxed) == 32;
    assert!(common::wait_until(Duration::from_secs(5), all_held), "the holder never had its 32 idle connections open");
    for i in 0..20 {
        let body = server.scrape();
        assert!(
            body.contains("rdram_keys"),
            "scrape #{i} while idle connections are held came back without metrics: {body:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    holder.join().unwrap();
}

/// Six clients that ask for ~1 MiB LIST replies and never take them hold at most the
/// server's one reply budget (plus one reply each per shard, which a client that is not
/// yet behind is always given), not six times each client's own bound; the held bytes
/// show in stats and metrics, and other clients are served.
#[test]
fn clients_that_never_read_share_one_reply_budget() {
    common::init(common::SHM);
    let budget: u64 = 16 << 20;
    let server = ServerProc::start(&[
        "--workers",
        "2",
        "--memory",
        "256MiB",
        "--reply-budget",
        "16MiB",
        "--metrics",
        "127.0.0.1:0",
    ]);
    let mut c = server.client();
    let long_key = |i: u32| [&i.to_be_bytes()[..], &[b'k'; (64 << 10) - 4]].concat();
    for i in 0..48 {
        c.put(&long_key(i), b"v").unwrap();
    }
    let mut hogs: Vec<_> = (0..6).map(|_| server.client()).collect();
    for hog in &mut hogs {
        for shard in 0..2 {
            for _ in 0..40 {
                common::list_without_reading(hog, shard);
            }
        }
    }
    let reaches_the_budget = || server.metric("rdram_reply_backlog_bytes{}") >= budget / 2;
    common::wait_until(Duration::from_secs(10), reaches_the_budget);
    let held = server.metric("rdram_reply_backlog_bytes{}");
    assert!(held >= budget / 2, "the hogs' replies are held ({held} bytes): the test reaches the budget");
    let one_reply_each = 6 * 2 * (1 << 20) + (64 << 10) * 12;
    assert!(held <= budget + one_reply_each, "{held} bytes held for clients that never read, budget {budget}");
    assert_eq!(c.list(&KeyRange::prefix(b"")).unwrap().len(), 48, "others are served");
    let stats = c.stats().unwrap();
    let in_stats = stats["servers"][0]["shards"][0]["reply_backlog_bytes"].as_u64().unwrap_or(0);
    assert!(in_stats > 0, "stats show the held bytes: {stats}");
    drop(hogs);
}
