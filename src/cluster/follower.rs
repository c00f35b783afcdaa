//! Following a cluster's state: a watch on its prefix, the whole state read again after
//! each change, and which members are live.

use super::etcd::{etcd_error, propose, read_state, Connection};
use super::store::Kv;
use super::tunables::{ETCD_RETRY_PAUSE, WARNED_RECORDS};
use super::*;

/// What a follower does with each state it reads; a placement it returns is proposed.
pub(super) type OnState = Box<dyn FnMut(&ClusterState) -> Option<Placement> + Send>;

/// Follows a cluster's state: watches its prefix and reads the whole state again after
/// each change (a handful of keys), so that what it hands on is always one etcd
/// revision's; proposes the placements its handler says are due.
pub(super) struct Follower {
    pub(super) etcd: Connection,
    pub(super) url: ClusterUrl,
    pub(super) on_state: OnState,
    /// What goes on while etcd is unreachable, for the log.
    pub(super) what: &'static str,
    pub(super) members: Members,
}

/// Which servers are live: those whose lease is. A record in etcd is taken when it is
/// under a lease and (for servers, who hold the cluster's secret) its seal holds for that
/// lease; others are ignored, with one warning each. A record that went (deleted, or
/// rewritten off its lease or seal) while the lease of the one last taken lives still
/// counts, as that record: whoever may write to etcd cannot take a live server out of
/// the placement, and the server puts its record back. A server's follower also keeps a
/// member whose lease lapsed while its own judge says lapses may be etcd's outage rather
/// than deaths ([`ServerRole::lapses_judged_in`]), and reads the state again once they
/// are not.
#[derive(Default)]
pub(super) struct Members {
    secret: Option<ClusterSecret>,
    /// The records last taken, by address.
    taken: BTreeMap<String, Member>,
    warned: std::collections::HashSet<(String, i64, String)>,
    judge: Option<LapseJudge>,
    /// When the state is to be read again: members are kept past their lease until then.
    recheck: Option<Duration>,
}

/// How long until a lapsed lease may be taken for its member's death (None: now).
pub(super) type LapseJudge = Box<dyn Fn() -> Option<Duration> + Send>;

impl Members {
    pub(super) fn checked_with(secret: ClusterSecret) -> Members {
        Members { secret: Some(secret), ..Default::default() }
    }

    /// Keeps members whose lease lapsed while `judge` says lapses are not yet deaths.
    pub(super) fn judging_lapses(self, judge: LapseJudge) -> Members {
        Members { judge: Some(judge), ..self }
    }

    /// When the last [`Members::settle`] kept a member past its lease: how soon to read
    /// the state again.
    pub(super) fn recheck(&self) -> Option<Duration> {
        self.recheck
    }

    /// Replaces `state.members` with the live servers' records.
    pub(super) async fn settle(&mut self, kv: &mut impl Kv, state: &mut ClusterState) {
        let mut live: BTreeMap<String, Member> = BTreeMap::new();
        for m in std::mem::take(&mut state.members) {
            let why = match &self.secret {
                Some(secret) => m.distrust(secret),
                None => (m.lease == 0).then_some("it is attached to no lease"),
            };
            match why {
                None => drop(live.insert(m.address.clone(), m)),
                Some(why) => {
                    if self.warned.len() >= WARNED_RECORDS {
                        // Whoever writes etcd could make up records without end: forget, and
                        // perhaps warn again, rather than grow.
                        self.warned.clear();
                    }
                    if self.warned.insert((m.address.clone(), m.lease, m.seal.clone())) {
                        warn!("cluster: ignoring the member record of {} in etcd: {why}", m.address);
                    }
                }
            }
        }
        self.recheck = None;
        for (address, m) in &self.taken {
            if live.contains_key(address) {
                continue;
            }
            if kv.lease_lives(m.lease).await {
                live.insert(address.clone(), m.clone());
                state.stood_in.push(address.clone());
            } else if let Some(wait) = self.judge.as_ref().and_then(|judge| judge()) {
                live.insert(address.clone(), m.clone());
                state.lapsed_in_outage.push(address.clone());
                self.recheck = Some(wait);
            }
        }
        state.members = live.values().cloned().collect();
        self.taken = live;
    }
}

/// Why a follower stopped following.
enum Stopped {
    /// A call failed: etcd is out of reach, or the connection is.
    Failed(Error),
    /// Another task of this process replaced the connection: follow on the new one.
    Replaced,
}

impl Follower {
    pub(super) async fn run(mut self) {
        let mut warned = false;
        let (mut number, mut client) = self.etcd.client();
        loop {
            match self.follow(number, &mut client).await {
                Stopped::Replaced => {}
                Stopped::Failed(failure) => {
                    if !warned {
                        warn!("cluster {}: etcd unreachable ({}); {}", self.url, failure.message, self.what);
                        warned = true;
                    }
                    tokio::time::sleep(ETCD_RETRY_PAUSE).await;
                    let _ = self.etcd.replace(number).await;
                }
            }
            (number, client) = self.etcd.client();
        }
    }

    /// Reads the state and watches for changes on connection `number`, until a call fails
    /// or the connection is replaced.
    async fn follow(&mut self, number: u64, client: &mut etcd_client::Client) -> Stopped {
        let revision = match settle(client, &self.url, &mut self.members, &mut self.on_state).await {
            Ok(r) => r,
            Err(e) => return Stopped::Failed(e),
        };
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let (_watcher, mut events) = match client.watch(self.url.prefix(), Some(options)).await {
            Ok(w) => w,
            Err(e) => return Stopped::Failed(etcd_error(&self.url, "cannot watch the cluster", e)),
        };
        let etcd = self.etcd.clone();
        let replaced = etcd.replaced_since(number);
        tokio::pin!(replaced);
        loop {
            let recheck = self.members.recheck();
            // Whether the state must be read again (a change, or a member kept past its
            // lease whose hold ended), or why the watch ended.
            let read_again = tokio::select! {
                event = events.message() => match event {
                    Ok(Some(reply)) if reply.canceled() => Err(etcd_error(&self.url, "watch", "canceled")),
                    Ok(Some(reply)) => Ok(!reply.events().is_empty()),
                    Ok(None) => Err(etcd_error(&self.url, "watch", "stream ended")),
                    Err(e) => Err(etcd_error(&self.url, "watch", e)),
                },
                () = &mut replaced => return Stopped::Replaced,
                () = tokio::time::sleep(recheck.unwrap_or_default()), if recheck.is_some() => Ok(true),
            };
            match read_again {
                Ok(false) => {}
                Ok(true) => {
                    if let Err(e) = settle(client, &self.url, &mut self.members, &mut self.on_state).await {
                        return Stopped::Failed(e);
                    }
                }
                Err(e) => return Stopped::Failed(e),
            }
        }
    }
}

/// Reads the state and hands it on, proposing what is due, until it reads a state that
/// asks for nothing more; returns the revision read. Of followers proposing at once, one
/// proposal holds and the others read it on their next turn.
pub(super) async fn settle(
    kv: &mut impl Kv,
    url: &ClusterUrl,
    members: &mut Members,
    on_state: &mut OnState,
) -> Result<i64> {
    loop {
        let mut state = read_state(kv, url).await?;
        members.settle(kv, &mut state).await;
        match on_state(&state) {
            Some(proposed) => {
                if state.placement.is_none() && state.placement_revision != 0 {
                    // Writing back over a placement someone made unreadable: not in a tight
                    // loop if they keep at it.
                    tokio::time::sleep(ETCD_RETRY_PAUSE).await;
                }
                propose(kv, url, &state, &proposed).await?;
            }
            None => return Ok(state.revision),
        }
    }
}
