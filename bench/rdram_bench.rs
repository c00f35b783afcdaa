//! rdram-bench: closed-loop latency and throughput of GET and PUT against a running
//! server (`--server`) or one started in this process (`--embedded`; traffic still goes
//! through UCX, as for any client).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use remote_dram::client::{GetInto, GetOptions};
use remote_dram::store::{parse_size, HugePages, Mode};
use remote_dram::transport::PollMode;
use remote_dram::{Client, ClientOptions, Server, ServerConfig};

#[derive(Parser, Clone)]
#[command(name = "rdram-bench", about = "Latency histograms and throughput for remote_dram")]
struct Args {
    /// Server address(es); omit with --embedded.
    #[arg(long, env = "RDRAM_SERVER", required_unless_present = "embedded")]
    server: Option<String>,
    /// Start a server in this process (still reached over UCX).
    #[arg(long)]
    embedded: bool,
    #[arg(long, value_delimiter = ',', default_value = "0")]
    server_cores: Vec<usize>,
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    server_memory: u64,
    /// get, put, or both.
    #[arg(long, default_value = "get,put", value_delimiter = ',')]
    ops: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "8,4096,65536,1048576", value_parser = parse_size)]
    sizes: Vec<u64>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, value_delimiter = ',')]
    client_cores: Vec<usize>,
    /// Requests in flight per thread.
    #[arg(long, default_value_t = 1)]
    depth: usize,
    #[arg(long, default_value_t = 64)]
    keys: usize,
    #[arg(long, default_value = "3")]
    seconds: f64,
    #[arg(long, default_value = "0.5")]
    warmup: f64,
    #[arg(long, value_enum, default_value = "busy")]
    poll: PollMode,
    /// One JSON object per (op, size) instead of the table.
    #[arg(long)]
    json: bool,
}

const KEY_BYTES: u64 = 128 << 20;

struct Run {
    op: String,
    size: u64,
    ops: u64,
    elapsed: Duration,
    hist: Histogram<u64>,
}

fn main() {
    let args = Args::parse();
    let server = args.embedded.then(|| {
        Server::start(ServerConfig {
            listen: "127.0.0.1:0".into(),
            workers: args.server_cores.len(),
            cores: args.server_cores.clone(),
            memory: args.server_memory,
            hugepages: HugePages::Auto,
            poll: args.poll,
            mode: Mode::Store,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("embedded server: {e}"))
    });
    let addr = server.as_ref().map(|s| s.local_addr().to_string()).or(args.server.clone()).unwrap();
    if !args.json {
        println!("# server {addr}, {} thread(s), depth {}, poll {:?}, UCX_TLS={}", args.threads, args.depth, args.poll, std::env::var("UCX_TLS").unwrap_or_default());
        println!("| op | size | ops/s | MB/s | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs |");
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    for op in &args.ops {
        for &size in &args.sizes {
            let run = run_one(&args, &addr, op, size);
            report(&args, &run);
        }
    }
    if let Some(s) = server {
        s.stop();
    }
}

fn run_one(args: &Args, addr: &str, op: &str, size: u64) -> Run {
    let barrier = Arc::new(Barrier::new(args.threads));
    let threads: Vec<_> = (0..args.threads)
        .map(|t| {
            let (args, addr, op, barrier) = (args.clone(), addr.to_string(), op.to_string(), barrier.clone());
            std::thread::spawn(move || {
                if let Some(&core) = args.client_cores.get(t % args.client_cores.len().max(1)) {
                    core_affinity::set_for_current(core_affinity::CoreId { id: core });
                }
                let opts = ClientOptions { poll: args.poll, ..Default::default() };
                let mut c = Client::connect(&addr, opts).unwrap_or_else(|e| panic!("connect: {e}"));
                let value = vec![0xA5u8; size as usize];
                let mut sink = vec![0u8; size as usize];
                // At most KEY_BYTES of values per thread, and at least one key.
                let nkeys = args.keys.min((KEY_BYTES / size.max(1)) as usize).max(1);
                let keys: Vec<Vec<u8>> = (0..nkeys).map(|k| format!("bench/{t}/{size}/{k}").into_bytes()).collect();
                for k in &keys {
                    c.put(k, &value).unwrap_or_else(|e| panic!("prefill: {e}"));
                }
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
                barrier.wait();
                let mut ops = 0u64;
                let mut next = 0usize;
                let warm_end = Instant::now() + Duration::from_secs_f64(args.warmup);
                let mut measure_start = None;
                let mut end = warm_end;
                loop {
                    let now = Instant::now();
                    if measure_start.is_none() && now >= warm_end {
                        measure_start = Some(now);
                        end = now + Duration::from_secs_f64(args.seconds);
                    }
                    if measure_start.is_some() && now >= end {
                        break;
                    }
                    let batch: Vec<&[u8]> = (0..args.depth).map(|i| keys[(next + i) % keys.len()].as_slice()).collect();
                    next += args.depth;
                    let t0 = Instant::now();
                    if op == "get" {
                        if args.depth == 1 {
                            // Into a reused buffer, as a latency-sensitive caller would.
                            let r = c.get_into(batch[0], &GetOptions::default(), &mut sink).expect("get");
                            assert!(matches!(r, GetInto::Value { .. }), "{r:?}");
                        } else {
                            for r in c.get_many(&batch, args.depth) {
                                r.expect("get").expect("present");
                            }
                        }
                    } else if args.depth == 1 {
                        c.put(batch[0], &value).expect("put");
                    } else {
                        let items: Vec<(&[u8], &[u8])> = batch.iter().map(|k| (*k, value.as_slice())).collect();
                        for r in c.put_many(&items, args.depth) {
                            r.expect("put");
                        }
                    }
                    let ns = t0.elapsed().as_nanos() as u64;
                    if measure_start.is_some() {
                        for _ in 0..args.depth {
                            hist.record(ns.max(1)).unwrap();
                        }
                        ops += args.depth as u64;
                    }
                }
                let elapsed = measure_start.map(|s| s.elapsed()).unwrap_or_default();
                for k in &keys {
                    c.delete(k).expect("cleanup");
                }
                (ops, elapsed, hist)
            })
        })
        .collect();
    let mut run = Run { op: op.into(), size, ops: 0, elapsed: Duration::ZERO, hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap() };
    for t in threads {
        let (ops, elapsed, hist) = t.join().expect("bench thread");
        run.ops += ops;
        run.elapsed = run.elapsed.max(elapsed);
        run.hist.add(&hist).unwrap();
    }
    run
}

fn report(args: &Args, r: &Run) {
    let secs = r.elapsed.as_secs_f64().max(1e-9);
    let ops_s = r.ops as f64 / secs;
    let mb_s = ops_s * r.size as f64 / 1e6;
    let us = |q: f64| r.hist.value_at_quantile(q) as f64 / 1000.0;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"op": r.op, "size": r.size, "ops_per_s": ops_s, "mb_per_s": mb_s, "p50_us": us(0.5),
                "p90_us": us(0.9), "p99_us": us(0.99), "p999_us": us(0.999), "max_us": r.hist.max() as f64 / 1000.0})
        );
    } else {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} |",
            r.op,
            r.size,
            ops_s,
            mb_s,
            us(0.5),
            us(0.9),
            us(0.99),
            us(0.999),
            r.hist.max() as f64 / 1000.0
        );
    }
}
