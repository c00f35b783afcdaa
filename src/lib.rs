//! remote_dram: the DRAM of server nodes as a key-value store reached over UCX.
//! See DESIGN.md in the shared docs and README.md.

pub mod error;
pub mod proto;
pub mod store;
pub mod transport;

pub use error::{Error, Result, Status};
