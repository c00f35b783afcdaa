//! Where a server's threads run. Workers are pinned to the cores given (`--cores`), one
//! each; threads a worker starts inherit its single core, so those that work beside it
//! (its replicators) are moved to the cores this process may use that no worker holds.

/// The cores a worker's helper threads run on: those the calling thread may run on (call
/// it before any worker is pinned) that are not among `workers`, or all of them if the
/// workers take every one. Empty: workers are not pinned, and helpers inherit the
/// process's cores as any thread does.
pub fn helper_cores(workers: &[usize]) -> Vec<usize> {
    if workers.is_empty() {
        return Vec::new();
    }
    let allowed: Vec<usize> = core_affinity::get_core_ids().unwrap_or_default().iter().map(|c| c.id).collect();
    let free: Vec<usize> = allowed.iter().copied().filter(|c| !workers.contains(c)).collect();
    if free.is_empty() {
        allowed
    } else {
        free
    }
}

/// Lets the calling thread run on any of `cores` (none: leaves it as it is). A helper
/// thread left on its worker's core would take turns with the worker's spin on it.
pub fn run_current_thread_on(cores: &[usize]) {
    if cores.is_empty() {
        return;
    }
    // SAFETY: `set` is a plain bit mask on the stack, zeroed, then filled by CPU_SET for
    // indices it bounds-checks below; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!("cannot move a helper thread to cores {cores:?}: {}", std::io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread started by a pinned worker is pinned with it; moved to the helpers' cores,
    /// it runs anywhere but there (where the process may run on more than one core).
    #[test]
    fn a_helper_started_by_a_pinned_worker_leaves_the_workers_core() {
        let allowed: Vec<usize> = core_affinity::get_core_ids().unwrap().iter().map(|c| c.id).collect();
        let worker = allowed[0];
        let helpers = helper_cores(&[worker]);
        if allowed.len() == 1 {
            assert_eq!(helpers, vec![worker], "the only core there is");
            return;
        }
        assert!(!helpers.contains(&worker) && !helpers.is_empty(), "{helpers:?}");
        let to = helpers.clone();
        let seen = std::thread::spawn(move || {
            assert!(core_affinity::set_for_current(core_affinity::CoreId { id: worker }));
            let inherited = std::thread::spawn(|| core_affinity::get_core_ids().unwrap()).join().unwrap();
            assert_eq!(inherited.iter().map(|c| c.id).collect::<Vec<_>>(), vec![worker], "inherited the worker's core");
            std::thread::spawn(move || {
                run_current_thread_on(&to);
                core_affinity::get_core_ids().unwrap().iter().map(|c| c.id).collect::<Vec<_>>()
            })
            .join()
            .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(seen, helpers);
    }
}
