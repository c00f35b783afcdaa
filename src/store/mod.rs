//! A shard's memory: arena (the DRAM), extent allocator, key index, and the kvstore
//! semantics on top. Single-threaded by design: one worker owns one shard.
pub mod alloc;
pub mod arena;
pub mod index;
pub mod shard;

pub use arena::{parse_size, Backing, HugePages};
pub use shard::{resolve_range, ByteRange, Condition, GetOutcome, Layout, Mode, Shard, ShardStats};
