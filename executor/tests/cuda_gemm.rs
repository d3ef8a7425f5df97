//! cuBLASLt GEMMs (`cuda::gemm`) on a GPU against the CPU reference (`Cpu::gemm`, the
//! row-major convention the interpreter uses) and against a product worked by hand:
//! every transpose combination, fp32 (plain fp32 arithmetic, 1e-5), bf16 operands with a
//! bf16 result (1e-2) and with an fp32 result accumulated onto (`beta = 1`, how weight
//! gradients add into fp32 main gradients; fp32 accumulation of exact bf16 products, 1e-5),
//! odd sizes that fit no tile, and the bias and bias + GELU epilogues against the
//! reference's own GELU. Bad calls (wrong element type, short buffers, a missing bias) are
//! errors naming what is wrong.
//!
//! Feature `cuda` only. Without a CUDA driver, cuBLASLt or a GPU each test prints
//! `skipped: <reason>` and passes. `scripts/gpu/check.sh` runs it on a GPU machine.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::close;
use shardwright_executor::cuda::device::{cuda_include_dir, unavailable, CudaSlice, Device};
use shardwright_executor::cuda::gemm::{Bf16, Blas, Elem, Epilogue, GemmSpec, F32};
use shardwright_executor::cuda::{bf16_bits, bf16_value};
use shardwright_executor::rng::Rng;
use shardwright_executor::{Backend, Cpu, GemmShape, Operand};
use std::sync::OnceLock;

static GPU: OnceLock<Result<(Device, Blas), String>> = OnceLock::new();

fn gpu(test: &str) -> Option<&'static (Device, Blas)> {
    let g = GPU.get_or_init(|| match unavailable() {
        Some(why) => Err(why),
        None => {
            let d = Device::new(0, &cuda_include_dir())
                .unwrap_or_else(|e| panic!("a GPU is present but the kernels do not load: {e}"));
            match Blas::new(&d) {
                Ok(b) => Ok((d, b)),
                Err(e) if e.contains("not on the library path") => Err(e),
                Err(e) => panic!("a GPU is present but cuBLASLt fails: {e}"),
            }
        }
    });
    match g {
        Ok(g) => Some(g),
        Err(why) => {
            println!("{test}: skipped: {why}");
            None
        }
    }
}

fn randn(g: &mut Rng, n: usize) -> Vec<f32> {
    g.vec(n, 1.0)
}

fn round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16_value(bf16_bits(v))).collect()
}

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16_bits(v)).collect()
}

/// The reference: `Cpu::gemm` on the values the GPU sees, then the epilogue.
fn reference(s: &GemmSpec, a: &[f32], b: &[f32], beta: f32, c0: &[f32], bias: &[f32]) -> Vec<f32> {
    let mut c = c0.to_vec();
    let shape = GemmShape {
        m: s.m,
        k: s.k,
        n: s.n,
    };
    let a = Operand {
        data: a,
        trans: s.trans_a,
    };
    let b = Operand {
        data: b,
        trans: s.trans_b,
    };
    Cpu.gemm(shape, a, b, beta, &mut c);
    if s.epilogue != Epilogue::None {
        for row in c.chunks_mut(s.n) {
            for (x, &bb) in row.iter_mut().zip(bias) {
                *x += bb;
            }
        }
    }
    if s.epilogue == Epilogue::GeluBias {
        c = Cpu.gelu_fwd(&c);
    }
    c
}

const SHAPES: [(usize, usize, usize); 5] = [
    (37, 70, 53),
    (128, 256, 96),
    (1, 64, 33),
    (300, 17, 129),
    (64, 1024, 8),
];

/// One case: operands of `S`'s type, a result of `C`'s.
fn case(g: &mut Rng, d: &Device, blas: &Blas, s: GemmSpec, beta: f32, rel: f64) {
    let (m, k, n) = (s.m, s.k, s.n);
    let bf = s.ab == Elem::Bf16;
    let a = randn(g, m * k);
    let b = randn(g, k * n);
    let (a, b) = if bf { (round(&a), round(&b)) } else { (a, b) };
    let c_bf = s.c == Elem::Bf16;
    let fix = |x: Vec<f32>| if c_bf { round(&x) } else { x };
    let c0 = fix(randn(g, m * n));
    let bias = fix(randn(g, n));
    let want = reference(&s, &a, &b, beta, &c0, &bias);
    let with_bias = s.epilogue != Epilogue::None;
    let got: Vec<f32> = match (bf, c_bf) {
        (false, false) => {
            let (da, db) = (d.upload(&a).unwrap(), d.upload(&b).unwrap());
            let mut dc = d.upload(&c0).unwrap();
            let dbias = d.upload(&bias).unwrap();
            blas.gemm::<F32, F32>(
                &s,
                (1.0, beta),
                &da,
                &db,
                &mut dc,
                with_bias.then_some(&dbias),
            )
            .unwrap();
            d.download(&dc).unwrap()
        }
        (true, c_is_bf) => {
            let (da, db) = (d.upload(&bits(&a)).unwrap(), d.upload(&bits(&b)).unwrap());
            if c_is_bf {
                let mut dc: CudaSlice<u16> = d.upload(&bits(&c0)).unwrap();
                let dbias = d.upload(&bits(&bias)).unwrap();
                blas.gemm::<Bf16, Bf16>(
                    &s,
                    (1.0, beta),
                    &da,
                    &db,
                    &mut dc,
                    with_bias.then_some(&dbias),
                )
                .unwrap();
                d.download(&dc)
                    .unwrap()
                    .into_iter()
                    .map(bf16_value)
                    .collect()
            } else {
                let mut dc = d.upload(&c0).unwrap();
                let dbias = d.upload(&bias).unwrap();
                blas.gemm::<Bf16, F32>(
                    &s,
                    (1.0, beta),
                    &da,
                    &db,
                    &mut dc,
                    with_bias.then_some(&dbias),
                )
                .unwrap();
                d.download(&dc).unwrap()
            }
        }
        (false, true) => unreachable!("fp32 operands with a bf16 result are not a case"),
    };
    let what = format!(
        "gemm[m={m} k={k} n={n} ta={} tb={} {:?}->{:?} beta={beta} {:?}]",
        s.trans_a as u8, s.trans_b as u8, s.ab, s.c, s.epilogue
    );
    close(&what, &got, &want, rel);
}

#[test]
fn gemm_every_transpose_and_precision_matches_the_cpu_reference() {
    let Some((d, blas)) = gpu("gemm_every_transpose_and_precision_matches_the_cpu_reference")
    else {
        return;
    };
    let mut g = Rng::new(0x6e33);
    for &(m, k, n) in &SHAPES {
        for ta in [false, true] {
            for tb in [false, true] {
                let shape = GemmShape { m, k, n };
                case(
                    &mut g,
                    d,
                    blas,
                    GemmSpec::new(shape, ta, tb, Elem::F32, Elem::F32),
                    0.0,
                    1e-5,
                );
                case(
                    &mut g,
                    d,
                    blas,
                    GemmSpec::new(shape, ta, tb, Elem::Bf16, Elem::Bf16),
                    0.0,
                    1e-2,
                );
                case(
                    &mut g,
                    d,
                    blas,
                    GemmSpec::new(shape, ta, tb, Elem::Bf16, Elem::F32),
                    1.0,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn bias_and_gelu_epilogues_match_the_reference() {
    let Some((d, blas)) = gpu("bias_and_gelu_epilogues_match_the_reference") else {
        return;
    };
    let mut g = Rng::new(0xe91);
    for &(m, k, n) in &SHAPES {
        for epilogue in [Epilogue::Bias, Epilogue::GeluBias] {
            // The forward linear layer: x [m, k] times W^T, W stored [n, k].
            let shape = GemmShape { m, k, n };
            let mut s = GemmSpec::new(shape, false, true, Elem::Bf16, Elem::Bf16);
            s.epilogue = epilogue;
            case(&mut g, d, blas, s, 0.0, 1e-2);
            let mut s = GemmSpec::new(shape, false, true, Elem::F32, Elem::F32);
            s.epilogue = epilogue;
            // The epilogue's tanh is the hardware's approximation, not libm's.
            let rel = if epilogue == Epilogue::GeluBias {
                1e-4
            } else {
                1e-5
            };
            case(&mut g, d, blas, s, 0.0, rel);
        }
    }
}

#[test]
fn a_product_worked_by_hand() {
    let Some((d, blas)) = gpu("a_product_worked_by_hand") else {
        return;
    };
    // [[1, 2, 3], [4, 5, 6]] times [[7, 8], [9, 10], [11, 12]] = [[58, 64], [139, 154]].
    let a = d.upload(&[1f32, 2., 3., 4., 5., 6.]).unwrap();
    let b = d.upload(&[7f32, 8., 9., 10., 11., 12.]).unwrap();
    let mut c = d.zeros::<f32>(4).unwrap();
    let s = GemmSpec::new(
        GemmShape { m: 2, k: 3, n: 2 },
        false,
        false,
        Elem::F32,
        Elem::F32,
    );
    blas.gemm::<F32, F32>(&s, (1.0, 0.0), &a, &b, &mut c, None)
        .unwrap();
    assert_eq!(d.download(&c).unwrap(), vec![58., 64., 139., 154.]);
    // The same b stored transposed ([[7, 9, 11], [8, 10, 12]]), alpha 2, beta 1 onto it.
    let bt = d.upload(&[7f32, 9., 11., 8., 10., 12.]).unwrap();
    let s = GemmSpec::new(
        GemmShape { m: 2, k: 3, n: 2 },
        false,
        true,
        Elem::F32,
        Elem::F32,
    );
    blas.gemm::<F32, F32>(&s, (2.0, 1.0), &a, &bt, &mut c, None)
        .unwrap();
    assert_eq!(d.download(&c).unwrap(), vec![174., 192., 417., 462.]);
}

#[test]
fn bad_calls_are_named_errors() {
    let Some((d, blas)) = gpu("bad_calls_are_named_errors") else {
        return;
    };
    let shape = GemmShape { m: 4, k: 8, n: 2 };
    let s = GemmSpec::new(shape, false, false, Elem::Bf16, Elem::F32);
    let a = d.zeros::<u16>(32).unwrap();
    let short = d.zeros::<u16>(15).unwrap();
    let mut c = d.zeros::<f32>(8).unwrap();
    let e = blas
        .gemm::<F32, F32>(
            &s,
            (1.0, 0.0),
            &d.zeros(32).unwrap(),
            &d.zeros(16).unwrap(),
            &mut c,
            None,
        )
        .unwrap_err();
    assert!(e.contains("F32 operands"), "{e}");
    let e = blas
        .gemm::<Bf16, F32>(&s, (1.0, 0.0), &a, &short, &mut c, None)
        .unwrap_err();
    assert!(e.contains("`b` has 15 elements, needs 16"), "{e}");
    let mut with_bias = s;
    with_bias.epilogue = Epilogue::Bias;
    let e = blas
        .gemm::<Bf16, F32>(&with_bias, (1.0, 0.0), &a, &a, &mut c, None)
        .unwrap_err();
    assert!(e.contains("needs a bias"), "{e}");
}
