//! Operations in flight on libfabric endpoints. Each operation has one [`OpContext`] per
//! part (a striped transfer has one part per rail), kept at a fixed address until
//! libfabric completes that part; the operation finishes when its last part does.

use super::{Completion, OpContext};
use crate::error::{Error, Result};

pub struct Finished<T> {
    pub value: T,
    /// Ok, or the first part's failure.
    pub result: Result<()>,
    /// Bytes moved (for a receive: the message length) and the matched tag.
    pub len: usize,
    pub tag: u64,
}

struct Slot<T> {
    /// Boxed: libfabric holds their addresses while parts are in flight. Kept when the
    /// slot is reused, so a steady state allocates nothing.
    #[allow(clippy::vec_box)]
    ctxs: Vec<Box<OpContext>>,
    left: usize,
    error: Option<Error>,
    len: usize,
    tag: u64,
    value: Option<T>,
}

/// What one completion did.
pub enum Progress<T> {
    /// Not one of ours (a stale or foreign completion).
    Nothing,
    /// Part `part` of operation `id` completed (`failed`: with an error); others remain.
    Part {
        id: u32,
        part: usize,
        failed: bool,
    },
    Finished(Finished<T>),
}

pub struct InFlight<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

const PART_BITS: u64 = 16;

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        InFlight { slots: Vec::new(), free: Vec::new() }
    }
}

impl<T> InFlight<T> {
    /// Reserves an operation of `parts` parts and returns its id; post part `p` with
    /// [`InFlight::ctx`]`(id, p)` as its context.
    pub fn start(&mut self, value: T, parts: usize) -> u32 {
        let id = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot { ctxs: Vec::new(), left: 0, error: None, len: 0, tag: 0, value: None });
            (self.slots.len() - 1) as u32
        });
        let slot = &mut self.slots[id as usize];
        while slot.ctxs.len() < parts {
            slot.ctxs.push(Box::default());
        }
        for (p, ctx) in slot.ctxs.iter_mut().enumerate().take(parts) {
            ctx.token = ((id as u64) << PART_BITS) | p as u64;
        }
        slot.left = parts;
        slot.error = None;
        slot.len = 0;
        slot.tag = 0;
        slot.value = Some(value);
        id
    }

    pub fn ctx(&mut self, id: u32, part: usize) -> *mut OpContext {
        &mut *self.slots[id as usize].ctxs[part]
    }

    pub fn value_mut(&mut self, id: u32) -> Option<&mut T> {
        self.slots.get_mut(id as usize).and_then(|s| s.value.as_mut())
    }

    /// The operations in flight.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }

    /// Forgets every operation in flight and returns them: for endpoints that are never
    /// progressed again (their completions would name slots reused since).
    pub fn drain(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        for (id, slot) in self.slots.iter_mut().enumerate() {
            if let Some(value) = slot.value.take() {
                slot.left = 0;
                self.free.push(id as u32);
                out.push(value);
            }
        }
        out
    }

    /// Parts that will never complete because they could not be posted.
    pub fn not_posted(&mut self, id: u32, parts: usize, error: Error) -> Option<Finished<T>> {
        let slot = &mut self.slots[id as usize];
        slot.error.get_or_insert(error);
        slot.left -= parts;
        self.finish_if_done(id)
    }

    /// Accounts one completion; returns the operation when that was its last part.
    pub fn complete(&mut self, c: Completion) -> Option<Finished<T>> {
        match self.progress(c) {
            Progress::Finished(f) => Some(f),
            _ => None,
        }
    }

    /// Accounts one completion and says what it did.
    pub fn progress(&mut self, c: Completion) -> Progress<T> {
        let (token, outcome) = match c {
            Completion::Done { token, len, tag } => (token, Ok((len, tag))),
            Completion::Failed { token, error } => (token, Err(error)),
        };
        let id = (token >> PART_BITS) as u32;
        let Some(slot) = self.slots.get_mut(id as usize) else { return Progress::Nothing };
        if slot.value.is_none() || slot.left == 0 {
            return Progress::Nothing;
        }
        let failed = outcome.is_err();
        match outcome {
            Ok((len, tag)) => {
                slot.len += len;
                slot.tag = tag;
            }
            Err(e) => {
                slot.error.get_or_insert(e);
            }
        }
        slot.left -= 1;
        let part = (token & ((1 << PART_BITS) - 1)) as usize;
        self.finish_if_done(id).map_or(Progress::Part { id, part, failed }, Progress::Finished)
    }

    fn finish_if_done(&mut self, id: u32) -> Option<Finished<T>> {
        let slot = &mut self.slots[id as usize];
        if slot.left > 0 {
            return None;
        }
        let value = slot.value.take()?;
        self.free.push(id);
        Some(Finished { value, result: slot.error.take().map_or(Ok(()), Err), len: slot.len, tag: slot.tag })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    #[test]
    fn an_operation_finishes_with_its_last_part_and_keeps_the_first_error() {
        let mut ops = InFlight::default();
        let id = ops.start("striped", 3);
        let tokens: Vec<u64> = (0..3).map(|p| unsafe { (*ops.ctx(id, p)).token }).collect();
        assert!(ops.complete(Completion::Done { token: tokens[0], len: 10, tag: 7 }).is_none());
        let err = Error::new(Status::Transport, "rail 1 failed");
        assert!(ops.complete(Completion::Failed { token: tokens[1], error: err }).is_none());
        let f = ops.complete(Completion::Done { token: tokens[2], len: 5, tag: 7 }).expect("last part");
        assert_eq!((f.value, f.len, f.tag), ("striped", 15, 7));
        assert_eq!(f.result.unwrap_err().message, "rail 1 failed");
        // The slot is reused; a stale completion for the old op finds nothing.
        let id2 = ops.start("next", 2);
        assert_eq!(id2, id);
        let f = ops.not_posted(id2, 2, Error::new(Status::Transport, "post failed")).expect("nothing in flight");
        assert!(f.result.is_err());
        assert!(ops.complete(Completion::Done { token: tokens[0], len: 1, tag: 0 }).is_none());
    }
}
