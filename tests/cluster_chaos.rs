//! The cluster's chaos soak (`make soak`, not in CI): etcd and `rdram serve --cluster`
//! members (R = 2) that are SIGKILLed and replaced, paused past their lease, joined,
//! drained (`rdram cluster drain`) and stopped (SIGTERM without `--drain`), one change at a time at random, for CHAOS_SECS (default 300; seed CHAOS_SEED;
//! the members' transport CHAOS_TRANSPORT, as `common::init` takes it, default UCX shm),
//! under writers of new keys, an overwriter, a deleter, a range deleter, compare-and-swap counters and
//! readers, each a client of its own given the cluster's `etcd://` string.
//!
//! Checked, while it runs and at the end:
//! - no read goes back in time: a read returns a generation at least that of every write
//!   and read of the key that completed before it started (docs/cluster.md, Guarantees);
//! - every value read is whole and the key's own;
//! - no acknowledged write is lost, and no acknowledged delete (of a key or a range) undone;
//! - the counters hold every acknowledged increment, and at most the unsure ones besides;
//! - at the end every acknowledged key is on exactly R members, and no key on more.
//!
//! Calls may fail while a change is under way (they are counted, not checked); what they
//! leave is. A failed run names a file with every violation, each with the time (s from
//! the load's start) its key was acknowledged and it was seen, beside the changes' times.
mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::cluster::{client, create, member_with, placement, status, Etcd, TTL_MS};
use common::{pattern, rdram, wait_until, ServerProc, SIGCONT, SIGSTOP};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use remote_dram::client::{KeyRange, PutOptions, WriteCondition, WriteResult};
use remote_dram::{Client, ClientOptions};

const REPLICAS: u32 = 2;
const HOT_KEYS: u64 = 16;
const COUNTERS: u64 = 4;
/// Members the cluster keeps between changes: a join takes it to one more, a drain or a
/// leave back (a killed member is replaced).
const MEMBERS: usize = 3;
/// Each member's memory: with two members left (after a kill, before its replacement
/// joins), each holds every key the writers added in a soak of the default length.
const MEMORY: &str = "1GiB";

/// A value that says what it is: the key's id and the version written, then bytes derived
/// from them, so a reader tells a whole value of its own key from a torn or foreign one.
fn value(id: u64, version: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(16));
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&pattern(id.wrapping_mul(1_000_003) ^ version, len.saturating_sub(16)));
    v
}

/// The version a value of key `id` claims, if it is whole and the key's own.
fn version_of(id: u64, v: &[u8]) -> Option<u64> {
    let claimed = u64::from_le_bytes(v.get(..8)?.try_into().ok()?);
    let version = u64::from_le_bytes(v.get(8..16)?.try_into().ok()?);
    (claimed == id && v[16..] == pattern(id.wrapping_mul(1_000_003) ^ version, v.len() - 16)).then_some(version)
}

/// A hot key's size, taking each of a write's ways: small and large copies (the latter
/// by a replicator thread over libfabric and UCX tcp, by the shard's worker over shared
/// memory), and a value sent in more than one fragment.
fn hot_size(rng: &mut impl Rng) -> usize {
    match rng.gen_range(0..20) {
        0 => 1 << 20,
        1..=3 => rng.gen_range(16 * 1024..300 * 1024),
        _ => rng.gen_range(16..4096),
    }
}

/// A new key's size: small, so that what the writers add fits the members' memory for the
/// whole soak, and now and then past what the shard's worker copies itself.
fn new_size(rng: &mut impl Rng) -> usize {
    match rng.gen_range(0..50) {
        0 => rng.gen_range(16 * 1024..64 * 1024),
        _ => rng.gen_range(16..1024),
    }
}

fn unique_id(writer: u64, i: u64) -> u64 {
    (writer + 1) << 40 | i
}

fn unique_key(id: u64) -> Vec<u8> {
    format!("u/{id:x}").into_bytes()
}

/// The range deleter's keys: [`RANGE_BATCH`] per batch, under the batch's prefix.
fn range_prefix(batch: u64) -> Vec<u8> {
    format!("r/{batch:x}/").into_bytes()
}

const RANGE_BATCH: u64 = 20;

fn hot_key(k: u64) -> Vec<u8> {
    format!("h/{k}").into_bytes()
}

fn counter_key(k: u64) -> Vec<u8> {
    format!("c/{k}").into_bytes()
}

/// When the load started: the changes and the violations say their times from it.
static START: OnceLock<Instant> = OnceLock::new();

fn elapsed_s() -> f64 {
    START.get().map_or(0.0, |s| s.elapsed().as_secs_f64())
}

/// What the load saw and was told.
#[derive(Default)]
struct Ledger {
    /// Per key, the highest generation a completed write or read of it returned.
    floors: HashMap<Vec<u8>, u64>,
    /// New keys acknowledged, by writer: writer 0's are never deleted.
    written: [Vec<u64>; 2],
    /// When each new key was acknowledged (s), and its generation.
    acked: HashMap<u64, (f64, u64)>,
    /// Writer 1's keys whose delete was acknowledged, and those whose delete failed.
    deleted: HashSet<u64>,
    deleted_at: HashMap<u64, Duration>,
    delete_unsure: HashSet<u64>,
    /// Deletes answered "not there" (after an attempt lost with its server).
    deletes_not_there: u64,
    /// The range deleter's batches whose range delete was acknowledged.
    ranges_deleted: Vec<u64>,
    /// The hot keys' versions acknowledged, highest.
    hot_versions: HashMap<u64, u64>,
    increments: u64,
    increments_unsure: u64,
    reads: u64,
    /// Failed calls, by kind.
    errors: HashMap<&'static str, u64>,
    /// What breaks a guarantee.
    violations: Vec<String>,
}

impl Ledger {
    fn floor(&self, key: &[u8]) -> u64 {
        self.floors.get(key).copied().unwrap_or(0)
    }

    fn completed(&mut self, key: &[u8], generation: u64) {
        let f = self.floors.entry(key.to_vec()).or_insert(0);
        *f = (*f).max(generation);
    }

    fn failed(&mut self, what: &'static str) {
        *self.errors.entry(what).or_insert(0) += 1;
    }
}

type Shared = Arc<Mutex<Ledger>>;

/// A client that waits long enough to ride out a change (a lease is [`TTL_MS`]).
fn patient_client(url: &str) -> Client {
    Client::connect(url, ClientOptions { timeout: Duration::from_secs(10), ..Default::default() }).unwrap()
}

fn start_load(url: &str, stop: &Arc<AtomicBool>, ledger: &Shared, seed: u64) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    let mut spawn = |name: &str, body: Box<dyn FnOnce(Client, SmallRng) + Send>| {
        let (url, n) = (url.to_string(), threads.len() as u64);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || body(patient_client(&url), SmallRng::seed_from_u64(seed ^ n)))
            .unwrap();
        threads.push(thread);
    };
    for writer in 0..2u64 {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        spawn(
            "writer",
            Box::new(move |mut c, mut rng| {
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    let id = unique_id(writer, i);
                    i += 1;
                    let key = unique_key(id);
                    let result = c.put(&key, &value(id, 0, new_size(&mut rng)));
                    let mut l = ledger.lock().unwrap();
                    match result {
                        Ok(generation) => {
                            l.completed(&key, generation);
                            l.written[writer as usize].push(id);
                            l.acked.insert(id, (elapsed_s(), generation));
                        }
                        Err(_) => l.failed("put"),
                    }
                }
            }),
        );
    }
    {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        spawn(
            "overwriter",
            Box::new(move |mut c, mut rng| {
                let mut version = 0;
                while !stop.load(Ordering::SeqCst) {
                    version += 1;
                    let k = rng.gen_range(0..HOT_KEYS);
                    let result = c.put(&hot_key(k), &value(k, version, hot_size(&mut rng)));
                    let mut l = ledger.lock().unwrap();
                    match result {
                        Ok(generation) => {
                            l.completed(&hot_key(k), generation);
                            l.hot_versions.insert(k, version);
                        }
                        Err(_) => l.failed("overwrite"),
                    }
                }
            }),
        );
    }
    {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        let started = Instant::now();
        spawn(
            "deleter",
            Box::new(move |mut c, _| {
                let mut next = 0;
                while !stop.load(Ordering::SeqCst) {
                    let Some(id) = ledger.lock().unwrap().written[1].get(next).copied() else {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    next += 1;
                    let key = unique_key(id);
                    // Read first: the key must be there, whole. (Only this thread deletes.)
                    match c.get(&key) {
                        Ok(Some(v)) if version_of(id, &v.data) == Some(0) => {}
                        Ok(found) => {
                            let what = if found.is_some() { "a torn or foreign value" } else { "missing" };
                            let mut l = ledger.lock().unwrap();
                            let acked = l.acked.get(&id).copied();
                            l.violations.push(format!(
                                "{id:x}: acknowledged (at s, generation: {acked:?}), then {what} at {:.3} s",
                                elapsed_s()
                            ));
                        }
                        Err(_) => ledger.lock().unwrap().failed("get"),
                    }
                    let result = c.delete(&key);
                    let mut l = ledger.lock().unwrap();
                    match result {
                        Ok(existed) => {
                            l.deleted.insert(id);
                            l.deleted_at.insert(id, started.elapsed());
                            // An attempt lost with its server may have deleted it before
                            // the one that answered (docs/cluster.md, Limits).
                            l.deletes_not_there += u64::from(!existed);
                        }
                        Err(_) => {
                            l.delete_unsure.insert(id);
                            l.failed("delete");
                        }
                    }
                }
            }),
        );
    }
    {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        spawn(
            "range deleter",
            Box::new(move |mut c, _| {
                let mut batch = 0;
                while !stop.load(Ordering::SeqCst) {
                    batch += 1;
                    let prefix = range_prefix(batch);
                    for i in 0..RANGE_BATCH {
                        if c.put(&[&prefix[..], format!("{i}").as_bytes()].concat(), b"deleted by range").is_err() {
                            ledger.lock().unwrap().failed("put in a range");
                        }
                    }
                    let result = c.delete_range(&KeyRange::prefix(&prefix));
                    let mut l = ledger.lock().unwrap();
                    match result {
                        Ok(_) => l.ranges_deleted.push(batch),
                        Err(_) => l.failed("delete a range"),
                    }
                }
            }),
        );
    }
    for _ in 0..2 {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        spawn(
            "counter",
            Box::new(move |mut c, mut rng| {
                while !stop.load(Ordering::SeqCst) {
                    let key = counter_key(rng.gen_range(0..COUNTERS));
                    let Ok(Some(v)) = c.get(&key) else { continue };
                    let count = u64::from_le_bytes(v.data[..8].try_into().unwrap());
                    let opts = PutOptions { condition: WriteCondition::IfEqual(v.generation), ttl: None };
                    let result = c.put_with(&key, &(count + 1).to_le_bytes(), &opts);
                    let mut l = ledger.lock().unwrap();
                    match result {
                        Ok(WriteResult::Written { generation }) => {
                            l.completed(&key, generation);
                            l.increments += 1;
                        }
                        Ok(WriteResult::ConditionFailed) => {}
                        Err(_) => {
                            l.increments_unsure += 1;
                            l.failed("increment");
                        }
                    }
                }
            }),
        );
    }
    for _ in 0..2 {
        let (stop, ledger) = (stop.clone(), ledger.clone());
        spawn("reader", Box::new(move |mut c, mut rng| read_loop(&mut c, &mut rng, &stop, &ledger)));
    }
    threads
}

/// Reads hot keys, counters and writer 0's keys, checking each against what completed
/// before the read started.
fn read_loop(c: &mut Client, rng: &mut SmallRng, stop: &AtomicBool, ledger: &Shared) {
    while !stop.load(Ordering::SeqCst) {
        let (key, id) = match rng.gen_range(0..3) {
            0 => {
                let k = rng.gen_range(0..HOT_KEYS);
                (hot_key(k), Some(k))
            }
            1 => (counter_key(rng.gen_range(0..COUNTERS)), None),
            _ => {
                let l = ledger.lock().unwrap();
                let Some(&id) = l.written[0].get(rng.gen_range(0..l.written[0].len().max(1))) else { continue };
                (unique_key(id), Some(id))
            }
        };
        let floor = ledger.lock().unwrap().floor(&key);
        let result = c.get(&key);
        let mut l = ledger.lock().unwrap();
        let v = match result {
            Ok(Some(v)) => v,
            // A hot key or counter not written yet (the counters are written before the load).
            Ok(None) if floor == 0 => continue,
            Ok(None) => {
                let acked = id.and_then(|id| l.acked.get(&id).copied());
                l.violations.push(format!(
                    "{}: missing at {:.3} s, after generation {floor} (acknowledged at s, generation: {acked:?})",
                    String::from_utf8_lossy(&key),
                    elapsed_s()
                ));
                continue;
            }
            Err(_) => {
                l.failed("get");
                continue;
            }
        };
        l.reads += 1;
        if v.generation < floor {
            l.violations.push(format!(
                "{}: read generation {} after generation {floor} completed (back in time)",
                String::from_utf8_lossy(&key),
                v.generation
            ));
        }
        if let Some(id) = id.filter(|&id| version_of(id, &v.data).is_none()) {
            l.violations.push(format!("{}: a torn or foreign value (key id {id:x})", String::from_utf8_lossy(&key)));
        }
        l.completed(&key, v.generation);
    }
}

/// The cluster's members, changed one at a time.
struct Members {
    url: String,
    servers: Vec<ServerProc>,
}

impl Members {
    fn addresses(&self) -> Vec<String> {
        let mut a: Vec<String> = self.servers.iter().map(|s| s.addr.clone()).collect();
        a.sort();
        a
    }

    /// Waits until the placement is on exactly the members held, with nothing moving.
    fn settle(&self, what: &str) {
        let want = self.addresses();
        let settled = wait_until(Duration::from_secs(60), || {
            let (_, mut members, settled) = placement(&self.url);
            members.sort();
            settled && members == want
        });
        assert!(settled, "after {what}, the placement did not settle on {want:?}: {}", status(&self.url));
    }

    fn join(&mut self) {
        self.servers.push(member_with(&self.url, &["--memory", MEMORY]));
        self.settle("a join");
    }

    fn kill(&mut self, i: usize) {
        let mut s = self.servers.swap_remove(i);
        s.kill();
        self.settle("a SIGKILL");
        self.join();
    }

    fn pause(&mut self, i: usize) {
        let pid = self.servers[i].child.id();
        common::signal(pid, SIGSTOP);
        std::thread::sleep(Duration::from_millis(TTL_MS + 1500));
        common::signal(pid, SIGCONT);
        self.settle("a pause past the lease");
    }

    /// A graceful leave (`rdram cluster drain`): the member hands its keys over, then exits 0.
    fn drain(&mut self, i: usize) {
        let mut s = self.servers.swap_remove(i);
        let (code, _, err) = rdram(&["cluster", "drain", &self.url, &s.addr], None);
        assert_eq!(code, 0, "cluster drain: {err}");
        let exited = wait_until(Duration::from_secs(120), || s.child.try_wait().ok().flatten().is_some());
        assert!(exited, "a drained member did not exit: {}", status(&self.url));
        let exit = s.stop();
        assert!(exit.is_some_and(|e| e.success()), "a drained member exits 0: {exit:?}");
        self.settle("a drain");
    }

    /// SIGTERM without `--drain`: the member deregisters and exits 0 at once; its keys'
    /// other replicas cover them until the move to the members that stay copied them.
    fn leave(&mut self, i: usize) {
        let mut s = self.servers.swap_remove(i);
        let exit = s.stop();
        assert!(exit.is_some_and(|e| e.success()), "a member exits 0 after SIGTERM: {exit:?}");
        self.settle("a leave");
    }
}

#[test]
#[ignore = "a soak: make soak runs it"]
fn chaos() {
    let transport = std::env::var("CHAOS_TRANSPORT").ok().filter(|t| !t.is_empty());
    common::init(transport.as_deref().unwrap_or(common::SHM));
    let secs: u64 = std::env::var("CHAOS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let seed: u64 = std::env::var("CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("chaos: {secs} s, CHAOS_SEED={seed}, over {}", transport.as_deref().unwrap_or(common::SHM));
    let mut rng = SmallRng::seed_from_u64(seed);
    let etcd = Etcd::start();
    let url = etcd.url("chaos");
    create(&url, REPLICAS);
    let mut members =
        Members { url: url.clone(), servers: (0..MEMBERS).map(|_| member_with(&url, &["--memory", MEMORY])).collect() };
    members.settle("the start");
    let mut setup = client(&url);
    for k in 0..COUNTERS {
        setup.put(&counter_key(k), &0u64.to_le_bytes()).unwrap();
    }

    let stop = Arc::new(AtomicBool::new(false));
    let ledger: Shared = Arc::default();
    let started = *START.get_or_init(Instant::now);
    let threads = start_load(&url, &stop, &ledger, seed);
    let mut changes: HashMap<&str, u32> = HashMap::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(rng.gen_range(500..2000)));
        let i = rng.gen_range(0..members.servers.len());
        let change = match (rng.gen_range(0..4), members.servers.len() > MEMBERS) {
            (0, _) => "kill",
            (1, _) => "pause",
            (_, false) => "join",
            (2, true) => "drain",
            (_, true) => "leave",
        };
        eprintln!(
            "chaos: {:>5.1} s: {change} (member {i} of {})",
            started.elapsed().as_secs_f64(),
            members.servers.len()
        );
        match change {
            "kill" => members.kill(i),
            "pause" => members.pause(i),
            "join" => members.join(),
            "drain" => members.drain(i),
            _ => members.leave(i),
        }
        *changes.entry(change).or_insert(0) += 1;
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let l = Arc::try_unwrap(ledger).ok().unwrap().into_inner().unwrap();
    eprintln!(
        "chaos: changes {changes:?}; {} reads, {} + {} new keys, {} deletes ({} not there), {} ranges deleted, {} increments ({} unsure); failed calls {:?}",
        l.reads,
        l.written[0].len(),
        l.written[1].len(),
        l.deleted.len(),
        l.deletes_not_there,
        l.ranges_deleted.len(),
        l.increments,
        l.increments_unsure,
        l.errors
    );
    if !l.violations.is_empty() {
        let report = std::env::temp_dir().join(format!("rdram-chaos-violations-{}.txt", std::process::id()));
        let _ = std::fs::write(&report, l.violations.join("\n") + "\n");
        panic!(
            "{} violations (all in {}), first: {:?}",
            l.violations.len(),
            report.display(),
            &l.violations[..l.violations.len().min(10)]
        );
    }
    assert!(l.reads > 1000 && l.increments > 10 && l.written[0].len() > 100, "the load ran");
    check_at_rest(&members, &l);
}

/// What the cluster holds once the load stopped: every acknowledged write, no
/// acknowledged delete, the counters, and R copies of each key.
fn check_at_rest(members: &Members, l: &Ledger) {
    let mut c = client(&members.url);
    let mut total = 0;
    for k in 0..COUNTERS {
        total += u64::from_le_bytes(c.get(&counter_key(k)).unwrap().unwrap().data[..8].try_into().unwrap());
    }
    assert!(
        (l.increments..=l.increments + l.increments_unsure).contains(&total),
        "the counters hold {total}: {} acknowledged increments, {} unsure",
        l.increments,
        l.increments_unsure
    );
    for k in 0..HOT_KEYS {
        let Some(&acked) = l.hot_versions.get(&k) else { continue };
        let v = c.get(&hot_key(k)).unwrap().expect("a hot key written");
        let version = version_of(k, &v.data).expect("a hot key's value whole");
        assert!(version >= acked, "hot key {k}: version {version}, after version {acked} was acknowledged");
        assert!(v.generation >= l.floor(&hot_key(k)), "hot key {k}: back in time at rest");
    }
    let mut present = Vec::new();
    for (writer, ids) in l.written.iter().enumerate() {
        for &id in ids {
            let v = c.get(&unique_key(id)).unwrap();
            if l.deleted.contains(&id) {
                if let Some(v) = v {
                    let held: Vec<String> = (members.servers.iter())
                        .filter_map(|s| {
                            let mut direct = Client::connect(&s.addr, ClientOptions::default()).ok()?;
                            let v = direct.get(&unique_key(id)).ok()??;
                            Some(format!("{} at generation {}", s.addr, v.generation))
                        })
                        .collect();
                    panic!(
                        "{id:x}: its delete was acknowledged (at {:?}), and it is back at generation {}: held by {held:?}",
                        l.deleted_at.get(&id),
                        v.generation
                    );
                }
                continue;
            }
            if l.delete_unsure.contains(&id) {
                continue;
            }
            let v = v.unwrap_or_else(|| panic!("{id:x} (writer {writer}): acknowledged, and lost"));
            assert_eq!(version_of(id, &v.data), Some(0), "{id:x}: whole");
            present.push(unique_key(id));
        }
    }
    // No key of a range whose delete was acknowledged, on any member.
    let ranges_deleted: Vec<Vec<u8>> = l.ranges_deleted.iter().map(|&b| range_prefix(b)).collect();
    for s in &members.servers {
        let listed =
            Client::connect(&s.addr, ClientOptions::default()).unwrap().list(&KeyRange::prefix(b"r/")).unwrap();
        let back: Vec<_> = (listed.iter())
            .filter(|e| ranges_deleted.iter().any(|p| e.key.starts_with(p)))
            .take(5)
            .map(|e| String::from_utf8_lossy(&e.key).into_owned())
            .collect();
        assert!(back.is_empty(), "{} holds keys of ranges whose delete was acknowledged: {back:?}", s.addr);
    }
    // Every acknowledged key on R members, and no key on more (a failed put may have
    // reached one replica only: it was never acknowledged).
    present.extend((0..HOT_KEYS).filter(|k| l.hot_versions.contains_key(k)).map(hot_key));
    present.extend((0..COUNTERS).map(counter_key));
    let copies = || {
        let mut count = HashMap::<Vec<u8>, u32>::new();
        for s in &members.servers {
            for e in Client::connect(&s.addr, ClientOptions::default()).unwrap().list(&Default::default()).unwrap() {
                *count.entry(e.key).or_default() += 1;
            }
        }
        count
    };
    let right = |count: &HashMap<Vec<u8>, u32>| {
        count.values().all(|&n| n <= REPLICAS) && present.iter().all(|k| count.get(k) == Some(&REPLICAS))
    };
    let settled = wait_until(Duration::from_secs(20), || right(&copies()));
    let count = copies();
    let wrong: Vec<_> = (present.iter())
        .filter(|k| count.get(*k) != Some(&REPLICAS))
        .take(5)
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert!(
        settled,
        "keys without exactly {REPLICAS} copies: {wrong:?}; most copies of one key: {:?}",
        count.values().max()
    );
}
