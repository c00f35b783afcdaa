//! Proofs of shared secrets. Two secrets exist:
//! - the **auth token**, which every client and server holds. It never crosses the wire:
//!   the bootstrap's challenge–response ([`token_proof`]) proves each side knows it;
//! - the **cluster secret**, which only a cluster's servers hold ([`ClusterSecret`]). It
//!   authenticates their member records in etcd and the tickets that let a frame install
//!   a generation on a replica: a key's primary makes one for each copy of a write it
//!   sends the key's replicas (and movers for theirs), and a replica takes a copy only
//!   with it. No client ever holds one, nor can make one up.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result, Status};

type HmacSha256 = Hmac<Sha256>;

/// Compares without an early exit, so the time taken tells nothing about where the
/// first difference is, nor about the expected length.
pub fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = (given.len() ^ expected.len()) as u64;
    for (i, &e) in expected.iter().enumerate() {
        diff |= (e ^ given.get(i).copied().unwrap_or(!e)) as u64;
    }
    diff == 0
}

/// HMAC-SHA256 of `parts` under `secret`, each part length-prefixed so that no two
/// different lists of parts give the same input.
fn mac(secret: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    mac_keyed(&HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length"), parts)
}

/// [`mac`] from an HMAC already keyed with the secret (which saves two of the hash's
/// rounds on each of the short inputs tickets are).
fn mac_keyed(keyed: &HmacSha256, parts: &[&[u8]]) -> [u8; 32] {
    let mut m = keyed.clone();
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Bytes of a bootstrap nonce.
pub const NONCE_LEN: usize = 32;

/// A fresh random nonce for a handshake.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n)
        .map_err(|e| Error::new(Status::Internal, format!("no randomness for a nonce: {e}")))?;
    Ok(n)
}

/// Which side of a handshake a proof is from: a proof made for one side is never
/// accepted from the other, so a server cannot reflect a client's proof back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Server,
    Client,
}

/// A proof that the sender knows `token`, bound to both sides' nonces of one handshake.
pub fn token_proof(token: &str, side: Side, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; 32] {
    let label: &[u8] = match side {
        Side::Server => b"remote_dram bootstrap: server",
        Side::Client => b"remote_dram bootstrap: client",
    };
    mac(token.as_bytes(), &[label, client_nonce, server_nonce])
}

/// Whether `given` is the proof [`token_proof`] makes.
pub fn token_proof_holds(given: &[u8], token: &str, side: Side, client_nonce: &[u8], server_nonce: &[u8]) -> bool {
    constant_time_eq(given, &token_proof(token, side, client_nonce, server_nonce))
}

/// What a replication ticket allows, on one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// Install a value of `len` bytes, TTL `ttl_ms`, under `generation`.
    Put { generation: u64, len: u64, ttl_ms: u64 },
    /// Delete the key unless it holds a generation newer than `generation`.
    Delete { generation: u64 },
    /// Hold the key for a handover (a mover, on its own server).
    Hold,
    /// End a handover, deleting the key if it still holds `generation`.
    EndHold { generation: u64 },
    /// Copy the key from the server's memory to members that hold it under the placement
    /// (a mover, on its own server).
    CopyOut,
}

/// Bytes of a ticket on the wire: HMAC-SHA256 truncated to 128 bits.
pub const TICKET_LEN: usize = 16;

/// The secret a cluster's servers share and clients never see (`--cluster-secret-file`).
#[derive(Clone)]
pub struct ClusterSecret(Arc<HmacSha256>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// At least this many bytes: the secret is what keeps clients from forging generations.
    pub const MIN_LEN: usize = 16;

    pub fn new(bytes: &[u8]) -> Result<ClusterSecret> {
        if bytes.len() < Self::MIN_LEN {
            return Err(Error::new(
                Status::Invalid,
                format!("the cluster secret must be at least {} bytes, not {}", Self::MIN_LEN, bytes.len()),
            ));
        }
        Ok(ClusterSecret(Arc::new(HmacSha256::new_from_slice(bytes).expect("HMAC takes keys of any length"))))
    }

    /// Reads a secret file, without its trailing newline; warns when others may read it.
    pub fn from_file(path: &str) -> Result<ClusterSecret> {
        use std::os::unix::fs::PermissionsExt;
        let bytes = std::fs::read(path)
            .map_err(|e| Error::new(Status::Invalid, format!("cannot read cluster secret file {path}: {e}")))?;
        if std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o077 != 0) {
            tracing::warn!("cluster secret file {path} is readable by group or others: chmod 600 it");
        }
        let trimmed = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        let trimmed = trimmed.strip_suffix(b"\r").unwrap_or(trimmed);
        Self::new(trimmed).map_err(|e| Error::new(e.status, format!("{path}: {}", e.message)))
    }

    /// The ticket for `grant` on `key`.
    pub fn ticket(&self, key: &[u8], grant: Grant) -> [u8; TICKET_LEN] {
        let (kind, a, b, c): (&[u8], u64, u64, u64) = match grant {
            Grant::Put { generation, len, ttl_ms } => (b"put", generation, len, ttl_ms),
            Grant::Delete { generation } => (b"delete", generation, 0, 0),
            Grant::Hold => (b"hold", 0, 0, 0),
            Grant::EndHold { generation } => (b"end hold", generation, 0, 0),
            Grant::CopyOut => (b"copy out", 0, 0, 0),
        };
        let full = mac_keyed(
            &self.0,
            &[b"remote_dram ticket", kind, key, &a.to_le_bytes(), &b.to_le_bytes(), &c.to_le_bytes()],
        );
        full[..TICKET_LEN].try_into().unwrap()
    }

    /// Whether `given` is the ticket for `grant` on `key`.
    pub fn allows(&self, given: &[u8; TICKET_LEN], key: &[u8], grant: Grant) -> bool {
        constant_time_eq(given, &self.ticket(key, grant))
    }

    /// The seal of a member record: its bytes and the etcd lease it is attached to.
    pub fn seal(&self, record: &[u8], lease: i64) -> String {
        crate::proto::bootstrap::hex_encode(&mac_keyed(&self.0, &[b"remote_dram member", record, &lease.to_le_bytes()]))
    }

    /// Whether `seal` is [`ClusterSecret::seal`] of `record` under `lease`.
    pub fn seal_holds(&self, seal: &str, record: &[u8], lease: i64) -> bool {
        constant_time_eq(seal.as_bytes(), self.seal(record, lease).as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison_needs_the_same_bytes_and_length() {
        use super::constant_time_eq as eq;
        assert!(eq(b"secret", b"secret"));
        assert!(!eq(b"secre", b"secret"));
        assert!(!eq(b"secretX", b"secret"));
        assert!(!eq(b"", b"secret"));
        assert!(!eq(b"secreT", b"secret"));
    }

    #[test]
    fn proofs_bind_token_side_and_nonces() {
        let (c, s) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = token_proof("t0ken", Side::Client, &c, &s);
        assert!(token_proof_holds(&p, "t0ken", Side::Client, &c, &s));
        assert!(!token_proof_holds(&p, "t0ken", Side::Server, &c, &s), "a client's proof is no server's");
        assert!(!token_proof_holds(&p, "other", Side::Client, &c, &s));
        assert!(!token_proof_holds(&p, "t0ken", Side::Client, &s, &c));
    }

    #[test]
    fn tickets_bind_key_and_grant() {
        let secret = ClusterSecret::new(b"sixteen bytes at least").unwrap();
        let grant = Grant::Put { generation: 7, len: 3, ttl_ms: 0 };
        let t = secret.ticket(b"k", grant);
        assert!(secret.allows(&t, b"k", grant));
        assert!(!secret.allows(&t, b"k2", grant));
        assert!(!secret.allows(&t, b"k", Grant::Put { generation: 8, len: 3, ttl_ms: 0 }));
        assert!(!secret.allows(&t, b"k", Grant::Put { generation: 7, len: 4, ttl_ms: 0 }));
        assert!(!secret.allows(&t, b"k", Grant::Delete { generation: 7 }));
        let other = ClusterSecret::new(b"another sixteen bytes").unwrap();
        assert!(!other.allows(&t, b"k", grant));
        assert!(ClusterSecret::new(b"short").is_err());
    }

    #[test]
    fn seals_bind_record_and_lease() {
        let secret = ClusterSecret::new(b"sixteen bytes at least").unwrap();
        let seal = secret.seal(b"{}", 42);
        assert!(secret.seal_holds(&seal, b"{}", 42));
        assert!(!secret.seal_holds(&seal, b"{}", 43));
        assert!(!secret.seal_holds(&seal, b"{ }", 42));
    }
}
