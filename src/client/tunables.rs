//! Every tunable of the client in one place: pacing of reconnects and retries, how long
//! a given-up call waits, and the sizes of batches and staging.

use std::time::Duration;

// Reconnecting and retrying (mod.rs)

/// First pause before a reconnect to a server that failed, doubling up to
/// [`RECONNECT_BACKOFF_MAX`].
pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(50);

/// Longest pause between reconnects to a server that keeps failing.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// First and longest pause before a request that a cluster's view change turned back is
/// sent again.
pub const CLUSTER_RETRY_MIN: Duration = Duration::from_millis(1);

/// See [`CLUSTER_RETRY_MIN`].
pub const CLUSTER_RETRY_MAX: Duration = Duration::from_millis(10);

// Waiting (link.rs)

/// How long a given-up call waits for the server to confirm that it no longer touches
/// the caller's memory, before closing the connection to make sure of it.
pub const ABORT_GRACE: Duration = Duration::from_secs(2);

/// How often a waiting client checks that its servers' bootstrap connections are open.
pub const LIVENESS_CHECK: Duration = Duration::from_millis(10);

/// How long giving up on a server waits for cancelled receives to be returned.
pub const CANCEL_DRAIN: Duration = Duration::from_millis(200);

// Values in parts and batches (parts.rs, the C ABI, Python)

/// Up to this many bytes in all, the parts of [`super::Client::put_parts`] are copied into one
/// value and put whole: a copy that small costs less than the two requests more that
/// staging takes.
pub const GATHER_COPY_MAX: usize = 256 << 10;

/// Requests a batch keeps in flight (the C ABI's `rdram_mput`/`rdram_mget` use the same).
pub const BATCH_DEPTH: usize = 64;

/// Values a `put_parts_many` stages at once: each holds room on its server until it is
/// committed, and a server gives a client's session at most 16 staged values and half its
/// staging room (beyond them a value is put whole, after a copy).
pub const PARTS_BATCH_DEPTH: usize = 8;

// Device memory (device.rs, device_staging.rs)

/// Bytes a get reads per request into device memory.
pub const DEVICE_CHUNK: usize = 4 << 20;

/// A put's pinned buffer is kept for the next put up to this size (larger ones are freed).
pub const KEEP_PUT_BUFFER: usize = 64 << 20;

/// Reads of a value that keeps changing under a chunked get.
pub const READ_ATTEMPTS: usize = 3;

// Large cluster writes streamed in parts (parts.rs)

/// In a cluster over UCX with its tcp transport, a value of at least this many bytes for a
/// key with other replicas goes to its primary in parts, which the primary sends on to the
/// replicas as they land (the size from which a primary streams a write).
pub const STREAM_PUT_MIN: usize = crate::cluster::tunables::STREAM_MIN;

/// Those parts number about this many per value: the last one reaches the replicas its
/// own length behind the value's end (its copy starts once it landed whole), so a part's
/// share of the value is what the replica's copy adds to the write's time.
pub const STREAM_PUT_PARTS: usize = 32;

/// Their size, at least and at most: each part costs a request on the primary and on
/// each replica.
pub const STREAM_PUT_PART_MIN: usize = 32 << 10;

/// See [`STREAM_PUT_PART_MIN`].
pub const STREAM_PUT_PART_MAX: usize = 128 << 10;

/// Those parts in flight at once: as many as a server takes of one value at once.
pub const STREAM_PUT_PARTS_IN_FLIGHT: usize = crate::server::tunables::STAGE_PARTS_IN_FLIGHT;
