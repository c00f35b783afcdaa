//! Which UCX transports a worker runs: the transport list (`UCX_TLS`), UCX's tcp transport
//! (off unless asked for, see [`Tcp`]), the settings every worker gets, and where shared
//! memory reaches.

/// True when the transport list (`UCX_TLS`, or what the worker was made with) enables only
/// shared-memory transports and those cannot detect peer failure (asking for it would
/// fail, noisily, on every endpoint): UCX 1.13, or error handling turned off with
/// `UCX_MM_ERROR_HANDLING=n`.
pub(super) fn shared_memory_only(tls: Option<&str>, shm_detects_failure: bool) -> bool {
    if shm_detects_failure {
        return false;
    }
    const SHM: [&str; 8] = ["posix", "sysv", "cma", "self", "sm", "shm", "knem", "xpmem"];
    match tls {
        Some(tls) if !tls.trim().is_empty() && !tls.starts_with('^') => tls.split(',').all(|t| SHM.contains(&t.trim())),
        _ => false,
    }
}

/// Whether the user's `UCX_TLS` names shared-memory transports only (this process can then
/// reach no server outside its [`crate::transport::local_scope`]).
pub fn env_allows_only_shared_memory() -> bool {
    shared_memory_only(std::env::var("UCX_TLS").ok().as_deref(), false)
}

/// UCX settings (names without `UCX_`) of a worker that only talks to servers on this
/// host, through shared memory (see [`super::Worker::with_settings`]): what a one-shot command
/// can skip. A context that looks for no tcp interfaces starts tens of milliseconds sooner,
/// and one shared-memory transport instead of two (posix, whose queue the server maps
/// once) saves a third of a command's page faults; cma moves large values.
pub const LOCAL_SHARED_MEMORY: &[(&str, &str)] = &[("TLS", "posix,cma,self")];

/// The same for a client that hands device memory to UCX ([`crate::client::DevicePath`]):
/// with UCX's CUDA transports, which move it between processes of one host.
pub const LOCAL_SHARED_MEMORY_WITH_CUDA: &[(&str, &str)] = &[("TLS", "posix,cma,cuda_copy,cuda_ipc,self")];

/// UCX settings every worker of this crate has (unless the environment says otherwise).
///
/// UCX carries out a peer's puts and gets on this process's memory without a key that
/// means anything: its tcp transport writes a put wherever the peer says, and UCP emulates
/// RMA over active messages (copying to and from any address named) for contexts with
/// `UCP_FEATURE_RMA`. remote_dram moves every byte with active messages, so its contexts
/// ask for no RMA (see [`super::Worker::with_settings`]), and tcp interfaces do not advertise
/// puts: a peer's stock UCX then has no way to name our memory (tests/ucx_rma.rs). UCX's
/// rendezvous over tcp does not use them by default either, so nothing is slower. What
/// remains is UCX's tcp receiver itself, which honours a hand-made put message from any
/// peer that reaches its port whatever it advertised (see README, Security).
pub(super) const HARDENING: &[(&str, &str)] = &[("TCP_PUT_ENABLE", "n")];

/// UCX settings every worker has for speed (unless the environment says otherwise). UCX's
/// tcp transport moves a large value in segments of its TX/RX segment size, each a message
/// of its own: at UCX's default 8 KiB a 32 MiB value is 4,096 of them, and moved at under
/// half the rate of 1 MiB segments (bench/README.md, "Mooncake Store, side by side"). A
/// connection holds one segment each way only while it moves one. UCX's tcp receiver takes
/// a message of up to its RX segment size and (release builds) overruns its buffer on a
/// longer one, so every peer must receive into segments at least as large as any peer
/// sends: one value for both, the same in every process of one protocol version (a user's
/// `UCX_TCP_*_SEG_SIZE` must match across hosts too).
pub(super) const SPEED: &[(&str, &str)] = &[("TCP_TX_SEG_SIZE", "1m"), ("TCP_RX_SEG_SIZE", "1m")];

/// The size of the worker's registered pool segments, which is set whatever the
/// environment says: UCX (1.22) packs an active message's user header into one of them
/// for zero-copy sends, but bounds the header by its transports' largest copied fragment
/// alone (`ucp_worker_query`'s `max_am_header`), which tcp's segment size raises far past
/// the pool's. A header longer than the segment then overruns it and corrupts the heap
/// (`free(): invalid next size`). [`super::Worker::max_am_header`] bounds headers by it.
pub(super) const POOL_SEGMENT: usize = 8 << 10;

/// Whether a worker runs UCX's tcp transport. UCX's tcp receiver carries out a put message
/// from any peer that reaches its port, before any remote_dram check (a hand-made one
/// writes wherever it says, or crashes the process), and UCX never closes a silent
/// connection to it. So no worker runs it unless asked to, for a trusted network.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Tcp {
    /// No tcp transport (`UCX_TLS=^tcp` unless the environment names transports).
    #[default]
    Off,
    /// tcp, its listeners on `device` only (the interface of the address the server
    /// listens on, or the client reached it from); None: every interface.
    On { device: Option<String> },
}

impl Tcp {
    /// tcp on the interface that holds `ip` (every interface for an unspecified address,
    /// or one that no interface holds).
    pub fn on_interface_of(ip: std::net::IpAddr) -> Tcp {
        Tcp::On { device: if ip.is_unspecified() { None } else { crate::transport::interface_of(ip) } }
    }

    pub(super) fn settings(&self) -> Vec<(&'static str, String)> {
        match self {
            Tcp::Off => vec![("TLS", "^tcp".into())],
            Tcp::On { device: Some(d) } => vec![("NET_DEVICES", d.clone())],
            Tcp::On { device: None } => Vec::new(),
        }
    }
}

/// Whether the user's `UCX_TLS` (set) lets UCX use its tcp transport.
pub fn env_enables_tcp() -> bool {
    std::env::var("UCX_TLS").is_ok_and(|tls| tls_may_use_tcp(&tls))
}

fn tls_may_use_tcp(tls: &str) -> bool {
    let names = |list: &str| list.split(',').map(str::trim).any(|t| t == "tcp" || t == "all");
    match tls.trim() {
        "" => true,
        tls => match tls.strip_prefix('^') {
            Some(excluded) => !excluded.split(',').any(|t| t.trim() == "tcp"),
            None => names(tls),
        },
    }
}

/// Where this process's UCX shared memory reaches, when its transports (`UCX_TLS`)
/// include posix shared memory (what [`LOCAL_SHARED_MEMORY`] keeps): the boot, the IPC
/// and PID namespaces (what UCX's sysv and posix transports need in common) and the user
/// (cma reads the peer's memory, which needs the same one). Two processes with the same
/// scope reach each other over [`LOCAL_SHARED_MEMORY`]'s transports.
pub fn shared_memory_scope() -> Option<String> {
    if offers_shared_memory() {
        crate::transport::local_scope()
    } else {
        None
    }
}

/// Whether `UCX_TLS` lets UCX use posix shared memory (unset, an exclusion list, or a list
/// naming it).
pub fn offers_shared_memory() -> bool {
    let tls = std::env::var("UCX_TLS").unwrap_or_default();
    tls.trim().is_empty() || tls.starts_with('^') || tls.split(',').any(|t| ["posix", "sm", "shm"].contains(&t.trim()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn which_transport_lists_let_ucx_use_tcp() {
        for tls in ["", "all", "tcp", "posix,tcp", " tcp , cma", "^posix", "^sysv,cma"] {
            assert!(super::tls_may_use_tcp(tls), "{tls:?}");
        }
        for tls in ["posix,sysv,cma,self", "posix,cma,self", "^tcp", "^posix,tcp", "rc,ud"] {
            assert!(!super::tls_may_use_tcp(tls), "{tls:?}");
        }
    }
}
