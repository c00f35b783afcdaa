//! Entry points for the fuzz targets (`fuzz/`, run by `make fuzz` with cargo-fuzz) and
//! for their smoke test in `cargo test` (`tests/fuzz_smoke.rs`). Each takes arbitrary
//! bytes from a peer and must never panic, hang or allocate without bound; what decodes
//! must encode back to the same thing.

use std::cell::RefCell;

use crate::proto::bootstrap::{hex_decode, Challenge, Hello, Proof, Welcome};
use crate::proto::fabric::{self, RemoteValue};
use crate::proto::{decode_list_entries, flags, ReplyHeader, RequestHeader, MAX_REQUEST_HEADER_LEN};
use crate::server::service::{Membership, Service};
use crate::store::{HugePages, Mode, Shard};

/// The request header (full or short form), reply header (full or compact) and list entries decoders.
pub fn request_header(data: &[u8]) {
    if let Ok((h, op)) = RequestHeader::decode(data) {
        let mut buf = [0u8; MAX_REQUEST_HEADER_LEN];
        let len = h.encode_with_view(h.flags & flags::SHORT_FORM != 0, &mut buf);
        assert_eq!(RequestHeader::decode(&buf[..len]).map_err(|e| e.message).unwrap(), (h, op));
    }
    if let Ok(h) = ReplyHeader::decode(data) {
        assert_eq!(ReplyHeader::decode(&h.encode()).unwrap(), h);
    }
    // A compact reply header's meaning depends on the payload after it: any length will do.
    let payload = data.last().map_or(0, |&b| b as usize % 16);
    if let Ok(h) = ReplyHeader::decode_compact(data, payload) {
        let mut buf = [0u8; crate::proto::REPLY_HEADER_LEN];
        let len = h.encode_compact(payload, &mut buf);
        assert_eq!(ReplyHeader::decode_compact(&buf[..len], payload).unwrap(), h);
    }
    let _ = decode_list_entries(data);
}

/// The bootstrap's JSON lines (both directions) and the hex addresses they carry.
pub fn bootstrap_line(data: &[u8]) {
    let _ = serde_json::from_slice::<Hello>(data);
    let _ = serde_json::from_slice::<Challenge>(data);
    let _ = serde_json::from_slice::<Proof>(data);
    if let Ok(w) = serde_json::from_slice::<Welcome>(data) {
        for s in &w.shards {
            let _ = fabric::decode_addresses(s);
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = hex_decode(s);
    }
}

/// A libfabric hello, the remote-value reference a large request ends with, and the
/// header of a request's later part.
pub fn fabric_hello(data: &[u8]) {
    if let Ok(h) = fabric::Hello::decode(data) {
        assert_eq!(fabric::Hello::decode(&h.encode()).unwrap(), h);
    }
    if let Some(p) = fabric::PartHeader::decode(data) {
        assert_eq!(fabric::PartHeader::decode(&p.encode()), Some(p));
    }
    for rails in 1..=4 {
        if let Ok((head, v)) = RemoteValue::decode_tail(data, rails) {
            let mut again = head.to_vec();
            v.encode(&mut again);
            assert_eq!(again, data);
        }
    }
}

/// The gateway's gRPC requests: decoded as tonic does and converted to engine requests, and
/// as request bodies (the first byte says where to cut the rest into HTTP/2 frames) through
/// the decoders that Write and Read use.
#[cfg(feature = "gateway")]
pub fn gateway_request(data: &[u8]) {
    use crate::gateway::frames::{ReadDecoder, WriteDecoder};
    use crate::gateway::{pb, service, wire};
    use prost::Message;
    if let Some((&cut, body)) = data.split_first() {
        let frames = || body.chunks(usize::from(cut) + 1).map(bytes::Bytes::copy_from_slice);
        let budget = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
        {
            let mut write = WriteDecoder::new(service::WriteValue::new(32 << 10, budget.clone()));
            if frames().all(|f| write.push(f).is_ok()) {
                if let Ok((first, value)) = write.finish() {
                    assert!(!first.key.is_empty() && value.bytes().len() <= 32 << 10);
                }
            }
        }
        assert_eq!(budget.available_permits(), 64, "a decoded write's budget comes back");
        let mut read = ReadDecoder::default();
        if frames().all(|f| read.push(f).is_ok()) {
            let _ = read.finish().map(|r| service::read_options(&r));
        }
    }
    if let Ok(r) = pb::ReadRequest::decode(data) {
        let _ = service::read_options(&r);
        let _ = wire::reply_timestamp(r.staleness_bound.as_ref());
    }
    if let Ok(r) = pb::WriteRequest::decode(data) {
        let _ = service::write_condition(&r.generation_if_equal);
    }
    if let Ok(r) = pb::DeleteRequest::decode(data) {
        let _ = r.range.map(service::key_range);
        let _ = service::write_condition(&r.generation_if_equal);
    }
    if let Ok(r) = pb::ListRequest::decode(data) {
        let _ = r.range.map(service::key_range);
    }
}

/// A shard of a cluster member whose keys move (view 3, from "a" to "a" and "b"), with one
/// client (`SESSION`): what the request targets are served by, once per thread.
const SESSION: u64 = 0x5e55_1011;

fn with_service(f: impl FnOnce(&mut Service)) {
    thread_local! {
        static SERVICE: RefCell<Option<Service>> = const { RefCell::new(None) };
    }
    SERVICE.with(|cell| {
        let mut cell = cell.borrow_mut();
        let service = cell.get_or_insert_with(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            tx.send(Membership::Joined { client: 1, session: SESSION }).unwrap();
            let shard = Shard::new(4 << 20, HugePages::Off, Mode::Cache).expect("a 4 MiB shard");
            let mut s = Service::new(
                0,
                1,
                rx,
                shard,
                std::sync::Arc::new(crate::server::reply_backlog::ReplyBudget::new(u64::MAX)),
            );
            s.sync_membership();
            let role = std::sync::Arc::new(crate::cluster::ServerRole::default());
            role.set(
                "a",
                crate::cluster::Placement {
                    epoch: 3,
                    members: vec!["a".into()],
                    next: Some(vec!["a".into(), "b".into()]),
                    replicas: 1,
                    version: 3,
                    ..Default::default()
                },
            );
            // The fuzzer knows no secret: the tickets it makes up must all be refused.
            let secret = crate::auth::ClusterSecret::new(b"fuzz target cluster secret").unwrap();
            s.set_cluster_role(role, secret, None, Vec::new(), false).expect("a replicator thread");
            s
        });
        f(service)
    });
}

/// Most inputs get the right session so that they reach the store.
fn with_session(msg: &mut [u8]) {
    if msg.first().is_some_and(|b| b & 1 == 0) {
        crate::proto::RequestHeader::set_session_in(msg, SESSION);
    }
}

/// A whole request (header, key, payload as one libfabric message) served by a real
/// shard: what a hostile client can make a worker do.
pub fn shard_request(data: &[u8]) {
    with_service(|service| {
        let mut msg = data.to_vec();
        with_session(&mut msg);
        let mut out = Vec::new();
        let admitted = service
            .admit_message(&msg, SESSION)
            .map(|(req, payload)| (req.header, req.kind, req.inline.to_vec(), payload.to_vec()));
        if let Ok((header, kind, inline, payload)) = admitted {
            let req = crate::server::service::Request { header, kind, inline: &inline };
            let _ = service.serve(&req, &payload, &mut out);
        }
    });
}

/// A whole request as UCX hands it to a shard worker: the active message's header (the
/// first two bytes of the input give its length) and its eager payload, through the UCX
/// path's admission (`Service::admit`) and then served.
pub fn ucx_request(data: &[u8]) {
    let Some((len, rest)) = data.split_first_chunk::<2>() else { return };
    let at = (u16::from_le_bytes(*len) as usize).min(rest.len());
    let (header, payload) = rest.split_at(at);
    let mut header = header.to_vec();
    with_session(&mut header);
    with_service(|service| {
        let mut out = Vec::new();
        if let Ok((req, _client)) = service.admit(&header) {
            let _ = service.serve(&req, payload, &mut out);
        }
    });
}
