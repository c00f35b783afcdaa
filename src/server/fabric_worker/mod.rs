//! The shard worker over libfabric.

mod worker;

pub(super) use worker::FabricShardWorker;
