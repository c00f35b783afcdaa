//! Prometheus metrics (`--metrics ADDR` on `rdram serve` and `rdram gateway`).
//!
//! Counters live where they are counted: each shard worker writes its own
//! [`ShardMetrics`], the bootstrap its [`BootstrapMetrics`]. Nothing is shared on the
//! request path; a scrape reads them all and merges them through a
//! `prometheus_client` [`Collector`], which encodes the OpenMetrics text.

#[cfg(feature = "metrics-http")]
mod http;
mod process;
mod shard;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

#[cfg(feature = "metrics-http")]
pub use http::Endpoint;

/// A library built without the `metrics-http` feature serves no metrics: asking for an
/// endpoint is refused, saying why.
#[cfg(not(feature = "metrics-http"))]
pub enum Endpoint {}

#[cfg(not(feature = "metrics-http"))]
impl Endpoint {
    pub fn start(listen: &str, _collector: Box<dyn Collector>) -> crate::error::Result<Endpoint> {
        Err(crate::error::Error::new(
            crate::error::Status::Invalid,
            format!("metrics on {listen}: this build of the library has no metrics endpoint (feature metrics-http)"),
        ))
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        match *self {}
    }
}
pub use process::encode as process_metrics;
pub use shard::{ShardMetrics, DURATION_BUCKETS, OPS};

/// What the bootstrap counts: connected clients and handshakes by outcome.
#[derive(Default, Debug)]
pub struct BootstrapMetrics {
    /// Welcomed clients whose bootstrap connection is still open.
    pub clients: AtomicUsize,
    pub accepted: AtomicU64,
    pub refused_auth: AtomicU64,
    pub refused_capacity: AtomicU64,
    pub refused_version: AtomicU64,
    /// Handshakes that failed before a verdict (bad line, deadline, I/O).
    pub failed: AtomicU64,
    /// Handshakes in progress (accepted sockets not yet welcomed or refused).
    pub handshakes_in_progress: AtomicUsize,
}

/// Label sets are lists of `(name, value)`.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// Writes one metric family: a descriptor, then one sample per label set.
pub(crate) fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, metric) in samples {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

pub(crate) fn counter(n: u64) -> ConstCounter<u64> {
    ConstCounter::new(n)
}

pub(crate) fn gauge(n: u64) -> ConstGauge<i64> {
    ConstGauge::new(n.min(i64::MAX as u64) as i64)
}

/// A server's metrics: every shard, the bootstrap and the process.
#[derive(Debug)]
pub struct ServerCollector {
    pub shards: Vec<Arc<ShardMetrics>>,
    pub bootstrap: Arc<BootstrapMetrics>,
    /// "ucx" or "fabric".
    pub transport: String,
    pub reply_budget: Arc<crate::server::reply_backlog::ReplyBudget>,
    /// A cluster member's placement and handovers.
    pub cluster: Option<Arc<crate::cluster::ServerRole>>,
}

impl Collector for ServerCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let shard = |i: usize| -> Labels { vec![("shard", i.to_string())] };
        let each = |f: &dyn Fn(&ShardMetrics) -> u64| -> Vec<(Labels, ConstGauge<i64>)> {
            self.shards.iter().enumerate().map(|(i, m)| (shard(i), gauge(f(m)))).collect()
        };
        let each_counter = |f: &dyn Fn(&ShardMetrics) -> u64| -> Vec<(Labels, ConstCounter<u64>)> {
            self.shards.iter().enumerate().map(|(i, m)| (shard(i), counter(f(m)))).collect()
        };

        family(
            &mut e,
            "rdram_server_info",
            "The server's transport (value 1)",
            MetricType::Gauge,
            [(
                vec![("transport", self.transport.clone()), ("version", env!("CARGO_PKG_VERSION").to_string())],
                gauge(1),
            )],
        )?;
        let requests = self.shards.iter().enumerate().flat_map(|(i, m)| {
            m.requests().into_iter().map(move |(op, status, n)| {
                (
                    vec![("shard", i.to_string()), ("op", op.to_string()), ("status", status.label().to_string())],
                    counter(n),
                )
            })
        });
        family(
            &mut e,
            "rdram_requests",
            "Requests answered, by op and outcome",
            MetricType::Counter,
            requests.collect::<Vec<_>>(),
        )?;
        family(
            &mut e,
            "rdram_received_bytes",
            "Value bytes received (puts)",
            MetricType::Counter,
            each_counter(&|m| m.bytes().0),
        )?;
        family(
            &mut e,
            "rdram_sent_bytes",
            "Value and listing bytes sent (gets, lists)",
            MetricType::Counter,
            each_counter(&|m| m.bytes().1),
        )?;
        let mut durations = e.encode_descriptor(
            "rdram_request_duration_seconds",
            "Server-side service time, from a request's arrival to its reply handed to the transport (a put's includes receiving its value)",
            None,
            MetricType::Histogram,
        )?;
        for (i, m) in self.shards.iter().enumerate() {
            for d in m.durations() {
                let labels: Labels = vec![("shard", i.to_string()), ("op", d.op.to_string())];
                durations.encode_family(&labels)?.encode_histogram::<Labels>(
                    d.sum_seconds,
                    d.count,
                    &d.buckets,
                    None,
                )?;
            }
        }

        let g = |f: fn(&shard::Gauges) -> &AtomicU64| move |m: &ShardMetrics| f(&m.gauges).load(Relaxed);
        family(&mut e, "rdram_arena_capacity_bytes", "Arena size", MetricType::Gauge, each(&g(|g| &g.capacity_bytes)))?;
        family(
            &mut e,
            "rdram_arena_used_bytes",
            "Arena bytes holding values or reserved for transfers",
            MetricType::Gauge,
            each(&g(|g| &g.used_bytes)),
        )?;
        family(
            &mut e,
            "rdram_arena_largest_free_bytes",
            "Largest free extent (the largest value that fits now)",
            MetricType::Gauge,
            each(&g(|g| &g.largest_free_bytes)),
        )?;
        let fragmentation = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, m)| (shard(i), ConstGauge::new(f64::from_bits(m.gauges.fragmentation.load(Relaxed)))));
        family(
            &mut e,
            "rdram_arena_fragmentation_ratio",
            "1 - largest free extent / free bytes (0: one free extent)",
            MetricType::Gauge,
            fragmentation.collect::<Vec<_>>(),
        )?;
        family(&mut e, "rdram_keys", "Keys stored", MetricType::Gauge, each(&g(|g| &g.keys)))?;
        family(
            &mut e,
            "rdram_index_bytes",
            "Memory of the key index",
            MetricType::Gauge,
            each(&g(|g| &g.index_bytes)),
        )?;
        family(
            &mut e,
            "rdram_pinned_extents",
            "Extents pinned by replies in flight",
            MetricType::Gauge,
            each(&g(|g| &g.pinned_extents)),
        )?;
        family(
            &mut e,
            "rdram_transfers_in_flight",
            "Values being received",
            MetricType::Gauge,
            each(&g(|g| &g.transfers_in_flight)),
        )?;
        family(
            &mut e,
            "rdram_evictions",
            "Values evicted to make room (cache mode)",
            MetricType::Counter,
            each_counter(&g(|g| &g.evictions)),
        )?;
        family(
            &mut e,
            "rdram_expirations",
            "Values that expired (TTL)",
            MetricType::Counter,
            each_counter(&g(|g| &g.expirations)),
        )?;
        family(
            &mut e,
            "rdram_worker_replacements",
            "Shard transport endpoints replaced because a dead or stopped shared-memory client stalled them (UCX: a hole in the receive queue; libfabric shm: large messages it never answered)",
            MetricType::Counter,
            each_counter(&g(|g| &g.worker_replacements)),
        )?;
        family(
            &mut e,
            "rdram_worker_replacement_failures",
            "Attempts to replace or recycle a shard's transport endpoints that failed (out of file descriptors or memory); each is tried again with backoff",
            MetricType::Counter,
            each_counter(&g(|g| &g.worker_replacement_failures)),
        )?;
        family(
            &mut e,
            "rdram_worker_recycles",
            "UCX workers whose new clients were moved to a fresh one because departed shared-memory clients' endpoints (freed by UCX only with the worker) piled up",
            MetricType::Counter,
            each_counter(&g(|g| &g.worker_recycles)),
        )?;
        family(
            &mut e,
            "rdram_transfers_cut",
            "Transfers of a client's value cut at their stall deadline because the client stopped driving them (UCX counts the client endpoints it closed; libfabric the reads it gave up)",
            MetricType::Counter,
            each_counter(&g(|g| &g.transfers_cut)),
        )?;

        family(
            &mut e,
            "rdram_reply_backlog_bytes",
            "Reply bytes held for clients that have not taken them yet, all shards",
            MetricType::Gauge,
            [(Labels::new(), gauge(self.reply_budget.held()))],
        )?;
        if let Some(role) = &self.cluster {
            let moves = &role.moves;
            family(
                &mut e,
                "rdram_cluster_view",
                "Epoch of the cluster placement this server routes with",
                MetricType::Gauge,
                [(Labels::new(), gauge(role.epoch()))],
            )?;
            family(
                &mut e,
                "rdram_cluster_handing_over",
                "1 while this server hands keys over to their new owners",
                MetricType::Gauge,
                [(Labels::new(), gauge(moves.active.load(Relaxed) as u64))],
            )?;
            family(
                &mut e,
                "rdram_cluster_handed_over_keys",
                "Keys this server handed over to their new owners",
                MetricType::Counter,
                [(Labels::new(), counter(moves.keys.load(Relaxed)))],
            )?;
            family(
                &mut e,
                "rdram_cluster_handed_over_bytes",
                "Value bytes this server handed over to their new owners",
                MetricType::Counter,
                [(Labels::new(), counter(moves.bytes.load(Relaxed)))],
            )?;
        }
        family(
            &mut e,
            "rdram_reply_budget_bytes",
            "The limit on rdram_reply_backlog_bytes (--reply-budget)",
            MetricType::Gauge,
            [(Labels::new(), gauge(self.reply_budget.limit()))],
        )?;
        let b = &self.bootstrap;
        family(
            &mut e,
            "rdram_clients_connected",
            "Clients connected",
            MetricType::Gauge,
            [(vec![("transport", self.transport.clone())], gauge(b.clients.load(Relaxed) as u64))],
        )?;
        family(
            &mut e,
            "rdram_handshakes_in_progress",
            "Client handshakes under way: accepted sockets not yet welcomed or refused",
            MetricType::Gauge,
            [(Labels::new(), gauge(b.handshakes_in_progress.load(Relaxed) as u64))],
        )?;
        let handshakes = [
            ("accepted", "", &b.accepted),
            ("refused", "auth", &b.refused_auth),
            ("refused", "capacity", &b.refused_capacity),
            ("refused", "version", &b.refused_version),
            ("failed", "", &b.failed),
        ]
        .map(|(outcome, reason, n)| {
            (vec![("outcome", outcome.to_string()), ("reason", reason.to_string())], counter(n.load(Relaxed)))
        });
        family(
            &mut e,
            "rdram_handshakes",
            "Client handshakes by outcome and reason of refusal",
            MetricType::Counter,
            handshakes,
        )?;
        family(
            &mut e,
            "rdram_shm_locks_released",
            "libfabric shm region locks released after a process died or stalled holding them",
            MetricType::Counter,
            [(Labels::new(), counter(crate::transport::fabric::shm_locks_released()))],
        )?;
        process::encode(&mut e)
    }
}
