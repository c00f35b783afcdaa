//! Values a client stages in parts before they are committed ([`flags::STAGE`]): admitted
//! in order, up to [`STAGE_PARTS_IN_FLIGHT`] arriving at once, then committed as an
//! ordinary put. A client copying a value out of GPU memory sends one part while the GPU
//! copies the next; a primary streaming a write to its replicas keeps several in flight.
//!
//! A staged value is reachable by no reader or writer; it is bounded in count and bytes
//! per shard and per session, held for at most [`STAGE_HOLD`], and freed when its
//! session ends (once a part still arriving into it has ended).
//!
//! [`flags::STAGE`]: crate::proto::flags::STAGE

use rustc_hash::FxHashMap;
use std::time::Instant;

use crate::error::{Error, Result, Status};
use crate::server::tunables::{MAX_STAGED, MAX_STAGED_PER_SESSION, STAGE_HOLD, STAGE_PARTS_IN_FLIGHT};
use crate::store::alloc::Extent;
use crate::store::Layout;

/// A value received but not published.
pub struct Staged {
    pub extent: Extent,
    pub layout: Layout,
    until: Instant,
    /// For a value staged in parts: how far it has arrived.
    pub assembly: Option<Assembly>,
}

/// The state of a value staged in parts.
#[derive(Clone, Debug, Default)]
pub struct Assembly {
    /// Bytes of the value received (the parts that ended, arrived).
    pub received: u64,
    /// Bytes of the value received from its start, with no gap: what a primary streaming
    /// the value to its replicas may send on (parts may end out of order).
    landed: u64,
    /// Parts that arrived beyond `landed` (offset, length), while one before them arrives.
    ahead: Vec<(u64, u64)>,
    /// Bytes of the value admitted, from its start: where the next part begins.
    admitted: u64,
    /// Parts arriving into the extent: until they end, their transfers own the extent.
    in_flight: u32,
    /// Lapsed, discarded or its session ended while a part was arriving: it goes when
    /// the part ends.
    doomed: bool,
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
                Status::NoRoom,
                format!("this shard holds {} staged values ({} bytes, limit {MAX_STAGED} and {} bytes); send the value as a copy", self.held.len(), self.bytes, self.max_bytes),
            ));
        }
        let (values, bytes) = self.by_session.get(&session).copied().unwrap_or_default();
        if values >= MAX_STAGED_PER_SESSION || bytes + len > self.max_bytes / 2 {
            return Err(Error::new(
                Status::NoRoom,
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
    pub fn hold(
        &mut self,
        session: u64,
        id: u64,
        extent: Extent,
        layout: Layout,
    ) -> std::result::Result<(), (Extent, Error)> {
        if let Err(e) = self.admit(session, extent.len) {
            return Err((extent, e));
        }
        if self.held.contains_key(&(session, id)) {
            return Err((
                extent,
                Error::new(Status::Invalid, format!("a value is staged under request id {id} already")),
            ));
        }
        self.count(session, extent.len, true);
        self.held.insert((session, id), Staged { extent, layout, until: Instant::now() + STAGE_HOLD, assembly: None });
        Ok(())
    }

    /// Holds `extent` for a value staged in parts under `(session, id)`, its first part
    /// of `len` bytes arriving; as [`Staging::hold`] otherwise.
    pub fn begin_assembly(
        &mut self,
        session: u64,
        id: u64,
        (extent, layout): (Extent, Layout),
        len: u64,
    ) -> std::result::Result<(), (Extent, Error)> {
        self.hold(session, id, extent, layout)?;
        let assembly = Assembly { admitted: len, in_flight: 1, ..Assembly::default() };
        self.held.get_mut(&(session, id)).unwrap().assembly = Some(assembly);
        Ok(())
    }

    /// Admits the part of `len` bytes at `offset` of the value staged in parts under
    /// `(session, id)`, whose whole length is `total`: its extent and layout.
    pub fn next_part(&mut self, session: u64, id: u64, offset: u64, len: u64, total: u64) -> Result<(Extent, Layout)> {
        let missing = || {
            Error::new(
                Status::Missing,
                format!("no value is staged in parts under request id {id} (it lapsed, or was discarded)"),
            )
        };
        let staged = self.held.get_mut(&(session, id)).ok_or_else(missing)?;
        let assembly = staged.assembly.as_mut().filter(|a| !a.doomed).ok_or_else(missing)?;
        if assembly.in_flight as usize >= STAGE_PARTS_IN_FLIGHT
            || offset != assembly.admitted
            || total != staged.layout.value_len
            || offset + len > total
        {
            return Err(Error::new(
                Status::Invalid,
                format!("part [{offset}, {}) of {total} bytes: the value staged under request id {id} admitted {} of {} bytes and has {} parts arriving; it takes its parts in order, at most {STAGE_PARTS_IN_FLIGHT} at once", offset + len, assembly.admitted, staged.layout.value_len, assembly.in_flight),
            ));
        }
        assembly.admitted += len;
        assembly.in_flight += 1;
        Ok((staged.extent, staged.layout))
    }

    /// The part `(offset, len)` of the value staged in parts under `(session, id)` ended:
    /// received (`arrived`) or failed. Ok: the bytes of the value received so far, and
    /// of them those from its start with no gap. Err: the value is over (the part failed,
    /// or the value lapsed or was discarded meanwhile), and taken out: its extent is the
    /// caller's to free.
    pub fn part_ended(
        &mut self,
        session: u64,
        id: u64,
        (offset, len): (u64, u64),
        arrived: bool,
    ) -> std::result::Result<(u64, u64), Option<Staged>> {
        let Some(a) = self.held.get_mut(&(session, id)).and_then(|s| s.assembly.as_mut()) else {
            return Err(None);
        };
        a.in_flight -= 1;
        if arrived && !a.doomed {
            a.received += len;
            // Parts are admitted in order and never overlap: one that starts where the
            // gapless bytes end extends them, and then those that ended ahead of it may.
            match offset == a.landed {
                true => a.landed += len,
                false if len > 0 => a.ahead.push((offset, len)),
                false => {}
            }
            while let Some(i) = a.ahead.iter().position(|&(at, _)| at == a.landed) {
                a.landed += a.ahead.swap_remove(i).1;
            }
            return Ok((a.received, a.landed));
        }
        Err(self.take(session, id))
    }

    /// The length of the value staged for `(session, id)`, left where it is.
    pub fn value_len(&self, session: u64, id: u64) -> Option<u64> {
        self.held.get(&(session, id)).map(|s| s.layout.value_len)
    }

    /// Takes the value staged for `(session, id)` out (to publish or discard it). A value
    /// with parts arriving stays until they ended, and goes then.
    pub fn take(&mut self, session: u64, id: u64) -> Option<Staged> {
        let staged = self.held.get_mut(&(session, id))?;
        if let Some(a) = staged.assembly.as_mut().filter(|a| a.in_flight > 0) {
            a.doomed = true;
            return None;
        }
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
            match s.assembly.as_mut().filter(|a| a.in_flight > 0) {
                // Its parts' transfers still write into the extent.
                Some(a) if !keep => a.doomed = true,
                _ if !keep => gone.push((session, s.extent)),
                _ => {}
            }
            keep || s.assembly.as_ref().is_some_and(|a| a.in_flight > 0)
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
        assert_eq!((back.offset, e.status), (800, Status::NoRoom));
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

    #[test]
    fn parts_arrive_in_order_and_a_part_in_flight_keeps_its_extent() {
        let mut s = Staging::new(1 << 20);
        let layout = Layout::packed(1, 300);
        s.begin_assembly(1, 7, (extent(0, 400), layout), 100).map_err(|(_, e)| e).unwrap();
        assert_eq!(s.next_part(1, 7, 0, 100, 300).unwrap_err().status, Status::Invalid, "parts come in order");
        assert_eq!(s.part_ended(1, 7, (0, 100), true).ok(), Some((100, 100)));
        assert_eq!(s.next_part(1, 7, 150, 100, 300).unwrap_err().status, Status::Invalid, "parts come in order");
        assert_eq!(s.next_part(1, 7, 100, 201, 300).unwrap_err().status, Status::Invalid, "parts end within the value");
        assert_eq!(s.next_part(2, 7, 100, 100, 300).unwrap_err().status, Status::Missing, "another session's value");
        assert!(s.next_part(1, 7, 100, 100, 300).is_ok());
        // Discarded and lapsed while the part arrives: the extent stays until the part ends.
        assert!(s.take(1, 7).is_none());
        assert!(s.drain(Instant::now() + STAGE_HOLD, |_| true).is_empty());
        assert_eq!(s.held().0, 1);
        let over = s.part_ended(1, 7, (100, 100), true).unwrap_err();
        assert_eq!(over.map(|v| v.extent.offset), Some(0), "the part ended: the extent is the caller's to free");
        assert!(s.is_empty() && s.held() == (0, 0));
        // A failed part ends the value.
        s.begin_assembly(1, 8, (extent(0, 400), layout), 100).map_err(|(_, e)| e).unwrap();
        assert!(s.part_ended(1, 8, (0, 100), false).unwrap_err().is_some());
        assert!(s.is_empty());
    }

    #[test]
    fn parts_arrive_side_by_side_and_the_value_is_whole_once_each_ended() {
        let mut s = Staging::new(1 << 20);
        let layout = Layout::packed(1, 300);
        s.begin_assembly(1, 7, (extent(0, 400), layout), 100).map_err(|(_, e)| e).unwrap();
        assert!(s.next_part(1, 7, 100, 100, 300).is_ok());
        assert!(s.next_part(1, 7, 200, 100, 300).is_ok());
        // They may end in any order; the value is whole once each arrived, and the bytes
        // from its start with no gap grow only as the gaps close.
        assert_eq!(s.part_ended(1, 7, (200, 100), true).ok(), Some((100, 0)));
        assert_eq!(s.part_ended(1, 7, (100, 100), true).ok(), Some((200, 0)));
        assert_eq!(s.part_ended(1, 7, (0, 100), true).ok(), Some((300, 300)));
        assert_eq!(s.take(1, 7).and_then(|v| v.assembly).map(|a| a.received), Some(300));
        // Taken with parts arriving: it goes once they ended.
        s.begin_assembly(1, 7, (extent(0, 400), layout), 100).map_err(|(_, e)| e).unwrap();
        assert!(s.next_part(1, 7, 100, 100, 300).is_ok());
        assert!(s.take(1, 7).is_none());
        assert!(s.part_ended(1, 7, (0, 100), true).unwrap_err().is_none(), "a part still arrives");
        assert_eq!(s.part_ended(1, 7, (100, 100), true).unwrap_err().map(|v| v.extent.offset), Some(0));
        assert!(s.is_empty());
        // A part that failed while others arrive ends the value once the last ended.
        s.begin_assembly(1, 8, (extent(0, 400), layout), 100).map_err(|(_, e)| e).unwrap();
        assert!(s.next_part(1, 8, 100, 100, 300).is_ok());
        assert_eq!(
            s.part_ended(1, 8, (0, 100), false).unwrap_err().map(|v| v.extent.offset),
            None,
            "a part still arrives"
        );
        assert_eq!(
            s.next_part(1, 8, 200, 100, 300).unwrap_err().status,
            Status::Missing,
            "a failed value takes no parts"
        );
        assert_eq!(s.part_ended(1, 8, (100, 100), true).unwrap_err().map(|v| v.extent.offset), Some(0));
        assert!(s.is_empty() && s.held() == (0, 0));
        // The parts arriving at once are bounded.
        let layout = Layout::packed(1, 100);
        s.begin_assembly(1, 9, (extent(0, 200), layout), 1).map_err(|(_, e)| e).unwrap();
        for i in 1..STAGE_PARTS_IN_FLIGHT as u64 {
            assert!(s.next_part(1, 9, i, 1, 100).is_ok());
        }
        let more = STAGE_PARTS_IN_FLIGHT as u64;
        assert_eq!(s.next_part(1, 9, more, 1, 100).unwrap_err().status, Status::Invalid, "too many parts at once");
    }
}
