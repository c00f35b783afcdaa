//! The bootstrap listener: answers each client's TCP handshake (version, auth token) with
//! the shards' transport addresses and the session credential. Off the data path.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
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
}

pub fn spawn(listener: TcpListener, shared: Shared) -> Result<JoinHandle<()>> {
    let shared = Arc::new(shared);
    std::thread::Builder::new()
        .name("rdram-bootstrap".into())
        .spawn(move || {
            for stream in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let shared = shared.clone();
                // One short-lived thread per handshake, so a slow client cannot stall others.
                let _ = std::thread::Builder::new().name("rdram-handshake".into()).spawn(move || {
                    if let Err(e) = handshake(stream, &shared) {
                        debug!("handshake failed: {e}");
                    }
                });
            }
        })
        .map_err(|e| Error::new(Status::Internal, e.to_string()))
}

fn handshake(mut stream: TcpStream, shared: &Shared) -> Result<()> {
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
    if hello.magic != MAGIC {
        return refuse(&mut stream, Status::VersionMismatch, "not a remote_dram client".into());
    }
    if hello.version != PROTOCOL_VERSION {
        return refuse(
            &mut stream,
            Status::VersionMismatch,
            format!("protocol version mismatch: server speaks v{PROTOCOL_VERSION}, client v{}", hello.version),
        );
    }
    if let Some(expected) = &shared.token {
        let given = hello.token.as_deref().unwrap_or("");
        if !constant_time_eq(given.as_bytes(), expected.as_bytes()) {
            let why = if hello.token.is_none() { "this server requires an auth token" } else { "wrong auth token" };
            return refuse(&mut stream, Status::AuthFailed, why.into());
        }
    }
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
            shards: shared.shards.clone(),
        },
    )
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
