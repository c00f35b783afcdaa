//! What the command-line tools (`rdram`, `rdram-bench`, `rdram-gateway-load`) share: sizes
//! as people write them, and the engine's choices as clap offers them. The engine's own
//! modules know nothing of clap.

use clap::builder::PossibleValue;
use clap::ValueEnum;

use crate::store::{HugePages, Mode};
use crate::transport::PollMode;

/// Parses sizes like `1GiB`, `512MiB`, `64M`, `4096`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} overflows"))
}

impl ValueEnum for HugePages {
    fn value_variants<'a>() -> &'a [Self] {
        &[HugePages::Auto, HugePages::On, HugePages::Off]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            HugePages::Auto => PossibleValue::new("auto")
                .help("hugetlb pages if reserved, else transparent huge pages, else 4 KiB pages"),
            HugePages::On => PossibleValue::new("on").help("hugetlb 2 MiB pages or fail"),
            HugePages::Off => PossibleValue::new("off").help("4 KiB pages only"),
        })
    }
}

impl ValueEnum for Mode {
    fn value_variants<'a>() -> &'a [Self] {
        &[Mode::Store, Mode::Cache]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Mode::Store => PossibleValue::new("store").help("a full arena answers \"no space\""),
            Mode::Cache => PossibleValue::new("cache").help("a full arena evicts least-recently-used values"),
        })
    }
}

impl ValueEnum for PollMode {
    fn value_variants<'a>() -> &'a [Self] {
        &[PollMode::Busy, PollMode::Adaptive]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            PollMode::Busy => {
                PossibleValue::new("busy").help("spin on progress forever: lowest latency, one core per poller")
            }
            PollMode::Adaptive => {
                PossibleValue::new("adaptive").help("spin for a bounded time, then sleep on the transport's event fd")
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1XB").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn choices_parse_by_their_names() {
        assert_eq!(HugePages::from_str("try", true).ok(), None);
        assert_eq!(HugePages::from_str("auto", true), Ok(HugePages::Auto));
        assert_eq!(Mode::from_str("cache", true), Ok(Mode::Cache));
        assert_eq!(PollMode::from_str("busy", true), Ok(PollMode::Busy));
    }
}
