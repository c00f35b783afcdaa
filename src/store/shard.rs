//! One shard: an arena, its allocator and its index, owned by exactly one worker thread.
//! This is where the kvstore semantics live (generations, conditions, byte ranges, TTL,
//! store/cache mode); it knows nothing of the network.
//!
//! A value is written in two steps so that large values can be received straight into the
//! arena: [`Shard::reserve`] hands out an extent, the transport fills it as a [`Layout`]
//! says (the key, then the value), then [`Shard::commit_put`] checks the condition and
//! publishes it (or the caller [`Shard::release`]s it). Extents that a reply is still being sent from are pinned; freeing
//! a pinned extent is deferred until its last send completes.

use rustc_hash::FxHashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::alloc::{Extent, ExtentAllocator, GRANULE};
use super::arena::{Arena, Backing, HugePages};
use super::index::{Entry, Index};
use super::tombstones::Tombstones;
use crate::error::{Error, Result, Status};
use crate::proto::{ByteRange, VALUE_ALIGN};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A full arena answers "no space".
    Store,
    /// A full arena evicts least-recently-used values.
    Cache,
}

/// Where a put's key and value go in its extent: the key at the start, the value right
/// after it; a value of [`ALIGN_VALUES_FROM`] bytes or more a little further, at the same
/// offset within a cache line as the bytes it is copied from (`src_align`, their address
/// modulo [`VALUE_ALIGN`]), so that the copy into the arena is mutually aligned (see
/// VALUE_ALIGN: misaligned, the kernel's cross-process copy ran at a third of the speed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub key_len: u32,
    pub value_at: u32,
    pub value_len: u64,
}

/// Values shorter than this go right after their key: at most 63 bytes of padding is
/// worth it only where copying dominates.
pub const ALIGN_VALUES_FROM: u64 = 4096;

// Extents start on a multiple of GRANULE in a page-aligned arena, so an offset within the
// extent has the same alignment as the address it ends up at.
const _: () = assert!(GRANULE % VALUE_ALIGN == 0);

impl Layout {
    /// For a value copied from an address that is `src_align` modulo VALUE_ALIGN.
    pub fn aligned_to(key_len: usize, value_len: u64, src_align: u64) -> Self {
        let pad = if value_len >= ALIGN_VALUES_FROM {
            (src_align % VALUE_ALIGN + VALUE_ALIGN - key_len as u64 % VALUE_ALIGN) % VALUE_ALIGN
        } else {
            0
        };
        // Keys are at most MAX_KEY_LEN (checked when the request is decoded), so this fits.
        Layout { key_len: key_len as u32, value_at: (key_len as u64 + pad) as u32, value_len }
    }

    /// The value right after the key, as when both arrive in one piece.
    pub fn packed(key_len: usize, value_len: u64) -> Self {
        Layout { key_len: key_len as u32, value_at: key_len as u32, value_len }
    }

    /// The extent length to reserve.
    pub fn extent_len(&self) -> u64 {
        self.value_at as u64 + self.value_len
    }
}

/// Generation conditions of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Condition {
    pub if_equal: Option<u64>,
    pub if_not_equal: Option<u64>,
    pub if_absent: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum GetOutcome {
    /// `offset`/`len` locate the (ranged) bytes in the arena.
    Value {
        generation: u64,
        value_size: u64,
        offset: u64,
        len: u64,
        extent: u64,
    },
    Missing,
    Unchanged {
        generation: u64,
    },
}

#[derive(Default, Clone, Serialize)]
pub struct Counters {
    pub puts: u64,
    pub gets: u64,
    pub hits: u64,
    pub deletes: u64,
    pub evictions: u64,
    pub expirations: u64,
    pub no_space: u64,
    pub condition_failed: u64,
}

#[derive(Serialize)]
pub struct ShardStats {
    pub keys: usize,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    pub largest_free_bytes: u64,
    pub fragmentation: f64,
    pub backing: Backing,
    pub mode: Mode,
    pub pinned_extents: usize,
    /// Heap bytes of the key index (key copies and per-key metadata), and its budget.
    pub index_bytes: usize,
    pub index_budget_bytes: usize,
    /// Deletes copied here by their keys' primaries that the shard remembers (see
    /// [`Tombstones`]).
    pub remembered_deletes: usize,
    #[serde(flatten)]
    pub counters: Counters,
}

struct Pin {
    sends: u32,
    /// Set when the extent was freed while pinned: free it when the last send completes.
    freed: Option<Extent>,
}

/// Generations stay below this: one given out, brought by an import or set as a floor.
/// Fresh shards start at wall-clock nanoseconds (about 2^60.6 in 2026; this limit is
/// reached in the year 2262), so a generation at or above it was made up, and taking it
/// would leave no room above it.
pub const GENERATION_LIMIT: u64 = 1 << 63;

/// Refuses a generation that came from elsewhere (an import, a floor) at or above
/// [`GENERATION_LIMIT`].
pub fn check_generation(generation: u64) -> Result<u64> {
    if generation >= GENERATION_LIMIT {
        return Err(Error::new(
            Status::Invalid,
            format!("generation {generation} is past the limit {GENERATION_LIMIT}: refused"),
        ));
    }
    Ok(generation)
}

pub struct Shard {
    arena: Arena,
    alloc: ExtentAllocator,
    index: Index,
    mode: Mode,
    last_generation: u64,
    clock: Instant,
    /// By extent offset (the allocator's choice, never a client's: a fast hash is safe).
    pins: FxHashMap<u64, Pin>,
    counters: Counters,
    /// Most heap bytes the key index may hold (see [`ShardStats::index_bytes`]).
    index_budget: usize,
    /// The deletes copied here by the keys' primaries, for a while (see [`Tombstones`]).
    tombstones: Tombstones,
}

impl Shard {
    pub fn new(memory: u64, hugepages: HugePages, mode: Mode) -> Result<Shard> {
        let arena = Arena::new(memory as usize, hugepages)?;
        let alloc = ExtentAllocator::new(arena.len() as u64);
        // Generations start at wall-clock nanoseconds so a restarted server does not hand
        // out a generation a client may still hold from before.
        let start = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Ok(Shard {
            arena,
            alloc,
            index: Index::new(),
            mode,
            last_generation: start,
            clock: Instant::now(),
            pins: FxHashMap::default(),
            counters: Counters::default(),
            index_budget: (memory as usize / 4).max(1 << 20),
            tombstones: Tombstones::default(),
        })
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    pub fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn next_generation(&mut self) -> Result<u64> {
        let next = check_generation(self.last_generation + 1)?;
        self.last_generation = next;
        Ok(next)
    }

    /// Looks a key up, dropping it first if its TTL has passed.
    fn live_slot(&mut self, key: &[u8]) -> Option<u32> {
        let slot = self.index.find(key)?;
        let expires = self.index.entry(slot).expires_at;
        if expires != 0 && expires <= self.now() {
            self.counters.expirations += 1;
            self.remove_key(key);
            return None;
        }
        Some(slot)
    }

    fn write_condition_holds(&mut self, key: &[u8], cond: &Condition) -> bool {
        if !cond.if_absent && cond.if_equal.is_none() {
            return true;
        }
        let current = self.live_slot(key).map(|s| self.index.entry(s).generation);
        match (current, cond) {
            (Some(_), Condition { if_absent: true, .. }) => false,
            (Some(g), Condition { if_equal: Some(want), .. }) => g == *want,
            (None, Condition { if_equal: Some(_), .. }) => false,
            _ => true,
        }
    }

    /// Checks a write condition before any data moves, so a doomed put fails fast.
    pub fn precheck_put(&mut self, key: &[u8], cond: &Condition) -> Result<()> {
        if self.write_condition_holds(key, cond) {
            Ok(())
        } else {
            self.counters.condition_failed += 1;
            Err(Error::new(Status::ConditionFailed, ""))
        }
    }

    /// Finds room for `len` bytes, expiring and (in cache mode) evicting as needed.
    pub fn reserve(&mut self, len: u64) -> Result<Extent> {
        if ExtentAllocator::rounded(len) > self.alloc.capacity() {
            return Err(Error::new(
                Status::ValueTooLarge,
                format!("{len} bytes do not fit in a shard of {} bytes", self.alloc.capacity()),
            ));
        }
        loop {
            if let Some(e) = self.alloc.alloc(len) {
                return Ok(e);
            }
            if self.expire_due(usize::MAX) > 0 {
                continue;
            }
            let victim = match self.mode {
                Mode::Cache => self.index.least_recently_used(),
                Mode::Store => None,
            };
            let Some(slot) = victim else {
                self.counters.no_space += 1;
                return Err(Error::new(
                    Status::NoSpace,
                    format!(
                        "{len} bytes requested, {} free in {} extents (largest {})",
                        self.alloc.free_bytes(),
                        self.alloc.free_extents(),
                        self.alloc.largest_free()
                    ),
                ));
            };
            let e = self.index.entry(slot);
            let key = self.arena.slice(e.extent.offset, e.key_len as u64).to_vec();
            self.remove_key(&key);
            self.counters.evictions += 1;
        }
    }

    /// Like `reserve`, for a put of `key`: when there is no room and the key exists, the
    /// error says why an overwrite needs more (old and new value held at once).
    pub fn reserve_for_put(&mut self, key: &[u8], len: u64) -> Result<Extent> {
        self.reserve(len).map_err(|mut e| {
            if e.status == Status::NoSpace && self.index.find(key).is_some() {
                e.message.push_str("; overwriting a value needs room for the old and the new one at once (a value is replaced only once the new one is complete)");
            }
            e
        })
    }

    /// Writes a key and value into a reserved extent as `layout` says.
    pub fn write_put(&mut self, e: Extent, layout: Layout, key: &[u8], value: &[u8]) {
        let slot = self.extent_mut(e);
        slot[..key.len()].copy_from_slice(key);
        slot[layout.value_at as usize..][..value.len()].copy_from_slice(value);
    }

    /// Writable view of a reserved extent.
    pub fn extent_mut(&mut self, e: Extent) -> &mut [u8] {
        self.arena.slice_mut(e.offset, e.len)
    }

    /// Publishes a key and value already written into `extent` as `layout` says.
    pub fn commit_put(&mut self, extent: Extent, layout: Layout, cond: &Condition, ttl_ms: u64) -> Result<u64> {
        debug_assert!(layout.key_len <= layout.value_at && layout.extent_len() <= extent.len);
        // SAFETY: the extent is reserved for this put: it is not in the index, so nothing
        // below frees or writes it, and the arena mapping never moves. Borrowing it raw
        // avoids copying the key on every put.
        let key: &[u8] = unsafe {
            std::slice::from_raw_parts(self.arena.base().add(extent.offset as usize), layout.key_len as usize)
        };
        if !self.write_condition_holds(key, cond) {
            self.counters.condition_failed += 1;
            self.release(extent);
            return Err(Error::new(Status::ConditionFailed, ""));
        }
        let generation = match self.next_generation() {
            Ok(g) => g,
            Err(e) => {
                self.release(extent);
                return Err(e);
            }
        };
        self.install(extent, layout, generation, ttl_ms)?;
        Ok(generation)
    }

    /// Publishes a value copied from another replica (or handed over by the key's previous
    /// owner) with the generation and TTL it had there, unless the key holds that
    /// generation or a newer one already, or was deleted at one lately (copies may arrive
    /// in any order); generations given out here from now on are above it, so that the
    /// key's generations never go backwards. Returns the generation the key holds (or
    /// was deleted at).
    pub fn commit_import(&mut self, extent: Extent, layout: Layout, generation: u64, ttl_ms: u64) -> Result<u64> {
        if let Err(e) = check_generation(generation) {
            self.release(extent);
            return Err(e);
        }
        self.last_generation = self.last_generation.max(generation);
        // SAFETY: as in `commit_put`: the extent is reserved, outside the index.
        let key: &[u8] = unsafe {
            std::slice::from_raw_parts(self.arena.base().add(extent.offset as usize), layout.key_len as usize)
        };
        if let Some(held) = self.tombstones.generation(key, self.now()).filter(|&g| g >= generation) {
            self.release(extent);
            return Ok(held);
        }
        if let Some(held) = self.generation_of(key).filter(|&g| g >= generation) {
            self.release(extent);
            return Ok(held);
        }
        self.install(extent, layout, generation, ttl_ms)?;
        Ok(generation)
    }

    /// The highest generation given out or brought here so far.
    pub fn last_generation(&self) -> u64 {
        self.last_generation
    }

    /// Gives out generations above `floor` from now on (a cluster's new epoch: see
    /// [`crate::cluster::Placement::generation_floor`]).
    /// A floor at or past [`GENERATION_LIMIT`] is refused (the placement that carried it
    /// was made up; its epoch's floor is checked when read from etcd too).
    pub fn raise_generations_above(&mut self, floor: u64) -> Result<()> {
        self.last_generation = self.last_generation.max(check_generation(floor)?);
        Ok(())
    }

    /// The generation of the key's live value.
    pub fn generation_of(&mut self, key: &[u8]) -> Option<u64> {
        self.live_slot(key).map(|s| self.index.entry(s).generation)
    }

    /// Deletes the key unless it holds a generation newer than `generation` (a replica
    /// copying a delete its primary made), and remembers the delete for a while (see
    /// [`Tombstones`]): whether it went, or the newer generation it keeps.
    pub fn delete_unless_newer(&mut self, key: &[u8], generation: u64) -> Result<std::result::Result<bool, u64>> {
        self.last_generation = self.last_generation.max(check_generation(generation)?);
        if let Some(newer) = self.generation_of(key).filter(|&g| g > generation) {
            return Ok(Err(newer));
        }
        let now = self.now();
        self.tombstones.remember(key, generation, now);
        let existed = self.remove_key(key);
        self.counters.deletes += existed as u64;
        Ok(Ok(existed))
    }

    /// Deletes a key as its primary in a cluster: the delete is a write of its own, with a
    /// generation above every one the key had here, which the shard remembers for a while
    /// (see [`Tombstones`]) so that no copy of an earlier write brings the value back (the
    /// mover's, when this shard gains the key in a move). Whether the key existed, and the
    /// delete's generation, for its replicas to delete up to.
    pub fn delete_as_primary(&mut self, key: &[u8], cond: &Condition) -> Result<(bool, u64)> {
        if !self.write_condition_holds(key, cond) {
            self.counters.condition_failed += 1;
            return Err(Error::new(Status::ConditionFailed, ""));
        }
        let generation = self.next_generation()?;
        let now = self.now();
        self.tombstones.remember(key, generation, now);
        let existed = self.remove_key(key);
        self.counters.deletes += existed as u64;
        Ok((existed, generation))
    }

    /// Whether the key holds a live value.
    pub fn contains(&mut self, key: &[u8]) -> bool {
        self.live_slot(key).is_some()
    }

    /// The key's time to live left, in milliseconds (0: it has none, or no value).
    pub fn ttl_left_ms(&mut self, key: &[u8]) -> u64 {
        let Some(slot) = self.live_slot(key) else { return 0 };
        match self.index.entry(slot).expires_at {
            0 => 0,
            at => (at.saturating_sub(self.now()) / 1_000_000).max(1),
        }
    }

    /// Puts `extent` (key and value in place) in the index under `generation`.
    fn install(&mut self, extent: Extent, layout: Layout, generation: u64, ttl_ms: u64) -> Result<()> {
        let Layout { key_len, value_at, value_len } = layout;
        // SAFETY: as in `commit_put`: the extent is reserved, outside the index.
        let key: &[u8] =
            unsafe { std::slice::from_raw_parts(self.arena.base().add(extent.offset as usize), key_len as usize) };
        let expires_at =
            if ttl_ms == 0 { 0 } else { self.now().saturating_add(ttl_ms.saturating_mul(1_000_000)).max(1) };
        let entry = Entry::new(extent, key_len, value_at, value_len, generation, expires_at);
        match self.index.find(key) {
            Some(slot) => {
                let old = self.index.replace(slot, entry);
                // Only eviction reads the recency order: store mode leaves the list (and
                // the cache lines of the entry's neighbours) alone.
                if self.mode == Mode::Cache {
                    self.index.touch(slot);
                }
                self.release(old.extent);
            }
            None => {
                let cost = key.len() + super::index::ENTRY_OVERHEAD;
                while self.index.bytes() + cost > self.index_budget {
                    // Keys live on the heap too: their index has a budget of its own (a
                    // quarter of the shard's memory). Cache mode makes room; store mode says no.
                    let victim = match self.mode {
                        Mode::Cache => self.index.least_recently_used(),
                        Mode::Store => None,
                    };
                    let Some(slot) = victim else {
                        self.counters.no_space += 1;
                        let msg = format!(
                            "the key index is full: {} keys use {} of its {} bytes (a quarter of the shard's memory; keys are also kept on the heap)",
                            self.index.len(),
                            self.index.bytes(),
                            self.index_budget
                        );
                        self.release(extent);
                        return Err(Error::new(Status::NoSpace, msg));
                    };
                    let e = self.index.entry(slot);
                    let victim_key = self.arena.slice(e.extent.offset, e.key_len as u64).to_vec();
                    self.remove_key(&victim_key);
                    self.counters.evictions += 1;
                }
                self.index.insert(key, entry);
            }
        }
        self.counters.puts += 1;
        Ok(())
    }

    /// Returns an extent to the allocator, or defers it while a send still reads it.
    pub fn release(&mut self, extent: Extent) {
        match self.pins.get_mut(&extent.offset) {
            Some(pin) => pin.freed = Some(extent),
            None => self.alloc.free(extent),
        }
    }

    /// Frees a reserved (never published, never pinned) extent except the byte ranges in
    /// `keep` (offsets from the extent's start), which are returned as extents of their
    /// own, widened to whole granules, for [`Shard::release`] later: what a cut transfer
    /// still has in flight into it.
    pub fn release_except(&mut self, extent: Extent, keep: &[(u64, u64)]) -> Vec<Extent> {
        let mut kept: Vec<Extent> = Vec::new();
        let mut ranges: Vec<(u64, u64)> = keep
            .iter()
            .filter(|&&(_, len)| len > 0)
            .map(|&(at, len)| (at / GRANULE * GRANULE, ((at + len).div_ceil(GRANULE) * GRANULE).min(extent.len)))
            .collect();
        ranges.sort_unstable();
        for (start, end) in ranges {
            match kept.last_mut() {
                Some(last) if start <= last.offset + last.len => last.len = last.len.max(end - last.offset),
                _ => kept.push(Extent { offset: start, len: end - start }),
            }
        }
        let mut at = 0;
        for k in &mut kept {
            if k.offset > at {
                self.alloc.free(Extent { offset: extent.offset + at, len: k.offset - at });
            }
            at = k.offset + k.len;
            k.offset += extent.offset;
        }
        if at < extent.len {
            self.alloc.free(Extent { offset: extent.offset + at, len: extent.len - at });
        }
        kept
    }

    pub fn pin(&mut self, extent_offset: u64) {
        self.pins.entry(extent_offset).or_insert(Pin { sends: 0, freed: None }).sends += 1;
    }

    pub fn unpin(&mut self, extent_offset: u64) {
        let Some(pin) = self.pins.get_mut(&extent_offset) else { return };
        pin.sends -= 1;
        if pin.sends == 0 {
            if let Some(e) = self.pins.remove(&extent_offset).and_then(|p| p.freed) {
                self.alloc.free(e);
            }
        }
    }

    pub fn get(&mut self, key: &[u8], cond: &Condition, range: Option<ByteRange>) -> Result<GetOutcome> {
        self.counters.gets += 1;
        let Some(slot) = self.live_slot(key) else { return Ok(GetOutcome::Missing) };
        self.counters.hits += 1;
        if self.mode == Mode::Cache {
            self.index.touch(slot);
        }
        let e = self.index.entry(slot);
        let generation = e.generation;
        let matches =
            cond.if_not_equal.is_none_or(|g| g != generation) && cond.if_equal.is_none_or(|g| g == generation);
        if !matches {
            return Ok(GetOutcome::Unchanged { generation });
        }
        let size = e.value_len;
        let (start, end) = match range {
            None => (0, size),
            Some(r) => r.resolve(size)?,
        };
        Ok(GetOutcome::Value {
            generation,
            value_size: size,
            offset: e.value_offset() + start,
            len: end - start,
            extent: e.extent.offset,
        })
    }

    /// Deletes a key; `Ok(true)` if it existed.
    pub fn delete(&mut self, key: &[u8], cond: &Condition) -> Result<bool> {
        if !self.write_condition_holds(key, cond) {
            self.counters.condition_failed += 1;
            return Err(Error::new(Status::ConditionFailed, ""));
        }
        let existed = self.remove_key(key);
        self.counters.deletes += existed as u64;
        Ok(existed)
    }

    /// Deletes up to `limit` keys in `[min, max)` (a bounded slice of work for the worker
    /// thread); returns how many, and whether more remain.
    pub fn delete_range(&mut self, min: &[u8], max: Option<&[u8]>, limit: usize) -> (u64, bool) {
        let mut keys: Vec<Vec<u8>> = self.index.range(min, max).take(limit + 1).map(|(k, _)| k.to_vec()).collect();
        let more = keys.len() > limit;
        keys.truncate(limit);
        for k in &keys {
            self.remove_key(k);
        }
        self.counters.deletes += keys.len() as u64;
        (keys.len() as u64, more)
    }

    /// Looks at up to `limit` keys from `from` on and drops those `unwanted` says so
    /// (copies a cluster member no longer keeps: see `Service::drop_stale_copies_if_the_placement_moved`);
    /// how many it dropped, and the key to go on from (None: it looked at the last).
    pub fn drop_keys(
        &mut self,
        from: &[u8],
        limit: usize,
        mut unwanted: impl FnMut(&[u8]) -> bool,
    ) -> (u64, Option<Vec<u8>>) {
        let (mut keys, mut rest) = (Vec::new(), None);
        for (i, (k, _)) in self.index.range(from, None).enumerate() {
            if i == limit.max(1) {
                rest = Some(k.to_vec());
                break;
            }
            if unwanted(k) {
                keys.push(k.to_vec());
            }
        }
        for k in &keys {
            self.remove_key(k);
        }
        (keys.len() as u64, rest)
    }

    /// Drops `key` (a copy a cluster member no longer keeps); whether it was here.
    pub fn drop_key(&mut self, key: &[u8]) -> bool {
        self.remove_key(key)
    }

    /// Live keys in `[min, max)` with value sizes, up to `limit` of them and `max_bytes` of
    /// key bytes (at least one); `true` if more remain.
    pub fn list(
        &mut self,
        min: &[u8],
        max: Option<&[u8]>,
        limit: usize,
        max_bytes: usize,
        out: &mut Vec<(Vec<u8>, u64)>,
    ) -> bool {
        let now = self.now();
        let mut bytes = 0;
        for (k, slot) in self.index.range(min, max) {
            let e = self.index.entry(slot);
            if e.expires_at != 0 && e.expires_at <= now {
                continue;
            }
            if out.len() == limit || (!out.is_empty() && bytes + k.len() > max_bytes) {
                return true;
            }
            bytes += k.len();
            out.push((k.to_vec(), e.value_len));
        }
        false
    }

    /// Drops up to `max` entries whose TTL has passed (and forgets the deletes remembered
    /// past their hold); returns how many entries.
    pub fn expire_due(&mut self, max: usize) -> usize {
        let now = self.now();
        self.tombstones.forget_expired(now);
        let mut n = 0;
        while n < max {
            let Some(slot) = self.index.first_expired(now) else { break };
            let e = self.index.entry(slot);
            let key = self.arena.slice(e.extent.offset, e.key_len as u64).to_vec();
            self.remove_key(&key);
            self.counters.expirations += 1;
            n += 1;
        }
        n
    }

    fn remove_key(&mut self, key: &[u8]) -> bool {
        match self.index.remove(key) {
            Some(old) => {
                self.release(old.extent);
                true
            }
            None => false,
        }
    }

    pub fn stats(&self) -> ShardStats {
        let capacity = self.alloc.capacity();
        ShardStats {
            keys: self.index.len(),
            capacity_bytes: capacity,
            used_bytes: capacity - self.alloc.free_bytes(),
            free_bytes: self.alloc.free_bytes(),
            largest_free_bytes: self.alloc.largest_free(),
            fragmentation: self.alloc.fragmentation(),
            backing: self.arena.backing(),
            mode: self.mode,
            pinned_extents: self.pins.len(),
            index_bytes: self.index.bytes(),
            index_budget_bytes: self.index_budget,
            remembered_deletes: self.tombstones.len(),
            counters: self.counters.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
