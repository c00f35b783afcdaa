//! Replies a shard worker has sent that their clients have not received yet: counted per
//! client, so that a client that stops receiving stops being served before its replies pile
//! up in the server's memory, and against one budget for the whole server ([`ReplyBudget`]).
//! Both shard workers keep one [`ReplyBacklog`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::server::tunables::{MAX_BACKLOG_BYTES, MAX_BACKLOG_REPLIES};

/// Reply bytes that every shard of a server holds for clients that have not taken them
/// ([`super::ServerConfig::reply_budget`]): one budget, so that the total is bounded
/// however many clients and shards there are, not only each client's share of a shard.
#[derive(Debug)]
pub struct ReplyBudget {
    limit: u64,
    held: AtomicU64,
}

impl ReplyBudget {
    pub fn new(limit: u64) -> ReplyBudget {
        ReplyBudget { limit, held: 0.into() }
    }

    pub fn charge(&self, bytes: u64) {
        self.held.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn discharge(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Whether a client already holding `behind` unreceived reply bytes may be served: a
    /// client that is not behind always is (it takes what it asked for), one that is
    /// waits while the budget is spent.
    pub fn serves(&self, behind: u64) -> bool {
        behind == 0 || self.held() < self.limit
    }
}

/// One shard worker's unreceived replies, per client.
pub struct ReplyBacklog {
    clients: FxHashMap<u64, Unreceived>,
    budget: Arc<ReplyBudget>,
}

#[derive(Default)]
struct Unreceived {
    replies: usize,
    bytes: u64,
}

impl ReplyBacklog {
    pub fn new(budget: Arc<ReplyBudget>) -> ReplyBacklog {
        ReplyBacklog { clients: FxHashMap::default(), budget }
    }

    /// A reply holding `bytes` of its own is on its way to `client`.
    pub fn charge(&mut self, client: u64, bytes: u64) {
        let c = self.clients.entry(client).or_default();
        c.replies += 1;
        c.bytes += bytes;
        self.budget.charge(bytes);
    }

    /// A reply's send ended (delivered or failed). For a client that left, only the
    /// budget gets the bytes back.
    pub fn discharge(&mut self, client: u64, bytes: u64) {
        self.budget.discharge(bytes);
        if let Some(c) = self.clients.get_mut(&client) {
            c.replies = c.replies.saturating_sub(1);
            c.bytes = c.bytes.saturating_sub(bytes);
        }
    }

    /// Whether `client` is too far behind to be served now: at its own bounds, or holding
    /// unreceived bytes while the server's budget is spent.
    pub fn is_behind(&self, client: u64) -> bool {
        self.clients.get(&client).is_some_and(|c| {
            c.replies >= MAX_BACKLOG_REPLIES || c.bytes >= MAX_BACKLOG_BYTES || !self.budget.serves(c.bytes)
        })
    }

    /// `client` left: its count goes; the bytes of its sends still in flight come back to
    /// the budget through [`ReplyBacklog::discharge`].
    pub fn forget(&mut self, client: u64) {
        self.clients.remove(&client);
    }

    pub fn clear(&mut self) {
        self.clients.clear();
    }
}
