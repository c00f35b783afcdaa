//! What each bench thread does next: which key, which op, and (open loop) when.

use std::time::Duration;

use quanta::Instant;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
pub enum KeyDistribution {
    Uniform,
    Zipf,
}

/// Picks key indices in `0..n`.
pub struct KeyChooser {
    rng: SmallRng,
    n: usize,
    zipf: Option<Zipf<f64>>,
}

impl KeyChooser {
    pub fn new(n: usize, dist: KeyDistribution, exponent: f64, seed: u64) -> Self {
        let zipf = (dist == KeyDistribution::Zipf)
            .then(|| Zipf::new(n as u64, exponent).unwrap_or_else(|e| panic!("zipf exponent {exponent}: {e}")));
        KeyChooser { rng: SmallRng::seed_from_u64(seed), n, zipf }
    }

    pub fn next(&mut self) -> usize {
        match &self.zipf {
            // Zipf yields ranks 1..=n; rank 1 is the hottest key.
            Some(z) => (z.sample(&mut self.rng) as usize).clamp(1, self.n) - 1,
            None => self.rng.gen_range(0..self.n),
        }
    }

    /// True with probability `p` (the op mix).
    pub fn chance(&mut self, p: f64) -> bool {
        self.rng.gen_bool(p.clamp(0.0, 1.0))
    }
}

/// Open-loop schedule: request i is due at `start + i * interval`, whether or not earlier
/// requests were slow. Latency is measured from the due time, so a stall is charged to
/// every request it delayed (the coordinated-omission correction).
pub struct Pacer {
    start: Instant,
    interval: Duration,
    issued: u64,
    spin: bool,
}

impl Pacer {
    pub fn new(start: Instant, rate_per_s: f64, spin: bool) -> Self {
        Pacer { start, interval: Duration::from_secs_f64(1.0 / rate_per_s), issued: 0, spin }
    }

    /// Waits until the next request is due and returns its due time.
    pub fn next_due(&mut self) -> Instant {
        let due = self.start + self.interval.mul_f64(self.issued as f64);
        self.issued += 1;
        loop {
            let now = Instant::now();
            if now >= due {
                return due;
            }
            // Sleeping costs a ~60 µs wake-up here: only sleep when it is further away
            // than that, and never in busy mode.
            let left = due - now;
            if !self.spin && left > Duration::from_micros(200) {
                std::thread::sleep(left - Duration::from_micros(100));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let mut z = KeyChooser::new(100, KeyDistribution::Zipf, 1.1, 7);
        let mut counts = [0u32; 100];
        for _ in 0..20_000 {
            counts[z.next()] += 1;
        }
        assert!(counts[0] > counts[50] * 10, "{:?}", &counts[..5]);
        let mut u = KeyChooser::new(100, KeyDistribution::Uniform, 0.0, 7);
        assert!((0..1000).map(|_| u.next()).all(|k| k < 100));
    }
}
