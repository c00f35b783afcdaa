//! The transport suite over UCX's tcp transport on loopback.
mod common;
mod suite;

transport_suite!(common::TCP);

/// `rdram get` writes the value, and only the value, to stdout: UCX's own log lines (to
/// stdout by default) go to stderr. And a client of a UCX server never loads libfabric,
/// whose PSM providers cost ~0.2 s at load.
#[test]
fn the_command_line_prints_only_the_value_and_loads_no_libfabric() {
    common::init(common::TCP);
    let server = common::ServerProc::start(&[]);
    server.client().put(b"plain", b"value bytes").unwrap();
    let out = std::process::Command::new(common::RDRAM)
        .args(["get", "--server", &server.addr, "plain"])
        .env("UCX_LOG_LEVEL", "info")
        .env("LD_DEBUG", "files")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(out.stdout, b"value bytes", "stderr: {stderr}");
    assert!(stderr.contains("[ucx] INFO"), "UCX logged nothing at info level: {stderr}");
    assert!(stderr.contains("libucp.so"), "LD_DEBUG lists what is loaded: {stderr}");
    assert!(!stderr.contains("libfabric.so"), "libfabric was loaded");
}

/// UCX only: over UCX the inline key travels in the active message's header.
#[test]
fn inline_keys_of_any_length_are_answered() {
    suite::inline_keys_of_any_length_are_answered(common::TCP)
}
