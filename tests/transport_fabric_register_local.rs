//! EFA's registration discipline (FI_MR_LOCAL: every local buffer registered, its
//! descriptor passed) forced on libfabric tcp;ofi_rxm, so the code path EFA takes runs
//! here: all sizes both ways, caller buffers, ranges, striping, a long key and a list
//! reply too large for one message.
mod common;
mod suite;

use remote_dram::client::KeyRange;

#[test]
fn sizes_and_ranges() {
    suite::sizes_and_ranges(common::FABRIC_TCP_REGISTER_LOCAL)
}

#[test]
fn striped_over_three_rails() {
    suite::striped_over_rails(common::FABRIC_TCP_REGISTER_LOCAL, 3)
}

#[test]
fn long_keys_and_large_list_replies() {
    common::init(common::FABRIC_TCP_REGISTER_LOCAL);
    let server = common::ServerProc::start(&["--workers", "1"]);
    let mut c = server.client();
    // A 60 KiB key: the request is too long for one message, so the worker reads it.
    let long_key = vec![b'k'; 60 << 10];
    c.put(&long_key, b"value of a long key").unwrap();
    assert_eq!(c.get(&long_key).unwrap().unwrap().data, b"value of a long key");
    for i in 0..2000 {
        c.put(format!("list/{i:05}/{}", "x".repeat(40)).as_bytes(), b"v").unwrap();
    }
    // ~110 KiB of entries: the reply's payload follows as its own message.
    let listed = c.list(&KeyRange::prefix(b"list/")).unwrap();
    assert_eq!(listed.len(), 2000);
    assert!(listed.windows(2).all(|w| w[0].key < w[1].key));
    assert!(c.delete(&long_key).unwrap());
}
