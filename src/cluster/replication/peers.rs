//! The connections a replicator copies over: made, and closed when given up on, on
//! threads of their own.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rustc_hash::FxHashMap;
use tracing::warn;

use super::work::Waiting;
use super::{ArenaValue, ReplicatorConfig};
use crate::client::{Client, ClientOptions, CopyInFlight, ReplicaCopy};
use crate::cluster::tunables::{
    COPY_ANSWER_SPIN, COPY_ANSWER_SPIN_MAX, COPY_DEPTH, COPY_PEER_TIMEOUT, EXPECTED_BYTES_PER_US,
};
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
    /// Each copy's token, whether its key must reach this replica, and a part's length.
    pub(super) copies: Vec<(u64, bool, Option<usize>)>,
    pub(super) outcomes: Receiver<Vec<Result<()>>>,
}

pub(super) struct Flight {
    pub(super) token: u64,
    pub(super) copy: CopyInFlight,
    /// Whether the copy's key must reach this replica (else it is one the key leaves).
    pub(super) must: bool,
    /// A streamed value's part of this many bytes, not a copy.
    pub(super) part: Option<usize>,
    /// Until when its answer is looked for without sleeping: the round trip and the time
    /// its bytes take to cross.
    pub(super) expected_by: Instant,
    pub(super) sent: Instant,
}

/// Sends `w`'s copy to `replica` over its connection in `peers`, which is made first, off
/// this thread, if there is none (the copy then goes once it is made). With `staged`, the
/// id under which the replica holds the whole value staged: the copy installs that.
#[allow(clippy::too_many_arguments)] // the copy, where it goes, and what it goes over
pub(super) fn send(
    peers: &mut FxHashMap<String, Peer>,
    connecting: &mut FxHashMap<String, Receiver<Result<Client>>>,
    cfg: &ReplicatorConfig,
    replica: &str,
    w: &Waiting,
    must: bool,
    staged: Option<u64>,
    now: Instant,
) -> Result<()> {
    let peer = connection(peers, connecting, cfg, replica)?;
    let job = &w.job;
    let value = job.value.as_ref().map(ArenaValue::bytes);
    let copy = ReplicaCopy { key: &job.key, value, generation: job.generation, ttl_ms: job.ttl_ms };
    let sent = match staged {
        Some(stage_id) => peer.client.send_replica_commit(&copy, stage_id),
        // SAFETY: the key and value stay put until the copy ends: the job is not ended
        // while a copy of it is in flight (`sending`), and its value's extent stays pinned
        // until then.
        None => unsafe { peer.client.send_replica_copy(&copy) },
    };
    let copy = sent.inspect_err(|e| peer.broken |= breaks(e.status))?;
    let crossing = if staged.is_some() { 0 } else { value.map_or(0, <[u8]>::len) };
    peer.flights.push(Flight {
        token: job.token,
        copy,
        must,
        part: None,
        expected_by: answer_due(now, crossing),
        sent: now,
    });
    Ok(())
}

/// Sends the part `bytes` at `offset` of a streamed value of `total` bytes to `replica`
/// (see [`super::StreamStart`]), staged there under `stage_id` (None: the first part,
/// whose request id it is then staged under, returned).
///
/// # Safety
/// `key` and `bytes` stay put until the part's answer came or its connection closed.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn send_part(
    peers: &mut FxHashMap<String, Peer>,
    connecting: &mut FxHashMap<String, Receiver<Result<Client>>>,
    cfg: &ReplicatorConfig,
    replica: &str,
    token: u64,
    (key, bytes, offset, total): (&[u8], &[u8], usize, usize),
    stage_id: Option<u64>,
    now: Instant,
) -> Result<u64> {
    let peer = connection(peers, connecting, cfg, replica)?;
    if peer.flights.len() >= COPY_DEPTH {
        return Err(Error::new(Status::Unavailable, "its fill of copies is in flight"));
    }
    // SAFETY: as this function's caller promises.
    let sent = unsafe { peer.client.send_replica_part(key, bytes, offset, total, stage_id) };
    let copy = sent.inspect_err(|e| peer.broken |= breaks(e.status))?;
    let id = copy.id();
    let (part, expected_by) = (Some(bytes.len()), answer_due(now, bytes.len()));
    peer.flights.push(Flight { token, copy, must: true, part, expected_by, sent: now });
    Ok(stage_id.unwrap_or(id))
}

/// Asks `replica`, over its connection if there is one, to free what it staged under
/// `stage_id` of the failed write `token`; its answer is not waited for.
pub(super) fn send_discard(
    peers: &mut FxHashMap<String, Peer>,
    replica: &str,
    token: u64,
    key: &[u8],
    stage_id: u64,
    now: Instant,
) {
    let Some(peer) = peers.get_mut(replica).filter(|p| !p.broken && !p.given_up) else { return };
    match peer.client.send_replica_discard(key, stage_id) {
        Ok(copy) => {
            let expected_by = answer_due(now, 0);
            peer.flights.push(Flight { token, copy, must: false, part: Some(0), expected_by, sent: now });
        }
        Err(e) => peer.broken |= breaks(e.status),
    }
}

/// Until when a copy's answer is looked for without sleeping: the round trip and the
/// time `crossing` bytes take.
fn answer_due(now: Instant, crossing: usize) -> Instant {
    let crossing = Duration::from_micros(crossing as u64 / EXPECTED_BYTES_PER_US);
    now + (COPY_ANSWER_SPIN + crossing).min(COPY_ANSWER_SPIN_MAX)
}

/// The connection to `replica` in `peers`, made first, off this thread, if there is none
/// (until it is made: Err, "connecting to it").
fn connection<'a>(
    peers: &'a mut FxHashMap<String, Peer>,
    connecting: &mut FxHashMap<String, Receiver<Result<Client>>>,
    cfg: &ReplicatorConfig,
    replica: &str,
) -> Result<&'a mut Peer> {
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
    Ok(peers.get_mut(replica).unwrap())
}

/// Whether a copy's failure leaves its connection unusable.
pub(super) fn breaks(status: Status) -> bool {
    matches!(status, Status::Transport | Status::Timeout | Status::Unavailable)
}

/// Closes `peer`'s connection on a thread of its own, giving up the copies in flight on
/// it; the [`Closing`] that hands their outcomes back, if there were any.
pub(super) fn close_off_thread(replica: String, mut peer: Peer) -> Option<Closing> {
    let copies: Vec<(u64, bool, Option<usize>)> = peer.flights.iter().map(|f| (f.token, f.must, f.part)).collect();
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
