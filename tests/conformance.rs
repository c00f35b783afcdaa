//! The shared kvstore conformance cases (tests/conformance/cases.json, also run by the C++
//! driver's GoogleTest suite) against the Rust client, over UCX tcp on loopback.
mod common;

use std::collections::HashMap;

use common::{ServerProc, TCP};
use remote_dram::client::{
    prefix_successor, ByteRange, DeleteResult, GetOptions, GetResult, KeyRange, PutOptions, WriteCondition, WriteResult,
};
use remote_dram::{Client, Status};
use serde_json::Value as Json;

/// Pattern bytes shared by every runner: byte i is (i * 31 + seed * 7) mod 256.
fn value(v: &Json) -> Vec<u8> {
    if let Some(s) = v.as_str() {
        return s.as_bytes().to_vec();
    }
    let (size, seed, from) =
        (v["size"].as_u64().unwrap(), v["seed"].as_u64().unwrap(), v["from"].as_u64().unwrap_or(0));
    (from..size).map(|i| ((i * 31 + seed * 7) & 0xff) as u8).collect()
}

struct Runner<'a> {
    c: &'a mut Client,
    prefix: Vec<u8>,
    saved: HashMap<String, Option<u64>>,
}

impl Runner<'_> {
    fn key(&self, k: &Json) -> Vec<u8> {
        [self.prefix.as_slice(), k.as_str().unwrap().as_bytes()].concat()
    }

    /// `None`: no value (absent key).
    fn gen(&self, r: &Json) -> Option<u64> {
        match r.as_str().unwrap() {
            "no_value" => None,
            "bogus" => Some(12345),
            name => *self.saved.get(&name[1..]).unwrap_or_else(|| panic!("no saved generation {name}")),
        }
    }

    fn range(&self, s: &Json) -> KeyRange {
        let (min, max) = match s.get("range") {
            Some(r) => (r[0].as_str().unwrap(), r[1].as_str().unwrap()),
            None => ("", ""),
        };
        let min = [self.prefix.as_slice(), min.as_bytes()].concat();
        let max = if max.is_empty() {
            prefix_successor(&self.prefix)
        } else {
            Some([self.prefix.as_slice(), max.as_bytes()].concat())
        };
        KeyRange { min, max }
    }

    fn step(&mut self, s: &Json) {
        let expect = s["expect"].as_str().unwrap_or("");
        match s["op"].as_str().unwrap() {
            "write" => {
                let condition = match s.get("if_equal").map(|g| self.gen(g)) {
                    None => WriteCondition::None,
                    Some(None) => WriteCondition::IfAbsent,
                    Some(Some(g)) => WriteCondition::IfEqual(g),
                };
                let r = self
                    .c
                    .put_with(&self.key(&s["key"]), &value(&s["value"]), &PutOptions { condition, ttl: None })
                    .unwrap();
                match (expect, r) {
                    ("condition_failed", WriteResult::ConditionFailed) => {}
                    ("condition_failed", r) => panic!("{s}: wrote {r:?}"),
                    (_, WriteResult::Written { generation }) => {
                        if let Some(name) = s["save"].as_str() {
                            self.saved.insert(name.into(), Some(generation));
                        }
                    }
                    (_, r) => panic!("{s}: {r:?}"),
                }
            }
            "delete" => {
                let condition =
                    s.get("if_equal").and_then(|g| self.gen(g)).map_or(WriteCondition::None, WriteCondition::IfEqual);
                let r = self.c.delete_with(&self.key(&s["key"]), condition).unwrap();
                let failed = r == DeleteResult::ConditionFailed;
                assert_eq!(failed, expect == "condition_failed", "{s}: {r:?}");
            }
            "read" => {
                let mut o = GetOptions::default();
                if let Some(g) = s.get("if_equal") {
                    o.if_equal = self.gen(g);
                }
                if let Some(g) = s.get("if_not_equal") {
                    o.if_not_equal = self.gen(g);
                }
                if let Some(r) = s.get("range") {
                    o.range = Some(ByteRange { start: r[0].as_i64().unwrap(), end: r[1].as_i64().unwrap_or(-1) });
                }
                let r = self.c.get_with(&self.key(&s["key"]), &o);
                if expect.starts_with("error:") {
                    assert_eq!(expect, "error:OUT_OF_RANGE");
                    assert_eq!(r.unwrap_err().status, Status::OutOfRange, "{s}");
                    return;
                }
                let want_gen = s.get("generation").map(|g| self.gen(g));
                match (expect, r.unwrap()) {
                    ("missing", GetResult::Missing) => {
                        assert!(
                            matches!(want_gen, None | Some(None)),
                            "{s}: the case expects a generation for a missing key"
                        );
                        // The result, not only the case: the key is absent from a listing too.
                        let key = self.key(&s["key"]);
                        let mut max = key.clone();
                        max.push(0);
                        let listed = self.c.list(&remote_dram::client::KeyRange { min: key, max: Some(max) }).unwrap();
                        assert!(listed.is_empty(), "{s}: reported missing but listed: {listed:?}");
                    }
                    ("unspecified", GetResult::Unchanged { generation }) => {
                        assert!(want_gen.is_none_or(|g| g == Some(generation)), "{s}")
                    }
                    ("value", GetResult::Value(v)) => {
                        if let Some(want) = s.get("value") {
                            assert!(v.data == value(want), "{s}: value differs");
                        }
                        assert!(want_gen.is_none_or(|g| g == Some(v.generation)), "{s}");
                    }
                    (e, r) => panic!("{s}: expected {e}, got {r:?}"),
                }
            }
            "list" => {
                let strip = self.prefix.len() + s["strip"].as_u64().unwrap_or(0) as usize;
                let got = self.c.list(&self.range(s)).unwrap();
                let keys: Vec<String> = got
                    .iter()
                    .map(|e| String::from_utf8_lossy(&e.key[strip.min(e.key.len())..]).into_owned())
                    .collect();
                let want: Vec<String> = serde_json::from_value(s["expect_keys"].clone()).unwrap();
                assert_eq!(keys, want, "{s}");
                if let Some(sizes) = s.get("expect_sizes") {
                    let want: Vec<u64> = serde_json::from_value(sizes.clone()).unwrap();
                    assert_eq!(got.iter().map(|e| e.size).collect::<Vec<_>>(), want, "{s}");
                }
            }
            "delete_range" => {
                self.c.delete_range(&self.range(s)).unwrap();
            }
            "generations_differ" => {
                let (a, b) = (&self.saved[s["a"].as_str().unwrap()], &self.saved[s["b"].as_str().unwrap()]);
                assert_ne!(a, b, "{s}");
            }
            "concurrent_writes" => {
                // The Rust client's way to many requests in flight: one pipelined batch.
                let n = s["count"].as_u64().unwrap() as usize;
                let keys: Vec<Vec<u8>> = (0..n).map(|i| self.key(&Json::from(format!("k{i}")))).collect();
                let vals: Vec<Vec<u8>> = (0..n).map(|i| format!("v{i}").into_bytes()).collect();
                let items: Vec<(&[u8], &[u8])> =
                    keys.iter().zip(&vals).map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
                assert!(self.c.put_many(&items, 64).into_iter().all(|r| r.is_ok()));
                let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
                for (r, v) in self.c.get_many(&refs, 64).into_iter().zip(&vals) {
                    assert_eq!(&r.unwrap().unwrap().data, v);
                }
            }
            op => panic!("unknown op {op}"),
        }
    }
}

#[test]
fn shared_conformance_cases() {
    common::init(TCP);
    let cases: Json = serde_json::from_str(include_str!("conformance/cases.json")).unwrap();
    let server = ServerProc::start(&["--memory", "256MiB"]);
    let mut c = server.client();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut r = Runner { c: &mut c, prefix: format!("{name}/").into_bytes(), saved: HashMap::new() };
        for step in case["steps"].as_array().unwrap() {
            r.step(step);
        }
    }
}
