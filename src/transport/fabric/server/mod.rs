//! The shard worker over libfabric.

mod worker;

pub(crate) use worker::FabricShardWorker;
