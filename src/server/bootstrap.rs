//! The bootstrap listener: answers each client's TCP handshake (version, auth token) with
//! the shards' transport addresses and the session credential. Off the data path.
//!
//! After the handshake the connection is kept open until the client closes it: a client
//! whose transport cannot see a peer die (libfabric RDM) watches it, so a server process
//! that goes away is noticed at once instead of at the next timeout.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, info};

use crate::error::{Error, Result, Status};
use crate::proto::bootstrap::{read_line, write_line, Hello, Welcome, MAGIC};
use crate::proto::PROTOCOL_VERSION;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Shared {
    pub node: String,
    pub transport: &'static str,
    pub provider: String,
    pub session: u64,
    /// Each shard worker's address(es), encoded for the Welcome.
    pub shards: Vec<String>,
    pub token: Option<String>,
    pub stop: Arc<AtomicBool>,
    /// Told the number of each client whose bootstrap connection closed (one per
    /// libfabric worker, which then frees that client's slot).
    pub departures: Vec<crossbeam_channel::Sender<u64>>,
    pub next_client: AtomicU64,
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
            for stream in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (shared, keep) = (shared.clone(), keep_tx.clone());
                // One short-lived thread per handshake, so a slow client cannot stall others.
                let _ = std::thread::Builder::new().name("rdram-handshake".into()).spawn(move || {
                    match handshake(stream, &shared) {
                        Ok(kept) => drop(keep.send(kept)),
                        Err(e) => debug!("handshake failed: {e}"),
                    }
                });
            }
        })
        .map_err(|e| Error::new(Status::Internal, e.to_string()))
}

/// Holds welcomed clients' connections until each client closes its end (or the server
/// stops, which closes them all).
fn keep_open(incoming: crossbeam_channel::Receiver<(TcpStream, u64)>, shared: &Shared) {
    let mut kept: Vec<(TcpStream, u64)> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        kept.extend(incoming.try_iter());
        let mut fds: Vec<libc::pollfd> = kept.iter().map(|(s, _)| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: `fds` holds one valid pollfd per kept stream.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n <= 0 {
            continue;
        }
        let mut buf = [0u8; 256];
        let mut i = 0;
        kept.retain_mut(|(s, client)| {
            let ready = fds[i].revents != 0;
            i += 1;
            // Readable means closed (read returns 0) or stray bytes, which are dropped.
            let open = !ready || matches!(s.read(&mut buf), Ok(n) if n > 0);
            if !open {
                for tx in &shared.departures {
                    let _ = tx.send(*client);
                }
            }
            open
        });
    }
}

fn handshake(mut stream: TcpStream, shared: &Shared) -> Result<(TcpStream, u64)> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let hello: Hello = match read_line(&stream, HANDSHAKE_TIMEOUT) {
        Ok(h) => h,
        Err(e) => {
            let _ = write_line(&mut stream, &Welcome::refusal(e.status, e.message.clone()));
            return Err(e);
        }
    };
    let refuse = |stream: &mut TcpStream, status: Status, msg: String| {
        info!("refused {:?}: {msg}", stream.peer_addr().ok());
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
    if let Some(expected) = &shared.token {
        let given = hello.token.as_deref().unwrap_or("");
        if !constant_time_eq(given.as_bytes(), expected.as_bytes()) {
            let why = if hello.token.is_none() { "this server requires an auth token" } else { "wrong auth token" };
            refuse(&mut stream, Status::AuthFailed, why.into())?;
            return Err(refused(Status::AuthFailed, why));
        }
    }
    let client_id = shared.next_client.fetch_add(1, Ordering::Relaxed);
    write_line(
        &mut stream,
        &Welcome {
            magic: MAGIC.into(),
            version: PROTOCOL_VERSION,
            error: None,
            transport: shared.transport.into(),
            provider: shared.provider.clone(),
            node: shared.node.clone(),
            session: shared.session,
            client_id,
            shards: shared.shards.clone(),
        },
    )?;
    Ok((stream, client_id))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
