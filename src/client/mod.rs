//! The synchronous Rust client. One `Client` is used by one thread at a time (`&mut self`);
//! open one per thread for parallelism. Each request goes straight to the worker that owns
//! the key's shard: servers are chosen by rendezvous hashing, shards by key hash.
//!
//! This file holds `Client` and its calls; the rest is split by concern: `options` (what
//! calls take and return), `routing` (where a key goes, reconnects, a cluster's view),
//! `replicas` (settling a cluster's turned-back calls, servers' copies and handovers), `batches` (pipelined calls), `device`
//! (CUDA memory), and below them `conn` (one connection to the servers) over a `link`
//! (implemented by `transport::ucx::client` and `transport::fabric::client`) with its
//! `requests` table.

mod batches;
mod conn;
mod device;
mod device_staging;
pub(crate) mod link;
pub(crate) mod options;
mod parts;
mod replicas;
pub(crate) mod requests;
mod routing;
pub mod tunables;

use std::time::Duration;

use serde_json::json;

use crate::cluster;
use crate::error::{Error, Result, Status};
pub use crate::proto::ByteRange;
use crate::proto::{self, flags, Op, RequestHeader, INLINE_KEY_MAX, MAX_KEY_LEN, MAX_VALUE_LEN};
use conn::Connection;
pub use conn::TEST_CONNECT_HOLD_ENV;
use link::{Payload, Receive, Reply, Sink};
pub use options::*;
pub use replicas::{CopiedOut, CopyInFlight, CopyOut, ReplicaCopy};
pub use tunables::DEVICE_CHUNK;
use tunables::{BATCH_DEPTH, RECONNECT_BACKOFF_MIN};

/// A client connection. Use it from one thread at a time; it may move between threads.
///
/// When a server is lost (it died, restarted, or left a call unanswered in time), the calls in
/// flight to it fail with `Unavailable`, and the next call connects again (a new
/// bootstrap with every server, the caller's registrations redone), trying at most once
/// per backoff step: [`RECONNECT_BACKOFF_MIN`] doubling up to [`tunables::RECONNECT_BACKOFF_MAX`].
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
    device_staging: Option<Box<device_staging::DeviceStaging>>,
}

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

    /// Stores `value` under a condition and/or with a TTL (`opts`). A failed condition
    /// writes nothing and is a result, not an error; the generation it returns is what a
    /// compare-and-set names next.
    ///
    /// ```
    /// # let server = remote_dram::Server::start(remote_dram::ServerConfig {
    /// #     listen: "127.0.0.1:0".into(), workers: 1, memory: 64 << 20,
    /// #     hugepages: remote_dram::store::HugePages::Off, ..Default::default() })?;
    /// # let mut client = remote_dram::Client::connect(&server.local_addr().to_string(), Default::default())?;
    /// use remote_dram::client::{PutOptions, WriteCondition, WriteResult};
    ///
    /// let first = PutOptions { condition: WriteCondition::IfAbsent, ..Default::default() };
    /// let WriteResult::Written { generation } = client.put_with(b"lock", b"owner-a", &first)? else {
    ///     panic!("the key was free");
    /// };
    /// // A second writer that expects the key to be absent loses.
    /// assert_eq!(client.put_with(b"lock", b"owner-b", &first)?, WriteResult::ConditionFailed);
    /// // Compare-and-set: only the holder of the current generation replaces the value.
    /// let cas = PutOptions { condition: WriteCondition::IfEqual(generation), ..Default::default() };
    /// assert!(matches!(client.put_with(b"lock", b"owner-a, renewed", &cas)?, WriteResult::Written { .. }));
    /// # drop(client); server.stop();
    /// # Ok::<(), remote_dram::Error>(())
    /// ```
    pub fn put_with(&mut self, key: &[u8], value: &[u8], opts: &PutOptions) -> Result<WriteResult> {
        self.put_payload(key, value.into(), opts)
    }

    /// [`Client::put_with`] of a value in host memory, or in device memory that the
    /// connection's transport moves itself.
    fn put_payload(&mut self, key: &[u8], value: Payload, opts: &PutOptions) -> Result<WriteResult> {
        check_key(key)?;
        if value.len() as u64 > MAX_VALUE_LEN {
            return Err(Error::new(Status::ValueTooLarge, format!("{} bytes > limit {MAX_VALUE_LEN}", value.len())));
        }
        if let Some(streamed) = value.host_bytes().and_then(|bytes| self.put_streamed(key, bytes, opts)) {
            return streamed;
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
    fn call_put(&mut self, key: &[u8], value: Payload, h: RequestHeader) -> Result<Reply> {
        if key.len() <= INLINE_KEY_MAX {
            return self.call_key_into(key, h, value, Receive::Owned);
        }
        let value = value
            .host_bytes()
            .ok_or_else(|| Error::new(Status::Invalid, "a value in device memory takes a key that travels inline"))?;
        let mut payload = Vec::with_capacity(key.len() + value.len());
        payload.extend_from_slice(key);
        payload.extend_from_slice(value);
        self.call_key(key, h, &payload)
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
        let reply = self.call_key_into(key, get_header(opts), Payload::empty(), Receive::OwnedAtMost(max_len))?;
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
        get_into_result(self.call_key_into(key, h, Payload::empty(), Receive::Into(Sink::new(buf)))?)
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

    /// Deletes every key in the range; returns how many were removed. A plain server's
    /// shards each delete the range in bounded batches. In a cluster the keys are listed
    /// and each is deleted through its primary, as [`Client::delete`] does: the primary
    /// orders the delete after the key's writes and copies it, with its generation, to
    /// every replica, so no replica keeps a key the others lost and no copy in flight
    /// brings it back (docs/cluster.md, "Clients").
    pub fn delete_range(&mut self, range: &KeyRange) -> Result<u64> {
        if self.cluster.is_some() {
            return self.delete_range_key_by_key(range);
        }
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

    fn delete_range_key_by_key(&mut self, range: &KeyRange) -> Result<u64> {
        let mut removed = 0;
        let mut from = None;
        loop {
            // A key is listed by each of its replicas: the second delete finds it gone.
            let (page, next) = self.list_page(range, from.as_ref())?;
            let keys: Vec<&[u8]> = page.iter().map(|e| e.key.as_slice()).collect();
            for existed in self.delete_many(&keys, BATCH_DEPTH) {
                removed += existed? as u64;
            }
            match next {
                Some(cursor) => from = Some(cursor),
                None => return Ok(removed),
            }
        }
    }

    /// Every key in `range`, in order, with sizes. (Holds them all: for a range that may
    /// hold many keys, page through it with [`Client::list_page`].)
    ///
    /// ```
    /// # let server = remote_dram::Server::start(remote_dram::ServerConfig {
    /// #     listen: "127.0.0.1:0".into(), workers: 1, memory: 64 << 20,
    /// #     hugepages: remote_dram::store::HugePages::Off, ..Default::default() })?;
    /// # let mut client = remote_dram::Client::connect(&server.local_addr().to_string(), Default::default())?;
    /// use remote_dram::client::KeyRange;
    ///
    /// for layer in ["ckpt/7/layer.1", "ckpt/7/layer.0", "ckpt/8/layer.0"] {
    ///     client.put(layer.as_bytes(), &[0u8; 16])?;
    /// }
    /// let keys: Vec<Vec<u8>> = client.list(&KeyRange::prefix(b"ckpt/7/"))?.into_iter().map(|e| e.key).collect();
    /// assert_eq!(keys, [b"ckpt/7/layer.0".to_vec(), b"ckpt/7/layer.1".to_vec()]);
    /// # drop(client); server.stop();
    /// # Ok::<(), remote_dram::Error>(())
    /// ```
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
    /// passed over. In a cluster, so is a lost member's while fewer members are lost than
    /// each key has replicas: each of its keys is listed by another replica.
    pub fn list_page(
        &mut self,
        range: &KeyRange,
        from: Option<&ListCursor>,
    ) -> Result<(Vec<ListEntry>, Option<ListCursor>)> {
        // (address, shard, server index), in address order.
        let mut shards: Vec<(String, usize, usize)> = self
            .all_shards()
            .into_iter()
            .map(|(server, shard)| (self.conn.servers[server].node.clone(), shard, server))
            .collect();
        shards.sort_unstable();
        let (mut index, mut min) = match from {
            None => (0, range.min.clone()),
            Some(c) => {
                let at =
                    shards.partition_point(|(node, shard, _)| (node.as_str(), *shard) < (c.node.as_str(), c.shard));
                match shards.get(at) {
                    Some((node, shard, _)) if (node, *shard) == (&c.node, c.shard) => (at, c.min.clone()),
                    _ => (at, range.min.clone()),
                }
            }
        };
        loop {
            let Some((node, shard, server)) = shards.get(index).cloned() else { return Ok((Vec::new(), None)) };
            let next_shard = shards.get(index + 1).map(|(node, shard, _)| (node.clone(), *shard));
            let reply =
                match self.call_range(server, shard, Op::List, &min, range.max.as_deref(), proto::LIST_BATCH as u64) {
                    Err(e) if e.status == Status::Unavailable && self.conn.lost_and_covered(server) => {
                        tracing::debug!("listing passes over lost member {node}: {e}");
                        (index, min) = (index + 1, range.min.clone());
                        continue;
                    }
                    reply => reply?,
                };
            let entries = proto::decode_list_entries(&reply.payload).map_err(|e| Error::new(Status::Transport, e))?;
            let after_last = entries.last().filter(|_| reply.header.more != 0).and_then(|(last, _)| key_after(last));
            let next = match after_last {
                Some(min) => Some(ListCursor { node, shard, min }),
                None => next_shard.map(|(node, shard)| ListCursor { node, shard, min: range.min.clone() }),
            };
            return Ok((entries.into_iter().map(|(key, size)| ListEntry { key, size }).collect(), next));
        }
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
        let id = self.conn.submit_raw(0, shard, header, &[], payload.into(), Receive::Owned)?;
        let reply = self.conn.wait_for(id, timeout)?;
        Ok((reply.header.status(), String::from_utf8_lossy(&reply.payload).into_owned()))
    }

    /// Sends raw header bytes to one shard without waiting for the reply (which is then
    /// never read): for tests that play a client that does not receive.
    #[doc(hidden)]
    pub fn raw_submit(&mut self, shard: usize, header: &[u8], payload: &[u8]) -> Result<u64> {
        self.conn.submit_raw(0, shard, header, &[], payload.into(), Receive::Owned)
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
