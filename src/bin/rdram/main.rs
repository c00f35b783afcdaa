//! The `rdram` command: run a server, or talk to one.

mod process;
mod top;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use process::{block_stop_signals, raise_fd_limit, wait_for_signal};
use remote_dram::cli::parse_size;
use remote_dram::client::{GetOptions, GetResult, KeyRange, PutOptions, WriteCondition, WriteResult};
use remote_dram::store::{HugePages, Mode};
use remote_dram::transport::PollMode;
use remote_dram::{Client, ClientOptions, Error, Server, ServerConfig, Status, TransportChoice};

/// Exit code for "key not found".
const EXIT_MISSING: u8 = 3;
/// Exit code for "generation condition failed".
const EXIT_CONDITION: u8 = 4;

#[derive(Parser)]
#[command(
    name = "rdram",
    version,
    args_override_self = true,
    about = "remote_dram: a key-value store in remote DRAM over UCX or libfabric"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// What to log (to stderr): error, warn, info, debug, trace, or a tracing filter such
    /// as "info,remote_dram::server=debug". Default: RUST_LOG, else info.
    #[arg(long, global = true)]
    log_level: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run a server.
    Serve(ServeArgs),
    /// Store a value: from the argument, --file, or stdin.
    Put {
        #[command(flatten)]
        conn: ConnArgs,
        key: String,
        value: Option<String>,
        #[arg(long, conflicts_with = "value")]
        file: Option<PathBuf>,
        /// Only write if the current generation equals this.
        #[arg(long)]
        if_equal: Option<u64>,
        /// Only write if the key does not exist.
        #[arg(long, conflicts_with = "if_equal")]
        if_absent: bool,
        /// Expire the value after this many milliseconds (at least 1; leave out for none).
        #[arg(long)]
        ttl_ms: Option<u64>,
    },
    /// Print a value's raw bytes (exit code 3 if the key is missing).
    Get {
        #[command(flatten)]
        conn: ConnArgs,
        key: String,
        #[arg(long)]
        out: Option<PathBuf>,
        /// Byte range start (negative: from the end).
        #[arg(long, allow_hyphen_values = true)]
        range_start: Option<i64>,
        /// Byte range end, exclusive (-1: to the end).
        #[arg(long, allow_hyphen_values = true)]
        range_end: Option<i64>,
        /// Print the generation on stderr.
        #[arg(long)]
        show_generation: bool,
    },
    /// Delete a key (exit code 3 if it did not exist).
    Del {
        #[command(flatten)]
        conn: ConnArgs,
        key: String,
        #[arg(long)]
        if_equal: Option<u64>,
    },
    /// List keys with their value sizes, in order.
    Ls {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// Server statistics as JSON.
    Stats {
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Serve TensorStore's gRPC kvstore protocol (driver "tsgrpc_kvstore") from remote DRAM.
    Gateway(GatewayArgs),
    /// Create a cluster in etcd, or show one.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// A live per-shard table of one server or a cluster (ops/s, MB/s, used/capacity,
    /// keys, clients, errors/s), redrawn every interval.
    Top {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
        /// Stop after this many tables (default: until interrupted).
        #[arg(long)]
        iterations: Option<u64>,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Record a new cluster's settings in etcd: `rdram cluster create etcd://HOST:PORT/NAME`.
    Create {
        /// etcd://HOST:PORT[,HOST:PORT...]/NAME
        url: String,
        /// Servers that hold each key.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
    },
    /// Print a cluster's settings, live members, placement (its view's epoch, and where
    /// keys move while they move) and each source's handover progress, as JSON.
    Status {
        /// etcd://HOST:PORT[,HOST:PORT...]/NAME
        url: String,
    },
    /// Ask one server to hand every key it holds over to the others and then exit.
    Drain {
        /// etcd://HOST:PORT[,HOST:PORT...]/NAME
        url: String,
        /// The server's address as the cluster lists it (`rdram cluster status`).
        node: String,
    },
}

#[derive(Args)]
struct GatewayArgs {
    /// Where TensorStore connects: `{"driver": "tsgrpc_kvstore", "address": "<this>"}`.
    #[arg(long, default_value = "127.0.0.1:9100")]
    listen: std::net::SocketAddr,
    #[command(flatten)]
    conn: ConnArgs,
    /// Engine clients (each on its own thread): the requests in flight toward the servers.
    #[arg(long, default_value_t = 8)]
    engine_clients: usize,
    /// Threads for gRPC: HTTP/2 framing and the copies in and out of its frames, which
    /// take most of the gateway's CPU (default: the CPUs this process may run on).
    #[arg(long)]
    grpc_threads: Option<usize>,
    /// Adaptive polling of the engine clients: microseconds each spins on its request
    /// before sleeping, while no more requests are in flight than the gateway has CPUs
    /// (beyond that they sleep at once). Shorter than a server's 200: a gateway shares its
    /// cores with TensorStore, and its large values take hundreds of microseconds anyway.
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Largest value a Write may stream (it is buffered whole before it is stored; reads
    /// stream any size, 8 MiB at a time).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    max_value: u64,
    /// Bytes held for clients at once, across all connections: unfinished Write streams
    /// and Read replies not yet sent; beyond it calls get RESOURCE_EXHAUSTED.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    max_buffered: u64,
    /// Client connections held at once; beyond them the gateway accepts no more until one
    /// closes (TensorStore opens 4 per driver to a loopback gateway, max(4, its CPUs) to
    /// others). Each may also hold up to 32 MiB of received bytes no call has taken yet.
    #[arg(long, default_value_t = remote_dram::gateway::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// File whose first line is a token every gRPC call must carry as
    /// `authorization: Bearer <token>` metadata (or env RDRAM_GATEWAY_TOKEN).
    #[arg(long, env = "RDRAM_GATEWAY_TOKEN_FILE")]
    gateway_token_file: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9465; port 0 picks one).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1:7000")]
    listen: String,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Cores to pin workers to, e.g. 0,1 (default: not pinned; give disjoint cores to
    /// servers that share a host).
    #[arg(long, value_delimiter = ',')]
    cores: Vec<usize>,
    /// Total arena memory, split across workers (e.g. 1GiB, 512MiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    memory: u64,
    #[arg(long, value_enum, default_value = "auto")]
    hugepages: HugePages,
    #[arg(long, value_enum, default_value = "adaptive")]
    poll: PollMode,
    /// Adaptive polling: microseconds to spin before sleeping.
    #[arg(long, default_value_t = 200)]
    spin_us: u64,
    #[arg(long, value_enum, default_value = "store")]
    mode: Mode,
    /// File whose first line is the auth token clients must present.
    #[arg(long, env = "RDRAM_AUTH_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// Network stack: auto = UCX, unless libfabric offers the efa provider.
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// libfabric provider for --transport fabric: efa, "tcp;ofi_rxm", shm, ...
    #[arg(long, default_value = "efa")]
    provider: String,
    /// libfabric: endpoints per worker, one per NIC domain; large values are striped
    /// across them (wraps around when the host has fewer domains).
    #[arg(long, default_value_t = 1)]
    domains: usize,
    /// Clients connected at once; more are refused with "server at capacity".
    #[arg(long, default_value_t = remote_dram::server::tunables::DEFAULT_MAX_CLIENTS)]
    max_clients: usize,
    /// A transfer that has not finished after this many ms (plus 1 s per 64 MiB) is cut
    /// and what it held released: a client that starts a large put and stops progressing.
    #[arg(long, default_value_t = remote_dram::server::tunables::DEFAULT_STALL_TIMEOUT.as_millis() as u64)]
    stall_timeout_ms: u64,
    /// UCX: endpoints of departed shared-memory clients a worker may hold (UCX frees them
    /// only with the worker) before new clients get a fresh worker.
    #[arg(long, default_value_t = remote_dram::server::tunables::DEFAULT_STRANDED_ENDPOINT_LIMIT as u64, value_parser = clap::value_parser!(u64).range(1..))]
    stranded_endpoint_limit: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464; port 0 picks one).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// UCX: also run UCX's tcp transport (on the --listen interface only). Trusted networks
    /// only: UCX's tcp receiver carries out any peer's writes into this server's memory
    /// before the token check. Between untrusted hosts use --transport fabric.
    #[arg(long, env = remote_dram::server::UCX_TCP_ENV, value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    ucx_tcp: bool,
    /// Join a cluster whose membership lives in etcd (etcd://HOST:PORT[,...]/NAME, made
    /// with `rdram cluster create`): registered under a lease while it runs, gone from the
    /// member set at SIGTERM (or when the lease expires, if the process dies).
    #[arg(long, env = "RDRAM_CLUSTER")]
    cluster: Option<String>,
    /// Cluster: file holding the secret the cluster's servers share (at least 16 bytes; its
    /// clients never see it). It seals member records in etcd and the tickets without which
    /// no replica takes a copy; required with --cluster.
    #[arg(long, env = "RDRAM_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// How long the cluster's registration outlives this server's last word with etcd.
    #[arg(long, default_value_t = remote_dram::cluster::tunables::DEFAULT_LEASE_TTL.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1000..))]
    lease_ttl_ms: u64,
    /// Cluster: on SIGTERM, hand every key over to the other servers before exiting (a
    /// second signal exits at once). Without it, a stopping server's keys go with it
    /// (unless the cluster keeps replicas).
    #[arg(long)]
    drain: bool,
    /// Cluster: bytes per second this server hands keys over at most while they move to
    /// another server (when servers join or leave).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    rebalance_rate: u64,
    /// Reply bytes the server holds, over all shards, for clients that do not take their
    /// replies; past it such clients' requests wait until they catch up.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    reply_budget: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    Auto,
    Ucx,
    Fabric,
}

#[derive(Args)]
struct ConnArgs {
    /// Server address(es), comma-separated.
    #[arg(long, env = "RDRAM_SERVER", default_value = "127.0.0.1:7000")]
    server: String,
    /// Auth token (or env RDRAM_AUTH_TOKEN).
    #[arg(long, env = "RDRAM_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// Operation timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
}

impl ConnArgs {
    fn options(&self) -> ClientOptions {
        ClientOptions {
            auth_token: self.auth_token.clone(),
            timeout: Duration::from_millis(self.timeout_ms),
            ..Default::default()
        }
    }

    fn connect(&self) -> Result<Client, Error> {
        Client::connect(&self.server, self.options())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = match &cli.log_level {
        Some(level) => tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string()),
        None => tracing_subscriber::EnvFilter::try_from_default_env().map_err(|e| e.to_string()),
    };
    let filter = filter.unwrap_or_else(|e| {
        if cli.log_level.is_some() {
            eprintln!("rdram: --log-level: {e}; logging at info");
        }
        "info".into()
    });
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rdram: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cmd: Command) -> Result<ExitCode, Error> {
    match cmd {
        Command::Serve(args) => serve(args),
        Command::Gateway(args) => gateway(args),
        Command::Cluster(ClusterCommand::Create { url, replicas }) => {
            let parsed = cluster_url(&url)?;
            remote_dram::cluster::create(&parsed, &remote_dram::cluster::Settings { replicas })?;
            println!("created cluster {parsed} with {replicas} replica(s) per key");
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(ClusterCommand::Drain { url, node }) => {
            let parsed = cluster_url(&url)?;
            remote_dram::cluster::request_drain(&parsed, &node)?;
            println!("asked {node} to hand its keys over and leave; follow it with `rdram cluster status {parsed}`");
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(ClusterCommand::Status { url }) => {
            let status = remote_dram::cluster::status(&cluster_url(&url)?)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&status).map_err(|e| Error::new(Status::Internal, e.to_string()))?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Put { conn, key, value, file, if_equal, if_absent, ttl_ms } => {
            if ttl_ms == Some(0) {
                return Err(Error::new(
                    Status::Invalid,
                    "--ttl-ms 0 is not a ttl: leave it out for a value that never expires",
                ));
            }
            let data = match (value, file) {
                (Some(v), _) => v.into_bytes(),
                (None, Some(path)) => {
                    let f = std::fs::File::open(&path)
                        .map_err(|e| Error::new(Status::Io, format!("{}: {e}", path.display())))?;
                    read_value(f, &path.display().to_string())?
                }
                (None, None) => read_value(std::io::stdin().lock(), "stdin")?,
            };
            let condition = match (if_equal, if_absent) {
                (Some(g), _) => WriteCondition::IfEqual(g),
                (None, true) => WriteCondition::IfAbsent,
                _ => WriteCondition::None,
            };
            let opts = PutOptions { condition, ttl: ttl_ms.map(Duration::from_millis) };
            match conn.connect()?.put_with(key.as_bytes(), &data, &opts)? {
                WriteResult::Written { generation } => {
                    println!("{generation}");
                    Ok(ExitCode::SUCCESS)
                }
                WriteResult::ConditionFailed => {
                    eprintln!("rdram: condition failed: {key:?} not written");
                    Ok(ExitCode::from(EXIT_CONDITION))
                }
            }
        }
        Command::Get { conn, key, out, range_start, range_end, show_generation } => {
            let range = (range_start.is_some() || range_end.is_some()).then(|| remote_dram::client::ByteRange {
                start: range_start.unwrap_or(0),
                end: range_end.unwrap_or(-1),
            });
            match conn.connect()?.get_with(key.as_bytes(), &GetOptions { range, ..Default::default() })? {
                GetResult::Value(v) => {
                    if show_generation {
                        eprintln!("generation {}", v.generation);
                    }
                    match out {
                        Some(path) => std::fs::write(&path, &v.data)
                            .map_err(|e| Error::new(Status::Io, format!("{}: {e}", path.display())))?,
                        None => {
                            let mut stdout = std::io::stdout().lock();
                            stdout.write_all(&v.data)?;
                            stdout.flush()?;
                        }
                    }
                    Ok(ExitCode::SUCCESS)
                }
                GetResult::Missing => {
                    eprintln!("rdram: key {key:?} not found");
                    Ok(ExitCode::from(EXIT_MISSING))
                }
                GetResult::Unchanged { .. } => unreachable!("no condition was sent"),
            }
        }
        Command::Del { conn, key, if_equal } => {
            let condition = if_equal.map_or(WriteCondition::None, WriteCondition::IfEqual);
            match conn.connect()?.delete_with(key.as_bytes(), condition)? {
                remote_dram::client::DeleteResult::Deleted { existed: true } => Ok(ExitCode::SUCCESS),
                remote_dram::client::DeleteResult::Deleted { existed: false } => {
                    eprintln!("rdram: key {key:?} not found");
                    Ok(ExitCode::from(EXIT_MISSING))
                }
                remote_dram::client::DeleteResult::ConditionFailed => {
                    eprintln!("rdram: condition failed: {key:?} not deleted");
                    Ok(ExitCode::from(EXIT_CONDITION))
                }
            }
        }
        Command::Ls { conn, prefix } => {
            let entries = conn.connect()?.list(&KeyRange::prefix(prefix.as_bytes()))?;
            let mut stdout = std::io::stdout().lock();
            for e in entries {
                writeln!(stdout, "{}\t{}", e.size, String::from_utf8_lossy(&e.key))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Stats { conn } => {
            let stats = conn.connect()?.stats()?;
            println!("{}", serde_json::to_string_pretty(&stats).unwrap());
            Ok(ExitCode::SUCCESS)
        }
        Command::Top { conn, interval_ms, iterations } => {
            top::run(conn.connect()?, Duration::from_millis(interval_ms.max(100)), iterations)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The token clients must present: the first line of `--auth-token-file`, else
/// `RDRAM_AUTH_TOKEN`, else none (an open server). An empty token is an error, never "none".
fn server_token(file: Option<&std::path::Path>) -> Result<Option<String>, Error> {
    let Some(path) = file else {
        return match std::env::var("RDRAM_AUTH_TOKEN") {
            Ok(t) if t.is_empty() => Err(Error::new(
                Status::Invalid,
                "RDRAM_AUTH_TOKEN is set but empty: set a token, or unset it for an open server",
            )),
            Ok(t) => Ok(Some(t)),
            Err(_) => Ok(None),
        };
    };
    Ok(Some(read_token_file(path)?))
}

/// A token file's first line; an empty one is an error, a loose mode a warning.
fn read_token_file(path: &std::path::Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::new(Status::Io, format!("{}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        return Err(Error::new(Status::Invalid, format!("{} holds no token", path.display())));
    }
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            eprintln!(
                "rdram: warning: token file {} is readable by group or others (mode {:o}); chmod 600 it",
                path.display(),
                meta.permissions().mode() & 0o777
            );
        }
    }
    Ok(token)
}

fn cluster_url(url: &str) -> Result<remote_dram::cluster::ClusterUrl, Error> {
    remote_dram::cluster::ClusterUrl::parse(url)?
        .ok_or_else(|| Error::new(Status::Invalid, format!("{url:?} is not etcd://HOST:PORT[,HOST:PORT...]/NAME")))
}

/// Reads a value, stopping one byte past the largest value a server takes (so an endless
/// source such as /dev/zero fails at once instead of filling memory).
fn read_value(source: impl Read, name: &str) -> Result<Vec<u8>, Error> {
    let limit = remote_dram::proto::MAX_VALUE_LEN;
    let mut buf = Vec::new();
    source.take(limit + 1).read_to_end(&mut buf).map_err(|e| Error::new(Status::Io, format!("{name}: {e}")))?;
    if buf.len() as u64 > limit {
        return Err(Error::new(
            Status::ValueTooLarge,
            format!("{name} is larger than the largest value ({} GiB)", limit >> 30),
        ));
    }
    Ok(buf)
}

fn serve(args: ServeArgs) -> Result<ExitCode, Error> {
    let stop_signals = block_stop_signals();
    let cluster =
        args.cluster.as_deref().map(remote_dram::cluster::ClusterUrl::parse).transpose()?.map(|u| {
            u.ok_or_else(|| Error::new(Status::Invalid, "--cluster takes etcd://HOST:PORT[,HOST:PORT...]/NAME"))
        });
    let cluster = cluster.transpose()?;
    let lease_ttl = Duration::from_millis(args.lease_ttl_ms);
    let auth_token = server_token(args.auth_token_file.as_deref())?;
    let cluster_secret =
        match (&cluster, &args.cluster_secret_file) {
            (Some(_), None) => return Err(Error::new(
                Status::Invalid,
                "--cluster needs --cluster-secret-file: the secret the cluster's servers share and clients never see",
            )),
            (Some(_), Some(path)) => Some(remote_dram::auth::ClusterSecret::from_file(&path.to_string_lossy())?),
            (None, _) => None,
        };
    let cfg = ServerConfig {
        listen: args.listen,
        workers: args.workers,
        cores: args.cores,
        memory: args.memory,
        hugepages: args.hugepages,
        poll: args.poll,
        spin: Duration::from_micros(args.spin_us),
        mode: args.mode,
        auth_token,
        transport: match args.transport {
            TransportArg::Auto => TransportChoice::Auto,
            TransportArg::Ucx => TransportChoice::Ucx,
            TransportArg::Fabric => TransportChoice::Fabric { provider: args.provider, rails: args.domains },
        },
        max_clients: args.max_clients,
        stall_timeout: Duration::from_millis(args.stall_timeout_ms),
        stranded_endpoint_limit: args.stranded_endpoint_limit as usize,
        metrics: args.metrics,
        ucx_tcp: args.ucx_tcp,
        reply_budget: args.reply_budget,
        cluster_role: None,
        cluster_secret: None,
    };
    raise_fd_limit();
    let auth = if cfg.auth_token.is_some() { "token required" } else { "none (open server)" };
    let (server, membership) = match &cluster {
        Some(url) => {
            let member = remote_dram::cluster::member::MemberConfig {
                url: url.clone(),
                lease_ttl,
                secret: cluster_secret.clone().expect("checked above: a cluster member has its secret"),
                auth_token: None,
                rebalance_rate: args.rebalance_rate,
            };
            let (server, member) = remote_dram::cluster::member::ClusterMember::start_server(cfg, member)?;
            (server, Some(member))
        }
        None => (Server::start(cfg)?, None),
    };
    println!("{}", server.info().banner());
    println!("auth: {auth}");
    if let Some(url) = &cluster {
        println!("cluster: {url}");
    }
    std::io::stdout().flush()?;
    // Until a stop signal, or in a cluster, a drain request for this server.
    let mut drain = args.drain;
    let sig = loop {
        if let Some(sig) = wait_for_signal(&stop_signals, Duration::from_millis(200)) {
            break sig;
        }
        if membership.as_ref().is_some_and(|m| m.drain_asked()) {
            eprintln!("rdram: asked to drain");
            drain = true;
            break 0;
        }
    };
    if sig != 0 {
        eprintln!("rdram: signal {sig}, shutting down");
    }
    if let Some(member) = membership {
        if drain {
            hand_keys_over(&member, &stop_signals);
        }
        // Out of the member set first, so that clients stop routing here, then stop.
        member.leave();
    }
    server.stop();
    eprintln!("rdram: stopped");
    Ok(ExitCode::SUCCESS)
}

/// A graceful leave (see [`ClusterMember::drain`]); a second signal stops waiting.
fn hand_keys_over(member: &remote_dram::cluster::member::ClusterMember, signals: &libc::sigset_t) {
    eprintln!("rdram: draining: handing every key over before leaving (a second signal stops at once)");
    use remote_dram::cluster::member::Drained;
    match member.drain(|| wait_for_signal(signals, Duration::ZERO).is_some()) {
        Ok(Drained::HandedOver(took)) => {
            eprintln!("rdram: drained in {:.1} s: every key is on the other servers", took.as_secs_f64())
        }
        Ok(Drained::NoOneToTakeThem) => eprintln!("rdram: no other server to hand keys over to; leaving with them"),
        Ok(Drained::GivenUp) => eprintln!("rdram: second signal: leaving without waiting for the handover"),
        Err(e) => eprintln!("rdram: cannot drain ({}); leaving without handing keys over", e.message),
    }
}

/// The gateway receives each value into a fresh buffer of its size (tonic hands every
/// decoded message over whole), and glibc gives buffers of MiBs back to the kernel when
/// they are freed, so the next one is zero-filled page by page again: about a quarter of
/// the gRPC threads' time went to page faults. Freed buffers stay in the heap instead (up
/// to 32 MiB each; the heap is never trimmed, so the gateway keeps its high-water mark,
/// which --max-buffered and the HTTP/2 windows bound).
///
/// In one arena: glibc's per-thread arenas are heaps of at most 64 MiB, each unmapped once
/// its last buffer is freed, whatever the trim threshold, and with them the buffers that
/// join a value's parts were fresh pages again: they took three quarters of the gateway's
/// page faults in writes, and a run of bench/tensorstore_throughput.py faulted 142-158 K
/// times instead of 98 K. Small allocations still come from each thread's cache, without
/// the arena's lock.
fn keep_freed_buffers() {
    // SAFETY: mallopt only sets malloc's parameters; it is called before any other thread
    // of this process starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn gateway(args: GatewayArgs) -> Result<ExitCode, Error> {
    keep_freed_buffers();
    let stop_signals = block_stop_signals();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut sig: libc::c_int = 0;
        // SAFETY: waits on the set blocked above; writes the signal number into `sig`.
        while unsafe { libc::sigwait(&stop_signals, &mut sig) } != 0 {}
        eprintln!("rdram: signal {sig}, shutting down");
        let _ = stop_tx.send(());
    });
    let config = remote_dram::gateway::GatewayConfig {
        listen: args.listen,
        servers: args.conn.server.clone(),
        client: ClientOptions { spin: Duration::from_micros(args.spin_us), ..args.conn.options() },
        engine_clients: args.engine_clients,
        grpc_threads: args.grpc_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())),
        max_value: usize::try_from(args.max_value.min(remote_dram::proto::MAX_VALUE_LEN)).unwrap_or(usize::MAX),
        max_buffered: usize::try_from(args.max_buffered).unwrap_or(usize::MAX),
        max_connections: args.max_connections,
        token: match args.gateway_token_file.as_deref() {
            Some(path) => Some(read_token_file(path)?),
            None => std::env::var("RDRAM_GATEWAY_TOKEN").ok(),
        },
        metrics: args.metrics,
    };
    remote_dram::gateway::run(
        config,
        |addr, metrics| {
            let metrics = metrics.map_or_else(String::new, |m| format!("metrics on http://{m}/metrics\n"));
            println!("gateway for {} (tsgrpc_kvstore)\n{metrics}listening on {addr}", args.conn.server);
            let _ = std::io::stdout().flush();
        },
        stop_rx,
    )?;
    Ok(ExitCode::SUCCESS)
}
