//! The transport suite with servers on libfabric's `tcp;ofi_rxm` provider (loopback),
//! plus departed clients, striping over several rails, the bench against a libfabric
//! server, and a missing provider.
mod common;
mod suite;

fabric_suite!(common::FABRIC_TCP);

#[test]
fn bench_against_a_fabric_server() {
    suite::bench_against_server(common::FABRIC_TCP)
}

/// Asking for a provider this host lacks (a made-up name: on an EFA host efa exists) stops the server at start with a message naming
/// the providers that exist: no silent fallback to something slower.
#[test]
fn a_missing_provider_stops_the_server_clearly() {
    let out = std::process::Command::new(common::RDRAM)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--memory",
            "64MiB",
            "--hugepages",
            "off",
            "--transport",
            "fabric",
            "--provider",
            "no_such_provider",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'no_such_provider'") && err.contains("tcp;ofi_rxm") && err.contains("shm"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening on"));
}

/// A cluster member SIGKILLed after a new client's handshake with it and before the
/// client's first message over libfabric (a test hook holds the client there) is
/// connected to as lost, as one that refused the handshake is: the client (the `rdram`
/// command) reads a key the dead member was primary of from its other replica. libfabric
/// tcp's rxm takes nothing for a peer that died before it connected to it, and the
/// connect failed once the post's stall limit (the call's timeout) ran out.
#[test]
fn a_member_dying_while_a_client_connects_locks_it_out_of_nothing() {
    use common::cluster::*;
    use remote_dram::client::TEST_CONNECT_HOLD_ENV;
    use remote_dram::cluster::{Placement, Routing};
    use std::process::{Command, Stdio};
    use std::time::Duration;

    common::init(common::FABRIC_TCP);
    let etcd = Etcd::start();
    let url = etcd.url("dying-at-connect");
    create(&url, 2);
    let mut servers = [member(&url), member(&url), member(&url)];
    wait_until_placed(&url, 3);
    let routing = Routing::new(serde_json::from_value::<Placement>(status(&url)["placement"].clone()).unwrap());
    let victim = servers[1].addr.clone();
    let key = (0..).map(|i| format!("dying/{i}")).find(|k| routing.owner(k.as_bytes()) == Some(&victim)).unwrap();
    client(&url).put(key.as_bytes(), b"still here").unwrap();

    let dir = tempfile::tempdir().unwrap();
    let hold = dir.path().join("held");
    let reader = Command::new(common::RDRAM)
        .args(["get", "--server", &url, "--timeout-ms", "5000", &key])
        .env(TEST_CONNECT_HOLD_ENV, &hold)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(common::wait_until(Duration::from_secs(20), || hold.exists()), "the reader never reached its hold");
    servers[1].kill();
    std::fs::remove_file(&hold).unwrap();
    let out = reader.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a client that connected while a member died is locked out: {stderr}");
    assert_eq!(out.stdout, b"still here", "{stderr}");
}
