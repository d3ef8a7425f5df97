//! What the GPU tests share (`mod gpu_common;` in each): the element-wise comparison of a
//! GPU result with the CPU reference.

/// `got` matches `want` element-wise: `|got - want| <= rel (|want| + rms(want))` (the rms
/// term keeps values near zero from demanding a relative precision their neighbours do not
/// have). NaN or infinity where the reference is finite fails. Prints the worst error.
pub fn close(what: &str, got: &[f32], want: &[f32], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().map(|&w| (w as f64).powi(2)).sum::<f64>() / want.len().max(1) as f64)
        .sqrt()
        .max(1e-30);
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_infinite() && g == w {
            continue;
        }
        let err = (g as f64 - w as f64).abs();
        let bound = rel * (w.abs() as f64 + rms);
        assert!(
            err <= bound,
            "{what}[{i}]: GPU {g}, CPU {w} (error {err:.3e} > {bound:.3e}; rel {rel:e}, rms {rms:.3e})"
        );
        worst = worst.max(err / (w.abs() as f64 + rms));
    }
    println!(
        "{what}: {} values, worst error {worst:.2e} of (|ref| + rms), bound {rel:.0e}",
        got.len()
    );
}
