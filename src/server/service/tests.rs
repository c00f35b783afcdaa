use super::*;
use crate::cluster::{Placement, Routing};
use crate::server::tunables::STALE_NAMED_BYTES;
use crate::store::{HugePages, Mode};

/// A shard of member `me` in a cluster with R = 2 whose keys move from `members` to
/// `next`, and a key whose primary changes from "a" to "b".
fn member_shard(me: &str, members: &[&str], next: &[&str]) -> (Service, Arc<ServerRole>, Vec<u8>) {
    let (_, rx) = crossbeam_channel::unbounded();
    let shard = Shard::new(1 << 20, HugePages::Off, Mode::Cache).expect("a 1 MiB shard");
    let mut service = Service::new(0, 1, rx, shard, Arc::new(ReplyBudget::new(u64::MAX)));
    let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let placement = Placement {
        epoch: 2,
        members: names(members),
        next: Some(names(next)),
        replicas: 2,
        version: 5,
        ..Default::default()
    };
    let routing = Routing::new(placement.clone());
    let key = (0..)
        .map(|i| format!("key-{i}").into_bytes())
        .find(|k| routing.owner(k) == Some("a") && routing.next_owner(k) == Some("b"))
        .unwrap();
    let role = Arc::new(ServerRole::default());
    role.set(me, placement);
    service
        .set_cluster_role(role.clone(), ClusterSecret::new(b"a test cluster secret").unwrap(), None, Vec::new(), false)
        .unwrap();
    (service, role, key)
}

fn asked_write() -> RequestHeader {
    let mut h = RequestHeader::new(Op::Put, 1, 0);
    h.flags = flags::VIEW | flags::ASKING;
    h.view = 5;
    h
}

#[test]
fn a_next_primary_takes_an_asked_write_only_once_the_primary_is_gone() {
    let (mut b, role, key) = member_shard("b", &["a", "b"], &["b", "c"]);
    role.set_live(vec!["a".into(), "b".into(), "c".into()]);
    let refused = b.check_placement(&asked_write(), Kind::Put, &key).unwrap_err();
    assert_eq!(refused.status, Status::ViewChanged, "{}", refused.message);
    assert!(refused.message.contains("is live"), "{}", refused.message);
    assert!(b.check_placement(&asked_write(), Kind::Get, &key).is_ok(), "reads are asked of any replica");
    role.set_live(vec!["b".into(), "c".into()]);
    assert!(b.check_placement(&asked_write(), Kind::Put, &key).is_ok(), "a's lease lapsed");
}

/// A read asked of a replica other than the primary (its client lost the primary) is
/// taken by the key's replicas under the current placement, which hold every write
/// acknowledged, and refused by one the key moves to, which may not have been copied it yet.
#[test]
fn an_asked_read_is_taken_only_by_a_replica_that_holds_every_acknowledged_write() {
    let mut read = asked_write();
    read.op = Op::Get as u8;
    let (mut b, _, key) = member_shard("b", &["a", "b"], &["b", "c"]);
    assert!(b.check_placement(&read, Kind::Get, &key).is_ok(), "b is the key's replica now");
    let (mut c, role, key) = member_shard("c", &["a", "b"], &["b", "c"]);
    assert!(role.current().unwrap().1.holds("c", &key), "the key moves to c");
    let refused = c.check_placement(&read, Kind::Get, &key).unwrap_err();
    assert_eq!(refused.status, Status::ViewChanged, "{}", refused.message);
}

/// A member's copy comes without a view: taken for a key this server holds, or is to hold,
/// under the placement it holds now; refused for any other, whoever sent it.
#[test]
fn a_copy_is_taken_only_for_a_key_held_here() {
    let (mut c, role, key) = member_shard("c", &["a", "b"], &["b", "c"]);
    assert!(role.current().unwrap().1.holds("c", &key), "the key moves to c");
    let import = RequestHeader::new(Op::Put, 1, 0);
    assert!(c.check_placement(&import, Kind::Import, &key).is_ok());
    let (mut d, _, key) = member_shard("d", &["a", "b"], &["b", "c"]);
    for kind in [Kind::Import, Kind::ImportDelete] {
        let refused = d.check_placement(&import, kind, &key).unwrap_err();
        assert_eq!(refused.status, Status::ViewChanged, "{kind:?}: {}", refused.message);
    }
    assert!(d.check_placement(&import, Kind::CopyRead, &key).is_ok(), "reads for a copy are not fenced");
}

#[test]
fn a_sealed_move_holds_writes_to_keys_whose_primary_changes() {
    let (mut a, role, key) = member_shard("a", &["a", "b"], &["b", "c"]);
    let mut write = RequestHeader::new(Op::Put, 1, 0);
    write.flags = flags::VIEW;
    write.view = 5;
    assert!(a.check_placement(&write, Kind::Put, &key).is_ok(), "taken while the move is not sealed");
    let mut sealed = role.current().unwrap().1.placement.clone();
    (sealed.sealed, sealed.version, sealed.generation_floor) = (true, 6, 1 << 62);
    role.set("a", sealed.clone());
    write.view = 6;
    let held = a.check_placement(&write, Kind::Put, &key).unwrap_err();
    assert_eq!(held.status, Status::KeyMoving, "{}", held.message);
    assert!(a.check_placement(&write, Kind::Get, &key).is_ok(), "reads go on");
    // The next epoch: generations given out here from then on are above its floor.
    let next = Placement { epoch: 3, members: sealed.next.clone().unwrap(), next: None, version: 7, ..sealed };
    role.set("a", next);
    write.view = 7;
    let _ = a.check_placement(&write, Kind::Put, b"k");
    assert!(a.shard.last_generation() >= 1 << 62, "the floor raised this shard's generations");
}

fn hold(s: &mut Service, key: &[u8]) {
    use crate::store::Layout;
    let layout = Layout::aligned_to(key.len(), 1, 0);
    let e = s.shard.reserve(layout.extent_len()).unwrap();
    s.shard.write_put(e, layout, key, b"v");
    let generation = s.shard.last_generation() + 1;
    s.shard.commit_import(e, layout, generation, 0).unwrap();
}

/// Member "c" of a cluster at rest on a, b and c (R = 2) holding `keys`, as a move
/// begins in which b leaves and d joins (c gains some of b's keys); and the routing at rest.
fn shard_as_a_move_begins(keys: &[Vec<u8>]) -> (Service, Routing, Routing) {
    let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (mut c, role, _) = member_shard("c", &["a", "b"], &["b", "c"]);
    let at_rest =
        Placement { epoch: 2, members: names(&["a", "b", "c"]), replicas: 2, version: 4, ..Default::default() };
    role.set("c", at_rest.clone());
    let _ = c.check_placement(&RequestHeader::new(Op::Put, 1, 0), Kind::Get, b"-");
    for k in keys {
        hold(&mut c, k);
    }
    let moving = Placement { next: Some(names(&["a", "c", "d"])), version: 5, ..at_rest.clone() };
    role.set("c", moving.clone());
    (c, Routing::new(at_rest), Routing::new(moving))
}

/// As a move begins, a member drops its copies of keys it is no replica of, without
/// holding requests up for a whole scan: a key a request names is looked at first, a copy
/// taken since the move began stays, and the scan ends at the worker's sweeps.
#[test]
fn a_moves_stale_copies_go_before_any_request_touches_them_and_new_copies_stay() {
    let keys: Vec<Vec<u8>> = (0..300).map(|i| format!("key-{i:03}").into_bytes()).collect();
    let (mut c, routing, gains) = shard_as_a_move_begins(&keys);
    let stale: Vec<&Vec<u8>> = keys.iter().filter(|k| !routing.replicas(k).contains(&"c")).collect();
    assert!(stale.len() > 50, "{} of the keys are copies c does not keep", stale.len());
    // A stale copy late in key order that c is to hold again: named first, it is dropped
    // at once, before the scan reaches it, and the copy the move sends stays.
    let copy = RequestHeader::new(Op::Put, 1, 0);
    let last = stale.iter().rev().find(|k| gains.next_replicas(k).contains(&"c")).unwrap().as_slice();
    let _ = c.check_placement(&copy, Kind::CopyRead, last);
    assert!(!c.shard.contains(last), "a stale copy was served before the scan dropped it");
    c.check_placement(&copy, Kind::Import, last).unwrap();
    hold(&mut c, last);
    for _ in 0..4 {
        c.sweep(1);
    }
    for k in &keys {
        let kept = routing.replicas(k).contains(&"c") || k.as_slice() == last;
        assert_eq!(c.shard.contains(k), kept, "{}", String::from_utf8_lossy(k));
    }
}

/// Keys requests name before the scan reached them are remembered only while they are
/// stale, and up to a bound of bytes: past it, the scan ends at once, so whoever sends
/// requests cannot make the shard hold more.
#[test]
fn keys_named_during_a_stale_scan_are_bounded() {
    let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("held-{i:04}").into_bytes()).collect();
    let (mut c, routing, _) = shard_as_a_move_begins(&keys);
    let copy = RequestHeader::new(Op::Put, 1, 0);
    let scanning = |c: &Service| c.placement.as_ref().unwrap().stale.is_some();
    let mut named = 0;
    for i in 0.. {
        // Long keys past every held one, so that the scan's own steps do not end it first.
        let key = format!("{}{i}", "z".repeat(200_000)).into_bytes();
        let _ = c.check_placement(&copy, Kind::Get, &key);
        if routing.replicas(&key).contains(&"c") {
            continue;
        }
        named += key.len();
        if !scanning(&c) {
            break;
        }
        assert!(named <= STALE_NAMED_BYTES, "{named} bytes of named keys and the scan goes on");
    }
    assert!(named >= STALE_NAMED_BYTES, "the scan ended after {named} bytes of named keys");
}
