//! Observability with the real tools: Debian's Prometheus scrapes an `rdram serve` and an
//! `rdram gateway` (both with `--metrics`) and is queried through its HTTP API after known
//! traffic; `promtool check metrics` accepts both endpoints' output.
mod common;

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ServerProc, TCP};
use remote_dram::gateway::pb::{self, kv_store_service_client::KvStoreServiceClient};

fn http_get(url: &str) -> String {
    ureq::get(url)
        .timeout(Duration::from_secs(5))
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .into_string()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Prometheus {
    child: Child,
    url: String,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!("rdram-{tag}-{}-{}", std::process::id(), rand::random::<u32>()));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Prometheus {
    /// Starts Prometheus on loopback, scraping `targets` (job name, host:port) every second.
    fn start(targets: &[(&str, &str)]) -> Option<Prometheus> {
        if Command::new("prometheus").arg("--version").output().is_err() {
            common::missing_prerequisite(
                "prometheus scrapes",
                "no `prometheus` binary (Debian package prometheus; make deps installs it)",
            );
            return None;
        }
        let dir = tempdir::Dir::new("prometheus");
        let mut config = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n");
        for (job, target) in targets {
            config += &format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n");
        }
        let path = dir.0.join("prometheus.yml");
        std::fs::write(&path, config).unwrap();
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.0.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while ureq::get(&format!("{}/-/ready", p.url)).call().is_err() {
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(p)
    }

    /// The value of an instant query returning one sample (None: no sample).
    fn query(&self, promql: &str) -> Option<f64> {
        let body = ureq::get(&format!("{}/api/v1/query", self.url))
            .query("query", promql)
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{promql}: {body}");
        let result = v["data"]["result"].as_array().unwrap();
        result.first().map(|r| r["value"][1].as_str().unwrap().parse().unwrap())
    }

    /// Waits until `promql` evaluates to `want` (scrapes arrive every second), then
    /// returns what it evaluates to: counters only grow, so anything else is a miscount.
    fn settle(&self, promql: &str, want: f64) -> Option<f64> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.query(promql);
            if got == Some(want) || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn promtool_accepts(url: &str) {
    let text = http_get(url);
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics rejected {url}: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_counts_exactly_the_traffic_it_was_shown() {
    common::init(TCP);
    let server = ServerProc::start(&["--metrics", "127.0.0.1:0"]);
    let gateway = ServerProc::gateway(&server.addr, &["--metrics", "127.0.0.1:0"]);
    let (server_metrics, gateway_metrics) = (
        server.metrics.clone().expect("server metrics address"),
        gateway.metrics.clone().expect("gateway metrics address"),
    );
    let Some(prom) = Prometheus::start(&[("rdram", &server_metrics), ("gateway", &gateway_metrics)]) else { return };

    // Known traffic straight to the server: 40 puts of 1000 B, 25 hits, 7 misses, 5 deletes.
    let mut c = server.client();
    for i in 0..40 {
        c.put(format!("m/{i}").as_bytes(), &[7u8; 1000]).unwrap();
    }
    for i in 0..25 {
        assert!(c.get(format!("m/{i}").as_bytes()).unwrap().is_some());
    }
    for i in 0..7 {
        assert!(c.get(format!("none/{i}").as_bytes()).unwrap().is_none());
    }
    for i in 0..5 {
        assert!(c.delete(format!("m/{i}").as_bytes()).unwrap());
    }
    drop(c);
    // And through the gateway: 3 writes, 4 reads (one of a missing key).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut g = KvStoreServiceClient::connect(format!("http://{}", gateway.addr)).await.unwrap();
        for i in 0..3 {
            let part = pb::WriteRequest {
                key: format!("g/{i}").into_bytes().into(),
                value_part: vec![1u8; 300].into(),
                ..Default::default()
            };
            g.write(tokio_stream::iter([part])).await.unwrap();
        }
        for key in ["g/0", "g/1", "g/2", "g/none"] {
            let mut s = g
                .read(pb::ReadRequest { key: key.as_bytes().to_vec().into(), ..Default::default() })
                .await
                .unwrap()
                .into_inner();
            while s.message().await.unwrap().is_some() {}
        }
    });

    let q = |metric: &str, want: f64| assert_eq!(prom.settle(metric, want), Some(want), "{metric}");
    q(r#"sum(rdram_requests_total{job="rdram",op="put",status="ok"})"#, 43.0);
    q(r#"sum(rdram_requests_total{job="rdram",op="get",status="ok"})"#, 28.0);
    q(r#"sum(rdram_requests_total{job="rdram",op="get",status="missing"})"#, 8.0);
    q(r#"sum(rdram_requests_total{job="rdram",op="delete",status="ok"})"#, 5.0);
    q(r#"sum(rdram_received_bytes_total{job="rdram"})"#, 40.0 * 1000.0 + 3.0 * 300.0);
    q(r#"sum(rdram_sent_bytes_total{job="rdram"})"#, 25.0 * 1000.0 + 3.0 * 300.0);
    q(r#"sum(rdram_request_duration_seconds_count{job="rdram",op="put"})"#, 43.0);
    q(r#"sum(rdram_keys{job="rdram"})"#, 38.0); // published on each worker's sweep
    q(r#"rdram_gateway_rpcs_total{job="gateway",method="Write",code="OK"}"#, 3.0);
    q(r#"rdram_gateway_rpcs_total{job="gateway",method="Read",code="OK"}"#, 4.0);
    q(r#"rdram_gateway_received_bytes_total{job="gateway"}"#, 900.0);
    q(r#"rdram_gateway_sent_bytes_total{job="gateway"}"#, 900.0);
    // The direct client and the gateway's engine clients were welcomed, none refused.
    assert!(prom.query(r#"rdram_handshakes_total{job="rdram",outcome="accepted"}"#).unwrap() >= 2.0);
    assert_eq!(prom.query(r#"sum(rdram_handshakes_total{job="rdram",outcome="refused"})"#), Some(0.0));
    assert!(prom.query(r#"process_resident_memory_bytes{job="rdram"}"#).unwrap() > 1e6);
    assert_eq!(prom.query(r#"sum(up)"#), Some(2.0), "both targets are up");

    promtool_accepts(&format!("http://{server_metrics}/metrics"));
    promtool_accepts(&format!("http://{gateway_metrics}/metrics"));
    assert!(http_get(&format!("http://{server_metrics}/metrics"))
        .contains("rdram_arena_capacity_bytes{shard=\"1\"} 33554432"));
}

#[test]
fn refused_handshakes_are_counted_by_reason() {
    common::init(TCP);
    let server = ServerProc::start_with_env(&["--metrics", "127.0.0.1:0"], &[("RDRAM_AUTH_TOKEN", "s3cret")]);
    let url = format!("http://{}/metrics", server.metrics.as_deref().unwrap());
    for token in [None, Some("wrong")] {
        let opts = remote_dram::ClientOptions { auth_token: token.map(str::to_string), ..Default::default() };
        assert_eq!(
            remote_dram::Client::connect(&server.addr, opts).err().map(|e| e.status),
            Some(remote_dram::Status::AuthFailed)
        );
    }
    // The client without a token is refused; the one with a wrong token gives up itself on
    // the server's proof, before proving anything: the server sees its handshake end.
    let counted = |text: &str| {
        text.contains("rdram_handshakes_total{outcome=\"refused\",reason=\"auth\"} 1")
            && text.contains("rdram_handshakes_total{outcome=\"failed\",reason=\"\"} 1")
    };
    assert!(common::wait_until(std::time::Duration::from_secs(5), || counted(&http_get(&url))), "{}", http_get(&url));
}

/// `rdram top` in a real terminal (a tmux pane), over a two-server cluster: the table
/// shows every shard with its keys and capacity as the servers report them, and rates
/// that follow the traffic.
#[test]
fn top_draws_the_cluster_in_a_terminal() {
    common::init(TCP);
    if Command::new("tmux").arg("-V").output().is_err() {
        common::missing_prerequisite(
            "top_draws_the_cluster_in_a_terminal",
            "no tmux (Debian package tmux; make deps installs it)",
        );
        return;
    }
    let (a, b) = (ServerProc::start(&[]), ServerProc::start(&[]));
    let cluster = format!("{},{}", a.addr, b.addr);
    let mut c = common::connect(&cluster);
    for i in 0..30 {
        c.put(format!("top/{i}").as_bytes(), &[1u8; 65536]).unwrap();
    }
    let stats = c.stats().unwrap();
    let socket = format!("rdram-test-{}", std::process::id());
    let tmux = |args: &[&str]| Command::new("tmux").args(["-L", &socket]).args(args).output().expect("tmux");
    let top = format!("{} top --server {cluster} --interval-ms 300", common::RDRAM);
    assert!(tmux(&["new-session", "-d", "-x", "200", "-y", "30", "-s", "top", &top]).status.success());
    struct KillServer<'a>(&'a dyn Fn(&[&str]) -> std::process::Output);
    impl Drop for KillServer<'_> {
        fn drop(&mut self) {
            (self.0)(&["kill-server"]);
        }
    }
    let _cleanup = KillServer(&tmux);
    // Rows: server shard ops/s MB/s used / capacity (pct) keys clients errors/s.
    let rows = |screen: &str| -> Vec<Vec<String>> {
        screen
            .lines()
            .filter(|l| l.starts_with("127.0.0.1:"))
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect()
    };
    let screen_with = |pred: &dyn Fn(&[Vec<String>]) -> bool| -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let screen = String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned();
            if pred(&rows(&screen)) || Instant::now() > deadline {
                return screen;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let ops = |r: &[Vec<String>]| r.iter().map(|row| row[2].parse::<f64>().unwrap_or(0.0)).sum::<f64>();

    // Traffic while top watches: gets from another thread for 3 s.
    let busy = std::thread::spawn({
        let cluster = cluster.clone();
        move || {
            let mut c = common::connect(&cluster);
            let end = Instant::now() + Duration::from_secs(3);
            while Instant::now() < end {
                c.get(b"top/1").unwrap();
            }
        }
    });
    let screen = screen_with(&|r| r.len() == 4 && ops(r) > 100.0);
    let table = rows(&screen);
    assert_eq!(table.len(), 4, "one row per shard of both servers:\n{screen}");
    assert!(ops(&table) > 100.0, "ops/s follow the traffic:\n{screen}");
    assert!(screen.contains("total"), "{screen}");
    for server in stats["servers"].as_array().unwrap() {
        for shard in server["shards"].as_array().unwrap() {
            let (node, index) = (server["node"].as_str().unwrap(), shard["shard"].as_u64().unwrap().to_string());
            let row = table
                .iter()
                .find(|r| r[0] == node && r[1] == index)
                .unwrap_or_else(|| panic!("no row for {node} shard {index}:\n{screen}"));
            assert_eq!(row[8], shard["keys"].as_u64().unwrap().to_string(), "keys of {node} shard {index}:\n{screen}");
            assert_eq!(row[6], "32", "capacity MiB:\n{screen}");
        }
    }
    let total_keys: u64 = table.iter().map(|r| r[8].parse::<u64>().unwrap()).sum();
    assert_eq!(total_keys, 30, "{screen}");
    busy.join().unwrap();
    // Once the traffic stops, only top's own stats requests remain (a few per second).
    let screen = screen_with(&|r| r.len() == 4 && ops(r) < 50.0);
    assert!(ops(&rows(&screen)) < 50.0, "rates fall when the traffic stops:\n{screen}");
}

/// Peers that connect to the metrics endpoint and send nothing hold at most 16 slots, and
/// only until the 5 s header deadline; the server keeps serving requests meanwhile.
#[test]
fn the_metrics_endpoint_bounds_idle_connections() {
    use std::io::Read;
    common::init(TCP);
    let server = ServerProc::start(&["--metrics", "127.0.0.1:0"]);
    let metrics = server.metrics.clone().unwrap();
    let idle: Vec<std::net::TcpStream> = (0..16).map(|_| std::net::TcpStream::connect(&metrics).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    // A scrape gets through at once: past the bounds (4 per address, 16 in all) a new
    // connection closes the oldest, not itself.
    assert!(http_get(&format!("http://{metrics}/metrics")).contains("rdram_requests_total"));
    let mut c = server.client();
    c.put(b"still", b"serving").unwrap();
    // The idle ones are closed, by newer connections or at their header deadline.
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let start = Instant::now();
        assert_eq!(s.read(&mut [0u8; 16]).unwrap_or(usize::MAX), 0, "an idle connection is closed");
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    assert!(http_get(&format!("http://{metrics}/metrics")).contains("rdram_requests_total"));
}
