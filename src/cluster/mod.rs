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

pub mod mover;
pub mod placement;
pub use placement::{Placement, Routing, ServerRole};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::auth::ClusterSecret;
use crate::error::{Error, Result, Status};

/// How long one etcd call may take before it counts as etcd being unreachable.
const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to reach etcd again after it failed.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// How long a joining server waits for the placement to take it in.
const PLACEMENT_WAIT: Duration = Duration::from_secs(5);
/// Default lease TTL of a server's registration.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

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

fn etcd_error(url: &ClusterUrl, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(Status::Unavailable, format!("etcd at {}: {what}: {e}", url.endpoints.join(",")))
}

/// A runtime of one thread for etcd's gRPC client, driven from synchronous code with
/// `block_on` and running background tasks (keep-alives, watches) meanwhile.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rdram-etcd")
        .enable_all()
        .build()
        .map_err(|e| Error::new(Status::Internal, format!("no runtime for etcd: {e}")))
}

/// Names a file whose first line is `USER:PASSWORD`, for an etcd with authentication on;
/// read by servers, clients and commands alike whenever they connect to etcd.
pub const CREDENTIALS_FILE_ENV: &str = "RDRAM_ETCD_CREDENTIALS_FILE";

/// Names a PEM file of the certificate authority that signed etcd's server certificate:
/// etcd is then reached over TLS (`https://`), its certificate checked against that CA.
pub const CA_FILE_ENV: &str = "RDRAM_ETCD_CA_FILE";
/// Name PEM files of a client certificate and its key, for an etcd that asks for client
/// certificates (`--client-cert-auth`); with [`CA_FILE_ENV`] only.
pub const CERT_FILE_ENV: &str = "RDRAM_ETCD_CERT_FILE";
pub const KEY_FILE_ENV: &str = "RDRAM_ETCD_KEY_FILE";

/// Reads the file an environment variable names: None when it is not set.
fn file_named_by(env: &str, what: &str) -> Result<Option<(String, String)>> {
    let Some(path) = std::env::var_os(env) else { return Ok(None) };
    let shown = std::path::Path::new(&path).display().to_string();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::new(Status::Invalid, format!("{what} {shown} ({env}): {e}")))?;
    Ok(Some((text, shown)))
}

/// Warns when a secret's file can be read by others than its owner.
fn warn_if_shared(shown: &str, what: &str) {
    if std::fs::metadata(shown).is_ok_and(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o077 != 0) {
        warn!("{what} {shown} is readable by others than its owner");
    }
}

/// The etcd user and password [`CREDENTIALS_FILE_ENV`] names, if it is set.
fn credentials() -> Result<Option<(String, String)>> {
    let Some((text, shown)) = file_named_by(CREDENTIALS_FILE_ENV, "etcd credentials file")? else { return Ok(None) };
    let line = text.lines().next().unwrap_or_default().trim_end();
    let Some((user, password)) = line.split_once(':').filter(|(user, _)| !user.is_empty()) else {
        return Err(Error::new(
            Status::Invalid,
            format!("etcd credentials file {shown}: its first line must be USER:PASSWORD"),
        ));
    };
    warn_if_shared(&shown, "etcd credentials file");
    Ok(Some((user.to_string(), password.to_string())))
}

/// TLS toward etcd, from the files [`CA_FILE_ENV`], [`CERT_FILE_ENV`] and [`KEY_FILE_ENV`]
/// name (None: plain http).
fn tls() -> Result<Option<etcd_client::TlsOptions>> {
    let ca = file_named_by(CA_FILE_ENV, "etcd CA file")?;
    let cert = file_named_by(CERT_FILE_ENV, "etcd client certificate")?;
    let key = file_named_by(KEY_FILE_ENV, "etcd client key")?;
    let Some((ca, _)) = ca else {
        return match cert.is_some() || key.is_some() {
            true => Err(Error::new(
                Status::Invalid,
                format!("{CERT_FILE_ENV} and {KEY_FILE_ENV} need {CA_FILE_ENV} (the CA of etcd's certificate)"),
            )),
            false => Ok(None),
        };
    };
    let mut options = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
    match (cert, key) {
        (Some((cert, _)), Some((key, shown))) => {
            warn_if_shared(&shown, "etcd client key");
            options = options.identity(etcd_client::Identity::from_pem(cert, key));
        }
        (None, None) => {}
        _ => {
            return Err(Error::new(
                Status::Invalid,
                format!("a client certificate needs both {CERT_FILE_ENV} and {KEY_FILE_ENV}"),
            ))
        }
    }
    Ok(Some(options))
}

async fn connect(url: &ClusterUrl) -> Result<etcd_client::Client> {
    let mut options =
        etcd_client::ConnectOptions::new().with_connect_timeout(ETCD_CALL_TIMEOUT).with_timeout(ETCD_CALL_TIMEOUT);
    if let Some((user, password)) = credentials()? {
        options = options.with_user(user, password);
    }
    let mut endpoints = url.endpoints.clone();
    if let Some(tls) = tls()? {
        options = options.with_tls(tls);
        for e in &mut endpoints {
            *e = e.replacen("http://", "https://", 1);
        }
    }
    etcd_client::Client::connect(endpoints, Some(options)).await.map_err(|e| etcd_error(url, "cannot connect", e))
}

async fn read_settings(client: &mut etcd_client::Client, url: &ClusterUrl) -> Result<Option<Settings>> {
    let got = client
        .get(url.config_key(), None)
        .await
        .map_err(|e| etcd_error(url, "cannot read the cluster's settings", e))?;
    match got.kvs().first() {
        None => Ok(None),
        Some(kv) => serde_json::from_slice(kv.value()).map(Some).map_err(|e| {
            Error::new(Status::Invalid, format!("cluster {}: its settings in etcd are not ours: {e}", url.name))
        }),
    }
}

/// Reads everything under the cluster's prefix at one revision (a handful of keys).
async fn read_state(client: &mut etcd_client::Client, url: &ClusterUrl) -> Result<ClusterState> {
    let got = client
        .get(url.prefix(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| etcd_error(url, "cannot read the cluster", e))?;
    let mut state = ClusterState { revision: got.header().map_or(0, |h| h.revision()), ..Default::default() };
    let prefix = url.prefix();
    for kv in got.kvs() {
        let Some(name) = kv.key_str().ok().and_then(|k| k.strip_prefix(prefix.as_str())) else { continue };
        let value = kv.value();
        if name == "config" {
            state.settings = serde_json::from_slice(value).ok();
        } else if name == "placement" {
            state.placement_revision = kv.mod_revision();
            match serde_json::from_slice::<Placement>(value).map_err(|e| e.to_string()).and_then(valid_placement) {
                Ok(p) => state.placement = Some(p),
                Err(why) => state.placement_unreadable = Some(why),
            }
        } else if let Some(address) = name.strip_prefix("members/") {
            if let Ok(m) = serde_json::from_slice::<Member>(value) {
                // A record is its own key's: one filed under another name is ignored.
                if m.address == address {
                    state.members.push(Member { lease: kv.lease(), ..m });
                }
            }
        } else if let Some(address) = name.strip_prefix("moves/") {
            if let Ok(report) = serde_json::from_slice(value) {
                state.moves.insert(address.to_string(), report);
            }
        } else if let Some(address) = name.strip_prefix("drain/") {
            state.drains.push(address.to_string());
        }
    }
    state.members.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(state)
}

/// Writes `proposed` as the placement if the placement is still the one `state` read.
async fn propose(
    client: &mut etcd_client::Client,
    url: &ClusterUrl,
    state: &ClusterState,
    proposed: &Placement,
) -> Result<bool> {
    let key = url.placement_key();
    let value = serde_json::to_vec(proposed).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    let unchanged = match state.placement_revision {
        0 => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
        revision => Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
    };
    let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(key, value, None)]);
    let done = client.txn(txn).await.map_err(|e| etcd_error(url, "cannot write the placement", e))?;
    if done.succeeded() {
        match &proposed.next {
            Some(next) => {
                info!("cluster {url}: view {}: keys move from {:?} to {:?}", proposed.epoch, proposed.members, next)
            }
            None => info!("cluster {url}: view {} placed on {:?}", proposed.epoch, proposed.members),
        }
    }
    Ok(done.succeeded())
}

/// Records a new cluster's settings; fails if the cluster exists already.
pub fn create(url: &ClusterUrl, settings: &Settings) -> Result<()> {
    if settings.replicas == 0 {
        return Err(Error::new(Status::Invalid, "a cluster needs at least 1 replica per key"));
    }
    let value = serde_json::to_vec(settings).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        let key = url.config_key();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value, None)]);
        let done = client.txn(txn).await.map_err(|e| etcd_error(url, "cannot write the cluster's settings", e))?;
        if done.succeeded() {
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

/// A server's membership: its key under a lease that a background task keeps alive, and
/// a follower of the cluster's state that keeps the server's [`ServerRole`] current and
/// proposes the next placement when one is due. The lease is revoked (the server leaves
/// the view at once) by [`Registration::leave`] or on drop; if the process dies, the
/// lease expires after its TTL.
pub struct Registration {
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    url: ClusterUrl,
    member: Arc<Mutex<Member>>,
    lease: Arc<AtomicI64>,
    secret: ClusterSecret,
    /// This member's connection to etcd for its own writes (a handle on a shared channel).
    etcd: etcd_client::Client,
    /// Whether the last exchange with etcd succeeded (for logs and metrics).
    pub etcd_reachable: Arc<AtomicBool>,
    /// The cluster's state as last read.
    state: Arc<Mutex<ClusterState>>,
    /// The thread that ticks the server's clock for fencing, and what stops it.
    clock: Mutex<Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>>,
}

/// How often the lease clock ticks ([`ServerRole::tick`]).
const TICK: Duration = Duration::from_millis(50);

impl Registration {
    /// Registers `member` in the cluster under a lease of `ttl`, and keeps `role` set to
    /// the cluster's placement from then on. Fails, saying why, when etcd cannot be
    /// reached or the cluster was not created.
    pub fn join(
        url: &ClusterUrl,
        member: Member,
        ttl: Duration,
        role: Arc<ServerRole>,
        secret: ClusterSecret,
    ) -> Result<Registration> {
        let ttl_secs = ttl.as_secs().max(1) as i64;
        let runtime = runtime()?;
        let key = url.members_prefix() + &member.address;
        let record = Arc::new(Mutex::new(member.clone()));
        let reregister = Arc::new(AtomicBool::new(false));
        let lease = Arc::new(AtomicI64::new(0));
        let etcd_reachable = Arc::new(AtomicBool::new(true));
        let (client, watcher) = runtime.block_on(async {
            let mut client = connect(url).await?;
            read_settings(&mut client, url).await?.ok_or_else(|| no_such_cluster(url))?;
            let id = register(&mut client, url, &key, &member, &secret, ttl_secs).await?;
            lease.store(id, Ordering::SeqCst);
            let watcher = connect(url).await?;
            Ok::<_, Error>((client, watcher))
        })?;
        info!("joined cluster {url} as {} (lease TTL {ttl_secs} s)", member.address);
        // Keep-alives go every third of the TTL: a pause of half the TTL cannot outlast
        // the lease; one longer fences the server until etcd confirms it.
        role.fence_pauses_longer_than(Duration::from_secs(ttl_secs as u64) / 2);
        let ticking = Arc::new(AtomicBool::new(true));
        let clock = {
            let (role, ticking, url) = (role.clone(), ticking.clone(), url.clone());
            std::thread::Builder::new().name("rdram-lease-clock".into()).spawn(move || {
                while ticking.load(Ordering::Relaxed) {
                    if role.tick() {
                        warn!("cluster {url}: this server was paused for longer than half its lease; serving no keys until etcd confirms the lease");
                    }
                    std::thread::sleep(TICK);
                }
            })
        }
        .map_err(|e| Error::new(Status::Internal, format!("cannot start the lease clock: {e}")))?;
        // One connection to etcd serves this member's own writes (draining, reports, leaving).
        let etcd = client.clone();
        let task = KeepAlive {
            client,
            url: url.clone(),
            key,
            record: record.clone(),
            secret: secret.clone(),
            reregister: reregister.clone(),
            ttl_secs,
            lease: lease.clone(),
            reachable: etcd_reachable.clone(),
            role: role.clone(),
            me: member.address.clone(),
        };
        runtime.spawn(task.run());
        let state = Arc::new(Mutex::new(ClusterState::default()));
        let me = member.address.clone();
        let seen = state.clone();
        let mut warned_about = -1;
        let steward = move |s: &ClusterState| {
            if s.stood_in.contains(&me) {
                // Deleted or rewritten by someone else while this server lives: put back.
                reregister.store(true, Ordering::SeqCst);
            }
            let held = role.current().map(|c| c.1.placement.clone());
            if let Some(back) = restored(s, held.as_ref()) {
                if warned_about != s.placement_revision {
                    warned_about = s.placement_revision;
                    let why = s.placement_unreadable.as_deref().unwrap_or("it was deleted");
                    warn!("cluster: the placement in etcd cannot be served on ({why}); serving on view {} and writing it back", back.epoch);
                }
                return Some(back);
            }
            if let Some(p) = &s.placement {
                let changed = role.current().is_none_or(|c| c.1.placement != *p);
                if changed {
                    role.set(&me, p.clone());
                }
            }
            role.set_live(s.members.iter().map(|m| m.address.clone()).collect());
            *seen.lock().unwrap_or_else(|e| e.into_inner()) = s.clone();
            next_placement(s)
        };
        let follower = Follower {
            client: watcher,
            url: url.clone(),
            on_state: Box::new(steward),
            what: "serving on the last view",
            members: Members::checked_with(secret.clone()),
        };
        runtime.spawn(follower.run());
        // Returns once the placement has this server (as a member, or as one keys move
        // to), so that a client connecting after the server started finds it.
        let placed = |p: &Placement| p.members.iter().chain(p.next.iter().flatten()).any(|m| *m == member.address);
        let deadline = std::time::Instant::now() + PLACEMENT_WAIT;
        while !state.lock().unwrap_or_else(|e| e.into_inner()).placement.as_ref().is_some_and(placed) {
            if std::time::Instant::now() >= deadline {
                warn!("cluster {url}: this server is not in the placement after {PLACEMENT_WAIT:?}; serving on while it is proposed");
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(Registration {
            secret,
            etcd,
            runtime: Mutex::new(Some(runtime)),
            url: url.clone(),
            member: record,
            lease,
            etcd_reachable,
            state,
            clock: Mutex::new(Some((ticking, clock))),
        })
    }

    /// The cluster's state as last read from etcd.
    pub fn state(&self) -> ClusterState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops taking keys: the member record says it drains, so the next placement leaves
    /// this server out and its keys are handed over.
    pub fn start_draining(&self) -> Result<()> {
        let member = {
            let mut m = self.member.lock().unwrap_or_else(|e| e.into_inner());
            m.draining = true;
            m.clone()
        };
        let (url, id) = (self.url.clone(), self.lease.load(Ordering::SeqCst));
        let key = url.members_prefix() + &member.address;
        let value = member.sealed(&self.secret, id);
        let mut client = self.etcd.clone();
        self.block_on(async move {
            client
                .put(key, value, Some(PutOptions::new().with_lease(id)))
                .await
                .map_err(|e| etcd_error(&url, "cannot mark this server as draining", e))?;
            Ok(())
        })
    }

    /// Publishes this server's progress in handing its keys over.
    pub fn report_moves(&self, report: &MoveReport) -> Result<()> {
        let (url, id) = (self.url.clone(), self.lease.load(Ordering::SeqCst));
        let key = url.move_key(&self.address());
        let value = serde_json::to_vec(report).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        let mut client = self.etcd.clone();
        self.block_on(async move {
            client
                .put(key, value, Some(PutOptions::new().with_lease(id)))
                .await
                .map_err(|e| etcd_error(&url, "cannot report the handover", e))?;
            Ok(())
        })
    }

    /// This server's address, its name in the cluster.
    pub fn address(&self) -> String {
        self.member.lock().unwrap_or_else(|e| e.into_inner()).address.clone()
    }

    fn block_on<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let handle = self.runtime.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|r| r.handle().clone());
        match handle {
            Some(h) => h.block_on(f),
            None => Err(Error::new(Status::Unavailable, "this server left the cluster")),
        }
    }

    /// Leaves the cluster now: the lease is revoked, and with it the member key.
    pub fn leave(&self) {
        self.revoke();
    }

    fn revoke(&self) {
        if let Some((ticking, thread)) = self.clock.lock().unwrap_or_else(|e| e.into_inner()).take() {
            ticking.store(false, Ordering::Relaxed);
            let _ = thread.join();
        }
        let Some(runtime) = self.runtime.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
        let (url, id) = (self.url.clone(), self.lease.load(Ordering::SeqCst));
        let drain_key = url.drain_key(&self.address());
        let mut client = self.etcd.clone();
        let revoked = runtime.block_on(async {
            let _ = client.delete(drain_key, None).await;
            client.lease_revoke(id).await.map_err(|e| etcd_error(&url, "cannot revoke the lease", e))
        });
        match revoked {
            Ok(_) => info!("left cluster {url}"),
            Err(e) => warn!("leaving cluster {url}: {}; the member key goes when its lease expires", e.message),
        }
        runtime.shutdown_timeout(Duration::from_millis(100));
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.revoke();
    }
}

/// Grants a lease of `ttl_secs` and puts the member record under it; returns the lease.
async fn register(
    client: &mut etcd_client::Client,
    url: &ClusterUrl,
    key: &str,
    member: &Member,
    secret: &ClusterSecret,
    ttl_secs: i64,
) -> Result<i64> {
    let lease = client.lease_grant(ttl_secs, None).await.map_err(|e| etcd_error(url, "cannot grant a lease", e))?;
    put_record(client, url, key, member, secret, lease.id()).await?;
    Ok(lease.id())
}

/// Puts the member record, sealed, under `lease`.
async fn put_record(
    client: &mut etcd_client::Client,
    url: &ClusterUrl,
    key: &str,
    member: &Member,
    secret: &ClusterSecret,
    lease: i64,
) -> Result<()> {
    client
        .put(key, member.sealed(secret, lease), Some(PutOptions::new().with_lease(lease)))
        .await
        .map_err(|e| etcd_error(url, "cannot register this server", e))?;
    Ok(())
}

/// Keeps a registration's lease alive; registers again under a new lease if the old one
/// expired (etcd was unreachable for longer than the TTL).
struct KeepAlive {
    client: etcd_client::Client,
    url: ClusterUrl,
    key: String,
    /// The record as this server last wrote it (draining or not).
    record: Arc<Mutex<Member>>,
    secret: ClusterSecret,
    /// Set when the record went from etcd (or was rewritten) while this server lives.
    reregister: Arc<AtomicBool>,
    ttl_secs: i64,
    lease: Arc<AtomicI64>,
    reachable: Arc<AtomicBool>,
    /// Fenced after a pause: the fence goes once a keep-alive succeeded (or the server
    /// registered again) and the placement was read anew.
    role: Arc<ServerRole>,
    me: String,
}

impl KeepAlive {
    /// Lifts a fence, now that the lease is confirmed: reads the placement first, so that
    /// the server refuses requests routed with the view it held before its pause.
    async fn lift_fence(&mut self) {
        if !self.role.fenced() {
            return;
        }
        match read_state(&mut self.client, &self.url).await {
            Ok(state) => {
                if let Some(p) = state.placement {
                    self.role.set(&self.me, p);
                }
                self.role.lift_fence();
                info!(
                    "cluster {}: lease confirmed and placement read again after a pause; serving keys again",
                    self.url
                );
            }
            Err(e) => warn!("cluster {}: after a pause: {}", self.url, e.message),
        }
    }

    /// Waits `every`, or less once the server is fenced or its record must be put back.
    async fn pause(&self, every: Duration) {
        let until = tokio::time::Instant::now() + every;
        while tokio::time::Instant::now() < until && !self.role.fenced() && !self.reregister.load(Ordering::SeqCst) {
            tokio::time::sleep(TICK).await;
        }
    }

    async fn run(mut self) {
        let every = Duration::from_millis((self.ttl_secs as u64 * 1000 / 3).max(100));
        loop {
            let outcome = self.keep_alive_until_failure(every).await;
            if outcome.status != Status::Ok && self.reachable.swap(false, Ordering::SeqCst) {
                warn!("cluster {}: etcd unreachable ({}); serving on, and trying again", self.url, outcome.message);
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            if let Ok(client) = connect(&self.url).await {
                self.client = client;
            }
        }
    }

    /// Sends keep-alives every `every` until one fails; re-registers when the lease is
    /// gone (and then says so with status `Ok`).
    async fn keep_alive_until_failure(&mut self, every: Duration) -> Error {
        let id = self.lease.load(Ordering::SeqCst);
        let (mut keeper, mut replies) = match self.client.lease_keep_alive(id).await {
            Ok(k) => k,
            Err(e) => return etcd_error(&self.url, "keep-alive", e),
        };
        loop {
            if let Err(e) = keeper.keep_alive().await {
                return etcd_error(&self.url, "keep-alive", e);
            }
            match tokio::time::timeout(ETCD_CALL_TIMEOUT, replies.message()).await {
                Ok(Ok(Some(reply))) if reply.ttl() > 0 => {
                    if !self.reachable.swap(true, Ordering::SeqCst) {
                        info!("cluster {}: etcd reachable again", self.url);
                    }
                    if self.reregister.swap(false, Ordering::SeqCst) {
                        warn!("cluster {}: this server's member record went from etcd (or was rewritten); registering again", self.url);
                        let member = self.record.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        if let Err(e) =
                            put_record(&mut self.client, &self.url, &self.key, &member, &self.secret, id).await
                        {
                            self.reregister.store(true, Ordering::SeqCst);
                            return e;
                        }
                    }
                    self.lift_fence().await;
                }
                Ok(Ok(Some(_))) => {
                    // The lease expired while etcd was out of reach: join again.
                    warn!("cluster {}: this server's lease expired; registering again", self.url);
                    let member = self.record.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    return match register(&mut self.client, &self.url, &self.key, &member, &self.secret, self.ttl_secs)
                        .await
                    {
                        Ok(new) => {
                            self.lease.store(new, Ordering::SeqCst);
                            self.lift_fence().await;
                            Error::new(Status::Ok, "registered again under a new lease")
                        }
                        Err(e) => e,
                    };
                }
                Ok(Ok(None)) => return etcd_error(&self.url, "keep-alive", "stream ended"),
                Ok(Err(e)) => return etcd_error(&self.url, "keep-alive", e),
                Err(_) => return etcd_error(&self.url, "keep-alive", "no answer in time"),
            }
            self.pause(every).await;
        }
    }
}

/// A cluster's placement as etcd says it is now, followed by a background watch.
/// [`Watch::revision`] is one atomic load: callers compare it with the revision of the
/// view they route on.
pub struct Watch {
    runtime: tokio::runtime::Runtime,
    url: ClusterUrl,
    /// For [`Watch::refresh`] (the follower has a connection of its own).
    client: etcd_client::Client,
    view: Arc<Mutex<View>>,
    revision: Arc<AtomicI64>,
    lost: Arc<LostServers>,
}

/// Servers a cluster's placement names whose lease lapsed (dead, or stopped answering):
/// a client waiting on one gives up on it at once instead of at its timeout. A version
/// (one atomic load) says when the set changed.
#[derive(Debug, Default)]
pub struct LostServers {
    version: std::sync::atomic::AtomicU64,
    nodes: Mutex<Vec<String>>,
}

impl LostServers {
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn contains(&self, node: &str) -> bool {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|n| n == node)
    }

    fn publish(&self, state: &ClusterState) {
        let Some(p) = &state.placement else { return };
        let live = |a: &String| state.members.iter().any(|m| m.address == *a);
        let lost: Vec<String> = p.members.iter().chain(p.next.iter().flatten()).filter(|a| !live(a)).cloned().collect();
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if *nodes != lost {
            *nodes = lost;
            self.version.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Watch {
    /// Reads the placement (failing if etcd cannot be reached or the cluster does not
    /// exist) and starts watching it.
    pub fn start(url: &ClusterUrl) -> Result<Watch> {
        let runtime = runtime()?;
        let (client, follower_client, state) = runtime.block_on(async {
            let mut client = connect(url).await?;
            let state = read_state(&mut client, url).await?;
            state.settings.as_ref().ok_or_else(|| no_such_cluster(url))?;
            let follower_client = connect(url).await?;
            Ok::<_, Error>((client, follower_client, state))
        })?;
        let view = Arc::new(Mutex::new(view_of(&state)));
        let revision = Arc::new(AtomicI64::new(state.placement_revision));
        let lost = Arc::new(LostServers::default());
        lost.publish(&state);
        let (shown, published, gone) = (view.clone(), revision.clone(), lost.clone());
        let publish = move |s: &ClusterState| {
            publish_view(&shown, &published, s);
            gone.publish(s);
            None
        };
        let follower = Follower {
            client: follower_client,
            url: url.clone(),
            on_state: Box::new(publish),
            what: "routing on the last view",
            members: Members::default(),
        };
        runtime.spawn(follower.run());
        Ok(Watch { runtime, url: url.clone(), client, view, revision, lost })
    }

    /// Reads the placement from etcd now, not waiting for the watch: for a caller a server
    /// told that the view changed.
    pub fn refresh(&self) -> Result<()> {
        let mut client = self.client.clone();
        let state = self.runtime.block_on(read_state(&mut client, &self.url))?;
        publish_view(&self.view, &self.revision, &state);
        self.lost.publish(&state);
        Ok(())
    }

    /// The servers of the placement whose lease lapsed, kept up to date.
    pub fn lost(&self) -> Arc<LostServers> {
        self.lost.clone()
    }

    /// The revision of the newest view.
    pub fn revision(&self) -> i64 {
        self.revision.load(Ordering::Acquire)
    }

    pub fn view(&self) -> View {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn url(&self) -> &ClusterUrl {
        &self.url
    }
}

/// Makes `state`'s placement the view, if it is newer than the one shown.
fn publish_view(view: &Mutex<View>, revision: &AtomicI64, state: &ClusterState) {
    if state.placement.is_none() && state.placement_revision != 0 {
        return; // unreadable: routes on the last good view until a server writes it back
    }
    let fresh = view_of(state);
    let mut current = view.lock().unwrap_or_else(|e| e.into_inner());
    if *current != fresh && fresh.revision >= current.revision {
        *current = fresh;
        drop(current);
        revision.store(state.placement_revision, Ordering::Release);
    }
}

fn view_of(state: &ClusterState) -> View {
    View { revision: state.placement_revision, placement: state.placement.clone().unwrap_or_default() }
}

/// What a follower does with each state it reads; a placement it returns is proposed.
type OnState = Box<dyn FnMut(&ClusterState) -> Option<Placement> + Send>;

/// Follows a cluster's state: watches its prefix and reads the whole state again after
/// each change (a handful of keys), so that what it hands on is always one etcd
/// revision's; proposes the placements its handler says are due.
struct Follower {
    client: etcd_client::Client,
    url: ClusterUrl,
    on_state: OnState,
    /// What goes on while etcd is unreachable, for the log.
    what: &'static str,
    members: Members,
}

/// Which servers are live: those whose lease is. A record in etcd is taken when it is
/// under a lease and (for servers, who hold the cluster's secret) its seal holds for that
/// lease; others are ignored, with one warning each. A record that went (deleted, or
/// rewritten off its lease or seal) while the lease of the one last taken lives still
/// counts, as that record: whoever may write to etcd cannot take a live server out of
/// the placement, and the server puts its record back.
#[derive(Default)]
struct Members {
    secret: Option<ClusterSecret>,
    /// The records last taken, by address.
    taken: BTreeMap<String, Member>,
    warned: std::collections::HashSet<(String, i64, String)>,
}

impl Members {
    fn checked_with(secret: ClusterSecret) -> Members {
        Members { secret: Some(secret), ..Default::default() }
    }

    /// Replaces `state.members` with the live servers' records.
    async fn settle(&mut self, client: &mut etcd_client::Client, state: &mut ClusterState) {
        let mut live: BTreeMap<String, Member> = BTreeMap::new();
        for m in std::mem::take(&mut state.members) {
            let why = match &self.secret {
                Some(secret) => m.distrust(secret),
                None => (m.lease == 0).then_some("it is attached to no lease"),
            };
            match why {
                None => drop(live.insert(m.address.clone(), m)),
                Some(why) => {
                    if self.warned.insert((m.address.clone(), m.lease, m.seal.clone())) {
                        warn!("cluster: ignoring the member record of {} in etcd: {why}", m.address);
                    }
                }
            }
        }
        for (address, m) in &self.taken {
            if live.contains_key(address) {
                continue;
            }
            let lives = client.lease_time_to_live(m.lease, None).await.is_ok_and(|r| r.ttl() > 0);
            if lives {
                live.insert(address.clone(), m.clone());
                state.stood_in.push(address.clone());
            }
        }
        state.members = live.values().cloned().collect();
        self.taken = live;
    }
}

impl Follower {
    async fn run(mut self) {
        let mut warned = false;
        loop {
            let failure = self.follow().await;
            if !warned {
                warn!("cluster {}: etcd unreachable ({}); {}", self.url, failure.message, self.what);
                warned = true;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            if let Ok(client) = connect(&self.url).await {
                self.client = client;
            }
        }
    }

    /// Reads the state and hands it on, proposing what is due, until it reads a state
    /// that asks for nothing more; returns the revision read.
    async fn settle(&mut self) -> Result<i64> {
        loop {
            let mut state = read_state(&mut self.client, &self.url).await?;
            self.members.settle(&mut self.client, &mut state).await;
            match (self.on_state)(&state) {
                Some(proposed) => {
                    if state.placement.is_none() && state.placement_revision != 0 {
                        // Writing back over a placement someone made unreadable: not in a
                        // tight loop if they keep at it.
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    propose(&mut self.client, &self.url, &state, &proposed).await?;
                }
                None => return Ok(state.revision),
            }
        }
    }

    async fn follow(&mut self) -> Error {
        let revision = match self.settle().await {
            Ok(r) => r,
            Err(e) => return e,
        };
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let (_watcher, mut events) = match self.client.watch(self.url.prefix(), Some(options)).await {
            Ok(w) => w,
            Err(e) => return etcd_error(&self.url, "cannot watch the cluster", e),
        };
        loop {
            match events.message().await {
                Ok(Some(reply)) if reply.canceled() => return etcd_error(&self.url, "watch", "canceled"),
                Ok(Some(reply)) if reply.events().is_empty() => {}
                Ok(Some(_)) => {
                    if let Err(e) = self.settle().await {
                        return e;
                    }
                }
                Ok(None) => return etcd_error(&self.url, "watch", "stream ended"),
                Err(e) => return etcd_error(&self.url, "watch", e),
            }
        }
    }
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
