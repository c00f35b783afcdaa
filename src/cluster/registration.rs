//! A server's membership: its registration under a lease, kept alive off the data path,
//! and its own writes to etcd (draining, handover reports, leaving).

use super::etcd::{etcd_error, read_settings, read_state, runtime, Connection};
use super::follower::{Follower, Members};
use super::tunables::{ETCD_CALL_TIMEOUT, ETCD_RETRY_PAUSE, LEASE_CLOCK_TICK, PLACEMENT_WAIT, REJOIN_POLL};
use super::*;

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
    /// This member's one connection to etcd, for its own writes too.
    etcd: Connection,
    /// Whether the last exchange with etcd succeeded (for logs and metrics).
    pub etcd_reachable: Arc<AtomicBool>,
    /// The cluster's state as last read.
    state: Arc<Mutex<ClusterState>>,
    /// The thread that ticks the server's clock for fencing, and what stops it.
    clock: Mutex<Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>>,
}

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
        let etcd = runtime.block_on(async {
            let etcd = Connection::open(url).await?;
            let mut client = etcd.client().1;
            read_settings(&mut client, url).await?.ok_or_else(|| no_such_cluster(url))?;
            let id = register(&mut client, url, &key, &member, &secret, ttl_secs).await?;
            lease.store(id, Ordering::SeqCst);
            Ok::<_, Error>(etcd)
        })?;
        info!("joined cluster {url} as {} (lease TTL {ttl_secs} s)", member.address);
        // Keep-alives go every third of the TTL: a pause of half the TTL cannot outlast
        // the lease; one longer fences the server until etcd confirms it. So does a lease
        // etcd last confirmed two thirds of the TTL ago (two keep-alives unanswered): the
        // lease lapses at etcd no sooner than a TTL after that confirmation, so the server
        // stops serving keys before the cluster can have moved them elsewhere.
        let ttl = Duration::from_secs(ttl_secs as u64);
        role.start_fencing(ttl);
        let ticking = Arc::new(AtomicBool::new(true));
        let clock = {
            let (role, ticking, url) = (role.clone(), ticking.clone(), url.clone());
            std::thread::Builder::new().name("rdram-lease-clock".into()).spawn(move || {
                while ticking.load(Ordering::Relaxed) {
                    if role.tick() {
                        warn!("cluster {url}: this server was paused for longer than half its lease; serving no keys until etcd confirms the lease");
                    }
                    if role.fence_unconfirmed_lease() {
                        warn!("cluster {url}: etcd has not confirmed this server's lease for two thirds of its TTL; serving no keys until it does");
                    }
                    std::thread::sleep(LEASE_CLOCK_TICK);
                }
            })
        }
        .map_err(|e| Error::new(Status::Internal, format!("cannot start the lease clock: {e}")))?;
        let (number, client) = etcd.client();
        let task = KeepAlive {
            etcd: etcd.clone(),
            number,
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
        let judge = role.clone();
        let mut kept: Vec<String> = Vec::new();
        let steward = move |s: &ClusterState| {
            let others: Vec<String> = s.lapsed_in_outage.iter().filter(|a| **a != me).cloned().collect();
            if others != kept {
                kept = others;
                if !kept.is_empty() {
                    warn!("cluster: the lease of {kept:?} lapsed while etcd was out of reach of this server too; they stay members for a lease TTL, to register again");
                }
            }
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
            // The state and who is live first: a new placement wakes the mover at once, and
            // it takes its live members from them (one that read the last state's would
            // count a dead member live, leave its keys to it, and leave them one copy short).
            *seen.lock().unwrap_or_else(|e| e.into_inner()) = s.clone();
            role.set_live(s.members.iter().map(|m| m.address.clone()).collect());
            if let Some(p) = &s.placement {
                let changed = role.current().is_none_or(|c| c.1.placement != *p);
                if changed {
                    role.set(&me, p.clone());
                }
            }
            proposal_of(&me, s)
        };
        let follower = Follower {
            etcd: etcd.clone(),
            url: url.clone(),
            on_state: Box::new(steward),
            what: "serving on the last view",
            members: Members::checked_with(secret.clone()).judging_lapses(Box::new(move || judge.lapses_judged_in())),
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
        let (mut client, secret) = (self.etcd.client().1, self.secret.clone());
        self.block_on(async move { put_record(&mut client, &url, &key, &member, &secret, id).await })
    }

    /// Publishes this server's progress in handing its keys over.
    pub fn report_moves(&self, report: &MoveReport) -> Result<()> {
        let (url, id) = (self.url.clone(), self.lease.load(Ordering::SeqCst));
        let key = url.move_key(&self.address());
        let value = serde_json::to_vec(report).map_err(|e| Error::new(Status::Internal, e.to_string()))?;
        let mut client = self.etcd.client().1;
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
        let mut client = self.etcd.client().1;
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
pub(super) async fn register(
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
pub(super) async fn put_record(
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
        .map_err(|e| etcd_error(url, "cannot write this server's member record", e))?;
    Ok(())
}

/// Grants a lease of `ttl_secs` and puts the member record under it, in a transaction
/// that holds only while `placement_key` was last changed at `revision` (0: it does not
/// exist); the lease, or None when the placement changed (the lease is revoked then).
async fn register_if_unchanged(
    client: &mut etcd_client::Client,
    url: &ClusterUrl,
    (key, member, secret, ttl_secs): (&str, &Member, &ClusterSecret, i64),
    (placement_key, revision): (&str, i64),
) -> Result<Option<i64>> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let lease = client.lease_grant(ttl_secs, None).await.map_err(|e| etcd_error(url, "cannot grant a lease", e))?.id();
    let unchanged = match revision {
        0 => Compare::create_revision(placement_key, CompareOp::Equal, 0),
        revision => Compare::mod_revision(placement_key, CompareOp::Equal, revision),
    };
    let put = TxnOp::put(key, member.sealed(secret, lease), Some(PutOptions::new().with_lease(lease)));
    let txn = Txn::new().when([unchanged]).and_then([put]);
    let done = client.txn(txn).await.map_err(|e| etcd_error(url, "cannot write this server's member record", e))?;
    if done.succeeded() {
        return Ok(Some(lease));
    }
    let _ = client.lease_revoke(lease).await;
    Ok(None)
}

/// Where a placement stands towards a member whose lease lapsed (see
/// [`KeepAlive::register_again`]).
#[derive(Debug, PartialEq, Eq)]
enum Standing {
    /// Named, and no move leaves it out: nothing went on without it.
    Named,
    /// A member whose keys are moving to the others: writes went on without it.
    MovedOff,
    /// Neither a member nor one keys move to: the cluster went on without it.
    LeftOut,
}

impl Standing {
    fn of(me: &str, p: &Placement) -> Standing {
        let named = |list: &[String]| list.iter().any(|m| m == me);
        match (named(&p.members), p.next.as_deref().map(named)) {
            (true, Some(false)) => Standing::MovedOff,
            (false, None | Some(false)) => Standing::LeftOut,
            _ => Standing::Named,
        }
    }
}

/// Keeps a registration's lease alive; registers again under a new lease if the old one
/// expired (etcd was unreachable for longer than the TTL).
pub(super) struct KeepAlive {
    etcd: Connection,
    /// The connection `client` is a handle on.
    number: u64,
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
            tokio::time::sleep(LEASE_CLOCK_TICK).await;
        }
    }

    async fn run(mut self) {
        let every = Duration::from_millis((self.ttl_secs as u64 * 1000 / 3).max(100));
        loop {
            let outcome = self.keep_alive_until_failure(every).await;
            if outcome.status != Status::Ok && self.reachable.swap(false, Ordering::SeqCst) {
                warn!(
                    "cluster {}: etcd unreachable ({}); trying again (keys are served while the lease is confirmed within two thirds of its TTL)",
                    self.url,
                    outcome.message
                );
            }
            tokio::time::sleep(ETCD_RETRY_PAUSE).await;
            if let Ok((number, client)) = self.etcd.replace(self.number).await {
                (self.number, self.client) = (number, client);
                // A lease that lapsed while etcd was out of reach takes no keep-alive
                // stream: etcd answers it "not found", not with a TTL of 0.
                if self.lease_gone().await {
                    warn!("cluster {}: this server's lease expired; registering again", self.url);
                    if let Err(e) = self.register_again().await {
                        warn!("cluster {}: {}", self.url, e.message);
                    }
                }
            }
        }
    }

    /// Whether etcd says this server's lease no longer exists.
    async fn lease_gone(&mut self) -> bool {
        let id = self.lease.load(Ordering::SeqCst);
        match tokio::time::timeout(ETCD_CALL_TIMEOUT, self.client.lease_time_to_live(id, None)).await {
            Ok(Ok(r)) => r.ttl() <= 0,
            Ok(Err(etcd_client::Error::GRpcStatus(s))) => s.code() == tonic::Code::NotFound,
            _ => false,
        }
    }

    /// Registers this server again under a new lease (its old one lapsed). Once its lease
    /// lapsed, the cluster may have taken it for dead and gone on without it: writes that
    /// its keys took meanwhile skipped it, and deletes too. What it does depends on where
    /// the placement stands ([`Standing`]):
    /// - the placement no longer names it: it forgets its copies
    ///   ([`ServerRole::forget_copies`]) before anyone can learn it is back and copy to it,
    ///   and joins as a new member;
    /// - a move that leaves it out is under way: it registers only once that move ended
    ///   (and then forgets), staying fenced meanwhile, so that it serves none of the keys
    ///   it holds as they were before the cluster went on, and copies none out;
    /// - the placement names it and no move leaves it out (an etcd outage the cluster
    ///   waited out): no write skipped it, so it keeps what it holds. It registers in a
    ///   transaction that holds only while the placement is the one it read, so that a
    ///   move leaving it out cannot begin between the read and the registration.
    async fn register_again(&mut self) -> Result<()> {
        let mut waiting = false;
        let new = loop {
            // Read again each time: a drain may have begun while it waited.
            let member = self.record.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let state = read_state(&mut self.client, &self.url).await?;
            let placement = state.placement.as_ref();
            match placement.map_or(Standing::Named, |p| Standing::of(&self.me, p)) {
                Standing::LeftOut => {
                    warn!(
                        "cluster {}: this server's lease lapsed and placement version {} goes on without it: it forgets the copies it held, which the cluster may have written or deleted since, and joins as a new member",
                        self.url,
                        placement.map_or(0, |p| p.version)
                    );
                    self.role.forget_copies();
                    break register(&mut self.client, &self.url, &self.key, &member, &self.secret, self.ttl_secs)
                        .await?;
                }
                Standing::MovedOff => {
                    if !std::mem::replace(&mut waiting, true) {
                        warn!(
                            "cluster {}: this server's lease lapsed and placement version {} moves its keys to the other members; it serves nothing until that move ends, then joins as a new member",
                            self.url,
                            placement.map_or(0, |p| p.version)
                        );
                    }
                    tokio::time::sleep(REJOIN_POLL).await;
                }
                Standing::Named => {
                    let at = state.placement_revision;
                    let registered = register_if_unchanged(
                        &mut self.client,
                        &self.url,
                        (&self.key, &member, &self.secret, self.ttl_secs),
                        (&self.url.placement_key(), at),
                    )
                    .await?;
                    if let Some(lease) = registered {
                        break lease;
                    }
                }
            }
        };
        self.lease.store(new, Ordering::SeqCst);
        self.role.lease_confirmed();
        self.lift_fence().await;
        Ok(())
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
            if self.etcd.client().0 != self.number {
                // Another task replaced the connection: the lease is kept alive on the new
                // one, and the old one goes with its last handle.
                (self.number, self.client) = self.etcd.client();
                (keeper, replies) = match self.client.lease_keep_alive(id).await {
                    Ok(k) => k,
                    Err(e) => return etcd_error(&self.url, "keep-alive", e),
                };
            }
            if let Err(e) = keeper.keep_alive().await {
                return etcd_error(&self.url, "keep-alive", e);
            }
            match tokio::time::timeout(ETCD_CALL_TIMEOUT, replies.message()).await {
                Ok(Ok(Some(reply))) if reply.ttl() > 0 => {
                    self.role.lease_confirmed();
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
                    return match self.register_again().await {
                        Ok(()) => Error::new(Status::Ok, "registered again under a new lease"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lapsed_member_is_moved_off_while_a_move_leaves_it_out_and_left_out_after() {
        let names = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let placement = |members: &[&str], next: Option<&[&str]>| Placement {
            epoch: 1,
            members: names(members),
            next: next.map(names),
            replicas: 2,
            version: 1,
            ..Default::default()
        };
        assert_eq!(Standing::of("b", &placement(&["a", "b", "c"], None)), Standing::Named);
        assert_eq!(Standing::of("b", &placement(&["a", "b", "c"], Some(&["a", "b", "c", "d"]))), Standing::Named);
        assert_eq!(Standing::of("b", &placement(&["a", "b", "c"], Some(&["a", "c"]))), Standing::MovedOff);
        assert_eq!(Standing::of("b", &placement(&["a", "c"], None)), Standing::LeftOut);
        assert_eq!(Standing::of("b", &placement(&["a", "c"], Some(&["a", "c", "d"]))), Standing::LeftOut);
        // A member keys were moving to when its lease lapsed: no write went on without it.
        assert_eq!(Standing::of("b", &placement(&["a", "c"], Some(&["a", "b", "c"]))), Standing::Named);
    }
}
