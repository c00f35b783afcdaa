//! Replication in a cluster: a write reaches every replica of its key before it is
//! acknowledged (large values staged on the replicas beside the primary's put), a key turned
//! back during a move is settled, and the movers' handover calls.

use super::*;
use crate::auth::{Grant, TICKET_LEN};

impl Client {
    /// Sends a large put's value to the key's replicas other than its primary as staged
    /// copies ([`flags::STAGE`]), to go while the primary takes it: the copy that follows
    /// the primary's reply is then a small publish, not the value again. Returns the
    /// key's primary and the (server, request id) of each copy submitted; None, and
    /// nothing sent, for smaller values (where a copy costs the same round trip), long
    /// keys, keys with one replica, or a primary that cannot be reached.
    pub(super) fn stage_copies(
        &mut self,
        key: &[u8],
        h: &RequestHeader,
        payload: &[u8],
    ) -> Option<(usize, Vec<(usize, u64)>)> {
        let plain_put = Op::from_u8(h.op) == Some(Op::Put) && h.flags & (flags::IMPORT | flags::MIGRATE) == 0;
        if !plain_put
            || payload.len() < STAGE_FROM
            || key.len() > INLINE_KEY_MAX
            || self.live().is_err()
            || !self.conn.copies_writes()
        {
            return None;
        }
        let primary = self.conn.route(key).0;
        if self.conn.is_dead(primary) {
            return None;
        }
        let (now, then) = self.conn.replicas_of(key);
        let required = if then.is_empty() { now } else { then };
        let mut stage = RequestHeader::new(Op::Put, 0, 0);
        stage.flags = flags::STAGE;
        let mut sent = Vec::new();
        for server in required {
            if server == primary || self.conn.is_dead(server) {
                continue;
            }
            if let Ok(id) = self.submit_key(key, stage, payload, Receive::Owned, server) {
                sent.push((server, id));
            }
        }
        Some((primary, sent))
    }

    /// Waits for the staged copies [`Client::stage_copies`] sent: the servers that hold
    /// one, by node, with the id to publish it under.
    pub(super) fn staged(&mut self, sent: Vec<(usize, u64)>) -> Vec<(String, u64)> {
        let mut held = Vec::new();
        for (server, id) in sent {
            if self.conn.wait(id).is_ok_and(|r| r.header.status() == Status::Ok) {
                held.push((self.conn.servers[server].node.clone(), id));
            }
        }
        held
    }

    /// Drops the staged copies left unpublished (the primary refused the write, or the
    /// key's replicas changed), so that the servers free them now rather than when they
    /// lapse.
    pub(super) fn discard_staged(&mut self, key: &[u8], staged: &mut Vec<(String, u64)>) {
        let mut discard = RequestHeader::new(Op::Delete, 0, 0);
        discard.flags = flags::STAGE;
        let mut sent = Vec::new();
        for (node, id) in staged.drain(..) {
            discard.if_not_equal = id;
            if let Some(server) = self.conn.server_named(&node) {
                sent.extend(self.submit_key(key, discard, &[], Receive::Owned, server).ok());
            }
        }
        for id in sent {
            let _ = self.conn.wait(id);
        }
    }

    /// Copies a write that a cluster key's primary (server `primary`) took to the key's
    /// other replicas, under the generation the primary gave it: the write is
    /// acknowledged only once every replica the key must have holds it. Replicas it is
    /// leaving (while keys move) get it too where they answer. Sent again, to the
    /// replicas that did not take it yet, until the call's timeout; the primary's write
    /// is never repeated, so a conditional write is applied once.
    ///
    /// A replica in `staged` holds the value already ([`Client::stage_copies`]): it gets
    /// a publish of it instead, and the full copy only if that fails. Publishes sent are
    /// taken out of `staged`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_write(
        &mut self,
        key: &[u8],
        h: &RequestHeader,
        payload: &[u8],
        reply: &Reply,
        primary: usize,
        started: std::time::Instant,
        staged: &mut Vec<(String, u64)>,
    ) -> Result<()> {
        if !self.conn.copies_writes() {
            return Ok(());
        }
        let mut copy =
            RequestHeader::new(if Op::from_u8(h.op) == Some(Op::Delete) { Op::Delete } else { Op::Put }, 0, 0);
        copy.flags = flags::IMPORT | (h.flags & flags::HAS_TTL);
        copy.ttl_or_limit = h.ttl_or_limit;
        copy.if_equal = reply.header.generation;
        let payload = if copy.op == Op::Delete as u8 { &[][..] } else { payload };
        // The key's primary's leave for the copies: no replica takes one without it.
        let ticket: [u8; TICKET_LEN] = reply.payload.get(..TICKET_LEN).and_then(|t| t.try_into().ok()).ok_or_else(|| {
            Error::new(
                Status::Internal,
                "the key's primary gave no ticket for the write's copies (is it a remote_dram server of another version?)",
            )
        })?;
        copy.set_ticket(&ticket);
        let conditional = h.flags & (flags::IF_EQUAL | flags::IF_NOT_EQUAL | flags::IF_ABSENT) != 0;
        let primary_node = self.conn.servers[primary].node.clone();
        let mut holding = vec![primary_node.clone()];
        let mut pause = CLUSTER_RETRY_MIN;
        loop {
            if !self.conn.copies_writes() {
                return Ok(());
            }
            let (now, then) = self.conn.replicas_of(key);
            let still_primary =
                [now.first(), then.first()].into_iter().flatten().any(|&s| self.conn.servers[s].node == primary_node);
            // A write taken by a server that is the key's primary no more is copied on
            // only if it was taken before the current epoch was sealed: every generation
            // the key's new primary gave out is above it. Otherwise (the server lost its
            // lease, or was paused, and the view moved on without it) its write may be
            // ordered after ones taken since: not copied.
            let taken_before_seal = copy.if_equal < self.conn.generation_floor();
            if !still_primary && !taken_before_seal {
                // Acknowledged only if the key's new primary holds it (the keys' moves
                // copied it there) under the generation it was given.
                let landed = copy.op == Op::Put as u8
                    && self
                        .send_key(key, RequestHeader::new(Op::Get, 0, 0), &[], Receive::OwnedAtMost(0), None)
                        .is_ok_and(|(r, _)| r.header.generation == copy.if_equal);
                return if landed {
                    Ok(())
                } else {
                    Err(Error::new(Status::Unavailable, format!("the view changed while the write was copied: {primary_node} took it but is no longer the key's primary, so it may not last; read the key to see")))
                };
            }
            let required = if then.is_empty() { now.clone() } else { then };
            // With one replica per key, the one it leaves hands it over itself.
            let leaving = now.iter().copied().filter(|s| now.len() > 1 && !required.contains(s)).collect::<Vec<_>>();
            let mut sent = Vec::new();
            let mut missing = None;
            for server in required.iter().map(|&s| (s, true)).chain(leaving.into_iter().map(|s| (s, false))) {
                let node = &self.conn.servers[server.0].node;
                if holding.contains(node) {
                    continue;
                }
                let (server, must) = server;
                if self.conn.is_dead(server) {
                    if must {
                        missing = Some(format!("replica {node} cannot be reached"));
                    }
                    continue;
                }
                let submitted = match staged.iter().position(|(n, _)| n == node) {
                    Some(at) => {
                        let mut publish = copy;
                        publish.flags |= flags::STAGE;
                        publish.if_not_equal = staged.swap_remove(at).1;
                        self.submit_key(key, publish, &[], Receive::Owned, server)
                    }
                    None => self.submit_key(key, copy, payload, Receive::Owned, server),
                };
                match submitted {
                    Ok(id) => sent.push((server, must, id)),
                    Err(e) if must => missing = Some(e.message),
                    Err(_) => {}
                }
            }
            for (server, must, id) in sent {
                let node = self.conn.servers[server].node.clone();
                match self.conn.wait(id) {
                    // The replica holds a newer write, taken by the key's new primary
                    // after the seal: it may have been decided without this one, so a
                    // conditional write cannot count as applied.
                    Ok(r)
                        if r.header.status() == Status::Ok
                            && !still_primary
                            && conditional
                            && r.header.generation > copy.if_equal =>
                    {
                        return Err(Error::new(
                            Status::Unavailable,
                            format!("the view changed while the write was copied: {primary_node} took it, but replica {node} holds a newer write from the key's new primary, which may have been decided without this one, so this conditional write may not last; read the key to see"),
                        ));
                    }
                    Ok(r) if r.header.status() == Status::Ok => holding.push(node),
                    Ok(r) if must => {
                        if r.header.status() == Status::ViewChanged {
                            self.refresh_view();
                        }
                        missing = Some(format!("replica {node}: {}", String::from_utf8_lossy(&r.payload)));
                    }
                    Err(e) if must => missing = Some(format!("replica {node}: {}", e.message)),
                    _ => {}
                }
            }
            let Some(why) = missing else { return Ok(()) };
            if started.elapsed() >= self.opts.timeout {
                return Err(Error::new(
                    Status::Unavailable,
                    format!(
                        "the write was taken by the key's primary but not by all its replicas within {:?}: {why}",
                        self.opts.timeout
                    ),
                ));
            }
            tracing::debug!("copying a write to its replicas again after {:?}: {why}", started.elapsed());
            std::thread::sleep(pause);
            pause = (pause * 2).min(CLUSTER_RETRY_MAX);
            self.live()?;
        }
    }

    /// Sends a cluster key's request until it is not turned back by a view change (see
    /// [`Client::call_key_into`]); returns the reply and the server that gave it.
    /// `first`: the reply to a first attempt already made.
    pub(super) fn settle_key(
        &mut self,
        key: &[u8],
        h: RequestHeader,
        payload: &[u8],
        receive: Receive,
        started: std::time::Instant,
        first: Option<Result<(Reply, usize)>>,
    ) -> Result<(Reply, usize)> {
        let mut reply = first.unwrap_or_else(|| self.send_key(key, h, payload, receive, None));
        let mut pause = CLUSTER_RETRY_MIN;
        loop {
            let mut asked = None;
            let why = match &reply {
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
                    Status::KeyMoving => String::from_utf8_lossy(&r.payload).into_owned(),
                    _ => return reply,
                },
                // A server lost: its keys' writes wait for the view without it.
                Err(e) if e.status == Status::Unavailable => e.message.clone(),
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

    /// Handover, first step (a cluster server's mover, on itself): reads a key and holds
    /// it, so that writes through the cluster wait while it moves. The value, its
    /// generation and its TTL left (ms, 0: none); None when the key is gone.
    #[doc(hidden)]
    pub fn handover_get(&mut self, key: &[u8]) -> Result<Option<(Vec<u8>, u64, u64)>> {
        self.read_for_copy(key, flags::MIGRATE)
    }

    /// Reads a key to copy it to a new replica (a cluster server's mover, on itself),
    /// without holding it: the value, its generation and its TTL left (ms, 0: none);
    /// None when the key is gone.
    #[doc(hidden)]
    pub fn copy_get(&mut self, key: &[u8]) -> Result<Option<(Vec<u8>, u64, u64)>> {
        self.read_for_copy(key, flags::IMPORT)
    }

    pub(super) fn read_for_copy(&mut self, key: &[u8], flag: u32) -> Result<Option<(Vec<u8>, u64, u64)>> {
        check_key(key)?;
        let h = self.read_for_copy_header(key, flag == flags::MIGRATE)?;
        copied_value(self.call_key(key, h, &[])?)
    }

    fn read_for_copy_header(&self, key: &[u8], hold: bool) -> Result<RequestHeader> {
        let mut h = RequestHeader::new(Op::Get, 0, 0);
        if hold {
            h.flags |= flags::MIGRATE;
            h.set_ticket(&self.member_ticket(key, Grant::Hold)?);
        } else {
            h.flags |= flags::IMPORT;
        }
        Ok(h)
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

    fn end_hold_header(&self, key: &[u8], generation: u64) -> Result<RequestHeader> {
        let mut h = RequestHeader::new(Op::Delete, 0, 0);
        h.flags |= flags::MIGRATE | flags::IF_EQUAL;
        h.if_equal = generation;
        h.set_ticket(&self.member_ticket(key, Grant::EndHold { generation })?);
        Ok(h)
    }

    /// [`Client::handover_get`] (`true`) or [`Client::copy_get`] of many keys (each at
    /// most `INLINE_KEY_MAX` bytes), up to `depth` in flight: a mover's reads.
    #[doc(hidden)]
    pub fn read_for_copy_many(&mut self, keys: &[(&[u8], bool)], depth: usize) -> Vec<Result<Option<CopiedValue>>> {
        let headers: Vec<_> = keys.iter().map(|&(key, hold)| self.read_for_copy_header(key, hold)).collect();
        let replies = self.member_pipelined(keys.len(), depth, |i| Ok((headers[i].clone()?, keys[i].0, &[][..])));
        replies.into_iter().map(|r| copied_value(r?)).collect()
    }

    /// [`Client::handover_import`] of many (key, value, generation, TTL), up to `depth` in
    /// flight: a mover's copies.
    #[doc(hidden)]
    pub fn handover_import_many(&mut self, items: &[(&[u8], &[u8], u64, u64)], depth: usize) -> Vec<Result<()>> {
        let headers: Vec<_> = items.iter().map(|&(k, v, g, ttl)| self.import_header(k, v.len(), g, ttl)).collect();
        let replies = self.member_pipelined(items.len(), depth, |i| Ok((headers[i].clone()?, items[i].0, items[i].1)));
        replies
            .into_iter()
            .map(|r| {
                let reply = r?;
                match reply.header.status() {
                    Status::Ok => Ok(()),
                    s => Err(error_of(s, &reply)),
                }
            })
            .collect()
    }

    /// [`Client::handover_delete`] of many (key, generation), up to `depth` in flight.
    #[doc(hidden)]
    pub fn handover_delete_many(&mut self, items: &[(&[u8], u64)], depth: usize) -> Vec<Result<bool>> {
        let headers: Vec<_> = items.iter().map(|&(k, g)| self.end_hold_header(k, g)).collect();
        let replies = self.member_pipelined(items.len(), depth, |i| Ok((headers[i].clone()?, items[i].0, &[][..])));
        replies.into_iter().map(|r| ended_hold(r?)).collect()
    }

    /// Sends `n` of a cluster server's own requests (header, key, payload each; keys of at
    /// most `INLINE_KEY_MAX` bytes) with up to `depth` in flight, each to its key's server
    /// on this connection; the replies, in order.
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
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..n {
            if in_flight.len() == depth.max(1) {
                let (j, id) = in_flight.pop_front().unwrap();
                results[j] = Some(self.conn.wait(id));
            }
            let submitted = item(i).and_then(|(h, key, payload)| {
                check_key(key)?;
                if key.len() > INLINE_KEY_MAX {
                    return Err(Error::new(Status::Invalid, format!("batches take keys up to {INLINE_KEY_MAX} bytes")));
                }
                let server = self.conn.route(key).0;
                self.submit_key(key, h, payload, Receive::Owned, server)
            });
            match submitted {
                Ok(id) => in_flight.push_back((i, id)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (j, id) in in_flight {
            results[j] = Some(self.conn.wait(id));
        }
        results.into_iter().map(|r| r.unwrap()).collect()
    }

    /// Handover or copy, second step (on the key's new replica): stores the value under
    /// the generation and TTL it had, unless the key holds that generation or a newer one.
    #[doc(hidden)]
    pub fn handover_import(&mut self, key: &[u8], value: &[u8], generation: u64, ttl_ms: u64) -> Result<()> {
        check_key(key)?;
        let h = self.import_header(key, value.len(), generation, ttl_ms)?;
        let reply = self.call_put(key, value, h)?;
        match reply.header.status() {
            Status::Ok => Ok(()),
            s => Err(error_of(s, &reply)),
        }
    }

    /// Handover, last step (on the previous owner): deletes the key if it still holds
    /// `generation`, and ends the hold. False when it changed (a write went ahead).
    #[doc(hidden)]
    pub fn handover_delete(&mut self, key: &[u8], generation: u64) -> Result<bool> {
        check_key(key)?;
        let h = self.end_hold_header(key, generation)?;
        ended_hold(self.call_key(key, h, &[])?)
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

/// A value read to be copied: its bytes, generation and TTL left (ms, 0: none).
pub type CopiedValue = (Vec<u8>, u64, u64);

/// A copy read's value; None when the key is gone.
fn copied_value(reply: Reply) -> Result<Option<CopiedValue>> {
    match reply.header.status() {
        Status::Ok => Ok(Some((reply.payload, reply.header.generation, u64::from(reply.header.more)))),
        Status::Missing => Ok(None),
        s => Err(error_of(s, &reply)),
    }
}

/// Whether a handover's end deleted the key (false: a write went ahead).
fn ended_hold(reply: Reply) -> Result<bool> {
    match reply.header.status() {
        Status::Ok => Ok(true),
        Status::ConditionFailed => Ok(false),
        s => Err(error_of(s, &reply)),
    }
}
