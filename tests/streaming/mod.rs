//! What the cluster tests of large values streamed to their replicas share, over each
//! transport (tests/cluster.rs; UCX tcp in tests/cluster_ucx_tcp.rs, whose processes run
//! UCX with its tcp transport alone).

use std::process::Child;
use std::time::Duration;

use remote_dram::{Client, ClientOptions};

use crate::common::cluster::*;
use crate::common::{self, wait_until};

/// See `large_values_reach_every_replica` (tests/cluster.rs): members started with `transport` (arguments
/// of `rdram serve`), whose large writes' copies have a thread of their own if
/// `copy_thread`; the client connects over shared memory alone where it can if
/// `local_shared_memory`.
pub fn large_values_reach_every_replica_over(transport: &[&str], copy_thread: bool, local_shared_memory: bool) {
    use remote_dram::client::{PutOptions, WriteCondition};
    let etcd = Etcd::start();
    let url = etcd.url("staged");
    create(&url, 2);
    // The first one's worker is pinned: its replicators must not share its core.
    let allowed = cores_allowed(&std::fs::read_to_string("/proc/self/status").unwrap());
    let core = allowed[0];
    let core_arg = core.to_string();
    let pinned: Vec<&str> = [&["--cores", core_arg.as_str()][..], transport].concat();
    let servers = [member_with(&url, &pinned), member_with(&url, transport), member_with(&url, transport)];
    wait_until_placed(&url, 3);
    // Every put below is streamed: none goes whole because its primary lags a view.
    wait_until_servers_read_placement(&url, &servers);
    let threads = thread_cores(servers[0].child.id());
    assert_eq!(threads["rdram-shard-0"], vec![core], "{threads:?}");
    assert_eq!(threads.contains_key("rdram-copy-0"), copy_thread, "{threads:?}");
    for replicator in ["rdram-copy-0", "rdram-move-0"].into_iter().filter(|r| threads.contains_key(*r)) {
        let on = &threads[replicator];
        let apart = allowed.len() == 1 || !on.contains(&core);
        assert!(apart && !on.is_empty(), "{replicator} runs off the worker's core: {threads:?}");
    }
    // Value 21 is longer than a connection may stage on a replica (an eighth of its
    // shard's 64 MiB): a primary that streams it sends it whole once the replica refused.
    let value = |i: usize| common::pattern(i as u64, if i == 21 { 10 << 20 } else { 300_000 + i });
    let opts = ClientOptions { timeout: Duration::from_secs(10), local_shared_memory, ..Default::default() };
    let mut c = Client::connect(&url, opts).unwrap();
    let mut generations = std::collections::BTreeMap::new();
    for i in 0..12 {
        let ttl = (i % 3 == 0).then_some(Duration::from_secs(600));
        let written =
            c.put_with(format!("big{i}").as_bytes(), &value(i), &PutOptions { ttl, ..Default::default() }).unwrap();
        let remote_dram::client::WriteResult::Written { generation } = written else { panic!("{written:?}") };
        generations.insert(format!("big{i}"), generation);
    }
    // A key longer than a request carries inline (1 KiB) reaches its replicas too.
    let long_key = format!("big{}20", "0".repeat(2000));
    generations.insert(long_key.clone(), c.put(long_key.as_bytes(), &value(20)).unwrap());
    // Value 21 among `put_many`'s items: the others stream on past its refusal.
    let batch = || (12..22).filter(|&i| i != 20);
    let keys: Vec<String> = batch().map(|i| format!("big{i}")).collect();
    let values: Vec<Vec<u8>> = batch().map(value).collect();
    let items: Vec<(&[u8], &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_bytes(), v.as_slice())).collect();
    for (key, r) in keys.iter().zip(c.put_many(&items, 4)) {
        generations.insert(key.clone(), r.unwrap());
    }
    let refused = c
        .put_with(b"big0", &value(99), &PutOptions { condition: WriteCondition::IfAbsent, ..Default::default() })
        .unwrap();
    assert!(matches!(refused, remote_dram::client::WriteResult::ConditionFailed), "{refused:?}");

    let mut holders = std::collections::BTreeMap::<String, Vec<u64>>::new();
    let (mut streamed, mut installed, mut sent_whole) = (0, 0, 0);
    for server in &servers {
        let mut direct = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        let stats = direct.stats().unwrap();
        let shards = stats["servers"][0]["shards"].as_array().unwrap().clone();
        streamed += shards.iter().map(|s| s["streamed_writes"].as_u64().unwrap()).sum::<u64>();
        installed += shards.iter().map(|s| s["installed_streamed"].as_u64().unwrap()).sum::<u64>();
        sent_whole += shards.iter().map(|s| s["streamed_sent_whole"].as_u64().unwrap()).sum::<u64>();
        for (key, &generation) in &generations {
            if let Some(v) = direct.get(key.as_bytes()).unwrap() {
                let i: usize = key[3..].parse().unwrap();
                assert!(v.data == value(i), "{key} on {} is byte-exact", server.addr);
                holders.entry(key.clone()).or_default().push(v.generation);
                assert_eq!(v.generation, generation, "{key} on {}", server.addr);
            }
        }
        let stats = direct.stats().unwrap();
        let staged: u64 = stats["servers"][0]["shards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["staged_values"].as_u64().unwrap())
            .sum();
        assert_eq!(staged, 0, "nothing is left staged on {}", server.addr);
    }
    for key in generations.keys() {
        assert_eq!(holders.get(key).map(Vec::len), Some(2), "{key} is held by two servers");
    }
    // 21 values of 256 KiB or more, each with its key inline (the long key's is not); all
    // but value 21 installed as staged. Over UCX the 20 of them whose value fits the
    // primary's staging room (`put`s and `put_many`'s items) are streamed from their parts.
    let ucx = !transport.contains(&"fabric");
    let expected = match (copy_thread, ucx) {
        (false, _) => (0, 0, 0),
        (true, false) => (21, 20, 1),
        (true, true) => (20, 20, 0),
    };
    assert_eq!(
        (streamed, installed, sent_whole),
        expected,
        "writes streamed to their replicas, installed there, and sent whole after all"
    );
    for key in generations.keys() {
        assert!(c.delete(key.as_bytes()).unwrap());
    }
    for server in &servers {
        let mut direct = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        assert_eq!(direct.stats().unwrap()["used_bytes"].as_u64(), Some(0), "{} holds no bytes", server.addr);
    }
}

/// The writer of `a_write_streamed_from_parts_given_up_midway_leaves_nothing_staged`:
/// puts a file's bytes under a key, as a client on another host would (not over shared
/// memory alone).
pub const STREAMED_WRITER_ENV: &str = "RDRAM_TEST_STREAMED_WRITER";

#[test]
#[ignore = "a helper process of a_write_streamed_from_parts_given_up_midway_leaves_nothing_staged"]
fn streamed_put_writer() {
    let Ok(what) = std::env::var(STREAMED_WRITER_ENV) else { return };
    let [url, key, file]: [&str; 3] = what.split(' ').collect::<Vec<_>>().try_into().unwrap();
    let opts = ClientOptions { local_shared_memory: false, ..Default::default() };
    let mut c = Client::connect(url, opts).unwrap();
    c.put(key.as_bytes(), &std::fs::read(file).unwrap()).unwrap();
}

/// See `a_streamed_write_given_up_midway_leaves_nothing_staged` (tests/cluster.rs): members started with
/// `args`, the writer a process that `writer(url, key, file)` starts, killed once
/// `staged_on` servers stage bytes (the replica; or the primary too, where the writer
/// stages the value there in parts).
pub fn streamed_write_given_up_midway(args: &[&str], staged_on: usize, writer: impl Fn(&str, &str, &str) -> Child) {
    let etcd = Etcd::start();
    let url = etcd.url("given-up");
    create(&url, 2);
    let servers = [member_with(&url, args), member_with(&url, args), member_with(&url, args)];
    wait_until_placed(&url, 3);
    let mut direct: Vec<Client> =
        servers.iter().map(|s| Client::connect(&s.addr, ClientOptions::default()).unwrap()).collect();
    let mut sum = |field: &str| -> Vec<u64> {
        // A UCX server whose shared-memory queue a killed writer left stuck replaces its
        // worker, and its clients' next call fails once (they reconnect).
        let stats = direct.iter_mut().map(|d| d.stats().or_else(|_| d.stats()).unwrap());
        stats
            .map(|s| s["servers"][0]["shards"].as_array().unwrap().iter().map(|s| s[field].as_u64().unwrap()).sum())
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("value");
    // Within what a replica stages for one connection (an eighth of its memory).
    let value = common::pattern(7, 60 << 20);
    std::fs::write(&file, &value).unwrap();
    let mut c = client(&url);
    let mut caught = false;
    for attempt in 0..8 {
        let key = format!("given-up/{attempt}");
        c.put(key.as_bytes(), b"before").unwrap();
        let mut writer = writer(&url, &key, file.to_str().unwrap());
        let staging = wait_until(Duration::from_secs(5), || {
            let staging_on = sum("staged_bytes").iter().filter(|&&n| n > 0).count();
            staging_on >= staged_on || writer.try_wait().unwrap().is_some()
        });
        let staging = staging && writer.try_wait().unwrap().is_none();
        writer.kill().ok();
        if writer.wait().unwrap().success() {
            let data = c.get(key.as_bytes()).unwrap().expect("the key keeps a value").data;
            assert!(data == value, "{key}: the writer ended well but the key holds {} bytes", data.len());
            assert!(c.delete(key.as_bytes()).unwrap());
            continue;
        }
        // Killed before its primary took all of the value (the write was given up), or
        // after (the primary copies it on, and it lasts): never anything between.
        let data = c.get(key.as_bytes()).unwrap().expect("the key keeps a value").data;
        let given_up = data == b"before";
        assert!(given_up || data == value, "{key}: {} bytes, neither value", data.len());
        if !given_up {
            assert!(c.delete(key.as_bytes()).unwrap());
        } else if staging {
            caught = true;
            break;
        }
    }
    assert!(caught, "no writer was killed while its value was staged on a replica");
    assert!(sum("streamed_writes").iter().sum::<u64>() >= 1);
    let freed = wait_until(Duration::from_secs(5), || sum("staged_bytes").iter().all(|&n| n == 0));
    assert!(freed, "a replica kept what it staged of the write given up on: {:?}", sum("staged_bytes"));
    // Every key holds its small value alone: the primary freed the large one.
    for (server, d) in servers.iter().zip(&mut direct) {
        let used = d.stats().or_else(|_| d.stats()).unwrap()["used_bytes"].as_u64().unwrap();
        assert!(used < 1 << 20, "{} holds {used} bytes", server.addr);
    }
}

/// The cores of a `Cpus_allowed_list:` line in a /proc status file.
pub fn cores_allowed(status: &str) -> Vec<usize> {
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim();
    let mut cores = Vec::new();
    for range in list.split(',') {
        let (from, to) = range.split_once('-').unwrap_or((range, range));
        cores.extend(from.parse::<usize>().unwrap()..=to.parse::<usize>().unwrap());
    }
    cores
}

/// The cores each thread of process `pid` may run on, by thread name.
pub fn thread_cores(pid: u32) -> std::collections::HashMap<String, Vec<usize>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .map(|t| {
            let dir = t.unwrap().path();
            let name = std::fs::read_to_string(dir.join("comm")).unwrap().trim().to_string();
            (name, cores_allowed(&std::fs::read_to_string(dir.join("status")).unwrap()))
        })
        .collect()
}
