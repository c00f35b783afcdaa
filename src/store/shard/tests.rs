use super::*;

fn put(s: &mut Shard, key: &[u8], value: &[u8], cond: Condition, ttl_ms: u64) -> Result<u64> {
    s.precheck_put(key, &cond)?;
    let layout = Layout::aligned_to(key.len(), value.len() as u64, value.as_ptr() as u64);
    let e = s.reserve(layout.extent_len())?;
    s.write_put(e, layout, key, value);
    s.commit_put(e, layout, &cond, ttl_ms)
}

fn value(s: &mut Shard, key: &[u8]) -> Option<Vec<u8>> {
    match s.get(key, &Condition::default(), None).unwrap() {
        GetOutcome::Value { offset, len, .. } => Some(s.arena().slice(offset, len).to_vec()),
        _ => None,
    }
}

#[test]
fn large_values_sit_as_their_source_did_within_a_cache_line() {
    let mut s = Shard::new(8 << 20, HugePages::Off, Mode::Store).unwrap();
    let backing: Vec<u8> = (0..(64 << 10) + 128).map(|i| (i * 7 % 251) as u8).collect();
    for shift in [0usize, 1, 16, 17, 48, 63] {
        let value = &backing[shift..shift + (64 << 10)];
        let key = format!("key/{shift}");
        put(&mut s, key.as_bytes(), value, Condition::default(), 0).unwrap();
        let GetOutcome::Value { offset, len, extent, .. } = s.get(key.as_bytes(), &Condition::default(), None).unwrap()
        else {
            panic!("missing")
        };
        let addr = s.arena().base() as u64 + offset;
        assert_eq!(addr % VALUE_ALIGN, value.as_ptr() as u64 % VALUE_ALIGN, "shift {shift}");
        assert!(offset >= extent + key.len() as u64 && offset < extent + key.len() as u64 + VALUE_ALIGN);
        assert_eq!(s.arena().slice(offset, len), value, "shift {shift}");
        assert_eq!(s.arena().slice(extent, key.len() as u64), key.as_bytes(), "the key stays at the extent's start");
    }
    // Small values go right after their key, whatever their alignment.
    put(&mut s, b"small", &backing[3..3 + 100], Condition::default(), 0).unwrap();
    let GetOutcome::Value { offset, extent, .. } = s.get(b"small", &Condition::default(), None).unwrap() else {
        panic!("missing")
    };
    assert_eq!(offset, extent + 5);
    assert_eq!(value(&mut s, b"small").unwrap(), &backing[3..103]);
}

#[test]
fn release_except_keeps_only_what_is_still_written_into() {
    let mut s = Shard::new(4 << 20, HugePages::Off, Mode::Store).unwrap();
    let free = s.stats().free_bytes;
    let e = s.reserve(3 << 20).unwrap();
    // Two overlapping in-flight ranges, unaligned, and one at the very end.
    let kept = s.release_except(e, &[(100, 1000), (1000, 200), (e.len - 10, 10)]);
    assert_eq!(
        kept,
        vec![Extent { offset: e.offset + 64, len: 1152 }, Extent { offset: e.offset + e.len - 64, len: 64 }]
    );
    assert_eq!(s.stats().free_bytes, free - 1152 - 64);
    for k in kept {
        s.release(k);
    }
    assert_eq!(s.stats().free_bytes, free);
    s.alloc.merge_listed();
    assert_eq!(s.stats().largest_free_bytes, free, "freed parts merged back into one extent");
}

#[test]
fn list_and_delete_range_work_in_bounded_slices() {
    let mut s = Shard::new(8 << 20, HugePages::Off, Mode::Store).unwrap();
    for i in 0..20u8 {
        put(&mut s, &[b'k', i].repeat(32 << 10)[..64 << 10], b"v", Condition::default(), 0).unwrap();
    }
    let mut out = Vec::new();
    // 64 KiB keys, 200 KiB of key bytes per reply: three keys, and more remain.
    assert!(s.list(b"", None, 1000, 200 << 10, &mut out));
    assert_eq!(out.len(), 3);
    out.clear();
    // A bound smaller than one key still returns one (progress is always made).
    assert!(s.list(b"", None, 1000, 1, &mut out));
    assert_eq!(out.len(), 1);
    out.clear();
    assert!(!s.list(b"", None, 1000, usize::MAX, &mut out));
    assert_eq!(out.len(), 20);
    assert_eq!(s.delete_range(b"", None, 8), (8, true));
    assert_eq!(s.delete_range(b"", None, 8), (8, true));
    assert_eq!(s.delete_range(b"", None, 8), (4, false));
    assert_eq!(s.stats().keys, 0);
}

#[test]
fn the_key_index_has_a_budget_of_its_own() {
    // 4 MiB shard: a 1 MiB index budget, so about fifteen 64 KiB keys.
    let mut s = Shard::new(4 << 20, HugePages::Off, Mode::Store).unwrap();
    let key = |i: u32| [&i.to_le_bytes()[..], &[b'k'; (64 << 10) - 4]].concat();
    let mut stored = 0;
    let err = loop {
        match put(&mut s, &key(stored), b"", Condition::default(), 0) {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(err.status, Status::NoSpace);
    assert!(err.message.contains("key index is full"), "{}", err.message);
    assert!((10..=16).contains(&stored), "{stored}");
    let st = s.stats();
    assert!(st.index_bytes <= st.index_budget_bytes && st.index_budget_bytes == 1 << 20);
    // Nothing leaked: the refused put's extent went back.
    assert_eq!(st.used_bytes as usize, stored as usize * (64 << 10));
    // Cache mode makes room instead.
    let mut c = Shard::new(4 << 20, HugePages::Off, Mode::Cache).unwrap();
    for i in 0..40 {
        put(&mut c, &key(i), b"", Condition::default(), 0).unwrap();
    }
    assert!(c.stats().index_bytes <= c.stats().index_budget_bytes);
    assert!(c.stats().counters.evictions > 0);
}

#[test]
fn generations_and_conditions() {
    let mut s = Shard::new(1 << 20, HugePages::Off, Mode::Store).unwrap();
    let absent = Condition { if_absent: true, ..Default::default() };
    let g1 = put(&mut s, b"k", b"v1", absent, 0).unwrap();
    assert_eq!(put(&mut s, b"k", b"v2", absent, 0).unwrap_err().status, Status::ConditionFailed);
    let stale = Condition { if_equal: Some(g1 + 1000), ..Default::default() };
    assert_eq!(put(&mut s, b"k", b"v2", stale, 0).unwrap_err().status, Status::ConditionFailed);
    let g2 = put(&mut s, b"k", b"v2", Condition { if_equal: Some(g1), ..Default::default() }, 0).unwrap();
    assert!(g2 > g1);
    assert_eq!(value(&mut s, b"k").unwrap(), b"v2");
    let unchanged = s.get(b"k", &Condition { if_not_equal: Some(g2), ..Default::default() }, None).unwrap();
    assert_eq!(unchanged, GetOutcome::Unchanged { generation: g2 });
    assert!(s.delete(b"k", &Condition::default()).unwrap());
    let g3 = put(&mut s, b"k", b"v3", Condition::default(), 0).unwrap();
    assert!(g3 > g2, "generations are never reused across delete and re-put");
}

#[test]
fn store_mode_full_keeps_data_and_cache_mode_evicts_lru() {
    let mut s = Shard::new(64 * 1024, HugePages::Off, Mode::Store).unwrap();
    let big = vec![7u8; 16 * 1024];
    for i in 0..3 {
        put(&mut s, format!("k{i}").as_bytes(), &big, Condition::default(), 0).unwrap();
    }
    let err = put(&mut s, b"k9", &vec![1u8; 20 * 1024], Condition::default(), 0).unwrap_err();
    assert_eq!(err.status, Status::NoSpace);
    assert_eq!(value(&mut s, b"k0").unwrap(), big);

    let mut c = Shard::new(64 * 1024, HugePages::Off, Mode::Cache).unwrap();
    for i in 0..3 {
        put(&mut c, format!("k{i}").as_bytes(), &big, Condition::default(), 0).unwrap();
    }
    value(&mut c, b"k0"); // k1 is now least recently used
                          // An overwrite (small enough to need no eviction) makes k1 the most recently used
                          // and k2 the least.
    put(&mut c, b"k1", b"small", Condition::default(), 0).unwrap();
    put(&mut c, b"k9", &vec![1u8; 24 * 1024], Condition::default(), 0).unwrap();
    assert!(value(&mut c, b"k2").is_none());
    assert!(value(&mut c, b"k0").is_some() && value(&mut c, b"k1").is_some());
    assert!(c.stats().counters.evictions >= 1);
}

#[test]
fn pinned_extent_is_freed_after_last_send() {
    let mut s = Shard::new(1 << 16, HugePages::Off, Mode::Store).unwrap();
    put(&mut s, b"k", &[1; 100], Condition::default(), 0).unwrap();
    let GetOutcome::Value { extent, .. } = s.get(b"k", &Condition::default(), None).unwrap() else { panic!() };
    let free_before = s.stats().free_bytes;
    s.pin(extent);
    s.delete(b"k", &Condition::default()).unwrap();
    assert_eq!(s.stats().free_bytes, free_before, "still being sent");
    s.unpin(extent);
    assert!(s.stats().free_bytes > free_before);
}

#[test]
fn ttl_expires() {
    let mut s = Shard::new(1 << 16, HugePages::Off, Mode::Store).unwrap();
    put(&mut s, b"t", b"x", Condition::default(), 1).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert!(value(&mut s, b"t").is_none());
    put(&mut s, b"u", b"x", Condition::default(), 1).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(s.expire_due(10), 1);
    assert_eq!(s.stats().keys, 0);
}

fn import(s: &mut Shard, key: &[u8], value: &[u8], generation: u64) -> Result<u64> {
    let layout = Layout::aligned_to(key.len(), value.len() as u64, value.as_ptr() as u64);
    let e = s.reserve(layout.extent_len())?;
    s.write_put(e, layout, key, value);
    s.commit_import(e, layout, generation, 0)
}

/// Copies may land in any order: one of a write older than a delete copied here lately
/// is refused, as one older than the value held, and a newer one is taken.
#[test]
fn an_import_older_than_a_delete_copied_here_is_refused() {
    let mut s = Shard::new(8 << 20, HugePages::Off, Mode::Store).unwrap();
    let base = s.last_generation();
    import(&mut s, b"k", b"old", base + 5).unwrap();
    assert_eq!(s.delete_unless_newer(b"k", base + 6).unwrap(), Ok(true));
    // The delete's copy came first, for a key this replica never held.
    assert_eq!(s.delete_unless_newer(b"never", base + 9).unwrap(), Ok(false));
    assert_eq!(s.stats().remembered_deletes, 2);
    assert_eq!(import(&mut s, b"k", b"late", base + 5).unwrap(), base + 6, "a copy from before the delete");
    assert_eq!(import(&mut s, b"never", b"late", base + 8).unwrap(), base + 9);
    assert_eq!((value(&mut s, b"k"), value(&mut s, b"never")), (None, None));
    assert_eq!(s.stats().used_bytes, 0, "refused copies leave nothing behind");
    assert_eq!(import(&mut s, b"k", b"new", base + 7).unwrap(), base + 7);
    assert_eq!(value(&mut s, b"k").as_deref(), Some(&b"new"[..]));
}

#[test]
fn a_delete_taken_as_primary_is_a_write_that_refuses_older_copies() {
    let mut s = Shard::new(8 << 20, HugePages::Off, Mode::Store).unwrap();
    let next = s.last_generation() + 1;
    let g = import(&mut s, b"k", b"v", next).unwrap();
    let (existed, deleted_at) = s.delete_as_primary(b"k", &Condition::default()).unwrap();
    assert!(existed && deleted_at > g, "a generation of its own, above the key's: {deleted_at} after {g}");
    // The mover's copy of the value deleted (a move that makes this shard a replica).
    assert_eq!(import(&mut s, b"k", b"v", g).unwrap(), deleted_at);
    assert_eq!(value(&mut s, b"k"), None);
    // A key this shard lacked: still a write, remembered.
    let (existed, absent_at) = s.delete_as_primary(b"elsewhere", &Condition::default()).unwrap();
    assert!(!existed && absent_at > deleted_at);
    assert_eq!(import(&mut s, b"elsewhere", b"old", absent_at - 1).unwrap(), absent_at);
    assert_eq!(s.stats().used_bytes, 0, "refused copies leave nothing behind");
}

#[test]
fn drop_keys_drops_what_it_is_told_and_nothing_else() {
    let mut s = Shard::new(8 << 20, HugePages::Off, Mode::Store).unwrap();
    for k in [&b"keep-1"[..], b"drop-1", b"keep-2", b"drop-2"] {
        let next = s.last_generation() + 1;
        import(&mut s, k, b"v", next).unwrap();
    }
    // In key order: drop-1, drop-2, keep-1, keep-2; three at a time, then the rest.
    let unwanted = |k: &[u8]| k.starts_with(b"drop") || k == b"keep-2";
    assert_eq!(s.drop_keys(b"", 3, |k| k.starts_with(b"drop")), (2, Some(b"keep-2".to_vec())));
    assert_eq!(s.drop_keys(b"keep-2", 3, |k| k.starts_with(b"drop")), (0, None));
    let kept: Vec<bool> = [&b"keep-1"[..], b"drop-1", b"keep-2", b"drop-2"].iter().map(|k| s.contains(k)).collect();
    assert_eq!(kept, [true, false, true, false]);
    assert_eq!(s.drop_keys(b"keep-1", 1, unwanted), (0, Some(b"keep-2".to_vec())));
    assert_eq!(s.drop_keys(b"keep-2", 1, unwanted), (1, None));
    assert!(s.drop_key(b"keep-1") && !s.drop_key(b"keep-1") && !s.contains(b"keep-1"));
}
