//! Token checks shared by the servers' bootstrap and the gateway.

/// Compares without an early exit, so the time taken tells nothing about where the
/// first difference is, nor about the expected length.
pub fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = (given.len() ^ expected.len()) as u64;
    for (i, &e) in expected.iter().enumerate() {
        diff |= (e ^ given.get(i).copied().unwrap_or(!e)) as u64;
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison_needs_the_same_bytes_and_length() {
        use super::constant_time_eq as eq;
        assert!(eq(b"secret", b"secret"));
        assert!(!eq(b"secre", b"secret"));
        assert!(!eq(b"secretX", b"secret"));
        assert!(!eq(b"", b"secret"));
        assert!(!eq(b"secreT", b"secret"));
    }
}
