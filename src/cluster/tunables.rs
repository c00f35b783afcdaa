//! Every tunable of the cluster layer in one place: etcd calls and the lease clock, the
//! mover's batches, and the pacing of replica copies.

use std::time::Duration;

// etcd and membership (mod.rs, registration.rs, follower.rs)

/// How long one etcd call may take before it counts as etcd being unreachable.
pub const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Pause between attempts to reach etcd again after it failed.
pub const ETCD_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// How long a joining server waits for the placement to take it in.
pub const PLACEMENT_WAIT: Duration = Duration::from_secs(5);

/// How often a server whose lease lapsed looks whether the move that leaves it out ended
/// (it registers again then).
pub const REJOIN_POLL: Duration = Duration::from_millis(200);

/// Default lease TTL of a server's registration.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// How often the lease clock ticks ([`super::ServerRole::tick`]).
pub const LEASE_CLOCK_TICK: Duration = Duration::from_millis(50);

/// Ignored member records remembered (so that each is warned about once), at most.
pub const WARNED_RECORDS: usize = 1024;

/// Servers whose lease lapsed that a client's watch remembers ([`super::LostServers`]), at
/// most.
pub const MAX_LOST: usize = 1024;

// Moving keys between members (mover.rs)

/// Bytes of the values one batch of a pass copies at once (the shards keep them pinned
/// until copied).
pub const MOVE_BATCH_BYTES: u64 = 64 << 20;

/// Keys in one batch, at most.
pub const MOVE_BATCH_KEYS: usize = 512;

/// Requests a batch keeps in flight per connection: the mover moves at the link's speed,
/// not at one round trip per key.
pub const MOVE_DEPTH: usize = 32;

/// How long the mover waits for the placement to change before it looks again (it wakes
/// at a change).
pub const MOVER_POLL: Duration = Duration::from_millis(50);

/// The longest nap of a mover keeping to `--rebalance-rate`, between its looks at whether
/// it must stop.
pub const MOVER_PACE_NAP: Duration = Duration::from_millis(20);

/// How often the mover reports its progress.
pub const MOVER_REPORT_EVERY: Duration = Duration::from_millis(500);

/// A mover's connection to another member gives up on a request after this long.
pub const MOVER_PEER_TIMEOUT: Duration = Duration::from_secs(10);

// Copying writes to replicas (replication/)

/// How long the replicator looks for copies without sleeping, and how long it sleeps
/// when none are waiting (it wakes as soon as one is handed over).
pub const COPY_SPIN: Duration = Duration::from_micros(50);

/// See [`COPY_SPIN`].
pub const COPY_IDLE_WAIT: Duration = Duration::from_millis(200);

/// The longest a replicator goes between full turns while its turns find nothing new
/// (`Work::turn` in replication/work.rs): copies' deadlines are seconds.
pub const COPY_FULL_TURN_EVERY: Duration = Duration::from_millis(10);

/// Where sending a large copy costs the sender (UCX's tcp transport, libfabric), a write's
/// value up to this size is copied by its shard's worker itself, between requests (two
/// hand-offs between threads are most of a small copy's cost), and a larger one by a
/// replicator thread of the shard's, so that the worker does not spend its time on it.
/// Elsewhere the worker sends every copy itself (see `Service::set_cluster_role` in
/// src/server/service.rs).
pub const SMALL_COPY_MAX: usize = 16 * 1024;

/// Where a replicator thread copies large writes (see [`SMALL_COPY_MAX`]), a write's value
/// at least this long is staged on its replicas in parts as it reaches its primary (see
/// `cluster::replication`), where the transport reports its progress (libfabric).
pub const STREAM_MIN: usize = 256 << 10;

/// A streamed value's next part goes to a replica once this much more of it landed (or
/// its rest, once all did), at most [`STREAM_PART_MAX`] in one part.
pub const STREAM_PART_MIN: usize = 32 << 10;

/// See [`STREAM_PART_MIN`].
pub const STREAM_PART_MAX: usize = 1 << 20;

/// Copies in flight to one replica, at most.
pub const COPY_DEPTH: usize = 32;

/// How long a copy's answer is looked for without sleeping, beyond the time its bytes
/// take to cross at [`EXPECTED_BYTES_PER_US`] (at most [`COPY_ANSWER_SPIN_MAX`] in all);
/// then the replicator naps, [`COPY_NAP_MIN`] doubling to [`COPY_NAP_MAX`], until an
/// answer or a new copy comes.
pub const COPY_ANSWER_SPIN: Duration = Duration::from_micros(200);

/// See [`COPY_ANSWER_SPIN`].
pub const COPY_ANSWER_SPIN_MAX: Duration = Duration::from_millis(20);

/// The copy rate assumed for [`COPY_ANSWER_SPIN`] (1 GB/s), below what links copy, so
/// that a large copy's answer comes before the spin ends. Over libfabric tcp the sender's
/// progress moves the bytes, so a nap would stall them.
pub const EXPECTED_BYTES_PER_US: u64 = 1000;

/// See [`COPY_ANSWER_SPIN`].
pub const COPY_NAP_MIN: Duration = Duration::from_micros(100);

/// See [`COPY_ANSWER_SPIN`].
pub const COPY_NAP_MAX: Duration = Duration::from_millis(1);

/// Copies taken in at once, at most (the rest on the next turn).
pub const COPY_BATCH: usize = 256;

/// Pause before a copy that a replica did not take is sent again, doubling up to
/// [`COPY_RETRY_MAX`]: the placement moves on past a dead replica within its lease.
pub const COPY_RETRY_MIN: Duration = Duration::from_millis(2);

/// See [`COPY_RETRY_MIN`].
pub const COPY_RETRY_MAX: Duration = Duration::from_millis(100);

/// How long a copy is tried before its writer is told it failed. The key's value stays
/// on the primary; the placement's next move copies it to the replicas it gains.
pub const COPY_DEADLINE: Duration = Duration::from_secs(30);

/// How long a mover's copy is tried (a member it goes to may not have read the
/// placement that gives it the key yet) before the mover hears it failed: below the
/// mover's own request timeout ([`MOVER_PEER_TIMEOUT`]).
pub const MOVE_COPY_DEADLINE: Duration = Duration::from_secs(5);

/// A replica's connection gives up on a request after this long.
pub const COPY_PEER_TIMEOUT: Duration = Duration::from_secs(5);

// A replica remembers a delete for longer than a copy of an earlier write can be tried
// (its last round may start at the deadline, and give up within its request's timeout
// and the transport's abort grace): see `store::tombstones`.
const _: () = assert!(
    crate::store::tombstones::TOMBSTONE_HOLD.as_millis()
        > COPY_DEADLINE.as_millis() + COPY_PEER_TIMEOUT.as_millis() + 2_000
);
