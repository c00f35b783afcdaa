//! `rdram-gateway-load`: drives `rdram gateway` with a gRPC client of its own (tonic), many
//! values at once over several connections, to tell the gateway's own limits from those of
//! the client in front of it (TensorStore's gRPC client reads through the gateway at a
//! fraction of what the gateway serves).
//!
//!   rdram-gateway-load --gateway 127.0.0.1:9100 [--connections 4] [--concurrency 16]
//!                      [--size 4MiB] [--seconds 3] [--threads N]
//!
//! Writes go as TensorStore sends them (value parts of at most 1 MiB); each op prints MB/s
//! (10^6 B/s) and its p50 / p99 latency.

use std::time::{Duration, Instant};

use clap::Parser;
use remote_dram::gateway::pb::{self, kv_store_service_client::KvStoreServiceClient};
use tonic::transport::Channel;

/// TensorStore's largest Write message part.
const WRITE_PART: usize = 1 << 20;

#[derive(Parser)]
#[command(about = "Load for rdram gateway from a gRPC client of its own")]
struct Args {
    /// The gateway's address (host:port).
    #[arg(long)]
    gateway: String,
    /// HTTP/2 connections (TensorStore opens 4 to a loopback address).
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Calls in flight, spread over the connections.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Value size, e.g. 4MiB.
    #[arg(long, default_value = "4MiB", value_parser = remote_dram::cli::parse_size)]
    size: u64,
    /// Seconds per op.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runtime threads (default: the CPUs this process may run on).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Write,
    Read,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        runtime.worker_threads(n.max(1));
    }
    runtime.enable_all().build()?.block_on(run(args))
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        channels.push(Channel::from_shared(format!("http://{}", args.gateway))?.connect().await?);
    }
    let value = bytes::Bytes::from(vec![0x5a_u8; args.size as usize]);
    println!(
        "gateway {}: {} connections, {} calls in flight, {} B values",
        args.gateway,
        channels.len(),
        args.concurrency,
        args.size
    );
    for op in [Op::Write, Op::Read] {
        let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
        let started = Instant::now();
        let tasks: Vec<_> = (0..args.concurrency.max(1))
            .map(|i| {
                let mut client = KvStoreServiceClient::new(channels[i % channels.len()].clone())
                    .max_decoding_message_size(usize::MAX);
                let value = value.clone();
                tokio::spawn(async move {
                    let key = bytes::Bytes::from(format!("gateway-load/{i}"));
                    let mut latencies = Vec::new();
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        match op {
                            Op::Write => write(&mut client, &key, &value).await?,
                            Op::Read => read(&mut client, &key, value.len()).await?,
                        }
                        latencies.push(t.elapsed());
                    }
                    Ok::<_, tonic::Status>(latencies)
                })
            })
            .collect();
        let mut latencies = Vec::new();
        for task in tasks {
            latencies.extend(task.await??);
        }
        let elapsed = started.elapsed().as_secs_f64();
        if latencies.is_empty() {
            return Err(format!("no call finished within {} s", args.seconds).into());
        }
        latencies.sort();
        let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
        let name = if op == Op::Write { "write" } else { "read" };
        println!(
            "{name}: {:.0} MB/s, {} calls, p50 {:.2} ms, p99 {:.2} ms",
            latencies.len() as f64 * args.size as f64 / elapsed / 1e6,
            latencies.len(),
            at(0.5),
            at(0.99)
        );
    }
    Ok(())
}

async fn write(
    client: &mut KvStoreServiceClient<Channel>,
    key: &bytes::Bytes,
    value: &bytes::Bytes,
) -> Result<(), tonic::Status> {
    let parts: Vec<pb::WriteRequest> = (0..value.len().div_ceil(WRITE_PART).max(1))
        .map(|i| pb::WriteRequest {
            key: key.clone(),
            value_part: value.slice((i * WRITE_PART).min(value.len())..((i + 1) * WRITE_PART).min(value.len())),
            ..Default::default()
        })
        .collect();
    client.write(tokio_stream::iter(parts)).await?;
    Ok(())
}

async fn read(
    client: &mut KvStoreServiceClient<Channel>,
    key: &bytes::Bytes,
    want: usize,
) -> Result<(), tonic::Status> {
    let mut replies = client.read(pb::ReadRequest { key: key.clone(), ..Default::default() }).await?.into_inner();
    let mut got = 0;
    while let Some(reply) = replies.message().await? {
        got += reply.value_part.len();
    }
    if got != want {
        return Err(tonic::Status::data_loss(format!("read {got} bytes of a {want}-byte value")));
    }
    Ok(())
}
