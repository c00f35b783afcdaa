//! Out-of-band connection setup over a plain TCP socket: JSON lines, two each way.
//!
//! 1. The client sends a [`Hello`]: protocol version and a random nonce.
//! 2. The server answers with a [`Challenge`]: a nonce of its own and, when it has an auth
//!    token, its proof that it knows the token (HMAC-SHA256 under the token over both
//!    nonces, [`crate::auth::token_proof`]). A client with a token checks that proof
//!    before it sends anything else, so a server that does not know the token learns
//!    nothing from it; the token itself never crosses the wire.
//! 3. The client sends its [`Proof`] the same way (the other side's label, so neither proof
//!    can stand for the other).
//! 4. The server answers with a [`Welcome`]: its transport, its shard count and, per shard,
//!    the transport address of the shard's worker, plus the client's own session
//!    credential, which every data-path request must carry. Or a refusal: a [`Welcome`]
//!    with `error` set, which may also come in place of the challenge.

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};

pub const MAGIC: &str = "remote_dram";
/// After the handshake the connection stays open and silent, except for this byte: the
/// server moved one of its shards to new transport endpoints (it replaced a stuck worker
/// or shm endpoints), so the client's addresses are stale. A client fails its calls in
/// flight with Unavailable and reconnects on the next call, rather than timing out.
pub const MOVED_NOTICE: u8 = b'M';
/// Neither side accepts a bootstrap line longer than this.
const MAX_LINE: usize = 1 << 20;

#[derive(Serialize, Deserialize, Debug)]
pub struct Hello {
    pub magic: String,
    pub version: u8,
    /// The client's nonce, hex ([`crate::auth::NONCE_LEN`] bytes).
    #[serde(default)]
    pub nonce: String,
}

/// The server's first answer: its nonce and, when it has a token, its proof.
#[derive(Serialize, Deserialize, Debug, Default)]
pub struct Challenge {
    pub magic: String,
    pub version: u8,
    /// Set when the server refuses the connection at once: status code and message.
    #[serde(default)]
    pub error: Option<(i8, String)>,
    /// The server's nonce, hex.
    #[serde(default)]
    pub nonce: String,
    /// The server's proof that it knows the auth token, hex; None for an open server.
    #[serde(default)]
    pub proof: Option<String>,
}

/// The client's proof that it knows the auth token, hex; None for a client without one.
#[derive(Serialize, Deserialize, Debug, Default)]
pub struct Proof {
    #[serde(default)]
    pub proof: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Welcome {
    pub magic: String,
    pub version: u8,
    /// Set when the server refuses the connection: status code and message.
    #[serde(default)]
    pub error: Option<(i8, String)>,
    #[serde(default)]
    pub transport: String,
    /// libfabric provider when `transport` is "fabric" (the client opens the same).
    #[serde(default)]
    pub provider: String,
    /// The server's canonical address; clusters hash keys over these.
    #[serde(default)]
    pub node: String,
    /// This client's own secret, issued after the token check: every data-path request
    /// (and a libfabric hello) carries it; it is revoked when this connection closes.
    #[serde(default)]
    pub session: u64,
    /// Each shard worker's transport address, in shard order: hex (UCX), or hex per
    /// rail joined by commas (libfabric).
    #[serde(default)]
    pub shards: Vec<String>,
    /// Set by a UCX server whose transports include shared memory, and by a libfabric
    /// `shm` server: where its shared memory reaches (see
    /// `transport::ucx::shared_memory_scope`). A client in the same scope may connect over
    /// shared memory alone; a libfabric `shm` client elsewhere cannot connect at all.
    #[serde(default)]
    pub shared_memory_scope: Option<String>,
    /// Set by a UCX server that runs UCX's tcp transport (`--ucx-tcp`, trusted networks
    /// only): its clients run it too, else they leave it off.
    #[serde(default)]
    pub ucx_tcp: bool,
}

impl Welcome {
    pub fn refusal(status: Status, message: String) -> Self {
        Welcome {
            magic: MAGIC.into(),
            version: super::PROTOCOL_VERSION,
            error: Some((status as i8, message)),
            transport: String::new(),
            provider: String::new(),
            node: String::new(),
            session: 0,
            shards: Vec::new(),
            shared_memory_scope: None,
            ucx_tcp: false,
        }
    }
}

/// The client's side of the handshake on a connected `stream` to `addr`, with
/// `token` if it has one: the server's welcome, or why it refused (or could not prove
/// that it knows the token, in which case nothing but nonces was sent to it).
pub fn client_handshake(stream: &mut TcpStream, addr: &str, token: Option<&str>, timeout: Duration) -> Result<Welcome> {
    use crate::auth::{token_proof, token_proof_holds, Side};
    let deadline = Instant::now() + timeout;
    let client_nonce = crate::auth::nonce()?;
    write_line(
        &mut *stream,
        &Hello { magic: MAGIC.into(), version: super::PROTOCOL_VERSION, nonce: hex_encode(&client_nonce) },
    )?;
    let challenge: Challenge = read_line_until(stream, deadline)?;
    if let Some((code, msg)) = challenge.error {
        return Err(Error::new(Status::from_code(code), format!("server {addr} refused the connection: {msg}")));
    }
    if challenge.version != super::PROTOCOL_VERSION {
        return Err(Error::new(
            Status::VersionMismatch,
            format!(
                "protocol version mismatch: client speaks v{}, server {addr} v{}",
                super::PROTOCOL_VERSION,
                challenge.version
            ),
        ));
    }
    let server_nonce = hex_decode(&challenge.nonce)?;
    let proof = match token {
        Some(token) => {
            let proved = challenge
                .proof
                .as_deref()
                .map(hex_decode)
                .transpose()?
                .is_some_and(|p| token_proof_holds(&p, token, Side::Server, &client_nonce, &server_nonce));
            if !proved {
                let why = match challenge.proof {
                    None => "it runs without an auth token",
                    Some(_) => "wrong auth token here or there",
                };
                return Err(Error::new(
                    Status::AuthFailed,
                    format!("server {addr} could not prove that it knows this client's auth token ({why}); nothing was sent to it"),
                ));
            }
            Some(hex_encode(&token_proof(token, Side::Client, &client_nonce, &server_nonce)))
        }
        None => None,
    };
    write_line(&mut *stream, &Proof { proof })?;
    let welcome: Welcome = read_line_until(stream, deadline)?;
    if let Some((code, msg)) = welcome.error {
        return Err(Error::new(Status::from_code(code), format!("server {addr} refused the connection: {msg}")));
    }
    Ok(welcome)
}

pub fn write_line<T: Serialize>(mut stream: impl Write, msg: &T) -> Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    line.push(b'\n');
    stream.write_all(&line)?;
    Ok(())
}

pub fn read_line<T: for<'de> Deserialize<'de>>(stream: &TcpStream, timeout: Duration) -> Result<T> {
    read_line_until(stream, Instant::now() + timeout)
}

/// Reads one line that must be complete by `deadline` (a peer trickling one byte at a
/// time cannot stretch it).
pub fn read_line_until<T: for<'de> Deserialize<'de>>(mut stream: &TcpStream, deadline: Instant) -> Result<T> {
    let mut line = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(Status::Timeout, "bootstrap line not complete in time"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            return Err(Error::new(Status::Unavailable, "peer closed the bootstrap connection"));
        }
        // Exactly one line: the peer sends nothing after it until we answer.
        if let Some(end) = chunk[..n].iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&chunk[..end]);
            break;
        }
        line.extend_from_slice(&chunk[..n]);
        if line.len() > MAX_LINE {
            return Err(Error::new(Status::Invalid, "bootstrap line too long"));
        }
    }
    serde_json::from_slice(&line).map_err(|e| {
        Error::new(Status::VersionMismatch, format!("peer does not speak the remote_dram bootstrap protocol: {e}"))
    })
}

pub fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn hex_decode(s: &str) -> Result<Vec<u8>> {
    // Byte-wise: a peer's text may hold anything, multi-byte characters included.
    let digit = |b: u8| (b as char).to_digit(16).ok_or_else(|| Error::new(Status::Invalid, "bad hex address"));
    let bytes = s.as_bytes();
    if bytes.len() % 2 != 0 {
        return Err(Error::new(Status::Invalid, "odd-length hex address"));
    }
    bytes.chunks(2).map(|p| Ok((digit(p[0])? << 4 | digit(p[1])?) as u8)).collect()
}
