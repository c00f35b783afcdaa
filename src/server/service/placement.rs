//! A cluster member's shard's side of placement: which requests routed with a view it
//! takes (fencing, redirects, handovers), and which frames only members may send.

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
use std::time::Instant;

use super::{transfer_deadline, Service};
use crate::auth::{ClusterSecret, Grant};
use crate::cluster::placement::{Routing, ServerRole};
use crate::error::{Error, Result, Status};
use crate::proto::{flags, Kind, Op, RequestHeader};
use crate::server::tunables::{FORGET_BATCH, HANDOVER_HOLD, MAX_HANDOVERS, STALE_NAMED_BYTES, STALE_STEP};

/// A cluster member's shard's side of placement: the routing last read from the
/// server's role, and the keys held for a handover ([`flags::MIGRATE`]) until when.
pub(super) struct PlacementCheck {
    pub(super) role: Arc<ServerRole>,
    /// Makes the tickets this shard gives as a key's primary and checks those it takes.
    pub(super) secret: ClusterSecret,
    pub(super) seen: u64,
    pub(super) current: Option<Arc<(String, Routing)>>,
    pub(super) handovers: FxHashMap<Vec<u8>, Instant>,
    /// The role's placement version, and the placement's epoch and `next`, that
    /// [`Service::drop_stale_copies_if_the_placement_moved`] last looked at.
    pub(super) moves_seen: u64,
    pub(super) last_move: Option<(u64, Option<Vec<String>>)>,
    /// The role's [`forgotten`](ServerRole::forgotten) count this shard acted on.
    pub(super) forgotten: u64,
    /// The copies a move made stale, being dropped (see
    /// [`Service::drop_stale_copies_if_the_placement_moved`]).
    pub(super) stale: Option<StaleCopies>,
}

/// The copies of keys this server is no replica of under the placement a move (or an
/// epoch) began in, being dropped without holding the shard's requests up for a whole scan: a scan in key
/// order, a few keys further at each request and a batch at each of the worker's sweeps,
/// and at once any key a request names before the scan reached it.
pub(super) struct StaleCopies {
    current: Arc<(String, Routing)>,
    /// This server's place among the placement's members (None: not one).
    me: Option<usize>,
    /// The next key the scan looks at.
    from: Vec<u8>,
    /// Stale keys from `from` on that requests named first: dropped then, and left be by
    /// the scan (a copy taken since the move began is current); and their bytes.
    named: FxHashSet<Vec<u8>>,
    named_bytes: usize,
    dropped: u64,
    started: Instant,
}

impl StaleCopies {
    fn is_stale(&self, key: &[u8]) -> bool {
        !self.me.is_some_and(|i| self.current.1.is_replica_at(i, key))
    }
}

impl Service {
    /// Refuses a frame that only a cluster's members send ([`Kind::members_only`]) when
    /// this server is in no cluster: there, no one may install a generation it did not give.
    pub(super) fn members_only(&self, kind: Kind) -> Result<()> {
        if kind.members_only() && self.placement.is_none() {
            return Err(Error::new(
                Status::AuthFailed,
                "replication and handover frames are taken only between members of a cluster; this server is in none",
            ));
        }
        Ok(())
    }

    /// Refuses a frame that would change what `key` holds on a replica's say-so without
    /// the ticket for `grant` that a key's primary (or a member) made with the cluster's
    /// secret: only the key's primary decides its generations.
    pub(super) fn check_ticket(&self, h: &RequestHeader, key: &[u8], grant: Grant) -> Result<()> {
        if self.placement.as_ref().is_some_and(|p| p.secret.allows(&h.ticket(), key, grant)) {
            return Ok(());
        }
        Err(Error::new(
            Status::AuthFailed,
            "a replica copy without a valid ticket: only the key's primary decides its generations",
        ))
    }

    /// Refuses a key operation routed with a view ([`flags::VIEW`]) that this server
    /// cannot take as routed: the view's placement version is not this server's ("view
    /// changed"); a key sent here asking ([`flags::ASKING`]) or to be replicated
    /// ([`Kind::Import`], [`Kind::ImportDelete`], [`Kind::CopyRead`]) that this server
    /// does not hold under the placement; or keys are
    /// moving and this one, moving elsewhere, is no longer here ("moved", with the server
    /// it moved to) or is being handed over (a write waits: "key moving"). Requests
    /// without a view (clients given addresses, servers reading keys to copy) are not
    /// fenced; a member's copy ([`Kind::is_import`]) comes without one and is taken only
    /// for a key this server holds, or is to hold, under the placement it holds now.
    pub(super) fn check_placement(&mut self, h: &RequestHeader, kind: Kind, key: &[u8]) -> Result<()> {
        self.forget_if_stale();
        self.drop_stale_copies_if_the_placement_moved();
        self.drop_if_stale(key);
        let Some(p) = self.placement.as_mut() else { return Ok(()) };
        let write = kind.op() != Op::Get;
        let routed = h.flags & flags::VIEW != 0;
        if !routed && !kind.is_import() {
            // A write sent to this server alone, by its address, would reach no other
            // replica of the key, nor be ordered by the key's primary. (Parts of a value
            // are staged without a view: a primary's replicator sends them so; their
            // commit is checked as a put.)
            if matches!(kind, Kind::Put | Kind::Delete) {
                return Err(Error::new(
                    Status::Invalid,
                    "this server is a member of a cluster: a write goes through the cluster (connect with its etcd:// string), which copies it to every replica of the key",
                ));
            }
            return Ok(());
        }
        if routed && !p.role.serving() {
            return Err(Error::new(Status::ViewChanged, "this server was paused, or cut off from etcd, for longer than its lease allows; it serves again once etcd confirmed its lease and it read the placement again"));
        }
        let version = p.role.version();
        if version != p.seen {
            p.current = p.role.current();
            p.seen = version;
            // Before any write is taken under it: a new epoch's primaries give out
            // generations above those its old primaries gave.
            if let Some(c) = &p.current {
                // Checked as the placement was read from etcd; a floor refused here too
                // leaves this server refusing writes rather than giving out wrapped ones.
                let floor = c.1.placement.generation_floor;
                if let Err(e) = self.shard.raise_generations_above(floor) {
                    p.seen = u64::MAX;
                    return Err(Error::new(
                        Status::ViewChanged,
                        format!("the placement's generation floor: {}", e.message),
                    ));
                }
            }
        }
        // Borrowed, not cloned: an `Arc` clone per request would bounce its count between
        // the workers' caches.
        let Some(current) = p.current.as_deref() else {
            return Err(Error::new(Status::ViewChanged, "this server has not read the cluster's placement yet"));
        };
        let (me, routing) = (current.0.as_str(), &current.1);
        let held = routing.placement.version;
        if !routed {
            // A copy sent under a placement that has since moved on, to a replica the key
            // left, would otherwise land after that replica freed the copies it no longer
            // needs, and stay there for good. The sender tries again under the new one.
            return match routing.holds(me, key) {
                true => Ok(()),
                false => Err(Error::new(
                    Status::ViewChanged,
                    format!("a copy of a key this server does not hold in placement version {held}"),
                )),
            };
        }
        if h.view != held {
            return Err(Error::new(
                Status::ViewChanged,
                format!("request routed with placement version {}, this server holds version {held}", h.view),
            ));
        }
        let replica_copy = matches!(kind, Kind::Import | Kind::ImportStaged | Kind::ImportDelete | Kind::CopyRead);
        if replica_copy || (h.flags & flags::ASKING != 0 && !write) {
            // A read asked of a replica other than the primary (its client lost the
            // primary) is taken where every acknowledged write is: on a replica under the
            // current placement, not on one the key moves to, which its mover may not have
            // copied it to yet. (With one replica per key, the key's next owner is asked
            // once its owner handed it over.)
            let asked_read = !replica_copy && routing.placement.replicas > 1;
            let here = match asked_read {
                true => routing.replicas(key).contains(&me),
                false => routing.holds(me, key),
            };
            return if here {
                Ok(())
            } else {
                Err(Error::new(
                    Status::ViewChanged,
                    format!("the key has no replica on this server in placement version {held}"),
                ))
            };
        }
        if h.flags & flags::ASKING != 0 {
            let owner = routing.owner(key);
            if routing.next_owner(key) != Some(me) && owner != Some(me) {
                return Err(Error::new(
                    Status::ViewChanged,
                    format!("asked here, but the key's primary is elsewhere in placement version {held}"),
                ));
            }
            // With R ≥ 2 a client asks a write of the key's next primary only when it lost
            // the key's primary. Taken once etcd says that primary is gone, not while it
            // lives (the client lost only its own connection): two servers would then
            // order the key's writes.
            if let Some(live) = owner.filter(|o| write && routing.placement.replicas > 1 && *o != me) {
                if p.role.is_live(live) {
                    return Err(Error::new(
                        Status::ViewChanged,
                        format!("asked here as the key's next primary, but its primary {live} is live"),
                    ));
                }
            }
            return Ok(());
        }
        if routing.owner(key) != Some(me) {
            return Err(Error::new(
                Status::ViewChanged,
                format!("this server is not the key's primary in placement version {held}"),
            ));
        }
        let moving_to = match routing.next_owner(key) {
            Some(next) if next != me => next.to_string(),
            _ => return Ok(()),
        };
        if routing.placement.replicas > 1 {
            // Its replicas take every write until the move is sealed; then the key waits
            // for its new primary, so that no write is taken here that the sources'
            // generation floor does not cover.
            return match write && routing.placement.sealed {
                true => Err(Error::new(
                    Status::KeyMoving,
                    format!("the key's primary becomes {moving_to} as this move ends; writes wait for it"),
                )),
                false => Ok(()),
            };
        }
        if !self.shard.contains(key) {
            return Err(Error::new(Status::Moved, moving_to));
        }
        if write && self.held_for_handover(key) {
            return Err(Error::new(Status::KeyMoving, format!("the key is being handed over to {moving_to}")));
        }
        Ok(())
    }

    /// As a move begins, and as the epoch it leads to begins (R ≥ 2), before this shard
    /// takes any request under them: starts dropping the copies of keys this server is no
    /// replica of under the current placement ([`StaleCopies`]). Nothing keeps them up to
    /// date (writes and deletes go to a key's replicas), and a move may make this server a
    /// replica of such a key again: the key's first replica copies it here if it still
    /// exists, and nothing brings the delete of one that does not, so the copy left here
    /// would come back with the key. As an epoch begins, they are the copies the move took
    /// off this server, which every new replica holds by then.
    pub(super) fn drop_stale_copies_if_the_placement_moved(&mut self) {
        let Some(p) = self.placement.as_mut() else { return };
        let version = p.role.version();
        if version == p.moves_seen {
            return;
        }
        p.moves_seen = version;
        let Some(current) = p.role.current() else { return };
        let placement = &current.1.placement;
        let this_move = (placement.epoch, placement.next.clone());
        let before = p.last_move.replace(this_move.clone());
        if placement.replicas < 2 || before.is_none_or(|b| b == this_move) {
            return;
        }
        let me = placement.members.iter().position(|m| *m == current.0);
        p.stale = Some(StaleCopies {
            me,
            current,
            from: Vec::new(),
            named: FxHashSet::default(),
            named_bytes: 0,
            dropped: 0,
            started: Instant::now(),
        });
    }

    /// Drops `key` first if it is a stale copy the scan has not looked at yet, then moves
    /// the scan on by [`STALE_STEP`] keys (to its end once the stale keys named so hold
    /// [`STALE_NAMED_BYTES`]: whoever names keys cannot make the shard hold more).
    fn drop_if_stale(&mut self, key: &[u8]) {
        let Some(stale) = self.placement.as_mut().and_then(|p| p.stale.as_mut()) else { return };
        if key >= stale.from.as_slice() && !stale.named.contains(key) && stale.is_stale(key) {
            stale.dropped += self.shard.drop_key(key) as u64;
            stale.named.insert(key.to_vec());
            stale.named_bytes += key.len();
        }
        let step = if stale.named_bytes >= STALE_NAMED_BYTES { usize::MAX } else { STALE_STEP };
        self.drop_stale_copies(step);
    }

    /// Looks at up to `limit` more keys for stale copies (the worker's sweep).
    pub(super) fn drop_stale_copies(&mut self, limit: usize) {
        let Some(p) = self.placement.as_mut() else { return };
        let Some(stale) = p.stale.as_mut() else { return };
        let (dropped, rest) =
            self.shard.drop_keys(&stale.from, limit, |k| !stale.named.contains(k) && stale.is_stale(k));
        stale.dropped += dropped;
        match rest {
            Some(from) => stale.from = from,
            None => {
                if stale.dropped > 0 {
                    tracing::info!(
                        "placement version {}: dropped {} copies of keys this server is no replica of ({:?})",
                        stale.current.1.placement.version,
                        stale.dropped,
                        stale.started.elapsed()
                    );
                }
                p.stale = None;
            }
        }
    }

    /// Forgets every key this shard holds once its server's copies went stale (see
    /// [`ServerRole::forget_copies`]): before any request under the placement that follows.
    fn forget_if_stale(&mut self) {
        let Some(p) = self.placement.as_mut() else { return };
        let forgotten = p.role.forgotten();
        if forgotten == p.forgotten {
            return;
        }
        p.forgotten = forgotten;
        p.handovers.clear();
        p.stale = None;
        let mut keys = 0;
        loop {
            let (deleted, more) = self.shard.delete_range(&[], None, FORGET_BATCH);
            keys += deleted;
            if !more {
                break;
            }
        }
        tracing::warn!("forgot the {keys} keys this shard held: the cluster moved on without this server");
    }

    /// Whether `key` is held for a handover now (a lapsed hold is dropped).
    pub(super) fn held_for_handover(&mut self, key: &[u8]) -> bool {
        let Some(p) = self.placement.as_mut() else { return false };
        match p.handovers.get(key) {
            Some(&until) if Instant::now() < until => true,
            Some(_) => {
                p.handovers.remove(key);
                false
            }
            None => false,
        }
    }

    /// Holds `key` for a handover of `len` bytes ([`flags::MIGRATE`] get).
    pub(super) fn hold_for_handover(&mut self, key: &[u8], len: u64) -> Result<()> {
        let Some(p) = self.placement.as_mut() else {
            return Err(Error::new(
                Status::Invalid,
                "handovers are between members of a cluster; this server is in none",
            ));
        };
        let now = Instant::now();
        if p.handovers.len() >= MAX_HANDOVERS {
            p.handovers.retain(|_, until| *until > now);
            if p.handovers.len() >= MAX_HANDOVERS {
                return Err(Error::new(
                    Status::NoRoom,
                    format!("{MAX_HANDOVERS} keys of this shard are in handovers already"),
                ));
            }
        }
        p.handovers.insert(key.to_vec(), transfer_deadline(HANDOVER_HOLD, len));
        Ok(())
    }

    pub(super) fn end_handover(&mut self, key: &[u8]) {
        if let Some(p) = self.placement.as_mut() {
            p.handovers.remove(key);
        }
    }
}
