//! Cluster calls: a key turned back during a move is settled, and what servers send each
//! other as members (a key's primary's copies to its replicas, the movers' handovers).

use super::tunables::{CLUSTER_RETRY_MAX, CLUSTER_RETRY_MIN};
use super::*;
use crate::auth::{Grant, TICKET_LEN};

impl Client {
    /// Sends a cluster key's request until it is not turned back by a view change (see
    /// [`Client::call_key_into`]); returns the reply and the server that gave it.
    /// `first`: the reply to a first attempt already made.
    pub(super) fn settle_key(
        &mut self,
        key: &[u8],
        h: RequestHeader,
        payload: Payload,
        receive: Receive,
        started: std::time::Instant,
        first: Option<Result<(Reply, usize)>>,
    ) -> Result<(Reply, usize)> {
        let mut reply = first.unwrap_or_else(|| self.send_key(key, h, payload, receive, None));
        let mut pause = CLUSTER_RETRY_MIN;
        let write = matches!(Op::from_u8(h.op), Some(Op::Put | Op::Delete));
        let conditional = write && h.flags & (flags::IF_EQUAL | flags::IF_NOT_EQUAL | flags::IF_ABSENT) != 0;
        // An attempt lost with its server may have been taken, and its primary copies it on
        // to the replicas (a write taken before the epoch's seal outlives its primary): a
        // conditional write that then fails its condition may have failed on itself.
        let mut lost_attempt: Option<String> = None;
        loop {
            let mut asked = None;
            let why = match &reply {
                Ok((r, _)) if r.header.status() == Status::ConditionFailed && lost_attempt.is_some() => {
                    return Err(Error::new(
                        Status::Unavailable,
                        format!(
                            "outcome unknown: an attempt of this conditional write was lost with its server ({}), and may have been taken before the condition failed on the next; read the key to see",
                            lost_attempt.unwrap_or_default()
                        ),
                    ));
                }
                Ok((r, _)) => match r.header.status() {
                    Status::Moved => {
                        let node = String::from_utf8_lossy(&r.payload).into_owned();
                        if self.conn.server_named(&node).is_some() {
                            asked = Some(node.clone());
                        } else {
                            // Keys move to a server this client has not connected to yet:
                            // its view is behind; the next attempt's `live` catches up.
                            self.refresh_view();
                        }
                        format!("the key moved to {node}")
                    }
                    Status::ViewChanged => {
                        self.refresh_view();
                        String::from_utf8_lossy(&r.payload).into_owned()
                    }
                    Status::KeyMoving | Status::Replicating => String::from_utf8_lossy(&r.payload).into_owned(),
                    _ => return reply,
                },
                // A server lost: its keys' writes wait for the view without it.
                Err(e) if e.status == Status::Unavailable => {
                    if conditional {
                        lost_attempt = Some(e.message.clone());
                    }
                    e.message.clone()
                }
                Err(_) => return reply,
            };
            tracing::debug!("cluster call sent again after {:?}: {why}", started.elapsed());
            if started.elapsed() >= self.opts.timeout {
                return Err(Error::new(
                    Status::Unavailable,
                    format!("the cluster's view was changing for the whole call ({:?}): {why}", self.opts.timeout),
                ));
            }
            if asked.is_none() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(CLUSTER_RETRY_MAX);
            }
            reply = self.send_key(key, h, payload, receive, asked.as_deref());
        }
    }

    fn import_header(&self, key: &[u8], len: usize, generation: u64, ttl_ms: u64) -> Result<RequestHeader> {
        let mut h = RequestHeader::new(Op::Put, 0, 0);
        h.flags |= flags::IMPORT;
        h.if_equal = generation;
        if ttl_ms > 0 {
            h.flags |= flags::HAS_TTL;
            h.ttl_or_limit = ttl_ms;
        }
        h.set_ticket(&self.member_ticket(key, Grant::Put { generation, len: len as u64, ttl_ms })?);
        Ok(h)
    }

    fn delete_import_header(&self, key: &[u8], generation: u64) -> Result<RequestHeader> {
        let mut h = RequestHeader::new(Op::Delete, 0, 0);
        h.flags |= flags::IMPORT;
        h.if_equal = generation;
        h.set_ticket(&self.member_ticket(key, Grant::Delete { generation })?);
        Ok(h)
    }

    fn end_hold_header(&self, key: &[u8], generation: u64) -> Result<RequestHeader> {
        let mut h = RequestHeader::new(Op::Delete, 0, 0);
        h.flags |= flags::MIGRATE | flags::IF_EQUAL;
        h.if_equal = generation;
        h.set_ticket(&self.member_ticket(key, Grant::EndHold { generation })?);
        Ok(h)
    }

    /// A mover's copies of keys from this connection's server straight to the members
    /// each names, those handed over held there first ([`flags::FORWARD`]), up to `depth`
    /// in flight: per key, its generation and size once every member named holds it;
    /// None when the key is gone.
    #[doc(hidden)]
    pub fn copy_out_many(&mut self, items: &[CopyOut<'_>], depth: usize) -> Vec<Result<Option<CopiedOut>>> {
        let headers: Vec<Result<RequestHeader>> = items
            .iter()
            .map(|c| {
                let mut h = RequestHeader::new(Op::Get, 0, 0);
                let (kind, grant) = match c.hand_over {
                    true => (flags::MIGRATE, Grant::Hold),
                    false => (flags::IMPORT, Grant::CopyOut),
                };
                h.flags |= kind | flags::FORWARD;
                h.set_ticket(&self.member_ticket(c.key, grant)?);
                Ok(h)
            })
            .collect();
        let targets: Vec<Vec<u8>> = items.iter().map(|c| proto::encode_members(c.to)).collect();
        let replies =
            self.member_pipelined(items.len(), depth, |i| Ok((headers[i].clone()?, items[i].key, &targets[i][..])));
        replies
            .into_iter()
            .map(|r| {
                let reply = r?;
                match reply.header.status() {
                    Status::Ok => {
                        Ok(Some(CopiedOut { generation: reply.header.generation, len: reply.header.value_size }))
                    }
                    Status::Missing => Ok(None),
                    s => Err(error_of(s, &reply)),
                }
            })
            .collect()
    }

    /// A handover's last step (on the previous owner), for many (key, generation) with up
    /// to `depth` in flight: deletes each key if it still holds the generation handed
    /// over, and ends its hold. False for one that changed (a write went ahead).
    #[doc(hidden)]
    pub fn handover_delete_many(&mut self, items: &[(&[u8], u64)], depth: usize) -> Vec<Result<bool>> {
        let headers: Vec<_> = items.iter().map(|&(k, g)| self.end_hold_header(k, g)).collect();
        let replies = self.member_pipelined(items.len(), depth, |i| Ok((headers[i].clone()?, items[i].0, &[][..])));
        replies.into_iter().map(|r| ended_hold(r?)).collect()
    }

    /// Sends a key's primary's copy of a write it took to one of the key's other replicas
    /// (this connection's server), without waiting for its answer: many go in flight at
    /// once, to many replicas, each on a connection of its own (see
    /// [`Client::copy_outcome`]).
    ///
    /// # Safety
    /// The copy's key and value stay valid, and unwritten, until [`Client::copy_outcome`]
    /// took the copy back or this client is dropped: the transport reads them meanwhile.
    #[doc(hidden)]
    pub unsafe fn send_replica_copy(&mut self, c: &ReplicaCopy<'_>) -> Result<CopyInFlight> {
        let h = match c.value {
            Some(v) => self.import_header(c.key, v.len(), c.generation, c.ttl_ms)?,
            None => self.delete_import_header(c.key, c.generation)?,
        };
        let (id, joined) = self.submit_member(h, c.key, c.value.unwrap_or(&[]))?;
        Ok(CopyInFlight { id, _joined: joined })
    }

    /// Stages a part of a write's value on one of the key's other replicas (this
    /// connection's server) while the rest still reaches its primary: `bytes` at `offset`
    /// of a value of `total`, under `stage_id` (None: the first part, staged under its own
    /// request id, [`CopyInFlight::id`]). Parts to one replica go in order, at most 8 in
    /// flight. An ordinary staged put: reachable by no one until
    /// [`Client::send_replica_commit`] installs it.
    ///
    /// # Safety
    /// As for [`Client::send_replica_copy`], for `key` and `bytes`.
    #[doc(hidden)]
    pub unsafe fn send_replica_part(
        &mut self,
        key: &[u8],
        bytes: &[u8],
        offset: usize,
        total: usize,
        stage_id: Option<u64>,
    ) -> Result<CopyInFlight> {
        if key.len() > INLINE_KEY_MAX {
            return Err(Error::new(Status::Invalid, "a value staged in parts has its key inline"));
        }
        let (id, joined) = self.submit_member(super::parts::part_header(offset, total, stage_id), key, bytes)?;
        Ok(CopyInFlight { id, _joined: joined })
    }

    /// Installs on a replica, as [`Client::send_replica_copy`] would, the value staged
    /// there whole under `stage_id` ([`Client::send_replica_part`]).
    #[doc(hidden)]
    pub fn send_replica_commit(&mut self, c: &ReplicaCopy<'_>, stage_id: u64) -> Result<CopyInFlight> {
        let len = c.value.map_or(0, <[u8]>::len);
        let mut h = self.import_header(c.key, len, c.generation, c.ttl_ms)?;
        h.flags |= flags::STAGE;
        h.if_not_equal = stage_id;
        let (id, joined) = self.submit_member(h, c.key, &[])?;
        Ok(CopyInFlight { id, _joined: joined })
    }

    /// Frees what a replica staged under `stage_id` of a write that failed
    /// ([`Client::send_replica_part`]).
    #[doc(hidden)]
    pub fn send_replica_discard(&mut self, key: &[u8], stage_id: u64) -> Result<CopyInFlight> {
        let (id, joined) = self.submit_member(super::parts::discard_header(stage_id), key, &[])?;
        Ok(CopyInFlight { id, _joined: joined })
    }

    /// One pass of the transport's progress, without sleeping: copies in flight move on,
    /// and their answers come in.
    #[doc(hidden)]
    pub fn poll_copies(&mut self) {
        self.conn.poll();
    }

    /// The fd that turns readable when this connection has progress to make (copies'
    /// answers, or a replica reading a copy's bytes), armed for a sleep on it; None when
    /// progress is pending already, or the transport has no fd (libfabric's shm).
    #[doc(hidden)]
    pub fn copies_wait_fd(&self) -> Option<std::os::fd::RawFd> {
        let fd = self.conn.wait_fd()?;
        self.conn.arm().then_some(fd)
    }

    /// Whether the connection's transport has an fd to sleep on ([`Client::copies_wait_fd`]).
    #[doc(hidden)]
    pub fn copies_can_sleep(&self) -> bool {
        self.conn.wait_fd().is_some()
    }

    /// Whether a copy's answer is in: [`Client::copy_outcome`] returns at once.
    #[doc(hidden)]
    pub fn copy_answered(&self, c: &CopyInFlight) -> bool {
        self.conn.answered(c.id)
    }

    /// A copy's outcome, waited for up to `timeout` (none, once answered). A replica that
    /// holds a newer generation keeps it, and the copy counts as taken.
    #[doc(hidden)]
    pub fn copy_outcome(&mut self, c: CopyInFlight, timeout: std::time::Duration) -> Result<()> {
        let reply = self.conn.wait_for(c.id, timeout)?;
        match reply.header.status() {
            Status::Ok => Ok(()),
            s => Err(error_of(s, &reply)),
        }
    }

    /// Sends `n` of a cluster server's own requests (header, key, payload each) with up to
    /// `depth` in flight, each to its key's server on this connection; the replies, in
    /// order. A key longer than `INLINE_KEY_MAX` travels before the payload.
    fn member_pipelined<'a>(
        &mut self,
        n: usize,
        depth: usize,
        item: impl Fn(usize) -> Result<(RequestHeader, &'a [u8], &'a [u8])>,
    ) -> Vec<Result<Reply>> {
        if let Err(e) = self.live() {
            return (0..n).map(|_| Err(e.clone())).collect();
        }
        let mut results: Vec<Option<Result<Reply>>> = (0..n).map(|_| None).collect();
        // Each with its long key joined to its payload, if it has one: kept until its
        // reply is in, as the transport reads it while the request is in flight.
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..n {
            if in_flight.len() == depth.max(1) {
                let (j, id, _joined) = in_flight.pop_front().unwrap();
                results[j] = Some(self.conn.wait(id));
            }
            match item(i).and_then(|(h, key, payload)| self.submit_member(h, key, payload)) {
                Ok((id, joined)) => in_flight.push_back((i, id, joined)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (j, id, _joined) in in_flight {
            results[j] = Some(self.conn.wait(id));
        }
        results.into_iter().map(|r| r.unwrap()).collect()
    }

    /// Submits a cluster server's own request to its key's server on this connection: its
    /// id, and the buffer a key longer than `INLINE_KEY_MAX` travels in before the
    /// payload, which must outlive the request.
    fn submit_member(&mut self, h: RequestHeader, key: &[u8], payload: &[u8]) -> Result<(u64, Option<Vec<u8>>)> {
        check_key(key)?;
        let server = self.conn.primary(key);
        if key.len() <= INLINE_KEY_MAX || payload.is_empty() {
            return Ok((self.submit_key(key, h, payload.into(), Receive::Owned, server)?, None));
        }
        let joined = [key, payload].concat();
        let id = self.submit_key(key, h, joined.as_slice().into(), Receive::Owned, server)?;
        Ok((id, Some(joined)))
    }

    /// A cluster server's own ticket for `grant` on `key`, made with the secret in its
    /// options ([`ClientOptions::cluster_secret`]).
    fn member_ticket(&self, key: &[u8], grant: Grant) -> Result<[u8; TICKET_LEN]> {
        let secret = self.opts.cluster_secret.as_ref().ok_or_else(|| {
            Error::new(Status::AuthFailed, "copies and handovers between servers need the cluster's secret")
        })?;
        Ok(secret.ticket(key, grant))
    }
}

/// A write a key's primary copies to a replica: its value (None: a delete), and the
/// generation and TTL (ms, 0: none) the primary gave it.
#[doc(hidden)]
pub struct ReplicaCopy<'a> {
    pub key: &'a [u8],
    pub value: Option<&'a [u8]>,
    pub generation: u64,
    pub ttl_ms: u64,
}

/// A copy in flight to a replica ([`Client::send_replica_copy`]).
#[doc(hidden)]
pub struct CopyInFlight {
    id: u64,
    /// A long key joined with the value, which the transport sends from here.
    _joined: Option<Vec<u8>>,
}

impl CopyInFlight {
    /// The request's id: a first part's is the id its value is staged under.
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// A key a mover copies from its server to the members it gains ([`Client::copy_out_many`]).
#[doc(hidden)]
pub struct CopyOut<'a> {
    pub key: &'a [u8],
    pub to: &'a [String],
    /// Held on the server for its handover first (one replica per key).
    pub hand_over: bool,
}

/// A key copied out: the generation and size of its value.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct CopiedOut {
    pub generation: u64,
    pub len: u64,
}

/// Whether a handover's end deleted the key (false: a write went ahead).
fn ended_hold(reply: Reply) -> Result<bool> {
    match reply.header.status() {
        Status::Ok => Ok(true),
        Status::ConditionFailed => Ok(false),
        s => Err(error_of(s, &reply)),
    }
}
