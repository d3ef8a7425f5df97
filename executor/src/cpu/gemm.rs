//! `c = beta c + op(a) op(b)` on the pool's threads: the output is cut into blocks of rows
//! (or of columns, when it has few rows), each a single-threaded `matrixmultiply::sgemm`
//! call on the operands' sub-matrices. matrixmultiply's blocking of the reduction dimension
//! depends on `k` only and every element goes through the same micro-kernel, so each
//! element of `c` is the same bits as in one whole call, on any number of threads.

use super::pool::{self, SendPtr};

/// Rows (or columns) per task: the boundaries depend on the shape only.
const BLOCK: usize = 64;

/// One single-threaded matrixmultiply call; strides in elements.
///
/// # Safety
/// Every element the shape and strides reach must be inside the allocations.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    (rsa, csa): (isize, isize),
    b: *const f32,
    (rsb, csb): (isize, isize),
    beta: f32,
    c: *mut f32,
    rsc: isize,
) {
    matrixmultiply::sgemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, beta, c, rsc, 1);
}

/// `c[m x n] = beta c + op(a) op(b)`, `op(a)` `m x k` stored transposed when `ta`, `op(b)`
/// `k x n` stored transposed when `tb`; row-major, `c` dense.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    beta: f32,
    c: &mut [f32],
) {
    gemm_on(None, m, k, n, a, ta, b, tb, beta, c)
}

/// [`gemm`] on a given pool (`None`: the process's; tests pass their own).
#[allow(clippy::too_many_arguments)]
pub fn gemm_on(
    pool: Option<&rayon::ThreadPool>,
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    beta: f32,
    c: &mut [f32],
) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
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
    let sa = if ta { (1, m as isize) } else { (k as isize, 1) };
    let sb = if tb { (1, k as isize) } else { (n as isize, 1) };
    let (ap, bp, cp) = (a.as_ptr() as usize, b.as_ptr() as usize, SendPtr(c.as_mut_ptr()));
    let work = m * k * n;
    // Split the longer side of c.
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let tasks = len.div_ceil(BLOCK);
    let task = |i: usize| {
        let lo = i * BLOCK;
        let w = BLOCK.min(len - lo);
        let (ap, bp) = (ap as *const f32, bp as *const f32);
        // SAFETY: the assert above bounds every element; tasks write disjoint blocks of c.
        unsafe {
            if by_rows {
                // Rows lo..lo+w of op(a) and of c.
                let a0 = ap.offset(lo as isize * sa.0);
                sgemm(w, k, n, a0, sa, bp, sb, beta, cp.get().add(lo * n), n as isize);
            } else {
                // Columns lo..lo+w of op(b) and of c.
                let b0 = bp.offset(lo as isize * sb.1);
                sgemm(m, k, w, ap, sa, b0, sb, beta, cp.get().add(lo), n as isize);
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
    #[allow(clippy::too_many_arguments)]
    fn naive(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        ta: bool,
        b: &[f32],
        tb: bool,
        beta: f32,
        c: &[f32],
    ) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = beta as f64 * c[i * n + j] as f64;
                for l in 0..k {
                    let x = if ta { a[l * m + i] } else { a[i * k + l] };
                    let y = if tb { b[j * k + l] } else { b[l * n + j] };
                    s += x as f64 * y as f64;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    #[test]
    fn blocks_on_threads_equal_one_call_and_the_textbook() {
        let p3 = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let mut g = Rng::new(11);
        for &(m, k, n) in &[(1, 1, 1), (200, 70, 9), (9, 300, 150), (130, 257, 131), (64, 1024, 64)] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = g.vec(m * k, 1.0);
                let b = g.vec(k * n, 1.0);
                let c0 = g.vec(m * n, 1.0);
                let want = naive(m, k, n, &a, ta, &b, tb, 0.5, &c0);
                // The whole product in one matrixmultiply call.
                let mut one = c0.clone();
                let sa = if ta { (1, m as isize) } else { (k as isize, 1) };
                let sb = if tb { (1, k as isize) } else { (n as isize, 1) };
                unsafe {
                    sgemm(m, k, n, a.as_ptr(), sa, b.as_ptr(), sb, 0.5, one.as_mut_ptr(), n as isize)
                };
                let mut par = c0.clone();
                gemm_on(Some(&p3), m, k, n, &a, ta, &b, tb, 0.5, &mut par);
                let mut ser = c0.clone();
                gemm_on(None, m, k, n, &a, ta, &b, tb, 0.5, &mut ser);
                for i in 0..m * n {
                    assert_eq!(par[i].to_bits(), one[i].to_bits(), "{m}x{k}x{n} {ta} {tb} [{i}]");
                    assert_eq!(ser[i].to_bits(), one[i].to_bits());
                    let tol = 1e-5 * (k as f64).sqrt() * 4.0;
                    assert!((par[i] as f64 - want[i]).abs() <= tol, "{} vs {}", par[i], want[i]);
                }
            }
        }
    }
}
