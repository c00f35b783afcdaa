//! Values a replica holds for a client before they are published ([`flags::STAGE`]).
//!
//! A client that writes a large value to a key with R > 1 replicas sends it to the key's
//! primary and, at the same time, to each other replica as a staged put; once the primary
//! has given the write its generation, a small publish request (`IMPORT | STAGE`) installs
//! the staged value under that generation. The value crosses the network to every replica
//! at once, instead of once to the primary and then once more to each replica.
//!
//! A staged value is reachable by no reader or writer; it is bounded in count and bytes
//! per shard and per session, held for at most [`STAGE_HOLD`], and freed when its
//! session ends.
//!
//! [`flags::STAGE`]: crate::proto::flags::STAGE

use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::store::alloc::Extent;
use crate::store::Layout;

/// Staged values one shard holds at once, over all its clients.
pub const MAX_STAGED: usize = 4096;
/// Staged values one shard holds for one session at once: a client stages one value per
/// replica and call, and publishes it before its next call.
pub const MAX_STAGED_PER_SESSION: usize = 16;
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
    /// Values and bytes held per session.
    by_session: FxHashMap<u64, (usize, u64)>,
}

impl Staging {
    /// Holds at most `max_bytes` of extents at once, half of them for any one session.
    pub fn new(max_bytes: u64) -> Staging {
        Staging { held: FxHashMap::default(), bytes: 0, max_bytes, by_session: FxHashMap::default() }
    }

    /// Whether `session` may stage `len` more bytes now.
    pub fn admit(&self, session: u64, len: u64) -> Result<()> {
        if self.held.len() >= MAX_STAGED || self.bytes + len > self.max_bytes {
            return Err(Error::new(
                Status::Unavailable,
                format!("this shard holds {} staged values ({} bytes, limit {MAX_STAGED} and {} bytes); send the value as a copy", self.held.len(), self.bytes, self.max_bytes),
            ));
        }
        let (values, bytes) = self.by_session.get(&session).copied().unwrap_or_default();
        if values >= MAX_STAGED_PER_SESSION || bytes + len > self.max_bytes / 2 {
            return Err(Error::new(
                Status::Unavailable,
                format!("the client's session holds {values} staged values ({bytes} bytes) on this shard, limit {MAX_STAGED_PER_SESSION} and {} bytes; publish or discard them", self.max_bytes / 2),
            ));
        }
        Ok(())
    }

    fn count(&mut self, session: u64, len: u64, added: bool) {
        if added {
            let held = self.by_session.entry(session).or_default();
            *held = (held.0 + 1, held.1 + len);
            self.bytes += len;
            return;
        }
        self.bytes -= len;
        if let Some(held) = self.by_session.get_mut(&session) {
            *held = (held.0 - 1, held.1 - len);
            if held.0 == 0 {
                self.by_session.remove(&session);
            }
        }
    }

    /// Holds a value received into `extent` for `(session, id)`; gives the extent back
    /// when the limits are reached (other stages landed while it arrived) or the id is
    /// taken.
    pub fn hold(&mut self, session: u64, id: u64, extent: Extent, layout: Layout) -> std::result::Result<(), (Extent, Error)> {
        if let Err(e) = self.admit(session, extent.len) {
            return Err((extent, e));
        }
        if self.held.contains_key(&(session, id)) {
            return Err((extent, Error::new(Status::Invalid, format!("a value is staged under request id {id} already"))));
        }
        self.count(session, extent.len, true);
        self.held.insert((session, id), Staged { extent, layout, until: Instant::now() + STAGE_HOLD });
        Ok(())
    }

    /// Takes the value staged for `(session, id)` out (to publish or discard it).
    pub fn take(&mut self, session: u64, id: u64) -> Option<Staged> {
        let staged = self.held.remove(&(session, id))?;
        self.count(session, staged.extent.len, false);
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
                gone.push((session, s.extent));
            }
            keep
        });
        for &(session, extent) in &gone {
            self.count(session, extent.len, false);
        }
        gone.into_iter().map(|(_, extent)| extent).collect()
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
        assert!(s.hold(1, 1, extent(0, 400), layout).is_ok());
        assert!(s.admit(1, 200).is_err(), "a session holds half the bytes at most");
        assert!(s.hold(2, 1, extent(400, 400), layout).is_ok());
        assert!(s.admit(3, 300).is_err(), "the shard's bytes are bounded");
        let (back, e) = s.hold(3, 2, extent(800, 300), layout).unwrap_err();
        assert_eq!((back.offset, e.status), (800, Status::Unavailable));
        assert!(s.hold(1, 1, extent(800, 10), layout).is_err(), "one value per id");
        assert_eq!(s.take(1, 1).map(|v| v.extent.offset), Some(0));
        assert!(s.take(1, 1).is_none());
        assert!(s.admit(1, 500).is_ok(), "taken bytes are counted out");
        assert_eq!(s.drain(Instant::now(), |session| session == 2).len(), 1, "an ended session's values go");
        assert!(s.is_empty() && s.held() == (0, 0));
        for id in 0..MAX_STAGED_PER_SESSION as u64 {
            s.hold(3, id, extent(id * 10, 10), layout).map_err(|(_, e)| e).unwrap();
        }
        assert!(s.admit(3, 10).is_err(), "a session's values are bounded");
        assert!(s.admit(4, 10).is_ok());
        assert!(s.drain(Instant::now(), |_| false).is_empty());
        assert_eq!(s.drain(Instant::now() + STAGE_HOLD, |_| false).len(), MAX_STAGED_PER_SESSION, "lapsed values go");
        assert!(s.admit(3, 500).is_ok());
    }
}
