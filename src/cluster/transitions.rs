//! The control plane's transitions, run through the followers' own loop
//! ([`follower::settle`]: read the state at one revision, take the live members, propose
//! what is due in a transaction) against an in-memory etcd behind the same [`Kv`] trait:
//! revisions, transactions on a key's last change, leases that lapse.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::follower::{self, Members, OnState};
use super::store::{Entry, Kv};
use super::*;

/// etcd's data model, in memory: a revision that every change raises, keys with the
/// revision of their last change and their lease, and leases that live until they lapse
/// (taking their keys with them).
#[derive(Default)]
struct MemoryEtcd {
    revision: i64,
    keys: BTreeMap<String, Entry>,
    leases: BTreeSet<i64>,
}

#[derive(Clone, Default)]
struct Etcd(Arc<Mutex<MemoryEtcd>>);

impl Etcd {
    fn with<T>(&self, f: impl FnOnce(&mut MemoryEtcd) -> T) -> T {
        f(&mut self.0.lock().unwrap())
    }

    fn put(&self, key: &str, value: Vec<u8>, lease: i64) {
        self.with(|e| {
            e.revision += 1;
            let entry = Entry { key: key.into(), value, mod_revision: e.revision, lease };
            e.keys.insert(key.into(), entry);
        });
    }

    fn delete(&self, key: &str) {
        self.with(|e| {
            e.revision += 1;
            e.keys.remove(key);
        });
    }

    fn grant(&self) -> i64 {
        self.with(|e| {
            let lease = e.leases.last().map_or(100, |l| l + 1);
            e.leases.insert(lease);
            lease
        })
    }

    /// The lease lapses: etcd deletes its keys.
    fn lapse(&self, lease: i64) {
        self.with(|e| {
            e.revision += 1;
            e.leases.remove(&lease);
            e.keys.retain(|_, entry| entry.lease != lease);
        });
    }

    fn placement(&self, url: &ClusterUrl) -> Placement {
        self.with(|e| serde_json::from_slice(&e.keys[&url.placement_key()].value).unwrap())
    }
}

impl Kv for Etcd {
    async fn range(&mut self, prefix: &str) -> std::result::Result<(i64, Vec<Entry>), String> {
        Ok(self.with(|e| {
            (
                e.revision,
                e.keys
                    .range(prefix.to_string()..)
                    .take_while(|(k, _)| k.starts_with(prefix))
                    .map(|(_, v)| v.clone())
                    .collect(),
            )
        }))
    }

    async fn put_if_unchanged(
        &mut self,
        key: &str,
        mod_revision: i64,
        value: Vec<u8>,
    ) -> std::result::Result<bool, String> {
        let current = self.with(|e| e.keys.get(key).map_or(0, |entry| entry.mod_revision));
        if current != mod_revision {
            return Ok(false);
        }
        self.put(key, value, 0);
        Ok(true)
    }

    async fn lease_lives(&mut self, lease: i64) -> bool {
        self.with(|e| e.leases.contains(&lease))
    }
}

/// A member's view of the cluster: what its follower reads and proposes, as a server's
/// steward does (`registration.rs`): the last good placement written back over one that
/// went or cannot be served on, else what the member proposes ([`proposal_of`]).
struct Follower {
    etcd: Etcd,
    members: Members,
    on_state: OnState,
}

impl Follower {
    fn new(etcd: &Etcd, secret: &ClusterSecret, me: &str) -> Follower {
        let held: Arc<Mutex<Option<Placement>>> = Arc::default();
        let me = me.to_string();
        let on_state: OnState = Box::new(move |s: &ClusterState| {
            let mut held = held.lock().unwrap();
            if let Some(back) = restored(s, held.as_ref()) {
                return Some(back);
            }
            if s.placement.is_some() {
                held.clone_from(&s.placement);
            }
            proposal_of(&me, s)
        });
        Follower { etcd: etcd.clone(), members: Members::checked_with(secret.clone()), on_state }
    }

    /// A server's follower, which keeps members whose lease lapsed while `hold` says.
    fn judging_lapses(mut self, hold: &Arc<Mutex<Option<Duration>>>) -> Follower {
        let hold = hold.clone();
        self.members = self.members.judging_lapses(Box::new(move || *hold.lock().unwrap()));
        self
    }

    /// Reads and proposes until nothing more is due; the state it ended on.
    fn settle(&mut self, url: &ClusterUrl) -> ClusterState {
        runtime().unwrap().block_on(async {
            follower::settle(&mut self.etcd, url, &mut self.members, &mut self.on_state).await.unwrap();
            let mut state = etcd::read_state(&mut self.etcd, url).await.unwrap();
            self.members.settle(&mut self.etcd, &mut state).await;
            state
        })
    }
}

struct Cluster {
    etcd: Etcd,
    url: ClusterUrl,
    secret: ClusterSecret,
    /// Each member's lease.
    leases: BTreeMap<String, i64>,
}

impl Cluster {
    /// A cluster of `replicas` per key whose `members` registered.
    fn with_members(replicas: u32, members: &[&str]) -> Cluster {
        let mut c = Cluster::new(replicas);
        for m in members {
            c.join(m);
        }
        c
    }

    fn new(replicas: u32) -> Cluster {
        let etcd = Etcd::default();
        let url = ClusterUrl::parse("etcd://127.0.0.1:2379/memory").unwrap().unwrap();
        etcd.put(&url.config_key(), serde_json::to_vec(&Settings { replicas }).unwrap(), 0);
        let secret = ClusterSecret::new(b"the cluster's secret, for tests").unwrap();
        Cluster { etcd, url, secret, leases: BTreeMap::new() }
    }

    /// A member registers: its record, sealed, under a lease of its own.
    fn join(&mut self, address: &str) {
        let lease = self.etcd.grant();
        self.leases.insert(address.into(), lease);
        self.put_record(address, false);
    }

    fn put_record(&self, address: &str, draining: bool) {
        let lease = self.leases[address];
        let member = Member { address: address.into(), shards: 1, draining, ..Default::default() };
        self.etcd.put(&(self.url.members_prefix() + address), member.sealed(&self.secret, lease), lease);
    }

    /// Member `me`'s follower.
    fn follower(&self, me: &str) -> Follower {
        Follower::new(&self.etcd, &self.secret, me)
    }

    /// A source reports its keys copied (and, once sealed, the generation it gave last).
    fn report(&self, source: &str, p: &Placement, last_generation: Option<u64>) {
        let report = MoveReport {
            epoch: p.epoch,
            next: p.next.clone().unwrap(),
            done: true,
            sealed_version: last_generation.map_or(0, |_| p.version),
            last_generation: last_generation.unwrap_or(0),
            ..Default::default()
        };
        self.etcd.put(&self.url.move_key(source), serde_json::to_vec(&report).unwrap(), self.leases[source]);
    }

    /// Takes the move under way to the next epoch: each source reports its keys copied,
    /// the placement is sealed, each reports the last generation it gave out.
    fn finish_move(&self, follower: &mut Follower, sources: &[(&str, u64)]) {
        let moving = self.placement();
        for (source, _) in sources {
            self.report(source, &moving, None);
        }
        follower.settle(&self.url);
        let sealed = self.placement();
        for (source, last) in sources {
            self.report(source, &sealed, Some(*last));
        }
        follower.settle(&self.url);
    }

    fn placement(&self) -> Placement {
        self.etcd.placement(&self.url)
    }
}

fn names(m: &[&str]) -> Vec<String> {
    m.iter().map(|s| s.to_string()).collect()
}

/// The first members are placed by whichever follower reads them first; the others find
/// nothing to do. Of two proposals made from one read, one holds.
#[test]
fn the_first_members_are_placed_once() {
    let c = Cluster::with_members(2, &["a", "b", "c"]);
    let (mut a, mut b) = (c.follower("a"), c.follower("b"));
    let state = a.settle(&c.url);
    let p = c.placement();
    assert_eq!((p.epoch, p.version, p.members.clone(), p.replicas), (1, 1, names(&["a", "b", "c"]), 2));
    assert_eq!(state.placement.as_ref(), Some(&p));
    let revision = c.etcd.with(|e| e.revision);
    b.settle(&c.url);
    assert_eq!(c.etcd.with(|e| e.revision), revision, "nothing was due: nothing was written");

    // Two members propose from the same read: the transaction holds for one.
    c.etcd.lapse(c.leases["c"]);
    let rt = runtime().unwrap();
    let proposals = rt.block_on(async {
        let mut state = etcd::read_state(&mut c.etcd.clone(), &c.url).await.unwrap();
        a.members.settle(&mut c.etcd.clone(), &mut state).await;
        let next = next_placement(&state).unwrap();
        let first = etcd::propose(&mut c.etcd.clone(), &c.url, &state, &next).await.unwrap();
        let second = etcd::propose(&mut c.etcd.clone(), &c.url, &state, &next).await.unwrap();
        (first, second)
    });
    assert_eq!(proposals, (true, false));
}

/// A member whose lease lapses is moved out: `next` without it, sealed once the live
/// sources copied their keys, then the next epoch with a generation floor above every
/// generation they gave out, which never goes back.
#[test]
fn a_member_whose_lease_lapses_is_moved_out() {
    let c = Cluster::with_members(2, &["a", "b", "c"]);
    let mut a = c.follower("a");
    a.settle(&c.url);
    c.etcd.lapse(c.leases["c"]);
    a.settle(&c.url);
    let moving = c.placement();
    assert_eq!((moving.epoch, moving.next.clone(), moving.sealed), (1, Some(names(&["a", "b"])), false));
    c.report("a", &moving, None);
    a.settle(&c.url);
    assert_eq!(c.placement(), moving, "b has not copied its keys yet");
    c.report("b", &moving, None);
    a.settle(&c.url);
    let sealed = c.placement();
    assert!(sealed.sealed && sealed.version == moving.version + 1, "{sealed:?}");
    c.report("a", &sealed, Some(700));
    c.report("b", &sealed, Some(900));
    let mut b = c.follower("b");
    b.settle(&c.url);
    let next = c.placement();
    assert_eq!((next.epoch, next.members.clone(), next.next.clone()), (2, names(&["a", "b"]), None));
    assert_eq!(next.generation_floor, 900);

    // b drains, a last source reports a lower generation: the floor stays.
    c.put_record("b", true);
    b.settle(&c.url);
    assert_eq!(c.placement().next, Some(names(&["a"])));
    c.finish_move(&mut b, &[("a", 10), ("b", 20)]);
    let after = c.placement();
    assert_eq!((after.epoch, after.members.clone(), after.generation_floor), (3, names(&["a"]), 900));
}

/// Records that whoever writes to etcd could make up or spoil: one whose seal does not
/// hold, or that is under no lease, is no member; a live member's record deleted stands
/// in as its last good one, and the placement keeps it.
#[test]
fn members_are_live_leases_with_records_sealed_for_them() {
    let c = Cluster::with_members(2, &["a", "b"]);
    let lease = c.etcd.grant();
    let forged = Member { address: "x".into(), seal: "00".repeat(32), ..Default::default() };
    c.etcd.put(&(c.url.members_prefix() + "x"), serde_json::to_vec(&forged).unwrap(), lease);
    let unleased = Member { address: "y".into(), ..Default::default() };
    c.etcd.put(&(c.url.members_prefix() + "y"), unleased.sealed(&c.secret, 0), 0);
    let mut a = c.follower("a");
    let state = a.settle(&c.url);
    assert_eq!(c.placement().members, names(&["a", "b"]));
    assert_eq!(state.members.iter().map(|m| m.address.as_str()).collect::<Vec<_>>(), ["a", "b"]);

    c.etcd.delete(&(c.url.members_prefix() + "b"));
    let state = a.settle(&c.url);
    assert_eq!(state.stood_in, ["b"], "b's lease lives: its last good record stands in");
    assert_eq!((c.placement().members, c.placement().next), (names(&["a", "b"]), None));
    c.etcd.lapse(c.leases["b"]);
    a.settle(&c.url);
    assert_eq!(c.placement().next, Some(names(&["a"])), "gone with its lease");
}

/// A placement deleted, or made unreadable, is written back by a member that held it: one
/// version on, with its epoch and generation floor.
#[test]
fn a_spoilt_placement_is_written_back_one_version_on() {
    let mut c = Cluster::new(1);
    c.join("a");
    let mut a = c.follower("a");
    a.settle(&c.url);
    let held = c.placement();
    c.etcd.put(&c.url.placement_key(), b"{\"not\": \"ours\"}".to_vec(), 0);
    a.settle(&c.url);
    let back = c.placement();
    assert_eq!((back.epoch, back.members.clone(), back.version), (held.epoch, held.members.clone(), held.version + 1));
    c.etcd.delete(&c.url.placement_key());
    a.settle(&c.url);
    let again = c.placement();
    assert_eq!((again.epoch, again.version), (held.epoch, held.version + 2));
}

/// Every lease lapses with an etcd that was out of reach of everyone: the member that
/// registers again first keeps the others in the placement while its judge holds (a
/// lease TTL after its own came back), so their keys are not moved off them; one that
/// does not come back in that time is moved out then.
#[test]
fn leases_lapsed_in_an_etcd_outage_move_no_member_out_until_the_hold_ends() {
    let mut c = Cluster::with_members(1, &["a", "b", "c"]);
    let hold = Arc::new(Mutex::new(None));
    let mut a = c.follower("a").judging_lapses(&hold);
    a.settle(&c.url);
    let placed = c.placement();
    assert_eq!(placed.members, names(&["a", "b", "c"]));

    for m in ["a", "b", "c"] {
        c.etcd.lapse(c.leases[m]);
    }
    *hold.lock().unwrap() = Some(Duration::from_secs(5));
    c.join("a");
    let state = a.settle(&c.url);
    assert_eq!(c.placement(), placed, "no move while the others may still register again");
    assert_eq!(state.lapsed_in_outage, ["b", "c"]);
    assert_eq!(a.members.recheck(), Some(Duration::from_secs(5)), "the state is read again when the hold ends");
    c.join("b");
    let state = a.settle(&c.url);
    assert_eq!((c.placement(), state.lapsed_in_outage), (placed.clone(), names(&["c"])));

    *hold.lock().unwrap() = None;
    a.settle(&c.url);
    assert_eq!(c.placement().next, Some(names(&["a", "b"])), "c did not come back within the hold");
    assert_eq!(a.members.recheck(), None);
}

/// A member back from a pause past its lease, before it registered again: its own judge
/// holds lapsed leases (its lease went unconfirmed for longer than half a TTL), so its
/// follower keeps its old record as live, but it proposes nothing from that; once
/// registered again it proposes keys moving to itself, as a joining member would.
#[test]
fn a_member_whose_lease_lapsed_proposes_nothing_until_it_registered_again() {
    let mut c = Cluster::with_members(2, &["a", "b", "c"]);
    let hold = Arc::new(Mutex::new(None));
    let (mut a, mut paused) = (c.follower("a"), c.follower("c").judging_lapses(&hold));
    a.settle(&c.url);
    paused.settle(&c.url);

    // c is paused past its lease: the others move its keys off it, and on.
    c.etcd.lapse(c.leases["c"]);
    a.settle(&c.url);
    assert_eq!(c.placement().next, Some(names(&["a", "b"])));
    c.finish_move(&mut a, &[("a", 1), ("b", 1)]);
    let without = c.placement();
    assert_eq!((without.members.clone(), without.next.clone()), (names(&["a", "b"]), None));

    // c runs again: its lease was not confirmed for long, so its judge holds lapses.
    *hold.lock().unwrap() = Some(Duration::from_secs(5));
    let state = paused.settle(&c.url);
    assert!(state.lapsed_in_outage.contains(&"c".to_string()), "{state:?}");
    assert_eq!(c.placement(), without, "c proposed keys moving to itself before it registered again");

    c.join("c");
    paused.settle(&c.url);
    assert_eq!(c.placement().next, Some(names(&["a", "b", "c"])), "registered again, c takes keys as a joining member");
}
