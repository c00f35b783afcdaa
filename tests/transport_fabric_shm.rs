//! The transport suite with servers on libfabric's `shm` provider, plus departed clients
//! and striping over several rails.
mod common;
mod suite;

use std::time::Duration;

fabric_suite!(common::FABRIC_SHM);

/// The shm regions (16 MiB each in /dev/shm) of a process that was SIGKILLed stay on the
/// host until the next shm endpoint finds that their owner's lock is free.
#[test]
fn regions_of_a_killed_server_are_reclaimed_by_the_next_endpoint() {
    common::init(common::FABRIC_SHM);
    let regions_of = |pid: u32| -> Vec<String> {
        let prefix = format!("rdram-{pid}-");
        let dir = std::fs::read_dir("/dev/shm").unwrap();
        dir.filter_map(|e| e.unwrap().file_name().into_string().ok()).filter(|n| n.starts_with(&prefix)).collect()
    };
    let mut killed = common::ServerProc::start(&[]);
    let killed_pid = killed.child.id();
    let left = regions_of(killed_pid);
    // Two workers: a region and a lock file each.
    assert_eq!(left.len(), 4, "regions of a living server: {left:?}");
    killed.kill();
    assert_eq!(regions_of(killed_pid), left, "SIGKILL leaves the regions (nothing unlinks them)");

    let mut next = common::ServerProc::start(&[]);
    let next_pid = next.child.id();
    assert!(regions_of(killed_pid).is_empty(), "still there: {:?}", regions_of(killed_pid));
    assert_eq!(regions_of(next_pid).len(), 4, "the next server's own: {:?}", regions_of(next_pid));
    let mut client = next.client();
    client.put(b"k", b"v").unwrap();
    assert_eq!(client.get(b"k").unwrap().expect("stored").data, b"v");
    drop(client);
    let status = next.stop().expect("the server stopped within 10 s");
    assert!(status.success(), "{status}");
    assert!(regions_of(next_pid).is_empty(), "a clean shutdown unlinks: {:?}", regions_of(next_pid));
}

/// An embedded server on libfabric shm stopped under a client of the same process: the
/// client's next calls fail (it was lost), and nothing touches the stopped server's
/// unmapped region. libfabric's shm reaches same-process endpoints through their own
/// mapping, and the client's next send crashed the process (SIGSEGV).
#[test]
fn an_embedded_server_stopped_under_a_client_of_the_same_process() {
    use remote_dram::server::{Server, ServerConfig, TransportChoice};
    common::init(common::FABRIC_SHM);
    for round in 0..3 {
        let server = Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            workers: 1,
            memory: 64 << 20,
            hugepages: remote_dram::store::HugePages::Off,
            transport: TransportChoice::Fabric { provider: "shm".into(), rails: 1 },
            ..Default::default()
        })
        .unwrap();
        let options = remote_dram::ClientOptions { timeout: std::time::Duration::from_secs(2), ..common::options() };
        let mut client = remote_dram::Client::connect(&server.local_addr().to_string(), options).unwrap();
        let value = common::pattern(round, 3 << 20);
        client.put(b"k", &value).unwrap();
        assert_eq!(client.get(b"k").unwrap().expect("stored").data, value);
        server.stop();
        for _ in 0..3 {
            assert!(client.get(b"k").is_err(), "round {round}: a stopped server answered");
        }
    }
}

/// Takes the spinlock of the libfabric shm region at `path` for good, from this process:
/// what a process that dies or stalls inside libfabric leaves (the lock lies at byte 24 of
/// libfabric 1.17's `struct smr_region`). Returns once it is held.
fn hold_region_lock(path: &std::path::Path) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let map = memmap2::MmapOptions::new().len(4096).map_raw(&file).unwrap();
    // SAFETY: a process-shared spinlock inside a shared mapping that is leaked below.
    let lock = unsafe { map.as_mut_ptr().add(24).cast::<libc::pthread_spinlock_t>() };
    // SAFETY: as above.
    let take = || unsafe { libc::pthread_spin_trylock(lock) } == 0;
    assert!(common::wait_until(Duration::from_secs(5), take), "the lock of {} stayed busy", path.display());
    std::mem::forget(map);
}

/// The regions (not lock files) in /dev/shm of process `pid`.
fn regions_of(pid: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("rdram-{pid}-");
    let dir = std::fs::read_dir("/dev/shm").unwrap();
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name().to_string_lossy().starts_with(&prefix) && !e.file_name().to_string_lossy().ends_with(".lock")
        })
        .map(|e| e.path())
        .collect()
}

/// Runs `rdram ARGS` and returns its exit code and stdout, failing the test if it has not
/// returned within `limit` (a client spinning inside libfabric, whose own timeout cannot fire).
fn rdram_within(limit: Duration, args: &[&str]) -> (i32, Vec<u8>) {
    use std::process::{Command, Stdio};
    let mut child =
        Command::new(common::RDRAM).args(args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
    let exited = common::wait_until(limit, || child.try_wait().unwrap().is_some());
    if !exited {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    assert!(exited, "rdram {args:?} had not returned after {limit:?}");
    (out.status.code().unwrap_or(-1), out.stdout)
}

/// The server's metrics page, or why it could not be had (with the server's state, for a
/// server that died).
fn scrape(server: &common::ServerProc) -> Result<String, String> {
    let url = format!("http://{}/metrics", server.metrics.as_ref().expect("started with --metrics"));
    let pid = server.child.id();
    let state =
        || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| format!("no /proc/{pid}/stat: {e}"));
    let failed = |e: &dyn std::fmt::Display| format!("scraping {url}: {e}; server: {}", state());
    let response = ureq::get(&url).timeout(Duration::from_secs(5)).call().map_err(|e| failed(&e))?;
    response.into_string().map_err(|e| failed(&e))
}

/// The sum of a metric's samples whose line starts with `name` and contains `labels`;
/// `None` when there is no such sample (a counter appears once it counted something).
fn samples_total(text: &str, name: &str, labels: &str) -> Option<u64> {
    let lines = text.lines().filter(|l| l.starts_with(name) && l.contains(labels));
    let samples: Vec<u64> = lines.filter_map(|l| l.rsplit(' ').next()?.parse().ok()).collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

/// The sum of a counter's samples (all label sets) on the server's metrics endpoint.
fn counter_total(server: &common::ServerProc, name: &str) -> u64 {
    let text = scrape(server).unwrap_or_else(|e| panic!("{e}"));
    samples_total(&text, name, "").unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// How many GETs `server` has answered (0 before its first).
fn gets_answered(server: &common::ServerProc) -> Option<u64> {
    scrape(server).ok().map(|t| samples_total(&t, "rdram_requests_total", "op=\"get\"").unwrap_or(0))
}

/// Waits (30 s at most) until `server` has answered a GET more than it had before the
/// call: a getter (such as a [`large_getter`]) has connected and is getting (a slow machine
/// takes longer than any fixed sleep).
fn until_getting(server: &common::ServerProc) {
    let before = gets_answered(server).unwrap_or(0);
    let answered_more = || gets_answered(server).is_some_and(|n| n > before);
    assert!(common::wait_until(Duration::from_secs(30), answered_more), "the getter never got");
}

/// A local sender that dies or stalls while it copies a message into a shard's region
/// leaves the region's lock held: the shard's own polling and every other local client then
/// spun inside libfabric for good (a `get` with a 3 s timeout was still hung at 10 s). The
/// lock is released after about a second, and the shard serves again.
#[test]
fn a_sender_that_dies_holding_a_shards_region_lock_does_not_wedge_it() {
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&["--metrics", "127.0.0.1:0"]);
    let addr = server.addr.as_str();
    let (code, _) = rdram_within(Duration::from_secs(15), &["put", "--server", addr, "k", "before"]);
    assert_eq!(code, 0);
    let regions = regions_of(server.child.id());
    assert_eq!(regions.len(), 2, "one region per worker: {regions:?}");
    for region in &regions {
        hold_region_lock(region);
    }
    let (code, value) = rdram_within(Duration::from_secs(15), &["get", "--server", addr, "--timeout-ms", "5000", "k"]);
    assert_eq!((code, value.as_slice()), (0, b"before".as_slice()));
    let (code, _) = rdram_within(Duration::from_secs(15), &["put", "--server", addr, "k", "after"]);
    assert_eq!(code, 0);
    let (code, value) = rdram_within(Duration::from_secs(15), &["get", "--server", addr, "k"]);
    assert_eq!((code, value.as_slice()), (0, b"after".as_slice()));
}

/// A client killed while it polls its own region holds that region's lock for good; the
/// shard's next reply to it then spun in libfabric (100 % CPU, no one answered again). The
/// server releases the dead client's lock and serves everyone else.
///
/// The shard spins only if a reply to the client was still due when the lock was taken (a
/// client window of 16 requests makes that likely, not certain; with none due, the server
/// sees the client depart and unmaps its region untouched). So every try checks that the
/// shard still serves, and some try must have had the server release a lock.
#[test]
fn a_client_killed_holding_its_own_region_lock_does_not_wedge_the_shard() {
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&["--metrics", "127.0.0.1:0"]);
    let addr = server.addr.as_str();
    for attempt in 0..5 {
        kill_a_getter_holding_its_own_region_lock(addr, &server);
        for i in 0..4 {
            let key = format!("k{attempt}.{i}");
            let (code, _) =
                rdram_within(Duration::from_secs(15), &["put", "--server", addr, "--timeout-ms", "5000", &key, "v"]);
            assert_eq!(code, 0, "try {attempt}: put {key}");
            let (code, value) =
                rdram_within(Duration::from_secs(15), &["get", "--server", addr, "--timeout-ms", "5000", &key]);
            assert_eq!((code, value.as_slice()), (0, b"v".as_slice()), "try {attempt}: get {key}");
        }
        if counter_total(&server, "rdram_shm_locks_released_total") >= 1 {
            return;
        }
    }
    panic!("the server released no lock in 5 tries: no reply was ever due to the killed client");
}

/// Starts a pipelined getter, takes its own region's lock once it is getting, and kills it.
fn kill_a_getter_holding_its_own_region_lock(addr: &str, server: &common::ServerProc) {
    use std::process::{Command, Stdio};
    let bench = common::bench_binary("rdram-bench");
    let mut client = Command::new(bench)
        .args(["--server", addr, "--ops", "get", "--sizes", "8", "--keys", "1", "--depth", "16", "--seconds", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = client.id();
    assert!(
        common::wait_until(Duration::from_secs(10), || !regions_of(pid).is_empty()),
        "the client opened no shm region"
    );
    until_getting(server); // connected and busy getting
    for region in regions_of(pid) {
        hold_region_lock(&region);
    }
    common::signal(pid, common::SIGKILL);
    client.wait().unwrap();
}

/// A client that sends requests and never takes its replies fills its own receive queue
/// (1024 messages on shm; a 64 KiB reply is two); the shard's next reply to it then
/// waited on that queue for good and the shard answered no one again. Now that send gives
/// up after a second, the hog is dropped, the shard's endpoints are replaced (its large
/// sends stalled everyone's: see the next test), and the others, after reconnecting once,
/// are served.
#[test]
fn a_client_that_never_receives_does_not_wedge_the_shard() {
    use remote_dram::proto::{Op, RequestHeader, REQUEST_HEADER_LEN};
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let options = remote_dram::ClientOptions { timeout: Duration::from_secs(10), ..common::options() };
    let mut other = remote_dram::Client::connect(&server.addr, options.clone()).unwrap();
    other.put(b"k", b"v").unwrap();
    other.put(b"big", &common::pattern(1, 64 << 10)).unwrap();
    let mut hog = remote_dram::Client::connect(&server.addr, options).unwrap();
    let mut sent = 0;
    while sent < 900 {
        let (session, id) = hog.raw_session();
        let mut buf = [0u8; REQUEST_HEADER_LEN];
        let mut header = RequestHeader::new(Op::Get, id, session);
        header.key_len = 3;
        header.ttl_or_limit = (64 << 10) + 1;
        header.encode(&mut buf);
        if hog.raw_submit(0, &buf, b"big").is_err() {
            break; // its receives are all posted
        }
        sent += 1;
    }
    assert!(sent >= 600, "the hog sent only {sent} requests");
    let replaced = || scrape(&server).ok().and_then(|t| samples_total(&t, "rdram_worker_replacements_total", ""));
    assert!(
        common::wait_until(Duration::from_secs(10), || replaced().is_some_and(|n| n >= 1)),
        "the shard's endpoints were not replaced after its send to the hog gave up"
    );
    // The shard moved to new endpoints: the server tells its clients, whose call in
    // flight fails at once (not at its 10 s timeout); the next one reconnects.
    let started = std::time::Instant::now();
    if let Err(e) = other.get(b"k") {
        assert_eq!(e.status, remote_dram::Status::Unavailable, "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "told only after {:?}", started.elapsed());
    }
    for _ in 0..3 {
        assert_eq!(other.get(b"big").expect("others are served").expect("stored").data, common::pattern(1, 64 << 10));
    }
    drop(hog);
}

/// `rdram-bench` getting 3 MiB values (8 keys it stores first) for `seconds`.
fn large_getter(server: &common::ServerProc, seconds: &str) -> std::process::Child {
    getter_of(server, seconds, "3145728", "8")
}

/// `rdram-bench` getting `keys` values of `size` bytes for `seconds`.
fn getter_of(server: &common::ServerProc, seconds: &str, size: &str, keys: &str) -> std::process::Child {
    use std::process::{Command, Stdio};
    Command::new(common::bench_binary("rdram-bench"))
        .args(["--server", &server.addr, "--ops", "get", "--sizes", size, "--keys", keys, "--seconds", seconds])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Stops `getter` (SIGSTOP) while one of its large GET replies is in flight, an extent
/// pinned for it. Stopped between two GETs instead, with nothing in flight and so nothing
/// for the shard to replace when it is killed, it is let go on and stopped again: a kill
/// at a fixed moment landed in that gap now and then on a loaded machine.
fn stop_during_a_large_get(server: &common::ServerProc, getter: &std::process::Child) {
    let pinned = || scrape(server).ok().and_then(|t| samples_total(&t, "rdram_pinned_extents", "")).unwrap_or(0);
    for _ in 0..20 {
        common::stop_process(getter.id());
        // Past the gauge's next publication (every 100 ms): a value published just before
        // the stop may name a GET that has since ended.
        std::thread::sleep(Duration::from_millis(300));
        if pinned() > 0 {
            return;
        }
        common::signal(getter.id(), common::SIGCONT);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the getter was never stopped with a large GET in flight");
}

/// Waits (40 s at most) for a [`large_getter`] to finish, asserts that it succeeded, and
/// returns its report.
fn large_gets_finish(mut getter: std::process::Child) -> String {
    let finished = common::wait_until(Duration::from_secs(40), || getter.try_wait().unwrap().is_some());
    if !finished {
        let _ = getter.kill();
    }
    let out = getter.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        finished && out.status.success(),
        "the next client's large GETs did not finish ({:?}):\n{report}\n{stderr}",
        out.status
    );
    assert!(report.contains("| get | 3145728 |"), "{report}");
    report
}

/// libfabric's shm sender of a large message waits for the receiver's answer in one
/// queue, read in order: a client killed during a large GET never answers, and every
/// later large send of the shard, to anyone, waited behind it (the next client's large
/// GETs all timed out). The shard replaces its endpoints when such a client leaves.
#[test]
fn a_client_killed_during_a_large_get_does_not_stall_later_large_gets() {
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let getter = |seconds: &str| large_getter(&server, seconds);
    // 16 MiB GETs: one is in flight at nearly every moment, so the stop below seldom
    // needs a second try.
    let mut killed = getter_of(&server, "30", "16777216", "1");
    until_getting(&server);
    stop_during_a_large_get(&server, &killed);
    common::signal(killed.id(), common::SIGKILL);
    killed.wait().unwrap();
    // The shard replaces its endpoints once it sees the client leave.
    let replacements = || scrape(&server).ok().and_then(|t| samples_total(&t, "rdram_worker_replacements_total", ""));
    assert!(
        common::wait_until(Duration::from_secs(10), || replacements().is_some_and(|n| n >= 1)),
        "no endpoint replacement counted after the client was killed"
    );
    large_gets_finish(getter("2"));
}

/// A shard whose endpoint replacement failed (here: the server was out of file
/// descriptors for a while) tries again until it succeeds. It used to warn once and never
/// try again: its large sends stayed stalled behind the departed client for good.
#[test]
fn a_failed_endpoint_replacement_is_tried_again() {
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&["--workers", "1", "--metrics", "127.0.0.1:0"]);
    let pid = server.child.id() as libc::pid_t;
    let getter = |seconds: &str| large_getter(&server, seconds);
    let nofile = |limit: Option<libc::rlimit>| {
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        let new = limit.as_ref().map_or(std::ptr::null(), |l| l as *const libc::rlimit);
        // SAFETY: pid is our child; new is null or a valid rlimit; old is an out-parameter.
        assert_eq!(
            unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, new, &mut old) },
            0,
            "prlimit: {}",
            std::io::Error::last_os_error()
        );
        old
    };
    let mut killed = getter("30");
    until_getting(&server);
    stop_during_a_large_get(&server, &killed);
    // No new file descriptor for the server: new endpoints cannot be opened. The limit is
    // below what is open, so that the descriptors the killed client's departure closes
    // do not make room for the replacement.
    let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as libc::rlim_t;
    let saved = nofile(None);
    nofile(Some(libc::rlimit { rlim_cur: open_fds.saturating_sub(16), rlim_max: saved.rlim_max }));
    common::signal(killed.id(), common::SIGKILL);
    killed.wait().unwrap();
    std::thread::sleep(Duration::from_secs(2)); // time for the replacement to fail (checked below)
    nofile(Some(saved));
    // Scraping may fail for a moment after the descriptors come back (the endpoint's accept
    // loop retries); the server must still be there and count the replacement.
    let mut last = Err(String::new());
    let replaced = common::wait_until(Duration::from_secs(15), || {
        last = scrape(&server).map(|t| samples_total(&t, "rdram_worker_replacements_total", ""));
        last.as_ref().is_ok_and(|n| n.is_some_and(|n| n >= 1))
    });
    assert!(replaced, "the failed replacement was not tried again once file descriptors were back: {last:?}");
    let failed = scrape(&server).map(|t| samples_total(&t, "rdram_worker_replacement_failures_total", ""));
    assert!(
        failed.as_ref().is_ok_and(|n| n.is_some_and(|n| n >= 1)),
        "the premise did not hold: no replacement failed while file descriptors were out ({failed:?})"
    );
    large_gets_finish(getter("2"));
}

/// A client whose large GET timed out before any of the reply came (the server was
/// stopped) receives that reply into its own memory, not the caller's, before it
/// reconnects. Left unanswered, shm's sender waits for the answer for good, and the shard
/// had to replace its endpoints, which costs every one of its clients a failed call.
#[test]
fn a_large_get_given_up_on_is_received_and_dropped_not_left_unanswered() {
    use remote_dram::client::GetOptions;
    use remote_dram::{ClientOptions, Status};
    common::init(common::FABRIC_SHM);
    const LEN: usize = 64 << 20;
    let server = common::ServerProc::start(&["--workers", "1", "--memory", "256MiB", "--metrics", "127.0.0.1:0"]);
    let value = common::pattern(3, LEN);
    let mut other = common::connect(&server.addr);
    other.put(b"big", &value).unwrap();
    let mut hasty = remote_dram::Client::connect(
        &server.addr,
        ClientOptions { timeout: Duration::from_millis(300), ..common::options() },
    )
    .unwrap();
    let mut out = vec![0u8; LEN];
    for round in 0..3 {
        common::stop_process(server.child.id());
        let got = hasty.get_into(b"big", &GetOptions::default(), &mut out);
        out.fill(0x11);
        common::signal(server.child.id(), common::SIGCONT);
        assert_eq!(got.err().map(|e| e.status), Some(Status::Timeout), "round {round}");
        std::thread::sleep(Duration::from_millis(300)); // the reply reaches the old connection
                                                        // The next call reconnects; the other client never notices.
        assert_eq!(hasty.get(b"big").unwrap().unwrap().data.len(), LEN, "round {round}");
        assert_eq!(other.get(b"big").unwrap().unwrap().data, value, "round {round}");
        assert!(
            out.iter().all(|&b| b == 0x11),
            "round {round}: the caller's buffer was written after the call returned"
        );
    }
    assert!(common::wait_until(Duration::from_secs(2), || counter_total(&server, "rdram_shm_locks_released") == 0));
    assert_eq!(counter_total(&server, "rdram_worker_replacements_total"), 0, "the shard replaced its endpoints");
}

/// shm moves messages up to its 4 KiB inject size inline and longer ones by a slower
/// protocol, so a request between 4 and 16 KiB travels in inline parts that the worker
/// joins (proto::fabric::split_request). Values and keys around every boundary, from one
/// client and from several at once, and parts that do not add up.
#[test]
fn requests_longer_than_the_inline_size_travel_in_parts() {
    use remote_dram::proto::fabric::{PartHeader, PART_HEADER_LEN};
    use remote_dram::proto::{flags, Op, RequestHeader, REQUEST_HEADER_LEN};
    common::init(common::FABRIC_SHM);
    let server = common::ServerProc::start(&[]);
    let mut c = server.client();
    // A 3-byte key: 72 + 3 + 4021 is exactly 4096 bytes, one message; one more, two parts.
    let sizes =
        [4000, 4020, 4021, 4022, 4096, 4097, 6000, 8100, 8150, 12_000, 16_000, 16_200, 16_309, 16_310, 16_384, 20_000];
    for (i, size) in sizes.into_iter().enumerate() {
        let value = common::pattern(i as u64, size);
        let key = format!("k{:02}", i % 100);
        let key = &key.as_bytes()[..3];
        let g = c.put(key, &value).unwrap();
        let got = c.get(key).unwrap().expect("stored");
        assert!(got.data == value && got.generation == g, "{size}-byte value");
    }
    // A key long enough to travel in the payload, itself longer than one message.
    let long_key = common::pattern(99, 6000);
    c.put(&long_key, b"under a long key").unwrap();
    assert_eq!(c.get(&long_key).unwrap().expect("stored").data, b"under a long key");
    // Requests in flight together, from several clients at once: the worker joins each
    // client's parts apart.
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let addr = server.addr.clone();
            s.spawn(move || {
                let mut c = common::connect(&addr);
                let values: Vec<Vec<u8>> =
                    (0..40).map(|i| common::pattern(t * 100 + i, 5000 + 97 * i as usize)).collect();
                let keys: Vec<String> = (0..40).map(|i| format!("t{t}/{i}")).collect();
                let items: Vec<(&[u8], &[u8])> =
                    keys.iter().zip(&values).map(|(k, v)| (k.as_bytes(), &v[..])).collect();
                for r in c.put_many(&items, 8) {
                    r.unwrap();
                }
                for (k, v) in keys.iter().zip(&values) {
                    assert!(c.get(k.as_bytes()).unwrap().expect("stored").data == *v, "{k}");
                }
            });
        }
    });
    // Parts that do not add up are dropped or refused; the server goes on serving.
    let (session, id) = c.raw_session();
    let mut h = RequestHeader::new(Op::Put, id, session);
    h.key_len = 3;
    h.flags = flags::IN_PARTS;
    let mut first = [0u8; REQUEST_HEADER_LEN].to_vec();
    h.encode((&mut first[..]).try_into().unwrap());
    first.extend_from_slice(b"bad");
    c.raw_submit(0, &first, &[7u8; 4000]).unwrap();
    // More parts than a request may hold (16 KiB in all): the request is refused.
    for _ in 0..4 {
        let part = PartHeader { request_id: id, credential: 0, last: false }.encode();
        c.raw_submit(0, &part, &[7u8; 4096 - PART_HEADER_LEN]).unwrap();
    }
    // A part whose start never came: dropped, unanswered.
    let (_, orphan) = c.raw_session();
    let part = PartHeader { request_id: orphan + 1000, credential: 0, last: true }.encode();
    let err = c.raw_request(0, &part, b"stray", Duration::from_millis(300)).unwrap_err();
    assert_eq!(err.status, remote_dram::Status::Timeout, "{err}");
    assert!(c.get(b"bad").unwrap().is_none(), "the refused request stored nothing");
    assert_eq!(c.get(b"k00").unwrap().expect("still there").data, common::pattern(0, 4000));
    let mut fresh = server.client();
    fresh.put(b"after", &common::pattern(5, 9000)).unwrap();
    assert_eq!(fresh.get(b"after").unwrap().expect("stored").data, common::pattern(5, 9000));
}
