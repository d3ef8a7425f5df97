//! The CUDA backend's own kernels timed on a GPU at the shapes of a ~1.1B Llama step
//! (issue 23's bench model: hidden 2048, 32 heads / 4 KV heads of 64, FFN 5632, seq 2048,
//! micro-batch 8, so 16384 tokens) and one long-context attention shape (32 / 8 heads of 128,
//! seq 4096), printed as a table of milliseconds and the rate against the ceiling that
//! bounds each kernel (bf16 matrix FLOP/s for attention, HBM bytes for the rest), for
//! comparison with `scripts/gpu/torch_kernels.py` (PyTorch on the same shapes) in the same
//! device call. Attention runs twice: the scalar kernels (attention.cu) and the tensor-core
//! ones (attention_mma.cu, rows `mma`). Correctness is `tests/cuda_kernels.rs`' job; this
//! only times.
//!
//! Then the backend itself (`cuda::backend::Cuda`, as the interpreter drives it) on one
//! Llama MLP block of that step: RMSNorm, the SwiGLU up projection, SwiGLU, the down
//! projection and the residual add, forward and backward (data and weight gradients,
//! accumulated), then AdamW on the two weight matrices, in bf16 mode (the training mode:
//! bf16 activations and GEMM operands, fp32 accumulation, master weights and moments) and
//! in fp32 mode (the reference-comparison mode) for comparison, each timed with CUDA
//! events around the whole sequence of backend calls (host work included), rated by its
//! GEMM FLOPs.
//!
//! `cargo bench -p shardwright-executor --features cuda --bench gpu_kernels` on a GPU
//! machine; without a GPU it prints why and exits 0. Timing: CUDA events around each
//! launch sequence, median of 20 after 3 warm-ups, random inputs (never zeros).

use shardwright_executor::cuda::backend::{AttnArgs, Cuda};
use shardwright_executor::cuda::device::{cuda_include_dir, unavailable, CudaSlice, Device};
use shardwright_executor::cuda::gemm::random_bf16;
use shardwright_executor::cuda::launch::{self, Attn, AttnImpl, Dtype, Norm};
use shardwright_executor::cuda::precision::Precision;
use shardwright_executor::cuda::{adamw_bias_corrections, device::PushKernelArg};
use shardwright_executor::Backend;
use shardwright_executor::{AdamW, AttnShape};

/// Median seconds of `f` (which queues work on `d`'s stream) over 20 runs after 3.
fn time(d: &Device, mut f: impl FnMut()) -> f64 {
    let mut ts = d
        .time_each(3, 20, || {
            f();
            Ok(())
        })
        .unwrap();
    ts.sort_by(f64::total_cmp);
    ts[ts.len() / 2]
}

fn bf16(d: &Device, n: usize, seed: u64) -> CudaSlice<u16> {
    d.upload(&random_bf16(n, seed)).unwrap()
}

struct Row {
    kernel: String,
    shape: String,
    ms: f64,
    rate: String,
}

/// A causal attention shape: batch, sequence, query heads, KV heads, head dim.
#[derive(Clone, Copy)]
struct AttnCase {
    b: u64,
    s: u64,
    hq: u64,
    hk: u64,
    hd: u64,
}

/// The attention kernels of `imp` (the scalar ones, or the tensor-core ones of
/// attention_mma.cu, whose rows are labelled `mma`) at one causal shape.
fn attention(d: &Device, rows: &mut Vec<Row>, imp: AttnImpl, case: AttnCase) {
    let AttnCase { b, s, hq, hk, hd } = case;
    let shape = AttnShape {
        batch: b as usize,
        seq_q: s as usize,
        seq_kv: s as usize,
        heads: hq as usize,
        kv_heads: hk as usize,
        head_dim: hd as usize,
        q_offset: 0,
        causal: true,
    };
    let ls = launch::attention_for(imp, Dtype::Bf16, &Attn::from(&shape)).unwrap();
    let tag = match imp {
        AttnImpl::Scalar => "",
        AttnImpl::Mma => " mma",
    };
    let a = AttnArgs::of(&shape);
    let (nq, nk) = ((b * s * hq * hd) as usize, (b * s * hk * hd) as usize);
    let (q, k, v) = (bf16(d, nq, 1), bf16(d, nk, 2), bf16(d, nk, 3));
    let mut o = d.zeros::<u16>(nq).unwrap();
    let rows_n = (b * hq * s) as usize;
    let mut lse = d.zeros::<f32>(rows_n).unwrap();
    let fwd = time(d, || unsafe {
        d.launch(&ls.fwd, |x| {
            x.arg(&q).arg(&k).arg(&v).arg(&mut o).arg(&mut lse);
            a.push(x);
        })
        .unwrap()
    });
    let dout = bf16(d, nq, 4);
    let mut delta = d.zeros::<f32>(rows_n).unwrap();
    let (mut dq, mut dk, mut dv) = (
        d.zeros::<u16>(nq).unwrap(),
        d.zeros::<u16>(nk).unwrap(),
        d.zeros::<u16>(nk).unwrap(),
    );
    let (nrows, sq, hq32, hd32) = (rows_n as u64, s as u32, hq as u32, hd as u32);
    let bwd = time(d, || unsafe {
        d.launch(&ls.bwd_delta, |x| {
            x.arg(&o)
                .arg(&dout)
                .arg(&mut delta)
                .arg(&nrows)
                .arg(&sq)
                .arg(&hq32)
                .arg(&hd32);
        })
        .unwrap();
        d.launch(&ls.bwd_dkdv, |x| {
            x.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&delta);
            x.arg(&mut dk).arg(&mut dv);
            a.push(x);
        })
        .unwrap();
        d.launch(&ls.bwd_dq, |x| {
            x.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&delta);
            x.arg(&mut dq);
            a.push(x);
        })
        .unwrap();
    });
    // Causal: QK^T and PV over the s(s+1)/2 pairs; the backward counts 2.5x the forward
    // (the same convention as scripts/gpu/measure_kernels.py).
    let fl = 4.0 * (s * (s + 1) / 2) as f64 * (hd * hq * b) as f64;
    let shape = format!("b={b} s={s} h={hq}/{hk} d={hd}");
    rows.push(Row {
        kernel: format!("attention fwd{tag}"),
        shape: shape.clone(),
        ms: fwd * 1e3,
        rate: format!("{:.1} TFLOP/s", fl / fwd / 1e12),
    });
    rows.push(Row {
        kernel: format!("attention bwd{tag}"),
        shape,
        ms: bwd * 1e3,
        rate: format!("{:.1} TFLOP/s", 2.5 * fl / bwd / 1e12),
    });
}

fn elementwise(d: &Device, rows: &mut Vec<Row>, t: u64, h: u64, f: u64) {
    let gbs = |bytes: f64, s: f64| format!("{:.0} GB/s", bytes / s / 1e9);
    // RMSNorm forward: read x, write y (bf16), per-row rstd.
    let (x, w) = (bf16(d, (t * h) as usize, 5), bf16(d, h as usize, 6));
    let mut y = d.zeros::<u16>((t * h) as usize).unwrap();
    let mut rstd = d.zeros::<f32>(t as usize).unwrap();
    let (hh, eps) = (h as u32, 1e-5f32);
    let l = launch::norm_fwd(Norm::Rms, Dtype::Bf16, t, h).unwrap();
    let s = time(d, || unsafe {
        d.launch(&l, |b| {
            b.arg(&x)
                .arg(&w)
                .arg(&mut y)
                .arg(&mut rstd)
                .arg(&hh)
                .arg(&eps);
        })
        .unwrap()
    });
    rows.push(Row {
        kernel: "rmsnorm fwd".into(),
        shape: format!("t={t} h={h}"),
        ms: s * 1e3,
        rate: gbs(4.0 * (t * h) as f64, s),
    });
    // SwiGLU forward (read [t, 2f], write [t, f]) and backward (read [t, 2f] + [t, f],
    // write [t, 2f]).
    let gu = bf16(d, (t * 2 * f) as usize, 7);
    let dy = bf16(d, (t * f) as usize, 8);
    let mut a = d.zeros::<u16>((t * f) as usize).unwrap();
    let mut dgu = d.zeros::<u16>((t * 2 * f) as usize).unwrap();
    let ff = f as u32;
    let lf = launch::swiglu(Dtype::Bf16, false, t, f).unwrap();
    let lb = launch::swiglu(Dtype::Bf16, true, t, f).unwrap();
    let sf = time(d, || unsafe {
        d.launch(&lf, |b| {
            b.arg(&gu).arg(&mut a).arg(&t).arg(&ff);
        })
        .unwrap()
    });
    let sb = time(d, || unsafe {
        d.launch(&lb, |b| {
            b.arg(&gu).arg(&dy).arg(&mut dgu).arg(&t).arg(&ff);
        })
        .unwrap()
    });
    let n = (t * f) as f64;
    rows.push(Row {
        kernel: "swiglu fwd".into(),
        shape: format!("t={t} f={f}"),
        ms: sf * 1e3,
        rate: gbs(6.0 * n, sf),
    });
    rows.push(Row {
        kernel: "swiglu bwd".into(),
        shape: format!("t={t} f={f}"),
        ms: sb * 1e3,
        rate: gbs(10.0 * n, sb),
    });
}

fn adamw(d: &Device, rows: &mut Vec<Row>, n: u64) {
    let h = AdamW {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 10,
    };
    let (bc1, bc2) = adamw_bias_corrections(&h);
    let host: Vec<f32> = random_bf16(n as usize, 9)
        .into_iter()
        .map(|b| shardwright_executor::cuda::bf16_value(b) * 0.01)
        .collect();
    let mut p = d.upload(&host).unwrap();
    let mut m = d.upload(&host).unwrap();
    let vv: Vec<f32> = host.iter().map(|x| x * x).collect();
    let mut v = d.upload(&vv).unwrap();
    let g = bf16(d, n as usize, 10);
    let mut pb = d.zeros::<u16>(n as usize).unwrap();
    let l = launch::adamw(Dtype::Bf16, n).unwrap();
    let s = time(d, || unsafe {
        d.launch(&l, |b| {
            b.arg(&mut p).arg(&g).arg(&mut m).arg(&mut v).arg(&mut pb);
            b.arg(&n).arg(&h.lr).arg(&h.beta1).arg(&h.beta2).arg(&h.eps);
            b.arg(&h.weight_decay).arg(&bc1).arg(&bc2);
        })
        .unwrap()
    });
    // Reads p, m, v (fp32) and g (bf16); writes p, m, v and the bf16 copy.
    rows.push(Row {
        kernel: "adamw (bf16 grads)".into(),
        shape: format!("n={n}"),
        ms: s * 1e3,
        rate: format!("{:.0} GB/s", 28.0 * n as f64 / s / 1e9),
    });
}

/// One MLP block forward + backward + AdamW through the backend in precision `p`.
fn backend_mlp(be: &Cuda, rows: &mut Vec<Row>, t: usize, h: usize, f: usize) {
    let up = |n: usize, seed: u64, scale: f32| {
        let host: Vec<f32> = random_bf16(n, seed)
            .into_iter()
            .map(|b| shardwright_executor::cuda::bf16_value(b) * scale)
            .collect();
        be.upload(&host)
    };
    let x = up(t * h, 11, 1.0);
    let dz = up(t * h, 12, 1e-3);
    let wn = up(h, 13, 1.0);
    let mut w_up = up(h * 2 * f, 14, 0.02);
    let mut w_down = up(f * h, 15, 0.02);
    let (mut g_up, mut g_down, mut g_n) = (be.zeros(h * 2 * f), be.zeros(f * h), be.zeros(h));
    let mut mom: Vec<_> = (0..4)
        .map(|i| be.zeros(if i < 2 { h * 2 * f } else { f * h }))
        .collect();
    let hp = AdamW {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 10,
    };
    let s = time(&be.dev, || {
        let (y, r) = be.rmsnorm_fwd(&x, &wn, h, 1e-5);
        let gu = be.linear_fwd(&y, &w_up, t, h, 2 * f);
        let a = be.swiglu_fwd(&gu, f);
        let o = be.linear_fwd(&a, &w_down, t, f, h);
        let z = be.add(&x, &o);
        let da = be.linear_dgrad(&dz, &w_down, t, f, h);
        be.linear_wgrad(&a, &dz, t, f, h, &mut g_down);
        let dgu = be.swiglu_bwd(&gu, &da, f);
        let dy = be.linear_dgrad(&dgu, &w_up, t, h, 2 * f);
        be.linear_wgrad(&y, &dgu, t, h, 2 * f, &mut g_up);
        let dx = be.rmsnorm_bwd(&x, &wn, &r, &dy, h, &mut g_n);
        let dres = be.add(&dz, &dx);
        let (m0, rest) = mom.split_at_mut(1);
        let (m1, rest) = rest.split_at_mut(1);
        let (m2, m3) = rest.split_at_mut(1);
        be.adamw(&mut w_up, &g_up, &mut m0[0], &mut m1[0], hp);
        be.adamw(&mut w_down, &g_down, &mut m2[0], &mut m3[0], hp);
        std::hint::black_box((z, dres));
    });
    // Three GEMM passes (forward, data and weight gradients) of the two projections.
    let fl = 3.0 * 2.0 * (t * h * 3 * f) as f64;
    rows.push(Row {
        kernel: format!("mlp block ({})", be.precision().name()),
        shape: format!("t={t} h={h} f={f}"),
        ms: s * 1e3,
        rate: format!("{:.0} TFLOP/s", fl / s / 1e12),
    });
}

fn main() {
    if let Some(why) = unavailable() {
        println!("gpu_kernels: skipped: {why}");
        return;
    }
    let d = Device::new(0, &cuda_include_dir()).expect("the kernels load");
    println!("gpu_kernels on {}", d.name().unwrap_or_default());
    let mut rows = Vec::new();
    for imp in [AttnImpl::Scalar, AttnImpl::Mma] {
        for case in [
            AttnCase {
                b: 8,
                s: 2048,
                hq: 32,
                hk: 4,
                hd: 64,
            },
            AttnCase {
                b: 1,
                s: 4096,
                hq: 32,
                hk: 8,
                hd: 128,
            },
        ] {
            attention(&d, &mut rows, imp, case);
        }
    }
    elementwise(&d, &mut rows, 16384, 2048, 5632);
    adamw(&d, &mut rows, 1 << 28);
    drop(d);
    // The backend at the step's MLP shapes: the training mode, then the reference mode.
    match Cuda::new_with(0, Precision::Bf16) {
        Ok(be) => {
            backend_mlp(&be, &mut rows, 16384, 2048, 5632);
            backend_mlp(
                &be.with_precision(Precision::Fp32),
                &mut rows,
                16384,
                2048,
                5632,
            );
        }
        Err(e) => println!("backend: not timed: {e}"),
    }
    println!(
        "{:<20} {:<26} {:>10} {:>16}",
        "kernel", "shape", "ms", "rate"
    );
    for r in &rows {
        println!(
            "{:<20} {:<26} {:>10.3} {:>16}",
            r.kernel, r.shape, r.ms, r.rate
        );
    }
}
