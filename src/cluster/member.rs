//! A server's membership of a cluster, as one library type ([`ClusterMember`]): its
//! registration in etcd (lease, following the placement), its mover, a drain when asked,
//! and its leave. `rdram serve --cluster` runs it; a server embedded in another program
//! runs it alike, beside its [`crate::server::Server`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::mover::{Mover, MoverConfig};
use super::{ClusterUrl, Member, Registration, ServerRole};
use crate::auth::ClusterSecret;
use crate::error::{Error, Result, Status};
use crate::server::{Server, ServerConfig, ServerInfo};

/// How a server joins a cluster.
#[derive(Clone)]
pub struct MemberConfig {
    pub url: ClusterUrl,
    /// The lease its registration lives under (it drops out of the set when it lapses).
    pub lease_ttl: Duration,
    /// The secret the cluster's servers share (clients never see it).
    pub secret: ClusterSecret,
    /// The cluster's token, which its servers present to each other as clients
    /// ([`ClusterMember::start_server`] takes the server's).
    pub auth_token: Option<String>,
    /// Bytes per second the mover hands over at most (0: no bound).
    pub rebalance_rate: u64,
}

/// A server's membership of a cluster (see the module's doc).
pub struct ClusterMember {
    registration: Arc<Registration>,
    /// Taken by [`ClusterMember::leave`].
    mover: std::sync::Mutex<Option<Mover>>,
    me: String,
}

/// How a drain ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    /// Every key is on the other servers.
    HandedOver(Duration),
    /// No other server could take the keys: leaving with them.
    NoOneToTakeThem,
    /// Given up on by the caller.
    GivenUp,
}

impl ClusterMember {
    /// Starts a server that is a member of the cluster: the server, with its cluster role
    /// and the cluster's secret, then its membership. A server that cannot join is
    /// stopped again. How `rdram serve`, `rdram_server_start` and Python's `Server` join.
    pub fn start_server(cfg: ServerConfig, mut member: MemberConfig) -> Result<(Server, ClusterMember)> {
        let role = Arc::new(ServerRole::default());
        member.auth_token = cfg.auth_token.clone();
        let cfg = ServerConfig { cluster_role: Some(role.clone()), cluster_secret: Some(member.secret.clone()), ..cfg };
        let server = Server::start(cfg)?;
        match ClusterMember::join(server.info(), role, member) {
            Ok(m) => Ok((server, m)),
            Err(e) => {
                server.stop();
                Err(e)
            }
        }
    }

    /// Registers the server `info` describes (started with `role` as its
    /// [`crate::server::ServerConfig::cluster_role`]) in the cluster, and starts its mover.
    pub fn join(info: &ServerInfo, role: Arc<ServerRole>, cfg: MemberConfig) -> Result<ClusterMember> {
        let member = Member {
            address: info.address.clone(),
            shards: info.shards,
            transport: info.transport.clone(),
            capacity_bytes: info.bytes_per_shard * info.shards as u64,
            ..Default::default()
        };
        if info.address.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_unspecified()) {
            return Err(Error::new(
                Status::Invalid,
                "a cluster member needs a listen address that clients can reach, not 0.0.0.0",
            ));
        }
        let me = member.address.clone();
        let registration = Registration::join(&cfg.url, member, cfg.lease_ttl, role.clone(), cfg.secret.clone())
            .map_err(|e| Error::new(e.status, format!("cannot join cluster {}: {}", cfg.url, e.message)))?;
        let registration = Arc::new(registration);
        let mover_cfg = MoverConfig {
            me: me.clone(),
            auth_token: cfg.auth_token,
            cluster_secret: cfg.secret,
            rate: cfg.rebalance_rate,
        };
        let mover = Mover::start(role, registration.clone(), mover_cfg);
        Ok(ClusterMember { registration, mover: std::sync::Mutex::new(Some(mover)), me })
    }

    /// Whether `rdram cluster drain` asked this server to drain.
    pub fn drain_asked(&self) -> bool {
        self.registration.state().drains.contains(&self.me)
    }

    /// A graceful leave's first half: marks this server as draining, so that the next
    /// placement leaves it out and its mover hands every key over, and returns once the
    /// placement no longer has it, at once when no other server could take the keys, or
    /// when `give_up` (asked every 100 ms) says so.
    pub fn drain(&self, mut give_up: impl FnMut() -> bool) -> Result<Drained> {
        self.registration.start_draining()?;
        info!("draining: handing every key over before leaving");
        let started = Instant::now();
        loop {
            if give_up() {
                warn!("drain given up: leaving without waiting for the handover");
                return Ok(Drained::GivenUp);
            }
            let state = self.registration.state();
            let placed_here = state
                .placement
                .as_ref()
                .is_some_and(|p| p.members.iter().chain(p.next.iter().flatten()).any(|m| *m == self.me));
            if !placed_here {
                return Ok(Drained::HandedOver(started.elapsed()));
            }
            if !state.members.iter().any(|m| m.address != self.me && !m.draining) {
                return Ok(Drained::NoOneToTakeThem);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// [`ClusterMember::drain`] for at most `timeout`: how long the handover took;
    /// `Unavailable` when no other server can take the keys; `Timeout` once `timeout`
    /// passed (the handover goes on until the leave).
    pub fn drain_within(&self, timeout: Duration) -> Result<Duration> {
        let until = Instant::now() + timeout;
        match self.drain(|| Instant::now() >= until)? {
            Drained::HandedOver(took) => Ok(took),
            Drained::NoOneToTakeThem => {
                Err(Error::new(Status::Unavailable, "no other server of the cluster can take this server's keys"))
            }
            Drained::GivenUp => Err(Error::new(
                Status::Timeout,
                format!("the keys were not handed over within {} ms", timeout.as_millis()),
            )),
        }
    }

    /// Stops the mover and leaves the member set (clients stop routing here); the server
    /// itself is stopped after.
    /// Leaving twice is leaving once.
    pub fn leave(&self) {
        if let Some(mover) = self.mover.lock().unwrap_or_else(|e| e.into_inner()).take() {
            mover.stop();
        }
        self.registration.leave();
    }
}
