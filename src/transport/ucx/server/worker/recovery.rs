//! Recovery and recycling: a stuck receive queue or too many stranded endpoints retire
//! the UCX worker; a fresh one (prepared ahead on a helper thread) takes its place, and the
//! retired one is destroyed once nothing is in flight on it.

use super::*;

impl ShardWorker {
    /// Probes the receive queue and replaces a stuck worker; hands out a fresh worker once
    /// too many endpoints are stranded on the current one; destroys retired workers once
    /// nothing is in flight and their time has come (see [`ShardWorker::retirement_over`]).
    ///
    /// Returns the retired workers to destroy, which the caller drops with no reference into
    /// this ShardWorker live (destroying a worker may run its callbacks), then passes to
    /// [`ShardWorker::reclaim_orphans`].
    #[must_use]
    pub(super) fn watch_queue(&mut self, idle: bool) -> Vec<Retired> {
        let now = Instant::now();
        self.prepare_spare();
        if self.probe.tick(self.probe_seen, idle, now) {
            if let Err(e) = self.replace_worker(Retirement::Stuck) {
                self.service.metrics().worker_replacement_failed();
                warn!("shard {}: could not replace a stuck worker: {}", self.service.index(), e.message);
            }
        } else if (self.stranded >= self.stranded_limit || self.idle_with_stranded(now))
            && self.recycle_retry.ready(now)
        {
            match self.replace_worker(Retirement::Recycled) {
                Ok(()) => self.recycle_retry.succeeded(),
                Err(e) => {
                    self.service.metrics().worker_replacement_failed();
                    let again = self.recycle_retry.failed(now);
                    warn!(
                        "shard {}: could not start a fresh worker ({}); trying again in {again:?}",
                        self.service.index(),
                        e.message
                    );
                }
            }
        }
        if !self.retired.is_empty() {
            let over: Vec<bool> = self.retired.iter().map(|r| self.retirement_over(r, now)).collect();
            let mut over = over.into_iter();
            let (gone, kept): (Vec<Retired>, Vec<Retired>) =
                std::mem::take(&mut self.retired).into_iter().partition(|_| over.next() == Some(true));
            self.retired = kept;
            for r in &gone {
                debug!("shard {}: {:?} worker {} destroyed", self.service.index(), r.why, r.incarnation);
                self.reply_eps.forget_incarnation(r.incarnation);
            }
            return gone;
        }
        Vec::new()
    }

    /// Whether endpoints have been stranded on the current worker for a while and no client
    /// is left to serve: then recycling disturbs no one. Not while an earlier worker is
    /// still retiring, so that clients that come and go one at a time keep at most two
    /// workers alive.
    pub(super) fn idle_with_stranded(&self, now: Instant) -> bool {
        self.retired.is_empty()
            && self.stranded_since.is_some_and(|since| now.duration_since(since) >= IDLE_RECYCLE_AFTER)
            && self.service.live_clients().next().is_none()
    }

    /// Frees the replies to departed clients that worker `incarnation` still had in flight
    /// when it was destroyed without ending them (their callbacks will never come).
    pub(super) fn reclaim_orphans(&mut self, incarnation: u64) {
        let left: Vec<usize> = self.orphans.iter().filter(|&(_, &g)| g == incarnation).map(|(&m, _)| m).collect();
        for m in left {
            self.orphans.remove(&m);
            // SAFETY: an orphan's box is owned by its send until the callback, which never
            // comes now that the worker is destroyed; reclaimed once (removed just above).
            self.finish_reply(unsafe { Box::from_raw(m as *mut ReplyMsg) });
        }
    }

    /// Whether a retired worker may be destroyed (with nothing in flight). One that was
    /// stuck goes after [`UCX_RETIRED_GRACE`]. One that was recycled serves its clients until
    /// the last has left, but at most [`MAX_RECYCLED`] of them wait for that: beyond, the
    /// oldest goes, and all clients are told to reconnect (as for a stuck worker). A worker
    /// is destroyed only with nothing of ours in flight on it.
    pub(super) fn retirement_over(&self, r: &Retired, now: Instant) -> bool {
        if now.duration_since(r.since) < UCX_RETIRED_GRACE || self.in_flight_on(r.incarnation) {
            return false;
        }
        match r.why {
            Retirement::Stuck => true,
            Retirement::Recycled => {
                let waited_for = |c: &u64| self.service.is_live(*c) && !self.reply_eps.knows(*c);
                if !self.reply_eps.serves(r.incarnation) && !r.unheard.iter().any(waited_for) {
                    return true;
                }
                let newer_waiting = self
                    .retired
                    .iter()
                    .filter(|o| {
                        o.why == Retirement::Recycled
                            && o.incarnation > r.incarnation
                            && self.reply_eps.serves(o.incarnation)
                    })
                    .count();
                if newer_waiting >= MAX_RECYCLED {
                    warn!(
                        "shard {}: clients of a recycled worker told to reconnect ({} recycled workers kept at most)",
                        self.service.index(),
                        MAX_RECYCLED
                    );
                    self.address.tell_moved();
                    return true;
                }
                false
            }
        }
    }

    /// Starts a fresh worker on a helper thread once the current one is three quarters of
    /// the way to its stranded limit, so that recycling does not stall the shard for the
    /// 10-30 ms a UCX context takes to start (a worker is used by one thread at a time,
    /// not necessarily the one that made it).
    pub(super) fn prepare_spare(&mut self) {
        if self.spare.is_some() || self.stranded * 4 < self.stranded_limit * 3 {
            return;
        }
        let tcp = self.tcp.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rdram-spare-{}", self.service.index()))
            .spawn(move || Worker::serving(&tcp));
        match spawned {
            Ok(thread) => self.spare = Some(thread),
            Err(e) => debug!(
                "shard {}: no helper thread for a spare worker ({e}); it will start on the shard's",
                self.service.index()
            ),
        }
    }

    /// The spare worker (waiting for the rest of its start if need be: less than starting
    /// another), else a new one started here.
    pub(super) fn take_fresh_worker(&mut self) -> Result<Worker> {
        match self.spare.take().map(|thread| thread.join()) {
            Some(Ok(Ok(worker))) => Ok(worker),
            Some(Ok(Err(e))) => {
                debug!(
                    "shard {}: the spare worker did not start ({}); starting one here",
                    self.service.index(),
                    e.message
                );
                Worker::serving(&self.tcp)
            }
            _ => Worker::serving(&self.tcp),
        }
    }

    /// Replaces the current UCX worker with a new one under a new address, which new
    /// clients are handed. Stored data is kept.
    ///
    /// A stuck worker (its receive queue will never move): the rendezvous puts in flight are
    /// cut (their extents come back as the old worker fails them); replies in flight end on
    /// the old worker, which stays progressed until it is destroyed; clients are told, and
    /// reconnect.
    ///
    /// A recycled one (too many stranded endpoints) goes on serving the clients it has.
    pub(super) fn replace_worker(&mut self, why: Retirement) -> Result<()> {
        match why {
            Retirement::Stuck => tracing::error!(
                "shard {}: its receive queue is stuck (a shared-memory client died while writing into it); \
                 replacing its UCX worker: clients reconnect, stored data is kept",
                self.service.index()
            ),
            Retirement::Recycled => {}
        }
        let started = Instant::now();
        let mut fresh = self.take_fresh_worker()?;
        let arena = self.service.arena();
        let memh = fresh.mem_map(arena.base(), arena.len())?;
        let incarnation = self.incarnation + 1;
        let arrival =
            ArrivalBox::new(Arrival { shard: self as *mut ShardWorker, incarnation, worker: fresh.handle(), memh });
        let address = match fresh.address().and_then(|a| Self::install_handlers(&fresh, &arrival).map(|()| a)) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: mapped just above on this worker, unmapped once.
                unsafe { fresh.mem_unmap(memh) };
                return Err(e);
            }
        };
        if why == Retirement::Stuck {
            self.cut_puts(|_| true);
        }
        self.worker.hand_waker_to(&mut fresh);
        let old = std::mem::replace(&mut self.worker, fresh);
        let old_memh = std::mem::replace(&mut self.memh, memh);
        let old_arrival = std::mem::replace(&mut self.arrival, arrival);
        let hex = crate::proto::bootstrap::hex_encode(&address);
        let mut unheard = Vec::new();
        match why {
            Retirement::Stuck => {
                self.address.set(hex);
                self.service.metrics().worker_replaced();
            }
            Retirement::Recycled => {
                self.address.hand_out(hex);
                self.service.metrics().worker_recycled();
                let message = format!(
                    "shard {}: {} departed shared-memory clients' endpoints held by its UCX worker (UCX frees them only with the worker); \
                     new clients get a fresh worker (the switch took {:.1} ms), the old one goes when its last client leaves",
                    self.service.index(),
                    self.stranded,
                    started.elapsed().as_secs_f64() * 1e3
                );
                if self.stranded >= self.stranded_limit {
                    tracing::info!("{message}");
                } else {
                    debug!("{message} (no client was left)");
                }
                // Everyone welcomed with the old address joined before this (the bootstrap
                // tells the workers before it reads the address).
                self.service.sync_membership();
                unheard = self.service.live_clients().filter(|&c| !self.reply_eps.knows(c)).collect();
            }
        }
        self.retired.push(Retired {
            worker: old,
            memh: old_memh,
            _arrival: old_arrival,
            incarnation: self.incarnation,
            since: Instant::now(),
            why,
            unheard,
        });
        self.incarnation = incarnation;
        self.stranded = 0;
        self.stranded_since = None;
        if let Err(e) = self.probe.connect(&address) {
            warn!(
                "shard {}: queue probe cannot reach the new worker ({}); a stuck queue will not be detected",
                self.service.index(),
                e.message
            );
        }
        Ok(())
    }
}
