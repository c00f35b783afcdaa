//! rdram-bench: latency histograms and throughput of GET and PUT against a running server
//! (`--server`) or one started in this process (`--embedded`; traffic still goes through
//! the transport, as for any client).
//!
//! Closed loop (default): each thread keeps `--depth` requests in flight. Open loop
//! (`--rate`): requests are issued on a fixed schedule and latency counts from when each
//! was due, so stalls are not hidden (coordinated omission).

mod report;
mod workload;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use clap::Parser;
use hdrhistogram::Histogram;
// Timestamps from the TSC, as ucx_perftest takes them: the two clock reads around each
// request are counted in its latency, and std's (clock_gettime) took 50 ns a pair on this
// VM against quanta's 20, an eighth of a small GET.
use quanta::Instant;
use remote_dram::cli::parse_size;
use remote_dram::client::{GetInto, GetOptions};
use remote_dram::store::{HugePages, Mode};
use remote_dram::transport::PollMode;
use remote_dram::{Client, ClientOptions, Server, ServerConfig};

use report::Run;
use workload::{KeyChooser, KeyDistribution, Pacer};

#[derive(Parser, Clone)]
#[command(name = "rdram-bench", about = "Latency histograms and throughput for remote_dram")]
struct Args {
    /// Server address(es); omit with --embedded.
    #[arg(long, env = "RDRAM_SERVER", required_unless_present = "embedded")]
    server: Option<String>,
    /// Start a server in this process (still reached over the transport).
    #[arg(long)]
    embedded: bool,
    /// Cores of the embedded server's workers (one worker per core).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    server_cores: Vec<usize>,
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    server_memory: u64,
    /// Workloads, each measured separately: get, put, mix (see --get-ratio).
    #[arg(long, default_value = "get,put", value_delimiter = ',', value_parser = ["get", "put", "mix"])]
    ops: Vec<String>,
    /// Share of GETs in the `mix` workload.
    #[arg(long, default_value_t = 0.9)]
    get_ratio: f64,
    #[arg(long, value_delimiter = ',', default_value = "8,4096,65536,1048576", value_parser = parse_size)]
    sizes: Vec<u64>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, value_delimiter = ',')]
    client_cores: Vec<usize>,
    /// Requests in flight per thread (closed loop). Latency of a pipelined request is the
    /// time its window took.
    #[arg(long, default_value_t = 1)]
    depth: usize,
    /// Value buffers per thread that requests rotate through: GETs read into them, PUTs
    /// write from them (default: --depth, one per request in flight; rounded up to a
    /// multiple of it). Depth 1 with as many buffers as a deeper run has compares the two
    /// with the same working set: 16 MiB of distinct buffers does not stay in a cache that
    /// one 1 MiB buffer does.
    #[arg(long)]
    buffers: Option<usize>,
    /// Open loop: total requests per second over all threads (depth 1).
    #[arg(long)]
    rate: Option<f64>,
    /// Keys per thread (capped so that a thread's values stay under 128 MiB).
    #[arg(long, default_value_t = 64)]
    keys: usize,
    /// Key length in bytes: keys are padded with '.' to it (at least as long as
    /// `bench/THREAD/SIZE/N`, which is what they are by default). Model keys such as
    /// checkpoint tensor names run to 40-100 bytes.
    #[arg(long, default_value_t = 0)]
    key_len: usize,
    #[arg(long, value_enum, default_value = "uniform")]
    distribution: KeyDistribution,
    #[arg(long, default_value_t = 0.99)]
    zipf_exponent: f64,
    /// Measured duration per (op, size), after the warm-up…
    #[arg(long, default_value = "3")]
    seconds: f64,
    /// …or a number of requests per thread instead.
    #[arg(long)]
    count: Option<u64>,
    #[arg(long, default_value = "0.5")]
    warmup: f64,
    #[arg(long, value_enum, default_value = "busy")]
    poll: PollMode,
    /// With `--poll adaptive`: how long each client thread spins for its answers before it
    /// sleeps (µs; default the library's). 0 sleeps at once, as where threads outnumber
    /// cores and a spinning client would keep the servers it waits for off the CPU.
    #[arg(long)]
    spin_us: Option<u64>,
    /// One JSON object per (op, size) instead of the table.
    #[arg(long)]
    json: bool,
    /// Where the .hgrm files and latency.svg go.
    #[arg(long, default_value = "rdram-bench-out")]
    out: PathBuf,
}

const KEY_BYTES: u64 = 128 << 20;

/// Value buffers per thread: --buffers rounded up to a multiple of --depth.
fn buffer_count(args: &Args) -> usize {
    args.buffers.unwrap_or(args.depth).max(1).div_ceil(args.depth) * args.depth
}

fn main() {
    let args = Args::parse();
    // The library's logs (a cluster's view changes, reconnects) on stderr, when RUST_LOG asks.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    if args.depth == 0 {
        fail("--depth must be at least 1");
    }
    if args.rate.is_some() && args.depth != 1 {
        fail("--rate (open loop) issues one request at a time: use --depth 1");
    }
    if args.spin_us.is_some() && args.poll != PollMode::Adaptive {
        fail("--spin-us is for --poll adaptive (a busy client spins for ever)");
    }
    if !(0.0..=1.0).contains(&args.get_ratio) {
        fail("--get-ratio must be between 0 and 1");
    }
    std::fs::create_dir_all(&args.out).unwrap_or_else(|e| fail(&format!("--out {}: {e}", args.out.display())));
    let server = args.embedded.then(|| {
        Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            workers: args.server_cores.len(),
            cores: args.server_cores.clone(),
            memory: args.server_memory,
            hugepages: HugePages::Auto,
            poll: args.poll,
            mode: Mode::Store,
            ucx_tcp: remote_dram::server::ucx_tcp_opted_in_by_env(),
            ..Default::default()
        })
        .unwrap_or_else(|e| fail(&format!("embedded server: {e}")))
    });
    let addr = server.as_ref().map(|s| s.local_addr().to_string()).or(args.server.clone()).unwrap();
    let loop_kind = match args.rate {
        Some(r) => format!("open loop {r:.0} req/s"),
        None => format!("closed loop depth {}", args.depth),
    };
    let title = format!(
        "rdram-bench: {} thread(s), {loop_kind}, {} buffer(s), {:?} keys, poll {:?}, UCX_TLS={}",
        args.threads,
        buffer_count(&args),
        args.distribution,
        args.poll,
        std::env::var("UCX_TLS").unwrap_or_default()
    );
    if !args.json {
        println!("# server {addr}; {title}\n{}", report::TABLE_HEADER);
    }
    let mut runs = Vec::new();
    for op in &args.ops {
        for &size in &args.sizes {
            for run in run_workload(&args, &addr, op, size) {
                report::print(&run, args.json);
                report::write_hgrm(&run, &args.out).unwrap_or_else(|e| fail(&format!("writing .hgrm: {e}")));
                runs.push(run);
            }
        }
    }
    report::write_plot(&runs, &args.out.join("latency.svg"), &title).unwrap_or_else(|e| fail(&format!("plot: {e}")));
    eprintln!("histograms and latency.svg in {}", args.out.display());
    if let Some(s) = server {
        s.stop();
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("rdram-bench: {msg}");
    std::process::exit(2)
}

/// What one thread measured: per op kind (get, put) a histogram and a count.
struct Measured {
    hists: [Histogram<u64>; 2],
    ops: [u64; 2],
    elapsed: Duration,
}

const GET: usize = 0;
const PUT: usize = 1;

/// Requests each thread has done, for the progress line. Each thread counts on a cache
/// line of its own: one counter shared by every thread and bumped per request would bounce
/// its line between the client cores of a scaling run.
#[repr(align(128))]
#[derive(Default)]
struct Done(AtomicU64);

impl Done {
    /// Adds `n`; only the counter's own thread writes it.
    fn add(&self, n: u64) {
        self.0.store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }
}

/// Runs one (op, size) on all threads; `mix` yields a run for its gets and one for its puts.
fn run_workload(args: &Args, addr: &str, op: &str, size: u64) -> Vec<Run> {
    let barrier = Arc::new(Barrier::new(args.threads + 1));
    let done: Arc<Vec<Done>> = Arc::new((0..args.threads).map(|_| Done::default()).collect());
    let threads: Vec<_> = (0..args.threads)
        .map(|t| {
            let (args, addr, op, barrier, done) =
                (args.clone(), addr.to_string(), op.to_string(), barrier.clone(), done.clone());
            std::thread::spawn(move || bench_thread(&args, &addr, &op, size, t, &barrier, &done[t]))
        })
        .collect();
    barrier.wait();
    show_progress(args, op, size, &threads, &done);

    let mut total =
        Measured { hists: [report::new_histogram(), report::new_histogram()], ops: [0; 2], elapsed: Duration::ZERO };
    for t in threads {
        let m = t.join().unwrap_or_else(|_| fail("a bench thread failed"));
        for k in [GET, PUT] {
            total.hists[k].add(&m.hists[k]).expect("same histogram bounds");
            total.ops[k] += m.ops[k];
        }
        total.elapsed = total.elapsed.max(m.elapsed);
    }
    let [get_hist, put_hist] = total.hists;
    let run = |name: &str, kind: usize, hist| Run {
        op: name.into(),
        size,
        ops: total.ops[kind],
        elapsed: total.elapsed,
        hist,
    };
    match op {
        "get" => vec![run("get", GET, get_hist)],
        "put" => vec![run("put", PUT, put_hist)],
        _ => vec![run("mix:get", GET, get_hist), run("mix:put", PUT, put_hist)],
    }
}

/// Progress on stderr once a second for runs longer than a few seconds.
fn show_progress(args: &Args, op: &str, size: u64, threads: &[std::thread::JoinHandle<Measured>], done: &[Done]) {
    let long = args.count.is_none() && args.seconds + args.warmup > 3.0;
    let start = Instant::now();
    let mut next_report = Duration::from_secs(1);
    while !threads.iter().all(|t| t.is_finished()) {
        std::thread::sleep(Duration::from_millis(50));
        if long && start.elapsed() >= next_report {
            let total = args.seconds + args.warmup;
            let requests: u64 = done.iter().map(|d| d.0.load(Ordering::Relaxed)).sum();
            eprintln!("[{op} {size} B] {}/{total:.0} s, {requests} requests", next_report.as_secs());
            next_report += Duration::from_secs(1);
        }
    }
}

fn bench_thread(args: &Args, addr: &str, op: &str, size: u64, t: usize, barrier: &Barrier, done: &Done) -> Measured {
    if !args.client_cores.is_empty() {
        let core = args.client_cores[t % args.client_cores.len()];
        core_affinity::set_for_current(core_affinity::CoreId { id: core });
    }
    let mut opts = ClientOptions { poll: args.poll, ..Default::default() };
    if let Some(us) = args.spin_us {
        opts.spin = Duration::from_micros(us);
    }
    let mut c = Client::connect(addr, opts).unwrap_or_else(|e| fail(&format!("connect {addr}: {e}")));
    // Reused buffers, at least one per request in flight, as a throughput-minded caller
    // would keep them (fresh buffers would measure page faults); each batch takes the next
    // `depth` of them.
    let buffers = buffer_count(args);
    let values = vec![vec![0xA5u8; size as usize]; buffers];
    let mut sinks = vec![vec![0u8; size as usize]; buffers];
    let mut next_buffer = 0;
    let nkeys = args.keys.min((KEY_BYTES / size.max(1)) as usize).max(1);
    let keys: Vec<Vec<u8>> = (0..nkeys)
        .map(|k| {
            let mut key = format!("bench/{t}/{size}/{k}").into_bytes();
            key.resize(key.len().max(args.key_len), b'.');
            key
        })
        .collect();
    for k in &keys {
        c.put(k, &values[0]).unwrap_or_else(|e| fail(&format!("prefill: {e}")));
    }
    let mut chooser = KeyChooser::new(nkeys, args.distribution, args.zipf_exponent, 0x5eed + t as u64);
    let mut m =
        Measured { hists: [report::new_histogram(), report::new_histogram()], ops: [0; 2], elapsed: Duration::ZERO };
    barrier.wait();

    let start = Instant::now();
    let measure_start = start + Duration::from_secs_f64(args.warmup);
    let deadline = measure_start + Duration::from_secs_f64(args.seconds);
    let mut pacer = args.rate.map(|r| Pacer::new(start, r / args.threads as f64, args.poll == PollMode::Busy));
    let mut measured = 0u64;
    // Reused: nothing is allocated per request on the measured path at depth 1.
    let mut batch: Vec<&[u8]> = Vec::with_capacity(args.depth);
    loop {
        // The request is chosen before its clock starts: the latency is the library's
        // (ucx_perftest times its calls alike), not this loop's.
        let kind = match op {
            "get" => GET,
            "put" => PUT,
            _ if chooser.chance(args.get_ratio) => GET,
            _ => PUT,
        };
        batch.clear();
        batch.extend((0..args.depth).map(|_| keys[chooser.next()].as_slice()));
        let window = next_buffer..next_buffer + args.depth;
        next_buffer = window.end % buffers;
        let due = match &mut pacer {
            Some(p) => p.next_due(),
            None => Instant::now(),
        };
        let measuring = due >= measure_start;
        match args.count {
            Some(n) if measured >= n => break,
            None if due >= deadline => break,
            _ => {}
        }
        if kind == GET {
            get_batch(&mut c, &batch, &mut sinks[window]);
        } else {
            put_batch(&mut c, &batch, &values[window]);
        }
        let ns = due.elapsed().as_nanos() as u64;
        if measuring {
            m.hists[kind].record_n(ns.max(1), args.depth as u64).expect("latency within bounds");
            m.ops[kind] += args.depth as u64;
            measured += args.depth as u64;
        }
        done.add(args.depth as u64);
    }
    m.elapsed = measure_start.elapsed();
    for k in &keys {
        c.delete(k).unwrap_or_else(|e| fail(&format!("cleanup: {e}")));
    }
    m
}

fn get_batch(c: &mut Client, keys: &[&[u8]], sinks: &mut [Vec<u8>]) {
    let check = |r: Result<GetInto, remote_dram::Error>| {
        if !matches!(r, Ok(GetInto::Value { .. })) {
            fail(&format!("get: {r:?}"));
        }
    };
    if let [key] = keys {
        check(c.get_into(key, &GetOptions::default(), &mut sinks[0]));
    } else {
        let mut bufs: Vec<&mut [u8]> = sinks.iter_mut().map(|s| s.as_mut_slice()).collect();
        c.get_many_into(keys, &mut bufs, keys.len()).into_iter().for_each(check);
    }
}

fn put_batch(c: &mut Client, keys: &[&[u8]], values: &[Vec<u8>]) {
    if let ([key], [value]) = (keys, values) {
        c.put(key, value).unwrap_or_else(|e| fail(&format!("put: {e}")));
    } else {
        let items: Vec<(&[u8], &[u8])> = keys.iter().zip(values).map(|(k, v)| (*k, v.as_slice())).collect();
        for r in c.put_many(&items, keys.len()) {
            r.unwrap_or_else(|e| fail(&format!("put: {e}")));
        }
    }
}
