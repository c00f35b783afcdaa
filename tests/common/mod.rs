//! Test harness: real `rdram serve` processes on ephemeral loopback ports, real UCX or
//! libfabric.
#![allow(dead_code)]

pub mod cluster;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use remote_dram::{Client, ClientOptions};

pub const RDRAM: &str = env!("CARGO_BIN_EXE_rdram");

/// A test whose prerequisite (a program `make deps` installs) is missing: skipped, visibly,
/// on a developer's machine; under CI (`CI` set), which must have it, a failure.
pub fn missing_prerequisite(test: &str, what: &str) {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(!ci, "{test}: {what}, and CI must have it");
    skipped(test, what);
}

/// Names the file where skipped tests are listed; `make test-rust` sets it, empties it
/// first and prints it after the tests (cargo shows no output of a test that passed).
pub const SKIPS_FILE_ENV: &str = "RDRAM_TEST_SKIPS_FILE";

/// Says that `test` (or a part of it, named so) skipped what this machine cannot do, and
/// why: on stderr, and in the file [`SKIPS_FILE_ENV`] names.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    let Some(path) = std::env::var_os(SKIPS_FILE_ENV) else { return };
    let file = std::fs::OpenOptions::new().create(true).append(true).open(&path);
    if let Err(e) = file.and_then(|mut f| writeln!(f, "{line}")) {
        eprintln!("cannot note the skip in {}: {e}", std::path::Path::new(&path).display());
    }
}

/// A TCP socket process `pid` holds, as the kernel's table (/proc/PID/net/tcp{,6}) gives
/// it: addresses as hex `IP:PORT` (IPv4 in network order read as a little-endian word:
/// 127.0.0.1 is `0100007F`), state as hex (`01` established, `0A` listening).
pub struct TcpSocket {
    pub local: String,
    pub remote: String,
    pub state: String,
}

/// The TCP sockets of process `pid`: its descriptors (/proc/PID/fd) matched by inode with
/// the kernel's tables of its network namespace.
pub fn tcp_sockets(pid: u32) -> Vec<TcpSocket> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| Some(l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_string()))
        .collect();
    let mut found = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() >= 10 && inodes.contains(f[9]) {
                found.push(TcpSocket { local: f[1].into(), remote: f[2].into(), state: f[3].into() });
            }
        }
    }
    found
}

/// A load generator of the `rdram-bench` package (bench/), built next to `rdram` by
/// `cargo build` in the tests' profile (make test-rust builds it before the tests).
pub fn bench_binary(name: &str) -> std::path::PathBuf {
    let path = std::path::Path::new(RDRAM).with_file_name(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo build` in the tests' profile builds it (the workspace's default members; make test-rust does)",
        path.display()
    );
    path
}

pub const TCP: &str = "tcp";
pub const SHM: &str = "posix,sysv,cma,self";
/// libfabric providers: "fabric:" + the provider name `rdram serve` gets.
pub const FABRIC_TCP: &str = "fabric:tcp;ofi_rxm";
pub const FABRIC_SHM: &str = "fabric:shm";
/// tcp;ofi_rxm with EFA's registration discipline (FI_MR_LOCAL) forced on.
pub const FABRIC_TCP_REGISTER_LOCAL: &str = "fabric:tcp;ofi_rxm+register-local";

static INIT: Once = Once::new();
/// Extra `rdram serve` arguments selecting this binary's transport.
static SERVE_ARGS: OnceLock<Vec<String>> = OnceLock::new();

/// Fixes this test binary's transport: a UCX transport list (set before any UCX context
/// exists, UCX kept on the loopback device, inherited by child processes), or
/// "fabric:PROVIDER" for servers on libfabric (clients follow what the server announces).
pub fn init(transport: &str) {
    INIT.call_once(|| {
        std::env::set_var("UCX_NET_DEVICES", "lo");
        // Cluster members (`--cluster`) read the secret they share from here.
        let secret = std::env::temp_dir().join(format!("rdram-test-cluster-secret-{}", std::process::id()));
        std::fs::write(&secret, "a cluster secret for these tests\n").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        std::env::set_var("RDRAM_CLUSTER_SECRET_FILE", &secret);
        match transport.strip_prefix("fabric:") {
            Some(provider) => {
                // "+register-local": every local buffer registered, as EFA (FI_MR_LOCAL) needs.
                let provider = match provider.strip_suffix("+register-local") {
                    Some(p) => {
                        std::env::set_var("RDRAM_FABRIC_REGISTER_LOCAL", "1");
                        p
                    }
                    None => provider,
                };
                let args = ["--transport", "fabric", "--provider", provider];
                SERVE_ARGS.set(args.iter().map(|a| a.to_string()).collect()).unwrap();
            }
            None => {
                std::env::set_var("UCX_TLS", transport);
                if transport == TCP {
                    // UCX's tcp transport is a trusted-network opt-in (docs/security.md).
                    std::env::set_var("RDRAM_UCX_TCP", "1");
                }
            }
        }
    });
}

pub struct ServerProc {
    pub child: Child,
    pub addr: String,
    /// `host:port` of its metrics endpoint, when started with `--metrics`.
    pub metrics: Option<String>,
}

impl ServerProc {
    /// Starts `rdram serve` with `--listen 127.0.0.1:0` plus `args`, and waits for its address.
    pub fn start(args: &[&str]) -> ServerProc {
        Self::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> ServerProc {
        let mut cmd = Command::new(RDRAM);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--workers", "2", "--memory", "64MiB", "--hugepages", "off"]);
        cmd.args(SERVE_ARGS.get().into_iter().flatten()).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::spawn_listening(cmd)
    }

    /// Starts `rdram gateway` on an ephemeral port in front of `server`.
    pub fn gateway(server: &str, args: &[&str]) -> ServerProc {
        let mut cmd = Command::new(RDRAM);
        cmd.args(["gateway", "--listen", "127.0.0.1:0", "--server", server]).args(args);
        Self::spawn_listening(cmd)
    }

    /// Spawns `cmd` and waits for the "listening on ADDR" line it prints when ready.
    pub fn spawn_listening(mut cmd: Command) -> ServerProc {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn rdram");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let (mut addr, mut metrics) = (None, None);
        for line in lines.by_ref() {
            let line = line.expect("read server stdout");
            if let Some(m) = line.strip_prefix("metrics on http://") {
                metrics = m.strip_suffix("/metrics").map(str::to_string);
            }
            if let Some(a) = line.strip_prefix("listening on ") {
                addr = Some(a.trim().to_string());
                break;
            }
        }
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let addr = addr.expect("server printed no address (did it fail to start?)");
        ServerProc { child, addr, metrics }
    }

    /// The server's Prometheus text (it must have been started with `--metrics`).
    pub fn scrape(&self) -> String {
        let url = format!("http://{}/metrics", self.metrics.as_deref().expect("server started without --metrics"));
        ureq::get(&url).timeout(Duration::from_secs(5)).call().unwrap().into_string().unwrap()
    }

    /// A counter or gauge from [`ServerProc::scrape`], `series` its name and labels as
    /// written (`name{label="value"}`; 0 while absent).
    pub fn metric(&self, series: &str) -> u64 {
        let prefix = format!("{series} ");
        self.scrape().lines().find_map(|l| l.strip_prefix(&prefix)?.trim().parse::<u64>().ok()).unwrap_or(0)
    }

    /// A per-shard counter or gauge from [`ServerProc::scrape`] (0 while absent).
    pub fn shard_metric(&self, name: &str, shard: usize) -> u64 {
        self.metric(&format!("{name}{{shard=\"{shard}\"}}"))
    }

    pub fn client(&self) -> Client {
        connect(&self.addr)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServerProc {
    /// SIGTERM, then the exit status: a clean shutdown (stop accepting, let transfers end,
    /// close endpoints, free memory) exits 0 within a few seconds.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        unsafe { libc_kill(self.child.id() as i32, 15) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        // A clean shutdown is part of what every test checks (unless the test killed the
        // server itself, or is already failing).
        let killed = matches!(self.child.try_wait(), Ok(Some(_)));
        let status = self.stop();
        if !killed && !std::thread::panicking() {
            let status = status.expect("the server did not stop within 10 s of SIGTERM");
            assert!(status.success(), "the server exited with {status} after SIGTERM");
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

pub const SIGSTOP: i32 = 19;
pub const SIGCONT: i32 = 18;
pub const SIGKILL: i32 = 9;

/// Sends `sig` to process `pid`.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) takes plain integers.
    assert_eq!(unsafe { libc_kill(pid as i32, sig) }, 0, "kill({pid}, {sig})");
}

/// Stops a process and returns once every thread of it is stopped (a thread busy on
/// another core can still run for a moment after `kill` returns).
pub fn stop_process(pid: u32) {
    signal(pid, SIGSTOP);
    let stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
            tasks.flatten().all(|t| {
                std::fs::read_to_string(t.path().join("stat"))
                    .is_ok_and(|st| st.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('T')))
            })
        })
    };
    assert!(wait_until(std::time::Duration::from_secs(5), stopped), "process {pid} did not stop");
}

pub fn options() -> ClientOptions {
    ClientOptions { timeout: Duration::from_secs(20), ..Default::default() }
}

pub fn connect(addr: &str) -> Client {
    Client::connect(addr, options()).expect("connect")
}

/// Runs the `rdram` command with the given arguments; returns (exit code, stdout, stderr).
pub fn rdram(args: &[&str], stdin: Option<&[u8]>) -> (i32, Vec<u8>, String) {
    use std::io::Write;
    let mut child = Command::new(RDRAM)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rdram");
    if let Some(data) = stdin {
        let mut s = child.stdin.take().unwrap();
        s.write_all(data).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code().unwrap_or(-1), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Deterministic pseudo-random bytes, so readers can check values without sharing them.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Resident memory of a process, in KiB; `None` once it is gone.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Waits until process `pid` holds at least `bytes` resident and has faulted its arenas in
/// whole: a server faults its memory in in the background after it starts listening (on
/// threads named `rdram-fault-in`, which end once done), and a test that measures how its
/// resident size moves starts from there. (Its resident size alone reaches `bytes` while
/// the last of an arena of `bytes` is still to come, as the binary and libraries count.)
pub fn wait_resident(pid: u32, bytes: u64) {
    let faulting_in = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
        tasks
            .flatten()
            .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|name| name.trim() == "rdram-fault-in"))
    };
    let faulted =
        wait_until(Duration::from_secs(60), || rss_kib(pid).is_some_and(|kib| kib << 10 >= bytes) && !faulting_in());
    assert!(faulted, "the server's memory was not faulted in after 60 s: {:?} KiB resident", rss_kib(pid));
}

/// Sends `client` a LIST of every key (up to ~1 MiB of reply) to `shard` without waiting:
/// for tests that play a client that asks and never takes its replies.
pub fn list_without_reading(client: &mut Client, shard: usize) {
    use remote_dram::proto::{flags, Op, RequestHeader, REQUEST_HEADER_LEN};
    let (session, id) = client.raw_session();
    let mut h = RequestHeader::new(Op::List, id, session);
    h.flags = flags::MAX_UNBOUNDED;
    h.ttl_or_limit = 16 << 10;
    let mut buf = [0u8; REQUEST_HEADER_LEN];
    h.encode(&mut buf);
    client.raw_submit(shard, &buf, &[]).unwrap();
}

/// A hand-made request (header from `edit`, the key inline, `value` as payload) to shard 0
/// of the server at `addr`, from a client of its own, as any token holder can send: the
/// status and message of the answer.
pub fn raw_request(
    addr: &str,
    op: remote_dram::proto::Op,
    key: &[u8],
    value: &[u8],
    edit: impl Fn(&mut remote_dram::proto::RequestHeader),
) -> (remote_dram::Status, String) {
    use remote_dram::proto::{RequestHeader, REQUEST_HEADER_LEN};
    let mut c = Client::connect(addr, options()).unwrap();
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(op, id, session);
    h.key_len = key.len() as u32;
    edit(&mut h);
    let mut fixed = [0u8; REQUEST_HEADER_LEN];
    h.encode(&mut fixed);
    c.raw_request(0, &[&fixed[..], key].concat(), value, Duration::from_secs(10)).unwrap()
}
