//! Values sent in parts ([`flags::STAGE`] with a range): staged on the server in order,
//! then committed as one ordinary put. The device path sends GPU memory so, a part at a
//! time through pinned buffers; [`Client::put_parts`] sends a value that lies in several
//! of the caller's buffers (a header and a body) without copying them together.

use super::link::Reply;
use super::{apply_write_condition, check_key, error_of, Client, PutOptions, WriteResult};
use crate::error::{Error, Result, Status};
use crate::proto::{flags, Op, RequestHeader, INLINE_KEY_MAX, MAX_VALUE_LEN};

/// Up to this many bytes in all, the parts of [`Client::put_parts`] are copied into one
/// value and put whole: a copy that small costs less than the two requests more that
/// staging takes.
pub const GATHER_COPY_MAX: usize = 256 << 10;

impl Client {
    /// Stores the concatenation of `parts` under `key`, as [`Client::put_with`] would, without
    /// joining them in memory: each part is staged on the server, then the value is
    /// committed. Small values, values for a cluster and values the server has no staging
    /// room for are joined here and put whole.
    pub fn put_parts(&mut self, key: &[u8], parts: &[&[u8]], opts: &PutOptions) -> Result<WriteResult> {
        check_key(key)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total as u64 > MAX_VALUE_LEN {
            return Err(Error::new(Status::ValueTooLarge, format!("{total} bytes > limit {MAX_VALUE_LEN}")));
        }
        let nonempty: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
        if nonempty.len() <= 1 {
            return self.put_with(key, nonempty.first().copied().unwrap_or_default(), opts);
        }
        if total > GATHER_COPY_MAX && self.cluster.is_none() && key.len() <= INLINE_KEY_MAX {
            let mut stage_id = None;
            let mut result = Ok(());
            let mut offset = 0;
            for part in &nonempty {
                result = self.stage_part(key, offset, total, &mut stage_id, part);
                if result.is_err() {
                    break;
                }
                offset += part.len();
            }
            let result = result.and_then(|()| self.commit_parts(key, total, stage_id.take(), opts));
            match result {
                // No staging room, or the value lapsed, or the connection was lost or replaced
                // while its parts arrived: sent whole below.
                Err(e)
                    if matches!(
                        e.status,
                        Status::NoRoom | Status::Unavailable | Status::Missing | Status::Transport
                    ) =>
                {
                    self.discard_parts_if_answered(key, &e, stage_id);
                }
                Err(e) => {
                    self.discard_parts_if_answered(key, &e, stage_id);
                    return Err(e);
                }
                done => return done,
            }
        }
        self.put_with(key, &parts.concat(), opts)
    }

    /// Sends `bytes` as the part at `offset` of a value of `total` bytes staged under
    /// `stage_id` (set by the first part's answer).
    pub(super) fn stage_part(
        &mut self,
        key: &[u8],
        offset: usize,
        total: usize,
        stage_id: &mut Option<u64>,
        bytes: &[u8],
    ) -> Result<()> {
        let mut h = RequestHeader::new(Op::Put, 0, 0);
        h.flags |= flags::STAGE | flags::HAS_RANGE;
        (h.range_start, h.range_end, h.if_not_equal) = (offset as i64, total as i64, stage_id.unwrap_or(0));
        let reply = self.call_key(key, h, bytes)?;
        if reply.header.status() != Status::Ok {
            return Err(part_refused(&reply));
        }
        stage_id.get_or_insert(reply.header.request_id);
        Ok(())
    }

    /// Commits a value of `total` bytes staged in parts under `stage_id`, with `opts`'
    /// condition and TTL.
    pub(super) fn commit_parts(
        &mut self,
        key: &[u8],
        total: usize,
        stage_id: Option<u64>,
        opts: &PutOptions,
    ) -> Result<WriteResult> {
        let mut h = RequestHeader::new(Op::Put, 0, 0);
        h.flags |= flags::STAGE | flags::HAS_RANGE;
        (h.range_start, h.range_end, h.if_not_equal) = (total as i64, total as i64, stage_id.unwrap_or(0));
        apply_write_condition(&mut h, opts.condition);
        if let Some(ttl) = opts.ttl {
            h.flags |= flags::HAS_TTL;
            h.ttl_or_limit = (ttl.as_millis() as u64).max(1);
        }
        let reply = self.call_key(key, h, &[])?;
        match reply.header.status() {
            Status::Ok => Ok(WriteResult::Written { generation: reply.header.generation }),
            Status::ConditionFailed => Ok(WriteResult::ConditionFailed),
            _ => Err(part_refused(&reply)),
        }
    }

    /// Frees what a put in parts that failed with `e` left on the server, where the server
    /// answered (a refused part); one that did not answer frees the parts when they lapse
    /// or the session ends, and is not waited for a second time.
    pub(super) fn discard_parts_if_answered(&mut self, key: &[u8], e: &Error, stage_id: Option<u64>) {
        let answered = !matches!(e.status, Status::Timeout | Status::Unavailable | Status::Transport);
        if let (true, Some(id)) = (answered, stage_id) {
            let mut h = RequestHeader::new(Op::Delete, 0, 0);
            h.flags |= flags::STAGE;
            h.if_not_equal = id;
            let _ = self.call_key(key, h, &[]);
        }
    }
}

/// Why a server refused a part of a value staged in parts, or its commit: `Missing` (the
/// value lapsed or was discarded) stays itself, so that the caller sends the value whole.
fn part_refused(reply: &Reply) -> Error {
    match reply.header.status() {
        Status::Missing => Error::new(Status::Missing, String::from_utf8_lossy(&reply.payload)),
        s => error_of(s, reply),
    }
}
