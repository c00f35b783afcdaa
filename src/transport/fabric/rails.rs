//! One libfabric endpoint per NIC domain ("rail"), owned by one thread. Requests and
//! replies use rail 0; large values are striped across all rails, as on a multi-NIC EFA
//! host. With fewer domains than rails, rails share a domain (how striping is tested on a
//! one-NIC machine).

use std::net::IpAddr;
use std::os::fd::RawFd;

use super::{Completion, Endpoint, MemoryRegion, RemoteAccess};
use crate::error::{Error, Result, Status};
use crate::transport::Transport;

/// Transfers shorter than this go on one rail: striping only pays off for large values.
pub const STRIPE_MIN: usize = 256 << 10;

pub struct Rails {
    pub eps: Vec<Endpoint>,
    /// Every local buffer is registered and its descriptor passed: required under
    /// `FI_MR_LOCAL` (EFA), or forced with RDRAM_FABRIC_REGISTER_LOCAL=1 so that this
    /// path is tested on providers that do not need it.
    register_local: bool,
    /// An epoll set over every rail's completion fd, or -1 when a provider has none.
    epoll: RawFd,
    /// shm's inject size: see [`Rails::one_message_max`].
    inline_max: Option<usize>,
}

impl Rails {
    /// Opens `n` rails on `provider`. IP-based providers bind to `local` (the listen
    /// address, or the address that reaches the server), so loopback traffic stays on
    /// `lo`; NIC-based ones (efa, shm) pick their own. The transport needs one-sided
    /// reads (`FI_RMA`); a provider without them is refused with a clear error.
    pub fn open(provider: &str, local: Option<IpAddr>, n: usize) -> Result<Rails> {
        if n == 0 || n > 64 {
            return Err(Error::new(Status::Invalid, "rails (domains) must be between 1 and 64"));
        }
        let ip_based = ["tcp", "sockets", "udp", "verbs"].iter().any(|p| provider.contains(p));
        let node = local.filter(|ip| ip_based && !ip.is_unspecified()).map(|ip| ip.to_string());
        let node = node.as_deref();
        let mut eps = Vec::with_capacity(n);
        for rail in 0..n {
            let ep = Endpoint::open_rail(provider, node, rail)?;
            if !ep.rma {
                return Err(Error::new(
                    Status::Unavailable,
                    format!("libfabric provider '{}' offers no one-sided reads (FI_RMA), which remote_dram needs for large values", ep.provider),
                ));
            }
            eps.push(ep);
        }
        let forced = std::env::var("RDRAM_FABRIC_REGISTER_LOCAL").is_ok_and(|v| v == "1");
        let register_local = forced || eps[0].mr_mode & super::sys::FI_MR_LOCAL != 0;
        let inline_max = Some(eps[0].inject_size).filter(|&size| eps[0].provider == "shm" && size > 0);
        let mut rails = Rails { eps, register_local, epoll: -1, inline_max };
        if rails.eps.iter().all(|e| e.wait_fd >= 0) {
            // SAFETY: plain epoll syscalls on fds the endpoints own for their lifetime.
            unsafe {
                let epoll = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                if epoll >= 0 {
                    for ep in &rails.eps {
                        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 0 };
                        libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, ep.wait_fd, &mut ev);
                    }
                    rails.epoll = epoll;
                }
            }
        }
        Ok(rails)
    }

    /// "provider tcp;ofi_rxm, fabric 127.0.0.1/32, domain lo" (+ the rail count).
    pub fn describe(&self) -> String {
        let first = self.eps[0].describe();
        if self.eps.len() == 1 {
            return first;
        }
        let domains: Vec<&str> = self.eps.iter().map(|e| e.domain_name.as_str()).collect();
        format!("{first}, {} rails on domains {}", self.eps.len(), domains.join(","))
    }

    pub fn provider(&self) -> &str {
        &self.eps[0].provider
    }

    pub fn addresses(&self) -> Result<Vec<Vec<u8>>> {
        self.eps.iter().map(|e| e.address()).collect()
    }

    /// Registers `[ptr, ptr+len)` on every rail (each domain has its own keys).
    pub fn register(&self, ptr: *const u8, len: usize, remote: RemoteAccess) -> Result<Vec<MemoryRegion>> {
        let mut regions = Vec::with_capacity(self.eps.len());
        for ep in &self.eps {
            match ep.register(ptr, len, remote) {
                Ok(r) => regions.push(r),
                Err(e) => {
                    self.deregister(regions);
                    return Err(e);
                }
            }
        }
        Ok(regions)
    }

    pub fn deregister(&self, regions: Vec<MemoryRegion>) {
        for (ep, r) in self.eps.iter().zip(regions) {
            if let Err(e) = ep.deregister(r) {
                tracing::warn!("{e}");
            }
        }
    }

    /// Whether local buffers need a registration descriptor (`FI_MR_LOCAL`, as on EFA).
    pub fn needs_local_registration(&self) -> bool {
        self.register_local
    }

    /// The longest message worth sending as one. shm copies messages up to its inject
    /// size (4 KiB) through its inline queue and moves longer ones by a protocol three
    /// times slower, so there a reply with a 4 KiB value goes as header, then payload, and
    /// a longer request in parts; other providers send up to `max` in one eager message.
    pub fn one_message_max(&self, max: usize) -> usize {
        self.inline_max.map_or(max, |inline| inline.min(max))
    }

    /// Reaps completions from every rail into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>) -> usize {
        self.eps.iter().map(|e| e.poll(out, 16)).sum()
    }
}

/// Each rail's share of a `len`-byte transfer (4 KiB-aligned), or all of it when short.
pub fn stripe_len(len: usize, rails: usize) -> usize {
    if rails <= 1 || len < STRIPE_MIN {
        len
    } else {
        len.div_ceil(rails).next_multiple_of(4096)
    }
}

/// Splits `len` bytes into one part per rail, or one part when short.
pub fn stripes(len: usize, rails: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = stripe_len(len, rails);
    let parts = if chunk == len { 1 } else { rails };
    (0..parts)
        .map(move |p| (p * chunk, len.saturating_sub(p * chunk).min(chunk)))
        .filter(move |&(off, l)| l > 0 || (off == 0 && len == 0))
}

impl Transport for Rails {
    fn arm(&self) -> Result<bool> {
        Ok(self.eps.iter().all(|e| e.try_wait()))
    }
    fn event_fd(&self) -> RawFd {
        self.epoll
    }
}

impl Drop for Rails {
    fn drop(&mut self) {
        if self.epoll >= 0 {
            // SAFETY: our own epoll fd, closed once.
            unsafe { libc::close(self.epoll) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_the_transfer_exactly_once() {
        for (len, rails) in [
            (0, 1),
            (100, 4),
            (STRIPE_MIN - 1, 3),
            (STRIPE_MIN, 3),
            (64 << 20, 4),
            ((1 << 20) + 5, 3),
            (STRIPE_MIN, 64),
        ] {
            let parts: Vec<_> = stripes(len, rails).collect();
            let mut at = 0;
            for &(off, l) in &parts {
                assert_eq!(off, at, "len {len} rails {rails}: {parts:?}");
                at += l;
            }
            assert_eq!(at, len, "len {len} rails {rails}");
            assert!(parts.len() <= rails.max(1));
            if len >= STRIPE_MIN && rails > 1 {
                assert!(parts.len() > 1, "large transfers use several rails");
            }
        }
    }
}
