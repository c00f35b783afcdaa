//! What the gateway counts, for `rdram gateway --metrics`: RPCs by method and gRPC code,
//! bytes, streams in flight and bytes held for unfinished writes and unsent reads.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use crate::metrics::{counter, family, gauge, process_metrics};

pub const METHODS: [&str; 4] = ["Read", "Write", "Delete", "List"];

#[derive(Clone, Copy)]
pub enum Method {
    Read,
    Write,
    Delete,
    List,
}

/// gRPC codes 0..=16.
const CODES: usize = 17;

#[derive(Debug)]
pub struct GatewayMetrics {
    rpcs: [[AtomicU64; CODES]; METHODS.len()],
    pub received_bytes: AtomicU64,
    pub sent_bytes: AtomicU64,
    streams: AtomicI64,
    /// The write buffer and its size in bytes per permit.
    buffered: Arc<tokio::sync::Semaphore>,
    permits: usize,
    permit_bytes: usize,
    /// One permit per connection the gateway may hold (`--max-connections`).
    connections: Arc<tokio::sync::Semaphore>,
    max_connections: usize,
}

/// One call, in flight while it lives and counted once by its outcome when it goes: the
/// code given to [`Call::finish`], or CANCELLED when the client left before the answer
/// (or the streamed reply) was complete.
pub struct Call {
    metrics: Arc<GatewayMetrics>,
    method: Method,
    code: Option<tonic::Code>,
}

impl Call {
    /// The call's outcome; the first one given counts.
    pub fn finish(&mut self, code: tonic::Code) {
        self.code.get_or_insert(code);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.metrics.streams.fetch_sub(1, Relaxed);
        let code = self.code.unwrap_or(tonic::Code::Cancelled);
        self.metrics.rpcs[self.method as usize][(code as usize).min(CODES - 1)].fetch_add(1, Relaxed);
    }
}

impl GatewayMetrics {
    pub fn new(
        buffered: Arc<tokio::sync::Semaphore>,
        permits: usize,
        permit_bytes: usize,
        connections: Arc<tokio::sync::Semaphore>,
        max_connections: usize,
    ) -> GatewayMetrics {
        GatewayMetrics {
            rpcs: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            received_bytes: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            streams: AtomicI64::new(0),
            buffered,
            permits,
            permit_bytes,
            connections,
            max_connections,
        }
    }

    pub fn call(self: &Arc<Self>, method: Method) -> Call {
        self.streams.fetch_add(1, Relaxed);
        Call { metrics: self.clone(), method, code: None }
    }
}

/// A gRPC code's name as a label ("OK", "NOT_FOUND", ...).
fn code_label(code: usize) -> String {
    let name = format!("{:?}", tonic::Code::from_i32(code as i32));
    // CamelCase -> UPPER_SNAKE, the way gRPC spells its codes.
    let mut out = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

impl Collector for GatewayMetrics {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rpcs = self.rpcs.iter().enumerate().flat_map(|(m, row)| {
            row.iter().enumerate().filter(|(_, n)| n.load(Relaxed) > 0).map(move |(code, n)| {
                (vec![("method", METHODS[m].to_string()), ("code", code_label(code))], counter(n.load(Relaxed)))
            })
        });
        family(
            &mut e,
            "rdram_gateway_rpcs",
            "gRPC calls by method and outcome; a streamed reply counts when it ends (CANCELLED: the client left first)",
            MetricType::Counter,
            rpcs.collect::<Vec<_>>(),
        )?;
        family(
            &mut e,
            "rdram_gateway_received_bytes",
            "Value bytes written through the gateway",
            MetricType::Counter,
            [(vec![], counter(self.received_bytes.load(Relaxed)))],
        )?;
        family(
            &mut e,
            "rdram_gateway_sent_bytes",
            "Value bytes read through the gateway",
            MetricType::Counter,
            [(vec![], counter(self.sent_bytes.load(Relaxed)))],
        )?;
        family(
            &mut e,
            "rdram_gateway_streams_in_flight",
            "Calls being served",
            MetricType::Gauge,
            [(vec![], gauge(self.streams.load(Relaxed).max(0) as u64))],
        )?;
        let held = self.permits.saturating_sub(self.buffered.available_permits());
        family(
            &mut e,
            "rdram_gateway_buffered_bytes",
            "Bytes of unfinished writes and unsent reads held (at most --max-buffered)",
            MetricType::Gauge,
            [(vec![], gauge((held * self.permit_bytes) as u64))],
        )?;
        let connected = self.max_connections.saturating_sub(self.connections.available_permits());
        family(
            &mut e,
            "rdram_gateway_connections",
            "Client connections held (at most --max-connections)",
            MetricType::Gauge,
            [(vec![], gauge(connected as u64))],
        )?;
        process_metrics(&mut e)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn codes_are_spelled_as_grpc_spells_them() {
        assert_eq!(super::code_label(0), "OK");
        assert_eq!(super::code_label(5), "NOT_FOUND");
        assert_eq!(super::code_label(8), "RESOURCE_EXHAUSTED");
    }
}
