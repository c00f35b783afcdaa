//! The bench runs briefly against a real server process and its outputs parse: JSON
//! lines, .hgrm percentile files and the SVG plot. No timing is asserted.
mod common;

use std::path::Path;
use std::process::Command;

use common::{ServerProc, TCP};

fn rdram_bench() -> Command {
    Command::new(common::bench_binary("rdram-bench"))
}

fn bench(server: &ServerProc, out: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let result = rdram_bench()
        .args(["--server", &server.addr, "--poll", "adaptive", "--json", "--out"])
        .arg(out)
        .args(args)
        .output()
        .expect("run rdram-bench");
    assert!(result.status.success(), "rdram-bench failed: {}", String::from_utf8_lossy(&result.stderr));
    String::from_utf8(result.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Checks one .hgrm file and returns its total count.
fn parse_hgrm(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    assert!(lines.next().unwrap().split_whitespace().eq(["Value", "Percentile", "TotalCount", "1/(1-Percentile)"]));
    let (mut last_q, mut last_value, mut last_count) = (0.0f64, 0.0f64, 0u64);
    let mut footer_total = None;
    for line in lines.filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("#[Max") {
            footer_total = rest.split('=').nth(2).map(|n| n.trim().trim_end_matches(']').parse::<u64>().unwrap());
            continue;
        }
        if line.starts_with("#[") {
            continue;
        }
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert!(cols.len() == 4 || cols.len() == 3, "{line}");
        let (value, q, count): (f64, f64, u64) =
            (cols[0].parse().unwrap(), cols[1].parse().unwrap(), cols[2].parse().unwrap());
        assert!(q >= last_q && value >= last_value && count >= last_count, "not monotonic at {line}");
        (last_q, last_value, last_count) = (q, value, count);
    }
    assert_eq!(last_q, 1.0, "{} does not reach the 100th percentile", path.display());
    assert_eq!(footer_total, Some(last_count));
    last_count
}

#[test]
fn closed_loop_mix_with_zipf_keys() {
    common::init(TCP);
    let server = ServerProc::start(&[]);
    let dir = tempdir("closed");
    let out = dir.path();
    let rows = bench(
        &server,
        out,
        &[
            "--ops",
            "get,put,mix",
            "--sizes",
            "8,4KiB",
            "--depth",
            "4",
            "--distribution",
            "zipf",
            "--seconds",
            "0.3",
            "--warmup",
            "0.05",
        ],
    );
    let names: Vec<String> = rows.iter().map(|r| format!("{}-{}", r["op"].as_str().unwrap(), r["size"])).collect();
    assert_eq!(
        names,
        ["get-8", "get-4096", "put-8", "put-4096", "mix:get-8", "mix:put-8", "mix:get-4096", "mix:put-4096"]
    );
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {r}"));
        assert!(f("ops_per_s") > 0.0, "{r}");
        assert!((f("mb_per_s") - f("ops_per_s") * f("size") / 1e6).abs() < 1e-6 * f("mb_per_s").max(1.0), "{r}");
        assert!(f("p50_us") > 0.0 && f("p50_us") <= f("p90_us") && f("p90_us") <= f("p99_us"), "{r}");
        assert!(f("p99_us") <= f("p999_us") && f("p999_us") <= f("max_us"), "{r}");
        let stem = format!("{}-{}", r["op"].as_str().unwrap().replace(':', "-"), r["size"]);
        assert!(parse_hgrm(&out.join(format!("{stem}.hgrm"))) > 0);
    }
    let svg = std::fs::read_to_string(out.join("latency.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for name in ["get 8 B", "put 4096 B", "mix:put 4096 B"] {
        assert!(svg.contains(name), "legend lacks {name}");
    }
    assert!(svg.matches("<polyline").count() >= rows.len(), "one line per run");
}

#[test]
fn open_loop_counts_every_scheduled_request() {
    common::init(TCP);
    let server = ServerProc::start(&[]);
    let dir = tempdir("open");
    let out = dir.path();
    let rows =
        bench(&server, out, &["--ops", "get", "--sizes", "64", "--rate", "2000", "--count", "300", "--warmup", "0"]);
    assert_eq!(rows.len(), 1);
    assert_eq!(parse_hgrm(&out.join("get-64.hgrm")), 300);
    // 300 requests at 2000/s take at least 150 ms however fast each one is.
    assert!(rows[0]["ops_per_s"].as_f64().unwrap() <= 2000.0 * 1.05, "{}", rows[0]);
}

#[test]
fn requests_rotate_through_the_buffers_asked_for() {
    common::init(TCP);
    let server = ServerProc::start(&[]);
    let dir = tempdir("buffers");
    let out = dir.path();
    // 3 buffers at depth 2 round up to 4: each batch takes the next two.
    let rows = bench(
        &server,
        out,
        &["--ops", "get,put", "--sizes", "4KiB", "--depth", "2", "--buffers", "3", "--count", "40", "--warmup", "0"],
    );
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let svg = std::fs::read_to_string(out.join("latency.svg")).unwrap();
    assert!(svg.contains("4 buffer(s)"), "the title names the buffers used");
}

#[test]
fn keys_are_as_long_as_asked() {
    common::init(TCP);
    let server = ServerProc::start(&[]);
    let dir = tempdir("key-len");
    let limit = remote_dram::proto::MAX_KEY_LEN;
    // The longest key the protocol takes works; one byte more is refused by the client
    // library, which shows the keys really are that long.
    let rows = bench(
        &server,
        dir.path(),
        &["--ops", "get,put", "--sizes", "64", "--key-len", &limit.to_string(), "--count", "20", "--warmup", "0"],
    );
    assert_eq!(rows.len(), 2);
    let out = rdram_bench()
        .args([
            "--server",
            &server.addr,
            "--poll",
            "adaptive",
            "--ops",
            "get",
            "--sizes",
            "64",
            "--count",
            "5",
            "--key-len",
        ])
        .arg((limit + 1).to_string())
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("prefill") && stderr.contains("key"), "{stderr}");
}

#[test]
fn bad_arguments_are_refused_clearly() {
    let out = rdram_bench().args(["--embedded", "--depth", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--depth must be at least 1"));
    let out = rdram_bench().args(["--embedded", "--rate", "100", "--depth", "4"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--depth 1"));
    let out = rdram_bench().args(["--server", "127.0.0.1:1", "--ops", "scan"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("scan"));
}

/// A scratch folder for the bench's files, removed when dropped.
fn tempdir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("rdram-bench-smoke-{name}-")).tempdir().unwrap()
}
