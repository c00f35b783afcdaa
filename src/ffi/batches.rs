//! C ABI: batches (`rdram_mput`, `rdram_mget`), many requests in flight behind one wait.

use super::client::{rdram_client, with_client};
use super::{args, guard, rdram_status};
use crate::client::{GetInto, GetOptions, PutOptions, WriteResult};
use crate::error::{Error, Status};

use crate::client::tunables::BATCH_DEPTH;
use rdram_status::*;

/// One item of `rdram_mput`. The caller fills key and value; the library fills
/// `status` and, on success, `generation`.
#[repr(C)]
pub struct rdram_put_item {
    pub key: *const u8,
    pub key_len: usize,
    pub value: *const u8,
    pub value_len: usize,
    pub generation: u64,
    pub status: rdram_status,
}

/// One item of `rdram_mget`. The caller fills key and buffer; the library fills
/// `status`, `value_len` (bytes written, or the size needed on RDRAM_BUFFER_TOO_SMALL)
/// and `generation`.
#[repr(C)]
pub struct rdram_get_item {
    pub key: *const u8,
    pub key_len: usize,
    pub buf: *mut u8,
    pub buf_len: usize,
    pub value_len: usize,
    pub generation: u64,
    pub status: rdram_status,
}

/// Stores `n` values with many requests in flight behind one wait. Each item's `status`
/// and `generation` are filled in. Returns RDRAM_OK if every item succeeded, else the
/// status of the first item that failed (see each item's status).
/// Keys in batches are limited to 1 KiB.
/// Items in CUDA device memory are staged through host memory one at a time.
#[no_mangle]
pub unsafe extern "C" fn rdram_mput(client: *mut rdram_client, items: *mut rdram_put_item, n: usize) -> rdram_status {
    // SAFETY: `items` points to `n` items, each with a key and a value readable for their lengths, for the
    // call (the header's contract).
    let lent = unsafe {
        args::items(items, n).map(|items| {
            let each: Vec<_> = items
                .iter()
                .map(|it| (args::key(it.key, it.key_len), args::Source::new(it.value, it.value_len, "item.value")))
                .collect();
            (items, each)
        })
    };
    guard(|| {
        let (items, lent) = lent?;
        // Every item gets a status on every path: an item with a bad argument its own
        // error, and the rest are sent.
        let sent = with_client(client, |c| {
            let mut batch = Vec::with_capacity(n);
            let mut results: Vec<Option<crate::Result<u64>>> = Vec::with_capacity(n);
            for (key, value) in lent {
                let (key, value) = match (key, value) {
                    (Ok(key), Ok(value)) => (key, value),
                    (Err(e), _) | (_, Err(e)) => {
                        results.push(Some(Err(e)));
                        continue;
                    }
                };
                match value.host_bytes() {
                    Some(bytes) => {
                        batch.push((key, bytes));
                        results.push(None);
                    }
                    // Device memory, staged through host memory on its own by the client.
                    None => results.push(Some(value.put(c, key, &PutOptions::default()).and_then(|w| match w {
                        WriteResult::Written { generation } => Ok(generation),
                        WriteResult::ConditionFailed => {
                            Err(Error::new(Status::Internal, "unconditional put reported a failed condition"))
                        }
                    }))),
                }
            }
            let results = merge_results(results, c.put_many(&batch, BATCH_DEPTH));
            Ok(fill(items, results, |it, g| it.generation = g, |it, s| it.status = s))
        });
        Ok(sent.unwrap_or_else(|e| fail_all(items, &e, |it, s| it.status = s)))
    })
}

/// Reads `n` values into the items' buffers with many requests in flight behind one wait.
/// Each item's `status`, `value_len` and `generation` are filled in (RDRAM_MISSING and
/// RDRAM_BUFFER_TOO_SMALL per item as for `rdram_get`). Returns RDRAM_OK if every item
/// got an answer (whatever it was), else the first other error (see each item's status).
/// Items in CUDA device memory are staged into it one at a time. A buffer that overlaps
/// another item's buffer, or any item's key (its own too), is refused
/// (RDRAM_INVALID_ARGUMENT for every item; nothing is read): values land while later
/// items' keys are still being read.
#[no_mangle]
pub unsafe extern "C" fn rdram_mget(client: *mut rdram_client, items: *mut rdram_get_item, n: usize) -> rdram_status {
    // SAFETY: `items` points to `n` items, each with a key readable and a buffer writable for their lengths,
    // for the call (the header's contract); no buffer overlaps a key or another buffer (checked below, before
    // any buffer is used).
    let lent = unsafe {
        args::items(items, n).map(|items| {
            let each: Vec<_> = items
                .iter()
                .map(|it| (args::key(it.key, it.key_len), args::Sink::new(it.buf, it.buf_len, "item.buf")))
                .collect();
            (items, each)
        })
    };
    guard(|| {
        let (items, lent) = lent?;
        if let Some((a, b, what)) = overlapping_buffers(items) {
            let why = match a == b {
                true => format!("item {a}'s buffer overlaps its key"),
                false => format!("items {a} and {b} have overlapping {what}"),
            };
            let e = Error::new(Status::Invalid, why);
            return Ok(fail_all(items, &e, |it, s| it.status = s));
        }
        let sent = with_client(client, |c| {
            let mut keys = Vec::with_capacity(n);
            let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(n);
            let mut results: Vec<Option<crate::Result<GetInto>>> = Vec::with_capacity(n);
            for (key, buf) in lent {
                let (key, buf) = match (key, buf) {
                    (Ok(key), Ok(buf)) => (key, buf),
                    (Err(e), _) | (_, Err(e)) => {
                        results.push(Some(Err(e)));
                        continue;
                    }
                };
                match buf.into_host() {
                    Ok(bytes) => {
                        keys.push(key);
                        bufs.push(bytes);
                        results.push(None);
                    }
                    // Staged into device memory on its own, by the client.
                    Err(mut device) => results.push(Some(device.get_into(c, key, &GetOptions::default()))),
                }
            }
            let results = merge_results(results, c.get_many_into(&keys, &mut bufs, BATCH_DEPTH));
            let mut first_error = RDRAM_OK;
            for (it, r) in items.iter_mut().zip(results) {
                it.status = match r {
                    Ok(GetInto::Value { len, generation, .. }) => {
                        it.value_len = len;
                        it.generation = generation;
                        RDRAM_OK
                    }
                    Ok(GetInto::TooSmall { needed }) => {
                        it.value_len = needed;
                        RDRAM_BUFFER_TOO_SMALL
                    }
                    Ok(GetInto::Missing) => RDRAM_MISSING,
                    Ok(GetInto::Unchanged { generation }) => {
                        it.generation = generation;
                        RDRAM_UNCHANGED
                    }
                    Err(e) => {
                        super::set_last_error(&e.to_string());
                        e.status.into()
                    }
                };
                if (it.status as i32) < 0 && it.status != RDRAM_BUFFER_TOO_SMALL && first_error == RDRAM_OK {
                    first_error = it.status;
                }
            }
            Ok(first_error)
        });
        Ok(sent.unwrap_or_else(|e| fail_all(items, &e, |it, s| it.status = s)))
    })
}

/// Two items (lower index first) where one's buffer overlaps the other's buffer or key
/// (an item's own key included), if any: the values of one batch land while keys are
/// still read, so no byte may be both written and read, or written twice. Keys may
/// overlap each other.
fn overlapping_buffers(items: &[rdram_get_item]) -> Option<(usize, usize, &'static str)> {
    // (start, end, item, is a buffer), by start.
    let mut spans: Vec<(usize, usize, usize, bool)> = Vec::with_capacity(2 * items.len());
    for (i, it) in items.iter().enumerate() {
        if it.buf_len > 0 && !it.buf.is_null() {
            spans.push((it.buf as usize, (it.buf as usize).saturating_add(it.buf_len), i, true));
        }
        if it.key_len > 0 && !it.key.is_null() {
            spans.push((it.key as usize, (it.key as usize).saturating_add(it.key_len), i, false));
        }
    }
    spans.sort_unstable();
    // The furthest-reaching buffer, and span of any kind, seen so far: (end, item, is a buffer).
    type Reach = Option<(usize, usize, bool)>;
    let (mut buffer_end, mut any_end): (Reach, Reach) = (None, None);
    for &(start, end, i, is_buffer) in &spans {
        let reach = if is_buffer { any_end } else { buffer_end };
        let clash = reach.filter(|&(e, _, _)| e > start).map(|(_, j, buf)| (j, buf));
        if let Some((j, other_is_buffer)) = clash {
            let what = if is_buffer && other_is_buffer { "buffers" } else { "a buffer and a key" };
            return Some((i.min(j), i.max(j), what));
        }
        if is_buffer && buffer_end.is_none_or(|(e, _, _)| end > e) {
            buffer_end = Some((end, i, true));
        }
        if any_end.is_none_or(|(e, _, _)| end > e) {
            any_end = Some((end, i, is_buffer));
        }
    }
    None
}

/// A batch's results in item order: the items refused before sending (`Some`) and, in
/// the gaps, the answers to those sent, in the order they were sent.
fn merge_results<R>(refused: Vec<Option<crate::Result<R>>>, sent: Vec<crate::Result<R>>) -> Vec<crate::Result<R>> {
    let mut sent = sent.into_iter();
    refused.into_iter().map(|r| r.unwrap_or_else(|| sent.next().expect("one answer per item sent"))).collect()
}

/// Gives every item the same error (the call itself could not run).
fn fail_all<T>(items: &mut [T], e: &Error, status: impl Fn(&mut T, rdram_status)) -> rdram_status {
    super::set_last_error(&e.to_string());
    for it in items.iter_mut() {
        status(it, e.status.into());
    }
    e.status.into()
}

fn fill<T>(
    items: &mut [T],
    results: Vec<crate::Result<u64>>,
    ok: impl Fn(&mut T, u64),
    status: impl Fn(&mut T, rdram_status),
) -> rdram_status {
    let mut first_error = RDRAM_OK;
    for (it, r) in items.iter_mut().zip(results) {
        let s = match r {
            Ok(g) => {
                ok(it, g);
                RDRAM_OK
            }
            Err(e) => {
                super::set_last_error(&e.to_string());
                e.status.into()
            }
        };
        status(it, s);
        if (s as i32) < 0 && first_error == RDRAM_OK {
            first_error = s;
        }
    }
    first_error
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item whose key and buffer are `(offset, len)` spans of one region (only the
    /// pointers matter: nothing is read or written).
    fn item(base: *mut u8, key: (usize, usize), buf: (usize, usize)) -> rdram_get_item {
        rdram_get_item {
            key: base.wrapping_add(key.0),
            key_len: key.1,
            buf: base.wrapping_add(buf.0),
            buf_len: buf.1,
            value_len: 0,
            generation: 0,
            status: RDRAM_OK,
        }
    }

    #[test]
    fn buffers_may_overlap_no_buffer_and_no_key() {
        let mut mem = [0u8; 512];
        let m = mem.as_mut_ptr();
        // Apart: buffers disjoint, keys elsewhere (keys overlapping each other are fine).
        let apart = [item(m, (400, 4), (0, 64)), item(m, (402, 4), (64, 64)), item(m, (400, 2), (128, 64))];
        assert_eq!(overlapping_buffers(&apart), None);
        // Two buffers sharing a byte.
        let two = [item(m, (400, 2), (0, 65)), item(m, (402, 2), (64, 64)), item(m, (404, 2), (200, 8))];
        assert_eq!(overlapping_buffers(&two), Some((0, 1, "buffers")));
        // A buffer over a later item's key, the key not next to it in address order.
        let key_in_buffer = [item(m, (400, 2), (0, 100)), item(m, (402, 2), (100, 8)), item(m, (50, 4), (200, 8))];
        assert_eq!(overlapping_buffers(&key_in_buffer), Some((0, 2, "a buffer and a key")));
        // A key that starts before a buffer and runs into it.
        let key_into_buffer = [item(m, (0, 20), (150, 8)), item(m, (400, 2), (10, 20))];
        assert_eq!(overlapping_buffers(&key_into_buffer), Some((0, 1, "a buffer and a key")));
        // An item's buffer over its own key.
        let own = [item(m, (10, 4), (0, 64))];
        assert_eq!(overlapping_buffers(&own), Some((0, 0, "a buffer and a key")));
    }
}
