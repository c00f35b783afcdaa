//! The synchronous Rust client. One `Client` is used by one thread at a time (`&mut self`);
//! open one per thread for parallelism. Each request goes straight to the worker that owns
//! the key's shard: servers are chosen by rendezvous hashing, shards by key hash.

mod conn;
mod device;
mod fabric_link;
mod link;
mod requests;
mod ucx_link;

use std::time::Duration;

use serde_json::json;

use crate::cluster;
use crate::error::{Error, Result, Status};
pub use crate::proto::ByteRange;
use crate::proto::{self, flags, Op, RequestHeader, INLINE_KEY_MAX, MAX_KEY_LEN, MAX_VALUE_LEN};
use crate::transport::{PollMode, DEFAULT_SPIN};
use conn::Connection;
pub use device::CHUNK as DEVICE_CHUNK;
use link::{Receive, Reply, Sink};

#[derive(Clone, Debug)]
pub struct ClientOptions {
    pub auth_token: Option<String>,
    pub poll: PollMode,
    pub spin: Duration,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// For UCX servers whose shared memory this process reaches (same boot, IPC and PID
    /// namespaces, and user, as their welcome says): a UCX context with shared-memory
    /// transports only (unless `UCX_TLS` is set), all transports if that fails. On by
    /// default. With every transport, UCX picks tcp even on the same host: the endpoints
    /// ask for peer-failure detection, which its shared-memory transports lack (a server's
    /// death is seen on the bootstrap connection either way), and small requests take
    /// about ten times longer. Such a context also starts sooner (no tcp interface
    /// discovery).
    pub local_shared_memory: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            auth_token: None,
            poll: PollMode::Adaptive,
            spin: DEFAULT_SPIN,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            local_shared_memory: true,
        }
    }
}

/// A condition on the key's current generation for a write or delete.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteCondition {
    #[default]
    None,
    IfEqual(u64),
    IfAbsent,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PutOptions {
    pub condition: WriteCondition,
    pub ttl: Option<Duration>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct GetOptions {
    /// Answer `Unchanged` (without the value) if the generation equals this.
    pub if_not_equal: Option<u64>,
    /// Answer `Unchanged` if the generation differs from this.
    pub if_equal: Option<u64>,
    pub range: Option<ByteRange>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Value {
    pub data: Vec<u8>,
    pub generation: u64,
    /// Size of the whole stored value (`data` may be a byte range of it).
    pub size: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetResult {
    Value(Value),
    Missing,
    Unchanged { generation: u64 },
}

/// The result of [`Client::get_at_most`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetAtMost {
    Got(GetResult),
    /// The value (or its requested range) is `len` bytes, more than was asked for; it
    /// stayed on the server. `size` is the whole stored value's.
    TooLong {
        len: usize,
        generation: u64,
        size: u64,
    },
}

/// The result of [`Client::get_into`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetInto {
    /// `len` bytes were written to the buffer; `size` is the whole stored value's size.
    Value {
        len: usize,
        generation: u64,
        size: u64,
    },
    TooSmall {
        needed: usize,
    },
    Missing,
    Unchanged {
        generation: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteResult {
    Written { generation: u64 },
    ConditionFailed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteResult {
    Deleted { existed: bool },
    ConditionFailed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListEntry {
    pub key: Vec<u8>,
    pub size: u64,
}

/// Where a listing paged with [`Client::list_page`] goes on: a server's shard, named by
/// the server's address (not by its place in one client's connection, so that any client
/// of the same servers can take the listing on), and the key to list it from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListCursor {
    node: String,
    shard: usize,
    min: Vec<u8>,
}

/// Keys in `[min, max)`; `max = None` is unbounded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRange {
    pub min: Vec<u8>,
    pub max: Option<Vec<u8>>,
}

impl KeyRange {
    pub fn prefix(prefix: &[u8]) -> KeyRange {
        KeyRange { min: prefix.to_vec(), max: prefix_successor(prefix) }
    }
}

/// The smallest key greater than every key starting with `prefix` (None: unbounded).
pub fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut p = prefix.to_vec();
    while let Some(last) = p.pop() {
        if last != 0xff {
            p.push(last + 1);
            return Some(p);
        }
    }
    None
}

/// A client connection. Use it from one thread at a time; it may move between threads.
///
/// When a server is lost (it died, restarted, or left a call unanswered in time), the calls in
/// flight to it fail with `Unavailable`, and the next call connects again (a new
/// bootstrap with every server, the caller's registrations redone), trying at most once
/// per backoff step: [`RECONNECT_BACKOFF_MIN`] doubling up to [`RECONNECT_BACKOFF_MAX`].
pub struct Client {
    conn: Connection,
    addresses: Vec<String>,
    /// For a cluster named by an `etcd://` string: its member set, followed in the
    /// background, and the revision of the view `addresses` came from.
    cluster: Option<(cluster::Watch, i64)>,
    opts: ClientOptions,
    /// Caller memory registered through [`Client::register`], redone on a new connection.
    regions: Vec<(usize, usize)>,
    /// No reconnect before this; the step after a failed attempt.
    reconnect_at: std::time::Instant,
    backoff: Duration,
    /// What [`Client::set_spin`] last set (the connect-time spin until then).
    spin: Duration,
    /// Streams and pinned buffers for device memory, made when the client first meets it.
    device_staging: Option<Box<device::DeviceStaging>>,
}

/// Puts of values this large or larger send them to every replica at once (staged);
/// smaller ones are copied after the primary's reply, which costs the same round trip.
const STAGE_FROM: usize = 256 * 1024;

pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// First and longest pause before a request that a cluster's view change turned back is
/// sent again.
const CLUSTER_RETRY_MIN: Duration = Duration::from_millis(1);
const CLUSTER_RETRY_MAX: Duration = Duration::from_millis(10);
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(2);

impl Client {
    /// Connects to one or more servers: `"host:port"` or `"a:7000,b:7001"`, or to the live
    /// members of a cluster, `"etcd://HOST:PORT[,HOST:PORT...]/NAME"`, whose changes it
    /// follows (a call after a member joined or left connects to the new set first).
    pub fn connect(addresses: &str, opts: ClientOptions) -> Result<Client> {
        let cluster = match cluster::ClusterUrl::parse(addresses)? {
            Some(url) => {
                let watch = cluster::Watch::start(&url)?;
                let revision = watch.revision();
                Some((watch, revision))
            }
            None => None,
        };
        let view = match &cluster {
            Some((watch, _)) => Some(view_of(watch)?),
            None => None,
        };
        let list: Vec<String> = match &view {
            Some(v) => v.addresses(),
            None => addresses.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        };
        let lost = cluster.as_ref().map(|(watch, _)| watch.lost());
        let mut conn = Connection::connect(&list, &opts, lost.as_ref())?;
        let cluster = match (cluster, view) {
            (Some((watch, _)), Some(view)) => {
                conn.route_with_view(&view.placement)?;
                Some((watch, view.revision))
            }
            _ => None,
        };
        Ok(Client {
            conn,
            addresses: list,
            cluster,
            spin: opts.spin,
            opts,
            regions: Vec::new(),
            reconnect_at: std::time::Instant::now(),
            backoff: RECONNECT_BACKOFF_MIN,
            device_staging: None,
        })
    }

    /// Sets how long a call's wait spins before it sleeps (adaptive polling), from the
    /// next call on, here and on the connections it makes anew. Over libfabric's shm,
    /// whose waits have no fd to sleep on, a connection keeps the spin it was made with.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
        self.conn.set_spin(spin);
    }

    /// True while the connection to any server is lost (the next call reconnects).
    /// (In a cluster, any server of its current view: one it no longer routes to, such
    /// as a server that drained and left, may go.)
    pub fn lost_a_server(&self) -> bool {
        (0..self.conn.servers.len()).any(|i| self.conn.is_dead(i) && self.in_view(i))
    }

    /// Whether connected server `i` is one this client uses: every server given, or in a
    /// cluster, those of its current view.
    fn in_view(&self, i: usize) -> bool {
        self.cluster.is_none() || self.addresses.contains(&self.conn.servers[i].node)
    }

    /// Routes with the cluster's newest view on the servers already connected, connecting
    /// to those that joined beside them: a view change costs no new connection to a server
    /// connected already, and the others serve on while a joining one is connected.
    /// False when the connection must be made anew (a joining server that does not fit it).
    fn reroute(&mut self) -> Result<bool> {
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
    fn live(&mut self) -> Result<&mut Connection> {
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
    fn lost_servers_answer(&self) -> bool {
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

    /// Server nodes and their shard counts, in the order given at connect (in a cluster,
    /// the servers of the current view).
    pub fn layout(&self) -> Vec<(String, usize)> {
        let servers = self.conn.servers.iter().enumerate().filter(|&(i, _)| self.in_view(i));
        servers.map(|(_, s)| (s.node.clone(), s.shards())).collect()
    }

    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<u64> {
        match self.put_with(key, value, &PutOptions::default())? {
            WriteResult::Written { generation } => Ok(generation),
            WriteResult::ConditionFailed => {
                Err(Error::new(Status::Internal, "unconditional put reported a failed condition"))
            }
        }
    }

    pub fn put_with(&mut self, key: &[u8], value: &[u8], opts: &PutOptions) -> Result<WriteResult> {
        check_key(key)?;
        if value.len() as u64 > MAX_VALUE_LEN {
            return Err(Error::new(Status::ValueTooLarge, format!("{} bytes > limit {MAX_VALUE_LEN}", value.len())));
        }
        let mut h = RequestHeader::new(Op::Put, 0, 0);
        apply_write_condition(&mut h, opts.condition);
        if let Some(ttl) = opts.ttl {
            h.flags |= flags::HAS_TTL;
            h.ttl_or_limit = (ttl.as_millis() as u64).max(1);
        }
        let reply = self.call_put(key, value, h)?;
        match reply.header.status() {
            Status::Ok => Ok(WriteResult::Written { generation: reply.header.generation }),
            Status::ConditionFailed => Ok(WriteResult::ConditionFailed),
            s => Err(error_of(s, &reply)),
        }
    }

    /// Sends a put; a key too long to travel inline goes at the front of the payload.
    fn call_put(&mut self, key: &[u8], value: &[u8], h: RequestHeader) -> Result<Reply> {
        if key.len() <= INLINE_KEY_MAX {
            return self.call_key(key, h, value);
        }
        let mut payload = Vec::with_capacity(key.len() + value.len());
        payload.extend_from_slice(key);
        payload.extend_from_slice(value);
        self.call_key(key, h, &payload)
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

    fn read_for_copy(&mut self, key: &[u8], flag: u32) -> Result<Option<(Vec<u8>, u64, u64)>> {
        check_key(key)?;
        let mut h = RequestHeader::new(Op::Get, 0, 0);
        h.flags |= flag;
        let reply = self.call_key(key, h, &[])?;
        match reply.header.status() {
            Status::Ok => Ok(Some((reply.payload, reply.header.generation, u64::from(reply.header.more)))),
            Status::Missing => Ok(None),
            s => Err(error_of(s, &reply)),
        }
    }

    /// Handover or copy, second step (on the key's new replica): stores the value under
    /// the generation and TTL it had, unless the key holds that generation or a newer one.
    #[doc(hidden)]
    pub fn handover_import(&mut self, key: &[u8], value: &[u8], generation: u64, ttl_ms: u64) -> Result<()> {
        check_key(key)?;
        let mut h = RequestHeader::new(Op::Put, 0, 0);
        h.flags |= flags::IMPORT;
        h.if_equal = generation;
        if ttl_ms > 0 {
            h.flags |= flags::HAS_TTL;
            h.ttl_or_limit = ttl_ms;
        }
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
        let mut h = RequestHeader::new(Op::Delete, 0, 0);
        h.flags |= flags::MIGRATE | flags::IF_EQUAL;
        h.if_equal = generation;
        let reply = self.call_key(key, h, &[])?;
        match reply.header.status() {
            Status::Ok => Ok(true),
            Status::ConditionFailed => Ok(false),
            s => Err(error_of(s, &reply)),
        }
    }

    pub fn get(&mut self, key: &[u8]) -> Result<Option<Value>> {
        match self.get_with(key, &GetOptions::default())? {
            GetResult::Value(v) => Ok(Some(v)),
            GetResult::Missing => Ok(None),
            GetResult::Unchanged { .. } => Err(Error::new(Status::Internal, "unconditional get reported unchanged")),
        }
    }

    pub fn get_with(&mut self, key: &[u8], opts: &GetOptions) -> Result<GetResult> {
        check_key(key)?;
        get_result(self.call_key(key, get_header(opts), &[])?)
    }

    /// Like [`Client::get_with`], but receives the value (or its range) only when it is at
    /// most `max_len` bytes: a longer one stays on the server, and the answer gives its
    /// length and generation, so that the caller can read it in ranges pinned to that
    /// generation. What one call can make the caller hold is bounded before it knows the
    /// value's size.
    pub fn get_at_most(&mut self, key: &[u8], opts: &GetOptions, max_len: usize) -> Result<GetAtMost> {
        check_key(key)?;
        let reply = self.call_key_into(key, get_header(opts), &[], Receive::OwnedAtMost(max_len))?;
        if reply.withheld {
            let h = &reply.header;
            return Ok(GetAtMost::TooLong { len: reply.len, generation: h.generation, size: h.value_size });
        }
        get_result(reply).map(GetAtMost::Got)
    }

    /// Reads a value (or a byte range of it) straight into `buf`, without an intermediate
    /// copy for large values. When `buf` is too small, nothing is written and the result
    /// says how many bytes are needed; the value stays on the server.
    pub fn get_into(&mut self, key: &[u8], opts: &GetOptions, buf: &mut [u8]) -> Result<GetInto> {
        check_key(key)?;
        let h = get_header(opts);
        get_into_result(self.call_key_into(key, h, &[], Receive::Into(Sink::new(buf)))?)
    }

    /// Stores many values with up to `depth` requests in flight: one wait for many
    /// round trips. Results are per item, in order.
    pub fn put_many(&mut self, items: &[(&[u8], &[u8])], depth: usize) -> Vec<Result<u64>> {
        self.pipelined(items.len(), depth, |i| {
            let (key, value) = items[i];
            if value.len() as u64 > MAX_VALUE_LEN {
                return Err(Error::new(
                    Status::ValueTooLarge,
                    format!("{} bytes > limit {MAX_VALUE_LEN}", value.len()),
                ));
            }
            Ok((Op::Put, key, value, Receive::Owned))
        })
        .into_iter()
        .map(|r| {
            let reply = r?;
            match reply.header.status() {
                Status::Ok => Ok(reply.header.generation),
                s => Err(error_of(s, &reply)),
            }
        })
        .collect()
    }

    /// Reads many values with up to `depth` requests in flight. `None`: missing.
    pub fn get_many(&mut self, keys: &[&[u8]], depth: usize) -> Vec<Result<Option<Value>>> {
        self.pipelined(keys.len(), depth, |i| Ok((Op::Get, keys[i], &[], Receive::Owned)))
            .into_iter()
            .map(|r| {
                let reply = r?;
                match reply.header.status() {
                    Status::Ok => Ok(Some(Value {
                        generation: reply.header.generation,
                        size: reply.header.value_size,
                        data: reply.payload,
                    })),
                    Status::Missing => Ok(None),
                    s => Err(error_of(s, &reply)),
                }
            })
            .collect()
    }

    /// Submits `n` requests (what `item` says of each), keeping at most `depth` in flight,
    /// and collects the replies. In a cluster, a request that a view change or a lost
    /// server turned back is sent again on its own (see [`Client::call_key_into`]), and
    /// writes the keys' primaries took are copied to their other replicas.
    fn pipelined<'a>(
        &mut self,
        n: usize,
        depth: usize,
        item: impl Fn(usize) -> Result<(Op, &'a [u8], &'a [u8], Receive)>,
    ) -> Vec<Result<Reply>> {
        let mut results = self.pipelined_once(n, depth, &item);
        if self.cluster.is_some() {
            let mut to_copy = Vec::new();
            for (i, result) in results.iter_mut().enumerate() {
                let turned_back = match result {
                    Ok(r) => matches!(r.header.status(), Status::Moved | Status::ViewChanged | Status::KeyMoving),
                    Err(e) => e.status == Status::Unavailable,
                };
                let Ok((op, key, payload, receive)) = item(i) else { continue };
                if turned_back {
                    *result = check_key(key)
                        .and_then(|()| self.call_key_into(key, RequestHeader::new(op, 0, 0), payload, receive));
                } else if result.as_ref().is_ok_and(|r| op == Op::Put && r.header.status() == Status::Ok)
                    && self.conn.copies_writes()
                {
                    to_copy.push(i);
                }
            }
            self.copy_batch(&to_copy, depth, &item, &mut results);
        }
        results
    }

    /// Copies the writes of a batch that the keys' primaries took (items `which` of
    /// `results`) to the keys' other replicas, pipelined as the batch was. A write whose
    /// copy did not land at once, or whose key is moving, is then copied on its own
    /// ([`Client::copy_write`], which waits out view changes).
    fn copy_batch<'a>(
        &mut self,
        which: &[usize],
        depth: usize,
        item: &impl Fn(usize) -> Result<(Op, &'a [u8], &'a [u8], Receive)>,
        results: &mut [Result<Reply>],
    ) {
        let mut alone = Vec::new();
        let mut in_flight = std::collections::VecDeque::new();
        let depth = depth.max(1);
        for &i in which {
            let (Ok((_, key, payload, _)), Ok(reply)) = (item(i), &results[i]) else { continue };
            let (now, then) = self.conn.replicas_of(key);
            if !then.is_empty() {
                alone.push(i);
                continue;
            }
            let mut copy = RequestHeader::new(Op::Put, 0, 0);
            copy.flags = flags::IMPORT;
            copy.if_equal = reply.header.generation;
            for &server in now.iter().skip(1) {
                if in_flight.len() == depth {
                    let (j, id) = in_flight.pop_front().unwrap();
                    if !self.conn.wait(id).is_ok_and(|r| r.header.status() == Status::Ok) {
                        alone.push(j);
                    }
                }
                match self.submit_key(key, copy, payload, Receive::Owned, server) {
                    Ok(id) => in_flight.push_back((i, id)),
                    Err(_) => alone.push(i),
                }
            }
        }
        for (j, id) in in_flight {
            if !self.conn.wait(id).is_ok_and(|r| r.header.status() == Status::Ok) {
                alone.push(j);
            }
        }
        alone.sort_unstable();
        alone.dedup();
        let started = std::time::Instant::now();
        for i in alone {
            let Ok((op, key, payload, _)) = item(i) else { continue };
            let copied = match &results[i] {
                Ok(reply) => {
                    let primary = self.conn.replicas_of(key).0[0];
                    self.copy_write(
                        key,
                        &RequestHeader::new(op, 0, 0),
                        payload,
                        reply,
                        primary,
                        started,
                        &mut Vec::new(),
                    )
                }
                Err(_) => continue,
            };
            if let Err(e) = copied {
                results[i] = Err(e);
            }
        }
    }

    fn pipelined_once<'a>(
        &mut self,
        n: usize,
        depth: usize,
        item: &impl Fn(usize) -> Result<(Op, &'a [u8], &'a [u8], Receive)>,
    ) -> Vec<Result<Reply>> {
        // Connected (anew, if a server was lost or the view changed) once for the whole
        // batch: a new connection while requests are in flight on the old one would lose them.
        if let Err(e) = self.live() {
            return (0..n).map(|_| Err(e.clone())).collect();
        }
        let submit = |c: &mut Self, i: usize| {
            let (op, key, payload, receive) = item(i)?;
            c.submit_batched(op, key, payload, receive)
        };
        let depth = depth.max(1);
        let mut results: Vec<Option<Result<Reply>>> = (0..n).map(|_| None).collect();
        let mut in_flight = std::collections::VecDeque::new();
        for i in 0..n {
            if in_flight.len() == depth {
                let (j, id) = in_flight.pop_front().unwrap();
                results[j] = Some(self.conn.wait(id));
            }
            match submit(self, i) {
                Ok(id) => in_flight.push_back((i, id)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (j, id) in in_flight {
            results[j] = Some(self.conn.wait(id));
        }
        results.into_iter().map(|r| r.unwrap()).collect()
    }

    /// Registers `[base, base+len)` with the transport so that puts from it and gets into
    /// it move without on-the-fly registration (zero copy for large values).
    ///
    /// # Safety
    /// The memory must stay valid until [`Client::deregister`] or the client is dropped.
    /// Device memory needs no registration (it moves through the client's pinned
    /// buffers): registering it does nothing.
    pub unsafe fn register(&mut self, base: *mut u8, len: usize) -> Result<()> {
        if len > 0 && crate::gpu::kind_of(base as usize) != crate::gpu::MemoryKind::Host {
            return Ok(());
        }
        // SAFETY: the caller keeps the memory valid until it is deregistered (this function's contract).
        unsafe {
            self.conn.register(base, len)?;
            self.regions.push((base as usize, len));
            Ok(())
        }
    }

    pub fn deregister(&mut self, base: *mut u8) -> Result<()> {
        if crate::gpu::kind_of(base as usize) != crate::gpu::MemoryKind::Host {
            return Ok(());
        }
        self.regions.retain(|r| r.0 != base as usize);
        self.conn.deregister(base)
    }

    /// Reads many values into the given buffers, with up to `depth` requests in flight.
    pub fn get_many_into(&mut self, keys: &[&[u8]], bufs: &mut [&mut [u8]], depth: usize) -> Vec<Result<GetInto>> {
        assert_eq!(keys.len(), bufs.len(), "one buffer per key");
        let sinks: Vec<Sink> = bufs.iter_mut().map(|b| Sink::new(b)).collect();
        self.pipelined(keys.len(), depth, |i| Ok((Op::Get, keys[i], &[], Receive::Into(sinks[i]))))
            .into_iter()
            .map(|r| get_into_result(r?))
            .collect()
    }

    /// Starts one request of a batch: keys travel inline, so batches take keys up to
    /// `INLINE_KEY_MAX`.
    fn submit_batched(&mut self, op: Op, key: &[u8], payload: &[u8], receive: Receive) -> Result<u64> {
        check_key(key)?;
        if key.len() > INLINE_KEY_MAX {
            return Err(Error::new(
                Status::Invalid,
                format!("batched operations take keys up to {INLINE_KEY_MAX} bytes"),
            ));
        }
        let mut h = RequestHeader::new(op, 0, 0);
        h.key_len = key.len() as u32;
        let (server, shard) = self.conn.route(key);
        self.conn.submit_into(server, shard, h, key, payload, receive)
    }

    /// Deletes a key; `true` if it existed.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool> {
        match self.delete_with(key, WriteCondition::None)? {
            DeleteResult::Deleted { existed } => Ok(existed),
            DeleteResult::ConditionFailed => {
                Err(Error::new(Status::Internal, "unconditional delete reported a failed condition"))
            }
        }
    }

    pub fn delete_with(&mut self, key: &[u8], condition: WriteCondition) -> Result<DeleteResult> {
        check_key(key)?;
        let mut h = RequestHeader::new(Op::Delete, 0, 0);
        apply_write_condition(&mut h, condition);
        let reply = self.call_key(key, h, &[])?;
        match reply.header.status() {
            Status::Ok => Ok(DeleteResult::Deleted { existed: reply.header.value_size != 0 }),
            Status::ConditionFailed => Ok(DeleteResult::ConditionFailed),
            s => Err(error_of(s, &reply)),
        }
    }

    /// Deletes every key in the range on every shard; returns how many were removed.
    pub fn delete_range(&mut self, range: &KeyRange) -> Result<u64> {
        let mut removed = 0;
        for (server, shard) in self.all_shards() {
            // Each request removes a bounded batch; repeat while the shard says more remain.
            loop {
                let reply = self.call_range(server, shard, Op::DeleteRange, &range.min, range.max.as_deref(), 0)?;
                removed += reply.header.value_size;
                if reply.header.more == 0 {
                    break;
                }
            }
        }
        Ok(removed)
    }

    /// Every key in `range`, in order, with sizes. (Holds them all: for a range that may
    /// hold many keys, page through it with [`Client::list_page`].)
    pub fn list(&mut self, range: &KeyRange) -> Result<Vec<ListEntry>> {
        let mut all = Vec::new();
        let mut from = None;
        loop {
            let (page, next) = self.list_page(range, from.as_ref())?;
            all.extend(page);
            match next {
                Some(cursor) => from = Some(cursor),
                None => break,
            }
        }
        all.sort_by(|a, b| a.key.cmp(&b.key));
        // While keys move between a cluster's servers, one may be listed by both.
        all.dedup_by(|a, b| a.key == b.key);
        Ok(all)
    }

    /// One page of the keys in `range` (`from` `None` for the first): one shard's, in key
    /// order, as many as one reply carries (at most 1 MiB of keys), and where the next page
    /// starts (`None` after the last). Shards are listed in the order of their servers'
    /// addresses, so the pages list each key once; across shards they are not in order.
    /// A cursor may be taken on by another client of the same servers (the gateway pages
    /// with whichever of its clients is free); a shard whose server left meanwhile is
    /// passed over.
    pub fn list_page(
        &mut self,
        range: &KeyRange,
        from: Option<&ListCursor>,
    ) -> Result<(Vec<ListEntry>, Option<ListCursor>)> {
        // (address, shard, server index), in address order.
        let mut shards: Vec<(&str, usize, usize)> = self
            .all_shards()
            .into_iter()
            .map(|(server, shard)| (self.conn.servers[server].node.as_str(), shard, server))
            .collect();
        shards.sort_unstable();
        let (index, min) = match from {
            None => (0, &range.min),
            Some(c) => {
                let at = shards.partition_point(|&(node, shard, _)| (node, shard) < (c.node.as_str(), c.shard));
                match shards.get(at) {
                    Some(&(node, shard, _)) if (node, shard) == (c.node.as_str(), c.shard) => (at, &c.min),
                    _ => (at, &range.min),
                }
            }
        };
        let Some(&(_, shard, server)) = shards.get(index) else { return Ok((Vec::new(), None)) };
        let next_shard = shards.get(index + 1).map(|&(node, shard, _)| (node.to_string(), shard));
        let node = self.conn.servers[server].node.clone();
        let reply = self.call_range(server, shard, Op::List, min, range.max.as_deref(), proto::LIST_BATCH as u64)?;
        let entries = proto::decode_list_entries(&reply.payload).map_err(|e| Error::new(Status::Transport, e))?;
        let after_last = entries.last().filter(|_| reply.header.more != 0).and_then(|(last, _)| key_after(last));
        let next = match after_last {
            Some(min) => Some(ListCursor { node, shard, min }),
            None => next_shard.map(|(node, shard)| ListCursor { node, shard, min: range.min.clone() }),
        };
        Ok((entries.into_iter().map(|(key, size)| ListEntry { key, size }).collect(), next))
    }

    /// Per-server, per-shard statistics and totals, as JSON.
    pub fn stats(&mut self) -> Result<serde_json::Value> {
        self.live()?;
        let mut servers = Vec::new();
        let (mut keys, mut used, mut capacity) = (0u64, 0u64, 0u64);
        let in_view: Vec<usize> = (0..self.conn.servers.len()).filter(|&i| self.in_view(i)).collect();
        for server in in_view {
            let mut shards = Vec::new();
            for shard in 0..self.conn.servers[server].shards() {
                let id = self.conn.submit(server, shard, RequestHeader::new(Op::Stats, 0, 0), &[], &[])?;
                let reply = self.conn.wait(id)?;
                if reply.header.status() != Status::Ok {
                    return Err(error_of(reply.header.status(), &reply));
                }
                let v: serde_json::Value = serde_json::from_slice(&reply.payload)
                    .map_err(|e| Error::new(Status::Transport, format!("bad stats JSON: {e}")))?;
                keys += v["keys"].as_u64().unwrap_or(0);
                used += v["used_bytes"].as_u64().unwrap_or(0);
                capacity += v["capacity_bytes"].as_u64().unwrap_or(0);
                shards.push(v);
            }
            servers.push(json!({"node": self.conn.servers[server].node, "shards": shards}));
        }
        Ok(json!({"keys": keys, "used_bytes": used, "capacity_bytes": capacity, "servers": servers}))
    }

    /// Sends raw header bytes and payload to one shard and returns the reply status and
    /// payload text. For protocol tests: it lets a test speak malformed requests.
    #[doc(hidden)]
    pub fn raw_request(
        &mut self,
        shard: usize,
        header: &[u8],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Status, String)> {
        let id = self.conn.submit_raw(0, shard, header, &[], payload, Receive::Owned)?;
        let reply = self.conn.wait_for(id, timeout)?;
        Ok((reply.header.status(), String::from_utf8_lossy(&reply.payload).into_owned()))
    }

    /// Sends raw header bytes to one shard without waiting for the reply (which is then
    /// never read): for tests that play a client that does not receive.
    #[doc(hidden)]
    pub fn raw_submit(&mut self, shard: usize, header: &[u8], payload: &[u8]) -> Result<u64> {
        self.conn.submit_raw(0, shard, header, &[], payload, Receive::Owned)
    }

    /// This client's session with server `node`, while connected to it (tests: whether a
    /// connection was kept across a view change).
    #[doc(hidden)]
    pub fn session_with(&self, node: &str) -> Option<u64> {
        self.conn.server_named(node).map(|i| self.conn.session(i))
    }

    /// The session credential and next request id, for building raw requests.
    #[doc(hidden)]
    pub fn raw_session(&self) -> (u64, u64) {
        (self.conn.session(0), self.conn.next_request_id())
    }

    fn all_shards(&mut self) -> Vec<(usize, usize)> {
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
    fn call_key(&mut self, key: &[u8], h: RequestHeader, payload: &[u8]) -> Result<Reply> {
        self.call_key_into(key, h, payload, Receive::Owned)
    }

    /// Sends a single-key request and waits for its reply. In a cluster, it settles what
    /// a view change makes servers answer: it follows a key that moved ("moved": asks the
    /// server named), and sends again when the view changed or the key is being handed
    /// over, or when a server it routed to is gone and the view changed meanwhile, until
    /// the call's timeout.
    fn call_key_into(&mut self, key: &[u8], h: RequestHeader, payload: &[u8], receive: Receive) -> Result<Reply> {
        if self.cluster.is_none() {
            return self.send_key(key, h, payload, receive, None).map(|(reply, _)| reply);
        }
        let started = std::time::Instant::now();
        let (first, mut staged) = match self.stage_copies(key, &h, payload) {
            Some((primary, sent)) => {
                // The primary's first attempt goes beside the staged copies, and all are
                // waited for before anything (a retry's reconnect) could replace the
                // connection they use: the caller's value is read by no one after return.
                let first = self
                    .submit_key(key, h, payload, receive, primary)
                    .and_then(|id| self.conn.wait(id))
                    .map(|r| (r, primary));
                (Some(first), self.staged(sent))
            }
            None => (None, Vec::new()),
        };
        let settled = self.settle_key(key, h, payload, receive, started, first);
        let (reply, primary) = match settled {
            Ok(settled) => settled,
            Err(e) => {
                self.discard_staged(key, &mut staged);
                return Err(e);
            }
        };
        let copied = h.flags & (flags::IMPORT | flags::MIGRATE) == 0 && reply.header.status() == Status::Ok;
        let copy = match Op::from_u8(h.op) {
            Some(Op::Put) if copied => self.copy_write(key, &h, payload, &reply, primary, started, &mut staged),
            Some(Op::Delete) if copied && reply.header.value_size != 0 => {
                self.copy_write(key, &h, payload, &reply, primary, started, &mut staged)
            }
            _ => Ok(()),
        };
        self.discard_staged(key, &mut staged);
        copy.map(|()| reply)
    }

    /// Sends a large put's value to the key's replicas other than its primary as staged
    /// copies ([`flags::STAGE`]), to go while the primary takes it: the copy that follows
    /// the primary's reply is then a small publish, not the value again. Returns the
    /// key's primary and the (server, request id) of each copy submitted; None, and
    /// nothing sent, for smaller values (where a copy costs the same round trip), long
    /// keys, keys with one replica, or a primary that cannot be reached.
    fn stage_copies(&mut self, key: &[u8], h: &RequestHeader, payload: &[u8]) -> Option<(usize, Vec<(usize, u64)>)> {
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
    fn staged(&mut self, sent: Vec<(usize, u64)>) -> Vec<(String, u64)> {
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
    fn discard_staged(&mut self, key: &[u8], staged: &mut Vec<(String, u64)>) {
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
    fn copy_write(
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
        let primary_node = self.conn.servers[primary].node.clone();
        let mut holding = vec![primary_node.clone()];
        let mut pause = CLUSTER_RETRY_MIN;
        loop {
            if !self.conn.copies_writes() {
                return Ok(());
            }
            let (now, then) = self.conn.replicas_of(key);
            // A write taken by a server that is the key's primary no more (its lease
            // lapsed, or it was paused, and the view moved on) is not copied: the key's
            // new primary may have given out newer generations meanwhile.
            let still_primary =
                [now.first(), then.first()].into_iter().flatten().any(|&s| self.conn.servers[s].node == primary_node);
            if !still_primary {
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
    fn settle_key(
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

    /// Reads the cluster's view from etcd now (a server said it changed; the watch may
    /// not have heard yet). If etcd cannot be reached, the watch's view stands.
    fn refresh_view(&self) {
        if let Some((watch, _)) = &self.cluster {
            let _ = watch.refresh();
        }
    }

    /// One attempt of a single-key request: routed by the view, or to `asked` (a server
    /// the key's previous owner named, [`flags::ASKING`]). Returns the reply and the
    /// server that gave it.
    fn send_key(
        &mut self,
        key: &[u8],
        mut h: RequestHeader,
        payload: &[u8],
        receive: Receive,
        asked: Option<&str>,
    ) -> Result<(Reply, usize)> {
        self.live()?;
        let target = match asked.and_then(|node| self.conn.server_named(node)) {
            Some(s) => Some(s),
            None if self.cluster.is_some() => self.failover_target(key, Op::from_u8(h.op) == Some(Op::Get)),
            None => None,
        };
        let server = match target {
            Some(s) => {
                h.flags |= flags::ASKING;
                s
            }
            None => self.conn.route(key).0,
        };
        let id = self.submit_key(key, h, payload, receive, server)?;
        Ok((self.conn.wait(id)?, server))
    }

    /// Where a cluster key's request goes when its primary's connection is lost: a read
    /// to the first other replica reachable, a write to the key's primary under the
    /// placement keys are moving to (which exists once the lost server's lease lapsed).
    /// None: to the primary.
    fn failover_target(&self, key: &[u8], read: bool) -> Option<usize> {
        // The common case costs a hash and no allocation: the primary is there.
        let primary = self.conn.route(key).0;
        if !self.conn.is_dead(primary) {
            return None;
        }
        let (now, then) = self.conn.replicas_of(key);
        let alive = |s: &&usize| !self.conn.is_dead(**s);
        if read {
            now.iter().skip(1).chain(then.iter()).find(alive).copied()
        } else {
            then.first().filter(|s| **s != primary).filter(alive).copied()
        }
    }

    /// Submits a single-key request to the key's shard on `server`.
    fn submit_key(
        &mut self,
        key: &[u8],
        mut h: RequestHeader,
        payload: &[u8],
        receive: Receive,
        server: usize,
    ) -> Result<u64> {
        let shard = proto::shard_of(key, self.conn.servers[server].shards());
        h.key_len = key.len() as u32;
        if key.len() <= INLINE_KEY_MAX {
            self.conn.submit_into(server, shard, h, key, payload, receive)
        } else {
            h.flags |= flags::KEY_IN_PAYLOAD;
            let payload = if payload.is_empty() { key } else { payload };
            self.conn.submit_into(server, shard, h, &[], payload, receive)
        }
    }

    fn call_range(
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
}

/// A cluster's view; an error when it places keys on no server.
fn view_of(watch: &cluster::Watch) -> Result<cluster::View> {
    let view = watch.view();
    if view.placement.members.is_empty() {
        return Err(Error::new(Status::Unavailable, format!("cluster {} has no live servers", watch.url())));
    }
    Ok(view)
}

fn check_key(key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(Error::new(Status::Invalid, "keys must be at least 1 byte"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::new(Status::KeyTooLarge, format!("{} bytes > limit {MAX_KEY_LEN}", key.len())));
    }
    Ok(())
}

/// The least key greater than `key` (`None`: there is none): `key` and a 0 byte, or for
/// a key of the longest length, `key` with its trailing 0xff bytes dropped and the last
/// byte left incremented.
fn key_after(key: &[u8]) -> Option<Vec<u8>> {
    if key.len() < MAX_KEY_LEN {
        return Some([key, &[0]].concat());
    }
    let mut next = key.to_vec();
    while next.last() == Some(&0xff) {
        next.pop();
    }
    let last = next.last_mut()?;
    *last += 1;
    Some(next)
}

fn get_result(reply: Reply) -> Result<GetResult> {
    match reply.header.status() {
        Status::Ok => Ok(GetResult::Value(Value {
            generation: reply.header.generation,
            size: reply.header.value_size,
            data: reply.payload,
        })),
        Status::Missing => Ok(GetResult::Missing),
        Status::Unchanged => Ok(GetResult::Unchanged { generation: reply.header.generation }),
        s => Err(error_of(s, &reply)),
    }
}

fn get_into_result(reply: Reply) -> Result<GetInto> {
    match reply.header.status() {
        Status::Ok if reply.withheld => Ok(GetInto::TooSmall { needed: reply.len }),
        Status::Ok => {
            Ok(GetInto::Value { len: reply.len, generation: reply.header.generation, size: reply.header.value_size })
        }
        Status::Missing => Ok(GetInto::Missing),
        Status::Unchanged => Ok(GetInto::Unchanged { generation: reply.header.generation }),
        s => Err(error_of(s, &reply)),
    }
}

fn get_header(opts: &GetOptions) -> RequestHeader {
    let mut h = RequestHeader::new(Op::Get, 0, 0);
    if let Some(g) = opts.if_not_equal {
        h.flags |= flags::IF_NOT_EQUAL;
        h.if_not_equal = g;
    }
    if let Some(g) = opts.if_equal {
        h.flags |= flags::IF_EQUAL;
        h.if_equal = g;
    }
    if let Some(r) = opts.range {
        h.flags |= flags::HAS_RANGE;
        h.range_start = r.start;
        h.range_end = r.end;
    }
    h
}

fn apply_write_condition(h: &mut RequestHeader, c: WriteCondition) {
    match c {
        WriteCondition::None => {}
        WriteCondition::IfEqual(g) => {
            h.flags |= flags::IF_EQUAL;
            h.if_equal = g;
        }
        WriteCondition::IfAbsent => h.flags |= flags::IF_ABSENT,
    }
}

fn error_of(status: Status, reply: &Reply) -> Error {
    let status = if status as i8 >= 0 { Status::Internal } else { status };
    Error::new(status, String::from_utf8_lossy(&reply.payload).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_after_is_the_least_greater_key() {
        assert_eq!(key_after(b"a"), Some(b"a\0".to_vec()));
        assert_eq!(key_after(&[0xff]), Some(vec![0xff, 0]));
        // At the longest length a 0 byte cannot be added: the key is incremented instead.
        let mut longest = vec![b'k'; MAX_KEY_LEN];
        assert_eq!(key_after(&longest), Some([&longest[..MAX_KEY_LEN - 1], b"l"].concat()));
        longest[MAX_KEY_LEN - 2..].fill(0xff);
        assert_eq!(key_after(&longest), Some([&longest[..MAX_KEY_LEN - 3], b"l"].concat()));
        assert_eq!(key_after(&vec![0xff; MAX_KEY_LEN]), None);
    }
}
