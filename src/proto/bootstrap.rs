//! Out-of-band connection setup over a plain TCP socket: one JSON line each way.
//!
//! The client sends a [`Hello`] (protocol version, auth token); the server answers with a
//! [`Welcome`]: its transport, its shard count and, per shard, the transport address of the
//! shard's worker (a UCX worker address today, a libfabric `fi_getname` address next), plus
//! the session credential every data-path request must carry.

use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::error::{Error, Result, Status};

pub const MAGIC: &str = "remote_dram";
/// Neither side accepts a bootstrap line longer than this.
const MAX_LINE: usize = 1 << 20;

#[derive(Serialize, Deserialize, Debug)]
pub struct Hello {
    pub magic: String,
    pub version: u8,
    #[serde(default)]
    pub token: Option<String>,
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
    #[serde(default)]
    pub session: u64,
    /// This bootstrap connection's number: a libfabric client names it in its hellos, and
    /// when the connection closes (the client exited or died) the workers free its slots.
    #[serde(default)]
    pub client_id: u64,
    /// Each shard worker's transport address, in shard order: hex (UCX), or hex per
    /// rail joined by commas (libfabric).
    #[serde(default)]
    pub shards: Vec<String>,
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
            client_id: 0,
            shards: Vec::new(),
        }
    }
}

pub fn write_line<T: Serialize>(stream: &mut TcpStream, msg: &T) -> Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    line.push(b'\n');
    stream.write_all(&line)?;
    Ok(())
}

pub fn read_line<T: for<'de> Deserialize<'de>>(stream: &TcpStream, timeout: Duration) -> Result<T> {
    stream.set_read_timeout(Some(timeout))?;
    let mut line = Vec::new();
    let mut reader = BufReader::new(stream).take(MAX_LINE as u64);
    let n = reader.read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(Error::new(Status::Unavailable, "peer closed the bootstrap connection"));
    }
    serde_json::from_slice(&line).map_err(|e| {
        Error::new(Status::VersionMismatch, format!("peer does not speak the remote_dram bootstrap protocol: {e}"))
    })
}

pub fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn hex_decode(s: &str) -> Result<Vec<u8>> {
    if s.len() % 2 != 0 {
        return Err(Error::new(Status::Invalid, "odd-length hex address"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| Error::new(Status::Invalid, "bad hex address")))
        .collect()
}

use std::io::Read as _;
