//! remote_dram: the DRAM of server nodes as a key-value store reached over UCX or
//! libfabric.
//!
//! - [`server::Server`] runs one pinned worker per shard; each owns the transport's
//!   endpoints (a UCX worker, or libfabric endpoints) and an arena of (huge-page backed)
//!   DRAM.
//! - [`client::Client`] routes each request straight to the owning shard's worker.
//! - [`store`] holds the semantics (generations, conditions, ranges, TTL, eviction),
//!   [`proto`] the wire format, [`transport`] the network.
//! - [`gpu`] tells device memory from host memory and copies between them (CUDA's
//!   driver, loaded at run time); the client stages device memory through it.
//! - [`cluster`] keeps a cluster's membership and placement in etcd; servers copy and
//!   move keys when it changes, clients route by it.
//! - [`gateway`] serves TensorStore's `tsgrpc_kvstore` gRPC protocol from the engine.
//!
//! A server in this process and a client of it, over UCX on loopback:
//!
//! ```
//! use remote_dram::{Client, ClientOptions, Server, ServerConfig};
//!
//! let server = Server::start(ServerConfig {
//!     listen: "127.0.0.1:0".into(),
//!     workers: 1,
//!     memory: 64 << 20,
//!     hugepages: remote_dram::store::HugePages::Off,
//!     ..Default::default()
//! })?;
//! let mut client = Client::connect(&server.local_addr().to_string(), ClientOptions::default())?;
//! let generation = client.put(b"tensor/0", &[1, 2, 3])?;
//! let value = client.get(b"tensor/0")?.expect("just stored");
//! assert_eq!((value.data.as_slice(), value.generation), (&[1u8, 2, 3][..], generation));
//! drop(client);
//! server.stop();
//! # Ok::<(), remote_dram::Error>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]

pub mod auth;
#[cfg(feature = "cli")]
pub mod cli;
pub mod client;
pub mod cluster;
pub mod error;
pub mod ffi;
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub mod fuzz;
#[cfg(feature = "gateway")]
pub mod gateway;
pub mod gpu;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod store;
pub mod transport;

pub use client::{Client, ClientOptions, DevicePath};
pub use error::{Error, Result, Status};
pub use server::{Server, ServerConfig, TransportChoice};
