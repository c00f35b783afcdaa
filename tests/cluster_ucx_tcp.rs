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
