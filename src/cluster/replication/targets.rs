//! Where a copy goes under the current placement.

use super::CopyJob;
use crate::cluster::placement::Members;
use crate::cluster::Routing;

/// Where one copy goes under the current placement: members named as the placement
/// names them (no allocation unless the write is superseded).
pub(super) enum Targets<'a> {
    /// Replicas that must take it, and those the key leaves whose lease lapsed (sent
    /// where they answer).
    Copy { required: Members<'a>, leaving: Members<'a> },
    /// The write may not last: this server is the key's primary no more, and the write
    /// was taken after the current epoch began.
    Superseded(String),
}

/// Where `job`'s copy goes under `routing`, as seen by member `me`; `live`: whether etcd
/// lists a member as live.
pub(super) fn targets<'a>(me: &str, routing: &'a Routing, job: &CopyJob, live: impl Fn(&str) -> bool) -> Targets<'a> {
    let key = &job.key;
    let primary = routing.owner(key) == Some(me) || routing.next_owner(key) == Some(me);
    // A write taken by a server that is the key's primary no more is copied on only if
    // it was taken before the current epoch began: at or below the epoch's floor (the
    // highest generation its old primaries gave out), since the key's new primary gives
    // out only generations above it. Otherwise (this server lost its lease, or was paused, and the
    // placement moved on without it) it may be ordered after writes taken since.
    if !primary && job.generation > routing.placement.generation_floor {
        return Targets::Superseded(format!(
            "the placement changed while the write was copied: {me} took it but is no longer the key's primary, so it may not last; read the key to see"
        ));
    }
    let now = routing.replicas(key);
    let then = routing.next_replicas(key);
    let mut required = if then.is_empty() { now.clone() } else { then };
    // With one replica per key, the one it leaves hands it over itself (the mover).
    let leaves: Members = match now.len() > 1 {
        true => now.iter().copied().filter(|s| !required.contains(s) && *s != me).collect(),
        false => Members::new(),
    };
    // A replica the key leaves still takes the reads that fail over to it until the move
    // ends, so it must hold every write acknowledged meanwhile; once its lease lapsed it
    // serves no more (it fenced itself first), and the write does not wait for it.
    let mut leaving = Members::new();
    for s in leaves {
        match live(s) {
            true => required.push(s),
            false => leaving.push(s),
        }
    }
    required.retain(|s| *s != me);
    Targets::Copy { required, leaving }
}

/// The first of the members a mover's copy names that `routing` no longer has hold `key`
/// (now or under `next`): the placement changed while the key was handed over, and that
/// member refuses the copy. None: every one still holds it.
pub(super) fn named_off<'n>(routing: &Routing, key: &[u8], named: &'n [String]) -> Option<&'n str> {
    named.iter().map(String::as_str).find(|m| !routing.holds(m, key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Placement;

    /// The last write the old primary took before the seal has the floor's generation:
    /// it is copied on after the epoch turns; one above the floor may not last.
    #[test]
    fn a_write_from_before_the_epoch_is_copied_on_and_one_after_it_is_not() {
        let members = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = Placement {
            epoch: 3,
            members: members(&["b", "c"]),
            replicas: 2,
            version: 9,
            generation_floor: 700,
            ..Default::default()
        };
        let routing = Routing::new(placement);
        let job = |generation| CopyJob {
            token: 1,
            key: b"k".to_vec(),
            value: None,
            generation,
            ttl_ms: 0,
            to: None,
            streamed: false,
        };
        let live = |_: &str| true;
        // "a" left the members: it is the key's primary no more.
        assert!(matches!(targets("a", &routing, &job(700), live), Targets::Copy { .. }), "taken before the epoch");
        assert!(matches!(targets("a", &routing, &job(699), live), Targets::Copy { .. }));
        assert!(matches!(targets("a", &routing, &job(701), live), Targets::Superseded(_)), "taken after it began");
        let Targets::Copy { required, leaving } = targets("a", &routing, &job(700), live) else { unreachable!() };
        assert_eq!((sorted(required), names(leaving)), (vec!["b".to_string(), "c".to_string()], Vec::<String>::new()));
    }

    /// While a key moves, a replica it leaves takes the reads that fail over to it: the
    /// write waits for it as long as etcd lists it live, and is sent where it answers once
    /// its lease lapsed.
    #[test]
    fn a_write_waits_for_a_live_replica_the_key_leaves_and_not_for_a_lapsed_one() {
        let members = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = Placement {
            epoch: 3,
            members: members(&["a", "b", "c"]),
            next: Some(members(&["a", "b", "c", "d"])),
            replicas: 2,
            version: 9,
            ..Default::default()
        };
        let routing = Routing::new(placement);
        // A key whose replicas change during the move, one kept and one replaced.
        let key = (0..10_000u32)
            .map(|i| format!("k{i}").into_bytes())
            .find(|k| {
                let (now, then) = (routing.replicas(k), routing.next_replicas(k));
                now[0] == then[0] && now[1] != then[1]
            })
            .expect("a key whose second replica changes");
        let (primary, leaving, gaining) = (
            routing.replicas(&key)[0].to_string(),
            routing.replicas(&key)[1].to_string(),
            routing.next_replicas(&key)[1].to_string(),
        );
        let job =
            CopyJob { token: 1, key: key.clone(), value: None, generation: 1, ttl_ms: 0, to: None, streamed: false };
        let Targets::Copy { required, leaving: lapsed } = targets(&primary, &routing, &job, |_| true) else {
            unreachable!()
        };
        assert_eq!(
            (sorted(required), names(lapsed)),
            (sorted(Members::from_slice(&[&gaining, &leaving])), Vec::<String>::new())
        );
        let Targets::Copy { required, leaving: lapsed } = targets(&primary, &routing, &job, |m| m != leaving) else {
            unreachable!()
        };
        assert_eq!((names(required), names(lapsed)), (vec![gaining.clone()], vec![leaving.clone()]));
    }

    /// A mover's copy names the members a key moves to; once the placement no longer has
    /// one of them hold it (the move was taken back), the copy goes no further.
    #[test]
    fn a_movers_copy_stops_at_a_member_the_placement_took_the_key_off() {
        let members = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = |next: Option<&[&str]>| Placement {
            epoch: 3,
            members: members(&["a", "b"]),
            next: next.map(members),
            replicas: 2,
            version: 9,
            ..Default::default()
        };
        let moving = Routing::new(placement(Some(&["a", "b", "c"])));
        let key = (0..10_000u32)
            .map(|i| format!("k{i}").into_bytes())
            .find(|k| moving.next_replicas(k).contains(&"c"))
            .expect("a key that moves to c");
        let named = members(&["c"]);
        assert_eq!(named_off(&moving, &key, &named), None, "c is to hold it");
        let taken_back = Routing::new(placement(Some(&["a", "b"])));
        assert_eq!(named_off(&taken_back, &key, &named), Some("c"));
        assert_eq!(named_off(&Routing::new(placement(None)), &key, &named), Some("c"));
    }

    fn names(m: Members) -> Vec<String> {
        m.iter().map(|s| s.to_string()).collect()
    }

    fn sorted(m: Members) -> Vec<String> {
        let mut v = names(m);
        v.sort();
        v
    }
}
