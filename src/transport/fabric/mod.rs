//! libfabric reliable-datagram endpoints (`FI_EP_RDM`): the path to AWS EFA, exercised
//! here over `tcp;ofi_rxm` and `shm`, which speak the same API.
//!
//! One [`Endpoint`] = one fabric, domain, address vector, completion queue and endpoint,
//! driven by one thread at a time, like a UCX worker (opened `FI_THREAD_SAFE`: see
//! `get_info`). Messages are tagged sends
//! and receives; callers pass an `fi_context`-sized context per operation and get it back
//! in the completion.
//!
//! [`Rails`] groups one endpoint per NIC domain for multi-rail transfers; `ops` tracks
//! operations in flight over them. Below it, the backend's two sides: `client/` (the
//! client's link over libfabric) and `server/` (the shard worker over libfabric); the
//! wire details it shares with them are in `proto::fabric`.

pub(crate) mod client;
mod closing;
pub mod ops;
mod posts;
pub mod rails;
pub(crate) mod server;
mod shm_lock_watch;
mod shm_region;
pub mod sys;

pub use ops::InFlight;
pub use rails::Rails;
pub use shm_lock_watch::locks_released as shm_locks_released;

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;
use std::os::raw::c_void;
use std::ptr;

use crate::error::{Error, Result, Status};
use closing::Handles;
use shm_region::RegionClaim;

/// The libfabric API version we are written against (Debian 12 ships 1.17).
const API_VERSION: u32 = (1 << 16) | 17;

/// Registration modes we honour: local buffers registered (EFA needs it), virtual
/// addresses and provider-chosen keys for RMA, allocated memory only.
const MR_MODES_SUPPORTED: u32 = sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_PROV_KEY;

/// How long posting an operation may wait for the provider to take it, unless the owner
/// sets another limit (see `Endpoint::retry_on_eagain`): a server's worker gives up on a
/// client after this.
pub const POST_STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);
/// A post retries at once for this long (a peer mapping us, a queue draining), then naps
/// `POST_NAP` between tries.
const POST_SPIN: std::time::Duration = std::time::Duration::from_millis(1);
const POST_NAP: std::time::Duration = std::time::Duration::from_micros(100);

/// A peer's index in the endpoint's address vector.
pub type PeerAddr = sys::fi_addr_t;

/// Per-operation context storage handed to libfabric (`FI_CONTEXT` mode): it must stay at
/// a fixed address until the operation completes.
#[repr(C)]
#[derive(Default)]
pub struct OpContext {
    raw: sys::fi_context,
    /// The caller's own token, returned in [`Completion`].
    pub token: u64,
}

#[derive(Debug)]
pub enum Completion {
    Done { token: u64, len: usize, tag: u64 },
    Failed { token: u64, error: Error },
}

pub struct Endpoint {
    info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    av: *mut sys::fid_av,
    cq: *mut sys::fid_cq,
    ep: *mut sys::fid_ep,
    pub provider: String,
    pub fabric_name: String,
    pub domain_name: String,
    /// The `FI_MR_*` bits the provider requires of us.
    pub mr_mode: u32,
    /// Whether the provider offered one-sided reads (`FI_RMA`) for large values.
    pub rma: bool,
    /// The provider's inject size: messages up to it are copied inline.
    pub inject_size: usize,
    /// The completion queue's file descriptor for sleeping, or -1 when the provider has
    /// no FD wait object (then idle loops sleep in short, bounded naps).
    pub wait_fd: RawFd,
    /// Bits in a requested key (`mr_key_size`), for keys we choose (no FI_MR_PROV_KEY).
    key_bits: u32,
    /// Contexts of one-sided reads in flight, oldest first: libfabric 1.17's shm reports
    /// a failed read without its context (fixed in 1.18, ofiwg/libfabric#8665); such an
    /// error is the oldest read's, since shm completes reads in order.
    reads: std::cell::RefCell<std::collections::VecDeque<usize>>,
    /// shm only: the claim on this endpoint's region name, released once the endpoint is
    /// closed (see `Drop`: possibly later than the endpoint's drop).
    shm_region: Option<RegionClaim>,
    /// How long a post waits for the provider to take it (see `retry_on_eagain`).
    post_stall_limit: std::time::Duration,
}

/// What peers may do to a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteAccess {
    None,
    Read,
}

/// A random memory key of `bits` bits, never 0.
fn random_key(bits: u32) -> Result<u64> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| Error::new(Status::Internal, format!("no randomness for a memory key: {e}")))?;
    let key = u64::from_le_bytes(bytes);
    Ok(if bits >= 64 { key } else { key & ((1u64 << bits) - 1) }.max(1))
}

/// A registered memory region: `desc` goes with local operations; `key` and
/// `remote_base` go to peers that read it.
pub struct MemoryRegion {
    mr: *mut sys::fid_mr,
    pub desc: *mut c_void,
    pub key: u64,
    /// What a peer passes as the address of the region's first byte: its virtual address
    /// under FI_MR_VIRT_ADDR, else offsets count from 0.
    pub remote_base: u64,
}

fn fi_error(what: &str, code: i64) -> Error {
    // SAFETY: fi_strerror returns a static string for any code.
    let text = unsafe { CStr::from_ptr(sys::rdram_fi_strerror((-code) as i32)) }.to_string_lossy();
    Error::new(Status::Transport, format!("libfabric {what}: {text} ({code})"))
}

fn check(what: &str, rc: i64) -> Result<()> {
    if rc < 0 {
        Err(fi_error(what, rc))
    } else {
        Ok(())
    }
}

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: libfabric's names are NUL-terminated strings owned by the fi_info.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// `fi_getinfo` for a tagged RDM endpoint on `prov` (any provider if None) with
/// `extra_caps`; the result goes to `info` (NULL on failure). Returns libfabric's code.
///
/// # Safety
/// `info` must be NULL or a list this function may overwrite without freeing.
unsafe fn get_info(prov: Option<&CStr>, node: Option<&CStr>, extra_caps: u64, info: &mut *mut sys::fi_info) -> i32 {
    // SAFETY: `hints` is checked non-NULL, and fi_allocinfo allocates its ep, domain and
    // fabric attributes with it; prov_name is malloc'd for fi_freeinfo to free; `node`
    // and `prov` are NUL-terminated; `info` may be overwritten (the caller's contract).
    unsafe {
        let hints = sys::rdram_fi_allocinfo();
        if hints.is_null() {
            return -(sys::FI_ENOMEM as i32);
        }
        (*(*hints).ep_attr).type_ = sys::FI_EP_RDM;
        (*hints).caps = (sys::FI_MSG | sys::FI_TAGGED) as u64 | extra_caps;
        (*hints).mode = sys::FI_CONTEXT;
        (*(*hints).domain_attr).mr_mode = MR_MODES_SUPPORTED as i32;
        // Real locks, though each domain is driven by one thread: with FI_THREAD_DOMAIN
        // libfabric 1.17's providers turn their locks into no-ops, and their own helper
        // threads (connection and progress handling) then race with ours; processes
        // with several endpoints on threads (tests, the gateway's engine clients) crashed
        // now and then in a provider spinlock.
        (*(*hints).domain_attr).threading = sys::FI_THREAD_SAFE;
        if let Some(prov) = prov {
            // fi_freeinfo frees prov_name: it must come from malloc.
            (*(*hints).fabric_attr).prov_name = libc::strdup(prov.as_ptr());
        }
        let flags = if node.is_some() { sys::FI_SOURCE } else { 0 };
        let rc = sys::rdram_fi_getinfo(
            API_VERSION,
            node.map_or(ptr::null(), |n| n.as_ptr()),
            ptr::null(),
            flags,
            hints,
            info,
        );
        sys::rdram_fi_freeinfo(hints);
        if rc != 0 {
            *info = ptr::null_mut();
        }
        rc
    }
}

/// Loads libfabric (once per process; see shim.c for why it is not linked).
pub fn load() -> Result<()> {
    // SAFETY: returns NULL or a pointer to a static NUL-terminated string.
    let why = unsafe { sys::rdram_fi_load() };
    if why.is_null() {
        Ok(())
    } else {
        Err(Error::new(Status::Unavailable, cstr(why)))
    }
}

/// The first entry of `list` on the `n`-th distinct domain, wrapping around.
///
/// # Safety
/// `list` is a valid, non-empty fi_info list.
unsafe fn nth_domain(list: *mut sys::fi_info, n: usize) -> *mut sys::fi_info {
    // SAFETY: `list` is a valid, non-empty fi_info list (the caller's contract): each entry
    // has a domain_attr and a next that is NULL or the next entry; it is only read.
    unsafe {
        let mut firsts: Vec<*mut sys::fi_info> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let mut i = list;
        while !i.is_null() {
            let name = cstr((*(*i).domain_attr).name);
            if !names.contains(&name) {
                names.push(name);
                firsts.push(i);
            }
            i = (*i).next;
        }
        firsts[n % firsts.len()]
    }
}

/// Names of the providers offering the endpoints we need here, for error messages.
pub fn available_providers() -> Vec<String> {
    let mut names = Vec::new();
    let mut list = ptr::null_mut();
    // SAFETY: get_info fills `list` (or leaves it NULL); it is walked read-only and freed once.
    unsafe {
        if get_info(None, None, 0, &mut list) == 0 {
            let mut i = list;
            while !i.is_null() {
                let name = cstr((*(*i).fabric_attr).prov_name);
                if !names.contains(&name) {
                    names.push(name);
                }
                i = (*i).next;
            }
            sys::rdram_fi_freeinfo(list);
        }
    }
    names
}

impl Endpoint {
    /// Opens an RDM endpoint on `provider` (e.g. "efa", "tcp;ofi_rxm", "shm"). `node`
    /// picks the local interface by address for IP-based providers ("127.0.0.1" keeps
    /// tcp on loopback). A missing provider is an error naming the ones available: no
    /// silent fallback to something slower.
    pub fn open(provider: &str, node: Option<&str>) -> Result<Endpoint> {
        Self::open_rail(provider, node, 0)
    }

    /// Like `open`, on the `rail`-th distinct domain (NIC) the provider offers, wrapping
    /// around when there are fewer: rails beyond the domain count share a NIC.
    pub fn open_rail(provider: &str, node: Option<&str>, rail: usize) -> Result<Endpoint> {
        load()?;
        let prov = CString::new(provider).map_err(|_| Error::new(Status::Invalid, "provider name contains NUL"))?;
        // shm takes its region's name as the source "node" (see shm_region).
        let shm_region = (provider == "shm" && node.is_none()).then(RegionClaim::new).transpose()?;
        let node = node.or(shm_region.as_ref().map(|r| r.name.as_str()));
        let node_c =
            node.map(CString::new).transpose().map_err(|_| Error::new(Status::Invalid, "node contains NUL"))?;
        let mut ep = Endpoint {
            info: ptr::null_mut(),
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            ep: ptr::null_mut(),
            provider: provider.to_string(),
            fabric_name: String::new(),
            domain_name: String::new(),
            mr_mode: 0,
            rma: false,
            inject_size: 0,
            wait_fd: -1,
            key_bits: 64,
            reads: Default::default(),
            shm_region,
            post_stall_limit: POST_STALL_LIMIT,
        };
        if ep.shm_region.is_some() {
            closing::shm_endpoint_opened();
        }
        // SAFETY: every object is created from the previous one's valid handle; on any
        // error, Drop closes what was opened (in reverse order) and frees the info.
        unsafe {
            // One-sided reads where the provider offers them, plain messaging otherwise.
            let rma_caps = (sys::FI_RMA | sys::FI_READ | sys::FI_REMOTE_READ) as u64;
            let mut rc = -(sys::FI_ENODATA as i32);
            for extra in [rma_caps, 0] {
                rc = get_info(Some(&prov), node_c.as_deref(), extra, &mut ep.info);
                if rc == 0 && !ep.info.is_null() {
                    ep.rma = extra != 0;
                    break;
                }
            }
            if rc != 0 || ep.info.is_null() {
                ep.info = ptr::null_mut();
                return Err(Error::new(
                    Status::Unavailable,
                    format!(
                        "libfabric provider '{provider}' offers no reliable-datagram endpoint here ({}); available: {}",
                        cstr(sys::rdram_fi_strerror(-rc)),
                        available_providers().join(", ")
                    ),
                ));
            }
            let info = &*nth_domain(ep.info, rail);
            ep.provider = cstr((*info.fabric_attr).prov_name);
            ep.fabric_name = cstr((*info.fabric_attr).name);
            ep.domain_name = cstr((*info.domain_attr).name);
            ep.mr_mode = (*info.domain_attr).mr_mode as u32;
            ep.inject_size = (*info.tx_attr).inject_size;
            ep.key_bits = ((*info.domain_attr).mr_key_size.clamp(1, 8) * 8) as u32;

            check("fi_fabric", sys::rdram_fi_fabric(info.fabric_attr, &mut ep.fabric, ptr::null_mut()) as i64)?;
            let chosen = info as *const sys::fi_info as *mut sys::fi_info;
            check("fi_domain", sys::rdram_fi_domain(ep.fabric, chosen, &mut ep.domain, ptr::null_mut()) as i64)?;
            let mut av_attr = sys::fi_av_attr { type_: sys::FI_AV_TABLE, ..Default::default() };
            check("fi_av_open", sys::rdram_fi_av_open(ep.domain, &mut av_attr, &mut ep.av, ptr::null_mut()) as i64)?;
            // A completion queue with an fd to sleep on where the provider has one.
            for wait_obj in [sys::FI_WAIT_FD, sys::FI_WAIT_NONE] {
                let mut cq_attr =
                    sys::fi_cq_attr { format: sys::FI_CQ_FORMAT_TAGGED, wait_obj, size: 4096, ..Default::default() };
                let rc = sys::rdram_fi_cq_open(ep.domain, &mut cq_attr, &mut ep.cq, ptr::null_mut()) as i64;
                if rc == 0 {
                    if wait_obj == sys::FI_WAIT_FD {
                        let mut fd: libc::c_int = -1;
                        check(
                            "fi_control(FI_GETWAIT)",
                            sys::rdram_fi_control(
                                &mut (*ep.cq).fid,
                                sys::FI_GETWAIT as i32,
                                (&mut fd as *mut libc::c_int).cast(),
                            ) as i64,
                        )?;
                        ep.wait_fd = fd;
                    }
                    break;
                }
                if wait_obj == sys::FI_WAIT_NONE {
                    check("fi_cq_open", rc)?;
                }
            }
            check("fi_endpoint", sys::rdram_fi_endpoint(ep.domain, chosen, &mut ep.ep, ptr::null_mut()) as i64)?;
            check("fi_ep_bind(av)", sys::rdram_fi_ep_bind(ep.ep, &mut (*ep.av).fid, 0) as i64)?;
            let cq_flags = (sys::FI_TRANSMIT | sys::FI_RECV) as u64;
            check("fi_ep_bind(cq)", sys::rdram_fi_ep_bind(ep.ep, &mut (*ep.cq).fid, cq_flags) as i64)?;
            check("fi_enable", sys::rdram_fi_enable(ep.ep) as i64)?;
        }
        Ok(ep)
    }

    /// "provider tcp;ofi_rxm, fabric 127.0.0.0/8, domain lo": what startup prints.
    pub fn describe(&self) -> String {
        format!("provider {}, fabric {}, domain {}", self.provider, self.fabric_name, self.domain_name)
    }

    /// This endpoint's fabric address, for the out-of-band bootstrap.
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut len = 0usize;
        // SAFETY: the first call only reports the length (FI_ETOOSMALL); the second
        // writes at most `len` bytes into a buffer of that size.
        unsafe {
            sys::rdram_fi_getname(&mut (*self.ep).fid, ptr::null_mut(), &mut len);
            let mut addr = vec![0u8; len];
            check("fi_getname", sys::rdram_fi_getname(&mut (*self.ep).fid, addr.as_mut_ptr().cast(), &mut len) as i64)?;
            addr.truncate(len);
            Ok(addr)
        }
    }

    /// Adds a peer's address (from its [`Endpoint::address`]) to the address vector.
    pub fn insert_peer(&self, address: &[u8]) -> Result<PeerAddr> {
        let mut peer: PeerAddr = 0;
        // SAFETY: one address in, one fi_addr_t out; libfabric copies the address.
        let n = unsafe { sys::rdram_fi_av_insert(self.av, address.as_ptr().cast(), 1, &mut peer, 0, ptr::null_mut()) };
        if n != 1 {
            return Err(fi_error("fi_av_insert", if n < 0 { n as i64 } else { -(sys::FI_EINVAL as i64) }));
        }
        Ok(peer)
    }

    /// Forgets a peer (a client that went away).
    pub fn remove_peer(&self, mut peer: PeerAddr) -> Result<()> {
        // SAFETY: one fi_addr_t from this AV.
        check("fi_av_remove", unsafe { sys::rdram_fi_av_remove(self.av, &mut peer, 1, 0) } as i64)
    }

    /// Prepares to sleep on `wait_fd`: false when completions are already pending (or
    /// the provider needs progress first), so the caller must poll instead.
    pub fn try_wait(&self) -> bool {
        if self.wait_fd < 0 {
            return true;
        }
        let mut fids = [unsafe { &mut (*self.cq).fid as *mut sys::fid }];
        // SAFETY: one CQ fid of this fabric.
        unsafe { sys::rdram_fi_trywait(self.fabric, fids.as_mut_ptr(), 1) == 0 }
    }

    /// Registers memory for this endpoint's own sends, receives and reads into it
    /// (`desc`), and, with `RemoteAccess::Read`, for peers' one-sided reads of it (`key`).
    /// Nothing is ever remotely writable. Keys we choose are random, so a peer cannot
    /// guess one; providers that choose their own (FI_MR_PROV_KEY, as EFA) do so.
    pub fn register(&self, buf: *const u8, len: usize, remote: RemoteAccess) -> Result<MemoryRegion> {
        let mut access = (sys::FI_SEND | sys::FI_RECV | sys::FI_READ | sys::FI_WRITE) as u64;
        if remote == RemoteAccess::Read {
            access |= sys::FI_REMOTE_READ as u64;
        }
        let mut mr = ptr::null_mut();
        let mut rc = 0;
        // A random key may collide with one in use (-FI_ENOKEY): draw again.
        for _ in 0..4 {
            let key = random_key(self.key_bits)?;
            // SAFETY: the caller keeps `buf..buf+len` mapped while the region exists.
            rc = unsafe {
                sys::rdram_fi_mr_reg(self.domain, buf.cast(), len, access, 0, key, 0, &mut mr, ptr::null_mut())
            } as i64;
            if rc != -(sys::FI_ENOKEY as i64) {
                break;
            }
        }
        check("fi_mr_reg", rc)?;
        let remote_base = if self.mr_mode & sys::FI_MR_VIRT_ADDR != 0 { buf as u64 } else { 0 };
        // SAFETY: mr was just registered successfully.
        Ok(unsafe { MemoryRegion { mr, desc: sys::rdram_fi_mr_desc(mr), key: sys::rdram_fi_mr_key(mr), remote_base } })
    }

    pub fn deregister(&self, region: MemoryRegion) -> Result<()> {
        // SAFETY: the region was registered on this endpoint's domain and is closed once.
        check("fi_close(mr)", unsafe { sys::rdram_fi_close(&mut (*region.mr).fid) } as i64)
    }

    /// Reaps up to `out.capacity()` completions; returns how many were added to `out`.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> usize {
        // Zero-filled on every poll (768 bytes), which shows in profiles of a busy worker
        // but is not on the critical path: left uninitialised, or with a pause on an empty
        // poll instead, GET 8 B over libfabric shm was a few percent slower.
        let mut entries: [sys::fi_cq_tagged_entry; 16] = Default::default();
        let want = max.min(entries.len());
        // SAFETY: the buffer holds `want` tagged entries, the CQ's format.
        let n = unsafe { sys::rdram_fi_cq_read(self.cq, entries.as_mut_ptr().cast(), want) } as i64;
        if n > 0 {
            for e in &entries[..n as usize] {
                self.read_done(e.op_context as usize);
                // SAFETY: every op_context we post points at an OpContext.
                let token = unsafe { (*(e.op_context as *const OpContext)).token };
                out.push(Completion::Done { token, len: e.len, tag: e.tag });
            }
            return n as usize;
        }
        if n == -(sys::FI_EAVAIL as i64) {
            let mut err = sys::fi_cq_err_entry::default();
            // SAFETY: reads the one pending error entry into `err`.
            if unsafe { sys::rdram_fi_cq_readerr(self.cq, &mut err, 0) } == 1 {
                let mut text = [0 as std::os::raw::c_char; 256];
                // SAFETY: fi_cq_strerror writes at most text.len() bytes and returns a C string.
                let detail = cstr(unsafe {
                    sys::rdram_fi_cq_strerror(self.cq, err.prov_errno, err.err_data, text.as_mut_ptr(), text.len())
                });
                let error =
                    Error::new(Status::Transport, format!("libfabric operation failed: {detail} (errno {})", err.err));
                let ctx = if err.op_context.is_null() {
                    self.reads.borrow().front().copied()
                } else {
                    Some(err.op_context as usize)
                };
                let Some(ctx) = ctx else {
                    tracing::warn!("{}: error for no operation of ours: {}", self.provider, error.message);
                    return 0;
                };
                self.read_done(ctx);
                // SAFETY: as above, the context is one of ours.
                let token = unsafe { (*(ctx as *const OpContext)).token };
                out.push(Completion::Failed { token, error });
                return 1;
            }
        }
        0
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let shm_endpoint = self.shm_region.is_some();
        let handles = Handles {
            fids: [
                self.ep.cast::<sys::fid>(),
                self.cq.cast::<sys::fid>(),
                self.av.cast::<sys::fid>(),
                self.domain.cast::<sys::fid>(),
                self.fabric.cast::<sys::fid>(),
            ],
            info: self.info,
            _claim: self.shm_region.take(),
        };
        // SAFETY: this endpoint's handles, opened by `open_rail`, used by nothing any more.
        unsafe { closing::close(handles, shm_endpoint) };
    }
}

#[cfg(test)]
mod tests;
