//! `rdram gateway`: TensorStore's `tsgrpc_kvstore` gRPC protocol in front of the engine,
//! so unmodified TensorStore (zarr, zarr3, n5, ocdbt…) keeps arrays in remote DRAM.
//!
//! It stores nothing itself: every call becomes an engine request over the transport,
//! made by a pool of engine clients (one per thread) so that many are in flight at once.

mod pool;
mod service;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
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
    /// Largest value a Write may stream; larger ones get INVALID_ARGUMENT.
    pub max_value: usize,
}

/// Serves until SIGINT/SIGTERM. Calls `ready` with the bound address once listening.
pub fn run(config: GatewayConfig, ready: impl FnOnce(SocketAddr)) -> Result<()> {
    let engine = Arc::new(EnginePool::connect(&config.servers, &config.client, config.engine_clients)?);
    let io = |e: std::io::Error| Error::new(Status::Io, e.to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io)?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await.map_err(io)?;
        ready(listener.local_addr().map_err(io)?);
        let service = service::Gateway { engine, max_value: config.max_value };
        let shutdown = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("gateway shutting down");
        };
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            // TensorStore pings every 5 min; answer them, and drop dead peers.
            .http2_keepalive_interval(Some(Duration::from_secs(60)))
            .max_concurrent_streams(Some(256))
            // Chunks are MiBs: HTTP/2's default 64 KiB windows would stall every stream on
            // window updates; size them to the traffic instead.
            .http2_adaptive_window(Some(true))
            .add_service(
                pb::kv_store_service_server::KvStoreServiceServer::new(service)
                    .max_decoding_message_size(8 << 20)
                    .max_encoding_message_size(usize::MAX),
            )
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), shutdown)
            .await
            .map_err(|e| Error::new(Status::Io, format!("gRPC server: {e}")))
    })
}
