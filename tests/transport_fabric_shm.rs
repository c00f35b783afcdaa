//! The transport suite with servers on libfabric's `shm` provider, plus departed clients
//! and striping over several rails.
mod common;
mod suite;

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
