//! Thin owning wrappers over UCX: a context with one worker (single-thread mode), its
//! endpoints, registered memory and active-message sends and receives. Everything here is
//! used by exactly one thread, except [`Waker`], which only calls `ucp_worker_signal`.
//! Below it, the backend's two sides: `client/` (the client's link over UCX) and
//! `server/` (the shard worker over UCX).

pub(crate) mod client;
pub mod ep_watch;
pub(crate) mod server;
pub mod sys;
mod transports;

use std::ffi::{c_void, CStr};
use std::os::fd::RawFd;
use std::ptr;

use crate::error::{Error, Result, Status};
use sys::*;
pub use transports::{
    env_allows_only_shared_memory, env_enables_tcp, offers_shared_memory, shared_memory_scope, Tcp,
    LOCAL_SHARED_MEMORY, LOCAL_SHARED_MEMORY_WITH_CUDA,
};
use transports::{shared_memory_only, HARDENING, POOL_SEGMENT, SPEED};

pub fn status_string(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(ucs_status_string(status)).to_string_lossy().into_owned() }
}

fn check(status: ucs_status_t, what: &str) -> Result<()> {
    if status == UCS_OK {
        Ok(())
    } else {
        Err(Error::new(Status::Transport, format!("{what}: {}", status_string(status))))
    }
}

/// UCS_PTR_IS_ERR / UCS_PTR_STATUS from ucs/type/status.h (macros bindgen cannot see).
pub fn ptr_status(p: ucs_status_ptr_t) -> Option<ucs_status_t> {
    let v = p as usize;
    if v >= (UCS_ERR_LAST as isize) as usize {
        Some(v as isize as ucs_status_t)
    } else {
        None
    }
}

/// UCX's configuration from the environment, and whether shared-memory transports detect a
/// dead peer: only when `UCX_MM_ERROR_HANDLING=y` (UCX 1.22). Then a server frees what a
/// dead client's shared-memory endpoint held (about 50 KB of mappings per client, else
/// kept), and same-host clients may use shared memory with the default `UCX_TLS`. Off by
/// default: with it on, UCX picks another protocol for large shared-memory puts, and a
/// writer killed mid-put then often leaves the shard's receive queue stuck
/// (`transport::ucx::server::queue_probe` recovers, but every client of that shard pays one timeout).
fn read_config() -> Result<(*mut ucp_config_t, bool)> {
    let mut config: *mut ucp_config_t = ptr::null_mut();
    // SAFETY: NULL prefix and file mean the defaults; config is an out-parameter.
    check(unsafe { ucp_config_read(ptr::null(), ptr::null(), &mut config) }, "ucp_config_read")?;
    let detects = std::env::var("UCX_MM_ERROR_HANDLING").is_ok_and(|v| matches!(v.as_str(), "y" | "yes" | "1" | "on"));
    Ok((config, detects))
}

/// Sets UCX variable `name` (without `UCX_`) in `config`: UCP's own, or a transport's,
/// which UCX applies when it opens that transport.
fn modify_config(config: *mut ucp_config_t, name: &str, value: &str) -> Result<()> {
    let nul = |_| Error::new(Status::Invalid, "a UCX setting with a NUL byte");
    let (n, v) = (std::ffi::CString::new(name).map_err(nul)?, std::ffi::CString::new(value).map_err(nul)?);
    // SAFETY: config came from ucp_config_read; both strings are NUL-terminated.
    check(unsafe { ucp_config_modify(config, n.as_ptr(), v.as_ptr()) }, &format!("ucp_config_modify {name}"))
}

extern "C" {
    // shim.c
    fn rdram_ucx_log_to_stderr();
}

/// Sends UCX's own log lines to stderr instead of stdout (UCX's default, where they mixed
/// into the bytes `rdram get` prints), unless `UCX_LOG_FILE` names a place. Once per
/// process, before its first context.
fn log_to_stderr_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_LOG_FILE").is_none() {
            // SAFETY: pushes a handler with UCX's log-handler signature; no context exists yet.
            unsafe { rdram_ucx_log_to_stderr() };
        }
    });
}

/// Where a buffer handed to UCX lives. Device memory is said to be so, so that UCX moves
/// it with its CUDA transports and never reads it on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Host,
    Cuda,
}

impl Memory {
    /// The request parameter's field mask and memory type for a buffer of this kind.
    fn param(self) -> (u32, ucs_memory_type_t) {
        match self {
            Memory::Host => (0, UCS_MEMORY_TYPE_HOST),
            Memory::Cuda => (UCP_OP_ATTR_FIELD_MEMORY_TYPE, UCS_MEMORY_TYPE_CUDA),
        }
    }
}

/// The outcome of starting a non-blocking operation.
pub enum Started {
    /// Completed inside the call; the callback will not run.
    Done,
    /// In flight; the callback runs from a later progress call.
    Pending,
}

fn started(p: ucs_status_ptr_t, what: &str) -> Result<Started> {
    if p.is_null() {
        return Ok(Started::Done);
    }
    match ptr_status(p) {
        Some(s) => Err(Error::new(Status::Transport, format!("{what}: {}", status_string(s)))),
        None => Ok(Started::Pending),
    }
}

/// A worker's raw handle: for the calls made while the [`Worker`] itself cannot be borrowed
/// (it is being progressed), or on a worker other than the one at hand (a request that
/// came by a retired worker is received through that one).
#[derive(Clone, Copy)]
pub struct WorkerHandle(ucp_worker_h);

impl WorkerHandle {
    /// Runs the worker's callbacks; returns nonzero if anything happened.
    ///
    /// # Safety
    /// The worker is alive, and this is its owning thread.
    pub unsafe fn progress(self) -> u32 {
        // SAFETY: as the caller promises.
        unsafe { ucp_worker_progress(self.0) }
    }

    /// Receives a rendezvous active message's data into `dest`, memory of kind `memory`.
    ///
    /// # Safety
    /// The worker is alive and this is its thread; `desc` is a rendezvous descriptor from
    /// this worker's AM callback; `memh` (or null) is a mapping of this worker's context;
    /// `dest` stays valid and untouched by anyone else until the receive completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn am_recv_data(
        self,
        desc: *mut c_void,
        dest: *mut u8,
        len: usize,
        memory: Memory,
        cb: ucp_am_recv_data_nbx_callback_t,
        user_data: *mut c_void,
        memh: ucp_mem_h,
    ) -> Result<Started> {
        // SAFETY: the caller keeps this function's documented contract.
        unsafe {
            let (memory_mask, memory_type) = memory.param();
            let mut mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | memory_mask;
            if !memh.is_null() {
                mask |= UCP_OP_ATTR_FIELD_MEMH;
            }
            let param = ucp_request_param_t {
                op_attr_mask: mask,
                cb: ucp_request_param_t__bindgen_ty_1 { recv_am: cb },
                user_data,
                memh,
                memory_type,
                ..Default::default()
            };
            let p = ucp_am_recv_data_nbx(self.0, desc, dest as *mut c_void, len, &param);
            started(p, "ucp_am_recv_data_nbx")
        }
    }
}

pub struct Worker {
    context: ucp_context_h,
    /// Whether shared-memory transports detect a dead peer (see [`read_config`]).
    shm_detects_failure: bool,
    /// The transport list in force: `UCX_TLS`, or the one the worker was made with.
    tls: Option<String>,
    worker: ucp_worker_h,
    event_fd: RawFd,
    waker: Waker,
}

// SAFETY: a Worker may move to the thread that will own it; it is never shared (not Sync).
unsafe impl Send for Worker {}

impl Worker {
    /// A context and a worker with active messages and wakeup, in serialized mode: used
    /// by one thread at a time, which need not be the thread that created it (a client
    /// handle may move between threads; single-thread mode would forbid that). No RMA: a
    /// peer must not read or write this process's memory one-sidedly (see `HARDENING` in this module).
    pub fn new(tcp: &Tcp) -> Result<Worker> {
        Self::with_settings(tcp, &[])
    }

    /// A server's worker: like [`Worker::new`], and it can watch the endpoints UCX makes
    /// for its peers ([`ep_watch`], which needs UCX's stream feature).
    pub fn serving(tcp: &Tcp) -> Result<Worker> {
        Self::build(tcp, &[], UCP_FEATURE_STREAM)
    }

    /// Like [`Worker::new`], with UCX `settings` (names without `UCX_`) in place of the
    /// defaults; a variable the user set in the environment wins over ours.
    pub fn with_settings(tcp: &Tcp, settings: &[(&str, &str)]) -> Result<Worker> {
        Self::build(tcp, settings, 0)
    }

    fn build(tcp: &Tcp, settings: &[(&str, &str)], more_features: ucp_feature) -> Result<Worker> {
        let params = ucp_params_t {
            field_mask: (UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64,
            features: (UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | more_features) as u64,
            mt_workers_shared: 0,
            ..Default::default()
        };
        log_to_stderr_once();
        let mut context: ucp_context_h = ptr::null_mut();
        let (config, shm_detects_failure) = read_config()?;
        let mut tls = std::env::var("UCX_TLS").ok();
        let tcp_settings = tcp.settings();
        let ours = HARDENING.iter().chain(SPEED).copied().chain(tcp_settings.iter().map(|(n, v)| (*n, v.as_str())));
        let all: Vec<(&str, &str)> = ours.chain(settings.iter().copied()).collect();
        for (i, &(name, value)) in all.iter().enumerate() {
            // The environment wins, and a later setting of ours replaces an earlier one.
            if std::env::var_os(format!("UCX_{name}")).is_some() || all[i + 1..].iter().any(|(n, _)| *n == name) {
                continue;
            }
            if let Err(e) = modify_config(config, name, value) {
                // SAFETY: config came from ucp_config_read and is released once.
                unsafe { ucp_config_release(config) };
                return Err(e);
            }
            if name == "TLS" {
                tls = Some(value.to_owned());
            }
        }
        if let Err(e) = modify_config(config, "SEG_SIZE", &POOL_SEGMENT.to_string()) {
            // SAFETY: config came from ucp_config_read and is released once.
            unsafe { ucp_config_release(config) };
            return Err(e);
        }
        // SAFETY: params is fully initialised for the fields named in field_mask; ucp_init
        // is an inline wrapper around ucp_init_version with the header's API version;
        // config came from ucp_config_read and is released right after.
        let status = unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut context) };
        // SAFETY: as above.
        unsafe { ucp_config_release(config) };
        check(status, "ucp_init")?;
        let wparams = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut worker: ucp_worker_h = ptr::null_mut();
        // SAFETY: context is valid; wparams initialised as above.
        if let Err(e) = check(unsafe { ucp_worker_create(context, &wparams, &mut worker) }, "ucp_worker_create") {
            // SAFETY: context was created above and has no workers.
            unsafe { ucp_cleanup(context) };
            return Err(e);
        }
        let waker = Waker(std::sync::Arc::new(std::sync::Mutex::new(Some(WorkerPtr(worker)))));
        let mut w = Worker { context, shm_detects_failure, tls, worker, event_fd: -1, waker };
        let mut fd: i32 = -1;
        // SAFETY: worker valid, fd is an out-parameter.
        check(unsafe { ucp_worker_get_efd(worker, &mut fd) }, "ucp_worker_get_efd")?;
        w.event_fd = fd;
        Ok(w)
    }

    pub fn raw(&self) -> ucp_worker_h {
        self.worker
    }

    pub fn context(&self) -> ucp_context_h {
        self.context
    }

    /// Whether this worker's context moves CUDA device memory itself (UCX's CUDA
    /// transports loaded: a CUDA driver and a GPU, and a transport list that allows them).
    pub fn moves_cuda_memory(&self) -> bool {
        let mut attr = ucp_context_attr_t { field_mask: UCP_ATTR_FIELD_MEMORY_TYPES as u64, ..Default::default() };
        // SAFETY: the context is valid; attr is an in/out parameter.
        let ok = unsafe { ucp_context_query(self.context, &mut attr) } == UCS_OK;
        ok && attr.memory_types & (1u64 << UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// The worker's address, to be handed to peers out of band.
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut attr = ucp_worker_attr_t { field_mask: UCP_WORKER_ATTR_FIELD_ADDRESS as u64, ..Default::default() };
        // SAFETY: worker valid; attr is an in/out parameter.
        check(unsafe { ucp_worker_query(self.worker, &mut attr) }, "ucp_worker_query")?;
        // SAFETY: UCX returned address/length; we copy then release it.
        let bytes = unsafe { std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec() };
        unsafe { ucp_worker_release_address(self.worker, attr.address) };
        Ok(bytes)
    }

    /// The longest active-message user header this worker can send: what UCX reports,
    /// bounded by the pool segment a zero-copy send packs the header into (less room for
    /// UCX's footer; see `transports::POOL_SEGMENT`). UCX (1.22, release builds) checks
    /// neither: a longer header leaves the sender's and the receiver's memory corrupted.
    pub fn max_am_header(&self) -> Result<usize> {
        const FOOTER_ROOM: usize = 64;
        let mut attr =
            ucp_worker_attr_t { field_mask: UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER as u64, ..Default::default() };
        // SAFETY: worker valid; attr is an in/out parameter.
        check(unsafe { ucp_worker_query(self.worker, &mut attr) }, "ucp_worker_query")?;
        Ok(attr.max_am_header.min(POOL_SEGMENT - FOOTER_ROOM))
    }

    /// What progresses this worker without borrowing it: for owners whose callbacks
    /// take `&mut` of a struct that contains the worker (no reference to it may be live
    /// while they run).
    pub fn handle(&self) -> WorkerHandle {
        WorkerHandle(self.worker)
    }

    /// Runs callbacks for completed communication; returns nonzero if anything happened.
    pub fn progress(&self) -> u32 {
        // SAFETY: worker valid; called from the owning thread only.
        unsafe { ucp_worker_progress(self.worker) }
    }

    /// Arms the event fd. `false` means events are pending: progress again before sleeping.
    pub fn arm(&self) -> Result<bool> {
        // SAFETY: worker valid.
        match unsafe { ucp_worker_arm(self.worker) } {
            s if s == UCS_OK => Ok(true),
            s if s == UCS_ERR_BUSY => Ok(false),
            s => Err(Error::new(Status::Transport, format!("ucp_worker_arm: {}", status_string(s)))),
        }
    }

    pub fn event_fd(&self) -> RawFd {
        self.event_fd
    }

    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Hands this worker's waker over to `successor`: the clones already given out wake
    /// `successor` from now on, and this worker gets a waker of its own.
    pub fn hand_waker_to(&mut self, successor: &mut Worker) {
        std::mem::swap(&mut self.waker, &mut successor.waker);
        self.waker.point_at(self.worker);
        successor.waker.point_at(successor.worker);
    }

    /// Installs `cb` for active messages with `id`; `arg` is passed to every call.
    ///
    /// # Safety
    /// `arg` must stay valid, and safe to use from `cb`, for as long as the worker lives.
    pub unsafe fn set_am_handler(&self, id: u16, cb: ucp_am_recv_callback_t, arg: *mut c_void) -> Result<()> {
        // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
        unsafe {
            let param = ucp_am_handler_param_t {
                field_mask: (UCP_AM_HANDLER_PARAM_FIELD_ID
                    | UCP_AM_HANDLER_PARAM_FIELD_CB
                    | UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
                id: id as u32,
                cb,
                arg,
                ..Default::default()
            };
            check(ucp_worker_set_am_recv_handler(self.worker, &param), "ucp_worker_set_am_recv_handler")
        }
    }

    /// Connects to a peer worker by address. With an error callback, peer-failure error
    /// handling is asked for first, so that a vanished peer fails outstanding operations
    /// instead of hanging them; UCX's shared-memory transports cannot detect peer failure,
    /// so when only those are enabled (or they are all UCX finds for this peer: it logs an
    /// error) the endpoint is created without it and the caller's timeouts bound waits.
    /// Without a callback (a worker's probe of itself) it is never asked for.
    /// Returns the endpoint and whether peer failures are detected.
    ///
    /// # Safety
    /// `err_arg` must stay valid for `err_cb` until the endpoint is closed.
    pub unsafe fn connect(
        &self,
        address: &[u8],
        err_cb: ucp_err_handler_cb_t,
        err_arg: *mut c_void,
    ) -> Result<(ucp_ep_h, bool)> {
        // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
        unsafe {
            let mut params = ucp_ep_params_t {
                field_mask: (UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
                address: address.as_ptr() as *const ucp_address_t,
                err_mode: UCP_ERR_HANDLING_MODE_PEER,
                err_handler: ucp_err_handler { cb: err_cb, arg: err_arg },
                ..Default::default()
            };
            let mut ep: ucp_ep_h = ptr::null_mut();
            if err_cb.is_some()
                && !shared_memory_only(self.tls.as_deref(), self.shm_detects_failure)
                && ucp_ep_create(self.worker, &params, &mut ep) == UCS_OK
            {
                return Ok((ep, true));
            }
            params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
            check(ucp_ep_create(self.worker, &params, &mut ep), "ucp_ep_create")?;
            Ok((ep, false))
        }
    }

    /// Closes an endpoint (forcibly: outstanding operations complete with an error) and
    /// progresses until the close finishes.
    ///
    /// # Safety
    /// `ep` is a live endpoint of this worker, closed once.
    pub unsafe fn close_ep(&self, ep: ucp_ep_h) {
        let param = ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS,
            flags: UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: ep belongs to this worker and is closed once.
        let req = unsafe { ucp_ep_close_nbx(ep, &param) };
        if req.is_null() || ptr_status(req).is_some() {
            return;
        }
        // SAFETY: req is a live request handle returned above.
        while unsafe { ucp_request_check_status(req) } == UCS_INPROGRESS {
            self.progress();
        }
        unsafe { ucp_request_free(req) };
    }

    /// Starts closing an endpoint forcibly (its operations in flight complete with an
    /// error) without progressing; returns the request to poll with
    /// [`request_done_free`], if the close did not finish at once.
    ///
    /// # Safety
    /// `ep` is a live endpoint of this worker, closed once and not used afterwards.
    pub unsafe fn close_ep_nb(&self, ep: ucp_ep_h) -> Option<ucs_status_ptr_t> {
        let param = ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS,
            flags: UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: as the caller promises.
        let req = unsafe { ucp_ep_close_nbx(ep, &param) };
        (!req.is_null() && ptr_status(req).is_none()).then_some(req)
    }

    /// Whether `ep` runs only over shared-memory transports that cannot detect a dead
    /// peer here, so was made without peer-failure handling. UCX never fails such an
    /// endpoint, and keeps one its peer connected to until the worker is destroyed, closed
    /// or not ("to enable remote endpoints keep sending"): what it holds (mappings of the
    /// peer's queues, ~50 KB of memory) comes back only with the worker.
    ///
    /// UCX without `UCP_EP_ATTR_FIELD_TRANSPORTS` (Debian's 1.13, with `RDRAM_UCX=system`)
    /// cannot say which transports an endpoint uses: always false there (such endpoints
    /// are never counted, and stay as they did before recycling existed).
    ///
    /// # Safety
    /// As below.
    #[cfg(not(ucx_ep_query_transports))]
    pub unsafe fn ep_lacks_failure_detection(&self, _ep: ucp_ep_h) -> bool {
        false
    }

    /// # Safety
    /// `ep` is a live endpoint of any worker of this process (all share its configuration).
    #[cfg(ucx_ep_query_transports)]
    pub unsafe fn ep_lacks_failure_detection(&self, ep: ucp_ep_h) -> bool {
        if self.shm_detects_failure {
            return false;
        }
        const SHM: [&[u8]; 6] = [b"posix", b"sysv", b"cma", b"self", b"xpmem", b"knem"];
        let mut entries = [ucp_transport_entry_t::default(); 32];
        let mut attr = ucp_ep_attr_t {
            field_mask: UCP_EP_ATTR_FIELD_TRANSPORTS as u64,
            transports: ucp_transports_t {
                entries: entries.as_mut_ptr(),
                num_entries: entries.len() as u32,
                entry_size: std::mem::size_of::<ucp_transport_entry_t>(),
            },
            ..Default::default()
        };
        // SAFETY: ep is live (caller); entries outlives the call and is as large as said.
        if unsafe { ucp_ep_query(ep, &mut attr) } != UCS_OK {
            return false;
        }
        let used = &entries[..(attr.transports.num_entries as usize).min(entries.len())];
        !used.is_empty()
            && used.iter().all(|t| {
                // SAFETY: UCX fills transport_name with a NUL-terminated string it owns for the endpoint's life.
                !t.transport_name.is_null() && SHM.contains(&unsafe { CStr::from_ptr(t.transport_name) }.to_bytes())
            })
    }

    /// Registers `len` bytes at `base` for zero-copy transfers.
    pub fn mem_map(&self, base: *mut u8, len: usize) -> Result<ucp_mem_h> {
        let params = ucp_mem_map_params_t {
            field_mask: (UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64,
            address: base as *mut c_void,
            length: len,
            ..Default::default()
        };
        let mut memh: ucp_mem_h = ptr::null_mut();
        // SAFETY: base..base+len is a live mapping owned by the caller, which keeps it alive
        // until mem_unmap.
        check(unsafe { ucp_mem_map(self.context, &params, &mut memh) }, "ucp_mem_map")?;
        Ok(memh)
    }

    /// # Safety
    /// `memh` came from `mem_map` on this worker and is unmapped once.
    pub unsafe fn mem_unmap(&self, memh: ucp_mem_h) {
        // SAFETY: memh came from mem_map on this context and is unmapped once.
        unsafe { ucp_mem_unmap(self.context, memh) };
    }

    /// Sends an active message: `header`, then the `payload_len` bytes at `payload` of kind
    /// `memory`. Both must stay valid and unchanged until the send completes
    /// (`Started::Done`, or `cb` called).
    ///
    /// # Safety
    /// `ep` is a live endpoint of this worker; the buffers outlive the operation as above.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn am_send(
        &self,
        ep: ucp_ep_h,
        id: u16,
        header: &[u8],
        (payload, payload_len, memory): (*const u8, usize, Memory),
        flags: u32,
        cb: ucp_send_nbx_callback_t,
        user_data: *mut c_void,
        memh: ucp_mem_h,
    ) -> Result<Started> {
        // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
        unsafe {
            let (memory_mask, memory_type) = memory.param();
            let mut mask =
                UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | memory_mask;
            if !memh.is_null() {
                mask |= UCP_OP_ATTR_FIELD_MEMH;
            }
            let param = ucp_request_param_t {
                op_attr_mask: mask,
                flags,
                cb: ucp_request_param_t__bindgen_ty_1 { send: cb },
                user_data,
                memh,
                memory_type,
                ..Default::default()
            };
            let p = ucp_am_send_nbx(
                ep,
                id as u32,
                header.as_ptr() as *const c_void,
                header.len(),
                payload as *const c_void,
                payload_len,
                &param,
            );
            started(p, "ucp_am_send_nbx")
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        *self.waker.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // SAFETY: worker and context were created in new() and are destroyed once, worker
        // first.
        unsafe {
            ucp_worker_destroy(self.worker);
            ucp_cleanup(self.context);
        }
    }
}

/// Wakes a worker sleeping on its event fd, from any thread. Once the worker is dropped,
/// waking is a no-op.
#[derive(Clone)]
pub struct Waker(std::sync::Arc<std::sync::Mutex<Option<WorkerPtr>>>);

struct WorkerPtr(ucp_worker_h);
// SAFETY: ucp_worker_signal is documented as safe to call from any thread; the pointer is
// only used under the mutex while the worker is alive.
unsafe impl Send for WorkerPtr {}

impl Waker {
    fn point_at(&self, worker: ucp_worker_h) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(WorkerPtr(worker));
    }

    pub fn wake(&self) {
        if let Some(w) = &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            // SAFETY: the worker is alive: Worker::drop clears the slot before destroying it.
            unsafe { ucp_worker_signal(w.0) };
        }
    }
}

/// The fields of an AM callback's `param` we use.
pub struct AmInfo {
    pub reply_ep: ucp_ep_h,
    pub rendezvous: bool,
}

/// # Safety
/// `param` is the pointer UCX passed to an AM callback.
pub unsafe fn am_info(param: *const ucp_am_recv_param_t) -> AmInfo {
    // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
    unsafe {
        let p = &*param;
        let reply_ep =
            if p.recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP as u64 != 0 { p.reply_ep } else { ptr::null_mut() };
        AmInfo { reply_ep, rendezvous: p.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 }
    }
}

/// The user header of an AM callback as a slice (UCX leaves the pointer undefined when
/// the length is 0).
///
/// # Safety
/// `header`/`len` are the values UCX passed to the callback; the slice must not outlive it.
pub unsafe fn am_header<'a>(header: *const c_void, len: usize) -> &'a [u8] {
    // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
    unsafe {
        if len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(header as *const u8, len)
        }
    }
}

/// Whether a request without a callback has finished; if so it is freed.
///
/// # Safety
/// `req` is a live request handle, not used again once this returned true.
pub unsafe fn request_done_free(req: ucs_status_ptr_t) -> bool {
    // SAFETY: as the caller promises.
    unsafe {
        if ucp_request_check_status(req) == UCS_INPROGRESS {
            return false;
        }
        ucp_request_free(req);
    }
    true
}

/// Releases a request handle from inside its completion callback.
///
/// # Safety
/// `req` is the request passed to the callback.
pub unsafe fn request_free(req: *mut c_void) {
    // SAFETY: the caller keeps this function's documented contract (handles from this worker, buffers valid until completion).
    unsafe {
        if !req.is_null() {
            ucp_request_free(req);
        }
    }
}
