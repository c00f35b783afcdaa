//! The cluster's etcd client side: connecting (credentials, TLS), reading a cluster's
//! state at one revision, and proposing a placement in a transaction.

use super::store::Kv;
use super::tunables::{ETCD_CALL_TIMEOUT, ETCD_RETRY_PAUSE};
use super::*;

pub(super) fn etcd_error(url: &ClusterUrl, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(Status::Unavailable, format!("etcd at {}: {what}: {e}", url.endpoints.join(",")))
}

/// A runtime of one thread for etcd's gRPC client, driven from synchronous code with
/// `block_on` and running background tasks (keep-alives, watches) meanwhile.
pub(super) fn runtime() -> Result<tokio::runtime::Runtime> {
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
pub(super) fn file_named_by(env: &str, what: &str) -> Result<Option<(String, String)>> {
    let Some(path) = std::env::var_os(env) else { return Ok(None) };
    let shown = std::path::Path::new(&path).display().to_string();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::new(Status::Invalid, format!("{what} {shown} ({env}): {e}")))?;
    Ok(Some((text, shown)))
}

/// Warns when a secret's file can be read by others than its owner.
pub(super) fn warn_if_shared(shown: &str, what: &str) {
    if std::fs::metadata(shown).is_ok_and(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o077 != 0) {
        warn!("{what} {shown} is readable by others than its owner");
    }
}

/// The etcd user and password [`CREDENTIALS_FILE_ENV`] names, if it is set.
pub(super) fn credentials() -> Result<Option<(String, String)>> {
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
pub(super) fn tls() -> Result<Option<etcd_client::TlsOptions>> {
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

/// A process's one connection to a cluster's etcd, which all its tasks share (a member's
/// keep-alive, its follower and its own writes; a client's watch and refreshes): handles
/// on one gRPC channel. A task whose call failed dials anew ([`Connection::replace`]); the
/// others take the new connection at their next call, and a watch moves over at once
/// ([`Connection::replaced_since`]), since a stream on a connection that a partition cut
/// without a word would wait for good.
#[derive(Clone)]
pub(super) struct Connection {
    url: ClusterUrl,
    /// The connection now, and its number (one more at each replacement).
    current: Arc<Mutex<(u64, etcd_client::Client)>>,
    /// Its number, for tasks waiting on a replacement.
    number: tokio::sync::watch::Sender<u64>,
    /// Held while dialing, so that tasks that failed together dial once; holds the last
    /// dial's failure, which tasks that waited for it take instead of dialing again.
    dialing: Arc<tokio::sync::Mutex<Option<(std::time::Instant, Error)>>>,
}

impl Connection {
    pub(super) async fn open(url: &ClusterUrl) -> Result<Connection> {
        let client = connect(url).await?;
        Ok(Connection {
            url: url.clone(),
            current: Arc::new(Mutex::new((0, client))),
            number: tokio::sync::watch::Sender::new(0),
            dialing: Arc::new(tokio::sync::Mutex::new(None)),
        })
    }

    /// A handle on the connection now, and its number.
    pub(super) fn client(&self) -> (u64, etcd_client::Client) {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Dials etcd anew after a call on connection `failed` failed, unless another task
    /// did already (or failed to within [`ETCD_RETRY_PAUSE`]: a dial into a partition
    /// waits out its timeout, and the tasks behind it do not wait out one each); returns
    /// the connection now.
    pub(super) async fn replace(&self, failed: u64) -> Result<(u64, etcd_client::Client)> {
        let mut last_failure = self.dialing.lock().await;
        let now = self.client();
        if now.0 != failed {
            return Ok(now);
        }
        if let Some((at, e)) = &*last_failure {
            if at.elapsed() < ETCD_RETRY_PAUSE {
                return Err(e.clone());
            }
        }
        match connect(&self.url).await {
            Ok(client) => {
                *last_failure = None;
                let replaced = (failed + 1, client);
                *self.current.lock().unwrap_or_else(|e| e.into_inner()) = replaced.clone();
                self.number.send_replace(replaced.0);
                Ok(replaced)
            }
            Err(e) => {
                *last_failure = Some((std::time::Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Resolves once connection `seen` has been replaced.
    pub(super) async fn replaced_since(&self, seen: u64) {
        let mut number = self.number.subscribe();
        // The sender lives as long as `self`, so the wait ends only at a replacement.
        let _ = number.wait_for(|n| *n != seen).await;
    }
}

pub(super) async fn connect(url: &ClusterUrl) -> Result<etcd_client::Client> {
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

pub(super) async fn read_settings(client: &mut etcd_client::Client, url: &ClusterUrl) -> Result<Option<Settings>> {
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
pub(super) async fn read_state(kv: &mut impl Kv, url: &ClusterUrl) -> Result<ClusterState> {
    let prefix = url.prefix();
    let (revision, entries) = kv.range(&prefix).await.map_err(|e| etcd_error(url, "cannot read the cluster", e))?;
    let mut state = ClusterState { revision, ..Default::default() };
    for kv in entries {
        let Some(name) = kv.key.strip_prefix(prefix.as_str()) else { continue };
        let value = kv.value.as_slice();
        if name == "config" {
            state.settings = serde_json::from_slice(value).ok();
        } else if name == "placement" {
            state.placement_revision = kv.mod_revision;
            match serde_json::from_slice::<Placement>(value).map_err(|e| e.to_string()).and_then(valid_placement) {
                Ok(p) => state.placement = Some(p),
                Err(why) => state.placement_unreadable = Some(why),
            }
        } else if let Some(address) = name.strip_prefix("members/") {
            if let Ok(m) = serde_json::from_slice::<Member>(value) {
                // A record is its own key's: one filed under another name is ignored.
                if m.address == address {
                    state.members.push(Member { lease: kv.lease, ..m });
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
pub(super) async fn propose(
    kv: &mut impl Kv,
    url: &ClusterUrl,
    state: &ClusterState,
    proposed: &Placement,
) -> Result<bool> {
    let value = serde_json::to_vec(proposed).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
    let done = kv
        .put_if_unchanged(&url.placement_key(), state.placement_revision, value)
        .await
        .map_err(|e| etcd_error(url, "cannot write the placement", e))?;
    if done {
        match &proposed.next {
            Some(next) => {
                info!("cluster {url}: view {}: keys move from {:?} to {:?}", proposed.epoch, proposed.members, next)
            }
            None => info!("cluster {url}: view {} placed on {:?}", proposed.epoch, proposed.members),
        }
    }
    Ok(done)
}
