//! What callers pass and get back: options, conditions, results, listings and key ranges.

use std::time::Duration;

use crate::proto::ByteRange;
use crate::transport::{PollMode, DEFAULT_SPIN};

#[derive(Clone, Debug)]
pub struct ClientOptions {
    pub auth_token: Option<String>,
    pub poll: PollMode,
    pub spin: Duration,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// For UCX servers whose shared memory this process reaches (same boot, IPC and PID
    /// namespaces, and user, as their welcome says): a UCX context with shared-memory
    /// transports only (unless `UCX_TLS` is set), all transports if that fails. On by
    /// default. With every transport, UCX picks tcp even on the same host: the endpoints
    /// ask for peer-failure detection, which its shared-memory transports lack (a server's
    /// death is seen on the bootstrap connection either way), and small requests take
    /// about ten times longer. Such a context also starts sooner (no tcp interface
    /// discovery).
    pub local_shared_memory: bool,
    /// A cluster server's own calls only (its replicator and mover): the cluster's secret,
    /// with which the client makes the tickets of its copies and handovers. Applications
    /// leave it None: they send no copies.
    #[doc(hidden)]
    pub cluster_secret: Option<crate::auth::ClusterSecret>,
    /// How device (GPU) memory moves: staged through pinned host buffers (the default), or
    /// handed to the transport where it moves device memory itself. The default is
    /// `RDRAM_DEVICE_PATH` (`staged` or `transport`). See docs/gpu.md.
    pub device_path: DevicePath,
}

/// How a client moves device memory (see [`ClientOptions::device_path`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePath {
    /// Through the client's pinned host buffers, with the GPU's copies: every transport.
    #[default]
    Staged,
    /// Given to the transport as device memory, where it moves it itself (UCX with its
    /// CUDA transports; same-host connections then include them); staged elsewhere.
    Transport,
}

impl DevicePath {
    /// `RDRAM_DEVICE_PATH`: `transport`, else staged.
    pub fn from_env() -> DevicePath {
        match std::env::var(DEVICE_PATH_ENV) {
            Ok(v) if v == "transport" => DevicePath::Transport,
            _ => DevicePath::Staged,
        }
    }
}

/// The environment variable that gives [`ClientOptions::device_path`]'s default.
pub const DEVICE_PATH_ENV: &str = "RDRAM_DEVICE_PATH";

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            auth_token: None,
            poll: PollMode::Adaptive,
            spin: DEFAULT_SPIN,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            local_shared_memory: true,
            cluster_secret: None,
            device_path: DevicePath::from_env(),
        }
    }
}

/// A condition on the key's current generation for a write or delete.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteCondition {
    #[default]
    None,
    IfEqual(u64),
    IfAbsent,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PutOptions {
    pub condition: WriteCondition,
    pub ttl: Option<Duration>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct GetOptions {
    /// Answer `Unchanged` (without the value) if the generation equals this.
    pub if_not_equal: Option<u64>,
    /// Answer `Unchanged` if the generation differs from this.
    pub if_equal: Option<u64>,
    pub range: Option<ByteRange>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    pub data: Vec<u8>,
    pub generation: u64,
    /// Size of the whole stored value (`data` may be a byte range of it).
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetResult {
    Value(Value),
    Missing,
    Unchanged { generation: u64 },
}

/// The result of [`Client::get_at_most`](super::Client::get_at_most).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetAtMost {
    Got(GetResult),
    /// The value (or its requested range) is `len` bytes, more than was asked for; it
    /// stayed on the server. `size` is the whole stored value's.
    TooLong {
        len: usize,
        generation: u64,
        size: u64,
    },
}

/// The result of [`Client::get_into`](super::Client::get_into).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetInto {
    /// `len` bytes were written to the buffer; `size` is the whole stored value's size.
    Value {
        len: usize,
        generation: u64,
        size: u64,
    },
    TooSmall {
        needed: usize,
    },
    Missing,
    Unchanged {
        generation: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteResult {
    Written { generation: u64 },
    ConditionFailed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteResult {
    Deleted { existed: bool },
    ConditionFailed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListEntry {
    pub key: Vec<u8>,
    pub size: u64,
}

/// Where a listing paged with [`Client::list_page`](super::Client::list_page) goes on: a
/// server's shard, named by the server's address (not by its place in one client's
/// connection, so that any client of the same servers can take the listing on), and the
/// key to list it from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListCursor {
    pub(super) node: String,
    pub(super) shard: usize,
    pub(super) min: Vec<u8>,
}

/// Keys in `[min, max)`; `max = None` is unbounded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRange {
    pub min: Vec<u8>,
    pub max: Option<Vec<u8>>,
}

impl KeyRange {
    pub fn prefix(prefix: &[u8]) -> KeyRange {
        KeyRange { min: prefix.to_vec(), max: prefix_successor(prefix) }
    }
}

/// The smallest key greater than every key starting with `prefix` (None: unbounded).
pub fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut p = prefix.to_vec();
    while let Some(last) = p.pop() {
        if last != 0xff {
            p.push(last + 1);
            return Some(p);
        }
    }
    None
}
