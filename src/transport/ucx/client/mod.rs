//! The client's UCX link: one UCX worker, one endpoint per (server, shard), and the
//! table of requests in flight. Replies are matched to requests by id in the AM callback;
//! large replies are received (rendezvous) straight into the request's reply buffer.
//!
//! Buffer ownership: a request's header bytes live in its pooled `Pending` box and its
//! payload in the caller's slice, both untouched until the send completes; `wait` does not
//! return before both the send and the reply have completed, or the request's server
//! failed. A box goes back to the pool only once UCX called its send complete: closing an
//! endpoint does not end its sends when UCX cannot close it by force (shared memory
//! without failure detection, see [`Worker::ep_lacks_failure_detection`]), and such a send
//! goes out once the peer drains its queue (a paused server that resumes), from the box
//! as it is then. A put's value sent that way would be read from the caller's slice after
//! the call returned: a link left with such a put makes no progress again (`abandoned`),
//! every server counts as lost, and the next call connects anew; dropping the link
//! destroys the worker, which cancels the put unsent.

mod callbacks;

use callbacks::{on_ep_error, on_reply, on_sent};

use crate::client::requests::Requests;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::time::{Duration, Instant};

use crate::client::link::{
    abort_request, gone_reason, shares_no_memory, Deadline, Link, Liveness, Payload, Receive, Reply, Sink,
};
use crate::client::tunables::ABORT_GRACE;
use crate::client::{ClientOptions, DevicePath};
use crate::error::{Error, Result, Status};
use crate::proto::bootstrap::{hex_decode, Welcome};
use crate::proto::{self, ReplyHeader};
use crate::transport::ucx::{self, sys, Memory, Started, Worker};
use crate::transport::Poller;

struct Pending {
    state: *mut State,
    server: usize,
    ep: sys::ucp_ep_h,
    msg: Vec<u8>,
    /// A put: until `sent`, the server may still be pulling its value from caller memory.
    is_put: bool,
    sent: bool,
    receiving: bool,
    sink: Option<Sink>,
    /// The longest successful payload this request takes (see `Receive::limit`).
    limit: Option<usize>,
    reply: Option<Result<Reply>>,
}

struct RecvTag {
    state: *mut State,
    id: u64,
}

struct EpTag {
    state: *mut State,
    server: usize,
}

/// Shared with UCX callbacks through a raw pointer; only touched on the client's thread.
struct State {
    worker: *const Worker,
    /// By request id.
    pending: Requests<Box<Pending>>,
    /// Set by an endpoint's error callback: the connection to that server is lost.
    failed: Vec<Option<String>>,
    /// Caller memory registered with UCX: (base, len, handle).
    registered: Vec<(usize, usize, sys::ucp_mem_h)>,
    /// What UCX is told a caller's device memory is: CUDA memory where its CUDA
    /// transports run, else host memory (tests' posing device memory is).
    device_memory: Memory,
}

impl State {
    /// The registration covering `[ptr, ptr+len)`, or null (UCX then registers on the fly).
    fn memh_for(&self, ptr: *const u8, len: usize) -> sys::ucp_mem_h {
        let (p, end) = (ptr as usize, ptr as usize + len);
        self.registered.iter().find(|(b, l, _)| *b <= p && end <= b + l).map_or(ptr::null_mut(), |r| r.2)
    }
}

/// The state UCX callbacks reach through a raw pointer, owned as a raw allocation rather
/// than a `Box` (whose uniqueness those accesses would break); freed on drop. Accesses
/// through `Deref` are short and never overlap a callback (callbacks run only inside
/// progress, which holds no reference to the state).
struct StatePtr(*mut State);

impl StatePtr {
    fn new(state: State) -> StatePtr {
        StatePtr(Box::into_raw(Box::new(state)))
    }
}

impl std::ops::Deref for StatePtr {
    type Target = State;
    fn deref(&self) -> &State {
        // SAFETY: allocated in `new`, freed only in Drop; see the type's comment on aliasing.
        unsafe { &*self.0 }
    }
}

impl std::ops::DerefMut for StatePtr {
    fn deref_mut(&mut self) -> &mut State {
        // SAFETY: as for Deref.
        unsafe { &mut *self.0 }
    }
}

impl Drop for StatePtr {
    fn drop(&mut self) {
        // SAFETY: allocated by Box in `new` and freed once, here.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

struct ServerEps {
    node: String,
    eps: Vec<sys::ucp_ep_h>,
    #[allow(clippy::vec_box)] // boxed: UCX holds their addresses
    _tags: Vec<Box<EpTag>>,
    dead: Option<String>,
}

pub struct UcxLink {
    // Field order matters for Drop: endpoints are closed in Drop, then the worker is
    // destroyed (UCX may then complete sends it still held, writing into their boxes),
    // then `state` and the boxes go.
    worker: Box<Worker>,
    state: StatePtr,
    servers: Vec<ServerEps>,
    #[allow(clippy::vec_box)] // boxed: UCX holds their addresses while in flight
    pool: Vec<Box<Pending>>,
    /// Given-up requests whose send UCX has not completed yet: reused once it has.
    #[allow(clippy::vec_box)]
    zombies: Vec<Box<Pending>>,
    poller: Poller,
    liveness: Liveness,
    /// The longest request header UCX can carry ([`Worker::max_am_header`]).
    max_header: usize,
    /// Why this link makes no progress again: UCX holds a put's value, in memory the
    /// caller has back (see the module's docs).
    abandoned: Option<String>,
}

// SAFETY: the worker is made in serialized mode (`UCS_THREAD_MODE_SERIALIZED`), which
// allows use from any one thread at a time; a link is driven through `&mut self` only
// and is not Sync, and its raw pointers point at memory the link owns.
unsafe impl Send for UcxLink {}

impl UcxLink {
    /// `local_ip`: this host's address toward the servers, where UCX's tcp transport
    /// listens when the servers run it (see [`ucx::Tcp`]). `elsewhere`: a server that
    /// offers shared memory this client cannot map, which a failure then names.
    pub fn connect(
        welcomes: &[Welcome],
        liveness: Liveness,
        local_ip: Option<std::net::IpAddr>,
        opts: &ClientOptions,
        elsewhere: Option<&str>,
    ) -> Result<UcxLink> {
        if let Some(node) = elsewhere.filter(|_| ucx::env_allows_only_shared_memory()) {
            return Err(Error::new(
                Status::Transport,
                format!("UCX_TLS allows only shared memory, and {}; run this client as the server's user on its host, or let UCX_TLS include tcp", shares_no_memory(node)),
            ));
        }
        Self::connect_to(welcomes, liveness, local_ip, opts).map_err(|mut e| {
            // UCX tried the server's shared memory anyway (its only transport, or one this
            // client's UCX_TLS forced): say why it could not map it. UCX's errors reach us
            // as their status text.
            if let Some(node) =
                elsewhere.filter(|_| e.message.contains(&ucx::status_string(ucx::sys::UCS_ERR_SHMEM_SEGMENT)))
            {
                e.message = format!("{} ({})", e.message, shares_no_memory(node));
            } else if e.message.contains(&ucx::status_string(ucx::sys::UCS_ERR_UNREACHABLE))
                && welcomes.iter().any(|w| !w.ucx_tcp)
            {
                e.message = format!(
                    "{} (the server runs UCX without its tcp transport, as by default: between hosts serve with \
                     --transport fabric, or with --ucx-tcp on a trusted network)",
                    e.message
                );
            }
            e
        })
    }

    fn connect_to(
        welcomes: &[Welcome],
        liveness: Liveness,
        local_ip: Option<std::net::IpAddr>,
        poll: &ClientOptions,
    ) -> Result<UcxLink> {
        if poll.local_shared_memory {
            tracing::debug!("UCX over shared memory only: the servers share this process's host, namespaces and user");
        }
        let tcp = match local_ip {
            Some(ip) if welcomes.iter().all(|w| w.ucx_tcp) => ucx::Tcp::on_interface_of(ip),
            _ => ucx::Tcp::Off,
        };
        let settings = match (poll.local_shared_memory, poll.device_path) {
            (false, _) => &[][..],
            (true, DevicePath::Staged) => ucx::LOCAL_SHARED_MEMORY,
            (true, DevicePath::Transport) => ucx::LOCAL_SHARED_MEMORY_WITH_CUDA,
        };
        let worker = Box::new(Worker::with_settings(&tcp, settings)?);
        let state = StatePtr::new(State {
            worker: &*worker,
            pending: Requests::default(),
            failed: Vec::new(),
            registered: Vec::new(),
            device_memory: if worker.moves_cuda_memory() { Memory::Cuda } else { Memory::Host },
        });
        let state_ptr: *mut State = state.0;
        // SAFETY: state is boxed and outlives the worker's callbacks (Drop closes every
        // endpoint and stops progressing before state and worker are freed).
        unsafe { worker.set_am_handler(proto::AM_REPLY, Some(on_reply), state_ptr as *mut c_void)? };
        let max_header = worker.max_am_header()?;
        let mut link = UcxLink {
            max_header,
            state,
            servers: Vec::new(),
            pool: Vec::new(),
            zombies: Vec::new(),
            poller: Poller::new(poll.poll, poll.spin),
            liveness,
            worker,
            abandoned: None,
        };
        link.connect_servers(welcomes)?;
        Ok(link)
    }

    /// Makes an endpoint to every shard of each server, numbered after those connected.
    fn connect_servers(&mut self, welcomes: &[Welcome]) -> Result<()> {
        for welcome in welcomes {
            let server = self.servers.len();
            // Before its endpoints exist: their error callback looks its server up here.
            self.state.failed.push(None);
            let mut eps = Vec::new();
            let mut tags = Vec::new();
            let mut failed = None;
            for shard_addr in &welcome.shards {
                let mut tag = Box::new(EpTag { state: self.state.0, server });
                // SAFETY: tag is kept alive in ServerEps until the endpoint is closed.
                let connected = hex_decode(shard_addr).and_then(|bytes| unsafe {
                    self.worker.connect(&bytes, Some(on_ep_error), &mut *tag as *mut EpTag as *mut c_void)
                });
                match connected {
                    Ok((ep, _detects_failure)) => {
                        eps.push(ep);
                        tags.push(tag);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            self.servers.push(ServerEps { node: welcome.node.clone(), eps, _tags: tags, dead: None });
            if let Some(e) = failed {
                // The endpoints made are closed (their tags live on with the server, which
                // keeps its place so that later servers' numbers still match).
                self.fail_server(server, e.status, e.message.clone());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Closes a server's endpoints (completing what is in flight with errors) and fails
    /// every request still waiting on it.
    fn fail_server(&mut self, server: usize, status: Status, why: String) {
        let conn = &mut self.servers[server];
        if conn.dead.is_none() {
            conn.dead = Some(why.clone());
            // An abandoned link's endpoints go with its worker (closing progresses it).
            if self.abandoned.is_none() {
                for &ep in &conn.eps {
                    // SAFETY: each endpoint is closed once: `dead` is set just before.
                    unsafe { self.worker.close_ep(ep) };
                }
            }
        }
        for p in self.state.pending.values_mut().filter(|p| p.server == server) {
            // Not `sent`: only UCX says when it let go of the box (see the module's docs).
            if p.receiving {
                // Closing the endpoint should have completed the receive; if UCX still
                // holds the buffer, leak it rather than free memory it may write.
                if let Some(Ok(r)) = p.reply.take() {
                    std::mem::forget(r.payload);
                }
                p.receiving = false;
            }
            if p.reply.is_none() {
                p.reply = Some(Err(Error::new(status, why.clone())));
            }
        }
    }
}

impl UcxLink {
    /// Ends request `id` for a caller who stops waiting, so that once this returns nothing
    /// reads or writes the caller's memory again: a put the server may still be pulling is
    /// aborted (the server discards the value) and waited for until UCX completed its send;
    /// a reply still arriving into the caller's buffer is let finish. What does not end
    /// within [`ABORT_GRACE`] is cut off by closing the server's endpoints (and a put UCX
    /// still holds abandons the link: see the module's docs).
    fn give_up(&mut self, id: u64, err: Error) -> Error {
        let Some(p) = self.state.pending.get(&id) else { return err };
        let server = p.server;
        if p.is_put && !p.sent && self.servers[server].dead.is_none() {
            let (abort_id, header) = abort_request(id, &p.msg);
            let shard = self.servers[server].eps.iter().position(|&e| e == p.ep).unwrap_or(0);
            let confirmed =
                self.submit(abort_id, server, shard, &header, &[], Payload::empty(), Receive::Owned).is_ok()
                    && self.progress_until(server, ABORT_GRACE, |st| st.pending.get(&id).is_some_and(|p| p.sent));
            self.forget_request(abort_id);
            if !confirmed {
                let why = format!(
                    "{} did not confirm the abort of a timed-out put; connection closed",
                    self.servers[server].node
                );
                self.fail_server(server, Status::Timeout, why);
            }
        }
        let receiving_into_caller = |st: &State| st.pending.get(&id).is_some_and(|p| p.receiving && p.sink.is_some());
        if receiving_into_caller(&self.state)
            && !self.progress_until(server, ABORT_GRACE, |st| !receiving_into_caller(st))
        {
            let why = format!(
                "a reply from {} into the caller's buffer did not end; connection closed",
                self.servers[server].node
            );
            self.fail_server(server, Status::Timeout, why);
        }
        self.forget_request(id);
        // The next call connects again: the server may be alive but no longer hear this
        // connection (a shard that replaced a stuck worker has a new address); one that
        // was only slow costs a bootstrap.
        if self.servers[server].dead.is_none() {
            let why = format!("{} did not answer in time; the next call reconnects", self.servers[server].node);
            self.fail_server(server, Status::Timeout, why);
        }
        err
    }

    /// Progresses until `done` holds, `limit` passes or the connection to `server` fails;
    /// true when it held.
    fn progress_until(&mut self, server: usize, limit: Duration, done: impl Fn(&State) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while !done(&self.state) {
            if Instant::now() >= deadline || self.state.failed[server].is_some() {
                return done(&self.state);
            }
            if !self.progress() {
                std::thread::yield_now();
            }
        }
        true
    }

    /// Drops a request nobody waits for; a reply arriving later is ignored. Its box is
    /// reused only once UCX has completed its send (and no receive writes into it).
    fn forget_request(&mut self, id: u64) {
        if let Some(mut p) = self.state.pending.remove(&id) {
            p.reply = None;
            if p.receiving {
                // fail_server closed the endpoint, which completes the receive; if UCX
                // still holds the buffer, leak it rather than free memory it may write.
                std::mem::forget(p);
            } else {
                self.retire(p);
            }
        }
    }

    /// Takes back the box of a request nobody waits for any more: to the pool once its
    /// send completed, else kept until it does; a put whose value UCX still holds
    /// abandons the link (see the module's docs).
    fn retire(&mut self, p: Box<Pending>) {
        if p.sent {
            self.pool.push(p);
            return;
        }
        if p.is_put && self.abandoned.is_none() {
            let why = format!(
                "a put's value is still queued by UCX for {}, which was given up; the connection is made anew",
                self.servers[p.server].node
            );
            tracing::warn!("{why}");
            self.abandoned = Some(why.clone());
            for server in 0..self.servers.len() {
                self.fail_server(server, Status::Unavailable, why.clone());
            }
        }
        self.zombies.push(p);
    }

    /// Progresses the worker, unless the link was abandoned; whether anything happened.
    fn progress(&self) -> bool {
        self.abandoned.is_none() && self.worker.progress() != 0
    }

    /// Whether a request's caller may have its answer: the reply is in (and done being
    /// written), and its send completed, or its server failed (then the send, if UCX still
    /// holds it, keeps the box: see the module's docs).
    fn finished(&self, p: &Pending) -> bool {
        p.reply.is_some() && !p.receiving && (p.sent || self.servers[p.server].dead.is_some())
    }

    fn reclaim_zombies(&mut self) {
        let mut i = 0;
        while i < self.zombies.len() {
            if self.zombies[i].sent {
                let p = self.zombies.swap_remove(i);
                self.pool.push(p);
            } else {
                i += 1;
            }
        }
    }
}

impl Link for UcxLink {
    fn submit(
        &mut self,
        id: u64,
        server: usize,
        shard: usize,
        header: &[u8],
        header_tail: &[u8],
        payload: Payload,
        receive: Receive,
    ) -> Result<()> {
        if (payload.is_device() || receive.sink().is_some_and(|s| s.device)) && !self.takes_device_memory() {
            return Err(Error::new(Status::Invalid, "this UCX link does not move device memory (no CUDA transports)"));
        }
        let conn = &self.servers[server];
        if let Some(why) = &conn.dead {
            return Err(Error::new(Status::Unavailable, format!("connection to {} lost: {why}", conn.node)));
        }
        let ep = *conn.eps.get(shard).ok_or_else(|| Error::new(Status::Invalid, format!("no shard {shard}")))?;
        if header.len() + header_tail.len() > self.max_header {
            // UCX would send it garbled, corrupting memory here and at the server.
            return Err(Error::new(
                Status::Invalid,
                format!(
                    "a {}-byte request header is longer than UCX carries ({} bytes)",
                    header.len() + header_tail.len(),
                    self.max_header
                ),
            ));
        }
        self.reclaim_zombies();
        let mut p = self.pool.pop().unwrap_or_else(|| {
            Box::new(Pending {
                state: ptr::null_mut(),
                server: 0,
                ep: ptr::null_mut(),
                msg: Vec::new(),
                is_put: false,
                sent: false,
                receiving: false,
                sink: None,
                limit: None,
                reply: None,
            })
        });
        p.state = self.state.0;
        p.server = server;
        p.ep = ep;
        p.is_put = header.get(3) == Some(&(proto::Op::Put as u8)) && !payload.is_empty();
        p.sent = false;
        p.receiving = false;
        p.sink = receive.sink();
        p.limit = receive.limit();
        p.reply = None;
        p.msg.clear();
        p.msg.extend_from_slice(header);
        p.msg.extend_from_slice(header_tail);
        let user = &mut *p as *mut Pending as *mut c_void;
        // Only put payloads (values) may go by rendezvous; keys and range bounds always go
        // eager, so the server gets them inside the callback.
        let is_put = header.get(3) == Some(&(proto::Op::Put as u8));
        let am_flags = sys::UCP_AM_SEND_FLAG_REPLY | if is_put { 0 } else { sys::UCP_AM_SEND_FLAG_EAGER };
        let (memory, memh) = if payload.is_device() {
            (self.state.device_memory, ptr::null_mut())
        } else {
            (Memory::Host, self.state.memh_for(payload.as_ptr(), payload.len()))
        };
        // SAFETY: the header lives in the boxed Pending (stable address) and the payload in
        // the caller's buffer (host memory, or device memory told to UCX as such); both stay
        // untouched until `sent` is set (see module docs).
        let started = unsafe {
            self.worker.am_send(
                ep,
                proto::AM_REQUEST,
                &p.msg,
                (payload.as_ptr(), payload.len(), memory),
                am_flags,
                Some(on_sent),
                user,
                memh,
            )
        };
        match started {
            Ok(Started::Done) => p.sent = true,
            Ok(Started::Pending) => {}
            Err(e) => {
                self.pool.push(p);
                return Err(e);
            }
        }
        self.state.pending.insert(id, p);
        Ok(())
    }

    unsafe fn register(&mut self, base: *mut u8, len: usize) -> Result<()> {
        if self.state.registered.iter().any(|r| r.0 == base as usize) {
            return Err(Error::new(Status::Invalid, "region already registered"));
        }
        let memh = self.worker.mem_map(base, len)?;
        self.state.registered.push((base as usize, len, memh));
        Ok(())
    }

    fn deregister(&mut self, base: *mut u8) -> Result<()> {
        let i = self
            .state
            .registered
            .iter()
            .position(|r| r.0 == base as usize)
            .ok_or_else(|| Error::new(Status::Invalid, "region not registered"))?;
        let (_, _, memh) = self.state.registered.remove(i);
        // SAFETY: memh came from mem_map on this worker and is unmapped once; no request
        // is in flight between synchronous calls.
        unsafe { self.worker.mem_unmap(memh) };
        Ok(())
    }

    fn wait_for(&mut self, id: u64, timeout: Duration) -> Result<Reply> {
        let mut deadline = Deadline::new(timeout);
        loop {
            let (done, server) = match self.state.pending.get(&id) {
                Some(p) => (self.finished(p), p.server),
                None => return Err(Error::new(Status::Internal, format!("unknown request {id}"))),
            };
            if done {
                let mut p = self.state.pending.remove(&id).unwrap();
                let reply = p.reply.take().unwrap();
                self.retire(p);
                return reply;
            }
            if let Some(why) = self.state.failed[server].clone() {
                self.fail_server(server, Status::Unavailable, format!("connection lost: {why}"));
                continue;
            }
            if self.poller.clock_due() {
                let (now, passed) = deadline.read();
                if passed {
                    let node = self.servers[server].node.clone();
                    return Err(self.give_up(
                        id,
                        Error::new(Status::Timeout, format!("no answer from {node} within {timeout:?}")),
                    ));
                }
                if let Some(gone) = self.liveness.next_gone(now) {
                    self.fail_server(gone, Status::Unavailable, gone_reason(&self.servers[gone].node));
                    continue;
                }
            }
            let did = self.progress();
            self.poller.after_progress(&*self.worker, did, deadline.max_sleep())?;
        }
    }

    fn is_dead(&self, server: usize) -> bool {
        self.servers[server].dead.is_some()
    }

    fn poll(&mut self) {
        if let Some(gone) = self.liveness.next_gone(Instant::now()) {
            self.fail_server(gone, Status::Unavailable, gone_reason(&self.servers[gone].node));
        }
        for server in 0..self.servers.len() {
            if self.servers[server].dead.is_none() {
                if let Some(why) = self.state.failed[server].clone() {
                    self.fail_server(server, Status::Unavailable, format!("connection lost: {why}"));
                }
            }
        }
        self.progress();
    }

    fn answered(&self, id: u64) -> bool {
        self.state.pending.get(&id).is_none_or(|p| self.finished(p))
    }

    fn add_servers(
        &mut self,
        welcomes: &[Welcome],
        bootstraps: Vec<std::net::TcpStream>,
        _timeout: Duration,
    ) -> Result<()> {
        for (w, stream) in welcomes.iter().zip(bootstraps) {
            self.liveness.add(stream, &w.node)?;
        }
        self.connect_servers(welcomes)
    }

    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        let fd = crate::transport::Transport::event_fd(&*self.worker);
        (fd >= 0).then_some(fd)
    }

    fn arm(&self) -> bool {
        crate::transport::Transport::arm(&*self.worker).unwrap_or(false)
    }

    fn set_spin(&mut self, spin: Duration) {
        self.poller.set_spin(spin);
    }

    fn takes_device_memory(&self) -> bool {
        self.state.device_memory == Memory::Cuda || crate::gpu::device_memory_is_host_memory()
    }

    fn takes_short_headers(&self) -> bool {
        true
    }

    /// UCX (seen with 1.13.1) aborts a server (`ucp_request.c:684 ... got REP message`)
    /// when a client's tcp endpoint fails while the server's wireup reply to it is still
    /// queued, so a client that connects and closes at once could bring the server down.
    /// After a round trip that window is closed.
    fn round_trip_before_use(&self) -> bool {
        true
    }
}

impl Drop for UcxLink {
    fn drop(&mut self) {
        for (_, _, memh) in std::mem::take(&mut self.state.registered) {
            // SAFETY: registered on this worker, unmapped once.
            unsafe { self.worker.mem_unmap(memh) };
        }
        for conn in &mut self.servers {
            // An abandoned link's endpoints go with its worker (closing progresses it).
            if conn.dead.is_none() && self.abandoned.is_none() {
                conn.dead = Some("closed".into());
                for &ep in &conn.eps {
                    // SAFETY: each endpoint is closed once: `dead` is set just before.
                    unsafe { self.worker.close_ep(ep) };
                }
            }
        }
    }
}
