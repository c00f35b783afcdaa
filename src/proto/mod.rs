//! The wire protocol: fixed little-endian headers carried as the UCX active-message header,
//! followed by the payload (key, key || value, list entries, error text).
//!
//! Request (AM id [`AM_REQUEST`], client → shard worker):
//!   header  = RequestHeader (72 B) || key            when the key fits the inline budget
//!           = RequestHeader (72 B)                   with FLAG_KEY_IN_PAYLOAD otherwise
//!   With [`flags::VIEW`], 8 bytes follow the header (either form), before the key: the
//!   epoch of the cluster view the client routed with.
//!   The header may instead take its short form (32 B, [`flags::SHORT_FORM`]): the first
//!   24 bytes, then key_len and aux_len, all other fields at their defaults (no condition,
//!   range or TTL). UCX clients send it when it says everything: over UCX's shared memory
//!   a message travels inline in the receiver's queue only up to about 92 bytes, and the
//!   40 bytes saved keep requests with keys up to about 50 bytes there.
//!   payload = value                                  (put, key inline)
//!           = key || value                           (put, FLAG_KEY_IN_PAYLOAD)
//!           = range_min || range_max                 (list, delete-range; lengths in the header)
//! Abort (op [`Op::Abort`], `ttl_or_limit` = the id of an earlier request of the same
//!   client): "I gave up on that request". The worker stops reading its payload from the
//!   client's memory, discards it (never publishes it), and answers the abort only once
//!   nothing of that request can touch the client's memory any more; a client whose
//!   call timed out waits for that answer before its call returns.
//! Reply (AM id [`AM_REPLY`], shard worker → client):
//!   header  = ReplyHeader (40 B), or over UCX one of its compact forms when they say
//!             everything ([`ReplyHeader::encode_compact`]): 20 B when `value_size` is the
//!             payload's length, 24 B when there is no payload; `more` 0 in both.
//!   payload = value bytes (get), list entries (list), JSON (stats) or UTF-8 error text;
//!             for a put or delete a cluster client routed to the key's primary, the
//!             ticket ([`crate::auth::TICKET_LEN`] bytes) its copies to the key's other
//!             replicas carry ([`RequestHeader::ticket`]).
//!   Why compact: UCX's shared memory puts a short message in its receiver's queue after a
//!   28-byte element header and its own 8-byte header, and sends the user header after the
//!   payload. A 40-byte reply header with an 8-byte value reaches into the element's second
//!   cache line, which then crosses between the two cores twice per reply (the client reads
//!   it; the server's next write into that element takes it back), which made a GET 8 B
//!   a fifth slower. 20 + 8 bytes stay in the first line.
//! Probe (AM id [`AM_PROBE`], within one server process: a shard's watchdog → the shard):
//!   header  = a random u64 (little-endian), no payload, no reply. The shard notes it; a probe
//!   that never arrives means the shard's receive queue is stuck (see `transport::ucx::server::queue_probe`).
//!
//! Every field is validated by [`RequestHeader::decode`] before anything else looks at it.

pub mod bootstrap;
pub mod fabric;
mod kind;
mod range;
mod routing;
pub use kind::Kind;
pub use range::ByteRange;
pub use routing::{node_seed, rendezvous, rendezvous_among, rendezvous_ranked, shard_of, Ranked};

use crate::error::Status;

/// 4: requests may come in [`flags::SHORT_FORM`]. 5: replies may come in a compact form
/// ([`ReplyHeader::encode_compact`]). 6: cluster views, redirects and handovers
/// ([`flags::VIEW`], [`flags::ASKING`], [`flags::IMPORT`], [`flags::MIGRATE`]).
/// 9: bootstrap proofs instead of the token. 10: a key's primary copies writes to its
/// replicas itself, and answers reads of a key being copied with `Replicating`. 11: an op
/// and flags that name no request ([`Kind`]) are refused; a shard at its bound of staged
/// values or handovers answers `NoRoom`, not `Unavailable`. 12: UCX tcp moves segments of
/// 1 MiB (a peer receiving into smaller ones has its heap overrun by UCX; see
/// `transport::ucx::transports::SPEED`), so peers of 11 must not meet it. 13: a mover's
/// copies go from its server's memory straight to their targets ([`flags::FORWARD`]). 14: a
/// primary stages a large write's value on its replicas in parts as it arrives, and commits
/// it there as an import ([`Kind::ImportStaged`]).
pub const PROTOCOL_VERSION: u8 = 14;
pub const MAGIC: u16 = 0x5244; // "RD"
/// Where an encoded request keeps its id, in the full and the short form alike.
const REQUEST_ID_AT: std::ops::Range<usize> = 8..16;
/// Where an encoded request keeps its session, in the full and the short form alike.
const SESSION_AT: std::ops::Range<usize> = 16..24;
/// Starts a reply header in a compact form.
pub const COMPACT_REPLY_MAGIC: u16 = 0x5352; // "RS"

pub const AM_REQUEST: u16 = 11;
pub const AM_REPLY: u16 = 12;
pub const AM_PROBE: u16 = 13;

pub const MAX_KEY_LEN: usize = 64 * 1024;
pub const MAX_VALUE_LEN: u64 = 1 << 30;
/// Keys up to this length travel in the AM header; longer ones are prepended to the payload.
pub const INLINE_KEY_MAX: usize = 1024;
/// A put tells the server where its value sits in the writer's memory, modulo this; the
/// server stores a large value at the same offset within a cache line, so that copying it
/// (over shared memory, the kernel's cross-process copy) is mutually aligned. Copies whose
/// destination lies 1 to 15 bytes past the source, modulo 64, ran at a third of the speed
/// (1 MiB puts over UCX cma).
pub const VALUE_ALIGN: u64 = 64;
/// Entries per list reply; the client asks again from the last key for more.
pub const LIST_BATCH: u32 = 16 * 1024;
/// Key bytes per list reply (at least one key): a reply the server builds and holds
/// until sent stays small whatever the keys' lengths.
pub const LIST_REPLY_MAX_KEY_BYTES: usize = 1 << 20;
/// Keys one delete-range request removes; the client repeats it while `more` is set, so
/// the worker never spends unbounded time on one request.
pub const DELETE_RANGE_BATCH: usize = 4096;

pub const REQUEST_HEADER_LEN: usize = 72;
/// The longest header: the full form and a view ([`flags::VIEW`]).
pub const MAX_REQUEST_HEADER_LEN: usize = REQUEST_HEADER_LEN + VIEW_LEN;
/// Bytes of a view's epoch after the fixed header.
pub const VIEW_LEN: usize = 8;
/// A request header in its short form ([`flags::SHORT_FORM`]).
pub const SHORT_REQUEST_HEADER_LEN: usize = 32;
pub const REPLY_HEADER_LEN: usize = 40;
/// A reply header in its compact form for a reply whose payload is the whole value (or
/// empty): the value's size is the payload's length.
pub const COMPACT_REPLY_LEN: usize = 20;
/// A reply header in its compact form for a reply without payload, `value_size` in 32 bits.
pub const COMPACT_EMPTY_REPLY_LEN: usize = 24;

/// Request flags.
pub mod flags {
    pub const KEY_IN_PAYLOAD: u32 = 1 << 0;
    pub const IF_EQUAL: u32 = 1 << 1;
    pub const IF_NOT_EQUAL: u32 = 1 << 2;
    pub const IF_ABSENT: u32 = 1 << 3;
    pub const HAS_RANGE: u32 = 1 << 4;
    /// Range operations: the upper bound is absent (unbounded).
    pub const MAX_UNBOUNDED: u32 = 1 << 5;
    pub const HAS_TTL: u32 = 1 << 6;
    /// Put over libfabric: the payload ends with a [`crate::proto::fabric::RemoteValue`]
    /// that the server reads the value through (one-sided), instead of the value itself.
    pub const REMOTE_VALUE: u32 = 1 << 7;
    /// The header is in its short form: 32 bytes, with key_len and aux_len at 24..32 and
    /// the fields in between at their defaults (see [`crate::proto::RequestHeader::encode_short`]).
    pub const SHORT_FORM: u32 = 1 << 9;
    /// The request was routed with a cluster's view: the 8 bytes after the fixed header
    /// (full or short form) hold that view's placement version
    /// ([`crate::proto::RequestHeader::view`]), and the server refuses a key operation
    /// routed with a version it does not hold. Clients given servers' addresses instead
    /// of a cluster send no view and are not fenced.
    pub const VIEW: u32 = 1 << 10;
    /// Sent to a server other than the key's primary under the view: a write where the
    /// key's previous owner redirected it ([`crate::error::Status::Moved`]) or where its
    /// primary is gone while keys move (taken if the key is the server's own under the
    /// placement being moved to, as Redis Cluster's ASKING); a read from another replica
    /// of the key when its primary cannot be reached.
    pub const ASKING: u32 = 1 << 11;
    /// Replication between replicas (a key's primary copying a write it took, or a
    /// server copying keys to their new replicas), taken only by a cluster's members and,
    /// for a put or delete, only with the ticket
    /// ([`crate::proto::RequestHeader::ticket`]) the sending member made. Put: `if_equal` holds
    /// the generation the primary gave the value, which is installed unless the key holds
    /// that generation or a newer one. Get: also answers the key's TTL left in `more`
    /// (ms, 0: none). Delete: `if_equal` holds the generation the primary deleted, and
    /// the key goes unless it holds a newer one.
    pub const IMPORT: u32 = 1 << 12;
    /// Between a cluster's members only, with a ticket a member made (as [`IMPORT`]).
    /// Get: hold the key for a handover (writes through the cluster wait until it is
    /// deleted or the hold lapses), and answer its TTL left in `more` (ms, 0: none).
    /// Delete (with `IF_EQUAL`): end the handover, deleting the key if it still holds
    /// the generation handed over.
    pub const MIGRATE: u32 = 1 << 13;
    /// A value staged in parts. Put with [`HAS_RANGE`] (never with `IMPORT`), the key
    /// inline: bytes `[range_start, range_start + payload)` of a value of `range_end`
    /// bytes. The first part (at 0) stages the value under the request's id, the later
    /// ones name it in `if_not_equal` and come in order, at most 8 arriving at once. The empty part at
    /// `range_start == range_end` commits the value as an ordinary put (its condition and
    /// TTL in the header). Delete: discards the value the session staged under the id in
    /// `if_not_equal`. Staged values are reachable by no one, bounded per shard, lapse,
    /// and go when their session ends (see `server/staging.rs`). A client copying a value
    /// out of GPU memory sends it so, and a key's primary a large write's value to its
    /// replicas as it arrives. Put with [`IMPORT`] and no range (between members only):
    /// commits the value the session staged under the id in `if_not_equal` as an
    /// [`IMPORT`] of the generation in `if_equal`, with an import's ticket.
    pub const STAGE: u32 = 1 << 14;
    /// Between a cluster's members only, on a get with [`IMPORT`] or [`MIGRATE`] (a
    /// mover's read for a copy or a handover, on its own server), the key inline: instead
    /// of answering the value, the server copies it from its memory to the members the
    /// payload names ([`crate::proto::encode_members`]), each of which must hold the key
    /// under the placement, as [`IMPORT`] puts of its generation and TTL left; it answers
    /// once every one holds it (or with the first failure) with the key's generation,
    /// size and TTL left (`more`, ms), and no bytes of the value. With `IMPORT` it carries
    /// a ticket for a copy out, with `MIGRATE` one for a hold (and holds the key, as a
    /// `MIGRATE` get does).
    pub const FORWARD: u32 = 1 << 15;
    /// Every flag a request may carry once it is whole.
    pub const ALL: u32 = ((1 << 8) - 1) | SHORT_FORM | VIEW | ASKING | IMPORT | MIGRATE | STAGE | FORWARD;
    /// Over libfabric's shm: this message is the first part of a longer request, whose
    /// other parts follow (see [`crate::proto::fabric::split_request`]). The worker joins
    /// the parts and clears the flag before it reads the request, so nothing else accepts it.
    pub const IN_PARTS: u32 = 1 << 8;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Put = 1,
    Get = 2,
    Delete = 3,
    DeleteRange = 4,
    List = 5,
    Stats = 6,
    Abort = 7,
}

impl Op {
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Put,
            2 => Op::Get,
            3 => Op::Delete,
            4 => Op::DeleteRange,
            5 => Op::List,
            6 => Op::Stats,
            7 => Op::Abort,
            _ => return None,
        })
    }
}

/// A request header: 72 bytes, or 32 in its short form. Field meaning depends on `op`;
/// unused fields are zero (`range_end`: -1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHeader {
    pub version: u8,
    pub op: u8,
    pub flags: u32,
    pub request_id: u64,
    /// Session credential handed out by the bootstrap handshake (auth).
    pub session: u64,
    pub if_equal: u64,
    pub if_not_equal: u64,
    /// Byte range for get: start (negative = suffix) and end (-1 = to the end).
    pub range_start: i64,
    pub range_end: i64,
    /// TTL in milliseconds for put; entry limit for list; for a get over libfabric, the
    /// caller's buffer size + 1; for abort, the request given up on.
    pub ttl_or_limit: u64,
    /// Key length (or range_min length for range ops).
    pub key_len: u32,
    /// Range ops: range_max length. Put: the value's address in the writer's memory
    /// modulo [`VALUE_ALIGN`] (see there). Other ops: zero.
    pub aux_len: u32,
    /// With [`flags::VIEW`]: the version of the cluster placement the request was routed with.
    pub view: u64,
}

/// What a shard worker answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplyHeader {
    pub version: u8,
    pub status: u8,
    pub request_id: u64,
    /// Generation of the value read or written, or the current generation on "unchanged".
    pub generation: u64,
    /// Get: full size of the stored value (the payload may be a byte range of it).
    /// Delete-range: number of keys removed. List: number of entries in the payload.
    pub value_size: u64,
    /// List: 1 when more entries remain after the last one returned.
    pub more: u32,
    /// Payload length. Set over libfabric, where it may follow in its own message; over
    /// UCX the active message's length says it and this is 0.
    pub payload_len: u64,
}

impl RequestHeader {
    pub fn new(op: Op, request_id: u64, session: u64) -> Self {
        RequestHeader {
            version: PROTOCOL_VERSION,
            op: op as u8,
            request_id,
            session,
            range_end: -1,
            ..Default::default()
        }
    }

    /// Writes the header in full, whatever `flags` says of the form; returns its length.
    pub fn encode(&self, out: &mut [u8; REQUEST_HEADER_LEN]) -> usize {
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = self.version;
        out[3] = self.op;
        out[4..8].copy_from_slice(&(self.flags & !flags::SHORT_FORM).to_le_bytes());
        out[REQUEST_ID_AT].copy_from_slice(&self.request_id.to_le_bytes());
        out[SESSION_AT].copy_from_slice(&self.session.to_le_bytes());
        out[24..32].copy_from_slice(&self.if_equal.to_le_bytes());
        out[32..40].copy_from_slice(&self.if_not_equal.to_le_bytes());
        out[40..48].copy_from_slice(&self.range_start.to_le_bytes());
        out[48..56].copy_from_slice(&self.range_end.to_le_bytes());
        out[56..64].copy_from_slice(&self.ttl_or_limit.to_le_bytes());
        out[64..68].copy_from_slice(&self.key_len.to_le_bytes());
        out[68..72].copy_from_slice(&self.aux_len.to_le_bytes());
        REQUEST_HEADER_LEN
    }

    /// The id of an encoded request (full or short form); None if `msg` is too short.
    pub fn request_id_in(msg: &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(msg.get(REQUEST_ID_AT)?.try_into().ok()?))
    }

    /// The session of an encoded request (full or short form); None if `msg` is too short.
    pub fn session_in(msg: &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(msg.get(SESSION_AT)?.try_into().ok()?))
    }

    /// Writes `session` into an encoded request (full or short form) that holds one.
    pub fn set_session_in(msg: &mut [u8], session: u64) {
        if let Some(field) = msg.get_mut(SESSION_AT) {
            field.copy_from_slice(&session.to_le_bytes());
        }
    }

    /// The request that aborts request `of` of `session`, under id `id`.
    pub fn abort(id: u64, of: u64, session: u64) -> RequestHeader {
        let mut h = RequestHeader::new(Op::Abort, id, session);
        h.ttl_or_limit = of;
        h
    }

    /// Writes the header in its short form when that says everything (no condition, range
    /// or TTL), else in full; returns how many bytes of `out` it took.
    pub fn encode_short(&self, out: &mut [u8; REQUEST_HEADER_LEN]) -> usize {
        let defaults = RequestHeader::new(Op::Get, 0, 0);
        let fits = (self.if_equal, self.if_not_equal, self.range_start, self.range_end, self.ttl_or_limit)
            == (
                defaults.if_equal,
                defaults.if_not_equal,
                defaults.range_start,
                defaults.range_end,
                defaults.ttl_or_limit,
            );
        let full = self.encode(out);
        if !fits {
            return full;
        }
        out[4..8].copy_from_slice(&(self.flags | flags::SHORT_FORM).to_le_bytes());
        out.copy_within(64..72, 24);
        SHORT_REQUEST_HEADER_LEN
    }

    /// Writes the header (in its short form when `short` and that says everything) and,
    /// with [`flags::VIEW`], the view after it; returns how many bytes of `out` it took.
    pub fn encode_with_view(&self, short: bool, out: &mut [u8; MAX_REQUEST_HEADER_LEN]) -> usize {
        let fixed: &mut [u8; REQUEST_HEADER_LEN] = (&mut out[..REQUEST_HEADER_LEN]).try_into().unwrap();
        let len = if short { self.encode_short(fixed) } else { self.encode(fixed) };
        if self.flags & flags::VIEW == 0 {
            return len;
        }
        out[len..len + VIEW_LEN].copy_from_slice(&self.view.to_le_bytes());
        len + VIEW_LEN
    }

    /// The replication ticket an [`flags::IMPORT`] or [`flags::MIGRATE`] request carries in
    /// the range fields (16 bytes: `range_start`, then `range_end`, little-endian), which
    /// those requests do not otherwise use: proof from a server holding the cluster's secret
    /// that the key's primary gave this generation (see [`crate::auth::Grant`]).
    pub fn ticket(&self) -> [u8; crate::auth::TICKET_LEN] {
        let mut t = [0u8; crate::auth::TICKET_LEN];
        t[..8].copy_from_slice(&self.range_start.to_le_bytes());
        t[8..].copy_from_slice(&self.range_end.to_le_bytes());
        t
    }

    /// Puts `ticket` where [`RequestHeader::ticket`] reads it.
    pub fn set_ticket(&mut self, ticket: &[u8; crate::auth::TICKET_LEN]) {
        self.range_start = i64::from_le_bytes(ticket[..8].try_into().unwrap());
        self.range_end = i64::from_le_bytes(ticket[8..].try_into().unwrap());
    }

    /// How many bytes the header took on the wire, its view included (decoded headers only).
    pub fn encoded_len(&self) -> usize {
        let fixed = if self.flags & flags::SHORT_FORM != 0 { SHORT_REQUEST_HEADER_LEN } else { REQUEST_HEADER_LEN };
        fixed + if self.flags & flags::VIEW != 0 { VIEW_LEN } else { 0 }
    }

    /// Parses and validates a request header, in full or in its short form (see
    /// [`RequestHeader::encoded_len`]). On error, returns the request id when it could be
    /// read (so the sender still gets an answer) and a message.
    pub fn decode(buf: &[u8]) -> Result<(RequestHeader, Kind), DecodeError> {
        let short = buf.len() >= SHORT_REQUEST_HEADER_LEN
            && u32::from_le_bytes(buf[4..8].try_into().unwrap()) & flags::SHORT_FORM != 0;
        let need = if short { SHORT_REQUEST_HEADER_LEN } else { REQUEST_HEADER_LEN };
        // The id is read whenever it is there, so that even a cut or foreign header is
        // answered with an error rather than left to the sender's timeout.
        let readable_id = RequestHeader::request_id_in(buf);
        if buf.len() < need {
            return Err(DecodeError::new(
                readable_id,
                Status::Invalid,
                format!("request header is {} bytes, need {need}", buf.len()),
            ));
        }
        let request_id = readable_id.expect("a whole header holds its id");
        let fail = |status, msg: String| Err(DecodeError::new(Some(request_id), status, msg));
        if u16::from_le_bytes([buf[0], buf[1]]) != MAGIC {
            return Err(DecodeError::new(readable_id, Status::Invalid, "bad magic: not a remote_dram request".into()));
        }
        let lengths_at = if short { 24 } else { 64 };
        let mut h = RequestHeader {
            version: buf[2],
            op: buf[3],
            flags: u32::from_le_bytes(buf[4..8].try_into().unwrap()),
            request_id,
            session: u64_at(buf, 16),
            key_len: u32::from_le_bytes(buf[lengths_at..lengths_at + 4].try_into().unwrap()),
            aux_len: u32::from_le_bytes(buf[lengths_at + 4..lengths_at + 8].try_into().unwrap()),
            ..RequestHeader::new(Op::Get, 0, 0)
        };
        if !short {
            h.if_equal = u64_at(buf, 24);
            h.if_not_equal = u64_at(buf, 32);
            h.range_start = u64_at(buf, 40) as i64;
            h.range_end = u64_at(buf, 48) as i64;
            h.ttl_or_limit = u64_at(buf, 56);
        }
        if h.version != PROTOCOL_VERSION {
            return fail(
                Status::VersionMismatch,
                format!("protocol version mismatch: server speaks v{PROTOCOL_VERSION}, request is v{}", h.version),
            );
        }
        let Some(op) = Op::from_u8(h.op) else { return fail(Status::Invalid, format!("unknown op {}", h.op)) };
        if h.flags & !flags::ALL != 0 {
            return fail(Status::Invalid, format!("unknown flags {:#x}", h.flags & !flags::ALL));
        }
        if h.flags & flags::VIEW != 0 {
            if buf.len() < need + VIEW_LEN {
                return fail(
                    Status::Invalid,
                    format!("request header is {} bytes, need {} with its view", buf.len(), need + VIEW_LEN),
                );
            }
            h.view = u64_at(buf, need);
        }
        let kind = match Kind::of(op, h.flags) {
            Ok(kind) => kind,
            Err(why) => return fail(Status::Invalid, why),
        };
        if kind.is_import() && h.flags & (flags::IF_ABSENT | flags::IF_NOT_EQUAL | flags::IF_EQUAL) != 0 {
            return fail(Status::Invalid, "an import carries its generation, not a condition".into());
        }
        if kind.is_import() && h.if_equal == 0 {
            return fail(Status::Invalid, "an import needs the generation the value keeps".into());
        }
        let key_len = h.key_len as usize;
        match op {
            Op::Put | Op::Get | Op::Delete => {
                if key_len == 0 || key_len > MAX_KEY_LEN {
                    return fail(Status::KeyTooLarge, format!("key length {key_len} outside 1..={MAX_KEY_LEN}"));
                }
                if op == Op::Put && u64::from(h.aux_len) >= VALUE_ALIGN {
                    return fail(
                        Status::Invalid,
                        format!("a put's value alignment must be below {VALUE_ALIGN}, not {}", h.aux_len),
                    );
                }
                if op != Op::Put && h.aux_len != 0 {
                    return fail(Status::Invalid, "aux_len must be 0 for gets and deletes".into());
                }
            }
            Op::DeleteRange | Op::List => {
                if key_len > MAX_KEY_LEN || h.aux_len as usize > MAX_KEY_LEN {
                    return fail(Status::KeyTooLarge, "range bound longer than the key limit".into());
                }
            }
            Op::Stats => {}
            Op::Abort => {
                if key_len != 0 || h.aux_len != 0 || h.ttl_or_limit == 0 {
                    return fail(Status::Invalid, "abort names one earlier request and carries no key".into());
                }
            }
        }
        if h.flags & flags::IF_EQUAL != 0 && h.flags & flags::IF_ABSENT != 0 {
            return fail(Status::Invalid, "if_equal and if_absent are exclusive".into());
        }
        if (h.flags & flags::IF_EQUAL != 0 && h.if_equal == 0)
            || (h.flags & flags::IF_NOT_EQUAL != 0 && h.if_not_equal == 0)
        {
            return fail(Status::Invalid, "generation 0 is never a valid condition".into());
        }
        Ok((h, kind))
    }
}

impl ReplyHeader {
    pub fn new(request_id: u64, status: Status) -> Self {
        ReplyHeader { version: PROTOCOL_VERSION, status: status as i8 as u8, request_id, ..Default::default() }
    }

    pub fn encode(&self) -> [u8; REPLY_HEADER_LEN] {
        let mut out = [0u8; REPLY_HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = self.version;
        out[3] = self.status;
        out[4..8].copy_from_slice(&self.more.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.generation.to_le_bytes());
        out[24..32].copy_from_slice(&self.value_size.to_le_bytes());
        out[32..40].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Encodes into `out` in the shortest form that says everything, given that the message
    /// carries `payload` bytes after it (and not `payload_len`, which a compact form has no
    /// room for); returns the length used.
    pub fn encode_compact(&self, payload: usize, out: &mut [u8; REPLY_HEADER_LEN]) -> usize {
        if self.more != 0 || self.payload_len != 0 {
            *out = self.encode();
            return REPLY_HEADER_LEN;
        }
        let len = if self.value_size == payload as u64 {
            COMPACT_REPLY_LEN
        } else if payload == 0 && self.value_size <= u32::MAX as u64 {
            out[20..24].copy_from_slice(&(self.value_size as u32).to_le_bytes());
            COMPACT_EMPTY_REPLY_LEN
        } else {
            *out = self.encode();
            return REPLY_HEADER_LEN;
        };
        out[0..2].copy_from_slice(&COMPACT_REPLY_MAGIC.to_le_bytes());
        out[2] = self.version;
        out[3] = self.status;
        out[4..12].copy_from_slice(&self.request_id.to_le_bytes());
        out[12..20].copy_from_slice(&self.generation.to_le_bytes());
        len
    }

    /// Decodes a reply header in any form, the message carrying `payload` bytes after it.
    pub fn decode_compact(buf: &[u8], payload: usize) -> Result<ReplyHeader, String> {
        if buf.len() < 2 || u16::from_le_bytes([buf[0], buf[1]]) != COMPACT_REPLY_MAGIC {
            return ReplyHeader::decode(buf);
        }
        let value_size = match buf.len() {
            COMPACT_REPLY_LEN => payload as u64,
            COMPACT_EMPTY_REPLY_LEN if payload == 0 => u32::from_le_bytes(buf[20..24].try_into().unwrap()) as u64,
            n => return Err(format!("malformed compact reply header ({n} bytes, {payload}-byte payload)")),
        };
        let h = ReplyHeader {
            version: buf[2],
            status: buf[3],
            more: 0,
            request_id: u64_at(buf, 4),
            generation: u64_at(buf, 12),
            value_size,
            payload_len: 0,
        };
        h.check_version()?;
        Ok(h)
    }

    fn check_version(&self) -> Result<(), String> {
        if self.version != PROTOCOL_VERSION {
            return Err(format!(
                "protocol version mismatch: client speaks v{PROTOCOL_VERSION}, server replied v{}",
                self.version
            ));
        }
        Ok(())
    }

    pub fn decode(buf: &[u8]) -> Result<ReplyHeader, String> {
        if buf.len() < REPLY_HEADER_LEN || u16::from_le_bytes([buf[0], buf[1]]) != MAGIC {
            return Err(format!("malformed reply header ({} bytes)", buf.len()));
        }
        let h = ReplyHeader {
            version: buf[2],
            status: buf[3],
            more: u32::from_le_bytes(buf[4..8].try_into().unwrap()),
            request_id: u64_at(buf, 8),
            generation: u64_at(buf, 16),
            value_size: u64_at(buf, 24),
            payload_len: u64_at(buf, 32),
        };
        h.check_version()?;
        Ok(h)
    }

    pub fn status(&self) -> Status {
        Status::from_code(self.status as i8)
    }
}

#[derive(Debug)]
pub struct DecodeError {
    pub request_id: Option<u64>,
    pub status: Status,
    pub message: String,
}

impl DecodeError {
    fn new(request_id: Option<u64>, status: Status, message: String) -> Self {
        DecodeError { request_id, status, message }
    }
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().unwrap())
}

/// List entries in a reply payload: repeated `u32 key_len || u64 value_size || key`.
pub fn encode_list_entry(out: &mut Vec<u8>, key: &[u8], size: u64) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(key);
}

pub fn decode_list_entries(mut buf: &[u8]) -> Result<Vec<(Vec<u8>, u64)>, String> {
    let mut entries = Vec::new();
    while !buf.is_empty() {
        if buf.len() < 12 {
            return Err("truncated list entry".into());
        }
        let len = u32::from_le_bytes(buf[0..4].try_into().unwrap()) as usize;
        let size = u64_at(buf, 4);
        if buf.len() < 12 + len {
            return Err("truncated list key".into());
        }
        entries.push((buf[12..12 + len].to_vec(), size));
        buf = &buf[12 + len..];
    }
    Ok(entries)
}

/// Members a [`flags::FORWARD`] request names, at most.
pub const MAX_FORWARD_TARGETS: usize = 16;

/// The members a [`flags::FORWARD`] request copies to, as its payload: their addresses
/// (cluster member names), one per line.
pub fn encode_members(members: &[String]) -> Vec<u8> {
    members.join("\n").into_bytes()
}

/// The members [`encode_members`] wrote: 1 to [`MAX_FORWARD_TARGETS`] of them, none empty
/// or repeated.
pub fn decode_members(payload: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(payload).map_err(|_| "member names are UTF-8".to_string())?;
    let members: Vec<String> = text.split('\n').map(str::to_string).collect();
    if members.len() > MAX_FORWARD_TARGETS || members.iter().any(String::is_empty) {
        return Err(format!("1 to {MAX_FORWARD_TARGETS} member names, one per line, none empty"));
    }
    if members.iter().enumerate().any(|(i, m)| members[..i].contains(m)) {
        return Err("a member named twice".into());
    }
    Ok(members)
}

#[cfg(test)]
mod tests;
