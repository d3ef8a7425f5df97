//! A tiny deterministic generator (SplitMix64): weights and synthetic data come from
//! `(seed, name)` so every layout draws the same numbers.

/// SplitMix64's finaliser (Steele, Lea and Flood 2014; the constants of Java's
/// `SplittableRandom`): a bijection of u64.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

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
        mix64(self.0)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::weights_hash;

    /// SplitMix64's published sequence for seed 0 (Vigna's reference `splitmix64.c`):
    /// 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F.
    #[test]
    fn splitmix64_reference_outputs() {
        let mut s = 0u64;
        let mut next = || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            mix64(s)
        };
        assert_eq!(next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(next(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(next(), 0x06C4_5D18_8009_454F);
    }

    /// The weights' hash by hand: zeros have bits 0, so element i contributes
    /// mix64(i * golden), SplitMix64's i-th output for seed 0; and mix64(0) = 0.
    #[test]
    fn weights_hash_by_hand() {
        assert_eq!(weights_hash(&[]), 0);
        assert_eq!(weights_hash(&[0.0]), 0);
        assert_eq!(weights_hash(&[0.0, 0.0]), 0xE220_A839_7B1D_CDAF);
        assert_eq!(
            weights_hash(&[0.0, 0.0, 0.0]),
            0xE220_A839_7B1D_CDAFu64.wrapping_add(0x6E78_9E6A_A1B9_65F4)
        );
        // Position matters (the same values swapped), and so does every bit.
        let x = [1.5f32, -2.25, 3.0];
        assert_ne!(weights_hash(&x), weights_hash(&[-2.25, 1.5, 3.0]));
        for b in 0..32 {
            let mut y = x;
            y[1] = f32::from_bits(y[1].to_bits() ^ (1 << b));
            assert_ne!(weights_hash(&y), weights_hash(&x), "bit {b}");
        }
    }
}
