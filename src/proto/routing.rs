//! Where a key lives: its shard on a server, and its servers in a cluster (rendezvous
//! hashing). Clients and servers must agree on both, so they live with the wire format.

use smallvec::SmallVec;

/// The shard that owns `key` on a server with `shards` shards. A one-shard server's key
/// needs no hash: the client routing it and the server checking it skip one each.
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    if shards <= 1 {
        return 0;
    }
    (xxhash_rust::xxh3::xxh3_64(key) % shards as u64) as usize
}

/// The hash seed of a server's name (its bootstrap address) for [`rendezvous`].
pub fn node_seed(node: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(node.as_bytes())
}

/// Rendezvous hashing: which of the servers whose [`node_seed`]s are given owns `key`
/// (its index). Clients and servers must agree on it, so it lives with the wire format.
pub fn rendezvous(key: &[u8], seeds: &[u64]) -> usize {
    if seeds.len() <= 1 {
        return 0;
    }
    (0..seeds.len()).max_by_key(|&i| xxhash_rust::xxh3::xxh3_64_with_seed(key, seeds[i])).unwrap()
}

/// A key's servers in rank order, held inline for up to four (a replica set is ranked on
/// every cluster request and every copy: no allocation then).
pub type Ranked = SmallVec<[usize; 4]>;

/// The `n` servers (at most) that rank highest for `key` under rendezvous hashing, best
/// first: a key's replica set, its primary first. Removing a server leaves the others'
/// order as it was, so a key's surviving replicas stay its replicas, in order.
pub fn rendezvous_ranked(key: &[u8], seeds: &[u64], n: usize) -> Ranked {
    if n <= 1 {
        return if seeds.is_empty() { Ranked::new() } else { smallvec::smallvec![rendezvous(key, seeds)] };
    }
    let mut scored: SmallVec<[(u64, usize); 8]> = (0..seeds.len()).map(|i| score(key, seeds, i)).collect();
    scored.sort_unstable_by(|a, b| b.cmp(a));
    scored.into_iter().take(n).map(|(_, i)| i).collect()
}

/// Whether server `i` is among the `n` that rank highest for `key` (as
/// [`rendezvous_ranked`] ranks them), without ranking them all.
pub fn rendezvous_among(key: &[u8], seeds: &[u64], n: usize, i: usize) -> bool {
    let mine = score(key, seeds, i);
    (0..seeds.len()).filter(|&j| score(key, seeds, j) > mine).count() < n
}

/// Server `i`'s rank for `key`: its hash, ties broken by its index.
fn score(key: &[u8], seeds: &[u64], i: usize) -> (u64, usize) {
    (xxhash_rust::xxh3::xxh3_64_with_seed(key, seeds[i]), i)
}
