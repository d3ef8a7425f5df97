//! `exp` for f32 without a libm call: range reduction `x = n ln2 + r` (ln2 in two parts,
//! Cody-Waite), a degree-6 polynomial for `e^r` on `|r| <= ln2/2`, and `2^n` built in the
//! exponent bits. Branch-free, so the slice loops vectorize; plain `*` and `+` (Rust never
//! contracts them into FMA), so the result is the same bits on every x86-64 CPU, whatever
//! width the loop was vectorized to. Relative error below 2 ulp over the normal range;
//! `exp(x) = 0` below -87.3 (where the true value is subnormal), `+inf` above 88.72, NaN
//! stays NaN, `exp(-inf) = 0`.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n * LN2_HI` is exact for |n| < 2^9.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
const ROUND: f32 = 12_582_912.0;
const HI: f32 = 88.722_83;
const LO: f32 = -87.336_55;

/// `e^x` (see the module doc).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(LO, HI);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Taylor/minimax coefficients of e^r on [-ln2/2, ln2/2] (Cephes expf).
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let er = p * r * r + r + 1.0;
    // n in [-126, 128]: 2^n as 2^a * 2^b with a, b in [-63, 64], both normal; scaling by
    // a power of two is exact, so only the last product rounds.
    let ni = n as i32;
    let a = ni >> 1;
    let b = ni - a;
    let pa = f32::from_bits(((a + 127) as u32) << 23);
    let pb = f32::from_bits(((b + 127) as u32) << 23);
    let y = er * pa * pb;
    let y = if x < LO { 0.0 } else { y };
    let y = if x > HI { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `x[i] = exp(x[i] - shift)` for every element; returns their sum, added in index order
/// (so it does not depend on the vector width).
pub fn exp_sub_sum(x: &mut [f32], shift: f32) -> f32 {
    exp_sub(x, shift);
    x.iter().sum()
}

/// `x[i] = exp(x[i] - shift)`.
pub fn exp_sub(x: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { exp_sub_avx2(x, shift) };
        return;
    }
    exp_sub_generic(x, shift);
}

#[inline(always)]
fn exp_sub_generic(x: &mut [f32], shift: f32) {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
}

/// The same loop compiled for 8 lanes; no FMA is enabled, so the bits are the generic
/// loop's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_sub_avx2(x: &mut [f32], shift: f32) {
    exp_sub_generic(x, shift);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_libm_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            let rel = ((got - want) / want).abs();
            worst = worst.max(rel);
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(88.7).is_finite());
        assert!((exp(1.0) - std::f32::consts::E).abs() <= f32::EPSILON * 3.0);
    }

    #[test]
    fn slice_form_is_the_scalar_bits() {
        let mut g = crate::rng::Rng::new(7);
        let v: Vec<f32> = (0..1003).map(|_| g.sym(60.0)).collect();
        let mut s = v.clone();
        let sum = exp_sub_sum(&mut s, 1.5);
        for (a, b) in s.iter().zip(&v) {
            assert_eq!(a.to_bits(), exp(b - 1.5).to_bits());
        }
        assert_eq!(sum, s.iter().sum::<f32>());
    }
}
