//! The connections a replicator copies over: made, and closed when given up on, on
//! threads of their own.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tracing::warn;

use super::work::Waiting;
use super::{ArenaValue, ReplicatorConfig};
use crate::client::{Client, ClientOptions, CopyInFlight, ReplicaCopy};
use crate::cluster::tunables::{COPY_ANSWER_SPIN, COPY_ANSWER_SPIN_MAX, COPY_PEER_TIMEOUT, EXPECTED_BYTES_PER_US};
use crate::error::{Error, Result, Status};

/// A replica copies go to: the connection, and the copies in flight on it.
pub(super) struct Peer {
    // Dropped before the flights: the transport reads their bytes until it is closed.
    pub(super) client: Client,
    pub(super) flights: Vec<Flight>,
    /// The connection failed: made anew once its flights ended.
    pub(super) broken: bool,
    /// A copy on it is overdue, or the replica's lease lapsed: it is closed, with the
    /// copies in flight on it given up (see [`Closing`]).
    pub(super) given_up: bool,
}

/// A connection given up on with copies in flight, closed on a thread of its own: giving
/// a copy up waits, for up to the transport's abort grace, until the replica stops
/// reading its bytes (their extents stay pinned until then), and nothing else waits
/// meanwhile. The copies' outcomes come back once it is closed.
pub(super) struct Closing {
    pub(super) replica: String,
    /// Each copy's token, and whether its key must reach this replica.
    pub(super) copies: Vec<(u64, bool)>,
    pub(super) outcomes: Receiver<Vec<Result<()>>>,
}

pub(super) struct Flight {
    pub(super) token: u64,
    pub(super) copy: CopyInFlight,
    /// Whether the copy's key must reach this replica (else it is one the key leaves).
    pub(super) must: bool,
    /// Until when its answer is looked for without sleeping: the round trip and the time
    /// its bytes take to cross.
    pub(super) expected_by: Instant,
    pub(super) sent: Instant,
}

/// Sends `w`'s copy to `replica` over its connection in `peers`, which is made first, off
/// this thread, if there is none (the copy then goes once it is made).
pub(super) fn send(
    peers: &mut HashMap<String, Peer>,
    connecting: &mut HashMap<String, Receiver<Result<Client>>>,
    cfg: &ReplicatorConfig,
    replica: &str,
    w: &Waiting,
    must: bool,
    now: Instant,
) -> Result<()> {
    if !peers.contains_key(replica) {
        let made = match connecting.get(replica).map(|r| r.try_recv()) {
            Some(Ok(made)) => made,
            Some(Err(crossbeam_channel::TryRecvError::Empty)) => {
                return Err(Error::new(Status::Unavailable, "connecting to it"));
            }
            Some(Err(crossbeam_channel::TryRecvError::Disconnected)) => {
                Err(Error::new(Status::Internal, "its connecting thread ended without a word"))
            }
            None => {
                connecting.insert(replica.to_string(), connect(cfg, replica)?);
                return Err(Error::new(Status::Unavailable, "connecting to it"));
            }
        };
        connecting.remove(replica);
        peers.insert(replica.to_string(), Peer { client: made?, flights: Vec::new(), broken: false, given_up: false });
    }
    let peer = peers.get_mut(replica).unwrap();
    let job = &w.job;
    let value = job.value.as_ref().map(ArenaValue::bytes);
    let copy = ReplicaCopy { key: &job.key, value, generation: job.generation, ttl_ms: job.ttl_ms };
    // SAFETY: the key and value stay put until the copy ends: the job is not ended while a
    // copy of it is in flight (`sending`), and its value's extent stays pinned until then.
    let sent = unsafe { peer.client.send_replica_copy(&copy) };
    let copy = sent.inspect_err(|e| peer.broken |= breaks(e.status))?;
    let crossing = Duration::from_micros(value.map_or(0, |v| v.len() as u64) / EXPECTED_BYTES_PER_US);
    let expected_by = now + (COPY_ANSWER_SPIN + crossing).min(COPY_ANSWER_SPIN_MAX);
    peer.flights.push(Flight { token: job.token, copy, must, expected_by, sent: now });
    Ok(())
}

/// Whether a copy's failure leaves its connection unusable.
pub(super) fn breaks(status: Status) -> bool {
    matches!(status, Status::Transport | Status::Timeout | Status::Unavailable)
}

/// Closes `peer`'s connection on a thread of its own, giving up the copies in flight on
/// it; the [`Closing`] that hands their outcomes back, if there were any.
pub(super) fn close_off_thread(replica: String, mut peer: Peer) -> Option<Closing> {
    let copies: Vec<(u64, bool)> = peer.flights.iter().map(|f| (f.token, f.must)).collect();
    if !copies.is_empty() {
        warn!("giving up {} copies in flight to {replica} (overdue, or its lease lapsed)", copies.len());
    }
    let (tx, outcomes) = crossbeam_channel::bounded(1);
    let close = move || {
        let flights = std::mem::take(&mut peer.flights);
        // Each returns once the transport reads the copy's bytes no more.
        let outcomes: Vec<Result<()>> =
            flights.into_iter().map(|f| peer.client.copy_outcome(f.copy, Duration::ZERO)).collect();
        drop(peer);
        let _ = tx.send(outcomes);
    };
    if let Err(e) = std::thread::Builder::new().name("rdram-close".into()).spawn(close) {
        // The closure went with the error, and the peer with it (its connection first):
        // the copies are told they failed.
        warn!("cannot start a thread to close a replica's connection ({e}); closed on this one");
    }
    (!copies.is_empty()).then_some(Closing { replica, copies, outcomes })
}

/// Starts a connection to `replica` on a thread of its own: it comes back through the
/// receiver.
fn connect(cfg: &ReplicatorConfig, replica: &str) -> Result<Receiver<Result<Client>>> {
    let opts = ClientOptions {
        auth_token: cfg.auth_token.clone(),
        cluster_secret: Some(cfg.secret.clone()),
        timeout: COPY_PEER_TIMEOUT,
        connect_timeout: COPY_PEER_TIMEOUT.min(Duration::from_secs(2)),
        ..Default::default()
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let replica = replica.to_string();
    std::thread::Builder::new()
        .name("rdram-connect".into())
        .spawn(move || drop(tx.send(Client::connect(&replica, opts))))
        .map_err(|e| Error::new(Status::Internal, format!("cannot start a thread to connect: {e}")))?;
    Ok(rx)
}
