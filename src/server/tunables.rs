//! Every tunable of the server in one place: bounds on what clients can make it hold,
//! deadlines, and the pacing of its workers.

use std::time::Duration;

// Handshakes on the bootstrap port (bootstrap.rs)

/// The whole handshake (both of the client's lines in, ours out) must fit in this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Handshakes in progress at once (one short-lived thread each).
pub const MAX_HANDSHAKES: usize = 64;

/// Handshakes in progress at once from one source address (past it, the oldest is cut).
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 8;

/// File descriptors that must be free for a new client to be welcomed.
pub const FD_HEADROOM: usize = 64;

/// How long the accept loop pauses when the process is out of fds (EMFILE).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

// Defaults of ServerConfig (mod.rs)

/// Default for [`super::ServerConfig::stall_timeout`].
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Default for [`super::ServerConfig::stranded_endpoint_limit`]: at most ~25 MB per worker.
pub const DEFAULT_STRANDED_ENDPOINT_LIMIT: usize = 512;

/// Default for [`super::ServerConfig::reply_budget`].
pub const DEFAULT_REPLY_BUDGET: u64 = 256 << 20;

/// Default for [`super::ServerConfig::max_clients`].
pub const DEFAULT_MAX_CLIENTS: usize = 1024;

// Serving requests (service.rs)

/// The slowest transfer rate a server waits for: a transfer of `len` bytes is cut once
/// `stall_timeout + len / MIN_TRANSFER_RATE` have passed (see `service::transfer_deadline`).
pub const MIN_TRANSFER_RATE: u64 = 64 << 20;

/// Keys one shard holds for handovers at once (each is one value in flight between two
/// servers; the server's own mover holds one at a time).
pub const MAX_HANDOVERS: usize = 1024;

/// Keys a shard deletes at a time while it forgets what it held (see
/// [`ServerRole::forget_copies`](crate::cluster::placement::ServerRole::forget_copies)).
pub const FORGET_BATCH: usize = 4096;

/// Keys a shard looks at for copies a move made stale (see `Service::drop_stale_copies`)
/// at each request while the scan lasts, and at each sweep; and the bytes of the stale
/// keys requests may name before the scan reached them (past it, the scan ends at once).
pub const STALE_STEP: usize = 16;
pub const STALE_SWEEP_BATCH: usize = 8192;
pub const STALE_NAMED_BYTES: usize = 4 << 20;

/// How long a key is held for a handover that does not end (its mover failed), before
/// writes to it go ahead here; the handover's delete is conditional on the generation
/// handed over, so a write in between is never lost.
pub const HANDOVER_HOLD: Duration = Duration::from_secs(2);

/// How often a shard under memory pressure logs it.
pub const PRESSURE_LOG_EVERY: Duration = Duration::from_secs(10);

// Staged values (staging.rs)

/// Staged values one shard holds at once, over all its clients.
pub const MAX_STAGED: usize = 4096;

/// Staged values one shard holds for one session at once: a client stages one value per
/// replica and call, and publishes it before its next call.
pub const MAX_STAGED_PER_SESSION: usize = 16;

/// Parts of one value staged in parts that may arrive at once: a primary streaming a write
/// to a replica keeps the link busy while each part's answer comes back.
pub const STAGE_PARTS_IN_FLIGHT: usize = 8;

/// How long a staged value waits for its publish (a client that sent it and then stalled
/// or lost its primary); then it is freed and a publish for it is refused.
pub const STAGE_HOLD: Duration = Duration::from_secs(30);

// Both shard workers (transport/ucx/server/, transport/fabric/server/)

/// How often an idle worker wakes to expire TTL'd keys.
pub const SWEEP_INTERVAL: Duration = Duration::from_millis(100);
/// The longest a worker sleeps while answers wait for their copies: the replicator
/// threads wake it as theirs end, and the worker looks at its own copies' connections at
/// least this often (and bounds a wake that went astray).
pub const COPY_WAIT_MAX: Duration = Duration::from_millis(1);
/// How long after handing a copy over a worker keeps looking for its answer without
/// sleeping (a replica's round trip; waking from a sleep costs tens of µs).
pub const COPY_SPIN: Duration = Duration::from_micros(100);

/// Expired keys one sweep frees at most, so that a sweep never holds up requests for long.
pub const SWEEP_BATCH: usize = 256;

/// Under load, the clock is read for a sweep once per this many progress turns.
pub const SWEEP_EVERY: u32 = 1024;

/// How long a stopping worker lets transfers in flight finish.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(2);

/// Replies (and their owned bytes) a client may leave unreceived before its further
/// requests are dropped unanswered: far above what any pipelining client keeps in flight.
pub const MAX_BACKLOG_REPLIES: usize = 4096;
/// See [`MAX_BACKLOG_REPLIES`]; all clients together are bounded by the reply budget.
pub const MAX_BACKLOG_BYTES: u64 = 64 << 20;

// The UCX shard worker (transport/ucx/server/)

/// A retired UCX worker is destroyed at the first sweep after this with nothing in flight.
pub const UCX_RETIRED_GRACE: Duration = Duration::from_secs(10);

/// Recycled workers (see `transport::ucx::server::incarnations::ReplyEps`) that may wait for their
/// last client at once.
pub const MAX_RECYCLED: usize = 2;

/// A shard with no client left recycles a worker that holds departed clients' endpoints
/// after this long: what they hold comes back without waiting for the stranded limit.
pub const IDLE_RECYCLE_AFTER: Duration = Duration::from_secs(1);

// The UCX worker's stuck-queue probe (transport/ucx/server/queue_probe.rs)

/// How often a probe is sent (and the probe worker progressed, at the shard's sweeps).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// A probe unseen this long after it was sent means a stuck queue. Generous: a healthy
/// shard reads a probe within microseconds, even behind a full queue.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// How long closing the probe's endpoint may take.
pub const PROBE_CLOSE_LIMIT: Duration = Duration::from_secs(1);

/// How long a probe path may stay unanswered before that is logged.
pub const PROBE_UNANSWERED_WARNING: Duration = Duration::from_secs(30);

// The libfabric shard worker (transport/fabric/server/)

/// Receives kept posted for requests: enough for many pipelining clients; more arriving
/// at once wait in the provider's unexpected-message queue.
pub const RECV_BUFS: usize = 256;

/// How long retired endpoints (see `FabricShardWorker::replace_rails`) keep what their
/// peers may still be reading.
pub const FABRIC_RETIRED_GRACE: Duration = Duration::from_secs(30);

/// Chunk of a one-sided read of a put's value.
pub const READ_CHUNK: usize = 4 << 20;

/// Chunk of a one-sided read of a put's value that is streamed to its replicas as it lands
/// (see `cluster::replication`): they follow it chunk by chunk.
pub const STREAM_READ_CHUNK: usize = 64 << 10;

/// Chunks of one value's read in flight per rail.
pub const READ_WINDOW_PER_RAIL: usize = 2;
