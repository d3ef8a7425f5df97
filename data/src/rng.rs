//! SplitMix64: the seeded generator behind the epoch shuffles and the MinHash permutations.

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, full period, good enough to drive a
/// Fisher-Yates shuffle. Written here so the sample order depends on nothing outside this
/// crate.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform in `0..n` (`n > 0`), by Lemire's multiply-shift with rejection (unbiased).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let threshold = n.wrapping_neg() % n;
        loop {
            let x = self.next_u64();
            let m = (x as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// The SplitMix64 output function: a bijective 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The permutation of `0..n` for `(seed, epoch)`: Fisher-Yates driven by SplitMix64 seeded
/// with `mix64(seed) ^ mix64(epoch + 1)` (so every epoch of every seed has its own order).
pub fn permutation(seed: u64, epoch: u64, n: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..n).collect();
    let mut rng = SplitMix64::new(mix64(seed) ^ mix64(epoch.wrapping_add(1)));
    for i in (1..n).rev() {
        let j = rng.below(i + 1);
        p.swap(i as usize, j as usize);
    }
    p
}
