//! One-sided UCX operations (RMA) aimed at a server by a client that holds a session (it
//! passed the token check) and a forged remote key: they must neither read nor write the
//! server's memory, and the server keeps serving.
//!
//! UCX carries out RMA without asking the target process: UCP emulates puts and gets for
//! any peer over active messages when the context has `UCP_FEATURE_RMA` (its handlers copy
//! to and from whatever address the peer names), and UCX's tcp transport writes a peer's
//! put wherever it says. Neither checks a key. The server therefore runs without the RMA
//! feature, and its tcp interfaces advertise no puts (`HARDENING` in
//! src/transport/ucx/mod.rs); the client library too, so a server cannot name its clients'
//! memory either.

mod common;

use std::net::TcpStream;
use std::os::raw::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use remote_dram::proto::bootstrap;
use remote_dram::transport::ucx::sys::*;
use remote_dram::transport::ucx::{ptr_status, status_string};

/// Where the server's executable is mapped (from /proc): the first mapping, which starts
/// with "\x7fELF", and the first writable one.
fn executable_mappings(pid: u32) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    let mut of_exe = maps.lines().filter(|l| l.ends_with(exe.to_str().unwrap()));
    let start = |line: &str| u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap();
    let first = start(of_exe.clone().next().expect("the executable's mapping"));
    let writable = start(
        of_exe
            .find(|l| l.split_whitespace().nth(1).is_some_and(|perms| perms.starts_with("rw")))
            .expect("a writable mapping"),
    );
    (first, writable)
}

/// Eight bytes of the server's memory, read through /proc (the test is its parent).
fn peek(pid: u32, address: u64) -> [u8; 8] {
    use std::os::unix::fs::FileExt;
    let mut bytes = [0u8; 8];
    std::fs::File::open(format!("/proc/{pid}/mem")).unwrap().read_exact_at(&mut bytes, address).unwrap();
    bytes
}

/// The server's UCX address for shard 0, through the bootstrap (the token check).
fn shard_address(server: &common::ServerProc) -> Vec<u8> {
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    let welcome = bootstrap::client_handshake(&mut stream, &server.addr, None, Duration::from_secs(5)).unwrap();
    // The stream stays open while the test runs: it is the session.
    std::mem::forget(stream);
    bootstrap::hex_decode(&welcome.shards[0]).unwrap()
}

/// A stock UCX peer, as an attacker would build it: active messages and RMA, UCX's
/// defaults (tcp puts enabled).
struct Attacker {
    context: ucp_context_h,
    worker: ucp_worker_h,
}

impl Attacker {
    fn new() -> Attacker {
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES as u64,
            features: (UCP_FEATURE_AM | UCP_FEATURE_RMA) as u64,
            ..Default::default()
        };
        let (mut config, mut context, mut worker) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
        let wparams = ucp_worker_params_t::default();
        // SAFETY: plain UCX set-up with valid out-parameters; config is released once.
        unsafe {
            assert_eq!(ucp_config_read(ptr::null(), ptr::null(), &mut config), UCS_OK);
            assert_eq!(ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut context), UCS_OK);
            ucp_config_release(config);
            assert_eq!(ucp_worker_create(context, &wparams, &mut worker), UCS_OK);
        }
        Attacker { context, worker }
    }

    fn connect(&self, address: &[u8]) -> ucp_ep_h {
        let params = ucp_ep_params_t {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address: address.as_ptr() as *const ucp_address_t,
            ..Default::default()
        };
        let mut ep = ptr::null_mut();
        // SAFETY: the worker is live; address is a UCX worker address.
        assert_eq!(unsafe { ucp_ep_create(self.worker, &params, &mut ep) }, UCS_OK);
        ep
    }

    /// Runs a request to completion, or 2 s (a refused get is never answered); its status.
    fn wait(&self, request: ucs_status_ptr_t) -> ucs_status_t {
        if request.is_null() {
            return UCS_OK;
        }
        if let Some(status) = ptr_status(request) {
            return status;
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        // SAFETY: request is live until freed below; the worker is live.
        unsafe {
            let mut status = ucp_request_check_status(request);
            while status == UCS_INPROGRESS && Instant::now() < deadline {
                ucp_worker_progress(self.worker);
                status = ucp_request_check_status(request);
            }
            ucp_request_free(request);
            status
        }
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        // SAFETY: created in new(), destroyed once (endpoints were closed by then).
        unsafe {
            ucp_worker_destroy(self.worker);
            ucp_cleanup(self.context);
        }
    }
}

fn rma_is_refused(transport: &str) {
    common::init(transport);
    let server = common::ServerProc::start(&["--workers", "1", "--memory", "64MiB"]);
    let pid = server.child.id();
    let (target, writable) = executable_mappings(pid);
    let before = peek(pid, writable);
    let address = shard_address(&server);

    let attacker = Attacker::new();
    let ep = attacker.connect(&address);
    // A key for the server, forged from one of our own registrations.
    let mut local = vec![0u8; 4096];
    let map = ucp_mem_map_params_t {
        field_mask: (UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64,
        address: local.as_mut_ptr().cast(),
        length: local.len(),
        ..Default::default()
    };
    let (mut memh, mut packed, mut packed_len, mut rkey) =
        (ptr::null_mut(), ptr::null_mut::<c_void>(), 0, ptr::null_mut());
    // SAFETY: local outlives the registration; the out-parameters are valid.
    unsafe {
        assert_eq!(ucp_mem_map(attacker.context, &map, &mut memh), UCS_OK);
        assert_eq!(ucp_rkey_pack(attacker.context, memh, &mut packed, &mut packed_len), UCS_OK);
    }
    // SAFETY: ep is live; packed came from ucp_rkey_pack.
    let unpacked = unsafe { ucp_ep_rkey_unpack(ep, packed, &mut rkey) };

    let mut read = [0u8; 8];
    let mut outcome = Vec::new();
    if unpacked == UCS_OK {
        let param = ucp_request_param_t::default();
        // SAFETY: read outlives the wait below; rkey and ep are live.
        let get = attacker.wait(unsafe { ucp_get_nbx(ep, read.as_mut_ptr().cast(), read.len(), target, rkey, &param) });
        outcome.push(format!("get: {}", status_string(get)));
        let junk = before.map(|b| !b);
        // SAFETY: junk outlives the wait below; rkey and ep are live.
        let put = attacker.wait(unsafe { ucp_put_nbx(ep, junk.as_ptr().cast(), junk.len(), writable, rkey, &param) });
        outcome.push(format!("put: {}", status_string(put)));
        // SAFETY: rkey came from ucp_ep_rkey_unpack and is destroyed once.
        unsafe { ucp_rkey_destroy(rkey) };
    } else {
        outcome.push(format!("rkey unpack: {}", status_string(unpacked)));
    }
    eprintln!("{transport}: {outcome:?}");
    assert_ne!(&read[..4], b"\x7fELF", "a client read the server's memory one-sidedly ({outcome:?})");
    // Time for a put to land, had it been carried out.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(peek(pid, writable), before, "a client wrote the server's memory one-sidedly ({outcome:?})");
    // The server is alive and serves.
    let mut client = server.client();
    client.put(b"after", b"v").unwrap();
    assert_eq!(client.get(b"after").unwrap().unwrap().data, b"v");
    // SAFETY: each released once; the endpoint closes before the worker goes (Drop).
    unsafe {
        ucp_rkey_buffer_release(packed);
        ucp_mem_unmap(attacker.context, memh);
        let close = ucp_request_param_t {
            op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS,
            flags: UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        attacker.wait(ucp_ep_close_nbx(ep, &close));
    }
}

#[test]
fn rma_with_a_forged_key_is_refused_over_tcp() {
    rma_is_refused(common::TCP);
}
