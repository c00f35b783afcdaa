//! Connecting: rails opened, every shard worker's address inserted, and a hello to each
//! worker for our slot and credential there.

use std::net::IpAddr;
use std::time::Duration;

// The rest of the link's impl, in a file of its own: everything of the parent is in scope.
use super::*;
use crate::transport::fabric::POST_STALL_LIMIT;

impl FabricLink {
    /// `elsewhere`: a server that offers shared memory this client cannot map, which a
    /// failure then names.
    pub fn connect(
        welcomes: &[Welcome],
        liveness: Liveness,
        local_ip: Option<IpAddr>,
        opts: &ClientOptions,
        elsewhere: Option<&str>,
    ) -> Result<FabricLink> {
        Self::connect_to(welcomes, liveness, local_ip, opts).map_err(|mut e| {
            // libfabric's shm regions are their owner's alone: mapping another user's fails
            // in fi_av_insert ("Invalid argument"), which says nothing of why.
            if let Some(node) = elsewhere.filter(|_| welcomes[0].provider == "shm") {
                e.message = format!("{} ({}: run this client as the server's user on its host, or serve with --provider \"tcp;ofi_rxm\")", e.message, shares_no_memory(node));
            }
            e
        })
    }

    pub(super) fn connect_to(
        welcomes: &[Welcome],
        liveness: Liveness,
        local_ip: Option<IpAddr>,
        opts: &ClientOptions,
    ) -> Result<FabricLink> {
        let provider = &welcomes[0].provider;
        let first_shard = crate::proto::fabric::decode_addresses(&welcomes[0].shards[0])?;
        let mut rails = Rails::open(provider, local_ip, first_shard.len())?;
        // An application's call waits for a server held up for a while (see
        // `Endpoint::set_post_stall_limit`) as long as for its answer. A server's own
        // connections (a replicator's, the mover's), driven between requests, give up
        // as its workers do: what they send is sent again on a new connection.
        let member = opts.cluster_secret.is_some();
        let stall_limit = if member { POST_STALL_LIMIT } else { opts.timeout.max(POST_STALL_LIMIT) };
        for ep in &mut rails.eps {
            ep.set_post_stall_limit(stall_limit);
        }
        let mut link = FabricLink {
            servers: Vec::new(),
            pending: Requests::default(),
            pool: Vec::new(),
            ops: InFlight::default(),
            registered: Vec::new(),
            completions: Vec::with_capacity(64),
            poller: Poller::new(opts.poll, opts.spin),
            liveness,
            rails: std::mem::ManuallyDrop::new(rails),
            poisoned: false,
        };
        link.connect_servers(welcomes, opts.connect_timeout)?;
        Ok(link)
    }

    /// Adds each server's shards as peers, numbered after the servers connected, and
    /// introduces us to them.
    pub(super) fn connect_servers(&mut self, welcomes: &[Welcome], timeout: Duration) -> Result<()> {
        let first = self.servers.len();
        for w in welcomes {
            let mut shards = Vec::new();
            for addrs in &w.shards {
                let addrs = crate::proto::fabric::decode_addresses(addrs)?;
                if addrs.len() != self.rails.eps.len() {
                    return Err(Error::new(
                        Status::Transport,
                        format!(
                            "server {} has {} rails per shard, expected {}",
                            w.node,
                            addrs.len(),
                            self.rails.eps.len()
                        ),
                    ));
                }
                let peers =
                    self.rails.eps.iter().zip(&addrs).map(|(ep, a)| ep.insert_peer(a)).collect::<Result<Vec<_>>>()?;
                shards.push(Shard { peers, slot: u32::MAX, credential: 0 });
            }
            self.servers.push(Server { node: w.node.clone(), shards, dead: None });
        }
        self.hello(first, welcomes, timeout)
    }

    /// Introduces us to every shard worker of the servers from `first` on (whose
    /// welcomes these are) and learns our slot at each. In a cluster, a member that died
    /// since its handshake, or does not answer, is connected to as lost (see
    /// `Connection::connect`): it stays failed here, and the keys its replicas hold are
    /// served.
    pub(super) fn hello(&mut self, first: usize, welcomes: &[Welcome], timeout: Duration) -> Result<()> {
        let addresses = self.rails.addresses()?;
        let lost = |e: &Error, in_cluster: bool| {
            in_cluster && matches!(e.status, Status::Unavailable | Status::Timeout | Status::Transport)
        };
        let mut waiting = Vec::new();
        for (s, w) in welcomes.iter().enumerate().map(|(i, w)| (first + i, w)) {
            for shard in 0..self.servers[s].shards.len() {
                let id = HELLO_ID_BASE + waiting.len() as u64;
                let hello = Hello { session: w.session, hello_id: id, addresses: addresses.clone() };
                let mut p = self.take_pending(s);
                p.msg.extend_from_slice(&hello.encode());
                match self.post(id, p, shard, wire::HELLO) {
                    Ok(()) => waiting.push((id, s, shard)),
                    Err(e) if lost(&e, self.liveness.in_cluster()) => {
                        // `post` failed the server: the rest of its shards are not asked.
                        tracing::debug!("connecting without {} for now: {}", w.node, e.message);
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        for (id, s, shard) in waiting {
            let reply = match self.wait_for(id, timeout) {
                Ok(reply) => reply,
                Err(e) if lost(&e, self.liveness.in_cluster()) => {
                    tracing::debug!("connecting without {} for now: {}", self.servers[s].node, e.message);
                    let why = format!("server {} did not answer the fabric hello: {}", self.servers[s].node, e.message);
                    self.fail_server(s, Status::Unavailable, why);
                    continue;
                }
                Err(e) => {
                    return Err(Error::new(
                        Status::Unavailable,
                        format!("server {} did not answer the fabric hello: {}", self.servers[s].node, e.message),
                    ))
                }
            };
            if reply.header.status() != Status::Ok {
                return Err(Error::new(reply.header.status(), String::from_utf8_lossy(&reply.payload).into_owned()));
            }
            let target = &mut self.servers[s].shards[shard];
            target.slot = reply.header.generation as u32;
            target.credential = reply.header.value_size;
        }
        Ok(())
    }
}
