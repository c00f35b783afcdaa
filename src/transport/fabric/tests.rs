use super::*;

const SIZES: [usize; 3] = [8, 4096, 3 << 20];

/// Runs `body` in a child process of this test binary (the test named `name`, run
/// again with RDRAM_FABRIC_TEST_CHILD set), and checks that it passed. libfabric 1.17
/// keeps provider state across endpoints of one process: a test opening shm endpoints
/// after another test closed its own crashed now and then (in shm's progress, on a
/// spinlock), as did shm and tcp;ofi_rxm driven from two threads. Servers and clients
/// open one provider's endpoints per process; these tests each get a process too.
fn isolated(name: &str, body: impl FnOnce()) {
    if std::env::var_os("RDRAM_FABRIC_TEST_CHILD").is_some() {
        return body();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &format!("transport::fabric::tests::{name}"), "--test-threads=1", "--nocapture"])
        .env("RDRAM_FABRIC_TEST_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} failed in its process: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn message(round: usize, size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 7 + round) as u8).collect()
}

/// Polls until `n` completions arrived (or panics after 20 s).
fn wait_for(ep: &Endpoint, n: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while done.len() < n {
        assert!(std::time::Instant::now() < deadline, "{}: no completion", ep.provider);
        ep.poll(&mut done, 16);
    }
    done
}

/// Two endpoints on one provider, each driven by its own thread as in a server and a
/// client: tagged messages of 8 B to 3 MiB arrive intact with their tags.
fn tagged_messages(provider: &'static str, node: Option<&'static str>) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let receiver = std::thread::spawn(move || {
        let b = Endpoint::open(provider, node).unwrap_or_else(|e| panic!("{provider}: {e}"));
        addr_tx.send(b.address().unwrap()).unwrap();
        for (round, size) in SIZES.into_iter().enumerate() {
            let mut got = vec![0u8; size];
            let mut rx = OpContext { token: round as u64, ..Default::default() };
            // SAFETY: `got` and `rx` outlive the completion awaited below.
            unsafe { b.recv(got.as_mut_ptr(), size, ptr::null_mut(), 0x40 + round as u64, 0, &mut rx).unwrap() };
            match wait_for(&b, 1).pop().unwrap() {
                Completion::Done { token, len, tag } => {
                    assert_eq!((token, len, tag), (round as u64, size, 0x40 + round as u64))
                }
                other => panic!("{provider}: {other:?}"),
            }
            assert!(got == message(round, size), "{provider}: {size} B arrived changed");
        }
        // Keep the endpoint until the sender has its completions: shm's sender side
        // still touches the receiver's region (mapped straight, in one process) after
        // the receiver's completion, and crashed when it was already closed.
        let mut sink = Vec::new();
        while done_rx.try_recv().is_err() {
            b.poll(&mut sink, 16);
        }
    });
    let a = Endpoint::open(provider, node).unwrap();
    eprintln!("{}", a.describe());
    assert!(a.describe().contains(provider), "{}", a.describe());
    let b_at_a = a.insert_peer(&addr_rx.recv().unwrap()).unwrap();
    for (round, size) in SIZES.into_iter().enumerate() {
        let msg = message(round, size);
        let mut tx = OpContext { token: 100 + round as u64, ..Default::default() };
        // SAFETY: `msg` and `tx` outlive the completion awaited below.
        unsafe { a.send(msg.as_ptr(), size, ptr::null_mut(), b_at_a, 0x40 + round as u64, &mut tx).unwrap() };
        match wait_for(&a, 1).pop().unwrap() {
            Completion::Done { token, .. } => assert_eq!(token, 100 + round as u64),
            other => panic!("{provider}: {other:?}"),
        }
    }
    done_tx.send(()).unwrap();
    receiver.join().unwrap();
}

/// One-sided read of a registered 2 MiB region owned by another thread's endpoint,
/// addressed per the provider's FI_MR_VIRT_ADDR mode, local buffer registered too.
fn one_sided_read(provider: &'static str, node: Option<&'static str>) {
    const LEN: usize = 2 << 20;
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let target = std::thread::spawn(move || {
        let b = Endpoint::open(provider, node).unwrap();
        let region: Vec<u8> = message(9, LEN);
        let mr = b.register(region.as_ptr(), LEN, RemoteAccess::Read).unwrap();
        tx.send((b.address().unwrap(), mr.remote_base, mr.key, b.rma)).unwrap();
        // Progress until the reader is done (tcp;ofi_rxm serves reads in progress).
        let mut sink = Vec::new();
        while done_rx.try_recv().is_err() {
            b.poll(&mut sink, 16);
        }
        b.deregister(mr).unwrap();
    });
    let (addr, base, key, rma) = rx.recv().unwrap();
    assert!(rma, "{provider} should offer FI_RMA here");
    let a = Endpoint::open(provider, node).unwrap();
    let peer = a.insert_peer(&addr).unwrap();
    let mut local = vec![0u8; LEN / 2];
    let mr = a.register(local.as_ptr(), local.len(), RemoteAccess::None).unwrap();
    let mut ctx = OpContext { token: 7, ..Default::default() };
    // SAFETY: `local`, its region and `ctx` outlive the completion awaited below.
    unsafe { a.read(local.as_mut_ptr(), LEN / 2, mr.desc, peer, base + (LEN / 4) as u64, key, &mut ctx).unwrap() };
    match wait_for(&a, 1).pop().unwrap() {
        Completion::Done { token: 7, .. } => {}
        other => panic!("{provider}: {other:?}"),
    }
    assert!(local == message(9, LEN)[LEN / 4..LEN / 4 + LEN / 2], "{provider}: read the wrong bytes");
    a.deregister(mr).unwrap();
    done_tx.send(()).unwrap();
    target.join().unwrap();
}

#[test]
fn one_sided_read_over_tcp_rxm() {
    isolated("one_sided_read_over_tcp_rxm", || one_sided_read("tcp;ofi_rxm", Some("127.0.0.1")));
}

#[test]
fn one_sided_read_over_shm() {
    isolated("one_sided_read_over_shm", || one_sided_read("shm", None));
}

#[test]
fn tagged_messages_over_tcp_rxm() {
    isolated("tagged_messages_over_tcp_rxm", || tagged_messages("tcp;ofi_rxm", Some("127.0.0.1")));
}

#[test]
fn tagged_messages_over_shm() {
    isolated("tagged_messages_over_shm", || tagged_messages("shm", None));
}

/// A region left in /dev/shm by an earlier process that had this pid (killed before it
/// could unlink it) made `fi_enable` fail with EBUSY under libfabric's default naming.
#[test]
fn a_stale_shm_region_under_this_pid_does_not_block_new_endpoints() {
    isolated("a_stale_shm_region_under_this_pid_does_not_block_new_endpoints", || {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let stale: Vec<String> = (0..8).map(|i| format!("/dev/shm/{}:{uid}:{i}", std::process::id())).collect();
        for path in &stale {
            std::fs::write(path, [0xA5u8; 4096]).unwrap();
        }
        let opened = Endpoint::open("shm", None).map(|ep| ep.address().unwrap());
        for path in &stale {
            let _ = std::fs::remove_file(path);
        }
        let address = opened.unwrap_or_else(|e| panic!("shm endpoint next to stale regions: {e}"));
        assert!(String::from_utf8_lossy(&address).contains("rdram-"), "{:?}", String::from_utf8_lossy(&address));
    });
}

/// Loading libfabric leaves the process's handlers of termination signals as they were
/// (Debian's, through PSM's libinfinipath, replaced them with ones calling exit(1)).
#[test]
fn loading_libfabric_keeps_the_signal_handlers() {
    isolated("loading_libfabric_keeps_the_signal_handlers", || {
        let handler = |sig| {
            // SAFETY: sigaction only reads the current disposition into `old`.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
                old.sa_sigaction
            }
        };
        let signals = [libc::SIGHUP, libc::SIGINT, libc::SIGQUIT, libc::SIGTERM];
        let before: Vec<_> = signals.iter().map(|&s| handler(s)).collect();
        load().unwrap();
        let after: Vec<_> = signals.iter().map(|&s| handler(s)).collect();
        assert_eq!(before, after, "handlers of SIGHUP, SIGINT, SIGQUIT, SIGTERM changed by loading libfabric");
    });
}

#[test]
fn a_missing_provider_is_named_with_the_alternatives() {
    // A name no host has: on an EFA host "efa" would open.
    let err = Endpoint::open("no_such_provider", None).err().expect("no such provider");
    assert_eq!(err.status, Status::Unavailable);
    assert!(err.message.contains("'no_such_provider'") && err.message.contains("shm"), "{}", err.message);
}
