//! Clusters whose membership lives in etcd: a real etcd process on loopback ports, real
//! `rdram serve --cluster` processes that join, leave and die, and clients given the
//! cluster's `etcd://` string.
mod common;
mod streaming;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::*;
use common::{rdram, wait_until, ServerProc, RDRAM};
use remote_dram::client::KeyRange;
use remote_dram::{Client, ClientOptions, Status};
use streaming::*;

impl Etcd {
    /// An etcd that clients reach over TLS only, showing a certificate `pki`'s CA signed
    /// and asking for a client certificate it signed.
    fn start_tls(pki: &Pki) -> Etcd {
        let tls = [
            "--cert-file",
            &pki.path("server.pem"),
            "--key-file",
            &pki.path("server.key"),
            "--trusted-ca-file",
            &pki.path("ca.pem"),
            "--client-cert-auth",
        ];
        Self::start_with(tempfile::tempdir().unwrap(), free_port(), free_port(), &tls.map(|a| a.to_string()))
    }
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Servers register under leases; a client given the etcd string connects to the live
/// members and follows the set as servers join and leave (SIGTERM deregisters at once);
/// the CLI takes the same string.
#[test]
fn clients_follow_the_member_set_as_servers_join_and_leave() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("pool");
    create(&url, 1);
    let (code, _, err) = rdram(&["cluster", "create", &url], None);
    assert_eq!(code, 1, "a second create fails");
    assert!(err.contains("exists already"), "{err}");

    let a = member(&url);
    let mut b = member(&url);
    assert_eq!(members(&url), sorted(vec![a.addr.clone(), b.addr.clone()]));
    let st = status(&url);
    assert_eq!(st["replicas"], 1);
    assert!(st["revision"].as_i64().unwrap() > 0);

    let mut c = client(&url);
    let layout: Vec<String> = c.layout().into_iter().map(|(node, _)| node).collect();
    assert_eq!(sorted(layout), sorted(vec![a.addr.clone(), b.addr.clone()]));
    for i in 0..20 {
        c.put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes()).unwrap();
    }
    for i in 0..20 {
        assert_eq!(c.get(format!("k{i}").as_bytes()).unwrap().unwrap().data, format!("v{i}").as_bytes());
    }
    let (code, _, err) = rdram(&["put", "--server", &url, "cli", "through etcd"], None);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = rdram(&["get", "--server", &url, "cli"], None);
    assert_eq!((code, out.as_slice()), (0, &b"through etcd"[..]), "{err}");

    // A graceful stop leaves the member set at once, not after the TTL.
    let stopped = Instant::now();
    assert!(b.stop().expect("stops").success());
    assert!(stopped.elapsed() < Duration::from_millis(TTL_MS), "deregistered on SIGTERM, not by lease expiry");
    assert_eq!(members(&url), vec![a.addr.clone()]);
    let follows = wait_until(Duration::from_secs(5), || {
        let _ = c.get(b"k0");
        c.layout().len() == 1
    });
    assert!(follows, "the client routes over the one member left: {:?}", c.layout());
    c.put(b"after-leave", b"1").unwrap();
    assert_eq!(c.get(b"after-leave").unwrap().unwrap().data, b"1");

    let kept = c.session_with(&a.addr);
    assert!(kept.is_some());
    let joined = member(&url);
    let follows = wait_until(Duration::from_secs(5), || {
        let _ = c.get(b"k0");
        c.layout().len() == 2
    });
    assert!(follows, "the client follows a join: {:?}", c.layout());
    assert!(c.layout().iter().any(|(node, _)| *node == joined.addr));
    assert_eq!(
        c.session_with(&a.addr),
        kept,
        "a join connects to the joining server only: the connection to the others is kept"
    );
    assert_eq!(c.get(b"after-leave").unwrap().unwrap().data, b"1");
    for i in 0..20 {
        c.put(format!("j{i}").as_bytes(), b"joined").unwrap();
        assert_eq!(c.get(format!("j{i}").as_bytes()).unwrap().unwrap().data, b"joined");
    }

    // A listing paged alternately by this client (which connected to the joining server
    // last) and a fresh one (as the gateway pages with whichever client is free) lists
    // every key once.
    let mut fresh = client(&url);
    let range = KeyRange::prefix(b"j");
    let (mut listed, mut cursor, mut pages) = (Vec::new(), None, 0);
    loop {
        let by = if pages % 2 == 0 { &mut c } else { &mut fresh };
        let (page, next) = by.list_page(&range, cursor.as_ref()).unwrap();
        listed.extend(page.into_iter().map(|e| String::from_utf8(e.key).unwrap()));
        pages += 1;
        match next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    assert_eq!(
        sorted(listed),
        sorted((0..20).map(|i| format!("j{i}")).collect()),
        "every key listed once over {pages} pages"
    );
}

/// A member that dies (SIGKILL) leaves the view when its lease expires.
#[test]
fn a_killed_server_leaves_the_view_within_its_lease_ttl() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("kill");
    create(&url, 1);
    let a = member(&url);
    let mut b = member(&url);
    assert_eq!(members(&url).len(), 2);
    let killed = Instant::now();
    b.kill();
    let gone = wait_until(Duration::from_millis(TTL_MS + 3000), || members(&url) == vec![a.addr.clone()]);
    assert!(gone, "the killed server is still a member {:?} after it died", killed.elapsed());
    eprintln!("a killed member left the view {:?} after SIGKILL (TTL {TTL_MS} ms)", killed.elapsed());
}

/// A server that cannot register (etcd unreachable, or no such cluster) exits with a
/// clear message; a client given such a string fails the same way.
#[test]
fn without_etcd_or_the_cluster_servers_and_clients_say_why() {
    common::init(common::SHM);
    let dead = format!("etcd://127.0.0.1:{}/x", free_port());
    let out = Command::new(RDRAM)
        .args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off", "--cluster", &dead])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot join cluster") && err.contains("etcd"), "{err}");
    let etcd = Etcd::start();
    let missing = etcd.url("never-created");
    let out = Command::new(RDRAM)
        .args(["serve", "--listen", "127.0.0.1:0", "--memory", "64MiB", "--hugepages", "off", "--cluster", &missing])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("rdram cluster create"), "{err}");
    let e = Client::connect(&missing, ClientOptions::default()).err().expect("no such cluster");
    assert!(e.message.contains("does not exist"), "{}", e.message);
}

/// With etcd gone for longer than two thirds of the lease TTL, servers serve no key (they
/// cannot tell an outage from being cut off while the cluster moves on), and keep what
/// they hold; once etcd is back they register again, serve it, a new server joins and
/// clients follow.
#[test]
fn the_cluster_waits_out_an_etcd_outage_and_recovers() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("outage");
    create(&url, 1);
    let a = member(&url);
    let mut c = client(&url);
    c.put(b"before", b"outage").unwrap();
    let mut impatient =
        Client::connect(&url, ClientOptions { timeout: Duration::from_millis(500), ..Default::default() }).unwrap();
    let member_pid = a.child.id();
    assert_eq!(etcd_connections(member_pid, etcd.client_port), 1, "the member's tasks share one connection to etcd");
    let (dir, client_port, peer_port) = etcd.kill();
    std::thread::sleep(Duration::from_millis(TTL_MS + 500));
    assert!(impatient.put(b"during", b"outage").is_err(), "a write was taken with etcd down past the lease");
    assert!(impatient.get(b"before").is_err(), "a read was served with etcd down past the lease");
    let etcd = Etcd::start_in(dir, client_port, peer_port);
    let back = wait_until(Duration::from_secs(15), || members(&url).contains(&a.addr));
    assert!(back, "the server registers again once etcd is back: {:?}", members(&url));
    let serving = wait_until(Duration::from_secs(15), || impatient.get(b"before").is_ok());
    assert!(serving, "the server serves again once etcd is back");
    assert_eq!(c.get(b"before").unwrap().unwrap().data, b"outage", "kept through the outage");
    c.put(b"during", b"outage").unwrap();
    let b = member(&url);
    let follows = wait_until(Duration::from_secs(10), || {
        let _ = c.get(b"before");
        c.layout().len() == 2
    });
    assert!(follows, "the client follows a join after the outage: {:?}", c.layout());
    assert!(c.layout().iter().any(|(node, _)| *node == b.addr));
    // Every task moved to the one new connection; the old one is gone.
    let one = wait_until(Duration::from_secs(10), || etcd_connections(member_pid, client_port) == 1);
    assert!(one, "the member holds {} connections to etcd after the outage", etcd_connections(member_pid, client_port));
    assert_eq!(etcd_connections(b.child.id(), client_port), 1, "a member that joined later");
    drop(etcd);
}

/// How many established TCP connections process `pid` holds to 127.0.0.1:`port`.
fn etcd_connections(pid: u32, port: u16) -> usize {
    let remote = format!("0100007F:{port:04X}");
    common::tcp_sockets(pid).iter().filter(|s| s.state == "01" && s.remote == remote).count()
}

/// Keys one server holds, asked of it directly (a client given its address).
fn keys_on(addr: &str) -> u64 {
    let mut c = Client::connect(addr, ClientOptions::default()).unwrap();
    c.stats().unwrap()["keys"].as_u64().unwrap()
}

fn value_of(i: usize) -> Vec<u8> {
    common::pattern(i as u64, 2048 + i % 1024)
}

/// Key `i` of the moves' load: every 64th longer than a request carries inline (1 KiB),
/// so that such keys are copied and handed over too.
fn key_of(i: usize) -> String {
    match i % 64 {
        0 => format!("k{i}/{}", "long".repeat(300)),
        _ => format!("k{i}"),
    }
}

/// What the load threads of [`keys_stay_readable_while_servers_join_and_drain`] saw.
#[derive(Default)]
struct Load {
    reads: u64,
    misses: Vec<String>,
    increments: u64,
    written: Vec<usize>,
    errors: Vec<String>,
}

/// Servers join and drain under load: a fourth server joins and takes its share of the
/// keys, then one server drains on `rdram cluster drain` and another on SIGTERM with
/// --drain. Readers check every key continuously; CAS writers increment shared counters;
/// a writer adds keys. No call fails, no read misses, no increment is lost or doubled,
/// every acknowledged key reads back, and the servers hold each key `replicas` times (old
/// copies freed).
fn servers_join_and_drain_under_load(replicas: u32) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("moves");
    create(&url, replicas);
    // Slow handovers, so that the load runs through them.
    let rate = ["--rebalance-rate", "2MiB"];
    let a = member_with(&url, &rate);
    let mut b = member_with(&url, &rate);
    let mut c = member_with(&url, &["--rebalance-rate", "2MiB", "--drain"]);
    let preload = 1500;
    let counters = 8;
    let mut setup = client(&url);
    for i in 0..preload {
        setup.put(key_of(i).as_bytes(), &value_of(i)).unwrap();
    }
    for n in 0..counters {
        setup.put(format!("counter{n}").as_bytes(), &0u64.to_le_bytes()).unwrap();
    }
    let (epoch, _, _) = placement(&url);

    let stop = Arc::new(AtomicBool::new(false));
    let load = Arc::new(Mutex::new(Load::default()));
    let mut threads = Vec::new();
    for t in 0..2 {
        let (stop, load, url) = (stop.clone(), load.clone(), url.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            let mut i = t;
            while !stop.load(Ordering::SeqCst) {
                let key = key_of(i % preload);
                match c.get(key.as_bytes()) {
                    Ok(Some(v)) if v.data == value_of(i % preload) => load.lock().unwrap().reads += 1,
                    Ok(Some(_)) => load.lock().unwrap().misses.push(format!("{key}: wrong bytes")),
                    Ok(None) => load.lock().unwrap().misses.push(format!("{key}: missing")),
                    Err(e) => load.lock().unwrap().errors.push(format!("get {key}: {e}")),
                }
                i += 7;
            }
        }));
    }
    for t in 0..2 {
        let (stop, load, url) = (stop.clone(), load.clone(), url.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            let mut n = t;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("counter{}", n % counters);
                n += 1;
                let result = c.get(key.as_bytes()).and_then(|v| {
                    let v = v.expect("counters exist");
                    let count = u64::from_le_bytes(v.data[..8].try_into().unwrap());
                    let opts = remote_dram::client::PutOptions {
                        condition: remote_dram::client::WriteCondition::IfEqual(v.generation),
                        ttl: None,
                    };
                    c.put_with(key.as_bytes(), &(count + 1).to_le_bytes(), &opts)
                });
                match result {
                    Ok(remote_dram::client::WriteResult::Written { .. }) => load.lock().unwrap().increments += 1,
                    Ok(remote_dram::client::WriteResult::ConditionFailed) => {}
                    Err(e) => load.lock().unwrap().errors.push(format!("increment {key}: {e}")),
                }
            }
        }));
    }
    {
        let (stop, load, url) = (stop.clone(), load.clone(), url.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            let mut i = preload;
            while !stop.load(Ordering::SeqCst) {
                match c.put(key_of(i).as_bytes(), &value_of(i)) {
                    Ok(_) => load.lock().unwrap().written.push(i),
                    Err(e) => load.lock().unwrap().errors.push(format!("put k{i}: {e}")),
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
        }));
    }

    // A fourth server joins: keys move to it, and the placement moves on.
    std::thread::sleep(Duration::from_millis(300));
    let d = member_with(&url, &rate);
    let joined = wait_until(Duration::from_secs(30), || {
        let (e, members, settled) = placement(&url);
        e > epoch && settled && members.contains(&d.addr)
    });
    assert!(joined, "the placement takes the new server in: {}", status(&url));
    let on_d = keys_on(&d.addr);
    assert!(on_d > preload as u64 / 8, "the new server took its share of the keys: {on_d}");
    let handed_over: u64 = [&a, &b, &c]
        .iter()
        .map(|s| {
            Client::connect(&s.addr, ClientOptions::default()).unwrap().stats().unwrap()["servers"][0]["shards"][0]
                ["handed_over_keys"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(
        handed_over > preload as u64 / 8,
        "the sources count the keys they handed over in their stats: {handed_over}"
    );

    // One server drains on request, another on SIGTERM with --drain: each exits 0.
    let (code, _, err) = rdram(&["cluster", "drain", &url, &b.addr], None);
    assert_eq!(code, 0, "cluster drain: {err}");
    let drained = wait_until(Duration::from_secs(30), || b.child.try_wait().ok().flatten().is_some());
    assert!(drained, "the drained server exits once its keys are handed over: {}", status(&url));
    assert!(b.stop().unwrap().success());
    assert!(c.stop().expect("a draining server exits in time").success(), "SIGTERM with --drain exits 0");
    let (_, members, settled) = placement(&url);
    assert!(settled);
    assert_eq!(sorted(members), sorted(vec![a.addr.clone(), d.addr.clone()]));

    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let load = Arc::try_unwrap(load).ok().unwrap().into_inner().unwrap();
    eprintln!(
        "{} reads, {} increments, {} keys added during the moves",
        load.reads,
        load.increments,
        load.written.len()
    );
    assert!(load.misses.is_empty(), "reads missed during the moves: {:?}", &load.misses[..load.misses.len().min(10)]);
    assert!(load.errors.is_empty(), "calls failed during the moves: {:?}", &load.errors[..load.errors.len().min(10)]);
    assert!(load.reads > 100 && load.increments > 10 && load.written.len() > 10, "the load ran through the moves");

    let mut check = client(&url);
    let mut total = 0;
    for n in 0..counters {
        let v = check.get(format!("counter{n}").as_bytes()).unwrap().unwrap();
        total += u64::from_le_bytes(v.data[..8].try_into().unwrap());
    }
    assert_eq!(total, load.increments, "every acknowledged increment is counted once");
    for i in (0..preload).chain(load.written.iter().copied()) {
        let v = check.get(key_of(i).as_bytes()).unwrap();
        assert_eq!(v.map(|v| v.data), Some(value_of(i)), "k{i} after the moves");
    }
    let keys = (preload + counters + load.written.len()) as u64 * u64::from(replicas);
    let held = || keys_on(&a.addr) + keys_on(&d.addr);
    // (With R = 2, copies the servers no longer need go once the placement moved on.)
    wait_until(Duration::from_secs(10), || held() == keys);
    assert_eq!(held(), keys, "each key is held {replicas} times: the old copies were freed");
}

#[test]
fn keys_stay_readable_while_servers_join_and_drain() {
    servers_join_and_drain_under_load(1);
}

/// With two replicas per key, a move ends with keys changing primary: writes in flight
/// then are sealed and copied under a generation floor, so none fails.
#[test]
fn replicated_keys_stay_writable_while_servers_join_and_drain() {
    servers_join_and_drain_under_load(2);
}

/// What the load threads of [`a_killed_server_loses_no_acknowledged_write`] saw: each
/// failed call with when it failed (after the kill), and the longest call.
#[derive(Default)]
struct Failover {
    reads: u64,
    misses: Vec<String>,
    written: std::collections::BTreeSet<usize>,
    increments: u64,
    /// Increments whose call failed: applied or not, the caller cannot tell.
    unsure: u64,
    errors: Vec<(Duration, String)>,
    longest_write: Duration,
}

/// Three servers, R = 2; one is SIGKILLed under load. Reads of its keys go on at once
/// from their other replicas; writes resume once its lease lapsed; afterwards every
/// acknowledged put reads back byte-exact, no increment is lost or doubled, failed calls
/// (if any) fall within the lease TTL plus a second of the kill, and the survivors hold
/// two copies of every key.
#[test]
fn a_killed_server_loses_no_acknowledged_write() {
    one_server_fails_under_load(false);
}

/// The same with a server stopped (SIGSTOP) past its lease TTL, then continued: clients
/// give up on it once its lease lapsed, it is fenced when it runs again (it serves no
/// key until etcd confirmed its lease and it read the placement anew, so no write is
/// accepted through it with the view it held), and it joins again as a new member.
#[test]
fn a_server_paused_past_its_lease_is_fenced() {
    one_server_fails_under_load(true);
}

/// A member paused past its lease, whose keys were deleted while the cluster went on
/// without it, brings none of them back when it joins again: it forgets what it held
/// before it registers anew, and is copied what it is to hold. (Found by the chaos soak:
/// such a member, again a replica of a deleted key, kept its old copy, and served it
/// once it was the key's primary.)
#[test]
fn a_member_back_from_a_lapsed_lease_brings_no_deleted_key_back() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("lapsed");
    create(&url, 2);
    let a = member(&url);
    let b = member(&url);
    let c = member(&url);
    wait_until_placed(&url, 3);
    let mut writer = client(&url);
    let keys: Vec<String> = (0..60).map(|i| format!("gone{i}")).collect();
    for k in &keys {
        writer.put(k.as_bytes(), b"deleted while b was away").unwrap();
    }
    writer.put(b"kept", b"written while b was away").unwrap();
    assert!(keys_on(&b.addr) > 0, "b holds replicas of the keys");

    let (epoch, _, _) = placement(&url);
    signal(&b, "STOP");
    let without_b = wait_until(Duration::from_secs(30), || {
        let (e, members, settled) = placement(&url);
        e > epoch && settled && sorted(members) == sorted(vec![a.addr.clone(), c.addr.clone()])
    });
    assert!(without_b, "the placement leaves the paused member out: {}", status(&url));
    for k in &keys {
        assert!(writer.delete(k.as_bytes()).unwrap(), "{k} deleted");
    }
    signal(&b, "CONT");
    let back = wait_until(Duration::from_secs(30), || {
        let (_, members, settled) = placement(&url);
        settled && members.contains(&b.addr)
    });
    assert!(back, "the paused member joins again: {}", status(&url));

    let mut reader = client(&url);
    for k in &keys {
        assert_eq!(reader.get(k.as_bytes()).unwrap().map(|v| v.data), None, "{k} came back");
    }
    assert_eq!(reader.get(b"kept").unwrap().unwrap().data, b"written while b was away");
    let copies = |addr: &str| {
        let listed = Client::connect(addr, ClientOptions::default()).unwrap().list(&Default::default()).unwrap();
        listed.iter().filter(|e| e.key.starts_with(b"gone")).count()
    };
    for m in [&a, &b, &c] {
        assert_eq!(copies(&m.addr), 0, "{} holds deleted keys", m.addr);
    }
}

/// A member that leaves just after another came back from a pause past its lease leaves
/// every key on R members. The one back takes the others' lapsed leases for live for a
/// lease TTL (docs/cluster.md, etcd trouble), so it counts the leaving member live while
/// the others do not; the key's first replica that stays copies it, as the placement says,
/// whoever counts whom live. (Found by the libfabric chaos soak: each member chose by its
/// own view, the one back left the leaving member's keys to it, the others held none of
/// them, and nobody copied them; they were on one member when it was paused again.)
#[test]
fn a_member_leaving_as_another_comes_back_from_a_pause_leaves_every_key_on_r_members() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("back-then-leave");
    create(&url, 2);
    // Long enough a lease that the leave falls inside the hold of the member back.
    const TTL: u64 = 4000;
    let ttl = TTL.to_string();
    let args = ["--workers", "1", "--cluster", &url, "--lease-ttl-ms", &ttl];
    let mut servers: Vec<ServerProc> = (0..4).map(|_| ServerProc::start(&args)).collect();
    wait_until_placed(&url, 4);
    let mut writer = client(&url);
    let keys: Vec<String> = (0..400).map(|i| format!("kept/{i}")).collect();
    for k in &keys {
        writer.put(k.as_bytes(), k.as_bytes()).unwrap();
    }
    let paused = servers[0].addr.clone();
    signal(&servers[0], "STOP");
    let left_out = wait_until(Duration::from_secs(60), || {
        let (_, members, settled) = placement(&url);
        settled && !members.contains(&paused)
    });
    assert!(left_out, "the placement leaves the paused member out: {}", status(&url));
    signal(&servers[0], "CONT");
    let back = wait_until(Duration::from_secs(60), || {
        let (_, members, settled) = placement(&url);
        settled && members.contains(&paused)
    });
    let back_at = Instant::now();
    assert!(back, "the paused member joins again: {}", status(&url));
    let mut leaving = servers.remove(1);
    let exit = leaving.stop();
    assert!(exit.is_some_and(|e| e.success()), "a member leaving on SIGTERM exits 0: {exit:?}");
    eprintln!("a member left {:?} after the one back was placed again", back_at.elapsed());
    let want = sorted(servers.iter().map(|s| s.addr.clone()).collect());
    let settled = wait_until(Duration::from_secs(60), || {
        let (_, members, settled) = placement(&url);
        settled && sorted(members) == want
    });
    assert!(settled, "the placement settles on the members left: {}", status(&url));
    let copies = || {
        let mut count = std::collections::HashMap::<Vec<u8>, usize>::new();
        for s in &servers {
            let listed = Client::connect(&s.addr, ClientOptions::default()).unwrap().list(&Default::default()).unwrap();
            for e in listed {
                *count.entry(e.key).or_default() += 1;
            }
        }
        count
    };
    // The copies a member no longer needs go shortly after the placement settled.
    let on_two = |count: &std::collections::HashMap<Vec<u8>, usize>| {
        keys.iter().filter(|k| count.get(k.as_bytes()) == Some(&2)).count()
    };
    wait_until(Duration::from_secs(10), || on_two(&copies()) == keys.len());
    let count = copies();
    let short: Vec<&String> = keys.iter().filter(|k| count.get(k.as_bytes()).copied().unwrap_or(0) < 2).collect();
    assert!(
        short.is_empty(),
        "{} of {} keys on fewer than 2 members: {:?}",
        short.len(),
        keys.len(),
        &short[..short.len().min(5)]
    );
    for k in &keys {
        assert_eq!(writer.get(k.as_bytes()).unwrap().map(|v| v.data), Some(k.clone().into_bytes()), "{k}");
    }
}

/// A member paused past its lease that comes back while the move leaving it out is still
/// under way serves none of its keys as they were before: writes went on without it, so
/// it stays out until that move ended, and joins as a new member. (Found by the chaos
/// soak: such a member, still named by the placement, registered again and served its
/// older values as the keys' primary until the move ended.)
#[test]
fn a_member_back_while_the_move_leaving_it_out_runs_serves_no_older_value() {
    use remote_dram::cluster::{Placement, Routing};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("back-early");
    create(&url, 2);
    // The others copy slowly, so that the move leaving `b` out lasts while it is back.
    let a = member_with(&url, &["--rebalance-rate", "256KiB"]);
    let b = member(&url);
    let c = member_with(&url, &["--rebalance-rate", "256KiB"]);
    wait_until_placed(&url, 3);
    let placed: Placement = serde_json::from_value(status(&url)["placement"].clone()).unwrap();
    let routing = Routing::new(placed);
    let hot: Vec<String> = (0..10_000)
        .map(|i| format!("hot{i}"))
        .filter(|k| routing.owner(k.as_bytes()) == Some(&b.addr))
        .take(20)
        .collect();
    let mut writer = client(&url);
    for k in &hot {
        writer.put(k.as_bytes(), b"before b's pause").unwrap();
    }
    let bulk = vec![7u8; 64 << 10];
    for i in 0..100 {
        writer.put(format!("bulk{i}").as_bytes(), &bulk).unwrap();
    }

    signal(&b, "STOP");
    let moving_off_b = || {
        let p = &status(&url)["placement"];
        let names = |v: &serde_json::Value| v.as_array().unwrap().iter().any(|m| m.as_str() == Some(&b.addr));
        names(&p["members"]) && !p["next"].is_null() && !names(&p["next"])
    };
    assert!(
        wait_until(Duration::from_secs(30), moving_off_b),
        "no move leaves the paused member out: {}",
        status(&url)
    );
    for k in &hot {
        writer.put(k.as_bytes(), b"while b was away").unwrap();
    }
    signal(&b, "CONT");
    // Reads while `b` is back and the move is still under way: a client that routed
    // before, and new ones. Each must succeed, and be current.
    let until = Instant::now() + Duration::from_secs(3);
    let mut rounds = 0;
    while Instant::now() < until {
        let mut fresh = client(&url);
        for c in [&mut writer, &mut fresh] {
            for k in &hot {
                let got = c.get(k.as_bytes()).unwrap_or_else(|e| panic!("{k} (round {rounds}): {e:?}")).map(|v| v.data);
                assert_eq!(got.as_deref(), Some(&b"while b was away"[..]), "{k} read back in time (round {rounds})");
            }
        }
        rounds += 1;
    }
    assert!(moving_off_b(), "the move ended before the reads: the test saw nothing; copy slower");
    assert!(rounds > 0);
    let back = wait_until(Duration::from_secs(60), || {
        let (_, members, settled) = placement(&url);
        settled && members.contains(&b.addr)
    });
    assert!(back, "the paused member joins again: {}", status(&url));
    let mut reader = client(&url);
    for k in &hot {
        assert_eq!(reader.get(k.as_bytes()).unwrap().unwrap().data, b"while b was away");
    }
    for i in 0..100 {
        assert_eq!(reader.get(format!("bulk{i}").as_bytes()).unwrap().unwrap().data, bulk, "bulk{i}");
    }
    drop((a, c));
}

/// A replica that stops answering (SIGSTOP) holds up only the writes it must take: while
/// a copy to it waits, the same primary's writes of keys it does not hold are copied to
/// their replicas and answered, before its lease lapses. Writes sent to it as the keys'
/// primary go to their next primaries once its lease lapsed.
#[test]
fn a_stopped_replica_holds_up_only_its_own_keys_writes() {
    use remote_dram::cluster::{Placement, Routing};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("stopped");
    create(&url, 2);
    let servers = [member(&url), member(&url), member(&url)];
    wait_until_placed(&url, 3);
    let placed: Placement = serde_json::from_value(status(&url)["placement"].clone()).unwrap();
    let routing = Routing::new(placed.clone());
    let (a, c) = (servers[0].addr.as_str(), servers[2].addr.as_str());
    // Keys whose primary is `a`: one that `c` holds too, and some that it does not.
    let keys = |with_c: bool, n: usize| -> Vec<String> {
        let of_a = |k: &String| {
            let r = routing.replicas(k.as_bytes());
            r[0] == a && r.contains(&c) == with_c
        };
        (0..10_000).map(|i| format!("hol{i}")).filter(of_a).take(n).collect()
    };
    let held_by_c = keys(true, 1).remove(0);
    let elsewhere = keys(false, 8);
    // And keys whose primary is `c`, each written by a client of its own.
    let of_c: Vec<String> =
        (0..10_000).map(|i| format!("hol{i}")).filter(|k| routing.replicas(k.as_bytes())[0] == c).take(16).collect();
    let mut writer = client(&url);
    let mut stuck_writer = client(&url);
    writer.put(b"warm-up", b"0").unwrap();
    stuck_writer.put(held_by_c.as_bytes(), b"0").unwrap();
    let mut writers_to_c: Vec<(String, Client)> = of_c.iter().map(|k| (k.clone(), client(&url))).collect();
    for (key, w) in &mut writers_to_c {
        w.put(key.as_bytes(), b"0").unwrap();
    }
    signal(&servers[2], "STOP");
    // Its copy waits on `c` until the placement moves on without it. A large one: `c` was
    // to read it from `a`'s memory, so giving it up waits for `c`, off the replicator's thread.
    let large = common::pattern(7, 4 << 20);
    let stuck = {
        let (key, large) = (held_by_c.clone(), large.clone());
        std::thread::spawn(move || stuck_writer.put(key.as_bytes(), &large).map(|_| ()))
    };
    // Sent to `c`, they wait until etcd says its lease lapsed, then go to the keys' next
    // primaries, however late each client looks (the placement without `c` may be there
    // by then).
    let to_c: Vec<_> = writers_to_c
        .into_iter()
        .map(|(key, mut w)| std::thread::spawn(move || w.put(key.as_bytes(), b"1").map(|_| ())))
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    for key in &elsewhere {
        writer.put(key.as_bytes(), b"1").unwrap();
    }
    let (_, members, _) = placement(&url);
    assert!(
        members.contains(&c.to_string()),
        "every write of a key c does not hold was answered while c was still a member ({members:?})"
    );
    stuck.join().unwrap().unwrap();
    for (key, w) in of_c.iter().zip(to_c) {
        w.join().unwrap().unwrap_or_else(|e| panic!("{key}, whose primary stopped: {e}"));
    }
    signal(&servers[2], "CONT");
    for key in elsewhere.iter().chain(&of_c) {
        assert_eq!(writer.get(key.as_bytes()).unwrap().unwrap().data, b"1", "{key}");
    }
    assert!(writer.get(held_by_c.as_bytes()).unwrap().unwrap().data == large, "{held_by_c} is byte-exact");
}

/// A replica with no room for a write refuses it for good: its writer hears so at once,
/// with the replica named, rather than a timeout once the copy was sent for its deadline
/// (30 s, past the client's 10 s).
#[test]
fn a_write_no_replica_has_room_for_is_refused_at_once() {
    use remote_dram::cluster::{Placement, Routing};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("full");
    create(&url, 2);
    let servers = [member(&url), member_with(&url, &["--memory", "8MiB"])];
    wait_until_placed(&url, 2);
    let placed: Placement = serde_json::from_value(status(&url)["placement"].clone()).unwrap();
    let routing = Routing::new(placed);
    let (big, small) = (servers[0].addr.as_str(), servers[1].addr.as_str());
    let key = (0..1000).map(|i| format!("full{i}")).find(|k| routing.owner(k.as_bytes()) == Some(big)).unwrap();
    let mut c = client(&url);
    let e = c.put(key.as_bytes(), &common::pattern(1, 12 << 20)).unwrap_err();
    assert!(matches!(e.status, Status::NoSpace | Status::ValueTooLarge), "{e:?}");
    assert!(e.message.contains(small) && e.message.contains("refused it"), "{e:?}");
    // Both keep serving.
    c.put(key.as_bytes(), b"fits").unwrap();
    assert_eq!(c.get(key.as_bytes()).unwrap().unwrap().data, b"fits");
}

/// Large values reach a key's other replicas through its primary, singly and in
/// batches: every key ends on exactly two servers with one generation and the same bytes;
/// a refused conditional write leaves nothing staged, and once the keys are deleted the
/// servers hold no bytes. Over UCX's shared memory the replica pulls a copy's bytes, and
/// the primary's worker sends large copies itself.
#[test]
fn large_values_reach_every_replica() {
    common::init(common::SHM);
    large_values_reach_every_replica_over(&[], false, true);
}

/// The same over libfabric `tcp;ofi_rxm`, where a replicator thread sends the copies of
/// large writes (each costs its sender a registration and the provider's socket writes),
/// and a value of 256 KiB or more is staged on its replicas as it reaches its primary,
/// then installed there: every such write was streamed, and installed on its replica.
#[test]
fn large_values_reach_every_replica_over_libfabric_tcp() {
    common::init(common::SHM);
    large_values_reach_every_replica_over(&["--transport", "fabric", "--provider", "tcp;ofi_rxm"], true, true);
}

/// The same over libfabric's shared memory, where a streamed value's reads keep as many
/// bytes in flight as any read (over tcp, two chunks).
#[test]
fn large_values_reach_every_replica_over_libfabric_shm() {
    common::init(common::SHM);
    large_values_reach_every_replica_over(&["--transport", "fabric", "--provider", "shm"], true, true);
}

/// A write whose value its primary streams to the replica as it arrives, given up midway
/// (its writer killed once the replica staged a part): the primary frees the value and
/// the replica what it staged of it, at once; the key reads as before the write.
#[test]
fn a_streamed_write_given_up_midway_leaves_nothing_staged() {
    common::init(common::SHM);
    let args = ["--transport", "fabric", "--provider", "tcp;ofi_rxm", "--memory", "512MiB"];
    streamed_write_given_up_midway(&args, 1, |url, key, file| {
        Command::new(RDRAM)
            .args(["put", "--server", url, key, "--file", file])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    });
}

fn one_server_fails_under_load(pause: bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("replicas");
    create(&url, 2);
    let a = member(&url);
    let mut b = member(&url);
    let c = member(&url);
    // Loaded once the three servers' keys have settled: the errors counted are the
    // failover's.
    wait_until_placed(&url, 3);
    let preload = 600;
    let counters = 8;
    let mut setup = client(&url);
    for i in 0..preload {
        setup.put(format!("k{i}").as_bytes(), &value_of(i)).unwrap();
    }
    for n in 0..counters {
        setup.put(format!("counter{n}").as_bytes(), &0u64.to_le_bytes()).unwrap();
    }
    let copies = keys_on(&a.addr) + keys_on(&b.addr) + keys_on(&c.addr);
    assert_eq!(copies, 2 * (preload + counters) as u64, "each key is held by two servers");

    let stop = Arc::new(AtomicBool::new(false));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let load = Arc::new(Mutex::new(Failover::default()));
    let since_kill = {
        let killed_at = killed_at.clone();
        move || killed_at.lock().unwrap().map_or(Duration::ZERO, |t| t.elapsed())
    };
    let mut threads = Vec::new();
    {
        let (stop, load, url, since_kill) = (stop.clone(), load.clone(), url.clone(), since_kill.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("k{}", i % preload);
                match c.get(key.as_bytes()) {
                    Ok(Some(v)) if v.data == value_of(i % preload) => load.lock().unwrap().reads += 1,
                    Ok(Some(_)) => load.lock().unwrap().misses.push(format!("{key}: wrong bytes")),
                    Ok(None) => load.lock().unwrap().misses.push(format!("{key}: missing")),
                    Err(e) => load.lock().unwrap().errors.push((since_kill(), format!("get {key}: {e}"))),
                }
                i += 7;
            }
        }));
    }
    for t in 0..2 {
        let (stop, load, url, since_kill) = (stop.clone(), load.clone(), url.clone(), since_kill.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            let mut n = t;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("counter{}", n % counters);
                n += 1;
                let Ok(Some(v)) = c.get(key.as_bytes()) else { continue };
                let count = u64::from_le_bytes(v.data[..8].try_into().unwrap());
                let opts = remote_dram::client::PutOptions {
                    condition: remote_dram::client::WriteCondition::IfEqual(v.generation),
                    ttl: None,
                };
                match c.put_with(key.as_bytes(), &(count + 1).to_le_bytes(), &opts) {
                    Ok(remote_dram::client::WriteResult::Written { .. }) => load.lock().unwrap().increments += 1,
                    Ok(remote_dram::client::WriteResult::ConditionFailed) => {}
                    Err(e) => {
                        let mut l = load.lock().unwrap();
                        l.unsure += 1;
                        l.errors.push((since_kill(), format!("increment {key}: {e}")));
                    }
                }
            }
        }));
    }
    for t in 0..2 {
        let (stop, load, url, since_kill) = (stop.clone(), load.clone(), url.clone(), since_kill.clone());
        threads.push(std::thread::spawn(move || {
            let mut c = client(&url);
            // A window of keys written over and over: the servers' memory holds them
            // however fast the writes go.
            const WINDOW: usize = 5_000;
            let first = preload + 100_000 * (t + 1);
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let i = first + n % WINDOW;
                let started = Instant::now();
                let result = c.put(format!("k{i}").as_bytes(), &value_of(i));
                let mut l = load.lock().unwrap();
                l.longest_write = l.longest_write.max(started.elapsed());
                match result {
                    Ok(_) => {
                        l.written.insert(i);
                    }
                    Err(e) => l.errors.push((since_kill(), format!("put k{i}: {e}"))),
                }
                n += 1;
            }
        }));
    }

    std::thread::sleep(Duration::from_millis(500));
    let (epoch, _, _) = placement(&url);
    *killed_at.lock().unwrap() = Some(Instant::now());
    if pause {
        signal(&b, "STOP");
    } else {
        b.kill();
    }
    let settled = wait_until(Duration::from_secs(30), || {
        let (e, members, settled) = placement(&url);
        e > epoch && settled && sorted(members) == sorted(vec![a.addr.clone(), c.addr.clone()])
    });
    assert!(settled, "the placement leaves the failed server out: {}", status(&url));
    let mut survivors = vec![a.addr.clone(), c.addr.clone()];
    if pause {
        signal(&b, "CONT");
        let rejoined = wait_until(Duration::from_secs(30), || {
            let (_, members, settled) = placement(&url);
            settled && members.contains(&b.addr)
        });
        assert!(rejoined, "the paused server joins again: {}", status(&url));
        survivors.push(b.addr.clone());
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let load = Arc::try_unwrap(load).ok().unwrap().into_inner().unwrap();
    eprintln!(
        "{} reads, {} increments ({} unsure), {} keys added; longest put {:?}; {} failed calls",
        load.reads,
        load.increments,
        load.unsure,
        load.written.len(),
        load.longest_write,
        load.errors.len()
    );
    assert!(load.misses.is_empty(), "reads missed: {:?}", &load.misses[..load.misses.len().min(10)]);
    let window = Duration::from_millis(TTL_MS + 1000);
    // Once the paused server is back, keys move to it. A write taken before that move was
    // sealed is copied on after it ends; only a conditional one whose copy reached the
    // key's new primary after a newer write may fail then, as of unknown outcome
    // (docs/cluster.md, Limits), counted as unsure above.
    let rejoin_race = |e: &str| pause && e.contains("conditional write may not last");
    let late: Vec<_> =
        load.errors.iter().filter(|(at, e)| (*at == Duration::ZERO || *at > window) && !rejoin_race(e)).collect();
    assert!(late.is_empty(), "calls failed outside the failover window: {late:?}");
    assert!(load.reads > 100 && load.increments > 10 && load.written.len() > 10, "the load ran through the failover");

    let mut check = client(&url);
    let mut total = 0;
    for n in 0..counters {
        let v = check.get(format!("counter{n}").as_bytes()).unwrap().unwrap();
        total += u64::from_le_bytes(v.data[..8].try_into().unwrap());
    }
    assert!(
        (load.increments..=load.increments + load.unsure).contains(&total),
        "counters hold {total}: {} acknowledged increments, {} unsure",
        load.increments,
        load.unsure
    );
    for i in (0..preload).chain(load.written.iter().copied()) {
        let v = check.get(format!("k{i}").as_bytes()).unwrap();
        assert_eq!(v.map(|v| v.data), Some(value_of(i)), "k{i} after the failover");
    }
    // Every acknowledged key has two replicas again, and no key has more. (A put that
    // failed may have reached one replica only: it was never acknowledged.)
    let acknowledged: Vec<String> = (0..preload)
        .chain(load.written.iter().copied())
        .map(|i| format!("k{i}"))
        .chain((0..counters).map(|n| format!("counter{n}")))
        .collect();
    let copies = || {
        let mut count = std::collections::HashMap::<Vec<u8>, usize>::new();
        for s in &survivors {
            for e in Client::connect(s, ClientOptions::default()).unwrap().list(&Default::default()).unwrap() {
                *count.entry(e.key).or_default() += 1;
            }
        }
        count
    };
    let settled = wait_until(Duration::from_secs(10), || {
        let count = copies();
        count.values().all(|&n| n <= 2) && acknowledged.iter().all(|k| count.get(k.as_bytes()) == Some(&2))
    });
    let count = copies();
    let wrong: Vec<_> = acknowledged.iter().filter(|k| count.get(k.as_bytes()) != Some(&2)).take(5).collect();
    assert!(settled, "keys without exactly two copies: {wrong:?}; most copies of one key: {:?}", count.values().max());
    if pause {
        b.stop();
    }
}

/// A server cut off from etcd (here etcd stopped with SIGSTOP) while its clients still
/// reach it stops taking writes before its lease can have lapsed at etcd, where the
/// cluster would give its keys to others: two thirds of the TTL after etcd last confirmed
/// the lease it serves no key. With a 6 s lease, keep-alives every 2 s: the first refused
/// write comes within 4 s of the cut (plus the test's slack), and nothing is taken after
/// it; etcd comes back half a second later, before the lease can lapse (at least 2 s after
/// the fence), and writes go through again with every key written before still there.
#[test]
fn a_server_cut_off_from_etcd_takes_no_writes_past_its_lease() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("cut-off");
    create(&url, 1);
    let ttl = Duration::from_secs(6);
    let args = ["--workers", "1", "--cluster", &url, "--lease-ttl-ms", "6000"];
    let _servers = [ServerProc::start(&args), ServerProc::start(&args)];
    wait_until_placed(&url, 2);
    let options = ClientOptions { timeout: Duration::from_millis(300), ..Default::default() };
    let mut c = Client::connect(&url, options).unwrap();
    for i in 0..20 {
        c.put(format!("k{i}").as_bytes(), b"before").unwrap();
    }
    let etcd_pid = etcd.child.id().to_string();
    let kill = |sig: &str| assert!(Command::new("kill").args([sig, &etcd_pid]).status().unwrap().success());
    kill("-STOP");
    let stopped = Instant::now();
    let mut refused_since = None;
    let mut taken_after_refusal = Vec::new();
    for n in 0.. {
        let started = stopped.elapsed();
        if refused_since.is_some_and(|r| started > r + Duration::from_millis(500)) || started > ttl {
            break;
        }
        match c.put(format!("k{}", n % 20).as_bytes(), b"during") {
            Ok(_) if refused_since.is_some() => taken_after_refusal.push(started),
            Ok(_) => {}
            Err(_) => drop(refused_since.get_or_insert(started)),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kill("-CONT");
    let refused = refused_since.expect("writes were still taken a lease TTL after etcd stopped");
    assert!(refused < ttl * 2 / 3 + Duration::from_secs(1), "the first write was refused {refused:?} after the cut");
    assert!(taken_after_refusal.is_empty(), "writes started {taken_after_refusal:?} were taken after one was refused");
    let back = wait_until(Duration::from_secs(30), || c.put(b"after", b"etcd is back").is_ok());
    assert!(back, "writes do not go through once etcd is back");
    for i in 0..20 {
        let v = c.get(format!("k{i}").as_bytes()).unwrap().expect("every key written before reads back");
        assert!(v.data == b"before" || v.data == b"during", "k{i}: {:?}", v.data);
    }
}

fn signal(server: &ServerProc, name: &str) {
    let ok =
        Command::new("kill").args([&format!("-{name}"), &server.child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill -{name}");
}

/// Benchmark, not a check (`cargo test --profile test-release --test cluster failover_times --
/// --ignored --nocapture`): over 20 trials, the time from SIGKILL of a key's primary
/// (R = 2, three servers, lease TTL [`TTL_MS`]) to the first successful read and write of
/// that key through a client given the cluster; then how long a batch read takes while
/// the dead member is still in the placement (`BATCH` keys, about a third of them the dead
/// member's, 16 in flight), against the same batch before the kill; a new server replaces
/// the dead one between trials.
#[test]
#[ignore = "a benchmark: bench/README.md quotes it"]
fn failover_times() {
    const BATCH: usize = 3000;
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("failover");
    create(&url, 2);
    let mut servers: Vec<ServerProc> = (0..3).map(|_| member(&url)).collect();
    let mut c = client(&url);
    let batch: Vec<Vec<u8>> = (0..BATCH).map(|i| format!("fo-batch/{i}").into_bytes()).collect();
    let batch: Vec<&[u8]> = batch.iter().map(|k| k.as_slice()).collect();
    let items: Vec<(&[u8], &[u8])> = batch.iter().map(|k| (*k, &b"batched"[..])).collect();
    assert!(c.put_many(&items, 16).iter().all(|r| r.is_ok()));
    let read_batch = |c: &mut Client| {
        let started = Instant::now();
        let all = c.get_many(&batch, 16).iter().all(|r| matches!(r, Ok(Some(_))));
        (all, started.elapsed())
    };
    let (mut reads, mut writes, mut at_rest, mut batches) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for trial in 0..20 {
        wait_until_placed(&url, 3);
        let (_, members, _) = placement(&url);
        let seeds: Vec<u64> = members.iter().map(|m| remote_dram::proto::node_seed(m)).collect();
        let victim = trial % 3;
        let key = (0..)
            .map(|i| format!("fo{trial}-{i}"))
            .find(|k| remote_dram::proto::rendezvous_ranked(k.as_bytes(), &seeds, 2)[0] == victim)
            .unwrap();
        c.put(key.as_bytes(), b"before").unwrap();
        let (all, took) = read_batch(&mut c);
        assert!(all, "the batch at rest");
        at_rest.push(took);
        let index = servers.iter().position(|s| s.addr == members[victim]).unwrap();
        let mut dead = servers.remove(index);
        let killed = Instant::now();
        dead.kill();
        while !matches!(c.get(key.as_bytes()), Ok(Some(_))) {}
        reads.push(killed.elapsed());
        let (all, took) = read_batch(&mut c);
        assert!(all, "the batch while the dead member is in the placement");
        batches.push(took);
        while c.put(key.as_bytes(), b"after").is_err() {}
        writes.push(killed.elapsed());
        servers.push(member(&url));
    }
    for times in [&mut reads, &mut writes, &mut at_rest, &mut batches] {
        times.sort();
    }
    eprintln!(
        "SIGKILL of the primary to the first read: median {:?}, max {:?}; to the first write: median {:?}, max {:?} (20 trials, lease TTL {TTL_MS} ms)",
        reads[10], reads[19], writes[10], writes[19]
    );
    eprintln!(
        "get_many of {BATCH} keys, 16 in flight, after the first read: median {:?}, max {:?}; before the kill median {:?}",
        batches[10], batches[19], at_rest[10]
    );
}

/// With authentication on in etcd, servers, commands and clients take the user and
/// password from the file `RDRAM_ETCD_CREDENTIALS_FILE` names; without it, they say
/// etcd refused them.
#[test]
fn etcd_credentials_come_from_a_file() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut c = etcd_client::Client::connect([format!("127.0.0.1:{}", etcd.client_port)], None).await.unwrap();
        c.user_add("root", "s3cret", None).await.unwrap();
        c.user_grant_role("root", "root").await.unwrap();
        c.auth_enable().await.unwrap();
    });
    let url = etcd.url("auth");
    let (code, _, err) = rdram(&["cluster", "create", &url], None);
    assert_ne!(code, 0, "etcd with authentication on refuses a command without credentials");
    assert!(err.contains("etcd at"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("etcd-credentials");
    std::fs::write(&file, "root:s3cret\n").unwrap();
    let file = file.to_str().unwrap();
    let with = |args: &[&str]| {
        let out = Command::new(RDRAM).args(args).env("RDRAM_ETCD_CREDENTIALS_FILE", file).output().unwrap();
        assert!(out.status.success(), "rdram {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    with(&["cluster", "create", &url]);
    let ttl = TTL_MS.to_string();
    let server = ServerProc::start_with_env(
        &["--workers", "1", "--cluster", &url, "--lease-ttl-ms", &ttl],
        &[("RDRAM_ETCD_CREDENTIALS_FILE", file)],
    );
    with(&["put", "--server", &url, "k", "authenticated"]);
    assert_eq!(with(&["get", "--server", &url, "k"]), b"authenticated");
    drop(server);
}

/// A certificate authority, and etcd's server and a client's certificates it signed
/// (openssl, which `make deps` installs).
struct Pki(tempfile::TempDir);

impl Pki {
    fn new() -> Pki {
        let pki = Pki(tempfile::tempdir().unwrap());
        let p = |name: &str| pki.path(name);
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=rdram-test-ca",
            "-keyout",
            &p("ca.key"),
            "-out",
            &p("ca.pem"),
        ]);
        for (name, ext) in [
            ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
            ("client", "extendedKeyUsage=clientAuth\n"),
        ] {
            let (key, csr, pem, extfile) = (
                p(&format!("{name}.key")),
                p(&format!("{name}.csr")),
                p(&format!("{name}.pem")),
                p(&format!("{name}.ext")),
            );
            std::fs::write(&extfile, ext).unwrap();
            pki.openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &key,
                "-out",
                &csr,
            ]);
            pki.openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &p("ca.pem"),
                "-CAkey",
                &p("ca.key"),
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &extfile,
                "-out",
                &pem,
            ]);
        }
        pki
    }

    fn path(&self, name: &str) -> String {
        self.0.path().join(name).to_str().unwrap().to_string()
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl").args(args).output().expect("openssl (make deps installs it)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// etcd over TLS that asks for client certificates: servers and commands reach it with the
/// CA, certificate and key the environment names, and not without them.
#[test]
fn etcd_over_tls_with_a_client_certificate() {
    common::init(common::SHM);
    let pki = Pki::new();
    let etcd = Etcd::start_tls(&pki);
    let url = etcd.url("tls");
    let run = |args: &[&str], env: &[(&str, String)]| {
        Command::new(RDRAM).args(args).envs(env.iter().map(|(k, v)| (*k, v.as_str()))).output().unwrap()
    };

    let out = run(&["cluster", "create", &url], &[]);
    assert!(!out.status.success(), "plain http to an etcd that speaks TLS fails");
    let ca_only = [("RDRAM_ETCD_CA_FILE", pki.path("ca.pem"))];
    let out = run(&["cluster", "create", &url], &ca_only);
    assert!(!out.status.success(), "TLS without the client certificate etcd asks for fails");
    let out = run(&["cluster", "create", &url], &[("RDRAM_ETCD_CERT_FILE", pki.path("client.pem"))]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("RDRAM_ETCD_CA_FILE"),
        "a certificate without a CA says what is missing"
    );

    let env = [
        ("RDRAM_ETCD_CA_FILE", pki.path("ca.pem")),
        ("RDRAM_ETCD_CERT_FILE", pki.path("client.pem")),
        ("RDRAM_ETCD_KEY_FILE", pki.path("client.key")),
    ];
    let with = |args: &[&str]| {
        let out = run(args, &env);
        assert!(out.status.success(), "rdram {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    with(&["cluster", "create", &url]);
    let ttl = TTL_MS.to_string();
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = ServerProc::start_with_env(&["--workers", "1", "--cluster", &url, "--lease-ttl-ms", &ttl], &env_refs);
    with(&["put", "--server", &url, "k", "over tls"]);
    assert_eq!(with(&["get", "--server", &url, "k"]), b"over tls");
    let status: serde_json::Value = serde_json::from_slice(&with(&["cluster", "status", &url])).unwrap();
    assert_eq!(status["members"].as_array().map(Vec::len), Some(1), "{status}");
    drop(server);
}

/// etcd's v3 JSON gateway, for writing what an attacker with access to etcd would.
struct EtcdKv {
    base: String,
}

impl EtcdKv {
    fn of(url: &str) -> EtcdKv {
        let host = url.trim_start_matches("etcd://").split('/').next().unwrap();
        EtcdKv { base: format!("http://{host}/v3/kv") }
    }

    fn call(&self, what: &str, body: serde_json::Value) -> serde_json::Value {
        let text = ureq::post(&format!("{}/{what}", self.base)).send_string(&body.to_string()).unwrap();
        serde_json::from_str(&text.into_string().unwrap()).unwrap()
    }

    fn put(&self, key: &str, value: &[u8]) {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        self.call("put", serde_json::json!({"key": b64.encode(key), "value": b64.encode(value)}));
    }

    fn delete(&self, key: &str) {
        use base64::Engine as _;
        self.call("deleterange", serde_json::json!({"key": base64::engine::general_purpose::STANDARD.encode(key)}));
    }

    /// The key's value and lease, if it exists.
    fn get(&self, key: &str) -> Option<(Vec<u8>, i64)> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let got = self.call("range", serde_json::json!({"key": b64.encode(key)}));
        let kv = got["kvs"].as_array()?.first()?.clone();
        let value = b64.decode(kv["value"].as_str().unwrap_or("")).unwrap();
        let lease = kv["lease"].as_str().map_or(0, |l| l.parse().unwrap());
        Some((value, lease))
    }
}

/// An ordinary client (it has the token) sends replica frames by hand to a key's replica in
/// an R = 2 cluster: imports of a made-up generation (u64::MAX among them), with no ticket
/// or a forged one, an import of a delete, a handover hold, copies out to the other
/// member (a mover's, with and without a hold), a staged value published without a
/// ticket, and plain writes sent to one member by its address. Every
/// one is refused and changes nothing: both replicas keep the
/// value and generation the key's primary gave, and the next write's generation follows
/// on from it (no wrap).
#[test]
fn no_client_installs_a_generation_its_primary_did_not_give() {
    use remote_dram::proto::{flags, Op};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("forge");
    create(&url, 2);
    let servers = [member(&url), member(&url)];
    let mut c = client(&url);
    let key = b"counter";
    let g1 = c.put(key, b"given by the primary").unwrap();
    let forged = [0x5a; 16];
    for (i, server) in servers.iter().enumerate() {
        let other = servers[1 - i].addr.as_bytes();
        type Attempt<'a> = (&'a str, Op, &'a [u8], Box<dyn Fn(&mut remote_dram::proto::RequestHeader)>);
        let attempts: Vec<Attempt> = vec![
            (
                "import of u64::MAX",
                Op::Put,
                b"forged",
                Box::new(|h| {
                    h.flags |= flags::IMPORT;
                    h.if_equal = u64::MAX;
                }),
            ),
            (
                "import with a forged ticket",
                Op::Put,
                b"forged",
                Box::new(move |h| {
                    h.flags |= flags::IMPORT;
                    h.if_equal = g1 + 1;
                    h.set_ticket(&forged);
                }),
            ),
            (
                "import of a delete",
                Op::Delete,
                b"",
                Box::new(move |h| {
                    h.flags |= flags::IMPORT;
                    h.if_equal = g1 + 1;
                }),
            ),
            ("handover hold", Op::Get, b"", Box::new(|h| h.flags |= flags::MIGRATE)),
            ("copy out", Op::Get, other, Box::new(|h| h.flags |= flags::IMPORT | flags::FORWARD)),
            (
                "hand out",
                Op::Get,
                other,
                Box::new(move |h| {
                    h.flags |= flags::MIGRATE | flags::FORWARD;
                    h.set_ticket(&forged);
                }),
            ),
            (
                "handover end",
                Op::Delete,
                b"",
                Box::new(move |h| {
                    h.flags |= flags::MIGRATE | flags::IF_EQUAL;
                    h.if_equal = g1;
                }),
            ),
        ];
        for (what, op, value, edit) in attempts {
            let (status, message) = common::raw_request(&server.addr, op, key, value, edit);
            assert_eq!(status, Status::AuthFailed, "{what} on {}: {message}", server.addr);
            assert!(message.contains("ticket"), "{what}: {message}");
        }
        // A whole value staged (as clients once sent replicas), then published: neither is
        // taken.
        let mut stager = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        let (session, id) = stager.raw_session();
        let mut stage = remote_dram::proto::RequestHeader::new(Op::Put, id, session);
        stage.flags = flags::STAGE;
        stage.key_len = key.len() as u32;
        let frame = |h: &remote_dram::proto::RequestHeader| {
            let mut fixed = [0u8; remote_dram::proto::REQUEST_HEADER_LEN];
            h.encode(&mut fixed);
            [&fixed[..], key].concat()
        };
        let (status, _) =
            stager.raw_request(0, &frame(&stage), b"staged by a client", Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::Invalid, "only parts of a value are staged");
        let part = b"staged by a client";
        let staged_id = stager.raw_session().1;
        (stage.request_id, stage.flags) = (staged_id, flags::STAGE | flags::HAS_RANGE);
        (stage.range_start, stage.range_end) = (0, part.len() as i64);
        let (status, message) = stager.raw_request(0, &frame(&stage), part, Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::Ok, "a value staged in parts: {message}");
        // Its commit, as a client sends it to a key's primary but without a view: refused.
        let mut commit = stage;
        (commit.request_id, commit.if_not_equal) = (stager.raw_session().1, staged_id);
        (commit.range_start, commit.range_end) = (part.len() as i64, part.len() as i64);
        let (status, message) = stager.raw_request(0, &frame(&commit), b"", Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::Invalid, "a commit sent to a member by its address: {message}");
        let mut publish = remote_dram::proto::RequestHeader::new(Op::Put, stager.raw_session().1, session);
        publish.flags = flags::STAGE | flags::IMPORT;
        publish.if_not_equal = staged_id;
        publish.if_equal = u64::MAX - 1;
        publish.key_len = key.len() as u32;
        let (status, message) = stager.raw_request(0, &frame(&publish), b"", Duration::from_secs(10)).unwrap();
        assert_eq!(status, Status::AuthFailed, "a publish of a staged value: {message}");
        assert!(message.contains("ticket"), "a publish of a staged value: {message}");
        let held = Client::connect(&server.addr, ClientOptions::default()).unwrap().get(key).unwrap().unwrap();
        assert_eq!((held.data.as_slice(), held.generation), (&b"given by the primary"[..], g1), "{}", server.addr);
    }
    let g2 = c.put(key, b"next").unwrap();
    assert!(g2 > g1 && g2 < 1 << 63, "generations follow on: {g1} then {g2}");
    for server in &servers {
        let held = Client::connect(&server.addr, ClientOptions::default()).unwrap().get(key).unwrap().unwrap();
        assert_eq!((held.data.as_slice(), held.generation), (&b"next"[..], g2), "{}", server.addr);
    }
    // A client given a member's address writes nothing there (sent to one member alone, a
    // write would reach no other replica), and reads as from a plain server.
    for server in &servers {
        let mut direct = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        let refused = direct.put(key, b"by address").unwrap_err();
        assert_eq!(refused.status, Status::Invalid, "a put by address: {refused}");
        assert!(refused.message.contains("etcd://"), "{refused}");
        let refused = direct.delete(key).unwrap_err();
        assert_eq!(refused.status, Status::Invalid, "a delete by address: {refused}");
        let held = direct.get(key).unwrap().unwrap();
        assert_eq!((held.data.as_slice(), held.generation), (&b"next"[..], g2), "{}", server.addr);
    }
}

/// A range delete goes through each key's primary: while a member joins (keys moving to
/// it, slowly) and a writer keeps writing into the range, every key written before is
/// gone from every member, and every key left is held alike by two members. A member
/// given a range delete by its address refuses it, deleting nothing: each replica deleting
/// on its own would keep a write another lost, or take a copy in flight after its delete.
#[test]
fn a_range_delete_leaves_no_replica_behind_the_others() {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("range");
    create(&url, 2);
    let slow = ["--rebalance-rate", "512KiB"];
    let servers = [member_with(&url, &slow), member_with(&url, &slow), member_with(&url, &slow)];
    wait_until_placed(&url, 3);
    let range = KeyRange::prefix(b"r/");
    let mut c = client(&url);
    let value = vec![3u8; 1024];
    for i in 0..1500 {
        c.put(format!("r/old{i}").as_bytes(), &value).unwrap();
    }
    c.put(b"s/kept", b"outside the range").unwrap();

    let mut direct = Client::connect(&servers[0].addr, ClientOptions::default()).unwrap();
    let held = direct.list(&range).unwrap().len();
    assert!(held > 0, "the member holds keys of the range");
    let refused = direct.delete_range(&range).unwrap_err();
    assert_eq!(refused.status, Status::Invalid, "a range delete by address: {refused}");
    assert!(refused.message.contains("etcd://"), "{refused}");
    assert_eq!(direct.list(&range).unwrap().len(), held, "a refused range delete deleted keys");

    let stop = Arc::new(AtomicBool::new(false));
    let writer = std::thread::spawn({
        let (url, stop) = (url.clone(), stop.clone());
        move || {
            let mut w = client(&url);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                w.put(format!("r/new{n}").as_bytes(), b"written while the range is deleted").unwrap();
                n += 1;
            }
            n
        }
    });
    let (epoch, _, _) = placement(&url);
    let joiner = member(&url);
    let moving = wait_until(Duration::from_secs(30), || {
        let (e, _, settled) = placement(&url);
        e > epoch || !settled
    });
    assert!(moving, "no move toward the joining member: {}", status(&url));
    let removed = c.delete_range(&range).unwrap();
    assert!(removed >= 1500, "{removed} removed");
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    assert!(written > 0, "the writer wrote nothing while the range was deleted");
    wait_until_placed(&url, 4);

    let mut reader = client(&url);
    for i in 0..1500 {
        let key = format!("r/old{i}");
        assert_eq!(reader.get(key.as_bytes()).unwrap().map(|v| v.data), None, "{key} came back");
    }
    assert_eq!(reader.get(b"s/kept").unwrap().unwrap().data, b"outside the range");
    // Each member's copies of the range, by key: (member, generation). Copies a move left
    // behind are dropped as the next epoch begins, so wait for those.
    let holdings = || {
        let mut by_key: BTreeMap<Vec<u8>, Vec<(String, u64)>> = BTreeMap::new();
        for addr in servers.iter().chain([&joiner]).map(|s| &s.addr) {
            let mut direct = Client::connect(addr, ClientOptions::default()).unwrap();
            for entry in direct.list(&range).unwrap() {
                let Some(v) = direct.get(&entry.key).unwrap() else { continue };
                by_key.entry(entry.key).or_default().push((addr.clone(), v.generation));
            }
        }
        by_key
    };
    let alike = |copies: &[(String, u64)]| copies.len() == 2 && copies[0].1 == copies[1].1;
    let mut last = BTreeMap::new();
    let agreed = wait_until(Duration::from_secs(10), || {
        last = holdings();
        last.values().all(|copies| alike(copies))
    });
    let odd: Vec<_> = (last.iter())
        .filter(|(_, copies)| !alike(copies))
        .take(5)
        .map(|(k, c)| (String::from_utf8_lossy(k), c))
        .collect();
    assert!(agreed, "keys not held alike by two members: {odd:?}");
    assert!(last.keys().all(|k| k.starts_with(b"r/new")), "an old key is held still");
    for (key, copies) in &last {
        let v = reader.get(key).unwrap().unwrap();
        assert_eq!(v.generation, copies[0].1, "{}", String::from_utf8_lossy(key));
    }
}

/// What a writer to etcd can and cannot do. A member record it makes up (naming a port
/// this test listens on) is ignored: the placement never takes it and nothing connects to
/// it. A live member's record it deletes, or rewrites off its lease, is put back by that
/// member. A placement it garbles or deletes is written back, its epoch and version never
/// going back, and the cluster serves on throughout.
#[test]
fn etcd_writers_cannot_redirect_or_detach_members() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("trust");
    create(&url, 1);
    let servers = [member(&url), member(&url)];
    wait_until_placed(&url, 2);
    let kv = EtcdKv::of(&url);
    let prefix = "/remote_dram/trust/";
    let decoy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    decoy.set_nonblocking(true).unwrap();
    let decoy_addr = decoy.local_addr().unwrap().to_string();
    let fake = serde_json::json!({"address": decoy_addr, "shards": 1, "transport": "ucx", "capacity_bytes": 1 << 30});
    kv.put(&format!("{prefix}members/{decoy_addr}"), fake.to_string().as_bytes());
    let (epoch, placed, _) = placement(&url);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(placement(&url).1, placed, "a made-up member entered the placement");
    let (code, _, err) = rdram(&["put", "--server", &url, "k", "v"], None);
    assert_eq!(code, 0, "{err}");
    assert!(decoy.accept().is_err(), "something connected to the made-up member");

    // A live member's record deleted, then another's rewritten without its lease.
    for (server, how) in [(&servers[0], "deleted"), (&servers[1], "rewritten")] {
        let key = format!("{prefix}members/{}", server.addr);
        let (record, lease) = kv.get(&key).expect("a live member has a record");
        assert_ne!(lease, 0, "a member's record is under its lease");
        match how {
            "deleted" => kv.delete(&key),
            _ => kv.put(&key, &record),
        }
        assert!(
            wait_until(Duration::from_secs(10), || kv.get(&key).is_some_and(|(_, l)| l != 0)),
            "the member whose record was {how} did not register again"
        );
    }
    assert_eq!(placement(&url), (epoch, placed.clone(), true), "a live member left the placement");
    let (code, out, err) = rdram(&["get", "--server", &url, "k"], None);
    assert_eq!((code, out.as_slice()), (0, &b"v"[..]), "{err}");

    // The placement garbled, then deleted: written back, never going back.
    let version = |url: &str| status(url)["placement"]["version"].as_u64();
    for how in ["garbled", "deleted"] {
        let before = version(&url).unwrap();
        match how {
            "garbled" => kv.put(&format!("{prefix}placement"), b"{not a placement"),
            _ => kv.delete(&format!("{prefix}placement")),
        }
        assert!(
            wait_until(Duration::from_secs(10), || version(&url).is_some_and(|v| v > before)),
            "the {how} placement was not written back"
        );
        let (now_epoch, now_placed, _) = placement(&url);
        assert!(
            now_epoch >= epoch && now_placed == placed,
            "the {how} placement came back as epoch {now_epoch} on {now_placed:?}"
        );
        let (code, out, err) = rdram(&["get", "--server", &url, "k"], None);
        assert_eq!((code, out.as_slice()), (0, &b"v"[..]), "after the placement was {how}: {err}");
    }
}

/// 58.2: a member SIGKILLed does not lock new clients out. One of three servers (R = 2)
/// is killed while clients connect, which all do; a client started 0.5 s later, while the dead member is still in the
/// placement, connects to the others and reads every key at once (from the keys' other
/// replicas) and lists them all; its writes go through once the placement has moved on
/// without the dead member (its lease, plus the time to propose).
#[test]
fn a_dead_member_locks_no_new_client_out() {
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("alive");
    create(&url, 2);
    let mut servers = [member(&url), member(&url), member(&url)];
    wait_until_placed(&url, 3);
    let mut c = client(&url);
    let keys: Vec<String> = (0..30).map(|i| format!("alive/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        c.put(k.as_bytes(), &value_of(i)).unwrap();
    }
    drop(c);
    // Clients that connect while it dies, too: one whose handshake the dying server
    // resets connects without it.
    let connecting = {
        let url = url.clone();
        std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_millis(400);
            let mut connected = 0;
            while Instant::now() < until {
                Client::connect(&url, ClientOptions::default()).map_err(|e| format!("connect #{connected}: {e}"))?;
                connected += 1;
            }
            Ok::<_, String>(connected)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    servers[1].kill();
    let killed = Instant::now();
    let connected = connecting.join().unwrap().expect("a client connecting while a member dies is locked out");
    assert!(connected > 0);
    std::thread::sleep(Duration::from_millis(500).saturating_sub(killed.elapsed()));
    let mut fresh = Client::connect(&url, ClientOptions { timeout: Duration::from_secs(5), ..Default::default() })
        .expect("a new client is locked out by a dead member");
    // A batch, then each key on its own: both read the dead member's keys from their other
    // replica.
    let batch: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    for (i, (k, got)) in keys.iter().zip(fresh.get_many(&batch, 16)).enumerate() {
        let got =
            got.unwrap_or_else(|e| panic!("{k} unreadable in a batch {:?} after the kill: {e}", killed.elapsed()));
        assert_eq!(got.map(|v| v.data), Some(value_of(i)), "{k} in a batch");
    }
    for (i, k) in keys.iter().enumerate() {
        let got = fresh
            .get(k.as_bytes())
            .unwrap_or_else(|e| panic!("{k} unreadable {:?} after the kill: {e}", killed.elapsed()));
        assert_eq!(got.map(|v| v.data), Some(value_of(i)), "{k}");
    }
    let read_all = killed.elapsed();
    // A listing passes over the dead member: each of its keys is listed by its other replica.
    let listed: Vec<Vec<u8>> = (fresh.list(&KeyRange::prefix(b"alive/")))
        .unwrap_or_else(|e| panic!("no listing {:?} after the kill: {e}", killed.elapsed()))
        .into_iter()
        .map(|e| e.key)
        .collect();
    let mut all: Vec<Vec<u8>> = keys.iter().map(|k| k.clone().into_bytes()).collect();
    all.sort();
    assert_eq!(listed, all, "a listing {:?} after the kill", killed.elapsed());
    for (i, k) in keys.iter().enumerate() {
        let mut written = false;
        while !written && killed.elapsed() < Duration::from_millis(TTL_MS) + Duration::from_secs(5) {
            written = fresh.put(k.as_bytes(), &value_of(i + 1)).is_ok();
        }
        assert!(written, "{k} not writable {:?} after the kill", killed.elapsed());
    }
    eprintln!("after the kill: every key read by a new client at {read_all:?}, written by {:?}", killed.elapsed());
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(fresh.get(k.as_bytes()).unwrap().map(|v| v.data), Some(value_of(i + 1)), "{k}");
    }
    assert_eq!(fresh.delete_range(&KeyRange::prefix(b"alive/")).unwrap(), keys.len() as u64);
    assert_eq!(fresh.list(&KeyRange::prefix(b"alive/")).unwrap().len(), 0);
}

/// A write on its primary alone is read by no one: the primary copies it to the key's
/// other replicas before anyone sees it (here the copies are held 4 s by a test hook).
/// Writers killed after their primary took their write, readers meanwhile, then SIGKILL of
/// the primary: every read before saw the previous value or none, and after the failover
/// every key reads the value the readers saw, never older.
#[test]
fn a_write_is_read_only_once_every_replica_holds_it() {
    use remote_dram::cluster::{Placement, Routing};
    common::init(common::SHM);
    let etcd = Etcd::start();
    let url = etcd.url("unseen");
    create(&url, 2);
    let ttl = TTL_MS.to_string();
    let args = ["--workers", "1", "--cluster", &url, "--lease-ttl-ms", &ttl];
    const HOLD: Duration = Duration::from_secs(4);
    // Only the keys' primary holds its copies: the survivors' moves and the writes after
    // the failover go at once.
    let hold = [(remote_dram::cluster::replication::TEST_COPY_DELAY_ENV, "4000")];
    let mut servers =
        vec![ServerProc::start_with_env(&args, &hold), ServerProc::start(&args), ServerProc::start(&args)];
    wait_until_placed(&url, 3);
    let routing = Routing::new(serde_json::from_value::<Placement>(status(&url)["placement"].clone()).unwrap());
    let primary = servers[0].addr.clone();
    let keys: Vec<String> = (0..)
        .map(|i| format!("unseen/{i}"))
        .filter(|k| routing.owner(k.as_bytes()) == Some(&primary))
        .take(8)
        .collect();
    let old = |i: usize| format!("old-{i}");
    let mut c = client(&url);
    let items: Vec<(&[u8], Vec<u8>)> =
        keys.iter().enumerate().map(|(i, k)| (k.as_bytes(), old(i).into_bytes())).collect();
    let items: Vec<(&[u8], &[u8])> = items.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    for r in c.put_many(&items, 8) {
        r.expect("an acknowledged first write");
    }
    let spawned = Instant::now();
    let writers: Vec<Child> = keys
        .iter()
        .map(|k| {
            Command::new(RDRAM)
                .args(["put", "--server", &url, "--timeout-ms", "20000", k, "new"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(400));
    for mut w in writers {
        w.kill().unwrap();
        let status = w.wait().unwrap();
        assert!(!status.success(), "a writer was answered before its copies could have ended");
    }
    let mut reader =
        Client::connect(&url, ClientOptions { timeout: Duration::from_millis(100), ..Default::default() }).unwrap();
    let mut seen = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        match reader.get(k.as_bytes()) {
            Ok(v) => {
                let v = v.map(|v| String::from_utf8(v.data).unwrap());
                assert_eq!(v.as_deref(), Some(old(i).as_str()), "{k}: a read saw a write its replica lacks");
                seen.push(k.clone());
            }
            Err(e) => assert_eq!(e.status, remote_dram::Status::Unavailable, "{k}: {e}"),
        }
    }
    servers[0].kill();
    assert!(spawned.elapsed() < HOLD, "the primary outlived its copies' hold: the test proves nothing");
    let mut after =
        Client::connect(&url, ClientOptions { timeout: Duration::from_secs(10), ..Default::default() }).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let v = after.get(k.as_bytes()).unwrap().map(|v| String::from_utf8(v.data).unwrap());
        assert_eq!(v.as_deref(), Some(old(i).as_str()), "{k} after the primary's death");
    }
    eprintln!("{} of {} keys read during the copies' hold (the others refused until timeout)", seen.len(), keys.len());
    let next: Vec<Vec<u8>> = (0..keys.len()).map(|i| format!("next-{i}").into_bytes()).collect();
    let items: Vec<(&[u8], &[u8])> = keys.iter().zip(&next).map(|(k, v)| (k.as_bytes(), v.as_slice())).collect();
    for (k, r) in keys.iter().zip(after.put_many(&items, 8)) {
        r.unwrap_or_else(|e| panic!("{k} not written after the failover: {e}"));
    }
    for (k, v) in keys.iter().zip(&next) {
        assert_eq!(after.get(k.as_bytes()).unwrap().map(|v| v.data).as_ref(), Some(v), "{k}");
    }
    drop(servers);
}
