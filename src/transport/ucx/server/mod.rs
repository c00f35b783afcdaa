//! The shard worker over UCX, and what only it needs: the probe that tells a stuck receive
//! queue, and the bookkeeping of the UCX workers a shard went through (incarnations).

mod incarnations;
mod queue_probe;
mod worker;

pub(crate) use worker::ShardWorker;
