//! Values a replica holds for a client before they are published ([`flags::STAGE`]).
//!
//! A client that writes a large value to a key with R > 1 replicas sends it to the key's
//! primary and, at the same time, to each other replica as a staged put; once the primary
//! has given the write its generation, a small publish request (`IMPORT | STAGE`) installs
//! the staged value under that generation. The value crosses the network to every replica
//! at once, instead of once to the primary and then once more to each replica.
//!
//! A staged value is reachable by no reader or writer; it is bounded in count and bytes
//! per shard, held for at most [`STAGE_HOLD`], and freed when its session ends.
//!
//! [`flags::STAGE`]: crate::proto::flags::STAGE

use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::store::alloc::Extent;
use crate::store::Layout;

/// Staged values one shard holds at once, over all its clients.
pub const MAX_STAGED: usize = 4096;
/// How long a staged value waits for its publish (a client that sent it and then stalled
/// or lost its primary); then it is freed and a publish for it is refused.
pub const STAGE_HOLD: Duration = Duration::from_secs(30);

/// A value received but not published.
pub struct Staged {
    pub extent: Extent,
    pub layout: Layout,
    until: Instant,
}

/// One shard's staged values, by the session that staged each and its request's id.
pub struct Staging {
    held: FxHashMap<(u64, u64), Staged>,
    bytes: u64,
    max_bytes: u64,
}

impl Staging {
    /// Holds at most `max_bytes` of extents at once.
    pub fn new(max_bytes: u64) -> Staging {
        Staging { held: FxHashMap::default(), bytes: 0, max_bytes }
    }

    /// Whether `len` more bytes may be staged now.
    pub fn admit(&self, len: u64) -> Result<()> {
        if self.held.len() >= MAX_STAGED || self.bytes + len > self.max_bytes {
            return Err(Error::new(
                Status::Unavailable,
                format!("this shard holds {} staged values ({} bytes, limit {MAX_STAGED} and {} bytes); send the value as a copy", self.held.len(), self.bytes, self.max_bytes),
            ));
        }
        Ok(())
    }

    /// Holds a value received into `extent` for `(session, id)`; gives the extent back
    /// when the limits are reached (other stages landed while it arrived) or the id is
    /// taken.
    pub fn hold(&mut self, session: u64, id: u64, extent: Extent, layout: Layout) -> std::result::Result<(), (Extent, Error)> {
        if let Err(e) = self.admit(extent.len) {
            return Err((extent, e));
        }
        if self.held.contains_key(&(session, id)) {
            return Err((extent, Error::new(Status::Invalid, format!("a value is staged under request id {id} already"))));
        }
        self.bytes += extent.len;
        self.held.insert((session, id), Staged { extent, layout, until: Instant::now() + STAGE_HOLD });
        Ok(())
    }

    /// Takes the value staged for `(session, id)` out (to publish or discard it).
    pub fn take(&mut self, session: u64, id: u64) -> Option<Staged> {
        let staged = self.held.remove(&(session, id))?;
        self.bytes -= staged.extent.len;
        Some(staged)
    }

    /// Takes out every staged value that lapsed by `now`, or whose session `ended` says
    /// is over: their extents, to free.
    pub fn drain(&mut self, now: Instant, ended: impl Fn(u64) -> bool) -> Vec<Extent> {
        if self.held.is_empty() {
            return Vec::new();
        }
        let mut gone = Vec::new();
        self.held.retain(|&(session, _), s| {
            let keep = s.until > now && !ended(session);
            if !keep {
                gone.push(s.extent);
            }
            keep
        });
        self.bytes -= gone.iter().map(|e| e.len).sum::<u64>();
        gone
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Values and extent bytes held.
    pub fn held(&self) -> (usize, u64) {
        (self.held.len(), self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn bounds_hold_and_free() {
        let mut s = Staging::new(1000);
        let layout = Layout::packed(1, 10);
        assert!(s.hold(1, 1, extent(0, 600), layout).is_ok());
        assert!(s.admit(500).is_err(), "bytes bounded");
        let (back, e) = s.hold(1, 2, extent(600, 500), layout).unwrap_err();
        assert_eq!((back.offset, e.status), (600, Status::Unavailable));
        assert!(s.hold(1, 1, extent(600, 100), layout).is_err(), "one value per id");
        assert!(s.hold(2, 1, extent(700, 100), layout).is_ok());
        assert_eq!(s.take(1, 1).map(|v| v.extent.offset), Some(0));
        assert!(s.take(1, 1).is_none());
        assert!(s.admit(900).is_ok(), "taken bytes are counted out");
        assert_eq!(s.drain(Instant::now(), |session| session == 2).len(), 1, "an ended session's values go");
        assert!(s.is_empty());
        s.hold(3, 1, extent(0, 10), layout).map_err(|(_, e)| e).unwrap();
        assert!(s.drain(Instant::now(), |_| false).is_empty());
        assert_eq!(s.drain(Instant::now() + STAGE_HOLD, |_| false).len(), 1, "lapsed values go");
        assert!(s.admit(1000).is_ok());
    }
}
