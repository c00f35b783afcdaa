//! What C holds of the library, kept in tables: open clients and running servers by serial
//! number, and buffers the library allocated by address. C is never handed anything that
//! is later dereferenced unchecked, so a closed, stale, doubled or invented handle or
//! buffer is refused or ignored instead of crashing the process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Objects C holds by serial number (never 0, never reused). A read lock per lookup:
/// threads using objects of their own never wait for each other.
pub(super) struct Handles<T> {
    table: RwLock<Option<HashMap<usize, Arc<T>>>>,
    next: AtomicUsize,
}

impl<T> Handles<T> {
    pub(super) const fn new() -> Handles<T> {
        Handles { table: RwLock::new(None), next: AtomicUsize::new(1) }
    }

    /// Takes `value` in; returns its handle.
    pub(super) fn insert(&self, value: T) -> usize {
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
        table.get_or_insert_with(HashMap::new).insert(handle, Arc::new(value));
        handle
    }

    /// The object behind `handle`, if it is in the table.
    pub(super) fn get(&self, handle: usize) -> Option<Arc<T>> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).as_ref()?.get(&handle).cloned()
    }

    /// Takes the object behind `handle` out: a second removal, here or on another thread,
    /// finds nothing. It is freed once the last call using it lets go.
    pub(super) fn remove(&self, handle: usize) -> Option<Arc<T>> {
        self.table.write().unwrap_or_else(|e| e.into_inner()).as_mut()?.remove(&handle)
    }
}

/// Byte buffers the library allocated and handed to C (`rdram_get_alloc`), by address,
/// with their lengths: each is freed once, with the length it was allocated with, whatever
/// C passes back. Unlike a handle, an address can come back: a stale free of one that the
/// allocator has since reused for another buffer handed out frees that one.
static BUFFERS: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);

/// Hands `data` to C: the returned pointer is C's until [`free_buffer`] takes it back.
pub(super) fn hand_out_buffer(data: Vec<u8>) -> (*mut u8, usize) {
    let data = Box::into_raw(data.into_boxed_slice());
    let (ptr, len) = (data as *mut u8, data.len());
    BUFFERS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(ptr as usize, len);
    (ptr, len)
}

/// Frees a buffer [`hand_out_buffer`] handed out; false (and nothing freed) for any other
/// pointer, one freed already included.
pub(super) fn free_buffer(ptr: *mut u8) -> bool {
    let len = BUFFERS.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&(ptr as usize)));
    let Some(len) = len else { return false };
    // SAFETY: `ptr` and `len` are those of a boxed slice `hand_out_buffer` leaked, and
    // this is the one removal of its entry, so it is freed once.
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_is_found_until_removed_and_removed_once() {
        let handles: Handles<String> = Handles::new();
        let a = handles.insert("a".into());
        let b = handles.insert("b".into());
        assert!(a != 0 && b != a);
        assert_eq!(handles.get(a).as_deref().map(String::as_str), Some("a"));
        let held = handles.get(b).unwrap();
        assert_eq!(handles.remove(b).as_deref().map(String::as_str), Some("b"));
        assert!(handles.remove(b).is_none(), "removed twice");
        assert!(handles.get(b).is_none(), "found after removal");
        assert_eq!(*held, "b", "a call holding it keeps it alive");
        assert!(handles.get(12345).is_none(), "an invented handle");
    }

    #[test]
    fn a_buffer_is_freed_once_and_only_if_handed_out() {
        let (ptr, len) = hand_out_buffer(vec![7u8; 100]);
        assert_eq!(len, 100);
        // SAFETY: the buffer is ours until freed below.
        assert_eq!(unsafe { *ptr.add(99) }, 7);
        assert!(free_buffer(ptr));
        assert!(!free_buffer(ptr), "freed twice");
        let mut own = [0u8; 4];
        assert!(!free_buffer(own.as_mut_ptr()), "a buffer the library never handed out");
        let (empty, len) = hand_out_buffer(Vec::new());
        assert_eq!(len, 0);
        assert!(!empty.is_null(), "never NULL, even for an empty value");
        assert!(free_buffer(empty));
    }
}
