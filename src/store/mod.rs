//! A shard's memory: arena (the DRAM), extent allocator, key index, and the kvstore
//! semantics on top. Single-threaded by design: one worker owns one shard.
pub mod alloc;
pub mod arena;
pub mod index;
pub mod shard;
pub mod tombstones;

pub use arena::{Backing, HugePages};
pub use shard::{Condition, GetOutcome, Layout, Mode, Shard, ShardStats};
