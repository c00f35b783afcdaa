//! Cluster members and clients over UCX with its tcp transport alone (every process of
//! this binary runs UCX_TLS=tcp, as between hosts): a large write goes to its primary in
//! parts, which the primary streams on to the key's replicas as they land.
mod common;
mod streaming;

use std::process::{Command, Stdio};

use streaming::*;

/// The same over UCX with its tcp transport, the client connecting as from another host
/// (not over shared memory alone): a put's value reaches a UCX server whole, so the client
/// sends a large write to its primary in parts, several in flight, and the primary streams
/// them on to the replica as they land: every `put` of 256 KiB or more whose key travels
/// inline was streamed and installed (batches and the long key go whole, and the value
/// longer than the primary's staging room for a connection goes whole after its first
/// part was refused).
#[test]
fn large_values_reach_every_replica_over_ucx_tcp() {
    common::init(common::TCP);
    large_values_reach_every_replica_over(&["--ucx-tcp"], true, false);
}

/// The same over UCX with its tcp transport, where the writer sends the value to its
/// primary in parts (a client as from another host) and dies with parts staged: its
/// session ends, and the primary ends the stream with it.
#[test]
fn a_write_streamed_from_parts_given_up_midway_leaves_nothing_staged() {
    common::init(common::TCP);
    let args = ["--ucx-tcp", "--memory", "512MiB"];
    streamed_write_given_up_midway(&args, 2, |url, key, file| {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "streaming::streamed_put_writer", "--ignored", "--test-threads=1"])
            .env(STREAMED_WRITER_ENV, format!("{url} {key} {file}"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    });
}

/// An authenticated client stages a value in parts by hand on its key's primary, then
/// lies: a part past a gap, then a commit of a value that is not whole. Its first part
/// opened a stream, which staged the part on the replica; both lies are refused, the
/// stream ends, nothing stays staged on either server, and the key keeps its value.
#[test]
fn a_client_lying_about_its_parts_leaves_nothing_staged() {
    use remote_dram::proto::{flags, Op, RequestHeader, MAX_REQUEST_HEADER_LEN};
    use remote_dram::{Client, ClientOptions, Status};
    use std::time::Duration;

    use common::cluster::*;
    use common::wait_until;

    common::init(common::TCP);
    let etcd = Etcd::start();
    let url = etcd.url("lying-parts");
    create(&url, 2);
    let servers = [member_with(&url, &["--ucx-tcp"]), member_with(&url, &["--ucx-tcp"])];
    wait_until_placed(&url, 2);
    // The key's primary takes the first part, not refuses it as of a view it lags.
    wait_until_servers_read_placement(&url, &servers);
    let key = b"staged-by-hand";
    let mut c = client(&url);
    c.put(key, b"before").unwrap();
    let view = status(&url)["placement"]["version"].as_u64().unwrap();
    let stat = |addr: &str, field: &str| -> u64 {
        let stats = Client::connect(addr, ClientOptions::default()).unwrap().stats().unwrap();
        stats["servers"][0]["shards"].as_array().unwrap().iter().map(|s| s[field].as_u64().unwrap()).sum()
    };
    let (total, part) = (1i64 << 20, common::pattern(3, 256 << 10));
    let request = |raw: &mut Client, edit: &dyn Fn(&mut RequestHeader), payload: &[u8]| {
        let (session, id) = raw.raw_session();
        let mut h = RequestHeader::new(Op::Put, id, session);
        h.flags = flags::STAGE | flags::HAS_RANGE | flags::VIEW;
        (h.view, h.key_len, h.range_end) = (view, key.len() as u32, total);
        edit(&mut h);
        let mut header = [0u8; MAX_REQUEST_HEADER_LEN];
        let len = h.encode_with_view(false, &mut header);
        let (status, message) =
            raw.raw_request(0, &[&header[..len], &key[..]].concat(), payload, Duration::from_secs(10)).unwrap();
        (status, message, id)
    };
    // The first part, to each server: the key's primary stages it, the other refuses.
    let mut staged = None;
    for (i, server) in servers.iter().enumerate() {
        let mut raw = Client::connect(&server.addr, ClientOptions::default()).unwrap();
        let (status, message, id) = request(&mut raw, &|_| {}, &part);
        if status == Status::Ok {
            staged = Some((i, raw, id));
        } else {
            assert!(matches!(status, Status::Moved | Status::ViewChanged), "{}: {status:?} {message}", server.addr);
        }
    }
    let (primary, mut raw, stage_id) = staged.expect("the key's primary staged the first part");
    let (primary, replica) = (&servers[primary].addr, &servers[1 - primary].addr);
    assert_eq!(stat(primary, "streamed_writes"), 1, "the first part opened a stream");
    assert!(
        wait_until(Duration::from_secs(5), || stat(replica, "staged_bytes") > 0),
        "the stream staged the landed part on the replica"
    );

    let past_a_gap = |h: &mut RequestHeader| (h.range_start, h.if_not_equal) = (512 << 10, stage_id);
    let (status, message, _) = request(&mut raw, &past_a_gap, &part);
    assert_eq!(status, Status::Invalid, "a part past a gap: {message}");
    let commit = |h: &mut RequestHeader| (h.range_start, h.if_not_equal) = (total, stage_id);
    let (status, message, _) = request(&mut raw, &commit, &[]);
    assert_eq!(status, Status::Invalid, "a commit of a value not whole: {message}");

    let gone = || [primary, replica].iter().all(|s| stat(s, "staged_values") == 0 && stat(s, "staged_bytes") == 0);
    assert!(wait_until(Duration::from_secs(5), gone), "something stayed staged");
    assert_eq!(stat(replica, "installed_streamed"), 0);
    assert_eq!(c.get(key).unwrap().unwrap().data, b"before");
}

/// Writers SIGKILLed while their writes wait on the key's primary for the copies to the
/// replica (held 1.5 s by a test hook), the primary hearing of their departures only 3 s
/// later (another hook, as a busy bootstrap thread might): UCX drops the primary's end of
/// each dead writer's connection at once, so when the copies end the primary must not
/// answer on it. It serves on: a fresh client writes and reads, and both servers stop
/// cleanly.
#[test]
fn writes_answered_after_their_writer_died_leave_the_primary_serving() {
    use common::cluster::*;
    use remote_dram::cluster::replication::TEST_COPY_DELAY_ENV;
    use remote_dram::server::TEST_DEPARTURE_DELAY_ENV;
    use std::time::Duration;

    common::init(common::TCP);
    let etcd = Etcd::start();
    let url = etcd.url("answers-to-no-one");
    create(&url, 2);
    let ttl = TTL_MS.to_string();
    let args = ["--workers", "1", "--cluster", &url, "--lease-ttl-ms", &ttl, "--ucx-tcp"];
    let hooks = [(TEST_COPY_DELAY_ENV, "1500"), (TEST_DEPARTURE_DELAY_ENV, "3000")];
    let mut servers =
        [common::ServerProc::start_with_env(&args, &hooks), common::ServerProc::start_with_env(&args, &hooks)];
    wait_until_placed(&url, 2);
    wait_until_servers_read_placement(&url, &servers);
    let writers: Vec<std::process::Child> = (0..6)
        .map(|i| {
            Command::new(common::RDRAM)
                .args(["put", "--server", &url, "--timeout-ms", "20000", &format!("lost-answer/{i}"), "value"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(600));
    for mut w in writers {
        w.kill().unwrap();
        assert!(!w.wait().unwrap().success(), "a writer was answered before its copies could have ended");
    }
    std::thread::sleep(Duration::from_millis(2000));
    for s in &mut servers {
        assert!(s.child.try_wait().unwrap().is_none(), "{} died answering a writer that was gone", s.addr);
    }
    let mut fresh = client(&url);
    fresh.put(b"after", b"served").unwrap();
    assert_eq!(fresh.get(b"after").unwrap().unwrap().data, b"served");
}
