//! `c = beta c + op(a) op(b)` on the pool's threads: the output is cut into blocks of rows
//! (or of columns, when it has few rows), each a single-threaded `matrixmultiply::sgemm`
//! call on the operands' sub-matrices. matrixmultiply's blocking of the reduction dimension
//! depends on `k` only and every element goes through the same micro-kernel, so each
//! element of `c` is the same bits as in one whole call, on any number of threads.

use super::pool::{self, SendPtr};
use crate::backend::{GemmShape, Operand};

/// Rows (or columns) per task: the boundaries depend on the shape only.
const BLOCK: usize = 64;

/// A matrix operand as matrixmultiply reads it: its first element and its (row, column)
/// strides in elements.
#[derive(Clone, Copy)]
struct Strided {
    p: *const f32,
    rs: isize,
    cs: isize,
}

/// One single-threaded matrixmultiply call: `c (row stride rsc) = beta c + a b`, `a`
/// `m x k`, `b` `k x n`.
///
/// # Safety
/// Every element the shape and strides reach must be inside the allocations.
unsafe fn sgemm(s: GemmShape, a: Strided, b: Strided, beta: f32, c: (*mut f32, isize)) {
    let (GemmShape { m, k, n }, (cp, rsc)) = (s, c);
    matrixmultiply::sgemm(
        m, k, n, 1.0, a.p, a.rs, a.cs, b.p, b.rs, b.cs, beta, cp, rsc, 1,
    );
}

/// Row and column strides of `op(x)`, `rows x cols`, stored row-major (its transpose when
/// `trans`).
fn strides(rows: usize, cols: usize, trans: bool) -> (isize, isize) {
    if trans {
        (1, rows as isize)
    } else {
        (cols as isize, 1)
    }
}

/// `c[m x n] = beta c + op(a) op(b)` (`op(a)` `m x k`, `op(b)` `k x n`, as
/// [`crate::backend::Backend::gemm`]); row-major, `c` dense.
pub fn gemm(s: GemmShape, a: Operand<'_>, b: Operand<'_>, beta: f32, c: &mut [f32]) {
    gemm_on(None, s, (a, b), beta, c)
}

/// [`gemm`] on a given pool (`None`: the process's; tests pass their own).
pub fn gemm_on(
    pool: Option<&rayon::ThreadPool>,
    s: GemmShape,
    (a, b): (Operand<'_>, Operand<'_>),
    beta: f32,
    c: &mut [f32],
) {
    let GemmShape { m, k, n } = s;
    assert!(
        a.data.len() >= m * k && b.data.len() >= k * n && c.len() >= m * n,
        "gemm shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c[..m * n].iter_mut().for_each(|x| *x *= beta);
        return;
    }
    // Row/column strides of op(a) (m x k) and op(b) (k x n).
    let sa = strides(m, k, a.trans);
    let sb = strides(k, n, b.trans);
    let (ap, bp, cp) = (
        a.data.as_ptr() as usize,
        b.data.as_ptr() as usize,
        SendPtr(c.as_mut_ptr()),
    );
    let work = m * k * n;
    // Split the longer side of c.
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let tasks = len.div_ceil(BLOCK);
    let task = |i: usize| {
        let lo = i * BLOCK;
        let w = BLOCK.min(len - lo);
        let at = |p: *const f32, (rs, cs): (isize, isize)| Strided { p, rs, cs };
        let (ap, bp) = (ap as *const f32, bp as *const f32);
        // SAFETY: the assert above bounds every element; tasks write disjoint blocks of c.
        unsafe {
            if by_rows {
                // Rows lo..lo+w of op(a) and of c.
                let a0 = at(ap.offset(lo as isize * sa.0), sa);
                let c0 = (cp.get().add(lo * n), n as isize);
                sgemm(GemmShape { m: w, k, n }, a0, at(bp, sb), beta, c0);
            } else {
                // Columns lo..lo+w of op(b) and of c.
                let b0 = at(bp.offset(lo as isize * sb.1), sb);
                let c0 = (cp.get().add(lo), n as isize);
                sgemm(GemmShape { m, k, n: w }, at(ap, sa), b0, beta, c0);
            }
        }
    };
    match pool {
        Some(p) => pool::run_on(Some(p), tasks, work, task),
        None => pool::run(tasks, work, task),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The textbook triple loop in f64.
    fn naive(s: GemmShape, a: Operand<'_>, b: Operand<'_>, beta: f32, c: &[f32]) -> Vec<f64> {
        let GemmShape { m, k, n } = s;
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = beta as f64 * c[i * n + j] as f64;
                for l in 0..k {
                    let x = if a.trans {
                        a.data[l * m + i]
                    } else {
                        a.data[i * k + l]
                    };
                    let y = if b.trans {
                        b.data[j * k + l]
                    } else {
                        b.data[l * n + j]
                    };
                    s += x as f64 * y as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    #[test]
    fn blocks_on_threads_equal_one_call_and_the_textbook() {
        let p3 = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut g = Rng::new(11);
        for &(m, k, n) in &[
            (1, 1, 1),
            (200, 70, 9),
            (9, 300, 150),
            (130, 257, 131),
            (64, 1024, 64),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = g.vec(m * k, 1.0);
                let b = g.vec(k * n, 1.0);
                let c0 = g.vec(m * n, 1.0);
                let s = GemmShape { m, k, n };
                let (oa, ob) = (
                    Operand {
                        data: a.as_slice(),
                        trans: ta,
                    },
                    Operand {
                        data: b.as_slice(),
                        trans: tb,
                    },
                );
                let want = naive(s, oa, ob, 0.5, &c0);
                // The whole product in one matrixmultiply call.
                let mut one = c0.clone();
                let sa = strides(m, k, ta);
                let sb = strides(k, n, tb);
                let at = |p: *const f32, (rs, cs): (isize, isize)| Strided { p, rs, cs };
                unsafe {
                    let c = (one.as_mut_ptr(), n as isize);
                    sgemm(s, at(a.as_ptr(), sa), at(b.as_ptr(), sb), 0.5, c)
                };
                let mut par = c0.clone();
                gemm_on(Some(&p3), s, (oa, ob), 0.5, &mut par);
                let mut ser = c0.clone();
                gemm_on(None, s, (oa, ob), 0.5, &mut ser);
                for i in 0..m * n {
                    assert_eq!(
                        par[i].to_bits(),
                        one[i].to_bits(),
                        "{m}x{k}x{n} {ta} {tb} [{i}]"
                    );
                    assert_eq!(ser[i].to_bits(), one[i].to_bits());
                    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                    assert!(
                        (par[i] as f64 - want[i]).abs() <= tol,
                        "{} vs {}",
                        par[i],
                        want[i]
                    );
                }
            }
        }
    }
}
