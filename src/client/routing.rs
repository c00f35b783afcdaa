//! Routing: which server and shard a key or range goes to, the connection kept live
//! (reconnects with backoff), and in a cluster the view followed, with failover for reads.

use super::tunables::{RECONNECT_BACKOFF_MAX, RECONNECT_BACKOFF_MIN};
use super::*;

impl Client {
    /// Whether connected server `i` is one this client uses: every server given, or in a
    /// cluster, those of its current view.
    pub(super) fn in_view(&self, i: usize) -> bool {
        self.cluster.is_none() || self.addresses.contains(&self.conn.servers[i].node)
    }

    /// Routes with the cluster's newest view on the servers already connected, connecting
    /// to those that joined beside them: a view change costs no new connection to a server
    /// connected already, and the others serve on while a joining one is connected.
    /// False when the connection must be made anew (a joining server that does not fit it).
    pub(super) fn reroute(&mut self) -> Result<bool> {
        let Some((watch, _)) = &self.cluster else { return Ok(false) };
        let view = view_of(watch)?;
        let addresses = view.addresses();
        // A server of the view whose connection is lost is still routed to: its keys fail
        // over to their other replicas, and it leaves the view once its lease lapses.
        let joined: Vec<String> = addresses.iter().filter(|a| self.conn.server_named(a).is_none()).cloned().collect();
        if !joined.is_empty() {
            // Servers that left stay connected (unrouted) until the connection is made
            // anew: that is when they would outnumber the view.
            if self.conn.servers.len() + joined.len() > 2 * addresses.len() {
                return Ok(false);
            }
            match self.conn.add_servers(&joined, &self.opts) {
                Ok(true) => {}
                Ok(false) => return Ok(false),
                Err(e) => {
                    tracing::debug!("connecting to joining servers {}: {e}", joined.join(","));
                    return Ok(false);
                }
            }
        }
        self.conn.route_with_view(&view.placement)?;
        self.addresses = addresses;
        if let Some((_, seen)) = &mut self.cluster {
            *seen = view.revision;
        }
        Ok(true)
    }

    /// The connection, made anew first when a server was lost (see [`Client`]).
    pub(super) fn live(&mut self) -> Result<&mut Connection> {
        let view_changed = self.cluster.as_ref().is_some_and(|(watch, seen)| watch.revision() != *seen);
        if !view_changed && !self.lost_a_server() {
            return Ok(&mut self.conn);
        }
        let routed = !view_changed || self.reroute()?;
        tracing::debug!(view_changed, routed, lost = self.lost_a_server(), "the connection is looked at again");
        if routed && !self.lost_a_server() {
            return Ok(&mut self.conn);
        }
        let now = std::time::Instant::now();
        // In a cluster routed by its newest view, a lost server's keys fail over to their
        // other replicas: the others keep serving while reconnecting waits its turn.
        let serves_around = self.cluster.is_some() && routed;
        if serves_around && !self.lost_servers_answer() {
            return Ok(&mut self.conn);
        }
        if now < self.reconnect_at && (serves_around || !self.lost_a_server()) {
            // Connecting to a new view failed a moment ago: the old one still serves.
            return Ok(&mut self.conn);
        }
        let mut view = None;
        if let Some((watch, _)) = &self.cluster {
            let v = view_of(watch)?;
            self.addresses = v.addresses();
            view = Some(v);
        }
        if now < self.reconnect_at {
            let wait = self.reconnect_at - now;
            return Err(Error::new(
                Status::Unavailable,
                format!("connection to {} lost; next reconnect attempt in {wait:?}", self.addresses.join(",")),
            ));
        }
        tracing::debug!("connecting anew to {}", self.addresses.join(","));
        let lost = self.cluster.as_ref().map(|(watch, _)| watch.lost());
        let fresh = Connection::connect(&self.addresses, &self.opts, lost.as_ref()).and_then(|mut c| {
            for &(base, len) in &self.regions {
                // SAFETY: the caller keeps registered memory valid until it deregisters
                // (the contract of `register`), which also removes it from `regions`.
                unsafe { c.register(base as *mut u8, len)? };
            }
            Ok(c)
        });
        let fresh = fresh.and_then(|mut c| {
            if let Some(v) = &view {
                c.route_with_view(&v.placement)?;
            }
            Ok(c)
        });
        match fresh {
            Ok(mut c) => {
                c.set_spin(self.spin);
                self.conn = c;
                if let (Some((_, seen)), Some(v)) = (&mut self.cluster, view) {
                    *seen = v.revision;
                }
                self.backoff = RECONNECT_BACKOFF_MIN;
                Ok(&mut self.conn)
            }
            Err(_) if serves_around => {
                self.reconnect_at = now + self.backoff;
                self.backoff = (self.backoff * 2).min(RECONNECT_BACKOFF_MAX);
                Ok(&mut self.conn)
            }
            Err(e) => {
                self.reconnect_at = now + self.backoff;
                self.backoff = (self.backoff * 2).min(RECONNECT_BACKOFF_MAX);
                let status = if matches!(e.status, Status::AuthFailed | Status::VersionMismatch | Status::Invalid) {
                    e.status
                } else {
                    Status::Unavailable
                };
                Err(Error::new(status, format!("reconnecting failed: {}", e.message)))
            }
        }
    }

    /// In a cluster: whether every server of the view this client lost may be back, so
    /// that connecting anew is worth its cost: etcd does not count it lost (its lease has
    /// not lapsed, or it registered again), and its address takes a TCP connection (a
    /// dead server's port refuses at once).
    pub(super) fn lost_servers_answer(&self) -> bool {
        let Some((watch, _)) = &self.cluster else { return true };
        let lost = watch.lost();
        (0..self.conn.servers.len()).filter(|&i| self.conn.is_dead(i) && self.in_view(i)).all(|i| {
            let node = &self.conn.servers[i].node;
            let probe = || {
                let addr = std::net::ToSocketAddrs::to_socket_addrs(node.as_str()).ok()?.next()?;
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).ok()
            };
            !lost.contains(node) && probe().is_some()
        })
    }

    /// Reads the cluster's view from etcd now (a server said it changed; the watch may
    /// not have heard yet). If etcd cannot be reached, the watch's view stands.
    pub(super) fn refresh_view(&self) {
        if let Some((watch, _)) = &self.cluster {
            let _ = watch.refresh();
        }
    }

    /// One attempt of a single-key request: routed by the view, or to `asked` (a server
    /// the key's previous owner named, [`flags::ASKING`]). Returns the reply and the
    /// server that gave it.
    pub(super) fn send_key(
        &mut self,
        key: &[u8],
        mut h: RequestHeader,
        payload: Payload,
        receive: Receive,
        asked: Option<&str>,
    ) -> Result<(Reply, usize)> {
        self.live()?;
        let server = self.target(key, &mut h, asked);
        let id = self.submit_key(key, h, payload, receive, server)?;
        Ok((self.conn.wait(id)?, server))
    }

    /// The server a key's request goes to: `asked` (a server the key's previous owner
    /// named), else in a cluster where [`Client::failover_target`] sends it, else the
    /// key's primary. A request sent elsewhere than the primary says so
    /// ([`flags::ASKING`]).
    pub(super) fn target(&self, key: &[u8], h: &mut RequestHeader, asked: Option<&str>) -> usize {
        let primary = self.conn.primary(key);
        let target = match asked.and_then(|node| self.conn.server_named(node)) {
            Some(s) => Some(s),
            None if self.cluster.is_some() => self.failover_target(key, primary, Op::from_u8(h.op) == Some(Op::Get)),
            None => None,
        };
        match target {
            Some(s) => {
                h.flags |= flags::ASKING;
                s
            }
            None => primary,
        }
    }

    /// Where a cluster key's request goes when its primary's connection is lost: a read
    /// to the first other replica reachable under the current placement, a write to the
    /// key's primary under the placement keys are moving to (which exists once the lost
    /// server's lease lapsed). None: to the primary, `primary`.
    pub(super) fn failover_target(&self, key: &[u8], primary: usize, read: bool) -> Option<usize> {
        // The common case costs no hash and no allocation: the primary is there.
        if !self.conn.is_dead(primary) {
            return None;
        }
        let (now, then) = self.conn.replicas_of(key);
        let alive = |s: &&usize| !self.conn.is_dead(**s);
        if read {
            // Only the key's replicas under the current placement hold every write
            // acknowledged: one it moves to may not have been copied it yet. With one
            // replica per key, its next owner holds it once it was handed over.
            let others = if now.len() > 1 { &now[1..] } else { &then[..] };
            others.iter().find(alive).copied()
        } else {
            then.first().filter(|s| **s != primary).filter(alive).copied()
        }
    }

    /// Submits a single-key request to the key's shard on `server`.
    pub(super) fn submit_key(
        &mut self,
        key: &[u8],
        mut h: RequestHeader,
        payload: Payload,
        receive: Receive,
        server: usize,
    ) -> Result<u64> {
        let shard = proto::shard_of(key, self.conn.servers[server].shards());
        h.key_len = key.len() as u32;
        if key.len() <= INLINE_KEY_MAX {
            self.conn.submit_into(server, shard, h, key, payload, receive)
        } else {
            h.flags |= flags::KEY_IN_PAYLOAD;
            let payload = if payload.is_empty() { Payload::host(key) } else { payload };
            self.conn.submit_into(server, shard, h, &[], payload, receive)
        }
    }

    pub(super) fn call_range(
        &mut self,
        server: usize,
        shard: usize,
        op: Op,
        min: &[u8],
        max: Option<&[u8]>,
        limit: u64,
    ) -> Result<Reply> {
        if min.len() > MAX_KEY_LEN || max.map_or(0, |m| m.len()) > MAX_KEY_LEN {
            return Err(Error::new(Status::KeyTooLarge, "range bound longer than the key limit"));
        }
        let mut h = RequestHeader::new(op, 0, 0);
        h.key_len = min.len() as u32;
        h.aux_len = max.map_or(0, |m| m.len() as u32);
        h.ttl_or_limit = limit;
        if max.is_none() {
            h.flags |= flags::MAX_UNBOUNDED;
        }
        let mut payload = min.to_vec();
        payload.extend_from_slice(max.unwrap_or(&[]));
        let id = self.conn.submit(server, shard, h, &[], &payload)?;
        let reply = self.conn.wait(id)?;
        match reply.header.status() {
            Status::Ok => Ok(reply),
            s => Err(error_of(s, &reply)),
        }
    }

    pub(super) fn all_shards(&mut self) -> Vec<(usize, usize)> {
        // A lost connection is made anew here; if that fails, the first call says why.
        let _ = self.live();
        let mut v = Vec::new();
        for (i, s) in self.conn.servers.iter().enumerate().filter(|&(i, _)| self.in_view(i)) {
            v.extend((0..s.shards()).map(|shard| (i, shard)));
        }
        v
    }

    /// Sends a single-key request to the key's shard; the key goes inline in the header
    /// when short, else the caller has put it at the front of `payload`.
    pub(super) fn call_key(&mut self, key: &[u8], h: RequestHeader, payload: &[u8]) -> Result<Reply> {
        self.call_key_into(key, h, payload.into(), Receive::Owned)
    }

    /// Sends a single-key request and waits for its reply. In a cluster, it settles what
    /// a view change makes servers answer: it follows a key that moved ("moved": asks the
    /// server named), and sends again when the view changed or the key is being handed
    /// over, or when a server it routed to is gone and the view changed meanwhile, until
    /// the call's timeout.
    pub(super) fn call_key_into(
        &mut self,
        key: &[u8],
        h: RequestHeader,
        payload: Payload,
        receive: Receive,
    ) -> Result<Reply> {
        if self.cluster.is_none() {
            return self.send_key(key, h, payload, receive, None).map(|(reply, _)| reply);
        }
        let started = std::time::Instant::now();
        self.settle_key(key, h, payload, receive, started, None).map(|(reply, _)| reply)
    }
}
