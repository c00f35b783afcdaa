//! The server: one worker thread per shard (pinned to the cores given), plus a bootstrap
//! thread that answers clients' TCP handshakes with the shards' transport addresses.

mod bootstrap;
pub(crate) mod cores;
pub(crate) mod reply_backlog;
pub(crate) mod service;
mod staging;
pub mod tunables;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{debug, warn};

pub use bootstrap::TEST_DEPARTURE_DELAY_ENV;

use crate::error::{Error, Result, Status};
use crate::metrics;
use crate::proto::PROTOCOL_VERSION;
use crate::server::service::Service;
use crate::server::tunables::{
    DEFAULT_MAX_CLIENTS, DEFAULT_REPLY_BUDGET, DEFAULT_STALL_TIMEOUT, DEFAULT_STRANDED_ENDPOINT_LIMIT,
};
use crate::store::{Backing, HugePages, Mode, Shard};
use crate::transport::{ucx, PollMode, DEFAULT_SPIN};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// `host:port`; port 0 picks a free port.
    pub listen: String,
    pub workers: usize,
    /// Cores to pin workers to, in order, wrapping; empty = not pinned. Pinning is asked
    /// for, never a default: servers on one host that each pinned worker 0 to the first
    /// core would share that core, each waiting out the other's adaptive spin.
    pub cores: Vec<usize>,
    /// Total arena memory, split evenly across shards.
    pub memory: u64,
    pub hugepages: HugePages,
    pub poll: PollMode,
    pub spin: Duration,
    pub mode: Mode,
    pub auth_token: Option<String>,
    pub transport: TransportChoice,
    /// Clients connected at once; more are refused with "server at capacity".
    pub max_clients: usize,
    /// How long a transfer may go without finishing (plus its size at
    /// `MIN_TRANSFER_RATE`) before the server gives up on it and takes back
    /// what it held: a client that starts a large put and stops progressing.
    pub stall_timeout: Duration,
    /// UCX: departed shared-memory clients' endpoints a shard worker may hold before new
    /// clients get a fresh worker. UCX frees such an endpoint (~50 KB, 3 mappings) only
    /// with its worker when the peer cannot be found dead (shared memory without
    /// `UCX_MM_ERROR_HANDLING=y`); the old worker serves its clients until they leave.
    pub stranded_endpoint_limit: usize,
    /// `host:port` to serve Prometheus metrics on (`/metrics`); None: no endpoint.
    pub metrics: Option<String>,
    /// UCX: run UCX's tcp transport, on the interface of `listen` only. Off by default:
    /// UCX's tcp receiver acts for any peer that reaches its port before the token check
    /// (see [`ucx::Tcp`]), so it is for trusted networks only. The edges (the command
    /// line, the C ABI, Python) take it from [`UCX_TCP_ENV`]; a default never does.
    pub ucx_tcp: bool,
    /// Reply bytes held, across every shard, for clients that do not take their replies;
    /// past it a client that is behind has its requests dropped until it catches up.
    pub reply_budget: u64,
    /// In a cluster: the placement, kept current by the server's etcd agent, that the
    /// shards check requests routed with a view against.
    pub cluster_role: Option<Arc<crate::cluster::placement::ServerRole>>,
    /// In a cluster (required with `cluster_role`): the secret the cluster's servers share
    /// and clients never see, for the replication tickets ([`crate::auth::ClusterSecret`]).
    pub cluster_secret: Option<crate::auth::ClusterSecret>,
}

/// Which network stack the workers use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// UCX, unless libfabric offers `efa` (then libfabric on efa).
    Auto,
    Ucx,
    /// libfabric RDM endpoints on `provider` ("efa", "tcp;ofi_rxm", "shm"), `rails`
    /// endpoints per worker (one per NIC domain).
    Fabric {
        provider: String,
        rails: usize,
    },
}

impl TransportChoice {
    /// From names as configuration gives them: "auto", "ucx" or "fabric" (then with a
    /// provider, default "efa", and a rail count, default 1).
    pub fn parse(transport: &str, provider: Option<&str>, domains: usize) -> Result<TransportChoice> {
        match transport {
            "auto" | "" => Ok(TransportChoice::Auto),
            "ucx" => Ok(TransportChoice::Ucx),
            "fabric" => {
                Ok(TransportChoice::Fabric { provider: provider.unwrap_or("efa").to_string(), rails: domains.max(1) })
            }
            other => Err(Error::new(Status::Invalid, format!("unknown transport {other:?}: use auto, ucx or fabric"))),
        }
    }

    /// Resolves `Auto`: EFA hosts get libfabric on efa, everything else UCX.
    pub fn resolve(self) -> TransportChoice {
        match self {
            TransportChoice::Auto
                if has_efa_device() && crate::transport::fabric::available_providers().iter().any(|p| p == "efa") =>
            {
                TransportChoice::Fabric { provider: "efa".into(), rails: 1 }
            }
            TransportChoice::Auto => TransportChoice::Ucx,
            other => other,
        }
    }
}

/// Whether the kernel lists an EFA device (`/sys/class/infiniband/*/device/driver` is
/// `efa`): asked before libfabric, whose loading and provider probing took most of a
/// server's start (0.2-0.3 s) on hosts that have none.
fn has_efa_device() -> bool {
    let Ok(devices) = std::fs::read_dir("/sys/class/infiniband") else { return false };
    devices.flatten().any(|d| {
        std::fs::read_link(d.path().join("device/driver"))
            .is_ok_and(|driver| driver.file_name().is_some_and(|n| n == "efa"))
    })
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:7000".into(),
            workers: 2,
            cores: Vec::new(),
            memory: 1 << 30,
            hugepages: HugePages::Auto,
            poll: PollMode::Adaptive,
            spin: DEFAULT_SPIN,
            mode: Mode::Store,
            auth_token: None,
            transport: TransportChoice::Auto,
            max_clients: DEFAULT_MAX_CLIENTS,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            stranded_endpoint_limit: DEFAULT_STRANDED_ENDPOINT_LIMIT,
            metrics: None,
            ucx_tcp: false,
            reply_budget: DEFAULT_REPLY_BUDGET,
            cluster_role: None,
            cluster_secret: None,
        }
    }
}

/// The environment variable through which a user opts in to UCX tcp
/// ([`ServerConfig::ucx_tcp`]) for a server the command line, C or Python starts.
pub const UCX_TCP_ENV: &str = "RDRAM_UCX_TCP";

/// Whether [`UCX_TCP_ENV`] says yes (`1`, `true`, `yes`, `on`, `y`).
pub fn ucx_tcp_opted_in_by_env() -> bool {
    std::env::var(UCX_TCP_ENV)
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on" | "y"))
}

/// What a started server reports about itself.
#[derive(Clone, Debug, Serialize)]
pub struct ServerInfo {
    pub protocol_version: u8,
    /// "ucx", or "fabric" and what libfabric chose ("provider shm, fabric shm, domain shm").
    pub transport: String,
    pub address: String,
    pub shards: usize,
    pub bytes_per_shard: u64,
    pub backing: Vec<Backing>,
    pub cores: Vec<Option<usize>>,
    pub mode: Mode,
    pub poll: PollMode,
    /// Where `/metrics` is served, with `--metrics`.
    pub metrics: Option<String>,
}

impl ServerInfo {
    /// "workers unpinned", or the core each worker is pinned to ("-" for one that is not).
    fn pinning(&self) -> String {
        if self.cores.iter().all(Option::is_none) {
            return "workers unpinned".into();
        }
        let cores: Vec<String> = self.cores.iter().map(|c| c.map_or_else(|| "-".into(), |c| c.to_string())).collect();
        format!("workers on cores {}", cores.join(","))
    }

    pub fn banner(&self) -> String {
        let mut backing_list: Vec<_> = self.backing.iter().map(|b| b.describe()).collect();
        backing_list.dedup();
        format!(
            "remote_dram server: protocol v{}, transport {}, {} shards x {} MiB ({}), mode {:?}, poll {:?}, {}\n{}listening on {}",
            self.protocol_version,
            self.transport,
            self.shards,
            self.bytes_per_shard >> 20,
            backing_list.join(", "),
            self.mode,
            self.poll,
            self.pinning(),
            self.metrics.as_ref().map_or_else(String::new, |m| format!("metrics on http://{m}/metrics\n")),
            self.address
        )
    }
}

/// A shard worker's transport address(es) as the bootstrap hands them out. A UCX shard
/// changes it when it replaces a stuck worker (see `transport::ucx::server::queue_probe`).
#[derive(Clone)]
pub(super) struct ShardAddress(Arc<std::sync::RwLock<(String, u64)>>);

impl ShardAddress {
    pub fn new(address: String) -> Self {
        ShardAddress(Arc::new(std::sync::RwLock::new((address, 0))))
    }

    /// How many times the address changed (the bootstrap then tells every client).
    pub fn moves(&self) -> u64 {
        self.0.read().unwrap_or_else(|e| e.into_inner()).1
    }

    pub fn get(&self) -> String {
        self.0.read().unwrap_or_else(|e| e.into_inner()).0.clone()
    }

    /// The shard moved to new endpoints: clients are told (and reconnect).
    pub fn set(&self, address: String) {
        self.hand_out(address);
        self.tell_moved();
    }

    /// New clients get `address`; those connected are not told (the old one still serves them).
    pub fn hand_out(&self, address: String) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).0 = address;
    }

    /// Tells every connected client to reconnect (a shard's old endpoints are going).
    pub fn tell_moved(&self) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).1 += 1;
    }
}

/// Hands the pages the allocator holds free back to the system: without it, the memory
/// of many departed clients stays in the server's resident set although nothing uses it.
fn return_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of glibc's heaps; callable any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns freed memory (see [`return_freed_memory`]) after clients departed or a worker
/// was destroyed, at most once a second: trimming walks every heap of the allocator.
pub(super) struct FreedMemory {
    due: bool,
    last: Option<Instant>,
}

impl FreedMemory {
    pub fn new() -> FreedMemory {
        FreedMemory { due: false, last: None }
    }

    /// Something a departed client held was freed.
    pub fn freed(&mut self) {
        self.due = true;
    }

    pub fn return_if_due(&mut self, now: Instant) {
        if self.due && self.last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            return_freed_memory();
            self.due = false;
            self.last = Some(now);
        }
    }
}

/// When to try again a replacement of a shard's endpoints that failed (no memory, no fds
/// for a moment): soon, then less and less often, never giving up: a shard stalled for good
/// is worse than a warning every few seconds.
pub(super) struct RetryBackoff {
    next_try: Option<std::time::Instant>,
    delay: Duration,
}

impl RetryBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MOST: Duration = Duration::from_secs(5);

    pub fn new() -> RetryBackoff {
        RetryBackoff { next_try: None, delay: Self::FIRST }
    }

    /// Whether an attempt may be made now.
    pub fn ready(&self, now: std::time::Instant) -> bool {
        self.next_try.is_none_or(|t| now >= t)
    }

    /// An attempt failed at `now`; returns how long until the next one.
    pub fn failed(&mut self, now: std::time::Instant) -> Duration {
        let delay = self.delay;
        self.next_try = Some(now + delay);
        self.delay = (delay * 2).min(Self::MOST);
        delay
    }

    pub fn succeeded(&mut self) {
        *self = RetryBackoff::new();
    }
}

/// What a shard worker says about itself, whatever its transport.
pub(super) struct WorkerInfo {
    /// Its transport address(es) as the bootstrap hands them out.
    pub address: ShardAddress,
    /// "ucx", or "fabric (provider …, fabric …, domain …)".
    pub transport: String,
    pub backing: Backing,
    pub bytes: u64,
    pub metrics: Arc<crate::metrics::ShardMetrics>,
}

/// What a worker thread reports once it is up.
struct Ready {
    index: usize,
    info: WorkerInfo,
    waker: Option<ucx::Waker>,
}

pub struct Server {
    info: ServerInfo,
    stop: Arc<AtomicBool>,
    /// UCX workers are woken at once; fabric workers notice `stop` within their sweep interval.
    wakers: Vec<ucx::Waker>,
    workers: Vec<JoinHandle<()>>,
    bootstrap: Option<JoinHandle<()>>,
    /// The bootstrap's listening socket (a second descriptor of it): shut down to end
    /// its accept loop, which needs no new descriptor (a connection of our own would,
    /// and a server out of them could not stop).
    bootstrap_socket: Option<TcpListener>,
    local_addr: SocketAddr,
    /// The `/metrics` endpoint, with `--metrics`.
    metrics: Option<metrics::Endpoint>,
}

impl Server {
    pub fn start(cfg: ServerConfig) -> Result<Server> {
        if cfg.workers == 0 || cfg.workers > 1024 {
            return Err(Error::new(Status::Invalid, "workers must be between 1 and 1024"));
        }
        let per_shard = cfg.memory / cfg.workers as u64;
        if per_shard < 1 << 16 {
            return Err(Error::new(Status::Invalid, "memory per shard must be at least 64 KiB"));
        }
        if cfg.stall_timeout.is_zero() {
            return Err(Error::new(Status::Invalid, "stall_timeout must be above 0"));
        }
        if cfg.max_clients == 0 {
            return Err(Error::new(Status::Invalid, "max_clients must be at least 1"));
        }
        if cfg.cluster_role.is_some() && cfg.cluster_secret.is_none() {
            return Err(Error::new(
                Status::Invalid,
                "a cluster member needs the cluster's secret (--cluster-secret-file), which its clients never see",
            ));
        }
        if cfg.auth_token.as_deref().is_some_and(str::is_empty) {
            return Err(Error::new(
                Status::Invalid,
                "the auth token is empty: give a non-empty token, or none for an open server",
            ));
        }
        // Resolved now, bound only once the workers are up: a client that connects while
        // the server is still starting is refused at once instead of waiting unanswered.
        let listen_addr = std::net::ToSocketAddrs::to_socket_addrs(&cfg.listen)
            .map_err(|e| Error::new(Status::Invalid, format!("listen address {}: {e}", cfg.listen)))?
            .next()
            .ok_or_else(|| Error::new(Status::Invalid, format!("listen address {} resolves to nothing", cfg.listen)))?;

        let stop = Arc::new(AtomicBool::new(false));
        if !cfg.cores.is_empty() {
            let allowed: Vec<usize> = core_affinity::get_core_ids().unwrap_or_default().iter().map(|c| c.id).collect();
            if let Some(c) = cfg.cores.iter().find(|c| !allowed.contains(c)) {
                return Err(Error::new(
                    Status::Invalid,
                    format!("core {c} is not one this process may run on (allowed: {allowed:?})"),
                ));
            }
        }
        let helper_cores = cores::helper_cores(&cfg.cores);
        let mut workers = Vec::new();
        let mut wakers = Vec::new();
        let mut addresses = Vec::new();
        let mut backing = Vec::new();
        let mut cores = Vec::new();
        let mut bytes = 0;
        let transport = cfg.transport.clone().resolve();
        let ucx_tcp = match transport {
            TransportChoice::Ucx if cfg.ucx_tcp => {
                // What no setting of ours closes (README, Security): said where operators look.
                warn!(
                    "UCX tcp is on (--ucx-tcp): UCX's tcp receiver carries out any peer's one-sided writes to this \
                     process's memory before the token check; let only trusted hosts reach {}",
                    listen_addr.ip()
                );
                ucx::Tcp::on_interface_of(listen_addr.ip())
            }
            TransportChoice::Ucx if ucx::env_enables_tcp() => {
                return Err(Error::new(
                    Status::Invalid,
                    "UCX_TLS enables UCX's tcp transport, which acts for any peer before the token check (one packet \
                     writes into the server's memory or crashes it): serve with --ucx-tcp (RDRAM_UCX_TCP=1) on a trusted \
                     network only, or use --transport fabric --provider \"tcp;ofi_rxm\" between hosts",
                ));
            }
            _ => ucx::Tcp::Off,
        };
        let reply_budget = Arc::new(reply_backlog::ReplyBudget::new(cfg.reply_budget));
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(cfg.workers);
        let mut members = Vec::new();
        for index in 0..cfg.workers {
            let core = cfg.cores.get(index % cfg.cores.len().max(1)).map(|&id| core_affinity::CoreId { id });
            cores.push(core.map(|c| c.id));
            let (tx, stop, cfg, transport, ucx_tcp, reply_budget, helper_cores) = (
                ready_tx.clone(),
                stop.clone(),
                cfg.clone(),
                transport.clone(),
                ucx_tcp.clone(),
                reply_budget.clone(),
                helper_cores.clone(),
            );
            let (member_tx, membership) = crossbeam_channel::unbounded();
            members.push(member_tx);
            let handle = std::thread::Builder::new()
                .name(format!("rdram-shard-{index}"))
                .spawn(move || {
                    if let Some(c) = core {
                        core_affinity::set_for_current(c);
                    }
                    let shard = match Shard::new(per_shard, cfg.hugepages, cfg.mode) {
                        Ok(s) => s,
                        Err(e) => return drop(tx.send(Err(e))),
                    };
                    // Built on this thread, which then runs it.
                    let mut service = Service::new(index, cfg.workers, membership, shard, reply_budget);
                    if let (Some(role), Some(secret)) = (&cfg.cluster_role, &cfg.cluster_secret) {
                        // UCX without its tcp transport moves values by shared memory or RDMA:
                        // the replica pulls a copy's bytes.
                        let copies_cost_the_sender =
                            !matches!(transport, TransportChoice::Ucx) || ucx_tcp != ucx::Tcp::Off;
                        if let Err(e) = service.set_cluster_role(
                            role.clone(),
                            secret.clone(),
                            cfg.auth_token.clone(),
                            helper_cores.clone(),
                            copies_cost_the_sender,
                        ) {
                            return drop(tx.send(Err(e)));
                        }
                    }
                    let built = match transport {
                        TransportChoice::Fabric { provider, rails } => {
                            crate::transport::fabric::server::FabricShardWorker::new(
                                service,
                                &provider,
                                listen_addr.ip(),
                                rails,
                                cfg.stall_timeout,
                            )
                            .and_then(|w| {
                                Ok((
                                    w.info()?,
                                    None,
                                    Box::new(move || w.run(cfg.poll, cfg.spin, stop)) as Box<dyn FnOnce()>,
                                ))
                            })
                        }
                        _ => crate::transport::ucx::server::ShardWorker::new(
                            service,
                            cfg.stall_timeout,
                            cfg.stranded_endpoint_limit,
                            ucx_tcp,
                        )
                        .and_then(|w| {
                            Ok((
                                w.info()?,
                                Some(w.waker()),
                                Box::new(move || w.run(cfg.poll, cfg.spin, stop)) as Box<dyn FnOnce()>,
                            ))
                        }),
                    };
                    match built {
                        Ok((info, waker, run)) => {
                            let _ = tx.send(Ok(Ready { index, info, waker }));
                            run();
                        }
                        Err(e) => drop(tx.send(Err(e))),
                    }
                })
                .map_err(|e| Error::new(Status::Internal, e.to_string()))?;
            workers.push(handle);
        }
        let mut ready: Vec<_> = Vec::new();
        let mut failure = None;
        for _ in 0..cfg.workers {
            match ready_rx.recv() {
                Ok(Ok(r)) => ready.push(r),
                Ok(Err(e)) => failure = Some(e),
                Err(_) => failure = Some(Error::new(Status::Internal, "a worker thread died during start")),
            }
        }
        ready.sort_by_key(|r| r.index);
        let transport_name = ready.first().map_or_else(String::new, |r| r.info.transport.clone());
        let mut shard_metrics = Vec::new();
        let bootstrap_metrics = Arc::new(metrics::BootstrapMetrics::default());
        for r in ready {
            shard_metrics.push(r.info.metrics);
            addresses.push(r.info.address);
            backing.push(r.info.backing);
            bytes = r.info.bytes;
            wakers.extend(r.waker);
        }
        let bound =
            TcpListener::bind(listen_addr).map_err(|e| Error::new(Status::Io, format!("bind {}: {e}", cfg.listen)));
        let local_addr = bound.as_ref().ok().and_then(|l| l.local_addr().ok()).unwrap_or(listen_addr);
        let mut server = Server {
            info: ServerInfo {
                protocol_version: PROTOCOL_VERSION,
                transport: transport_name,
                address: local_addr.to_string(),
                shards: cfg.workers,
                bytes_per_shard: bytes,
                backing,
                cores,
                mode: cfg.mode,
                poll: cfg.poll,
                metrics: None,
            },
            stop,
            wakers,
            workers,
            bootstrap: None,
            bootstrap_socket: None,
            local_addr,
            metrics: None,
        };
        let listener = match (failure, bound) {
            (None, Ok(l)) => l,
            (Some(e), _) | (None, Err(e)) => {
                server.shutdown();
                return Err(e);
            }
        };
        // Listening: the shards' memory faults in from now on, beside the requests.
        crate::store::arena::fault_in_from_now_on();
        let welcome = bootstrap::Shared {
            node: local_addr.to_string(),
            transport: match &transport {
                TransportChoice::Fabric { .. } => "fabric",
                _ => "ucx",
            },
            provider: match &transport {
                TransportChoice::Fabric { provider, .. } => provider.clone(),
                _ => String::new(),
            },
            ucx_tcp: ucx_tcp != ucx::Tcp::Off,
            shared_memory_scope: match &transport {
                TransportChoice::Fabric { provider, .. } if provider == "shm" => crate::transport::local_scope(),
                TransportChoice::Fabric { .. } => None,
                _ => crate::transport::ucx::shared_memory_scope(),
            },
            shards: addresses,
            token: cfg.auth_token.clone(),
            stop: server.stop.clone(),
            members,
            next_client: 1.into(),
            max_clients: cfg.max_clients,
            metrics: bootstrap_metrics.clone(),
            handshakes: Default::default(),
            next_handshake: 0.into(),
        };
        if let Some(listen) = &cfg.metrics {
            shard_metrics.iter().for_each(|m| m.time_requests());
            let collector = metrics::ServerCollector {
                shards: shard_metrics,
                bootstrap: bootstrap_metrics,
                transport: welcome.transport.to_string(),
                reply_budget: reply_budget.clone(),
                cluster: cfg.cluster_role.clone(),
            };
            match metrics::Endpoint::start(listen, Box::new(collector)) {
                Ok(endpoint) => {
                    server.info.metrics = Some(endpoint.local_addr().to_string());
                    server.metrics = Some(endpoint);
                }
                Err(e) => {
                    server.shutdown();
                    return Err(e);
                }
            }
        }
        server.bootstrap_socket = Some(listener.try_clone()?);
        server.bootstrap = Some(bootstrap::spawn(listener, welcome)?);
        debug!("{}", server.info.banner());
        Ok(server)
    }

    pub fn info(&self) -> &ServerInfo {
        &self.info
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops the workers and the bootstrap listener and waits for them.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Stops in order: no new clients (the bootstrap listener ends, and with it every
    /// client's session), then the workers (each lets its transfers in flight finish,
    /// destroys its endpoints and transport, then frees its arena).
    fn shutdown(&mut self) {
        self.metrics = None;
        self.stop.store(true, Ordering::SeqCst);
        if let Some(b) = self.bootstrap.take() {
            if let Some(socket) = self.bootstrap_socket.take() {
                // SAFETY: shutdown on a descriptor this server owns; it wakes the accept
                // blocked on the same socket (Linux), which then sees `stop`.
                unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&socket), libc::SHUT_RDWR) };
            }
            let _ = b.join();
        }
        for w in &self.wakers {
            w.wake();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if !self.workers.is_empty() || self.bootstrap.is_some() {
            self.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RetryBackoff;
    use std::time::{Duration, Instant};

    #[test]
    fn a_failed_replacement_is_tried_again_ever_later_but_never_given_up() {
        let mut retry = RetryBackoff::new();
        let t0 = Instant::now();
        assert!(retry.ready(t0));
        let delays: Vec<Duration> = (0..8).map(|_| retry.failed(t0)).collect();
        assert_eq!(delays[0], Duration::from_millis(100));
        assert!(delays.windows(2).all(|w| w[1] >= w[0]), "{delays:?}");
        assert_eq!(*delays.last().unwrap(), Duration::from_secs(5), "the delay is not capped: {delays:?}");
        assert!(!retry.ready(t0 + Duration::from_millis(4999)));
        assert!(retry.ready(t0 + Duration::from_secs(5)));
        retry.succeeded();
        assert!(retry.ready(t0));
        assert_eq!(retry.failed(t0), Duration::from_millis(100), "success does not start over");
    }

    /// UCX tcp is a trusted-network opt-in that the edges take from the environment; a
    /// library user's default config never turns it on behind their back.
    #[test]
    fn a_default_config_leaves_ucx_tcp_off_whatever_the_environment_says() {
        std::env::set_var(super::UCX_TCP_ENV, "1");
        let (default, opted_in) = (super::ServerConfig::default().ucx_tcp, super::ucx_tcp_opted_in_by_env());
        std::env::set_var(super::UCX_TCP_ENV, "off");
        let off = super::ucx_tcp_opted_in_by_env();
        std::env::remove_var(super::UCX_TCP_ENV);
        assert!(!default, "ServerConfig::default() read {}", super::UCX_TCP_ENV);
        assert!(opted_in && !off, "the edges' reading of {}", super::UCX_TCP_ENV);
    }
}
