//! The standard `process_*` metrics, from /proc/self (Linux).

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use super::{family, gauge, Labels};

pub fn encode(e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    // SAFETY: sysconf has no preconditions.
    let (page, ticks) =
        unsafe { (libc::sysconf(libc::_SC_PAGESIZE).max(1) as u64, libc::sysconf(libc::_SC_CLK_TCK).max(1) as f64) };
    let none = Labels::new;
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        let pages: Vec<u64> = statm.split_whitespace().filter_map(|f| f.parse().ok()).collect();
        if pages.len() >= 2 {
            family(
                e,
                "process_virtual_memory_bytes",
                "Virtual memory size",
                MetricType::Gauge,
                [(none(), gauge(pages[0] * page))],
            )?;
            family(
                e,
                "process_resident_memory_bytes",
                "Resident memory size",
                MetricType::Gauge,
                [(none(), gauge(pages[1] * page))],
            )?;
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        family(
            e,
            "process_open_fds",
            "Open file descriptors",
            MetricType::Gauge,
            [(none(), gauge(fds.count() as u64))],
        )?;
    }
    // Fields after the command name (which may hold spaces): utime and stime are the 12th
    // and 13th of them.
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let f: Vec<&str> = after.split_whitespace().collect();
        if let (Some(u), Some(s)) =
            (f.get(11).and_then(|v| v.parse::<u64>().ok()), f.get(12).and_then(|v| v.parse::<u64>().ok()))
        {
            family(
                e,
                "process_cpu_seconds",
                "User and system CPU time",
                MetricType::Counter,
                [(none(), ConstCounter::new((u + s) as f64 / ticks))],
            )?;
        }
    }
    Ok(())
}
