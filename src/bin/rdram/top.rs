//! `rdram top`: a per-shard table of a cluster, redrawn every interval, from each shard's
//! stats (rates are the difference of two samples).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use remote_dram::{Client, Error};
use serde_json::Value;

/// One shard's cumulative counters and state at one moment.
#[derive(Clone, Default)]
struct Sample {
    requests: u64,
    errors: u64,
    bytes: u64,
    used: u64,
    capacity: u64,
    keys: u64,
    clients: u64,
    /// Cluster members: the view's epoch, whether the server hands keys over, and the
    /// bytes it handed over so far (the server's, on every shard).
    view: u64,
    handing_over: bool,
    handed_over_bytes: u64,
}

impl Sample {
    fn of(shard: &Value) -> Sample {
        let n = |k: &str| shard[k].as_u64().unwrap_or(0);
        Sample {
            requests: n("requests"),
            errors: n("errors"),
            bytes: n("received_bytes") + n("sent_bytes"),
            used: n("used_bytes"),
            capacity: n("capacity_bytes"),
            keys: n("keys"),
            clients: n("server_clients"),
            view: n("cluster_view"),
            handing_over: shard["handing_over"].as_bool().unwrap_or(false),
            handed_over_bytes: n("handed_over_bytes"),
        }
    }
}

/// `(server, shard index, sample)` for every shard of every server, in order.
fn sample(client: &mut Client) -> Result<Vec<(String, u64, Sample)>, Error> {
    let stats = client.stats()?;
    let mut out = Vec::new();
    for server in stats["servers"].as_array().into_iter().flatten() {
        let node = server["node"].as_str().unwrap_or("?").to_string();
        for shard in server["shards"].as_array().into_iter().flatten() {
            out.push((node.clone(), shard["shard"].as_u64().unwrap_or(0), Sample::of(shard)));
        }
    }
    Ok(out)
}

/// Redraws the table every `interval` (`iterations` times, or until interrupted).
pub fn run(mut client: Client, interval: Duration, iterations: Option<u64>) -> Result<(), Error> {
    let redraw = std::io::stdout().is_terminal();
    let mut before = sample(&mut client)?;
    let mut at = Instant::now();
    let mut drawn = 0;
    while iterations.is_none_or(|n| drawn < n) {
        std::thread::sleep(interval);
        let now = sample(&mut client)?;
        let secs = at.elapsed().as_secs_f64().max(1e-3);
        at = Instant::now();
        let table = render(&before, &now, secs);
        let mut out = std::io::stdout().lock();
        if redraw {
            // Home, clear: the table replaces the last one.
            write!(out, "\x1b[H\x1b[2J")?;
        }
        writeln!(out, "{table}")?;
        out.flush()?;
        before = now;
        drawn += 1;
    }
    Ok(())
}

fn render(before: &[(String, u64, Sample)], now: &[(String, u64, Sample)], secs: f64) -> String {
    let mut lines = vec![format!(
        "{:<22} {:>5} {:>10} {:>9} {:>21} {:>9} {:>7} {:>9}",
        "server", "shard", "ops/s", "MB/s", "used / capacity MiB", "keys", "clients", "errors/s"
    )];
    let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    let mut total = (0.0, 0.0, 0, 0, 0, 0.0);
    for (node, shard, s) in now {
        let prev = before.iter().find(|(n, i, _)| n == node && i == shard).map(|b| b.2.clone()).unwrap_or_default();
        let (ops, mbs, errs) =
            (rate(prev.requests, s.requests), rate(prev.bytes, s.bytes) / 1e6, rate(prev.errors, s.errors));
        let pct = 100.0 * s.used as f64 / s.capacity.max(1) as f64;
        lines.push(format!(
            "{:<22} {:>5} {:>10.0} {:>9.1} {:>21} {:>9} {:>7} {:>9.0}",
            node,
            shard,
            ops,
            mbs,
            format!("{} / {} ({pct:.0}%)", s.used >> 20, s.capacity >> 20),
            s.keys,
            s.clients,
            errs
        ));
        total =
            (total.0 + ops, total.1 + mbs, total.2 + s.used, total.3 + s.capacity, total.4 + s.keys, total.5 + errs);
    }
    lines.push(format!(
        "{:<22} {:>5} {:>10.0} {:>9.1} {:>21} {:>9} {:>7} {:>9.0}",
        "total",
        now.len(),
        total.0,
        total.1,
        format!("{} / {}", total.2 >> 20, total.3 >> 20),
        total.4,
        "",
        total.5
    ));
    for (node, _, s) in now.iter().filter(|(_, shard, s)| *shard == 0 && s.handing_over) {
        let prev =
            before.iter().find(|(n, i, _)| n == node && *i == 0).map_or(s.handed_over_bytes, |b| b.2.handed_over_bytes);
        lines.push(format!(
            "{node} hands keys over (view {}): {} MiB so far, {:.1} MB/s",
            s.view,
            s.handed_over_bytes >> 20,
            rate(prev, s.handed_over_bytes) / 1e6
        ));
    }
    lines.join("\n")
}
