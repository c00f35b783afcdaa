//! How the protocol travels over libfabric (tagged messages on RDM endpoints).
//!
//! Client → shard worker, tag = [`REQUEST`] | the client's slot at that worker:
//!   RequestHeader (72 B) || inline key || payload, in one message of at most
//!   [`REQUEST_MSG_MAX`] bytes. A longer request sends its payload by reference instead
//!   (flag REMOTE_VALUE; the payload is then a [`RemoteValue`]) and the worker reads it
//!   from the client's registered memory with one-sided reads, striped over the rails.
//!   A client that vanishes mid-transfer fails those reads, so its reserved slot is freed.
//!   On shm, whose messages up to its inject size (4 KiB) go through an inline queue and
//!   longer ones by a protocol three times slower, a request longer than the inject size
//!   travels in parts of at most that size instead ([`split_request`]): its first bytes,
//!   with flag IN_PARTS set in the header, then parts that each start with a
//!   [`PartHeader`]. The worker joins them (at most [`REQUEST_MSG_MAX`] bytes in all)
//!   before reading the request. A client sends the parts back to back and the provider
//!   delivers one sender's messages in order (FI_ORDER_SAS).
//! Client → shard worker, tag = [`HELLO`]: a [`Hello`] with the session the bootstrap
//!   issued to this client (after its token check) and the client's rail addresses; a
//!   hello without a live session is dropped unanswered. The worker binds the slot to
//!   that client's bootstrap connection (freed when it closes) and answers (as a reply to `hello_id`) with the client's slot in `generation`
//!   and a random credential in `value_size`. Requests carry the credential in the
//!   header's session field; one naming a slot without its credential is dropped.
//! Shard worker → client, tag = [`REPLY`] | request id:
//!   ReplyHeader (40 B, `payload_len` set) || payload when 40 + payload fits
//!   [`REPLY_MSG_MAX`] (shm: its 4 KiB inline size); else the header alone (the receiver
//!   tells by the length), then the payload as a [`DATA`] | request id
//!   message striped over the rails — unless the client's GET declared a smaller buffer
//!   (`ttl_or_limit` = capacity + 1), then no payload is sent: it stays on the server.

use super::REQUEST_HEADER_LEN;
use crate::error::{Error, Result, Status};

pub const REQUEST: u64 = 0;
pub const HELLO: u64 = 1 << 62;
pub const REPLY: u64 = 2 << 62;
pub const DATA: u64 = 3 << 62;
/// The worker's receives take every client → worker kind (top bit clear).
pub const TO_WORKER_IGNORE: u64 = (1 << 63) - 1;
pub const KIND_MASK: u64 = 3 << 62;
/// Request ids and slots live in the low bits.
pub const ID_MASK: u64 = (1 << 62) - 1;

pub const REQUEST_MSG_MAX: usize = 16 << 10;
pub const REPLY_MSG_MAX: usize = 16 << 10;

/// The start of a request's second or later part. The request id and the slot's
/// credential sit where a request header has them (bytes 8..16 and 16..24), so the worker
/// checks a part's credential as it checks a request's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartHeader {
    pub request_id: u64,
    pub credential: u64,
    /// The request's last part.
    pub last: bool,
}

pub const PART_HEADER_LEN: usize = 24;
const PART_MAGIC: u16 = 0x5052; // "RP"

impl PartHeader {
    pub fn encode(&self) -> [u8; PART_HEADER_LEN] {
        let mut out = [0u8; PART_HEADER_LEN];
        out[0..2].copy_from_slice(&PART_MAGIC.to_le_bytes());
        out[2] = super::PROTOCOL_VERSION;
        out[3] = self.last as u8;
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.credential.to_le_bytes());
        out
    }

    /// The part header `msg` starts with; None when `msg` is not a part (a request header
    /// starts with another magic).
    pub fn decode(msg: &[u8]) -> Option<PartHeader> {
        let h = msg.get(..PART_HEADER_LEN)?;
        if u16::from_le_bytes([h[0], h[1]]) != PART_MAGIC || h[2] != super::PROTOCOL_VERSION || h[3] > 1 {
            return None;
        }
        let word = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().unwrap());
        Some(PartHeader { request_id: word(8), credential: word(16), last: h[3] == 1 })
    }
}

/// Whether `msg` is the first part of a request that continues in parts.
pub fn starts_parts(msg: &[u8]) -> bool {
    msg.get(4..8).is_some_and(|f| u32::from_le_bytes(f.try_into().unwrap()) & super::flags::IN_PARTS != 0)
}

/// Clears IN_PARTS in a joined request's header.
pub fn clear_in_parts(msg: &mut [u8]) {
    if let Some(f) = msg.get_mut(4..8) {
        let flags = u32::from_le_bytes((&*f).try_into().unwrap()) & !super::flags::IN_PARTS;
        f.copy_from_slice(&flags.to_le_bytes());
    }
}

/// The bytes a `len`-byte request takes on the wire in parts of at most `part_max` bytes
/// (see [`split_request`]).
pub fn split_len(len: usize, part_max: usize) -> usize {
    if len <= part_max || part_max <= PART_HEADER_LEN {
        return len;
    }
    let rest = len - part_max;
    len + rest.div_ceil(part_max - PART_HEADER_LEN) * PART_HEADER_LEN
}

/// Rewrites `msg`, a whole request (header with the request id and credential, then the
/// rest), in place into the parts it travels in when longer than `part_max` bytes, laid
/// end to end; `ends` gets where each part ends. A request that fits is left as it is,
/// with `ends` empty: it travels as one message. `msg` grows to
/// [`split_len`] bytes (within its capacity when that is at least as large).
pub fn split_request(msg: &mut Vec<u8>, part_max: usize, ends: &mut Vec<usize>) {
    ends.clear();
    let len = msg.len();
    if len <= part_max || len < REQUEST_HEADER_LEN || part_max <= PART_HEADER_LEN {
        return;
    }
    let word = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().unwrap());
    let (request_id, credential) = (word(8), word(16));
    let flags = u32::from_le_bytes(msg[4..8].try_into().unwrap()) | super::flags::IN_PARTS;
    msg[4..8].copy_from_slice(&flags.to_le_bytes());
    let chunk = part_max - PART_HEADER_LEN;
    let parts = (len - part_max).div_ceil(chunk);
    msg.resize(split_len(len, part_max), 0);
    // Later part k's bytes move PART_HEADER_LEN * (k + 1) forward. Last part first: no
    // move or header then lands on bytes still to be moved.
    for k in (0..parts).rev() {
        let from = part_max + k * chunk;
        let to = from + (k + 1) * PART_HEADER_LEN;
        msg.copy_within(from..(from + chunk).min(len), to);
        msg[to - PART_HEADER_LEN..to]
            .copy_from_slice(&PartHeader { request_id, credential, last: k + 1 == parts }.encode());
    }
    ends.extend((0..=parts).map(|k| (part_max * (k + 1)).min(msg.len())));
}

/// A payload left in the client's memory for the worker to read: its length and, per
/// rail, the address and key of the client's registration on that rail's domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteValue {
    pub len: u64,
    pub rails: Vec<(u64, u64)>,
}

impl RemoteValue {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&(self.rails.len() as u64).to_le_bytes());
        for (addr, key) in &self.rails {
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&key.to_le_bytes());
        }
    }

    /// Parses a payload that ends with a RemoteValue; returns what precedes it (a long key)
    /// and the value reference.
    pub fn decode_tail(payload: &[u8], rails: usize) -> Result<(&[u8], RemoteValue)> {
        let size = 16 + 16 * rails;
        let bad = || Error::new(Status::Invalid, "malformed remote value reference");
        let at = payload.len().checked_sub(size).ok_or_else(bad)?;
        let (head, tail) = payload.split_at(at);
        let word = |i: usize| u64::from_le_bytes(tail[i * 8..i * 8 + 8].try_into().unwrap());
        if word(1) != rails as u64 {
            return Err(Error::new(
                Status::Invalid,
                format!("remote value names {} rails, the server has {rails}", word(1)),
            ));
        }
        let refs = (0..rails).map(|r| (word(2 + 2 * r), word(3 + 2 * r))).collect();
        Ok((head, RemoteValue { len: word(0), rails: refs }))
    }
}

/// A client introducing itself to a shard worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub session: u64,
    pub hello_id: u64,
    /// The client's rail addresses (`fi_getname`), one per rail.
    pub addresses: Vec<Vec<u8>>,
}

const HELLO_MAGIC: u32 = 0x4844_5246; // "FRDH"

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
        out.extend_from_slice(&self.session.to_le_bytes());
        out.extend_from_slice(&self.hello_id.to_le_bytes());
        out.extend_from_slice(&(self.addresses.len() as u32).to_le_bytes());
        for a in &self.addresses {
            out.extend_from_slice(&(a.len() as u32).to_le_bytes());
            out.extend_from_slice(a);
        }
        out
    }

    pub fn decode(mut buf: &[u8]) -> Result<Hello> {
        let bad = || Error::new(Status::Invalid, "malformed fabric hello");
        let mut take = |n: usize| -> Result<&[u8]> {
            let (a, b) = buf.split_at_checked(n).ok_or_else(bad)?;
            buf = b;
            Ok(a)
        };
        if u32::from_le_bytes(take(4)?.try_into().unwrap()) != HELLO_MAGIC {
            return Err(bad());
        }
        let session = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let hello_id = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let n = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        if n == 0 || n > 64 {
            return Err(bad());
        }
        let mut addresses = Vec::with_capacity(n);
        for _ in 0..n {
            let len = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
            addresses.push(take(len)?.to_vec());
        }
        Ok(Hello { session, hello_id, addresses })
    }
}

/// Rail addresses as the bootstrap carries them: hex per rail, comma-separated.
pub fn encode_addresses(addrs: &[Vec<u8>]) -> String {
    addrs.iter().map(|a| super::bootstrap::hex_encode(a)).collect::<Vec<_>>().join(",")
}

pub fn decode_addresses(s: &str) -> Result<Vec<Vec<u8>>> {
    s.split(',').map(super::bootstrap::hex_decode).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_request_splits_into_parts_that_join_back() {
        let mut h = crate::proto::RequestHeader::new(crate::proto::Op::Put, 77, 0xC0DE);
        h.key_len = 3;
        let mut whole = [0u8; REQUEST_HEADER_LEN].to_vec();
        h.encode((&mut whole[..REQUEST_HEADER_LEN]).try_into().unwrap());
        whole.extend((0..9000u32).map(|i| i as u8));
        let mut msg = whole.clone();
        let mut ends = Vec::new();
        split_request(&mut msg, 4096, &mut ends);
        assert_eq!(msg.len(), split_len(whole.len(), 4096));
        assert_eq!(ends.len(), 3, "4096 bytes, then two parts of at most 4096 - 24");
        assert_eq!(*ends.last().unwrap(), msg.len());
        assert!(starts_parts(&msg[..ends[0]]) && !starts_parts(&whole));
        // Joined as the worker joins them: the first part, then each part past its header.
        let mut joined = msg[..ends[0]].to_vec();
        for (k, w) in ends.windows(2).enumerate() {
            let part = &msg[w[0]..w[1]];
            assert!(part.len() <= 4096);
            let ph = PartHeader::decode(part).unwrap();
            assert_eq!((ph.request_id, ph.credential, ph.last), (77, 0xC0DE, k == ends.len() - 2));
            assert!(PartHeader::decode(&whole).is_none(), "a request header is not a part");
            joined.extend_from_slice(&part[PART_HEADER_LEN..]);
        }
        clear_in_parts(&mut joined);
        assert_eq!(joined, whole);

        let mut short = whole[..4000].to_vec();
        split_request(&mut short, 4096, &mut ends);
        assert!(ends.is_empty() && short == whole[..4000] && !starts_parts(&short), "a request that fits stays whole");
        assert_eq!(split_len(4000, 4096), 4000);

        // Every length around the part boundaries, split in place and joined back.
        whole.extend((0..8000u32).map(|i| (i * 7) as u8));
        for len in [4097, 4096 + 4072, 4096 + 4072 + 1, 4096 + 2 * 4072, 16_000, 16_384] {
            let mut msg = whole[..len].to_vec();
            split_request(&mut msg, 4096, &mut ends);
            assert_eq!((msg.len(), *ends.last().unwrap()), (split_len(len, 4096), split_len(len, 4096)), "{len}");
            let mut joined = msg[..ends[0]].to_vec();
            for w in ends.windows(2) {
                assert!(w[1] - w[0] <= 4096 && w[1] > w[0] + PART_HEADER_LEN, "{len}: part {w:?}");
                assert!(PartHeader::decode(&msg[w[0]..w[1]]).unwrap().last == (w[1] == msg.len()), "{len}");
                joined.extend_from_slice(&msg[w[0] + PART_HEADER_LEN..w[1]]);
            }
            clear_in_parts(&mut joined);
            assert!(joined == whole[..len], "{len}");
        }
    }

    #[test]
    fn hello_and_remote_value_round_trip_and_reject_garbage() {
        let h = Hello { session: 9, hello_id: 3, addresses: vec![vec![1, 2, 3], vec![4; 40]] };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&h.encode()[..20]).is_err());
        assert!(Hello::decode(b"garbage garbage garbage garbage").is_err());

        let v = RemoteValue { len: 1 << 30, rails: vec![(0x1000, 7), (0x2000, 8)] };
        let mut payload = b"long key".to_vec();
        v.encode(&mut payload);
        let (key, back) = RemoteValue::decode_tail(&payload, 2).unwrap();
        assert_eq!((key, back), (&b"long key"[..], v));
        assert!(RemoteValue::decode_tail(&payload, 3).is_err(), "rail count must match");
        assert!(RemoteValue::decode_tail(&payload[..10], 2).is_err());
    }

    #[test]
    fn tag_kinds_are_distinct_and_worker_receives_only_client_kinds() {
        for kind in [REQUEST, HELLO] {
            assert_eq!(kind & !TO_WORKER_IGNORE, 0);
        }
        for kind in [REPLY, DATA] {
            assert_ne!(kind & !TO_WORKER_IGNORE, 0);
        }
        let all = [REQUEST, HELLO, REPLY, DATA];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a & KIND_MASK, b & KIND_MASK);
            }
        }
    }
}
