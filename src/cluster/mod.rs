//! Clusters whose membership lives in etcd: `etcd://HOST:PORT[,HOST:PORT…]/NAME`.
//!
//! etcd holds, under `/remote_dram/NAME/`:
//! - `config`: the cluster's settings ([`Settings`]), written once by `rdram cluster create`;
//! - `members/ADDRESS`: one key per live server ([`Member`]), attached to that server's
//!   lease, so that a server that dies (or is cut off from etcd) drops out of the set when
//!   its lease expires, and one that stops revokes it at once;
//! - `placement`: the servers keys are placed on, and while keys move, where they move
//!   ([`Placement`]);
//! - `moves/ADDRESS`: a source server's progress in handing its keys over ([`MoveReport`]),
//!   under its lease;
//! - `drain/ADDRESS`: written by `rdram cluster drain`: that server hands its keys over
//!   and leaves.
//!
//! A server keeps its lease alive from a thread of its own ([`Registration`]), and follows
//! the cluster's state: when the live members differ from the placement, or every source
//! has handed its keys over, it proposes the next placement in an etcd transaction that
//! holds only if the placement is still the one it read (so of servers proposing at once,
//! one wins and the others read its result). Clients and tools read the placement and
//! watch it ([`Watch`]). The request path never talks to etcd: a client routes on the
//! view it holds and learns of a new one by an atomic load. etcd's leases, watches and
//! transactions are the whole protocol; nothing here votes or elects.
//!
//! Here: the URL, the records, the cluster's state and the next placement (pure), and the
//! admin commands. `store.rs`: what the state machine asks of etcd, as a trait (etcd, and
//! the in-memory etcd of `transitions.rs`'s unit tests). `etcd.rs`: the one connection a
//! process's tasks share, reading the state, proposing. `follower.rs`:
//! following the state and which members are live. `registration.rs`: a server's
//! membership. `watch.rs`: what clients route on. `mover.rs`: moving keys.

mod etcd;
mod follower;
pub mod member;
pub mod mover;
pub mod placement;
mod registration;
pub mod replication;
mod store;
#[cfg(test)]
mod transitions;
pub mod tunables;
mod watch;
use etcd::{connect, etcd_error, read_settings, read_state, runtime};
pub use etcd::{CA_FILE_ENV, CERT_FILE_ENV, CREDENTIALS_FILE_ENV, KEY_FILE_ENV};
pub use placement::{Placement, Routing, ServerRole};
pub use registration::Registration;
pub use watch::{LostServers, Watch};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::auth::ClusterSecret;
use crate::error::{Error, Result, Status};

/// A parsed `etcd://HOST:PORT[,HOST:PORT…]/NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterUrl {
    /// etcd's client endpoints, as `http://HOST:PORT`.
    pub endpoints: Vec<String>,
    pub name: String,
}

impl ClusterUrl {
    /// None when `s` is not an `etcd://` string (a static list of servers).
    pub fn parse(s: &str) -> Result<Option<ClusterUrl>> {
        let Some(rest) = s.trim().strip_prefix("etcd://") else {
            return Ok(None);
        };
        let bad = |why: &str| {
            Error::new(
                Status::Invalid,
                format!("cluster address {s:?}: {why} (expected etcd://HOST:PORT[,HOST:PORT...]/NAME)"),
            )
        };
        let (hosts, name) = rest.split_once('/').ok_or_else(|| bad("no cluster name"))?;
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(bad("the name must be letters, digits, '-', '_' or '.'"));
        }
        let endpoints: Vec<String> =
            hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("http://{h}")).collect();
        if endpoints.is_empty() {
            return Err(bad("no etcd endpoint"));
        }
        Ok(Some(ClusterUrl { endpoints, name: name.to_string() }))
    }

    fn prefix(&self) -> String {
        format!("/remote_dram/{}/", self.name)
    }

    fn config_key(&self) -> String {
        self.prefix() + "config"
    }

    fn members_prefix(&self) -> String {
        self.prefix() + "members/"
    }

    fn placement_key(&self) -> String {
        self.prefix() + "placement"
    }

    fn move_key(&self, address: &str) -> String {
        self.prefix() + "moves/" + address
    }

    fn drain_key(&self, address: &str) -> String {
        self.prefix() + "drain/" + address
    }
}

impl std::fmt::Display for ClusterUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<&str> = self.endpoints.iter().map(|e| e.trim_start_matches("http://")).collect();
        write!(f, "etcd://{}/{}", hosts.join(","), self.name)
    }
}

/// A cluster's settings, recorded once by `rdram cluster create`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Settings {
    /// Servers that hold each key.
    pub replicas: u32,
}

/// What a live server publishes about itself, sealed with the cluster's secret and bound
/// to its lease: servers ignore a record whose seal does not hold for the lease etcd says
/// it is attached to (one made by someone without the secret, or moved off its lease).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Member {
    /// Its bootstrap address: what clients connect to, and the node name keys hash over.
    pub address: String,
    pub shards: usize,
    pub transport: String,
    pub capacity_bytes: u64,
    /// Handing its keys over before it leaves: keys are placed on it no more.
    #[serde(default)]
    pub draining: bool,
    /// [`crate::auth::ClusterSecret::seal`] of the record without this field, under `lease`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub seal: String,
    /// The lease etcd holds the record under (read from etcd, never written).
    #[serde(skip)]
    pub lease: i64,
}

impl Member {
    /// The record's bytes in etcd, sealed for `lease`.
    fn sealed(&self, secret: &ClusterSecret, lease: i64) -> Vec<u8> {
        let bare = Member { seal: String::new(), ..self.clone() };
        let bytes = serde_json::to_vec(&bare).expect("a member record serializes");
        let seal = secret.seal(&bytes, lease);
        serde_json::to_vec(&Member { seal, ..bare }).expect("a member record serializes")
    }

    /// Why this record, as read from etcd, is not to be trusted; None when its seal holds
    /// for the lease it is attached to.
    fn distrust(&self, secret: &ClusterSecret) -> Option<&'static str> {
        if self.lease == 0 {
            return Some("it is attached to no lease");
        }
        let bare = Member { seal: String::new(), lease: 0, ..self.clone() };
        let bytes = serde_json::to_vec(&bare).expect("a member record serializes");
        (!secret.seal_holds(&self.seal, &bytes, self.lease))
            .then_some("its seal does not hold (not made with this cluster's secret for its lease)")
    }
}

/// A source server's progress in handing over the keys that move elsewhere under a
/// placement's `next`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MoveReport {
    /// The placement (epoch and `next`) the keys move for.
    pub epoch: u64,
    pub next: Vec<String>,
    /// Every key that moves was handed over.
    pub done: bool,
    pub keys_moved: u64,
    pub bytes_moved: u64,
    /// Handover rate over the pass so far, bytes per second.
    pub bytes_per_second: u64,
    /// The version of the sealed placement this source sealed under (0: not sealed):
    /// from then on it takes no write for a key whose primary changes.
    #[serde(default)]
    pub sealed_version: u64,
    /// The highest generation this source's shards gave out, read once it sealed.
    #[serde(default)]
    pub last_generation: u64,
}

/// Everything under a cluster's prefix at one etcd revision.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    pub revision: i64,
    pub settings: Option<Settings>,
    /// Live members, in address order.
    pub members: Vec<Member>,
    pub placement: Option<Placement>,
    /// The placement key's last modification, which a proposal must still find.
    pub placement_revision: i64,
    /// Why the placement key holds no placement that can be served on (not one of ours,
    /// or a generation floor past [`crate::store::shard::GENERATION_LIMIT`]); `placement`
    /// is None then.
    pub placement_unreadable: Option<String>,
    pub moves: BTreeMap<String, MoveReport>,
    /// Servers asked to drain (`rdram cluster drain`).
    pub drains: Vec<String>,
    /// Live members whose record in etcd went or was spoilt: their last good one stands in.
    pub stood_in: Vec<String>,
    /// Members whose lease lapsed while etcd may have been out of reach of everyone: kept,
    /// as their last record, until they may be taken for dead
    /// ([`ServerRole::lapses_judged_in`]).
    pub lapsed_in_outage: Vec<String>,
}

/// What a client routes on: the placement at one etcd revision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The placement key's last modification (0: no placement yet).
    pub revision: i64,
    pub placement: Placement,
}

impl View {
    /// Every server a client needs a connection to: the members, and while keys move,
    /// the servers they move to.
    pub fn addresses(&self) -> Vec<String> {
        let mut all = self.placement.members.clone();
        for n in self.placement.next.iter().flatten() {
            if !all.contains(n) {
                all.push(n.clone());
            }
        }
        all
    }
}

/// What member `me` proposes on reading `state`: the next step ([`next_placement`]), but
/// nothing while its own lease lapsed and it has not registered again. Its follower then
/// holds it as live only by its own judgement of the lapse (`lapsed_in_outage`), which the
/// others' followers need not share: counted as wanted, it would propose keys moving to
/// itself before it is back, the others would take that back at once, and the copies
/// begun meanwhile would wait out their deadline. Its registration wakes its follower.
pub fn proposal_of(me: &str, state: &ClusterState) -> Option<Placement> {
    if state.lapsed_in_outage.iter().any(|m| m == me) {
        return None;
    }
    next_placement(state)
}

/// The placement that should follow `state`'s, if any: the first placement once a member
/// is live; keys moving once the live members that are not draining differ from the
/// placement's (a member that died leaves it this way too, once its lease lapsed); sealed
/// once every live source reported its keys copied; the next epoch, with its generation
/// floor, once every live source reported itself sealed. A server keys were moving to
/// that died is dropped from `next`, and the move starts over. What a dead member held
/// survives on its keys' other replicas (none with R = 1).
pub fn next_placement(state: &ClusterState) -> Option<Placement> {
    let wanted: Vec<String> = state.members.iter().filter(|m| !m.draining).map(|m| m.address.clone()).collect();
    let live = |a: &String| state.members.iter().any(|m| m.address == *a);
    let Some(p) = &state.placement else {
        let replicas = state.settings.as_ref().map_or(1, |s| s.replicas.max(1) as usize);
        return (!wanted.is_empty()).then_some(Placement {
            epoch: 1,
            members: wanted,
            next: None,
            replicas,
            version: 1,
            ..Default::default()
        });
    };
    let changed = |p: Placement| Placement { version: p.version + 1, ..p };
    match &p.next {
        None if wanted.is_empty() || p.members == wanted => None,
        None => Some(changed(Placement { next: Some(wanted), ..p.clone() })),
        Some(next) if !next.iter().all(live) => {
            let still: Vec<String> = next.iter().filter(|a| live(a)).cloned().collect();
            let next = if still.is_empty() { (!wanted.is_empty()).then_some(wanted) } else { Some(still) };
            Some(changed(Placement { next, sealed: false, ..p.clone() }))
        }
        Some(next) => {
            let reports: Option<Vec<&MoveReport>> = p
                .members
                .iter()
                .filter(|a| live(a))
                .map(|a| state.moves.get(a).filter(|r| r.done && r.epoch == p.epoch && r.next == *next))
                .collect();
            let reports = reports?;
            if !p.sealed {
                return Some(changed(Placement { sealed: true, ..p.clone() }));
            }
            if !reports.iter().all(|r| r.sealed_version == p.version) {
                return None;
            }
            let floor = reports.iter().map(|r| r.last_generation).fold(p.generation_floor, u64::max);
            Some(changed(Placement {
                epoch: p.epoch + 1,
                members: next.clone(),
                next: None,
                sealed: false,
                generation_floor: floor,
                ..p.clone()
            }))
        }
    }
}

/// A placement read from etcd, checked before any server or client takes it.
fn valid_placement(p: Placement) -> std::result::Result<Placement, String> {
    if p.epoch == 0 || p.version == 0 || p.replicas == 0 || p.members.is_empty() {
        return Err(format!(
            "epoch {}, version {}, {} replicas, {} members",
            p.epoch,
            p.version,
            p.replicas,
            p.members.len()
        ));
    }
    crate::store::shard::check_generation(p.generation_floor).map_err(|e| e.message)?;
    Ok(p)
}

/// The placement to write back when etcd's was deleted or made unreadable while this
/// server held `held`: the same, one version on, so that neither the epoch nor the
/// generation floor ever goes back.
fn restored(state: &ClusterState, held: Option<&Placement>) -> Option<Placement> {
    let held = held.filter(|_| state.placement.is_none())?;
    Some(Placement { version: held.version + 1, ..held.clone() })
}

/// Records a new cluster's settings; fails if the cluster exists already.
pub fn create(url: &ClusterUrl, settings: &Settings) -> Result<()> {
    if settings.replicas == 0 {
        return Err(Error::new(Status::Invalid, "a cluster needs at least 1 replica per key"));
    }
    let value = serde_json::to_vec(settings).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        let created = store::Kv::put_if_unchanged(&mut client, &url.config_key(), 0, value)
            .await
            .map_err(|e| etcd_error(url, "cannot write the cluster's settings", e))?;
        if created {
            return Ok(());
        }
        let existing = read_settings(&mut client, url)
            .await?
            .map_or_else(|| "unknown settings".into(), |s| format!("{} replicas", s.replicas));
        Err(Error::new(Status::Invalid, format!("cluster {} exists already ({existing})", url.name)))
    })
}

/// What `rdram cluster status` prints.
#[derive(Debug, Serialize)]
pub struct ClusterStatus {
    pub cluster: String,
    pub replicas: u32,
    pub revision: i64,
    pub members: Vec<Member>,
    pub placement: Option<Placement>,
    /// Sources' progress while keys move.
    pub moves: BTreeMap<String, MoveReport>,
    pub drains: Vec<String>,
}

/// Reads a cluster's settings, members, placement and data movement.
pub fn status(url: &ClusterUrl) -> Result<ClusterStatus> {
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        let state = read_state(&mut client, url).await?;
        let settings = state.settings.ok_or_else(|| no_such_cluster(url))?;
        let moving = state.placement.as_ref().and_then(|p| p.next.as_ref().map(|n| (p.epoch, n.clone())));
        let moves = state
            .moves
            .into_iter()
            .filter(|(_, r)| moving.as_ref().is_some_and(|(e, n)| r.epoch == *e && r.next == *n))
            .collect();
        Ok(ClusterStatus {
            cluster: url.to_string(),
            replicas: settings.replicas,
            revision: state.revision,
            members: state.members,
            placement: state.placement,
            moves,
            drains: state.drains,
        })
    })
}

/// Asks the server at `address` to hand its keys over and leave (`rdram cluster drain`).
pub fn request_drain(url: &ClusterUrl, address: &str) -> Result<()> {
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        let state = read_state(&mut client, url).await?;
        state.settings.as_ref().ok_or_else(|| no_such_cluster(url))?;
        if !state.members.iter().any(|m| m.address == address) {
            let live: Vec<&str> = state.members.iter().map(|m| m.address.as_str()).collect();
            return Err(Error::new(
                Status::Invalid,
                format!("{address} is not a live member of cluster {} (members: {live:?})", url.name),
            ));
        }
        client
            .put(url.drain_key(address), "", None)
            .await
            .map_err(|e| etcd_error(url, "cannot write the drain request", e))?;
        Ok(())
    })
}

fn no_such_cluster(url: &ClusterUrl) -> Error {
    Error::new(
        Status::Invalid,
        format!("cluster {} does not exist in etcd: create it with `rdram cluster create {url}`", url.name),
    )
}

#[cfg(test)]
mod tests {
    use super::{next_placement, ClusterState, ClusterUrl, Member, MoveReport, Placement};

    fn member(address: &str) -> Member {
        Member { address: address.into(), shards: 1, transport: "ucx".into(), capacity_bytes: 1, ..Default::default() }
    }

    fn report(p: &Placement, sealed: bool, last_generation: u64) -> MoveReport {
        MoveReport {
            epoch: p.epoch,
            next: p.next.clone().unwrap(),
            done: true,
            sealed_version: if sealed { p.version } else { 0 },
            last_generation,
            ..Default::default()
        }
    }

    #[test]
    fn a_move_ends_sealed_with_a_generation_floor_above_every_source() {
        let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut state = ClusterState {
            members: ["a", "b", "c"].map(member).to_vec(),
            placement: Some(Placement {
                epoch: 4,
                members: names(&["a", "b"]),
                replicas: 2,
                version: 9,
                generation_floor: 50,
                ..Default::default()
            }),
            ..Default::default()
        };
        let moving = next_placement(&state).expect("c joined: keys move");
        assert_eq!((moving.epoch, moving.next.clone(), moving.sealed), (4, Some(names(&["a", "b", "c"])), false));
        state.placement = Some(moving.clone());
        assert_eq!(next_placement(&state), None, "no source reported yet");
        state.moves.insert("a".into(), report(&moving, false, 0));
        assert_eq!(next_placement(&state), None, "b has not copied its keys yet");
        state.moves.insert("b".into(), report(&moving, false, 0));
        let sealed = next_placement(&state).expect("every source copied its keys");
        assert!(sealed.sealed && sealed.epoch == 4 && sealed.version == moving.version + 1);
        state.placement = Some(sealed.clone());
        state.moves.insert("a".into(), report(&sealed, true, 700));
        state.moves.insert("b".into(), report(&moving, true, 900));
        assert_eq!(next_placement(&state), None, "b sealed under an older version of the placement");
        state.moves.insert("b".into(), report(&sealed, true, 300));
        let next = next_placement(&state).expect("every source sealed");
        assert_eq!((next.epoch, next.members.clone(), next.next.clone()), (5, names(&["a", "b", "c"]), None));
        assert_eq!((next.sealed, next.generation_floor), (false, 700), "the floor is the sources' highest");

        // A server keys move to that dies unseals the move: it starts over.
        state.members.retain(|m| m.address != "c");
        let restarted = next_placement(&state).expect("c is gone");
        assert_eq!((restarted.next, restarted.sealed), (Some(names(&["a", "b"])), false));
    }

    #[test]
    fn cluster_urls_name_etcd_endpoints_and_a_cluster() {
        let u = ClusterUrl::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/pool-a").unwrap().unwrap();
        assert_eq!(u.endpoints, ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]);
        assert_eq!(u.name, "pool-a");
        assert_eq!(u.to_string(), "etcd://127.0.0.1:2379,10.0.0.2:2379/pool-a");
        assert_eq!(ClusterUrl::parse("127.0.0.1:7000,127.0.0.1:7001").unwrap(), None);
        for bad in ["etcd://127.0.0.1:2379", "etcd:///x", "etcd://h:1/", "etcd://h:1/a/b"] {
            assert!(ClusterUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
