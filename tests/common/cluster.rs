//! What the cluster tests share: a real etcd process on free loopback ports, with a data
//! directory of its own; `rdram serve --cluster` members; the placement as `rdram cluster
//! status` prints it.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use remote_dram::{Client, ClientOptions};

use super::{rdram, wait_until, ServerProc};

/// An etcd server on free loopback ports, with a data directory of its own.
pub struct Etcd {
    pub child: Child,
    pub client_port: u16,
    pub peer_port: u16,
    dir: tempfile::TempDir,
}

/// A loopback port free now, and never handed out before in this process: tests run side
/// by side, and the kernel may offer a port just closed again, so that two etcds started
/// at once could be given the same port.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

impl Etcd {
    pub fn start() -> Etcd {
        let dir = tempfile::tempdir().unwrap();
        Self::start_in(dir, free_port(), free_port())
    }

    pub fn start_in(dir: tempfile::TempDir, client_port: u16, peer_port: u16) -> Etcd {
        Self::start_with(dir, client_port, peer_port, &[])
    }

    /// `tls`: etcd's TLS flags for its client port (none: plain http).
    pub fn start_with(dir: tempfile::TempDir, client_port: u16, peer_port: u16, tls: &[String]) -> Etcd {
        let scheme = if tls.is_empty() { "http" } else { "https" };
        let client = format!("{scheme}://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path())
            .args(tls)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}"), "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (make deps installs Debian's etcd-server)");
        let mut etcd = Etcd { child, client_port, peer_port, dir };
        let up =
            wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(("127.0.0.1", client_port)).is_ok());
        assert!(up, "etcd did not start listening on {client_port}");
        // An etcd that could not bind its ports exits at once; the port may be another's.
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            etcd.child.try_wait().unwrap().is_none(),
            "etcd exited at start (ports {client_port}, {peer_port} taken?)"
        );
        etcd
    }

    pub fn url(&self, name: &str) -> String {
        format!("etcd://127.0.0.1:{}/{name}", self.client_port)
    }

    /// Stops etcd (SIGKILL) and hands back what starts it again where it was.
    pub fn kill(mut self) -> (tempfile::TempDir, u16, u16) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped; each field is read out once.
        unsafe { (std::ptr::read(&this.dir), this.client_port, this.peer_port) }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lease TTL the tests' servers register with.
pub const TTL_MS: u64 = 2000;

pub fn create(url: &str, replicas: u32) {
    let (code, out, err) = rdram(&["cluster", "create", url, "--replicas", &replicas.to_string()], None);
    assert_eq!(code, 0, "cluster create: {err}");
    assert!(String::from_utf8_lossy(&out).contains("created"), "{}", String::from_utf8_lossy(&out));
}

/// `rdram serve --cluster URL` on a free loopback port.
pub fn member(url: &str) -> ServerProc {
    member_with(url, &[])
}

/// Waits (up to 10 s) until each of `servers` holds the placement etcd holds, so that no
/// request a client routes by it is refused as routed by a newer one.
pub fn wait_until_servers_read_placement(url: &str, servers: &[ServerProc]) {
    let version = status(url)["placement"]["version"].as_u64().unwrap();
    for server in servers {
        let mut direct = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        let mut held = || direct.stats().unwrap()["servers"][0]["shards"][0]["placement_version"].as_u64();
        let read = wait_until(Duration::from_secs(10), || held() == Some(version));
        assert!(read, "{} holds placement version {:?}, etcd {version}", server.addr, held());
    }
}

pub fn member_with(url: &str, args: &[&str]) -> ServerProc {
    let ttl = TTL_MS.to_string();
    let mut all = vec!["--workers", "1", "--cluster", url, "--lease-ttl-ms", &ttl];
    all.extend_from_slice(args);
    ServerProc::start(&all)
}

pub fn status(url: &str) -> serde_json::Value {
    let (code, out, err) = rdram(&["cluster", "status", url], None);
    assert_eq!(code, 0, "cluster status: {err}");
    serde_json::from_slice(&out).unwrap()
}

pub fn members(url: &str) -> Vec<String> {
    status(url)["members"].as_array().unwrap().iter().map(|m| m["address"].as_str().unwrap().to_string()).collect()
}

pub fn client(url: &str) -> Client {
    Client::connect(url, ClientOptions { timeout: Duration::from_secs(10), ..Default::default() }).unwrap()
}

pub fn placement(url: &str) -> (u64, Vec<String>, bool) {
    let p = &status(url)["placement"];
    let members = p["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_string()).collect();
    (p["epoch"].as_u64().unwrap(), members, p["next"].is_null())
}

/// Waits (up to 30 s) until the placement holds `n` members and no keys move; fails the
/// test with the cluster's status otherwise.
pub fn wait_until_placed(url: &str, n: usize) {
    let placed = wait_until(Duration::from_secs(30), || {
        let (_, members, settled) = placement(url);
        settled && members.len() == n
    });
    assert!(placed, "{n} members were not placed: {}", status(url));
}
