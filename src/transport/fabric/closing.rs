//! Closing an endpoint's libfabric handles, and the shm endpoints this process keeps
//! parked a while after they close (see [`ShmEndpoints::count`] for why).

use super::shm_lock_watch;
use super::shm_region::RegionClaim;
use super::sys;

/// Counts a shm endpoint opened, and closes the parked ones that are due.
pub(super) fn shm_endpoint_opened() {
    for h in ShmEndpoints::count(None) {
        // SAFETY: parked handles are used by nothing any more (see `close`).
        unsafe { h.close() };
    }
}

/// Closes an endpoint's handles, or parks them (a shm endpoint while others of this
/// process are open), closing the parked ones that are due.
///
/// # Safety
/// The handles were opened by `Endpoint::open_rail` and nothing uses them any more.
pub(super) unsafe fn close(handles: Handles, shm_endpoint: bool) {
    let close_now = if shm_endpoint { ShmEndpoints::count(Some(handles)) } else { vec![handles] };
    for h in close_now {
        // SAFETY: `handles`, or parked ones: opened by `open_rail`, used by nothing any more.
        unsafe { h.close() };
    }
}

/// An endpoint's libfabric handles, closed together (endpoint first).
pub(super) struct Handles {
    pub(super) fids: [*mut sys::fid; 5],
    pub(super) info: *mut sys::fi_info,
    /// shm: the region name's claim, released (dropped) after the handles are closed.
    pub(super) _claim: Option<RegionClaim>,
}

impl Handles {
    /// # Safety
    /// The handles were opened by `Endpoint::open_rail` and nothing uses them any more.
    unsafe fn close(self) {
        // SAFETY: as the caller promises; each handle is closed once, in order.
        unsafe {
            for fid in self.fids {
                if !fid.is_null() {
                    sys::rdram_fi_close(fid);
                }
            }
            if !self.info.is_null() {
                sys::rdram_fi_freeinfo(self.info);
            }
        }
    }
}

/// This process's shm endpoints: how many are open, and those closed while others were
/// (with when).
struct ShmEndpoints {
    open: usize,
    parked: Vec<(std::time::Instant, Handles)>,
    /// Whether the lock watchdog runs (while any shm endpoint is open).
    watching: bool,
}

/// How long a closed shm endpoint stays parked while others of the process are open: by
/// then its peers here have seen it go (a closed bootstrap connection, a departed client,
/// or their own timeouts) and send to it no more. Bounds what churn can hold.
const SHM_PARK: std::time::Duration = std::time::Duration::from_secs(30);

// SAFETY: parked handles are never used again except to be closed once, which libfabric
// allows from any thread (domains are opened FI_THREAD_SAFE).
unsafe impl Send for ShmEndpoints {}

static SHM_ENDPOINTS: std::sync::Mutex<ShmEndpoints> =
    std::sync::Mutex::new(ShmEndpoints { open: 0, parked: Vec::new(), watching: false });

impl ShmEndpoints {
    /// Counts a shm endpoint opened (`None`) or closed (its handles), then closes the
    /// parked endpoints that are due, and the closing one unless it must be parked.
    ///
    /// libfabric's shm reaches an endpoint of the same process through that endpoint's
    /// own mapping of its region: closing it (which unmaps the region) while another shm
    /// endpoint here may still send to it crashed that one (an embedded server stopped
    /// under a client in the same process: SIGSEGV in the client's next send). So an
    /// endpoint closed while others are open is parked, nothing reading its queue, until
    /// [`SHM_PARK`] has passed or the process's last shm endpoint closes.
    fn count(closing: Option<Handles>) -> Vec<Handles> {
        let mut shm = SHM_ENDPOINTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut close_now = Vec::new();
        match closing {
            None => {
                shm.open += 1;
                if !shm.watching {
                    shm.watching = true;
                    shm_lock_watch::spawn(ShmEndpoints::keep_watching);
                }
            }
            Some(handles) => {
                shm.open -= 1;
                if shm.open > 0 {
                    shm.parked.push((std::time::Instant::now(), handles));
                } else {
                    close_now.push(handles);
                }
            }
        }
        let all = shm.open == 0;
        close_now.extend(shm.take_due(all));
        close_now
    }

    /// Takes out the parked endpoints whose time is up (all of them with `all`).
    fn take_due(&mut self, all: bool) -> Vec<Handles> {
        let (due, kept): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.parked).into_iter().partition(|(since, _)| all || since.elapsed() >= SHM_PARK);
        self.parked = kept;
        due.into_iter().map(|(_, h)| h).collect()
    }

    /// Whether the lock watchdog goes on: while shm endpoints are open. Asked every tick,
    /// it also closes the parked endpoints that are due, so that they go on time in a
    /// process that opens and closes no other (a server after a replacement).
    fn keep_watching() -> bool {
        let (watching, due) = {
            let mut shm = SHM_ENDPOINTS.lock().unwrap_or_else(|e| e.into_inner());
            shm.watching = shm.open > 0;
            (shm.watching, shm.take_due(false))
        };
        for handles in due {
            // SAFETY: parked handles, opened by `open_rail` and used by nothing any more;
            // taken out of the list above, so closed once.
            unsafe { handles.close() };
        }
        watching
    }
}
