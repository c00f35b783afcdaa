//! Clusters whose membership lives in etcd: `etcd://HOST:PORT[,HOST:PORT…]/NAME`.
//!
//! etcd holds, under `/remote_dram/NAME/`:
//! - `config`: the cluster's settings ([`Settings`]), written once by `rdram cluster create`;
//! - `members/ADDRESS`: one key per live server ([`Member`]), attached to that server's
//!   lease, so that a server that dies (or is cut off from etcd) drops out of the set when
//!   its lease expires, and one that stops revokes it at once.
//!
//! A server keeps its lease alive from a thread of its own ([`Registration`]); clients and
//! tools read the member set and watch it ([`Watch`]). The request path never talks to
//! etcd: a client routes on the view it holds and learns of a new one by an atomic load.
//! etcd's leases and watches are the whole protocol; nothing here votes or elects.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::error::{Error, Result, Status};

/// How long one etcd call may take before it counts as etcd being unreachable.
const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to reach etcd again after it failed.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
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
        let bad = |why: &str| Error::new(Status::Invalid, format!("cluster address {s:?}: {why} (expected etcd://HOST:PORT[,HOST:PORT...]/NAME)"));
        let (hosts, name) = rest.split_once('/').ok_or_else(|| bad("no cluster name"))?;
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(bad("the name must be letters, digits, '-', '_' or '.'"));
        }
        let endpoints: Vec<String> = hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("http://{h}")).collect();
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

/// What a live server publishes about itself.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Member {
    /// Its bootstrap address: what clients connect to, and the node name keys hash over.
    pub address: String,
    pub shards: usize,
    pub transport: String,
    pub capacity_bytes: u64,
}

/// The member set at one etcd revision, members in address order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    pub revision: i64,
    pub members: Vec<Member>,
}

impl View {
    pub fn addresses(&self) -> Vec<String> {
        self.members.iter().map(|m| m.address.clone()).collect()
    }
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

async fn connect(url: &ClusterUrl) -> Result<etcd_client::Client> {
    let options = etcd_client::ConnectOptions::new().with_connect_timeout(ETCD_CALL_TIMEOUT).with_timeout(ETCD_CALL_TIMEOUT);
    etcd_client::Client::connect(url.endpoints.clone(), Some(options)).await.map_err(|e| etcd_error(url, "cannot connect", e))
}

async fn read_settings(client: &mut etcd_client::Client, url: &ClusterUrl) -> Result<Option<Settings>> {
    let got = client.get(url.config_key(), None).await.map_err(|e| etcd_error(url, "cannot read the cluster's settings", e))?;
    match got.kvs().first() {
        None => Ok(None),
        Some(kv) => serde_json::from_slice(kv.value())
            .map(Some)
            .map_err(|e| Error::new(Status::Invalid, format!("cluster {}: its settings in etcd are not ours: {e}", url.name))),
    }
}

async fn read_view(client: &mut etcd_client::Client, url: &ClusterUrl) -> Result<View> {
    let got = client
        .get(url.members_prefix(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| etcd_error(url, "cannot read the members", e))?;
    let revision = got.header().map_or(0, |h| h.revision());
    let mut members: Vec<Member> = got.kvs().iter().filter_map(|kv| serde_json::from_slice(kv.value()).ok()).collect();
    members.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(View { revision, members })
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
        let txn = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(key, value, None)]);
        let done = client.txn(txn).await.map_err(|e| etcd_error(url, "cannot write the cluster's settings", e))?;
        if done.succeeded() {
            return Ok(());
        }
        let existing = read_settings(&mut client, url).await?.map_or_else(|| "unknown settings".into(), |s| format!("{} replicas", s.replicas));
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
}

/// Reads a cluster's settings and members.
pub fn status(url: &ClusterUrl) -> Result<ClusterStatus> {
    runtime()?.block_on(async {
        let mut client = connect(url).await?;
        let settings = read_settings(&mut client, url).await?.ok_or_else(|| no_such_cluster(url))?;
        let view = read_view(&mut client, url).await?;
        Ok(ClusterStatus { cluster: url.to_string(), replicas: settings.replicas, revision: view.revision, members: view.members })
    })
}

fn no_such_cluster(url: &ClusterUrl) -> Error {
    Error::new(Status::Invalid, format!("cluster {} does not exist in etcd: create it with `rdram cluster create {url}`", url.name))
}

/// A server's membership: its key under a lease that a background task keeps alive. The
/// lease is revoked (the server leaves the view at once) by [`Registration::leave`] or on
/// drop; if the process dies, the lease expires after its TTL.
pub struct Registration {
    runtime: Option<tokio::runtime::Runtime>,
    url: ClusterUrl,
    lease: Arc<AtomicI64>,
    /// Whether the last exchange with etcd succeeded (for logs and metrics).
    pub etcd_reachable: Arc<AtomicBool>,
}

impl Registration {
    /// Registers `member` in the cluster under a lease of `ttl`. Fails, saying why, when
    /// etcd cannot be reached or the cluster was not created.
    pub fn join(url: &ClusterUrl, member: Member, ttl: Duration) -> Result<Registration> {
        let ttl_secs = ttl.as_secs().max(1) as i64;
        let runtime = runtime()?;
        let value = serde_json::to_vec(&member).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        let key = url.members_prefix() + &member.address;
        let lease = Arc::new(AtomicI64::new(0));
        let etcd_reachable = Arc::new(AtomicBool::new(true));
        let client = runtime.block_on(async {
            let mut client = connect(url).await?;
            read_settings(&mut client, url).await?.ok_or_else(|| no_such_cluster(url))?;
            let id = register(&mut client, url, &key, &value, ttl_secs).await?;
            lease.store(id, Ordering::SeqCst);
            Ok::<_, Error>(client)
        })?;
        info!("joined cluster {url} as {} (lease TTL {ttl_secs} s)", member.address);
        let task = KeepAlive { client, url: url.clone(), key, value, ttl_secs, lease: lease.clone(), reachable: etcd_reachable.clone() };
        runtime.spawn(task.run());
        Ok(Registration { runtime: Some(runtime), url: url.clone(), lease, etcd_reachable })
    }

    /// Leaves the cluster now: the lease is revoked, and with it the member key.
    pub fn leave(mut self) {
        self.revoke();
    }

    fn revoke(&mut self) {
        let Some(runtime) = self.runtime.take() else { return };
        let (url, id) = (self.url.clone(), self.lease.load(Ordering::SeqCst));
        let revoked = runtime.block_on(async {
            let mut client = connect(&url).await?;
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

/// Grants a lease of `ttl_secs` and puts the member key under it; returns the lease.
async fn register(client: &mut etcd_client::Client, url: &ClusterUrl, key: &str, value: &[u8], ttl_secs: i64) -> Result<i64> {
    let lease = client.lease_grant(ttl_secs, None).await.map_err(|e| etcd_error(url, "cannot grant a lease", e))?;
    client
        .put(key, value, Some(PutOptions::new().with_lease(lease.id())))
        .await
        .map_err(|e| etcd_error(url, "cannot register this server", e))?;
    Ok(lease.id())
}

/// Keeps a registration's lease alive; registers again under a new lease if the old one
/// expired (etcd was unreachable for longer than the TTL).
struct KeepAlive {
    client: etcd_client::Client,
    url: ClusterUrl,
    key: String,
    value: Vec<u8>,
    ttl_secs: i64,
    lease: Arc<AtomicI64>,
    reachable: Arc<AtomicBool>,
}

impl KeepAlive {
    async fn run(mut self) {
        let every = Duration::from_millis((self.ttl_secs as u64 * 1000 / 3).max(100));
        loop {
            let outcome = self.keep_alive_until_failure(every).await;
            if self.reachable.swap(false, Ordering::SeqCst) {
                warn!("cluster {}: etcd unreachable ({}); serving on, and trying again", self.url, outcome.message);
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            if let Ok(client) = connect(&self.url).await {
                self.client = client;
            }
        }
    }

    /// Sends keep-alives every `every` until one fails; re-registers when the lease is gone.
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
                }
                Ok(Ok(Some(_))) => {
                    // The lease expired while etcd was out of reach: join again.
                    warn!("cluster {}: this server's lease expired; registering again", self.url);
                    return match register(&mut self.client, &self.url, &self.key, &self.value, self.ttl_secs).await {
                        Ok(new) => {
                            self.lease.store(new, Ordering::SeqCst);
                            Error::new(Status::Unavailable, "lease renewed")
                        }
                        Err(e) => e,
                    };
                }
                Ok(Ok(None)) => return etcd_error(&self.url, "keep-alive", "stream ended"),
                Ok(Err(e)) => return etcd_error(&self.url, "keep-alive", e),
                Err(_) => return etcd_error(&self.url, "keep-alive", "no answer in time"),
            }
            tokio::time::sleep(every).await;
        }
    }
}

/// A cluster's member set as etcd says it is now, followed by a background watch.
/// [`Watch::revision`] is one atomic load: callers compare it with the revision of the
/// view they route on.
pub struct Watch {
    _runtime: tokio::runtime::Runtime,
    url: ClusterUrl,
    view: Arc<Mutex<View>>,
    revision: Arc<AtomicI64>,
}

impl Watch {
    /// Reads the member set (failing if etcd cannot be reached or the cluster does not
    /// exist) and starts watching it.
    pub fn start(url: &ClusterUrl) -> Result<Watch> {
        let runtime = runtime()?;
        let (client, view) = runtime.block_on(async {
            let mut client = connect(url).await?;
            read_settings(&mut client, url).await?.ok_or_else(|| no_such_cluster(url))?;
            let view = read_view(&mut client, url).await?;
            Ok::<_, Error>((client, view))
        })?;
        let revision = Arc::new(AtomicI64::new(view.revision));
        let view = Arc::new(Mutex::new(view));
        let follower = Follower { client, url: url.clone(), view: view.clone(), revision: revision.clone() };
        runtime.spawn(follower.run());
        Ok(Watch { _runtime: runtime, url: url.clone(), view, revision })
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

/// Keeps a [`Watch`]'s view current: watches the member keys and reads the whole set again
/// after each change (a handful of keys), so the view is always one etcd revision's.
struct Follower {
    client: etcd_client::Client,
    url: ClusterUrl,
    view: Arc<Mutex<View>>,
    revision: Arc<AtomicI64>,
}

impl Follower {
    async fn run(mut self) {
        let mut warned = false;
        loop {
            let failure = self.follow().await;
            if !warned {
                warn!("cluster {}: etcd unreachable ({}); routing on the last view", self.url, failure.message);
                warned = true;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            if let Ok(client) = connect(&self.url).await {
                self.client = client;
            }
        }
    }

    fn publish(&self, view: View) {
        let revision = view.revision;
        let mut current = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if current.members != view.members || current.revision == 0 {
            *current = view;
            drop(current);
            self.revision.store(revision, Ordering::Release);
        }
    }

    async fn follow(&mut self) -> Error {
        let view = match read_view(&mut self.client, &self.url).await {
            Ok(v) => v,
            Err(e) => return e,
        };
        let from = view.revision + 1;
        self.publish(view);
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        let (_watcher, mut events) = match self.client.watch(self.url.members_prefix(), Some(options)).await {
            Ok(w) => w,
            Err(e) => return etcd_error(&self.url, "cannot watch the members", e),
        };
        loop {
            match events.message().await {
                Ok(Some(reply)) if reply.canceled() => return etcd_error(&self.url, "watch", "canceled"),
                Ok(Some(reply)) if reply.events().is_empty() => {}
                Ok(Some(_)) => match read_view(&mut self.client, &self.url).await {
                    Ok(view) => self.publish(view),
                    Err(e) => return e,
                },
                Ok(None) => return etcd_error(&self.url, "watch", "stream ended"),
                Err(e) => return etcd_error(&self.url, "watch", e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ClusterUrl;

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
