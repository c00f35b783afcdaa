//! What one shard worker counts. The worker is the only writer of its `ShardMetrics`, so
//! an increment is a plain load and store (no locked instruction) on cache lines no other
//! worker writes; a scrape reads them with relaxed loads, from another thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use crate::error::Status;
use crate::proto::Op;
use crate::store::ShardStats;

/// Request kinds as metric labels; the last one is for requests that did not decode.
pub const OPS: [&str; 8] = ["put", "get", "delete", "delete_range", "list", "stats", "abort", "unknown"];
const UNKNOWN_OP: usize = OPS.len() - 1;

/// Every status, in code order; `STATUS_OFFSET` maps a code to its index.
const STATUSES: usize = (max_code() + STATUS_OFFSET + 1) as usize;
const STATUS_OFFSET: i32 = -min_code();

const fn min_code() -> i32 {
    let (mut i, mut min) = (0, 0);
    while i < Status::ALL.len() {
        if (Status::ALL[i] as i32) < min {
            min = Status::ALL[i] as i32;
        }
        i += 1;
    }
    min
}

const fn max_code() -> i32 {
    let (mut i, mut max) = (0, 0);
    while i < Status::ALL.len() {
        if (Status::ALL[i] as i32) > max {
            max = Status::ALL[i] as i32;
        }
        i += 1;
    }
    max
}

/// Upper bounds (seconds) of the service-time histogram's buckets: 1 µs to 10 s.
pub const DURATION_BUCKETS: [f64; 19] =
    [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0, 10.0];

/// A histogram of service times (nanoseconds summed).
pub struct Durations {
    /// Per bucket (not cumulative); the last slot counts what exceeds every bound.
    buckets: [AtomicU64; DURATION_BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

/// One op's service times, as a Prometheus histogram wants them.
pub struct OpDurations {
    pub op: &'static str,
    pub sum_seconds: f64,
    pub count: u64,
    /// `(upper bound, count in that bucket)`, `f64::MAX` for +Inf. Not cumulative: the
    /// encoder accumulates.
    pub buckets: Vec<(f64, u64)>,
}

/// One worker's counters, plus the gauges it publishes on its sweeps.
#[repr(align(128))]
pub struct ShardMetrics {
    requests: [[AtomicU64; STATUSES]; OPS.len()],
    durations: [Durations; OPS.len()],
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Whether requests are timed: only while something scrapes the histogram (two clock
    /// reads per request are otherwise a cost for nothing).
    timed: AtomicBool,
    /// Published every sweep (at most [`crate::server`]'s sweep interval old).
    pub(crate) gauges: Gauges,
}

/// What a worker publishes on each sweep: its shard's state.
#[derive(Default)]
pub struct Gauges {
    pub capacity_bytes: AtomicU64,
    pub used_bytes: AtomicU64,
    pub largest_free_bytes: AtomicU64,
    /// f64 bits.
    pub fragmentation: AtomicU64,
    pub keys: AtomicU64,
    pub index_bytes: AtomicU64,
    pub pinned_extents: AtomicU64,
    pub transfers_in_flight: AtomicU64,
    pub evictions: AtomicU64,
    pub expirations: AtomicU64,
    /// Transport endpoints replaced: a UCX worker whose receive queue got stuck
    /// (`transport::ucx::server::queue_probe`), libfabric shm rails stalled by a departed client.
    pub worker_replacements: AtomicU64,
    /// Attempts to replace or recycle the shard's transport endpoints that failed (out of
    /// file descriptors or memory); each is tried again with backoff.
    pub worker_replacement_failures: AtomicU64,
    /// UCX workers recycled: new clients handed a fresh one because departed
    /// shared-memory clients' endpoints piled up on the old (`transport::ucx::server::ReplyEps`).
    pub worker_recycles: AtomicU64,
    /// Transfers of a client's value cut at their stall deadline: the client stopped
    /// driving them (UCX counts the client endpoints it closed; libfabric the reads it
    /// gave up).
    pub transfers_cut: AtomicU64,
}

/// Adds `n` to a counter only this thread writes.
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

impl Default for ShardMetrics {
    fn default() -> Self {
        ShardMetrics {
            requests: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            durations: std::array::from_fn(|_| Durations {
                buckets: std::array::from_fn(|_| AtomicU64::new(0)),
                sum_ns: AtomicU64::new(0),
            }),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            timed: AtomicBool::new(false),
            gauges: Gauges::default(),
        }
    }
}

impl std::fmt::Debug for ShardMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardMetrics")
    }
}

impl ShardMetrics {
    /// Times requests from now on (the `/metrics` endpoint is up).
    pub fn time_requests(&self) {
        self.timed.store(true, Relaxed);
    }

    /// A request's arrival time, when requests are timed.
    pub fn clock(&self) -> Option<Instant> {
        self.timed.load(Relaxed).then(Instant::now)
    }

    /// Counts one answered request: its op (`None`: it did not decode), outcome, the value
    /// bytes it brought in and sent out, and (when timed) the time since it arrived.
    pub fn record(&self, op: Option<Op>, status: Status, bytes_in: u64, bytes_out: u64, arrived: Option<Instant>) {
        let op = op.map_or(UNKNOWN_OP, |o| o as usize - 1);
        bump(&self.requests[op][(status as i32 + STATUS_OFFSET) as usize], 1);
        bump(&self.bytes_in, bytes_in);
        bump(&self.bytes_out, bytes_out);
        if let Some(arrived) = arrived {
            let d = &self.durations[op];
            let took = arrived.elapsed().as_secs_f64();
            let bucket = DURATION_BUCKETS.iter().position(|&b| took <= b).unwrap_or(DURATION_BUCKETS.len());
            bump(&d.buckets[bucket], 1);
            bump(&d.sum_ns, (took * 1e9) as u64);
        }
    }

    /// Counts a replacement of the shard's transport endpoints.
    pub fn worker_replaced(&self) {
        bump(&self.gauges.worker_replacements, 1);
    }

    /// Counts a replacement or recycling of the shard's endpoints that failed.
    pub fn worker_replacement_failed(&self) {
        bump(&self.gauges.worker_replacement_failures, 1);
    }

    pub fn worker_recycled(&self) {
        bump(&self.gauges.worker_recycles, 1);
    }

    /// Counts `n` transfers cut at their stall deadline.
    pub fn transfers_cut(&self, n: u64) {
        bump(&self.gauges.transfers_cut, n);
    }

    /// Publishes the shard's state for scrapes.
    pub fn publish(&self, stats: &ShardStats, transfers_in_flight: usize) {
        let g = &self.gauges;
        g.capacity_bytes.store(stats.capacity_bytes, Relaxed);
        g.used_bytes.store(stats.used_bytes, Relaxed);
        g.largest_free_bytes.store(stats.largest_free_bytes, Relaxed);
        g.fragmentation.store(stats.fragmentation.to_bits(), Relaxed);
        g.keys.store(stats.keys as u64, Relaxed);
        g.index_bytes.store(stats.index_bytes as u64, Relaxed);
        g.pinned_extents.store(stats.pinned_extents as u64, Relaxed);
        g.transfers_in_flight.store(transfers_in_flight as u64, Relaxed);
        g.evictions.store(stats.counters.evictions, Relaxed);
        g.expirations.store(stats.counters.expirations, Relaxed);
    }

    /// `(op, status, count)` for every non-zero count.
    pub fn requests(&self) -> Vec<(&'static str, Status, u64)> {
        let mut out = Vec::new();
        for (op, row) in self.requests.iter().enumerate() {
            for (i, c) in row.iter().enumerate() {
                let n = c.load(Relaxed);
                if n > 0 {
                    out.push((OPS[op], Status::from_code((i as i32 - STATUS_OFFSET) as i8), n));
                }
            }
        }
        out
    }

    /// Per op, for ops that were served at least once.
    pub fn durations(&self) -> Vec<OpDurations> {
        let mut out = Vec::new();
        for (op, d) in self.durations.iter().enumerate() {
            let buckets: Vec<(f64, u64)> = DURATION_BUCKETS
                .iter()
                .chain([&f64::MAX])
                .zip(&d.buckets)
                .map(|(&bound, n)| (bound, n.load(Relaxed)))
                .collect();
            let count: u64 = buckets.iter().map(|b| b.1).sum();
            if count > 0 {
                out.push(OpDurations { op: OPS[op], sum_seconds: d.sum_ns.load(Relaxed) as f64 / 1e9, count, buckets });
            }
        }
        out
    }

    pub fn bytes(&self) -> (u64, u64) {
        (self.bytes_in.load(Relaxed), self.bytes_out.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_under_their_op_and_status() {
        let m = ShardMetrics::default();
        m.time_requests();
        let t = m.clock();
        assert!(t.is_some());
        m.record(Some(Op::Put), Status::Ok, 10, 0, t);
        m.record(Some(Op::Put), Status::Ok, 5, 0, t);
        m.record(Some(Op::Get), Status::Missing, 0, 0, t);
        m.record(None, Status::AuthFailed, 0, 0, t);
        let mut r = m.requests();
        r.sort_by_key(|x| x.0);
        assert_eq!(r, vec![("get", Status::Missing, 1), ("put", Status::Ok, 2), ("unknown", Status::AuthFailed, 1)]);
        assert_eq!(m.bytes(), (15, 0));
        let d = m.durations();
        let put = d.iter().find(|x| x.op == "put").unwrap();
        assert_eq!(put.count, 2);
        assert_eq!(put.buckets.iter().map(|b| b.1).sum::<u64>(), 2);
        assert_eq!(put.buckets.last().unwrap().0, f64::MAX, "the last bucket is +Inf");
    }
}
