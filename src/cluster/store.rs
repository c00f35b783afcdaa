//! What following a cluster's state asks of etcd, behind one trait ([`Kv`]): the keys
//! under a prefix at one revision, a write that holds only while another key is
//! unchanged, and whether a lease lives. etcd itself implements it; so does the in-memory
//! etcd of the unit tests (`tests.rs`), against which the placement's transitions run.

use std::future::Future;

/// A key as etcd holds it.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision that last changed it.
    pub mod_revision: i64,
    /// The lease it is attached to (0: none).
    pub lease: i64,
}

/// The etcd operations a cluster's state machine takes (see the module's doc). Errors are
/// etcd's, as text; callers say what they were doing.
pub(super) trait Kv {
    /// Every key under `prefix`, with the store's revision at which they were read.
    fn range(&mut self, prefix: &str) -> impl Future<Output = Result<(i64, Vec<Entry>), String>> + Send;

    /// Writes `key` if its last change was at `mod_revision` (0: if it does not exist);
    /// whether it did.
    fn put_if_unchanged(
        &mut self,
        key: &str,
        mod_revision: i64,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<bool, String>> + Send;

    /// Whether etcd says `lease` lives (an unanswered question: it does not).
    fn lease_lives(&mut self, lease: i64) -> impl Future<Output = bool> + Send;
}

impl Kv for etcd_client::Client {
    async fn range(&mut self, prefix: &str) -> Result<(i64, Vec<Entry>), String> {
        let got =
            self.get(prefix, Some(etcd_client::GetOptions::new().with_prefix())).await.map_err(|e| e.to_string())?;
        let revision = got.header().map_or(0, |h| h.revision());
        let entries = got
            .kvs()
            .iter()
            .filter_map(|kv| {
                Some(Entry {
                    key: kv.key_str().ok()?.to_string(),
                    value: kv.value().to_vec(),
                    mod_revision: kv.mod_revision(),
                    lease: kv.lease(),
                })
            })
            .collect();
        Ok((revision, entries))
    }

    async fn put_if_unchanged(&mut self, key: &str, mod_revision: i64, value: Vec<u8>) -> Result<bool, String> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let unchanged = match mod_revision {
            0 => Compare::create_revision(key, CompareOp::Equal, 0),
            revision => Compare::mod_revision(key, CompareOp::Equal, revision),
        };
        let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(key, value, None)]);
        Ok(self.txn(txn).await.map_err(|e| e.to_string())?.succeeded())
    }

    async fn lease_lives(&mut self, lease: i64) -> bool {
        self.lease_time_to_live(lease, None).await.is_ok_and(|r| r.ttl() > 0)
    }
}
