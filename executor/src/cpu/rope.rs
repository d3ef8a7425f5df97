//! Rotary embedding with its cos/sin tables computed once per `(head_dim, theta)` for the
//! process (grown when a larger position comes) instead of on every call. The angles are the
//! reference's (`pos * theta^(-2i/d)` in f64, rounded to f32), so the result is the same
//! bits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// cos and sin of every position below `len` and every pair `i < d/2`: `cos[p * half + i]`.
pub struct Table {
    len: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Table {
    fn new(len: usize, d: usize, theta: f32) -> Table {
        let half = d / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| (theta as f64).powf(-(2.0 * i as f64) / d as f64))
            .collect();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for p in 0..len {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Table { len, cos, sin }
    }
}

/// The table for `(d, theta)` covering positions `0..=max_pos`, shared by every caller.
pub fn table(d: usize, theta: f32, max_pos: usize) -> Arc<Table> {
    type Cache = Mutex<HashMap<(usize, u32), Arc<Table>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    let e = c
        .entry((d, theta.to_bits()))
        .or_insert_with(|| Arc::new(Table::new(0, d, theta)));
    if e.len <= max_pos {
        *e = Arc::new(Table::new(
            (max_pos + 1).next_power_of_two().max(64),
            d,
            theta,
        ));
    }
    Arc::clone(e)
}

/// Rotates `x: [t, heads, d]` in place (pairs `j, j + d/2`), token `i` at `pos[i]`;
/// `inverse` applies the transpose rotation (the gradient).
pub fn apply(x: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32, inverse: bool) {
    let half = d / 2;
    if half == 0 || pos.is_empty() {
        return;
    }
    let max = pos.iter().copied().max().unwrap_or(0) as usize;
    let tab = table(d, theta, max);
    for (i, &p) in pos.iter().enumerate() {
        let c = &tab.cos[p as usize * half..][..half];
        let s = &tab.sin[p as usize * half..][..half];
        for hd in 0..heads {
            let row = &mut x[(i * heads + hd) * d..][..d];
            let (lo, hi) = row.split_at_mut(half);
            let hi = &mut hi[..half];
            if inverse {
                for j in 0..half {
                    let (a, b) = (lo[j], hi[j]);
                    lo[j] = a * c[j] + b * s[j];
                    hi[j] = b * c[j] - a * s[j];
                }
            } else {
                for j in 0..half {
                    let (a, b) = (lo[j], hi[j]);
                    lo[j] = a * c[j] - b * s[j];
                    hi[j] = b * c[j] + a * s[j];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The per-call form this replaces: angles from scratch for every token.
    fn reference(x: &mut [f32], pos: &[u32], heads: usize, d: usize, theta: f32, inv: bool) {
        let half = d / 2;
        for (i, &p) in pos.iter().enumerate() {
            for hd in 0..heads {
                let base = (i * heads + hd) * d;
                for j in 0..half {
                    let f = (theta as f64).powf(-(2.0 * j as f64) / d as f64);
                    let a = p as f64 * f;
                    let (c, s) = (a.cos() as f32, a.sin() as f32);
                    let (u, v) = (x[base + j], x[base + j + half]);
                    if inv {
                        x[base + j] = u * c + v * s;
                        x[base + j + half] = v * c - u * s;
                    } else {
                        x[base + j] = u * c - v * s;
                        x[base + j + half] = v * c + u * s;
                    }
                }
            }
        }
    }

    #[test]
    fn cached_tables_give_the_reference_bits_and_grow() {
        let mut g = Rng::new(5);
        for &(t, heads, d, maxp) in &[(10, 3, 8, 10u32), (7, 2, 16, 1000), (33, 1, 4, 70)] {
            let pos: Vec<u32> = (0..t).map(|_| g.below(maxp as u64) as u32).collect();
            let x = g.vec(t * heads * d, 1.0);
            for inv in [false, true] {
                let mut a = x.clone();
                let mut b = x.clone();
                apply(&mut a, &pos, heads, d, 10000.0, inv);
                reference(&mut b, &pos, heads, d, 10000.0, inv);
                assert!(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()));
            }
        }
        assert!(table(16, 10000.0, 999).len >= 1000);
        assert!(Arc::ptr_eq(&table(16, 10000.0, 5), &table(16, 10000.0, 7)));
    }
}
