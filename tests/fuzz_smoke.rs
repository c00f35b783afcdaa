//! A short run of every fuzz target (src/fuzz.rs) on stable Rust: the committed corpus
//! (fuzz/corpus/TARGET/), then seeded random mutations of it. `make fuzz` runs the same
//! targets under libFuzzer for millions of inputs. `cargo test --test fuzz_smoke --
//! --ignored write_seed_corpus` rewrites the seeds from the encoders.

use std::path::PathBuf;

use rand::{rngs::SmallRng, Rng, SeedableRng};
use remote_dram::fuzz;

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 6] = [
    ("request_header", fuzz::request_header),
    ("bootstrap_line", fuzz::bootstrap_line),
    ("fabric_hello", fuzz::fabric_hello),
    ("gateway_request", fuzz::gateway_request),
    ("shard_request", fuzz::shard_request),
    ("ucx_request", fuzz::ucx_request),
];

/// Random inputs per target in the smoke run.
const MUTATIONS: usize = 20_000;

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir(target))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// One mutation of a seed, as libFuzzer's simplest mutators do.
fn mutate(rng: &mut SmallRng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        match rng.gen_range(0..6) {
            0 if !v.is_empty() => {
                let i = rng.gen_range(0..v.len());
                v[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if !v.is_empty() => {
                let i = rng.gen_range(0..v.len());
                v[i] = [0, 1, 0x7f, 0x80, 0xff][rng.gen_range(0..5)];
            }
            2 => v.truncate(rng.gen_range(0..=v.len())),
            3 => {
                let at = rng.gen_range(0..=v.len());
                let n = rng.gen_range(1..64);
                v.splice(at..at, (0..n).map(|_| rng.gen::<u8>()));
            }
            4 if v.len() >= 8 => {
                // An interesting integer over 8 bytes: lengths and offsets live there.
                let i = rng.gen_range(0..=v.len() - 8);
                let x: u64 = [0, 1, u32::MAX as u64, u64::MAX, 1 << 31, 1 << 63, 65_537][rng.gen_range(0..7)];
                v[i..i + 8].copy_from_slice(&x.to_le_bytes());
            }
            _ => v = (0..rng.gen_range(0..200)).map(|_| rng.gen()).collect(),
        }
    }
    v
}

#[test]
fn every_target_survives_its_corpus_and_random_mutations() {
    for (name, target) in TARGETS {
        let seeds = corpus(name);
        assert!(!seeds.is_empty(), "{name}: no committed corpus in {}", corpus_dir(name).display());
        for s in &seeds {
            target(s);
        }
        let mut rng = SmallRng::seed_from_u64(0x5eed ^ name.len() as u64);
        for _ in 0..MUTATIONS {
            let seed = &seeds[rng.gen_range(0..seeds.len())];
            target(&mutate(&mut rng, seed));
        }
        eprintln!("{name}: {} seeds + {MUTATIONS} mutations", seeds.len());
    }
}

/// Writes the seed corpora from the real encoders (run by hand when formats change).
#[test]
#[ignore = "rewrites fuzz/corpus: run by hand when a wire format changes"]
fn write_seed_corpus() {
    use remote_dram::proto::bootstrap::{Hello, Welcome};
    use remote_dram::proto::fabric::{self, RemoteValue};
    use remote_dram::proto::{flags, Op, ReplyHeader, RequestHeader, MAX_REQUEST_HEADER_LEN};
    use remote_dram::Status;
    let write = |target: &str, name: &str, bytes: &[u8]| {
        std::fs::create_dir_all(corpus_dir(target)).unwrap();
        std::fs::write(corpus_dir(target).join(name), bytes).unwrap();
    };
    let header = |op: Op, key: &[u8], tweak: &dyn Fn(&mut RequestHeader)| {
        let mut h = RequestHeader::new(op, 7, 0x5e55_1011);
        h.key_len = key.len() as u32;
        tweak(&mut h);
        let mut buf = [0u8; MAX_REQUEST_HEADER_LEN];
        let len = h.encode_with_view(false, &mut buf);
        [&buf[..len], key].concat()
    };
    // What UCX clients send: the 32-byte short form.
    let short = |op: Op, key: &[u8]| {
        let mut h = RequestHeader::new(op, 8, 0x5e55_1011);
        h.key_len = key.len() as u32;
        let mut buf = [0u8; MAX_REQUEST_HEADER_LEN];
        let len = h.encode_with_view(true, &mut buf);
        [&buf[..len], key].concat()
    };
    let requests: Vec<(&str, Vec<u8>)> = vec![
        ("put", [header(Op::Put, b"key", &|_| {}), b"value".to_vec()].concat()),
        (
            "put-ttl-if-absent",
            [
                header(Op::Put, b"k2", &|h| {
                    h.flags = flags::HAS_TTL | flags::IF_ABSENT;
                    h.ttl_or_limit = 5
                }),
                b"v".to_vec(),
            ]
            .concat(),
        ),
        ("get", header(Op::Get, b"key", &|_| {})),
        (
            "get-range",
            header(Op::Get, b"key", &|h| {
                h.flags = flags::HAS_RANGE;
                h.range_start = -2;
                h.range_end = -1
            }),
        ),
        (
            "get-if-not-equal",
            header(Op::Get, b"key", &|h| {
                h.flags = flags::IF_NOT_EQUAL;
                h.if_not_equal = 1
            }),
        ),
        (
            "delete-if-equal",
            header(Op::Delete, b"key", &|h| {
                h.flags = flags::IF_EQUAL;
                h.if_equal = 1
            }),
        ),
        (
            "list",
            [
                header(Op::List, b"", &|h| {
                    h.key_len = 1;
                    h.aux_len = 1;
                    h.ttl_or_limit = 10
                }),
                b"ab".to_vec(),
            ]
            .concat(),
        ),
        (
            "delete-range",
            [
                header(Op::DeleteRange, b"", &|h| {
                    h.key_len = 1;
                    h.flags = flags::MAX_UNBOUNDED
                }),
                b"a".to_vec(),
            ]
            .concat(),
        ),
        ("stats", header(Op::Stats, b"", &|_| {})),
        ("abort", header(Op::Abort, b"", &|h| h.ttl_or_limit = 3)),
        (
            "key-in-payload",
            [
                header(Op::Put, b"", &|h| {
                    h.flags = flags::KEY_IN_PAYLOAD;
                    h.key_len = 4
                }),
                b"longvalue".to_vec(),
            ]
            .concat(),
        ),
        ("get-short", short(Op::Get, b"key")),
        ("put-short", [short(Op::Put, b"key"), b"value".to_vec()].concat()),
        // Cluster requests (the fuzzed shard is a member of a cluster whose keys move).
        (
            "get-view",
            header(Op::Get, b"key", &|h| {
                h.flags = flags::VIEW;
                h.view = 3
            }),
        ),
        (
            "put-view-asking",
            [
                header(Op::Put, b"key", &|h| {
                    h.flags = flags::VIEW | flags::ASKING;
                    h.view = 2
                }),
                b"v".to_vec(),
            ]
            .concat(),
        ),
        (
            "put-import",
            [
                header(Op::Put, b"key", &|h| {
                    h.flags = flags::IMPORT | flags::HAS_TTL;
                    h.if_equal = 9;
                    h.ttl_or_limit = 50
                }),
                b"v".to_vec(),
            ]
            .concat(),
        ),
        ("get-migrate", header(Op::Get, b"key", &|h| h.flags = flags::MIGRATE)),
        (
            "delete-migrate",
            header(Op::Delete, b"key", &|h| {
                h.flags = flags::MIGRATE | flags::IF_EQUAL;
                h.if_equal = 9
            }),
        ),
    ];
    for (name, bytes) in &requests {
        write("request_header", name, bytes);
        write("shard_request", name, bytes);
        // Over UCX the header (with an inline key) is the active message's, the rest its payload.
        if let Ok((h, kind)) = RequestHeader::decode(bytes) {
            let inline = matches!(kind.op(), Op::Put | Op::Get | Op::Delete) && h.flags & flags::KEY_IN_PAYLOAD == 0;
            let at = (h.encoded_len() + if inline { h.key_len as usize } else { 0 }).min(bytes.len());
            write("ucx_request", name, &[&(at as u16).to_le_bytes()[..], bytes].concat());
        }
    }
    let mut reply = ReplyHeader::new(9, Status::Ok);
    reply.generation = 3;
    write("request_header", "reply", &reply.encode());
    let hello = Hello { magic: "remote_dram".into(), version: 2, nonce: "00".repeat(32) };
    write("bootstrap_line", "hello", &serde_json::to_vec(&hello).unwrap());
    let welcome = Welcome::refusal(Status::AuthFailed, "no".into());
    write("bootstrap_line", "refusal", &serde_json::to_vec(&welcome).unwrap());
    let mut w: serde_json::Value = serde_json::to_value(&welcome).unwrap();
    w["error"] = serde_json::Value::Null;
    w["transport"] = "fabric".into();
    w["shards"] = serde_json::json!(["0a0b,0c0d", "ff"]);
    write("bootstrap_line", "welcome", &serde_json::to_vec(&w).unwrap());
    let h = fabric::Hello { session: 5, hello_id: 1 << 60, addresses: vec![vec![1; 16], vec![2; 24]] };
    write("fabric_hello", "hello", &h.encode());
    let mut rv = b"key".to_vec();
    RemoteValue { len: 1 << 20, rails: vec![(0x7f00_0000_0000, 42)] }.encode(&mut rv);
    write("fabric_hello", "remote-value", &rv);
    let part = fabric::PartHeader { request_id: 9, credential: 0x5e55_1011, last: true };
    write("fabric_hello", "part", &[&part.encode()[..], b"tail"].concat());
    use prost::Message;
    use remote_dram::gateway::pb;
    let read = pb::ReadRequest {
        key: "a/b".into(),
        generation_if_equal: vec![0, 1, 0, 0, 0, 0, 0, 0, 0].into(),
        byte_range: Some(pb::ByteRange { inclusive_min: -3, exclusive_max: None }),
        staleness_bound: Some(pb::Timestamp { seconds: i64::MAX, nanos: 0 }),
        ..Default::default()
    };
    write("gateway_request", "read", &read.encode_to_vec());
    let del = pb::DeleteRequest {
        range: Some(pb::KeyRange { inclusive_min: "a".into(), exclusive_max: "b".into() }),
        ..Default::default()
    };
    write("gateway_request", "delete-range", &del.encode_to_vec());
    let wr = pb::WriteRequest { key: "k".into(), generation_if_equal: vec![2].into(), value_part: "v".into() };
    write("gateway_request", "write", &wr.encode_to_vec());
}
