//! Translation between TensorStore's tsgrpc conventions and the engine's: tagged
//! generations, timestamps with sentinels, status codes.

use std::time::{SystemTime, UNIX_EPOCH};

use tonic::Code;

use super::pb;
use crate::error::Error;

/// A `StorageGeneration` as TensorStore encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generation {
    /// Empty bytes: no condition (in requests).
    Unknown,
    /// `0x02`: the key is absent.
    NoValue,
    /// `0x00` + 8 little-endian bytes: an engine generation.
    Engine(u64),
    /// Anything else: not minted by us, so it equals no stored value.
    Foreign,
}

const TAG_VALUE: u8 = 0x00;
const TAG_NO_VALUE: u8 = 0x02;

impl Generation {
    pub fn parse(bytes: &[u8]) -> Generation {
        match bytes {
            [] => Generation::Unknown,
            [TAG_NO_VALUE] => Generation::NoValue,
            [TAG_VALUE, rest @ ..] if rest.len() == 8 => {
                Generation::Engine(u64::from_le_bytes(rest.try_into().unwrap()))
            }
            _ => Generation::Foreign,
        }
    }

    /// Bytes for a response; `Unknown` (empty) means "condition not met".
    pub fn encode(self) -> Vec<u8> {
        match self {
            Generation::Unknown | Generation::Foreign => Vec::new(),
            Generation::NoValue => vec![TAG_NO_VALUE],
            Generation::Engine(g) => {
                let mut v = Vec::with_capacity(9);
                v.push(TAG_VALUE);
                v.extend_from_slice(&g.to_le_bytes());
                v
            }
        }
    }
}

/// The time a reply was known current: now, or the request's staleness bound if that is a
/// finite time ahead of our clock (so clock skew never makes a fresh reply look stale).
/// The sentinels (seconds = i64::MIN / i64::MAX: infinite past / future) are not times.
pub fn reply_timestamp(staleness_bound: Option<&pb::Timestamp>) -> pb::Timestamp {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let now = pb::Timestamp { seconds: now.as_secs() as i64, nanos: now.subsec_nanos() as i32 };
    match staleness_bound {
        Some(b) if is_valid_time(b) && (b.seconds, b.nanos) > (now.seconds, now.nanos) => *b,
        _ => now,
    }
}

/// Within 0001-01-01 … 9999-12-31 with valid nanos: what TensorStore accepts as a time.
fn is_valid_time(t: &pb::Timestamp) -> bool {
    const MIN_SECONDS: i64 = -62_135_596_800; // 0001-01-01T00:00:00Z
    const MAX_SECONDS: i64 = 253_402_300_799; // 9999-12-31T23:59:59Z
    (MIN_SECONDS..=MAX_SECONDS).contains(&t.seconds) && (0..1_000_000_000).contains(&t.nanos)
}

pub fn generation_and_timestamp(g: Generation, staleness_bound: Option<&pb::Timestamp>) -> pb::GenerationAndTimestamp {
    pb::GenerationAndTimestamp { generation: g.encode().into(), timestamp: Some(reply_timestamp(staleness_bound)) }
}

/// Engine errors as gRPC statuses, by [`crate::Status::grpc_code`] (the C++ driver's table too).
/// Outcomes the gateway answers itself (not errors) never come here; one that did would
/// read as INTERNAL.
pub fn status_of(e: &Error) -> tonic::Status {
    let code = match Code::from_i32(e.status.grpc_code()) {
        Code::Ok => Code::Internal,
        code => code,
    };
    tonic::Status::new(code, format!("remote_dram: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_round_trip_and_foreign_bytes_are_recognised() {
        for g in [Generation::NoValue, Generation::Engine(0), Generation::Engine(u64::MAX), Generation::Engine(0x0102)]
        {
            assert_eq!(Generation::parse(&g.encode()), g);
        }
        assert_eq!(Generation::Engine(1).encode(), [0, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Generation::parse(b""), Generation::Unknown);
        assert!(Generation::Unknown.encode().is_empty());
        // TensorStore-internal tags and other lengths are not ours.
        for foreign in [&[0x01u8][..], &[0x00], &[0x00, 1, 2], &[0x03, 0, 0, 0, 0, 0, 0, 0, 0], &[0x02, 0]] {
            assert_eq!(Generation::parse(foreign), Generation::Foreign, "{foreign:?}");
        }
    }

    #[test]
    fn sentinel_and_invalid_bounds_never_reach_a_reply() {
        let now = reply_timestamp(None);
        assert!(now.seconds > 1_700_000_000);
        for bound in [i64::MIN, i64::MAX, -70_000_000_000, 300_000_000_000] {
            let t = reply_timestamp(Some(&pb::Timestamp { seconds: bound, nanos: 0 }));
            assert!(t.seconds >= now.seconds && t.seconds < now.seconds + 60, "{bound} gave {t:?}");
        }
        let ahead = pb::Timestamp { seconds: now.seconds + 3600, nanos: 5 };
        assert_eq!(reply_timestamp(Some(&ahead)), ahead);
        let past = pb::Timestamp { seconds: 1000, nanos: 0 };
        assert!(reply_timestamp(Some(&past)).seconds >= now.seconds);
        let bad_nanos = pb::Timestamp { seconds: now.seconds + 3600, nanos: -1 };
        assert!(reply_timestamp(Some(&bad_nanos)).seconds < bad_nanos.seconds);
    }

    #[test]
    fn permanent_failures_use_codes_tensorstore_does_not_retry() {
        use crate::error::Status;
        let code = |s| status_of(&Error::new(s, "x")).code();
        assert_eq!(code(Status::OutOfRange), Code::OutOfRange);
        assert_eq!(code(Status::KeyTooLarge), Code::InvalidArgument);
        assert_eq!(code(Status::AuthFailed), Code::Unauthenticated);
        assert_eq!(code(Status::Unavailable), Code::Unavailable);
        assert_eq!(code(Status::WrongShard), Code::FailedPrecondition);
        // Every status has a code of gRPC's own; an outcome that is no error reads as INTERNAL.
        for &s in Status::ALL {
            assert_ne!(code(s), Code::Unknown, "{s:?}");
            assert_ne!(code(s), Code::Ok, "{s:?}");
        }
        assert_eq!(code(Status::Missing), Code::Internal);
    }
}
