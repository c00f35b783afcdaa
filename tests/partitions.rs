//! Partitions, not only pauses: etcd, three `rdram serve --cluster` members (R = 2) and
//! the clients each on a host of the test's own (a network namespace), with a link (a veth
//! pair) between every two of them, cut with `ip link set … down` and put back. The
//! servers run libfabric `tcp;ofi_rxm`: a network transport, since shared memory ignores
//! network namespaces. (Not UCX tcp: the clients run on a thread moved into the client
//! host's namespace, where UCX, which lists devices from /sys, sees the outer host's.) While a link is cut, a writer puts ever larger numbers to a set of
//! keys and a reader checks that no read goes back: below a write acknowledged before the
//! read started, or below what it read of the key before. Afterwards every key reads its
//! last acknowledged write or a later one.
//!
//! Needs root (network namespaces) and iproute2 (`make deps` installs it).
mod common;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{rdram, wait_until, ServerProc, RDRAM};
use remote_dram::cluster::{Placement, Routing};
use remote_dram::{Client, ClientOptions};

/// The members' lease TTL.
const TTL: Duration = Duration::from_secs(3);
const ETCD: &str = "etcd";
const CLIENT: &str = "client";
const SERVERS: [&str; 3] = ["a", "b", "c"];

/// Hosts of the test's own: a network namespace each, with its address on its loopback
/// device and a veth pair to every other host (a route per peer through it), so that the
/// link between two hosts is cut without touching the others. Removed when dropped.
struct Net {
    prefix: String,
    hosts: Vec<&'static str>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Net {
    /// None, with the reason, where this machine lets the test make no namespace.
    fn new(hosts: &[&'static str]) -> Result<Net, String> {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        Self::remove_leftovers();
        let prefix = format!("rdram-{}-{}", std::process::id(), MADE.fetch_add(1, Ordering::SeqCst));
        let mut net = Net { prefix, hosts: Vec::new() };
        for host in hosts {
            let ns = net.ns(host);
            // The one step that tells whether this machine lets the test make namespaces.
            ip(&["netns", "add", &ns])?;
            net.hosts.push(host);
            ip(&["-n", &ns, "link", "set", "lo", "up"]).unwrap();
            ip(&["-n", &ns, "addr", "add", &format!("{}/32", net.addr(host)), "dev", "lo"]).unwrap();
        }
        for (i, a) in hosts.iter().enumerate() {
            for b in &hosts[i + 1..] {
                let (to_b, to_a) = (format!("to-{b}"), format!("to-{a}"));
                ip(&[
                    "-n",
                    &net.ns(a),
                    "link",
                    "add",
                    &to_b,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &to_a,
                    "netns",
                    &net.ns(b),
                ])
                .unwrap();
                net.heal(a, b);
            }
        }
        Ok(net)
    }

    /// Namespaces a test process that died left (their process is gone).
    fn remove_leftovers() {
        let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or_default();
            let pid = name.strip_prefix("rdram-").and_then(|rest| rest.split('-').next());
            if pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }

    fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    fn addr(&self, host: &str) -> String {
        let i = self.hosts.iter().position(|h| *h == host).expect("a host of this net");
        format!("10.99.0.{}", i + 1)
    }

    fn link_up(&self, from: &str, to: &str) {
        let (ns, dev) = (self.ns(from), format!("to-{to}"));
        ip(&["-n", &ns, "link", "set", &dev, "up"]).unwrap();
        let (peer, local) = (format!("{}/32", self.addr(to)), self.addr(from));
        ip(&["-n", &ns, "route", "replace", &peer, "dev", &dev, "src", &local]).unwrap();
    }

    /// Cuts the link between two hosts, both ways.
    fn cut(&self, a: &str, b: &str) {
        ip(&["-n", &self.ns(a), "link", "set", &format!("to-{b}"), "down"]).unwrap();
        ip(&["-n", &self.ns(b), "link", "set", &format!("to-{a}"), "down"]).unwrap();
    }

    /// Puts the link between two hosts (back) up, with their routes through it.
    fn heal(&self, a: &str, b: &str) {
        self.link_up(a, b);
        self.link_up(b, a);
    }

    /// A command that runs `program` on `host`.
    fn on(&self, host: &str, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns(host), program]);
        cmd
    }

    /// Moves the calling thread onto `host`: the sockets it opens from now on, and the
    /// threads and processes it starts, are there.
    fn enter(&self, host: &str) {
        let ns = std::fs::File::open(format!("/run/netns/{}", self.ns(host))).expect("the namespace's file");
        // SAFETY: setns with a namespace fd this thread holds open; it moves this thread only.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns into {}: {}", self.ns(host), std::io::Error::last_os_error());
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A veth pair goes with either of its namespaces.
        for host in &self.hosts {
            let _ = ip(&["netns", "del", &self.ns(host)]);
        }
    }
}

/// Where this machine cannot make namespaces the test says so and is skipped (as root
/// with iproute2, which CI has, it runs).
fn net_or_skip(test: &str) -> Option<Net> {
    let mut hosts = vec![ETCD, CLIENT];
    hosts.extend(SERVERS);
    match Net::new(&hosts) {
        Ok(net) => Some(net),
        Err(why) if !std::path::Path::new("/usr/sbin/ip").exists() && !std::path::Path::new("/sbin/ip").exists() => {
            common::missing_prerequisite(test, &format!("iproute2's `ip` ({why})"));
            None
        }
        Err(why) => {
            common::skipped(test, &format!("this machine lets it make no network namespace ({why}); it needs root"));
            None
        }
    }
}

/// The cluster on the net: etcd on its host, a member on each server host, the calling
/// thread on the client host.
struct Cluster {
    members: Vec<ServerProc>,
    etcd: Child,
    _data: tempfile::TempDir,
    url: String,
    net: Net,
}

impl Cluster {
    fn start(net: Net, member_env: &[(&str, &str)]) -> Cluster {
        common::init(common::FABRIC_TCP);
        net.enter(CLIENT);
        let data = tempfile::tempdir().unwrap();
        let (client_url, peer_url) =
            (format!("http://{}:2379", net.addr(ETCD)), format!("http://{}:2380", net.addr(ETCD)));
        let etcd = net
            .on(ETCD, "etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(data.path())
            .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}"), "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (make deps installs Debian's etcd-server)");
        let etcd_addr = format!("{}:2379", net.addr(ETCD));
        let up = wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(&etcd_addr).is_ok());
        assert!(up, "etcd did not start listening on {etcd_addr}");
        let url = format!("etcd://{etcd_addr}/partitions");
        let (code, _, err) = rdram(&["cluster", "create", &url, "--replicas", "2"], None);
        assert_eq!(code, 0, "cluster create: {err}");
        let ttl = TTL.as_millis().to_string();
        let members = SERVERS
            .iter()
            .map(|host| {
                let mut cmd = net.on(host, RDRAM);
                cmd.args(["serve", "--listen", &format!("{}:7000", net.addr(host)), "--workers", "1"]);
                cmd.args([
                    "--memory",
                    "64MiB",
                    "--hugepages",
                    "off",
                    "--transport",
                    "fabric",
                    "--provider",
                    "tcp;ofi_rxm",
                ]);
                cmd.args(["--cluster", &url, "--lease-ttl-ms", &ttl]);
                cmd.envs(member_env.iter().copied());
                ServerProc::spawn_listening(cmd)
            })
            .collect();
        let cluster = Cluster { members, etcd, _data: data, url, net };
        let placed = wait_until(Duration::from_secs(30), || {
            let (members, settled) = cluster.placement();
            settled && members.len() == SERVERS.len()
        });
        assert!(placed, "the three members were never placed: {:?}", cluster.placement());
        cluster
    }

    /// The placement's members and whether no key is moving.
    fn placement(&self) -> (Vec<String>, bool) {
        let (code, out, err) = rdram(&["cluster", "status", &self.url], None);
        assert_eq!(code, 0, "cluster status: {err}");
        let status: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let p = &status["placement"];
        let members = p["members"]
            .as_array()
            .map_or(Vec::new(), |m| m.iter().filter_map(|m| m.as_str().map(str::to_string)).collect());
        (members, p["next"].is_null())
    }

    fn routing(&self) -> Routing {
        let (code, out, err) = rdram(&["cluster", "status", &self.url], None);
        assert_eq!(code, 0, "cluster status: {err}");
        let status: serde_json::Value = serde_json::from_slice(&out).unwrap();
        Routing::new(serde_json::from_value::<Placement>(status["placement"].clone()).unwrap())
    }

    fn member_addr(&self, host: &str) -> String {
        format!("{}:7000", self.net.addr(host))
    }

    fn client(&self, timeout: Duration) -> Client {
        Client::connect(&self.url, ClientOptions { timeout, ..Default::default() }).expect("a client of the cluster")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Members leave (deregister from etcd) before etcd goes; the namespaces go last.
        self.members.clear();
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
    }
}

/// What the writer and the reader did, and what the reader found wrong.
#[derive(Default)]
struct History {
    /// Per key, the latest write acknowledged (writes are numbered, ever larger).
    acked: HashMap<String, u64>,
    /// When each key's writes were acknowledged, from the start of the load.
    acked_at: HashMap<String, Vec<Duration>>,
    /// Writes whose outcome the writer could not learn (taken or not).
    unsure: HashMap<String, Vec<u64>>,
    /// Reads that went back in time, or read what no one wrote.
    wrong: Vec<String>,
    /// Reads answered, per key, and when.
    read_at: HashMap<String, Vec<Duration>>,
    failed_reads: u64,
    failed_writes: u64,
}

/// A writer and a reader on the client host per group of keys, until stopped: a group
/// whose primary is cut off waits without holding the others up.
struct Load {
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    started: Instant,
}

/// A write's value: the key and the write's number.
fn value(key: &str, n: u64) -> Vec<u8> {
    format!("{key}={n}").into_bytes()
}

/// The number a value read from `key` holds; None if it is not a value written to it.
fn number(key: &str, v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.strip_prefix(key)?.strip_prefix('=')?.parse().ok()
}

impl Load {
    /// Threads started from the client host's thread run on that host.
    fn start(cluster: &Cluster, groups: &[&[String]]) -> Load {
        let mut load =
            Load { history: Arc::default(), stop: Arc::default(), threads: Vec::new(), started: Instant::now() };
        for keys in groups {
            let writer = cluster.client(Duration::from_millis(1500));
            let reader = cluster.client(Duration::from_millis(1500));
            load.write(writer, keys.to_vec());
            load.read(reader, keys.to_vec());
        }
        load
    }

    fn write(&mut self, mut c: Client, keys: Vec<String>) {
        let (history, stop, started) = (self.history.clone(), self.stop.clone(), self.started);
        self.threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let key = &keys[n as usize % keys.len()];
                let result = c.put(key.as_bytes(), &value(key, n));
                let mut h = history.lock().unwrap();
                match result {
                    Ok(_) => {
                        h.acked.insert(key.clone(), n);
                        h.acked_at.entry(key.clone()).or_default().push(started.elapsed());
                    }
                    Err(_) => {
                        h.failed_writes += 1;
                        h.unsure.entry(key.clone()).or_default().push(n);
                    }
                }
            }
        }));
    }

    fn read(&mut self, mut c: Client, keys: Vec<String>) {
        let (history, stop, started) = (self.history.clone(), self.stop.clone(), self.started);
        self.threads.push(std::thread::spawn(move || {
            let mut seen: HashMap<String, u64> = HashMap::new();
            for key in keys.iter().cycle() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let floor = history.lock().unwrap().acked.get(key).copied().unwrap_or(0);
                let result = c.get(key.as_bytes());
                let mut h = history.lock().unwrap();
                let Ok(v) = result else {
                    h.failed_reads += 1;
                    continue;
                };
                let got = match v {
                    None => 0,
                    Some(v) => number(key, &v.data).unwrap_or_else(|| {
                        h.wrong.push(format!(
                            "{key} read {:?}, which no one wrote to it",
                            String::from_utf8_lossy(&v.data)
                        ));
                        0
                    }),
                };
                let before = seen.get(key).copied().unwrap_or(0).max(floor);
                if got < before {
                    h.wrong.push(format!("{key} read {got} after {before} was acknowledged or read"));
                }
                seen.insert(key.clone(), got.max(before));
                h.read_at.entry(key.clone()).or_default().push(started.elapsed());
            }
        }));
    }

    fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    fn finish(self) -> History {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().unwrap();
        }
        Arc::try_unwrap(self.history).ok().unwrap().into_inner().unwrap()
    }
}

/// Once the links are whole: every key reads its last acknowledged write, or a later one
/// whose outcome its writer did not learn; and the history held no read that went back.
fn check(cluster: &Cluster, keys: &[String], h: &History) {
    assert!(h.wrong.is_empty(), "reads went back: {:?}", &h.wrong[..h.wrong.len().min(10)]);
    let mut c = cluster.client(Duration::from_secs(10));
    for key in keys {
        let acked = h.acked.get(key).copied().unwrap_or(0);
        let got = c.get(key.as_bytes()).unwrap_or_else(|e| panic!("{key} after the links were put back: {e}"));
        let got = got.map_or(0, |v| number(key, &v.data).expect("a value written to the key"));
        let unsure = h.unsure.get(key).map_or(&[][..], |u| u.as_slice());
        assert!(
            got == acked || (got > acked && unsure.contains(&got)),
            "{key} reads {got}: the last acknowledged write was {acked}, unsure ones {unsure:?}"
        );
    }
    let acked: usize = h.acked_at.values().map(Vec::len).sum();
    let read: usize = h.read_at.values().map(Vec::len).sum();
    eprintln!("{acked} writes acknowledged ({} failed), {read} reads ({} failed)", h.failed_writes, h.failed_reads);
}

/// `count` keys whose primary is `host`'s member, and as many whose primary is another's.
fn keys_split(cluster: &Cluster, host: &str, count: usize) -> (Vec<String>, Vec<String>) {
    let routing = cluster.routing();
    let addr = cluster.member_addr(host);
    let (mut its, mut others) = (Vec::new(), Vec::new());
    for i in 0.. {
        let key = format!("p/{i}");
        let mine = routing.owner(key.as_bytes()) == Some(addr.as_str());
        match mine {
            true if its.len() < count => its.push(key),
            false if others.len() < count => others.push(key),
            _ => {}
        }
        if its.len() == count && others.len() == count {
            break;
        }
    }
    (its, others)
}

/// A key's writes acknowledged within `from..to` of the load's start.
fn acked_within(h: &History, key: &str, from: Duration, to: Duration) -> usize {
    h.acked_at.get(key).map_or(0, |at| at.iter().filter(|t| (from..to).contains(t)).count())
}

/// A cluster on the test's hosts under load for a second: keys whose primary is host "a"'s
/// member (`its`) and as many others, a writer and a reader on each group. None where the
/// test is skipped.
struct Loaded {
    cluster: Cluster,
    its: Vec<String>,
    others: Vec<String>,
    keys: Vec<String>,
    load: Load,
}

fn loaded(test: &str, member_env: &[(&str, &str)]) -> Option<Loaded> {
    let cluster = Cluster::start(net_or_skip(test)?, member_env);
    let (its, others) = keys_split(&cluster, "a", 6);
    let keys = its.iter().chain(&others).cloned().collect();
    let load = Load::start(&cluster, &[&its, &others]);
    std::thread::sleep(Duration::from_secs(1));
    Some(Loaded { cluster, its, others, keys, load })
}

/// A primary cut off from etcd, not from its clients or the other members: it stops taking
/// writes before its lease can have lapsed at etcd (after that the others take its keys),
/// so no write it took is lost; its keys are written again through the others once the
/// placement has moved on, before the link comes back; and when it does, it joins again.
#[test]
fn a_primary_cut_off_from_etcd_loses_no_write() {
    let Some(Loaded { cluster, its, keys, load, .. }) = loaded("a_primary_cut_off_from_etcd_loses_no_write", &[])
    else {
        return;
    };
    let cut = load.elapsed();
    cluster.net.cut("a", ETCD);
    // Its lease lapses a TTL after its last renewal; the others then propose a placement
    // without it, and clients follow.
    std::thread::sleep(TTL + Duration::from_secs(4));
    let healed = load.elapsed();
    cluster.net.heal("a", ETCD);
    let rejoined = wait_until(Duration::from_secs(30), || {
        let (members, settled) = cluster.placement();
        settled && members.len() == SERVERS.len()
    });
    std::thread::sleep(Duration::from_millis(500));
    let h = load.finish();
    assert!(rejoined, "the member cut off from etcd did not join again: {:?}", cluster.placement());
    check(&cluster, &keys, &h);
    for key in &its {
        assert!(
            acked_within(&h, key, cut + TTL, healed) > 0,
            "{key} (its primary cut off) was not written through the others before the link came back"
        );
    }
}

/// A primary cut off from its clients, not from etcd or the other members: it stays in
/// the placement, so its keys' writes wait for the link; their reads are served by the
/// keys' other replicas; and nothing acknowledged is lost or read back in time.
#[test]
fn a_primary_cut_off_from_its_clients_loses_no_write() {
    let Some(Loaded { cluster, its, others, keys, load }) =
        loaded("a_primary_cut_off_from_its_clients_loses_no_write", &[])
    else {
        return;
    };
    let cut = load.elapsed();
    cluster.net.cut("a", CLIENT);
    std::thread::sleep(TTL + Duration::from_secs(1));
    let healed = load.elapsed();
    cluster.net.heal("a", CLIENT);
    std::thread::sleep(Duration::from_secs(4));
    let h = load.finish();
    check(&cluster, &keys, &h);
    for key in &others {
        assert!(
            acked_within(&h, key, cut + Duration::from_secs(2), healed) > 0,
            "{key} was not written during the cut"
        );
    }
    for key in &its {
        let reads = h
            .read_at
            .get(key)
            .map_or(0, |at| at.iter().filter(|t| (cut + Duration::from_secs(2)..healed).contains(t)).count());
        assert!(reads > 0, "{key} (its primary cut off from the clients) was not read from its other replica");
        assert!(
            acked_within(&h, key, healed + Duration::from_secs(2), Duration::MAX) > 0,
            "{key} not written after the link came back"
        );
    }
}

/// A replica cut off from its primary while the primary copies writes to it (copies held
/// 200 ms by a test hook, so that many are in flight): the writes wait, none is read before
/// the replica holds it, and once the link is back they complete; then the primary is
/// SIGKILLed and the survivors hold everything acknowledged or read.
#[test]
fn a_replica_cut_off_from_its_primary_mid_copy_loses_no_write() {
    let hold = [(remote_dram::cluster::replication::TEST_COPY_DELAY_ENV, "200")];
    let Some(Loaded { mut cluster, keys, load, .. }) =
        loaded("a_replica_cut_off_from_its_primary_mid_copy_loses_no_write", &hold)
    else {
        return;
    };
    cluster.net.cut("a", "b");
    std::thread::sleep(Duration::from_secs(3));
    cluster.net.heal("a", "b");
    std::thread::sleep(Duration::from_secs(2));
    cluster.members[0].kill();
    let moved = wait_until(Duration::from_secs(30), || {
        let (members, settled) = cluster.placement();
        settled && members.len() == 2
    });
    std::thread::sleep(Duration::from_millis(500));
    let h = load.finish();
    assert!(moved, "the placement did not move on without the killed primary: {:?}", cluster.placement());
    check(&cluster, &keys, &h);
}
