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
