//! `rdram gateway`: TensorStore's `tsgrpc_kvstore` gRPC protocol in front of the engine,
//! so unmodified TensorStore (zarr, zarr3, n5, ocdbt…) keeps arrays in remote DRAM.
//!
//! It stores nothing itself: every call becomes an engine request over the transport,
//! made by a pool of engine clients (one per thread) so that many are in flight at once.

// tonic's `Status` (176 bytes) is the error of every gRPC handler and of the frame codecs
// that feed them; errors end a call, off the per-byte path, so it is not boxed.
#![allow(clippy::result_large_err)]

mod connections;
pub(crate) mod frames;
pub mod metrics;
mod pool;
pub(crate) mod service;
pub(crate) mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::ClientOptions;
pub use pool::EnginePool;

/// Generated from TensorStore's schema, tsgrpc_kvstore.proto (in this folder).
pub mod pb {
    tonic::include_proto!("tensorstore_grpc.kvstore");
}

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    /// remote_dram server address(es), comma-separated.
    pub servers: String,
    pub client: ClientOptions,
    /// Engine clients, each on its own thread: the requests in flight toward the servers.
    pub engine_clients: usize,
    /// Threads for gRPC (HTTP/2 framing, and the copies in and out of its frames).
    pub grpc_threads: usize,
    /// Largest value a Write may stream; larger ones get INVALID_ARGUMENT.
    pub max_value: usize,
    /// Bytes held for clients at once, across all connections: unfinished Write streams
    /// and Read replies not yet sent.
    pub max_buffered: usize,
    /// Client connections held at once; beyond them the gateway stops accepting until one
    /// closes. Each may also hold up to [`CONNECTION_WINDOW`] of received bytes that no call
    /// has taken yet, outside `max_buffered`.
    pub max_connections: usize,
    /// When set, every call must carry `authorization: Bearer <token>` metadata.
    pub token: Option<String>,
    /// `host:port` to serve Prometheus metrics on (`/metrics`).
    pub metrics: Option<String>,
}

/// Checks the optional bearer token of each call (constant-time compare).
#[derive(Clone)]
pub(crate) struct TokenCheck(Option<Arc<String>>);

impl TokenCheck {
    /// `authorization` is the call's header of that name, if it has one.
    fn verify(&self, authorization: Option<&str>) -> std::result::Result<(), tonic::Status> {
        let Some(expected) = &self.0 else { return Ok(()) };
        match authorization.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(t) if crate::auth::constant_time_eq(t.as_bytes(), expected.as_bytes()) => Ok(()),
            Some(_) => Err(tonic::Status::unauthenticated("wrong gateway token")),
            None => {
                Err(tonic::Status::unauthenticated("this gateway requires 'authorization: Bearer <token>' metadata"))
            }
        }
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        self.verify(request.metadata().get("authorization").and_then(|v| v.to_str().ok()))?;
        Ok(request)
    }
}

/// Requests in flight on one gRPC connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// HTTP/2 flow-control window of one stream: a whole message (as large as the decoder
/// accepts, with gRPC's 5-byte prefix) is sent without waiting for a window update.
pub const STREAM_WINDOW: u32 = MAX_MESSAGE as u32 + 5;
/// HTTP/2 flow-control window of one connection: the most bytes a client can have sent
/// that the gateway has not read yet.
pub const CONNECTION_WINDOW: u32 = 32 << 20;
/// Largest HTTP/2 frame the gateway accepts. At HTTP/2's default of 16 KiB, TensorStore sent
/// each 4 MiB chunk in 256 frames, and the work per frame (parsing, flow control, a read and
/// a wake-up each) took a third of the gateway's CPU in writes; at 1 MiB, the size of
/// TensorStore's messages, writes went from 0.98-1.13 to 0.65-0.78 CPU-seconds per GB
/// (16 MiB did no better).
pub const MAX_FRAME: u32 = 1 << 20;
/// Largest gRPC message the gateway decodes (a Write's, with its value part).
pub(crate) const MAX_MESSAGE: usize = 8 << 20;
/// A key of the engine's longest and 4 KiB of small fields: the longest ReadRequest, and
/// the longest WriteRequest field other than the value part.
pub(crate) const KEY_AND_FIELDS: usize = crate::proto::MAX_KEY_LEN + 4096;
/// Largest message of the calls tonic decodes for the gateway (Delete, List): two keys of
/// the engine's longest and small fields. tonic buffers a message whole before decoding it,
/// outside the `--max-buffered` budget, so a call that carries no value gets no more room.
pub(crate) const RANGE_REQUEST_LIMIT: usize = crate::proto::MAX_KEY_LEN + KEY_AND_FIELDS;
/// Default for [`GatewayConfig::max_buffered`].
pub const DEFAULT_MAX_BUFFERED: usize = 1 << 30;
/// Default for [`GatewayConfig::max_connections`]. TensorStore opens 4 connections per
/// driver to a loopback gateway and max(4, its CPUs) to any other.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// Serves until `stop` fires (or its sender is dropped). Calls `ready` with the bound
/// address, and the metrics endpoint's, once listening.
pub fn run(
    config: GatewayConfig,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<()> {
    let engine = Arc::new(EnginePool::connect(&config.servers, &config.client, config.engine_clients)?);
    let io = |e: std::io::Error| Error::new(Status::Io, e.to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.grpc_threads.max(1))
        .enable_all()
        .build()
        .map_err(io)?;
    if !config.listen.ip().is_loopback() {
        tracing::warn!(
            "the gateway listens on {}, beyond loopback: anyone who reaches it reads and writes the servers' data{}",
            config.listen,
            if config.token.is_some() { " (with the gateway token)" } else { " WITHOUT any token" }
        );
    }
    if config.token.as_deref().is_some_and(str::is_empty) {
        return Err(Error::new(Status::Invalid, "the gateway token is empty"));
    }
    let permits = (config.max_buffered / service::BUFFER_PERMIT).clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let buffered = Arc::new(tokio::sync::Semaphore::new(permits));
    let max_connections = config.max_connections.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let connection_places = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let gateway_metrics = Arc::new(metrics::GatewayMetrics::new(
        buffered.clone(),
        permits,
        service::BUFFER_PERMIT,
        connection_places.clone(),
        max_connections,
    ));
    let endpoint = match &config.metrics {
        Some(listen) => Some(crate::metrics::Endpoint::start(listen, Box::new(gateway_metrics.clone()))?),
        None => None,
    };
    let check = TokenCheck(config.token.clone().map(Arc::new));
    runtime.spawn(give_back_freed_memory(buffered.clone(), connection_places.clone()));
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.map_err(io)?;
        ready(listener.local_addr().map_err(io)?, endpoint.as_ref().map(|e| e.local_addr()));
        let gateway =
            Arc::new(service::Gateway { engine, max_value: config.max_value, buffered, metrics: gateway_metrics });
        let grpc = pb::kv_store_service_server::KvStoreServiceServer::from_arc(gateway.clone())
            .max_decoding_message_size(RANGE_REQUEST_LIMIT)
            .max_encoding_message_size(usize::MAX);
        let routes = frames::Routes {
            grpc: tonic::service::interceptor::InterceptedService::new(grpc, check.clone()),
            gateway,
            token: check,
        };
        let shutdown = async {
            let _ = stop.await;
            tracing::info!("gateway shutting down");
        };
        tonic::transport::Server::builder()
            // TensorStore pings every 5 min; answer them, and drop dead peers.
            .http2_keepalive_interval(Some(Duration::from_secs(60)))
            // Streams in flight per connection.
            .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
            // Chunks are MiBs: HTTP/2's default 64 KiB windows would stall every stream on
            // window updates. Fixed windows, not hyper's adaptive (BDP) ones: with those a
            // TensorStore write of 64 chunks at once stalled some streams for over a second
            // in one run of two or three.
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(CONNECTION_WINDOW))
            .max_frame_size(Some(MAX_FRAME))
            .add_service(routes)
            .serve_with_incoming_shutdown(connections::incoming(listener, connection_places), shutdown)
            .await
            .map_err(|e| Error::new(Status::Io, format!("gRPC server: {e}")))
    })
}

/// How often the gateway looks whether memory its clients made it hold was let go.
const TRIM_EVERY: Duration = Duration::from_secs(1);
/// For how many looks after holdings last went down it trims: a connection's buffers may
/// be freed a while after the permits that counted them (its tasks end on their own time).
const TRIMS_AFTER_A_DROP: u32 = 3;
/// Growth of the free bytes glibc's heaps hold, between two looks, that makes it trim.
const FREED_ENOUGH_TO_TRIM: usize = 1 << 20;

/// Hands heap memory back to the system once what clients made the gateway hold went
/// down: glibc may keep freed memory in its heaps for reuse, and then what clients that
/// left streams half-finished or untaken made the gateway hold would stay resident after
/// they went. It trims after its `--max-buffered` budget or its connections went down, and
/// whenever the heaps hold more free bytes than at the last look (a departed connection's
/// buffers are freed when its tasks end, which can be seconds after its permits).
async fn give_back_freed_memory(buffered: Arc<tokio::sync::Semaphore>, places: Arc<tokio::sync::Semaphore>) {
    let mut before = (buffered.available_permits(), places.available_permits());
    let mut free_before = heap_free_bytes();
    let mut trims_left = 0;
    loop {
        tokio::time::sleep(TRIM_EVERY).await;
        let now = (buffered.available_permits(), places.available_permits());
        if now.0 > before.0 || now.1 > before.1 {
            trims_left = TRIMS_AFTER_A_DROP;
        }
        let free_now = heap_free_bytes();
        if trims_left > 0 || free_now > free_before + FREED_ENOUGH_TO_TRIM {
            trims_left = trims_left.saturating_sub(1);
            // SAFETY: malloc_trim has no preconditions; it only returns free memory.
            unsafe { libc::malloc_trim(0) };
        }
        // After a trim too: trimming gives back the pages of free chunks, which stay free
        // chunks, so only bytes freed after this look make the next one trim.
        free_before = heap_free_bytes();
        before = now;
    }
}

/// Bytes in free chunks of glibc's heaps (mallinfo2's `fordblks`).
fn heap_free_bytes() -> usize {
    // SAFETY: mallinfo2 has no preconditions; it reads the allocator's counters.
    unsafe { libc::mallinfo2() }.fordblks
}
