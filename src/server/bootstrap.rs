//! The bootstrap listener: answers each client's TCP handshake (version, auth token) with
//! the shards' transport addresses and a session credential of that client's own. Off the
//! data path.
//!
//! After the handshake the connection is kept open until the client closes it: a client
//! whose transport cannot see a peer die (libfabric RDM) watches it, so a server process
//! that goes away is noticed at once instead of at the next timeout; and when it closes
//! (the client closed, exited or was killed) the workers revoke the client's session and
//! free what it held.
//!
//! Bounds: at most [`MAX_HANDSHAKES`] handshakes at once, [`MAX_HANDSHAKES_PER_SOURCE`] of
//! them from one address, each finished within [`HANDSHAKE_TIMEOUT`] in all (not per
//! byte); at a bound the oldest handshake in progress there is cut, so that silent sockets
//! (from one host, or from many) cannot lock a prompt client out; at most
//! `max_clients` welcomed clients, counted apart from handshakes; and a new client only
//! while the process has [`FD_HEADROOM`] file descriptors to spare (a client's endpoints
//! need some). Beyond any of these a client is told "server at capacity" and why; with no
//! fd left at all, one kept in reserve is let go to accept and tell it.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::service::Membership;
use crate::auth;
use crate::error::{Error, Result, Status};
use crate::metrics::BootstrapMetrics;
use crate::proto::bootstrap::{
    hex_decode, hex_encode, read_line_until, write_line, Challenge, Hello, Proof, Welcome, MAGIC, MOVED_NOTICE,
};
use crate::proto::PROTOCOL_VERSION;
use crate::server::tunables::{
    ACCEPT_BACKOFF, FD_HEADROOM, HANDSHAKE_TIMEOUT, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE,
};

pub struct Shared {
    pub node: String,
    pub transport: &'static str,
    pub provider: String,
    /// See [`Welcome::shared_memory_scope`].
    pub shared_memory_scope: Option<String>,
    /// See [`Welcome::ucx_tcp`].
    pub ucx_tcp: bool,
    /// Each shard worker's address(es), encoded for the Welcome.
    pub shards: Vec<super::ShardAddress>,
    pub token: Option<String>,
    pub stop: Arc<AtomicBool>,
    /// Every worker hears of each client's session and departure.
    pub members: Vec<crossbeam_channel::Sender<Membership>>,
    pub next_client: AtomicU64,
    pub max_clients: usize,
    /// Connected clients and handshake outcomes (also for `--metrics`).
    pub metrics: Arc<BootstrapMetrics>,
    /// Handshakes in progress, oldest first (see [`HandshakePlace`]).
    pub handshakes: std::sync::Mutex<std::collections::VecDeque<InProgress>>,
    pub next_handshake: AtomicU64,
}

/// A handshake in progress: a second handle on its socket, to cut it when it must make
/// room for a newer one.
pub struct InProgress {
    id: u64,
    source: std::net::IpAddr,
    stream: TcpStream,
}

impl Shared {
    /// How many times shards moved to new endpoints so far (all shards together).
    fn moves(&self) -> u64 {
        self.shards.iter().map(super::ShardAddress::moves).sum()
    }

    fn tell_workers(&self, m: Membership) {
        for tx in &self.members {
            let _ = tx.send(m);
        }
    }
}

pub fn spawn(listener: TcpListener, shared: Shared) -> Result<JoinHandle<()>> {
    let shared = Arc::new(shared);
    let (keep_tx, keep_rx) = crossbeam_channel::unbounded();
    let keeper = shared.clone();
    std::thread::Builder::new()
        .name("rdram-keeper".into())
        .spawn(move || keep_open(keep_rx, &keeper))
        .map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    std::thread::Builder::new()
        .name("rdram-bootstrap".into())
        .spawn(move || {
            // Let go when the process is out of fds, to accept the client waiting and
            // tell it so (instead of leaving it to its connect timeout).
            let mut reserve = std::fs::File::open("/dev/null").ok();
            for stream in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let stream = match stream {
                    Ok(s) => s,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) && reserve.is_some() => {
                        drop(reserve.take());
                        if let Ok((s, from)) = listener.accept() {
                            debug!("refused {from}: out of file descriptors");
                            refuse_at_once(&s, &shared, "server at capacity: out of file descriptors");
                        }
                        reserve = std::fs::File::open("/dev/null").ok();
                        std::thread::sleep(ACCEPT_BACKOFF);
                        continue;
                    }
                    Err(e) => {
                        // Out of fds (or memory): spinning on accept would not free any.
                        if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
                        {
                            warn!("bootstrap: cannot accept ({e}); pausing {ACCEPT_BACKOFF:?}");
                            std::thread::sleep(ACCEPT_BACKOFF);
                        }
                        continue;
                    }
                };
                let Some(place) = HandshakePlace::take(&shared, &stream) else {
                    continue;
                };
                let (shared, keep) = (shared.clone(), keep_tx.clone());
                // One short-lived thread per handshake, so a slow client cannot stall others.
                let spawned = std::thread::Builder::new().name("rdram-handshake".into()).spawn(move || {
                    let result = handshake(stream, &shared);
                    drop(place);
                    match result {
                        Ok(kept) => drop(keep.send(kept)),
                        Err(e) => debug!("handshake failed: {e}"),
                    }
                });
                if spawned.is_err() {
                    warn!("bootstrap: cannot start a handshake thread");
                }
            }
        })
        .map_err(|e| Error::new(Status::Internal, e.to_string()))
}

/// Answers a connection with a refusal and closes it, without a thread of its own. Counted
/// and logged at debug only: a connection flood must not become a log flood.
fn refuse_at_once(stream: &TcpStream, shared: &Shared, why: &str) {
    shared.metrics.refused_capacity.fetch_add(1, Ordering::Relaxed);
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = write_line(stream, &Welcome::refusal(Status::Unavailable, why.into()));
}

/// A place among the handshakes in progress, given back when dropped.
///
/// At a bound (all places, or those of one source address) the oldest handshake in
/// progress there is cut to make room: whoever holds sockets open without finishing them
/// only ever cuts their own (or, from many addresses, the oldest), and a client that
/// completes its handshake promptly always gets through.
struct HandshakePlace {
    shared: Arc<Shared>,
    id: u64,
}

impl HandshakePlace {
    /// A place for `stream`'s handshake, or None after telling it why there is none.
    fn take(shared: &Arc<Shared>, stream: &TcpStream) -> Option<HandshakePlace> {
        let source = stream.peer_addr().map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip());
        if free_fds().is_some_and(|free| free < FD_HEADROOM) {
            let why = "server at capacity: out of file descriptors";
            debug!("refused {source}: {why}");
            refuse_at_once(stream, shared, why);
            return None;
        }
        let Ok(second) = stream.try_clone() else {
            refuse_at_once(stream, shared, "server at capacity: out of file descriptors");
            return None;
        };
        let id = shared.next_handshake.fetch_add(1, Ordering::Relaxed);
        let mut all = shared.handshakes.lock().unwrap_or_else(|e| e.into_inner());
        let from_source = all.iter().filter(|h| h.source == source).count();
        let oldest = if from_source >= MAX_HANDSHAKES_PER_SOURCE {
            all.iter().position(|h| h.source == source)
        } else if all.len() >= MAX_HANDSHAKES {
            Some(0)
        } else {
            None
        };
        if let Some(cut) = oldest.and_then(|at| all.remove(at)) {
            debug!("bootstrap: cut the oldest handshake in progress from {} to make room", cut.source);
            shared.metrics.refused_capacity.fetch_add(1, Ordering::Relaxed);
            let _ = cut.stream.shutdown(std::net::Shutdown::Both);
        }
        all.push_back(InProgress { id, source, stream: second });
        shared.metrics.handshakes_in_progress.store(all.len(), Ordering::Relaxed);
        Some(HandshakePlace { shared: shared.clone(), id })
    }
}

impl Drop for HandshakePlace {
    fn drop(&mut self) {
        let mut all = self.shared.handshakes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = all.iter().position(|h| h.id == self.id) {
            all.remove(at);
        }
        self.shared.metrics.handshakes_in_progress.store(all.len(), Ordering::Relaxed);
    }
}

/// File descriptors this process may still open (its limit less those open), if known.
fn free_fds() -> Option<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the limit into `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    // Listing them takes a descriptor too: when none is left, none is free.
    let Ok(open) = std::fs::read_dir("/proc/self/fd").map(Iterator::count) else {
        return Some(0);
    };
    Some((limit.rlim_cur as usize).saturating_sub(open))
}

/// Tests only: the workers hear of a client's departure this many milliseconds after its
/// bootstrap connection closed, as a busy keeper might tell them late; a test can then
/// act while a dead client's session still looks live.
pub const TEST_DEPARTURE_DELAY_ENV: &str = "RDRAM_TEST_DEPARTURE_DELAY_MS";

/// Holds welcomed clients' connections until each client closes its end (or the server
/// stops, which closes them all).
fn keep_open(incoming: crossbeam_channel::Receiver<Kept>, shared: &Shared) {
    let mut kept: Vec<Kept> = Vec::new();
    let delay = std::env::var(TEST_DEPARTURE_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    // Departures seen, and when the workers hear of them.
    let mut departing: Vec<(u64, Instant)> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        kept.extend(incoming.try_iter());
        let now = Instant::now();
        departing.retain(|&(client, due)| {
            let tell = due <= now;
            if tell {
                shared.tell_workers(Membership::Left { client });
            }
            !tell
        });
        // A shard moved to new endpoints: clients welcomed before learn it here (see
        // MOVED_NOTICE) and reconnect, instead of each waiting out a timeout on the old ones.
        let moved = shared.moves();
        for k in kept.iter_mut().filter(|k| k.moves_known < moved) {
            k.moves_known = moved;
            let _ = k.stream.set_write_timeout(Some(Duration::from_millis(10)));
            if let Err(e) = std::io::Write::write_all(&mut k.stream, &[MOVED_NOTICE]) {
                debug!("client {}: cannot tell it a shard moved: {e}", k.client);
            }
        }
        let mut fds: Vec<libc::pollfd> =
            kept.iter().map(|k| libc::pollfd { fd: k.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: `fds` holds one valid pollfd per kept stream.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n <= 0 {
            continue;
        }
        let mut buf = [0u8; 256];
        let mut i = 0;
        kept.retain_mut(|Kept { stream: s, client, .. }| {
            let ready = fds[i].revents != 0;
            i += 1;
            // Readable means closed (read returns 0) or stray bytes, which are dropped.
            let open = !ready || matches!(s.read(&mut buf), Ok(n) if n > 0);
            if !open {
                info!("client {client} ({}) departed", peer(s));
                match delay.is_zero() {
                    true => shared.tell_workers(Membership::Left { client: *client }),
                    false => departing.push((*client, now + delay)),
                }
                shared.metrics.clients.fetch_sub(1, Ordering::SeqCst);
            }
            open
        });
    }
    // Stopping: every client's session ends with the server.
    for client in kept.iter().map(|k| k.client).chain(departing.into_iter().map(|(c, _)| c)) {
        shared.tell_workers(Membership::Left { client });
    }
}

/// A welcomed client's bootstrap connection, kept open.
struct Kept {
    stream: TcpStream,
    client: u64,
    /// The shards' moves (see [`Shared::moves`]) its welcome's addresses already reflect:
    /// it is told of later ones only (one welcomed during a move already has the new
    /// address, and telling it would fail its first call for nothing).
    moves_known: u64,
}

fn handshake(mut stream: TcpStream, shared: &Shared) -> Result<Kept> {
    stream.set_nodelay(true)?;
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let hello: Hello = match read_line_until(&stream, deadline) {
        Ok(h) => h,
        Err(e) => {
            shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
            let _ = write_line(&mut stream, &Welcome::refusal(e.status, e.message.clone()));
            return Err(e);
        }
    };
    let refuse = |stream: &mut TcpStream, status: Status, msg: String| {
        let m = &shared.metrics;
        let counter = match status {
            Status::AuthFailed => &m.refused_auth,
            Status::VersionMismatch => &m.refused_version,
            _ => &m.refused_capacity,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        info!("refused {}: {msg}", peer(stream));
        write_line(stream, &Welcome::refusal(status, msg))
    };
    let refused = |status: Status, msg: &str| Error::new(status, format!("refused: {msg}"));
    if hello.magic != MAGIC {
        refuse(&mut stream, Status::VersionMismatch, "not a remote_dram client".into())?;
        return Err(refused(Status::VersionMismatch, "not a remote_dram client"));
    }
    if hello.version != PROTOCOL_VERSION {
        let msg = format!("protocol version mismatch: server speaks v{PROTOCOL_VERSION}, client v{}", hello.version);
        refuse(&mut stream, Status::VersionMismatch, msg.clone())?;
        return Err(refused(Status::VersionMismatch, &msg));
    }
    // Challenge–response: each side proves it knows the token; the token never travels.
    let client_nonce = match hex_decode(&hello.nonce) {
        Ok(n) if n.len() == auth::NONCE_LEN => n,
        _ => {
            let msg = "the hello carries no valid nonce".to_string();
            refuse(&mut stream, Status::Invalid, msg.clone())?;
            return Err(refused(Status::Invalid, &msg));
        }
    };
    let server_nonce = auth::nonce()?;
    let challenge = Challenge {
        magic: MAGIC.into(),
        version: PROTOCOL_VERSION,
        error: None,
        nonce: hex_encode(&server_nonce),
        proof: shared
            .token
            .as_deref()
            .map(|t| hex_encode(&auth::token_proof(t, auth::Side::Server, &client_nonce, &server_nonce))),
    };
    write_line(&mut stream, &challenge)?;
    let proof: Proof = match read_line_until(&stream, deadline) {
        Ok(p) => p,
        Err(e) => {
            shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    if let Some(token) = &shared.token {
        let given = proof.proof.as_deref().map(hex_decode).and_then(std::result::Result::ok);
        let holds = given
            .as_deref()
            .is_some_and(|p| auth::token_proof_holds(p, token, auth::Side::Client, &client_nonce, &server_nonce));
        if !holds {
            let why = if proof.proof.is_none() { "this server requires an auth token" } else { "wrong auth token" };
            refuse(&mut stream, Status::AuthFailed, why.into())?;
            return Err(refused(Status::AuthFailed, why));
        }
    }
    if shared.metrics.clients.fetch_add(1, Ordering::SeqCst) >= shared.max_clients {
        shared.metrics.clients.fetch_sub(1, Ordering::SeqCst);
        let msg = format!("server at capacity: {} clients connected (--max-clients)", shared.max_clients);
        refuse(&mut stream, Status::Unavailable, msg.clone())?;
        return Err(refused(Status::Unavailable, &msg));
    }
    let client_id = shared.next_client.fetch_add(1, Ordering::Relaxed);
    let session = match random_session() {
        Ok(s) => s,
        Err(e) => {
            shared.metrics.clients.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
    };
    // The workers learn the session before the client does, so its first request finds it.
    shared.tell_workers(Membership::Joined { client: client_id, session });
    // Read before the addresses: a move in between is told to it (harmless), never missed.
    let moves_known = shared.moves();
    let welcomed = write_line(
        &mut stream,
        &Welcome {
            magic: MAGIC.into(),
            version: PROTOCOL_VERSION,
            error: None,
            transport: shared.transport.into(),
            provider: shared.provider.clone(),
            node: shared.node.clone(),
            session,
            shards: shared.shards.iter().map(super::ShardAddress::get).collect(),
            shared_memory_scope: shared.shared_memory_scope.clone(),
            ucx_tcp: shared.ucx_tcp,
        },
    );
    if let Err(e) = welcomed {
        shared.tell_workers(Membership::Left { client: client_id });
        shared.metrics.clients.fetch_sub(1, Ordering::SeqCst);
        shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
        return Err(e);
    }
    shared.metrics.accepted.fetch_add(1, Ordering::Relaxed);
    info!("client {client_id} connected from {}", peer(&stream));
    Ok(Kept { stream, client: client_id, moves_known })
}

fn peer(stream: &TcpStream) -> String {
    stream.peer_addr().map_or_else(|_| "unknown address".into(), |a| a.to_string())
}

/// A client's secret: 64 random bits, never 0 (0 means "none").
fn random_session() -> Result<u64> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| Error::new(Status::Internal, format!("no randomness for a session: {e}")))?;
    Ok(u64::from_le_bytes(bytes).max(1))
}
