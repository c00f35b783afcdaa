//! A client connection: the bootstrap handshake with each server, key routing, request
//! ids, and a [`Link`] that moves requests and replies over the transport the servers
//! announced (UCX or libfabric). Callers see the same API whatever the transport.

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use super::link::{Link, Liveness, Payload, Receive, Reply};
use super::options::ClientOptions;
use crate::cluster::LostServers;
use crate::error::{Error, Result, Status};
use crate::proto::bootstrap::{client_handshake, Welcome};
use crate::proto::{self, flags, Op, RequestHeader, MAX_REQUEST_HEADER_LEN, PROTOCOL_VERSION, VALUE_ALIGN};
use crate::transport::fabric::client::FabricLink;
use crate::transport::ucx::client::UcxLink;

pub struct ServerConn {
    pub node: String,
    pub node_seed: u64,
    session: u64,
    shards: usize,
    /// This server's index in the link; None for a cluster member that could not be
    /// reached when the connection was made (it counts as lost: its keys' other replicas
    /// serve them, and a reconnect is tried once it answers again).
    link_index: Option<usize>,
}

impl ServerConn {
    pub fn shards(&self) -> usize {
        self.shards
    }
}

pub struct Connection {
    pub servers: Vec<ServerConn>,
    link: Box<dyn Link>,
    next_id: u64,
    timeout: Duration,
    /// Keys hash over the servers `route_to` names, by their `route_seeds`: every server,
    /// or in a cluster whose keys move, the placement's members (not those keys move to).
    route_to: Vec<usize>,
    route_seeds: Vec<u64>,
    /// In a cluster: the placement version requests are routed with ([`flags::VIEW`]).
    view: Option<u64>,
    /// In a cluster: servers that hold each key (R), and while keys move, the servers
    /// keys hash over under the placement's `next`, with their seeds.
    replicas: usize,
    next_to: Vec<usize>,
    next_seeds: Vec<u64>,
    /// What a server must offer to join this connection (see [`Connection::add_servers`]).
    joins: Joins,
}

/// What the link was made for: a server added later must fit it, or the connection is
/// made anew.
#[derive(Clone, Debug)]
struct Joins {
    transport: String,
    provider: String,
    /// UCX over shared memory only, within this scope.
    shared_memory_only: Option<String>,
    /// UCX with its tcp transport.
    ucx_tcp: bool,
    /// A server's connecting failed half-way: the link may hold part of it, so no
    /// server joins this connection any more.
    closed: bool,
}

impl Joins {
    fn fit(&self, w: &Welcome) -> bool {
        (&w.transport, &w.provider) == (&self.transport, &self.provider)
            && self.shared_memory_only.as_ref().is_none_or(|scope| w.shared_memory_scope.as_ref() == Some(scope))
            && (w.transport != "ucx" || w.ucx_tcp == self.ucx_tcp)
    }
}

impl Connection {
    pub fn connect(addresses: &[String], opts: &ClientOptions, lost: Option<&Arc<LostServers>>) -> Result<Connection> {
        match Self::connect_once(addresses, opts, lost) {
            // Shared memory could not reach the server (another IPC namespace, say):
            // once more, with every transport.
            Err(e) if opts.local_shared_memory && e.status == Status::Transport => {
                tracing::debug!(
                    "shared memory did not reach {}: {}; trying every transport",
                    addresses.join(","),
                    e.message
                );
                Self::connect_once(addresses, &ClientOptions { local_shared_memory: false, ..opts.clone() }, lost)
            }
            r => r,
        }
    }

    fn connect_once(addresses: &[String], opts: &ClientOptions, lost: Option<&Arc<LostServers>>) -> Result<Connection> {
        if addresses.is_empty() {
            return Err(Error::new(Status::Invalid, "no server address given"));
        }
        let mut welcomes: Vec<Welcome> = Vec::new();
        let mut bootstraps = Vec::new();
        let mut local_ip = None;
        // Read once: each welcome is compared with it (see `Welcome::shared_memory_scope`).
        let here = crate::transport::local_scope();
        let scope =
            if opts.local_shared_memory && crate::transport::ucx::offers_shared_memory() { here.clone() } else { None };
        let mut all_local = scope.is_some();
        // In a cluster, a member that does not answer is connected to as lost, so that the
        // keys whose replicas live are served (and it is tried again once it answers).
        let mut unreached: Vec<(String, Error)> = Vec::new();
        let mut reached = Vec::new();
        for addr in addresses {
            let (welcome, stream) = match handshake(addr, opts) {
                Ok(w) => w,
                Err(e) if lost.is_some() && unreachable(&e) => {
                    tracing::debug!("connecting without cluster member {addr} for now: {}", e.message);
                    unreached.push((addr.clone(), e));
                    continue;
                }
                Err(e) => return Err(e),
            };
            reached.push(addr.clone());
            let ip = stream.local_addr()?.ip();
            bootstraps.push(stream);
            if welcomes.iter().any(|w| w.node == welcome.node) {
                return Err(Error::new(Status::Invalid, format!("server {} is listed twice", welcome.node)));
            }
            if let Some(first) = welcomes.first() {
                if (&first.transport, &first.provider) != (&welcome.transport, &welcome.provider) {
                    return Err(Error::new(
                        Status::Transport,
                        format!(
                            "servers use different transports ({} {} vs {} {})",
                            first.transport, first.provider, welcome.transport, welcome.provider
                        ),
                    ));
                }
            }
            all_local &= welcome.shared_memory_scope.is_some() && welcome.shared_memory_scope == scope;
            local_ip.get_or_insert(ip);
            welcomes.push(welcome);
        }
        if welcomes.is_empty() {
            let (_, first) = unreached.into_iter().next().expect("at least one address was tried");
            return Err(first);
        }
        hold_for_test();
        let liveness = Liveness::new(bootstraps, reached, lost.cloned())?;
        let joins = Joins {
            transport: welcomes[0].transport.clone(),
            provider: welcomes[0].provider.clone(),
            // (`all_local` holds only with a scope of our own.)
            shared_memory_only: scope.clone().filter(|_| all_local),
            ucx_tcp: welcomes.iter().all(|w| w.ucx_tcp),
            closed: false,
        };
        // A server that offers shared memory where this client cannot map it (see
        // `Welcome::shared_memory_scope`): the links say so when connecting fails.
        let elsewhere = welcomes.iter().find(|w| !shares_memory_with(w, &here)).map(|w| w.node.clone());
        let link: Box<dyn Link> = match welcomes[0].transport.as_str() {
            "ucx" => {
                let opts = ClientOptions { local_shared_memory: all_local, ..opts.clone() };
                Box::new(UcxLink::connect(&welcomes, liveness, local_ip, &opts, elsewhere.as_deref())?)
            }
            "fabric" => Box::new(FabricLink::connect(&welcomes, liveness, local_ip, opts, elsewhere.as_deref())?),
            other => {
                return Err(Error::new(
                    Status::Transport,
                    format!("server {} uses transport {other:?}, which this client does not speak", addresses[0]),
                ))
            }
        };
        let mut servers = welcomes
            .into_iter()
            .enumerate()
            .map(|(i, w)| ServerConn {
                node_seed: proto::node_seed(&w.node),
                shards: w.shards.len(),
                session: w.session,
                node: w.node,
                link_index: Some(i),
            })
            .collect::<Vec<_>>();
        servers.extend(unreached.into_iter().map(|(addr, _)| ServerConn {
            node_seed: proto::node_seed(&addr),
            shards: 1,
            session: 0,
            node: addr,
            link_index: None,
        }));
        let route_seeds = servers.iter().map(|s| s.node_seed).collect();
        let route_to = (0..servers.len()).collect();
        let mut conn = Connection {
            servers,
            link,
            next_id: 1,
            timeout: opts.timeout,
            route_to,
            route_seeds,
            view: None,
            replicas: 1,
            next_to: Vec::new(),
            next_seeds: Vec::new(),
            joins,
        };
        if conn.link.round_trip_before_use() {
            conn.round_trip_every_shard(0, opts.connect_timeout, lost.is_some())?;
        }
        Ok(conn)
    }

    /// Connects to servers that joined (a cluster's new members) beside those connected,
    /// which go on serving: false when one of them does not fit the link (another
    /// transport, or a UCX context made for shared memory only and a server it cannot
    /// reach so), and the connection must be made anew.
    pub fn add_servers(&mut self, addresses: &[String], opts: &ClientOptions) -> Result<bool> {
        if self.joins.closed {
            return Ok(false);
        }
        let mut welcomes = Vec::new();
        let mut bootstraps = Vec::new();
        for addr in addresses {
            let (welcome, stream) = handshake(addr, opts)?;
            if !self.joins.fit(&welcome) {
                return Ok(false);
            }
            if self.server_named(&welcome.node).is_some() || welcomes.iter().any(|w: &Welcome| w.node == welcome.node) {
                return Err(Error::new(Status::Invalid, format!("server {} is connected already", welcome.node)));
            }
            welcomes.push(welcome);
            bootstraps.push(stream);
        }
        let first = self.servers.len();
        let linked = self.servers.iter().filter(|s| s.link_index.is_some()).count();
        if let Err(e) = self.link.add_servers(&welcomes, bootstraps, opts.connect_timeout) {
            self.joins.closed = true;
            return Err(e);
        }
        for (j, w) in welcomes.into_iter().enumerate() {
            self.servers.push(ServerConn {
                node_seed: proto::node_seed(&w.node),
                shards: w.shards.len(),
                session: w.session,
                node: w.node,
                link_index: Some(linked + j),
            });
        }
        if self.link.round_trip_before_use() {
            self.round_trip_every_shard(first, opts.connect_timeout, true)?;
        }
        Ok(true)
    }

    /// One round trip with every shard worker (of the servers from `first_server` on)
    /// before the connection is handed out, for links that need it (see
    /// [`Link::round_trip_before_use`]). An abort that names no request is the cheapest
    /// request: the worker answers at once. `in_cluster`: a member that fails meanwhile
    /// (it died since its handshake) is connected to as lost, as one that did not answer
    /// the handshake is, so that the keys its replicas hold are served.
    fn round_trip_every_shard(&mut self, first_server: usize, timeout: Duration, in_cluster: bool) -> Result<()> {
        let lost = |e: &Error| in_cluster && unreachable(e);
        let mut ids = Vec::new();
        for server in first_server..self.servers.len() {
            if self.servers[server].link_index.is_none() {
                continue;
            }
            for shard in 0..self.servers[server].shards {
                let mut h = RequestHeader::new(proto::Op::Abort, 0, 0);
                h.ttl_or_limit = u64::MAX;
                match self.submit(server, shard, h, &[], &[]) {
                    Ok(id) => ids.push((server, id)),
                    Err(e) if lost(&e) => {
                        tracing::debug!("connecting without {} for now: {}", self.servers[server].node, e.message)
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        for (server, id) in ids {
            let reply = match self.link.wait_for(id, timeout) {
                Ok(reply) => reply,
                Err(e) if lost(&e) => {
                    tracing::debug!("connecting without {} for now: {}", self.servers[server].node, e.message);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if reply.header.status() != crate::error::Status::Ok {
                return Err(Error::new(reply.header.status(), String::from_utf8_lossy(&reply.payload).into_owned()));
            }
        }
        Ok(())
    }

    /// Starts a request; `payload` must stay valid until [`Connection::wait`] returns for it.
    pub fn submit(
        &mut self,
        server: usize,
        shard: usize,
        h: RequestHeader,
        header_tail: &[u8],
        payload: &[u8],
    ) -> Result<u64> {
        self.submit_into(server, shard, h, header_tail, payload.into(), Receive::Owned)
    }

    /// Like `submit`; a successful reply's payload goes where `receive` says.
    pub fn submit_into(
        &mut self,
        server: usize,
        shard: usize,
        mut h: RequestHeader,
        header_tail: &[u8],
        payload: Payload,
        receive: Receive,
    ) -> Result<u64> {
        h.request_id = self.next_id;
        h.session = self.servers[server].session;
        if h.op == Op::Put as u8 && h.flags & flags::KEY_IN_PAYLOAD == 0 {
            // The value is sent from where it is: the server places it alike (VALUE_ALIGN).
            h.aux_len = (payload.as_ptr() as u64 % VALUE_ALIGN) as u32;
        }
        if let Some(view) = self.view {
            h.flags |= flags::VIEW;
            h.view = view;
        }
        let mut header = [0u8; MAX_REQUEST_HEADER_LEN];
        let len = h.encode_with_view(self.link.takes_short_headers(), &mut header);
        self.submit_raw(server, shard, &header[..len], header_tail, payload, receive)
    }

    /// Sends header bytes as given (after the id was written into them by `submit`, or
    /// verbatim for protocol tests) and registers the next request id as waiting.
    pub fn submit_raw(
        &mut self,
        server: usize,
        shard: usize,
        header: &[u8],
        header_tail: &[u8],
        payload: Payload,
        receive: Receive,
    ) -> Result<u64> {
        let Some(linked) = self.servers[server].link_index else {
            return Err(Error::new(
                Status::Unavailable,
                format!("server {} could not be reached when this client connected", self.servers[server].node),
            ));
        };
        if shard >= self.servers[server].shards {
            return Err(Error::new(Status::Invalid, format!("no shard {shard}")));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.link.submit(id, linked, shard, header, header_tail, payload, receive)?;
        Ok(id)
    }

    /// Registers caller memory for zero-copy sends from and receives into it.
    ///
    /// # Safety
    /// The memory must stay valid until deregistered (or the connection is dropped).
    pub unsafe fn register(&mut self, base: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller keeps the memory valid until it is deregistered (this function's contract).
        unsafe { self.link.register(base, len) }
    }

    pub fn deregister(&mut self, base: *mut u8) -> Result<()> {
        self.link.deregister(base)
    }

    pub fn session(&self, server: usize) -> u64 {
        self.servers[server].session
    }

    pub fn next_request_id(&self) -> u64 {
        self.next_id
    }

    /// Whether device memory may be handed to this connection's transport (see
    /// [`Link::takes_device_memory`]).
    pub fn takes_device_memory(&self) -> bool {
        self.link.takes_device_memory()
    }

    pub fn is_dead(&self, server: usize) -> bool {
        self.servers[server].link_index.is_none_or(|l| self.link.is_dead(l))
    }

    pub fn set_spin(&mut self, spin: Duration) {
        self.link.set_spin(spin);
    }

    /// One pass of progress without sleeping (see [`Link::poll`]).
    pub fn poll(&mut self) {
        self.link.poll();
    }

    /// Whether the reply to request `id` is in (or it failed): `wait` returns at once.
    pub fn answered(&self, id: u64) -> bool {
        self.link.answered(id)
    }

    /// See [`Link::wait_fd`].
    pub fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        self.link.wait_fd()
    }

    /// See [`Link::arm`].
    pub fn arm(&self) -> bool {
        self.link.arm()
    }

    /// Whether a cluster's large writes go to their primaries in parts (see
    /// `Client::put_streamed`): over UCX between hosts with its tcp transport, where a
    /// put's value reaches the server whole or not at all and the server streams staged
    /// values to the replicas. (libfabric servers read a value in chunks and stream it
    /// as it lands; over shared memory the copies share the memory's bandwidth.)
    pub fn stages_large_writes(&self) -> bool {
        self.joins.transport == "ucx" && self.joins.ucx_tcp && self.joins.shared_memory_only.is_none()
    }

    /// Waits for the reply to request `id`.
    pub fn wait(&mut self, id: u64) -> Result<Reply> {
        self.link.wait_for(id, self.timeout)
    }

    pub fn wait_for(&mut self, id: u64, timeout: Duration) -> Result<Reply> {
        self.link.wait_for(id, timeout)
    }

    /// The server a key routes to, by rendezvous hashing over the servers' node names (in
    /// a cluster, its primary; the shard is the key's hash over that server's shards).
    pub fn primary(&self, key: &[u8]) -> usize {
        self.route_to[proto::rendezvous(key, &self.route_seeds)]
    }

    /// Routes with a cluster's placement: keys hash over its members only (the other
    /// servers connected to are those keys move to), to `replicas` servers each, and
    /// requests carry the placement's version.
    pub fn route_with_view(&mut self, placement: &crate::cluster::Placement) -> Result<()> {
        let named = |list: &[String]| -> Result<Vec<usize>> {
            list.iter()
                .map(|m| {
                    self.server_named(m)
                        .ok_or_else(|| Error::new(Status::Internal, format!("member {m} is not connected")))
                })
                .collect()
        };
        let route_to = named(&placement.members)?;
        let next_to = named(placement.next.as_deref().unwrap_or_default())?;
        if route_to.is_empty() {
            return Err(Error::new(Status::Unavailable, "the cluster's view has no members"));
        }
        self.route_seeds = route_to.iter().map(|&i| self.servers[i].node_seed).collect();
        self.next_seeds = next_to.iter().map(|&i| self.servers[i].node_seed).collect();
        self.route_to = route_to;
        self.next_to = next_to;
        self.replicas = placement.replicas.max(1);
        self.view = Some(placement.version);
        Ok(())
    }

    /// In a cluster: whether `server`'s connection is lost and every key it holds has a
    /// replica on a server whose connection is not (fewer of the placement's members lost
    /// than each key has replicas; a server keys move to holds none that others lack).
    pub fn lost_and_covered(&self, server: usize) -> bool {
        let lost = self.route_to.iter().filter(|&&s| self.is_dead(s)).count();
        self.view.is_some() && self.is_dead(server) && lost < self.replicas
    }

    /// The servers that hold `key` in a cluster, its primary first, and while keys move,
    /// those that hold it under the placement's `next` (empty when none).
    pub fn replicas_of(&self, key: &[u8]) -> (proto::Ranked, proto::Ranked) {
        let now = proto::rendezvous_ranked(key, &self.route_seeds, self.replicas)
            .into_iter()
            .map(|i| self.route_to[i])
            .collect();
        let then = proto::rendezvous_ranked(key, &self.next_seeds, self.replicas)
            .into_iter()
            .map(|i| self.next_to[i])
            .collect();
        (now, then)
    }

    /// The server connected to under `node`, its bootstrap address.
    pub fn server_named(&self, node: &str) -> Option<usize> {
        self.servers.iter().position(|s| s.node == node)
    }
}

/// The bootstrap handshake. Also returns the connection: its local address is the
/// interface IP-based libfabric providers should use, and the server keeps it open for as
/// long as it lives.
fn handshake(addr: &str, opts: &ClientOptions) -> Result<(Welcome, TcpStream)> {
    let unavailable = |e: std::io::Error| Error::new(Status::Unavailable, format!("cannot reach server {addr}: {e}"));
    let sockaddr = addr
        .to_socket_addrs()
        .map_err(unavailable)?
        .next()
        .ok_or_else(|| Error::new(Status::Invalid, format!("address {addr} resolves to nothing")))?;
    let mut stream = TcpStream::connect_timeout(&sockaddr, opts.connect_timeout).map_err(unavailable)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(opts.connect_timeout))?;
    // A server killed meanwhile resets the connection: unreachable, as a refused connect
    // is (a cluster client then connects without it).
    let dropped = |e: Error| match e.status {
        Status::Io => Error::new(Status::Unavailable, format!("server {addr} dropped the connection: {}", e.message)),
        _ => e,
    };
    let welcome =
        client_handshake(&mut stream, addr, opts.auth_token.as_deref(), opts.connect_timeout).map_err(dropped)?;
    if welcome.version != PROTOCOL_VERSION {
        return Err(Error::new(
            Status::VersionMismatch,
            format!("protocol version mismatch: client speaks v{PROTOCOL_VERSION}, server {addr} v{}", welcome.version),
        ));
    }
    if welcome.shards.is_empty() {
        return Err(Error::new(Status::Invalid, format!("server {addr} announced no shards")));
    }
    Ok((welcome, stream))
}

/// Whether a server failed to answer (gone, stopped, cut off) rather than refused: a
/// cluster member that does is connected to as lost.
/// Tests only: a client connecting creates the file this names once its handshakes are
/// done, and waits there (up to 30 s) until the test removes it, so that a test can kill a
/// server between a client's handshake with it and the client's first message on the
/// transport.
pub const TEST_CONNECT_HOLD_ENV: &str = "RDRAM_TEST_CONNECT_HOLD_FILE";

fn hold_for_test() {
    let Some(file) = std::env::var_os(TEST_CONNECT_HOLD_ENV) else { return };
    if std::fs::write(&file, b"").is_ok() {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while std::path::Path::new(&file).exists() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn unreachable(e: &Error) -> bool {
    matches!(e.status, Status::Unavailable | Status::Timeout | Status::Transport)
}

/// False when the server says it offers shared memory somewhere this client's cannot
/// reach: another user's, host's or namespaces' (root maps any user's segments).
/// `here`: this process's [`crate::transport::local_scope`].
fn shares_memory_with(w: &Welcome, here: &Option<String>) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root || w.shared_memory_scope.is_none() || w.shared_memory_scope == *here
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server killed while a client connects resets the connection: the client counts it
    /// unreachable, as a refused connect, so that a cluster client connects without it.
    #[test]
    fn a_server_that_resets_the_handshake_is_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            // Closed with the client's hello unread: the kernel resets the connection.
            stream.peek(&mut [0u8; 1]).unwrap();
        });
        let e = handshake(&addr, &ClientOptions::default()).unwrap_err();
        server.join().unwrap();
        assert_eq!(e.status, Status::Unavailable, "{e:?}");
        assert!(e.message.contains(&addr), "{e:?}");
    }
}
