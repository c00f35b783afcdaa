//! C ABI: a server hosted inside the calling process (the TensorStore driver plan's
//! "server mode"). Clients, in this process or others, reach it over UCX or libfabric like
//! any server.

use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::client::{flag, poll_mode};
use super::handles::Handles;
use super::{args, guard, null_arg, rdram_status};
use crate::auth::ClusterSecret;
use crate::cluster::member::{ClusterMember, MemberConfig};
use crate::cluster::tunables::DEFAULT_LEASE_TTL;
use crate::cluster::ClusterUrl;
use crate::error::{Error, Result, Status};
use crate::store::{HugePages, Mode};
use crate::{Server, ServerConfig, TransportChoice};

/// A running embedded server. Created by `rdram_server_start`, stopped and freed by
/// `rdram_server_stop`. What C holds is a serial number, never an address: a stopped,
/// stale or invented handle is refused or ignored, never dereferenced (stopping twice is
/// a no-op). Any thread may use it.
pub struct rdram_server {
    _opaque: [u8; 0],
}

struct Hosted {
    /// Taken out by the stop.
    inner: Mutex<Option<Server>>,
    /// Its membership of a cluster, when it joined one (shared with a drain in progress).
    member: Option<Arc<ClusterMember>>,
    address: CString,
}

/// Running servers by handle. The address string of each lives as long as its entry.
static SERVERS: Handles<Hosted> = Handles::new();

/// Embedded server configuration. Zero-initialise for defaults (127.0.0.1 on a free port,
/// 2 workers, 1 GiB, huge pages when available, adaptive polling, store mode, no auth).
#[repr(C)]
pub struct rdram_server_config {
    /// "host:port" to listen on (NULL: "127.0.0.1:0", a free loopback port).
    pub listen_addr: *const c_char,
    /// Worker threads, one shard each (0: 2).
    pub workers: u32,
    /// Total arena bytes, split across workers (0: 1 GiB).
    pub memory_bytes: u64,
    /// 0: auto (hugetlb, else THP, else 4 KiB), 1: hugetlb only, 2: 4 KiB pages only.
    pub hugepages: i32,
    /// An `rdram_poll_mode` value (others are refused).
    pub poll_mode: i32,
    /// 0: store ("no space" when full), 1: cache (evict least-recently-used values).
    pub cache_mode: u8,
    /// Token clients must present (NULL: none). Copied.
    pub auth_token: *const c_char,
    /// Cores to pin workers to, in order, wrapping (NULL: not pinned). Borrowed for the call.
    pub cores: *const u32,
    pub cores_len: usize,
    /// "auto" (NULL: UCX, or libfabric when the efa provider exists), "ucx" or "fabric".
    pub transport: *const c_char,
    /// libfabric provider with transport "fabric": "efa" (NULL), "tcp;ofi_rxm", "shm", ...
    pub fabric_provider: *const c_char,
    /// libfabric endpoints per worker, one per NIC domain (0: 1).
    pub fabric_domains: u32,
    /// A cluster to join, "etcd://HOST:PORT[,HOST:PORT...]/NAME" (NULL: none). A member
    /// needs a listen address its clients can reach, and the cluster's secret.
    pub cluster: *const c_char,
    /// File holding the secret the cluster's servers share (NULL: the file that the
    /// environment variable RDRAM_CLUSTER_SECRET_FILE names).
    pub cluster_secret_file: *const c_char,
    /// How long the member's registration outlives its last word with etcd, in ms (0: 5 s;
    /// at least 1000).
    pub cluster_lease_ms: u32,
    /// Bytes per second the member hands keys over at most while they move (0: 1 GiB/s).
    pub rebalance_rate: u64,
}

/// Starts a server in this process. `config` may be NULL (defaults). On success `*out`
/// receives a server owned by the caller, to be stopped with `rdram_server_stop`.
#[no_mangle]
pub unsafe extern "C" fn rdram_server_start(
    config: Option<&rdram_server_config>,
    out: Option<&mut *mut rdram_server>,
) -> rdram_status {
    // SAFETY: `config`'s strings are NULL or NUL-terminated, and its `cores` NULL or `cores_len` entries, for
    // the call (the header's contract).
    let lent = config.map(|c| unsafe { Lent::of(c) });
    guard(|| {
        let out = out.ok_or_else(|| null_arg("out"))?;
        let mut cfg = ServerConfig {
            listen: "127.0.0.1:0".into(),
            ucx_tcp: crate::server::ucx_tcp_opted_in_by_env(),
            ..Default::default()
        };
        let mut cluster = None;
        if let (Some(c), Some(lent)) = (config, lent) {
            if let Some(listen) = lent.listen_addr? {
                cfg.listen = listen.to_string();
            }
            if c.workers > 0 {
                cfg.workers = c.workers as usize;
            }
            if c.memory_bytes > 0 {
                cfg.memory = c.memory_bytes;
            }
            cfg.hugepages = match c.hugepages {
                0 => HugePages::Auto,
                1 => HugePages::On,
                2 => HugePages::Off,
                v => return Err(Error::new(Status::Invalid, format!("config.hugepages must be 0, 1 or 2, not {v}"))),
            };
            cfg.poll = poll_mode(c.poll_mode, "config.poll_mode")?;
            cfg.mode = if flag(c.cache_mode, "config.cache_mode")? { Mode::Cache } else { Mode::Store };
            cfg.auth_token = lent.auth_token?.map(str::to_string);
            cfg.cores = lent.cores?.iter().map(|&c| c as usize).collect();
            let transport = lent.transport?.unwrap_or("auto");
            cfg.transport = TransportChoice::parse(transport, lent.fabric_provider?, c.fabric_domains as usize)?;
            if let Some(url) = lent.cluster? {
                cluster = Some(member_config(c, url, lent.cluster_secret_file?)?);
            }
        }
        let (inner, member) = match cluster {
            Some(member) => {
                let (server, member) = ClusterMember::start_server(cfg, member)?;
                (server, Some(Arc::new(member)))
            }
            None => (Server::start(cfg)?, None),
        };
        let address =
            CString::new(inner.local_addr().to_string()).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        *out = SERVERS.insert(Hosted { inner: Mutex::new(Some(inner)), member, address }) as *mut rdram_server;
        Ok(rdram_status::RDRAM_OK)
    })
}

/// The pointers of an `rdram_server_config`, converted (each checked when it is used).
struct Lent<'a> {
    listen_addr: Result<Option<&'a str>>,
    auth_token: Result<Option<&'a str>>,
    cores: Result<&'a [u32]>,
    transport: Result<Option<&'a str>>,
    fabric_provider: Result<Option<&'a str>>,
    cluster: Result<Option<&'a str>>,
    cluster_secret_file: Result<Option<&'a str>>,
}

impl<'a> Lent<'a> {
    /// # Safety
    /// `c`'s strings are NULL or NUL-terminated, and its `cores` NULL or `cores_len`
    /// entries, unwritten while `'a` lasts.
    unsafe fn of(c: &'a rdram_server_config) -> Lent<'a> {
        // SAFETY: this function's contract, argument by argument.
        unsafe {
            Lent {
                listen_addr: args::optional_c_str(c.listen_addr, "config.listen_addr"),
                auth_token: args::optional_c_str(c.auth_token, "config.auth_token"),
                cores: args::optional_slice(c.cores, c.cores_len, "config.cores"),
                transport: args::optional_c_str(c.transport, "config.transport"),
                fabric_provider: args::optional_c_str(c.fabric_provider, "config.fabric_provider"),
                cluster: args::optional_c_str(c.cluster, "config.cluster"),
                cluster_secret_file: args::optional_c_str(c.cluster_secret_file, "config.cluster_secret_file"),
            }
        }
    }
}

/// How the server in `c` joins the cluster at `url`.
fn member_config(c: &rdram_server_config, url: &str, secret_file: Option<&str>) -> Result<MemberConfig> {
    let url = ClusterUrl::parse(url)?
        .ok_or_else(|| Error::new(Status::Invalid, "config.cluster takes etcd://HOST:PORT[,HOST:PORT...]/NAME"))?;
    let secret_file = secret_file
        .map(str::to_string)
        .or_else(|| std::env::var("RDRAM_CLUSTER_SECRET_FILE").ok())
        .ok_or_else(|| {
            Error::new(
                Status::Invalid,
                "a cluster member needs the cluster's secret: config.cluster_secret_file or RDRAM_CLUSTER_SECRET_FILE",
            )
        })?;
    let lease_ttl = match c.cluster_lease_ms {
        0 => DEFAULT_LEASE_TTL,
        ms if ms < 1000 => {
            return Err(Error::new(Status::Invalid, format!("config.cluster_lease_ms is at least 1000, not {ms}")))
        }
        ms => Duration::from_millis(ms.into()),
    };
    Ok(MemberConfig {
        url,
        lease_ttl,
        secret: ClusterSecret::from_file(&secret_file)?,
        auth_token: None,
        rebalance_rate: if c.rebalance_rate == 0 { 1 << 30 } else { c.rebalance_rate },
    })
}

/// Hands every key of a cluster member over to the other servers, and returns once the
/// cluster's placement no longer has this server (it keeps serving until
/// `rdram_server_stop`): RDRAM_OK; RDRAM_UNAVAILABLE when no other server can take the
/// keys; RDRAM_TIMEOUT after `timeout_ms` (the handover goes on until the stop).
/// RDRAM_INVALID_ARGUMENT for a server that is not a cluster member, or not running.
#[no_mangle]
pub extern "C" fn rdram_server_drain(server: *mut rdram_server, timeout_ms: u32) -> rdram_status {
    guard(|| {
        if server.is_null() {
            return Err(null_arg("server"));
        }
        let member = SERVERS
            .get(server as usize)
            .ok_or_else(|| Error::new(Status::Invalid, "not a running server"))?
            .member
            .clone()
            .ok_or_else(|| Error::new(Status::Invalid, "this server is not a cluster member (config.cluster)"))?;
        member.drain_within(Duration::from_millis(timeout_ms.into()))?;
        Ok(rdram_status::RDRAM_OK)
    })
}

/// The address clients connect to ("127.0.0.1:port"). Owned by the server, valid until
/// `rdram_server_stop`. NULL if `server` is NULL or not a running server.
#[no_mangle]
pub extern "C" fn rdram_server_address(server: *const rdram_server) -> *const c_char {
    // The string's bytes stay where they are until its entry is removed (stop).
    SERVERS.get(server as usize).map_or(std::ptr::null(), |s| s.address.as_ptr())
}

/// Stops the server's workers, frees its memory and the handle; a cluster member leaves
/// the cluster first (its keys go with it unless `rdram_server_drain` handed them over).
/// NULL, or a handle stopped already, is a no-op.
#[no_mangle]
pub extern "C" fn rdram_server_stop(server: *mut rdram_server) {
    // Taken out of the table first: a second stop, here or on another thread, finds nothing.
    if let Some(h) = SERVERS.remove(server as usize) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Out of the member set first, so that clients stop routing here, then stop.
            if let Some(member) = &h.member {
                member.leave();
            }
            let server = h.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(server) = server {
                server.stop();
            }
        }));
    }
}
