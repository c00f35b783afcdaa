//! Byte ranges of a value, as requests carry them (TensorStore's rules).

use crate::error::{Error, Result, Status};

/// A byte range of a value: `[start, end)`, where a negative `start` counts from the end
/// and `end` -1 means the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub start: i64,
    pub end: i64,
}

impl ByteRange {
    /// The range's `[start, end)` in a value of `size` bytes; a range outside the value
    /// is an error.
    pub fn resolve(self, size: u64) -> Result<(u64, u64)> {
        let size_i = size as i64;
        let start = if self.start < 0 { self.start + size_i } else { self.start };
        let end = if self.end == -1 { size_i } else { self.end };
        if start < 0 || end < 0 || end > size_i || start > end {
            return Err(Error::new(
                Status::OutOfRange,
                format!("byte range [{}, {}) of a {size}-byte value", self.start, self.end),
            ));
        }
        Ok((start as u64, end as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_tensorstore() {
        let r = |start, end| ByteRange { start, end }.resolve(10);
        assert_eq!(r(0, -1).unwrap(), (0, 10));
        assert_eq!(r(-3, -1).unwrap(), (7, 10));
        assert_eq!(r(2, 5).unwrap(), (2, 5));
        assert_eq!(r(10, 10).unwrap(), (10, 10));
        for (start, end) in [(-11, -1), (0, 11), (6, 5)] {
            assert_eq!(r(start, end).unwrap_err().status, Status::OutOfRange);
        }
    }
}
