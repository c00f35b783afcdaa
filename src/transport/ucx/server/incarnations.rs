//! Bookkeeping of a UCX shard's workers (incarnations): a shard replaces its worker when the
//! receive queue gets stuck, or recycles it when departed clients' endpoints pile up on it
//! (see [`ReplyEps`]); until a retired worker is destroyed, the shard tracks what is in
//! flight on it and which clients it still serves.

use rustc_hash::FxHashMap;

use crate::transport::ucx::sys;

/// A count of operations in flight per worker incarnation (a handful at most).
#[derive(Default)]
pub(super) struct PerIncarnation(Vec<(u64, usize)>);

impl PerIncarnation {
    pub(super) fn add(&mut self, incarnation: u64) {
        match self.0.iter_mut().find(|(g, _)| *g == incarnation) {
            Some((_, n)) => *n += 1,
            None => self.0.push((incarnation, 1)),
        }
    }

    pub(super) fn remove(&mut self, incarnation: u64) {
        if let Some(i) = self.0.iter().position(|(g, _)| *g == incarnation) {
            self.0[i].1 -= 1;
            if self.0[i].1 == 0 {
                self.0.swap_remove(i);
            }
        }
    }

    pub(super) fn count(&self, incarnation: u64) -> usize {
        self.0.iter().find(|(g, _)| *g == incarnation).map_or(0, |(_, n)| *n)
    }

    pub(super) fn total(&self) -> usize {
        self.0.iter().map(|(_, n)| n).sum()
    }
}

/// Which worker (incarnation) each client's requests arrive on, and whether UCX will ever
/// free that endpoint by itself. Over shared memory without peer-failure detection it
/// never does: UCX keeps an endpoint its peer connected to until the worker is destroyed
/// (closing it does not free it), and each keeps mappings of the peer's queues (~50 KB of
/// memory, 3 mappings; every `rdram get` from a shell left that behind for good). Those a
/// departed client leaves are counted as stranded on their worker, whose replacement
/// after [`crate::server::ServerConfig::stranded_endpoint_limit`] of them bounds the total.
///
/// It also keeps the endpoints that failed, or that the shard closed: UCX destroys an
/// endpoint it made for a peer as soon as the peer fails (ucp_ep_set_failed), while
/// replies to it may still be due (a rendezvous put's failure, a deferred answer), so
/// nothing is sent on them again.
#[derive(Default)]
pub(super) struct ReplyEps {
    by_ep: FxHashMap<usize, ReplyEp>,
    /// The endpoint of the last request: most requests come from the same one as the
    /// request before, and need no lookup.
    last: usize,
    /// Endpoints failed or closed, with the client each served (0: not known), at most
    /// [`FAILED_EPS_KEPT`] (the oldest go first, `failed_order`). UCX may still hand over
    /// a request that came by one; a request of another client at its address comes by
    /// a new endpoint there.
    failed: FxHashMap<usize, u64>,
    failed_order: std::collections::VecDeque<usize>,
}

/// Failed endpoints remembered: a reply is due to one for at most a transfer's deadline
/// or a copy's, while this many other endpoints fail.
const FAILED_EPS_KEPT: usize = 1 << 16;

#[derive(Clone, Copy)]
struct ReplyEp {
    client: u64,
    incarnation: u64,
    /// Only the worker's destruction frees it.
    stranded_when_left: bool,
}

impl ReplyEps {
    /// Notes that a request of `client` (0: none yet) arrived on `ep` of worker
    /// `incarnation`; true when `ep` is new here (its watch is to be started: see
    /// [`ReplyEps::lost`]).
    /// `strands`: asked once for a new endpoint, whether only the worker's destruction will free it.
    pub(super) fn note(
        &mut self,
        ep: sys::ucp_ep_h,
        client: u64,
        incarnation: u64,
        strands: impl FnOnce() -> bool,
    ) -> bool {
        let key = ep as usize;
        if key == self.last {
            return false;
        }
        if let Some(&of) = self.failed.get(&key) {
            if of != client || of == 0 {
                // Another client's request: a new endpoint at the address of one that failed.
                self.failed.remove(&key);
            }
        }
        if client == 0 || self.by_ep.contains_key(&key) {
            return false;
        }
        self.by_ep.insert(key, ReplyEp { client, incarnation, stranded_when_left: strands() });
        self.last = key;
        true
    }

    /// UCX dropped `ep` (see [`crate::transport::ucx::ep_watch`]): nothing is sent on it
    /// again, and an endpoint UCX makes later at its address is a new one.
    pub(super) fn lost(&mut self, ep: usize) {
        self.by_ep.remove(&ep);
        self.fail(ep as sys::ucp_ep_h);
        if let Some(of) = self.failed.get_mut(&ep) {
            *of = 0; // whoever comes by this address next, comes by a new endpoint
        }
        self.last = 0;
    }

    /// Whether `ep` is the live endpoint of `client`'s requests: a reply given to it later
    /// goes nowhere else (UCX may have made a new endpoint, for another client, at the
    /// address of one it dropped).
    pub(super) fn reaches(&self, ep: sys::ucp_ep_h, client: u64) -> bool {
        !self.failed(ep) && self.by_ep.get(&(ep as usize)).is_some_and(|e| e.client == client)
    }

    /// `ep` failed (a transfer or reply on it failed) or was closed: nothing is sent on
    /// it again.
    pub(super) fn fail(&mut self, ep: sys::ucp_ep_h) {
        let key = ep as usize;
        if key == 0 || self.failed(ep) {
            return;
        }
        // Entries already gone (an endpoint at the same address came back) leave the
        // order as it is passed over.
        while self.failed.len() >= FAILED_EPS_KEPT || self.failed_order.len() >= 2 * FAILED_EPS_KEPT {
            match self.failed_order.pop_front() {
                Some(oldest) => drop(self.failed.remove(&oldest)),
                None => break,
            }
        }
        let client = self.by_ep.get(&key).map_or(0, |e| e.client);
        self.failed.insert(key, client);
        self.failed_order.push_back(key);
        self.last = 0;
    }

    /// Whether `ep` failed or was closed (see [`ReplyEps::fail`]).
    pub(super) fn failed(&self, ep: sys::ucp_ep_h) -> bool {
        !self.failed.is_empty() && self.failed.contains_key(&(ep as usize))
    }

    /// Forgets the endpoints of clients that left; returns the incarnations of those left
    /// stranded, one entry each.
    pub(super) fn departed(&mut self, departed: &[u64]) -> Vec<u64> {
        let mut stranded = Vec::new();
        self.by_ep.retain(|_, e| {
            let left = departed.contains(&e.client);
            if left && e.stranded_when_left {
                stranded.push(e.incarnation);
            }
            !left
        });
        self.last = 0;
        stranded
    }

    /// Whether a request of `client` has come by any worker (and it has not left).
    pub(super) fn knows(&self, client: u64) -> bool {
        self.by_ep.values().any(|e| e.client == client)
    }

    /// Whether a client that has not left came by worker `incarnation`.
    pub(super) fn serves(&self, incarnation: u64) -> bool {
        self.by_ep.values().any(|e| e.incarnation == incarnation)
    }

    /// Worker `incarnation` was destroyed: its endpoints are gone (their addresses may
    /// come back for new ones).
    pub(super) fn forget_incarnation(&mut self, incarnation: u64) {
        self.by_ep.retain(|_, e| e.incarnation != incarnation);
        self.last = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::{PerIncarnation, ReplyEps, FAILED_EPS_KEPT};
    use crate::transport::ucx::sys;

    #[test]
    fn failed_endpoints_are_kept_up_to_a_bound() {
        let ep = |n: usize| (n * 64) as sys::ucp_ep_h;
        let mut eps = ReplyEps::default();
        eps.fail(std::ptr::null_mut());
        assert!(!eps.failed(std::ptr::null_mut()), "a null endpoint is no endpoint");
        eps.fail(ep(1));
        eps.fail(ep(1));
        assert!(eps.failed(ep(1)) && !eps.failed(ep(2)));
        for n in 2..=FAILED_EPS_KEPT + 1 {
            eps.fail(ep(n));
        }
        assert!(!eps.failed(ep(1)), "the oldest goes beyond the bound");
        assert!(eps.failed(ep(2)) && eps.failed(ep(FAILED_EPS_KEPT + 1)));
        assert_eq!(eps.failed.len(), FAILED_EPS_KEPT);
    }

    #[test]
    fn a_dropped_endpoint_reaches_no_one_and_its_address_serves_the_next_client() {
        let ep = 64 as sys::ucp_ep_h;
        let mut eps = ReplyEps::default();
        let eps_lacking = |eps: &mut ReplyEps, client| eps.note(ep, client, 0, || false);
        assert!(eps_lacking(&mut eps, 7), "a new endpoint is noted (and watched)");
        assert!(!eps_lacking(&mut eps, 7), "the same one again is not");
        assert!(eps.reaches(ep, 7) && !eps.reaches(ep, 8));
        eps.lost(ep as usize);
        assert!(!eps.reaches(ep, 7) && eps.failed(ep), "nothing goes to a dropped endpoint");
        assert!(!eps.knows(7));
        // UCX makes the next endpoint at the same address, whichever client it is for.
        assert!(eps_lacking(&mut eps, 7), "an endpoint at a dropped one's address is new");
        assert!(eps.reaches(ep, 7) && !eps.failed(ep));
        eps.lost(ep as usize);
        assert!(eps_lacking(&mut eps, 8));
        assert!(eps.reaches(ep, 8) && !eps.reaches(ep, 7), "an answer for the old client goes nowhere");
    }

    #[test]
    fn operations_in_flight_are_counted_per_worker() {
        let mut n = PerIncarnation::default();
        n.add(0);
        n.add(1);
        n.add(1);
        assert_eq!((n.count(0), n.count(1), n.count(2), n.total()), (1, 2, 0, 3));
        n.remove(1);
        n.remove(0);
        assert_eq!((n.count(0), n.count(1), n.total()), (0, 1, 1));
        n.remove(7); // never added: nothing to take away
        n.remove(1);
        assert_eq!(n.total(), 0);
    }
}
