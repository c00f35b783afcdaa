//! The server process's own affairs: stop signals taken by `sigwait` rather than by
//! handlers, and the open-files limit.

use std::time::Duration;

/// Blocks SIGINT and SIGTERM in this thread and every thread started after, and returns
/// the set to `sigwait` on. Libraries that install their own handlers (Debian's
/// libfabric pulls in PSM's libinfinipath, whose handlers call `exit(1)`) never see them.
pub fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: plain libc calls on a local, initialised sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Lifts this process's soft limit on open files to its hard limit: a server holds a
/// descriptor or more per client, and refuses new clients (it does not fail) near the limit.
pub fn raise_fd_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Waits up to `timeout` for one of the blocked stop signals; its number, if one came.
pub fn wait_for_signal(set: &libc::sigset_t, timeout: Duration) -> Option<libc::c_int> {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: waits on a signal set blocked in every thread; no siginfo is asked for.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}
