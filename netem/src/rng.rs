//! The seeded generator every decision is drawn from.

use kvpipe_core::Duration;

/// A SplitMix64 generator: small, fast and reproducible (the same seed gives the same sequence
/// on every platform). Every choice a [`Netem`](crate::Netem) makes is drawn from one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SeededRng { state: seed }
    }

    /// An independent generator derived from this one's seed and `stream` (for sub-systems that
    /// must not shift each other's sequences).
    pub fn fork(&self, stream: u64) -> Self {
        let mut r = SeededRng::new(self.state ^ stream.wrapping_mul(0xa076_1d64_78bd_642f));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`0` when `n == 0`, without drawing).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift: unbiased enough for emulation, no division.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A value in `lo..=hi` (`lo` when `hi <= lo`, without drawing).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.below(hi - lo + 1)
    }

    /// `true` with probability `p`; `p <= 0` and `p >= 1` decide without drawing.
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// A uniformly chosen element of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.below(items.len() as u64) as usize)
    }

    /// A duration in `lo..=hi` (`lo` when `hi <= lo`, without drawing).
    pub(crate) fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_nanos(self.range(lo.as_nanos(), hi.as_nanos()))
    }
}
