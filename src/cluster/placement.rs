//! Where keys live in a cluster: the placement etcd holds (which servers keys hash over,
//! and while keys move, the servers they move to), compiled for routing, and the
//! placement a server's shard workers check requests against.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::proto::{node_seed, rendezvous, rendezvous_among, rendezvous_ranked};

/// The servers keys are placed on, as etcd holds it (`/remote_dram/NAME/placement`).
/// Each key goes to `replicas` of `members`, ranked by rendezvous hashing: its primary
/// first, which decides its generations and conditions, then its other replicas. While
/// `next` is set, keys are copied to the replicas they gain under `next`; once every
/// source has copied its keys, the placement is sealed, and once every source has
/// sealed, it becomes `next` under the following epoch.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Placement {
    /// Grows by one at each change of `members`; requests carry it, and servers refuse a
    /// request routed with an epoch they do not hold.
    pub epoch: u64,
    pub members: Vec<String>,
    pub next: Option<Vec<String>>,
    /// Servers that hold each key (the cluster's R).
    #[serde(default = "one")]
    pub replicas: usize,
    /// Grows by one at every change of the placement (`next` set or changed, or an epoch
    /// begun): what requests are routed with, so that a server refuses a client that
    /// has not seen where keys are being copied to.
    #[serde(default)]
    pub version: u64,
    /// Set once every source copied its keys to `next`: keys whose primary changes at the
    /// end of the move take no writes until it ends, and each source reports the highest
    /// generation it gave out ([`super::MoveReport::last_generation`]).
    #[serde(default)]
    pub sealed: bool,
    /// Above every generation a primary gave out before the epoch began (the highest the
    /// sources reported when sealed): a key's new primary gives out larger ones, so a
    /// write its old primary took before the seal can still be copied to the key's
    /// replicas after the epoch began, and is ordered before every write taken since.
    #[serde(default)]
    pub generation_floor: u64,
}

fn one() -> usize {
    1
}

/// Members that hold a key ([`Routing::replicas`]), inline for up to four.
pub type Members<'a> = smallvec::SmallVec<[&'a str; 4]>;

/// A placement with its members' hash seeds, for routing keys.
#[derive(Clone, Debug)]
pub struct Routing {
    pub placement: Placement,
    seeds: Vec<u64>,
    next_seeds: Vec<u64>,
}

impl Routing {
    pub fn new(placement: Placement) -> Routing {
        let seeds = placement.members.iter().map(|m| node_seed(m)).collect();
        let next_seeds = placement.next.iter().flatten().map(|m| node_seed(m)).collect();
        Routing { placement, seeds, next_seeds }
    }

    /// The member that owns `key` (None: the placement has no members).
    pub fn owner(&self, key: &[u8]) -> Option<&str> {
        (!self.seeds.is_empty()).then(|| self.placement.members[rendezvous(key, &self.seeds)].as_str())
    }

    /// The member `key` moves to, while keys move.
    pub fn next_owner(&self, key: &[u8]) -> Option<&str> {
        let next = self.placement.next.as_ref()?;
        (!next.is_empty()).then(|| next[rendezvous(key, &self.next_seeds)].as_str())
    }

    /// The members that hold `key`, its primary first.
    pub fn replicas(&self, key: &[u8]) -> Members<'_> {
        let ranked = rendezvous_ranked(key, &self.seeds, self.placement.replicas);
        ranked.into_iter().map(|i| self.placement.members[i].as_str()).collect()
    }

    /// The members that hold `key` under `next`, while keys move (empty otherwise).
    pub fn next_replicas(&self, key: &[u8]) -> Members<'_> {
        let Some(next) = &self.placement.next else { return Members::new() };
        let ranked = rendezvous_ranked(key, &self.next_seeds, self.placement.replicas);
        ranked.into_iter().map(|i| next[i].as_str()).collect()
    }

    /// Whether the member at `index` of the placement's members holds `key` now (as
    /// [`Routing::replicas`] says, without listing them).
    pub fn is_replica_at(&self, index: usize, key: &[u8]) -> bool {
        index < self.seeds.len() && rendezvous_among(key, &self.seeds, self.placement.replicas, index)
    }

    /// Whether `member` holds `key` now, or is to hold it under `next`.
    pub fn holds(&self, member: &str, key: &[u8]) -> bool {
        self.replicas(key).contains(&member) || self.next_replicas(key).contains(&member)
    }
}

/// A cluster member's current placement, set by its etcd agent and read by its shard
/// workers: a version number they compare with one atomic load per request, and the
/// routing behind a lock they take only when it changed.
#[derive(Debug, Default)]
pub struct ServerRole {
    version: AtomicU64,
    current: Mutex<Option<Arc<(String, Routing)>>>,
    /// Signalled (under `current`'s lock) when the placement changes.
    changed: std::sync::Condvar,
    /// What this server's mover handed over (for stats, metrics and `rdram top`).
    pub moves: MoveProgress,
    /// Fencing: a thread of the server's own ticks this clock (ms since [`clock`]'s
    /// origin) often; a gap longer than `pause_limit_ms` means the process was paused
    /// (SIGSTOP, a stalled VM) for long enough that its lease may have lapsed and the
    /// cluster moved on. Then `fenced` is set, and the server serves no key until etcd
    /// confirmed its lease and it read the placement again.
    tick_ms: AtomicU64,
    pause_limit_ms: AtomicU64,
    /// When etcd last confirmed this server's lease (ms on [`clock`]); a confirmation
    /// older than `lease_limit_ms` (a server cut off from etcd, but maybe not from its
    /// clients) fences it too, before the lease can have lapsed at etcd.
    confirmed_ms: AtomicU64,
    lease_limit_ms: AtomicU64,
    /// The lease's TTL, and when etcd confirmed the lease after going half of it without
    /// (etcd was out of reach of this server, and perhaps of everyone): for a TTL after
    /// that, another member's lapsed lease is not taken for its death (see
    /// [`ServerRole::lapses_judged_in`]).
    lease_ttl_ms: AtomicU64,
    back_from_outage_ms: AtomicU64,
    fenced: AtomicBool,
    /// Counts the times this server's copies went stale: each shard forgets every key it
    /// holds when it sees the count change (see [`ServerRole::forget_copies`]).
    forgotten: AtomicU64,
    /// The members etcd last said are live (their lease holds).
    live: Mutex<Vec<String>>,
}

/// Milliseconds on the monotonic clock since the first call.
fn clock() -> u64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1
}

/// Keys and bytes a server handed over to others since it started.
#[derive(Debug, Default)]
pub struct MoveProgress {
    pub keys: AtomicU64,
    pub bytes: AtomicU64,
    /// Set while this server has keys to hand over.
    pub active: AtomicBool,
}

impl ServerRole {
    /// Publishes the placement for the member named `me`.
    pub fn set(&self, me: &str, placement: Placement) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        *current = Some(Arc::new((me.to_string(), Routing::new(placement))));
        // Inside the lock: whoever reads this placement reads its version too, so a
        // request it sends next is checked against this placement (the mover's seal).
        self.version.fetch_add(1, Ordering::Release);
        self.changed.notify_all();
    }

    /// Waits until the placement's version is past `seen`, or `timeout` passed.
    pub fn wait_past(&self, seen: u64, timeout: std::time::Duration) {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.changed.wait_timeout_while(current, timeout, |_| self.version() == seen);
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Records the members etcd says are live.
    pub fn set_live(&self, members: Vec<String>) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = members;
    }

    /// Whether etcd last said `member` is live.
    pub fn is_live(&self, member: &str) -> bool {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|m| m == member)
    }

    /// The epoch of the placement this server holds (0: none yet).
    pub fn epoch(&self) -> u64 {
        self.current().map_or(0, |c| c.1.placement.epoch)
    }

    /// Starts fencing for a lease of `ttl`, kept alive every third of it: a pause longer
    /// than half the TTL (see `tick_ms`), or a lease etcd has not confirmed for two thirds
    /// of it (see `confirmed_ms`), fences the server.
    pub fn start_fencing(&self, ttl: std::time::Duration) {
        let ms = |d: std::time::Duration| d.as_millis().max(1) as u64;
        self.tick_ms.store(clock(), Ordering::Release);
        self.confirmed_ms.store(clock(), Ordering::Release);
        self.lease_limit_ms.store(ms(ttl * 2 / 3), Ordering::Release);
        self.pause_limit_ms.store(ms(ttl / 2), Ordering::Release);
        self.lease_ttl_ms.store(ms(ttl), Ordering::Release);
    }

    /// How long without a confirmation of its own lease means etcd was out of this
    /// server's reach long enough for others' leases to lapse: a member's lease lapses in
    /// an outage of two thirds of the TTL at least (it was kept alive a third of a TTL
    /// before), and this server then went half a TTL without a confirmation too. 0 before
    /// fencing starts.
    fn outage_ms(&self) -> u64 {
        self.lease_ttl_ms.load(Ordering::Acquire) / 2
    }

    /// etcd confirmed this server's lease (a keep-alive answered, or a new lease).
    pub fn lease_confirmed(&self) {
        let now = clock();
        let before = self.confirmed_ms.swap(now, Ordering::AcqRel);
        let outage = self.outage_ms();
        if outage > 0 && now.saturating_sub(before) > outage {
            self.back_from_outage_ms.store(now, Ordering::Release);
        }
    }

    /// How long until another member's lapsed lease may be taken for its death; None:
    /// now. Not while this server goes without its own lease confirmed for long, nor for a
    /// lease TTL after etcd confirmed it again: an etcd out of reach of everyone lets
    /// every lease lapse, those of live members too, and they register again as this
    /// server did. (Taken for dead, a live member's keys would be moved off it without it,
    /// and with one replica lost.)
    pub fn lapses_judged_in(&self) -> Option<std::time::Duration> {
        let (hold, outage) = (self.lease_ttl_ms.load(Ordering::Acquire), self.outage_ms());
        let now = clock();
        let back = self.back_from_outage_ms.load(Ordering::Acquire);
        let waited = if now.saturating_sub(self.confirmed_ms.load(Ordering::Acquire)) > outage {
            0
        } else if back == 0 {
            hold
        } else {
            now.saturating_sub(back)
        };
        (outage > 0 && waited < hold).then(|| std::time::Duration::from_millis(hold - waited))
    }

    /// Fences the server when etcd has not confirmed its lease for too long; true when
    /// this call fenced it.
    pub fn fence_unconfirmed_lease(&self) -> bool {
        !self.lease_current(clock()) && !self.fenced.swap(true, Ordering::AcqRel)
    }

    /// The server's lease lapsed while it was fenced, and the placement went on without it:
    /// the cluster may have written and deleted keys it holds, so every shard forgets what
    /// it holds before it takes another request. It joins as a new member, and is copied
    /// what it is to hold. (Kept, a key deleted meanwhile would come back once it is a
    /// replica of that key again.)
    pub fn forget_copies(&self) {
        self.forgotten.fetch_add(1, Ordering::AcqRel);
    }

    /// See [`ServerRole::forget_copies`].
    pub fn forgotten(&self) -> u64 {
        self.forgotten.load(Ordering::Acquire)
    }

    /// Whether etcd confirmed the lease recently enough, at `now` on [`clock`].
    fn lease_current(&self, now: u64) -> bool {
        let limit = self.lease_limit_ms.load(Ordering::Acquire);
        limit == 0 || now.saturating_sub(self.confirmed_ms.load(Ordering::Acquire)) <= limit
    }

    /// Ticks the server's clock; true when the gap since the last tick fenced it.
    pub fn tick(&self) -> bool {
        let (now, last) = (clock(), self.tick_ms.load(Ordering::Acquire));
        let limit = self.pause_limit_ms.load(Ordering::Acquire);
        let paused = limit > 0 && now.saturating_sub(last) > limit && !self.fenced.swap(true, Ordering::AcqRel);
        // Stored after `fenced`: a worker that reads this tick also reads the fence.
        self.tick_ms.store(now, Ordering::Release);
        paused
    }

    /// Whether the server may serve keys: not fenced, not paused since the last tick (a
    /// worker may run before the ticking thread after a pause), its lease confirmed lately.
    pub fn serving(&self) -> bool {
        let limit = self.pause_limit_ms.load(Ordering::Relaxed);
        if limit == 0 {
            return true;
        }
        let (now, last) = (clock(), self.tick_ms.load(Ordering::Acquire));
        !self.fenced.load(Ordering::Acquire) && now.saturating_sub(last) <= limit && self.lease_current(now)
    }

    pub fn fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Lifts the fence (etcd confirmed the lease, and the placement was read again).
    pub fn lift_fence(&self) {
        self.fenced.store(false, Ordering::Release);
    }

    /// This member's name and the placement it routes with (None before the first).
    pub fn current(&self) -> Option<Arc<(String, Routing)>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lapses are deaths while etcd confirms this server's lease steadily; not while it
    /// goes unconfirmed for half a TTL, nor for a TTL after it is confirmed again.
    #[test]
    fn lapses_are_judged_deaths_only_a_lease_ttl_after_an_outage() {
        let role = ServerRole::default();
        assert_eq!(role.lapses_judged_in(), None, "not fencing: nothing to hold");
        let ttl = std::time::Duration::from_secs(3);
        role.start_fencing(ttl);
        assert_eq!(role.lapses_judged_in(), None, "confirmed at the start");
        std::thread::sleep(ttl / 2 + std::time::Duration::from_millis(100));
        assert_eq!(role.lapses_judged_in(), Some(ttl), "unconfirmed for half a TTL: etcd may be out of reach");
        role.lease_confirmed();
        let wait = role.lapses_judged_in().expect("just back from an outage");
        assert!(wait <= ttl && wait > ttl / 2, "{wait:?}");
    }

    fn placement(members: &[&str], next: Option<&[&str]>, replicas: usize) -> Placement {
        let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Placement {
            epoch: 1,
            members: names(members),
            next: next.map(names),
            replicas,
            version: 1,
            ..Default::default()
        }
    }

    #[test]
    fn a_dead_members_keys_keep_their_surviving_replicas_in_order() {
        let r = Routing::new(placement(&["a", "b", "c", "d"], Some(&["b", "c", "d"]), 2));
        for i in 0..2000 {
            let key = format!("key-{i}");
            let (now, then) = (r.replicas(key.as_bytes()), r.next_replicas(key.as_bytes()));
            assert_eq!(now.len(), 2);
            assert_ne!(now[0], now[1], "two distinct replicas");
            let survivors: Vec<&str> = now.iter().copied().filter(|m| *m != "a").collect();
            assert_eq!(&then[..survivors.len()], &survivors[..], "survivors keep their rank: {now:?} -> {then:?}");
        }
    }

    #[test]
    fn is_replica_at_agrees_with_the_replica_list() {
        for replicas in 1..=3 {
            let r = Routing::new(placement(&["a", "b", "c", "d"], None, replicas));
            for i in 0..2000 {
                let key = format!("key-{i}");
                let listed = r.replicas(key.as_bytes());
                for (index, member) in r.placement.members.iter().enumerate() {
                    assert_eq!(r.is_replica_at(index, key.as_bytes()), listed.contains(&member.as_str()));
                }
            }
        }
    }

    #[test]
    fn keys_move_only_to_a_member_that_joins() {
        let before = placement(&["a", "b", "c"], None, 1);
        let mut during = before.clone();
        during.next = Some(vec!["a".into(), "b".into(), "c".into(), "d".into()]);
        let r = Routing::new(during);
        let mut moved = 0;
        for i in 0..2000 {
            let key = format!("key-{i}");
            let (from, to) = (r.owner(key.as_bytes()).unwrap(), r.next_owner(key.as_bytes()).unwrap());
            if from != to {
                assert_eq!(to, "d", "a key moves only to the new member");
                moved += 1;
            }
        }
        assert!((350..650).contains(&moved), "about a quarter of the keys move: {moved}");
    }
}
