//! A tiny deterministic generator (SplitMix64): weights and synthetic data come from
//! `(seed, name)` so every layout draws the same numbers.

/// SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// A generator keyed by a seed and a name (FNV-1a of the name mixed into the seed).
    pub fn keyed(seed: u64, name: &str) -> Rng {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Rng::new(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ h)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f64) -> f32 {
        ((2.0 * self.uniform() - 1.0) * a) as f32
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn vec(&mut self, n: usize, a: f64) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}
