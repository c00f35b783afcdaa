//! `rdram gateway`: TensorStore's `tsgrpc_kvstore` gRPC protocol in front of the engine,
//! so unmodified TensorStore (zarr, zarr3, n5, ocdbt…) keeps arrays in remote DRAM.
//!
//! It stores nothing itself: every call becomes an engine request over the transport,
//! made by a pool of engine clients (one per thread) so that many are in flight at once.

pub mod metrics;
mod pool;
pub(crate) mod service;
pub(crate) mod wire;
pub(crate) mod frames;

use std::net::SocketAddr;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::ClientOptions;
pub use pool::EnginePool;

/// Generated from proto/tsgrpc_kvstore.proto.
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
            Some(t) if crate::server::constant_time_eq(t.as_bytes(), expected.as_bytes()) => Ok(()),
            Some(_) => Err(tonic::Status::unauthenticated("wrong gateway token")),
            None => Err(tonic::Status::unauthenticated("this gateway requires 'authorization: Bearer <token>' metadata")),
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

/// How long the accept loop pauses after a failed accept (out of fds: EMFILE).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long an accepted connection may take to send HTTP/2's client preface.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2's client connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
const PREFACE_LEN: usize = 24;
/// At most one "connections full" warning per this long (clients may reconnect in a loop).
const FULL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// The connections the gateway accepts, each holding a place among `places`
/// (`--max-connections`) until tonic drops it: with none free, the connection just
/// accepted waits for one, the gateway accepts no more, and new clients wait in the listen
/// backlog. TCP_NODELAY is set on each (tonic's
/// `tcp_nodelay` applies only to listeners it binds itself). A failed accept is logged,
/// paused on for [`ACCEPT_BACKOFF`] and not passed on: tonic 0.12 ends its accept loop on
/// every error but a few transient ones (EMFILE is not one of them), and with it the
/// gateway, so clients holding all its fds could stop it.
fn incoming(listener: tokio::net::TcpListener, places: Arc<tokio::sync::Semaphore>) -> impl tokio_stream::Stream<Item = std::io::Result<Counted>> {
    let (accepted, connections) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut last_warning: Option<std::time::Instant> = None;
        loop {
            let connection = match listener.accept().await {
                Ok((connection, _)) => connection,
                Err(e) => {
                    tracing::warn!("gateway: cannot accept ({e}); pausing {ACCEPT_BACKOFF:?}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let place = match places.clone().try_acquire_owned() {
                Ok(place) => place,
                Err(_) => {
                    if last_warning.map_or(true, |t| t.elapsed() >= FULL_WARNING_INTERVAL) {
                        tracing::warn!("gateway: every --max-connections place is held; accepting no more until a connection closes");
                        last_warning = Some(std::time::Instant::now());
                    }
                    let Ok(place) = places.clone().acquire_owned().await else { return };
                    place
                }
            };
            if let Err(e) = connection.set_nodelay(true) {
                tracing::warn!("gateway: cannot set TCP_NODELAY ({e})");
            }
            let preface_due = Some(Box::pin(tokio::time::sleep(PREFACE_TIMEOUT)));
            if accepted.send(Ok(Counted { connection, _place: place, preface_left: PREFACE_LEN, preface_due })).await.is_err() {
                return; // tonic has stopped serving
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(connections)
}

/// An accepted connection and its place among `--max-connections`, given back when it is
/// dropped. Reads and writes go straight to the socket (vectored writes too: hyper gathers
/// HTTP/2 frames into one `writev`). A client that has not sent HTTP/2's preface within
/// [`PREFACE_TIMEOUT`] of its accept gets a read error, and hyper closes the connection, so
/// silent connections cannot keep every place.
pub(crate) struct Counted {
    connection: tokio::net::TcpStream,
    _place: tokio::sync::OwnedSemaphorePermit,
    /// Preface bytes still to come; the deadline is dropped once they have.
    preface_left: usize,
    preface_due: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl tonic::transport::server::Connected for Counted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.connection.connect_info()
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.connection).poll_read(cx, buf);
        let Some(due) = this.preface_due.as_mut() else { return read };
        this.preface_left = this.preface_left.saturating_sub(buf.filled().len() - before);
        if this.preface_left == 0 {
            this.preface_due = None;
        } else if read.is_pending() && due.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no HTTP/2 preface within the gateway's deadline")));
        }
        read
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().connection).poll_write(cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().connection).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.connection.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().connection).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().connection).poll_shutdown(cx)
    }
}

/// Serves until `stop` fires (or its sender is dropped). Calls `ready` with the bound
/// address, and the metrics endpoint's, once listening.
pub fn run(config: GatewayConfig, ready: impl FnOnce(SocketAddr, Option<SocketAddr>), stop: tokio::sync::oneshot::Receiver<()>) -> Result<()> {
    let engine = Arc::new(EnginePool::connect(&config.servers, &config.client, config.engine_clients)?);
    let io = |e: std::io::Error| Error::new(Status::Io, e.to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(config.grpc_threads.max(1)).enable_all().build().map_err(io)?;
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
    let gateway_metrics = Arc::new(metrics::GatewayMetrics::new(buffered.clone(), permits, service::BUFFER_PERMIT, connection_places.clone(), max_connections));
    let endpoint = match &config.metrics {
        Some(listen) => Some(crate::metrics::Endpoint::start(listen, Box::new(gateway_metrics.clone()))?),
        None => None,
    };
    let check = TokenCheck(config.token.clone().map(Arc::new));
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.map_err(io)?;
        ready(listener.local_addr().map_err(io)?, endpoint.as_ref().map(|e| e.local_addr()));
        let gateway = Arc::new(service::Gateway { engine, max_value: config.max_value, buffered, metrics: gateway_metrics });
        let grpc = pb::kv_store_service_server::KvStoreServiceServer::from_arc(gateway.clone())
            .max_decoding_message_size(RANGE_REQUEST_LIMIT)
            .max_encoding_message_size(usize::MAX);
        let routes = frames::Routes { grpc: tonic::service::interceptor::InterceptedService::new(grpc, check.clone()), gateway, token: check };
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
            // TensorStore write of 64 chunks at once stalled some streams for up to 1.4 s
            // (one run in two or three wrote at 108-258 MB/s instead of ~700).
            .initial_stream_window_size(Some(STREAM_WINDOW))
            .initial_connection_window_size(Some(CONNECTION_WINDOW))
            .max_frame_size(Some(MAX_FRAME))
            .add_service(routes)
            .serve_with_incoming_shutdown(incoming(listener, connection_places), shutdown)
            .await
            .map_err(|e| Error::new(Status::Io, format!("gRPC server: {e}")))
    })
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    /// Without TCP_NODELAY, a small frame (a window update, a reply's trailers) waits for the
    /// peer's delayed ACK whenever one is unacknowledged: two 4 MiB TensorStore writes at once
    /// went at 451 MB/s, one at a time at 1,096 (16-core host).
    #[tokio::test]
    async fn accepted_connections_send_small_frames_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let places = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
        let mut accepted = std::pin::pin!(super::incoming(listener, places));
        let connection = accepted.next().await.unwrap().unwrap();
        assert!(connection.connection.nodelay().unwrap(), "an accepted gateway connection has Nagle's algorithm on");
    }
}
