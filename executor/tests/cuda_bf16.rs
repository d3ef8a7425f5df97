//! The CUDA backend's bf16 mode (`Cuda::new_with(0, Precision::Bf16)`), method by method,
//! against `Sim` (`gpu_common/bf16_sim.rs`: the same precision rules on the CPU, bf16
//! rounding where the backend stores bf16, fp32 arithmetic). Every result must have the
//! element type the rules give it (`DBuf::kind` against `Sim`'s, the table in
//! `cuda::backend`'s docs) and the same values up to the summation order: bf16 results
//! within 1e-2 of `(|ref| + rms)` (one bf16 rounding step is 2^-8 relative), fp32
//! statistics and accumulated gradients within 1e-4 (fp32 sums in another order of the same
//! bf16 inputs). Also: the working copy of a weight follows AdamW (a GEMM after the update
//! reads the updated weight), and host values written into a bf16 buffer panic.
//!
//! Feature `cuda` only. Without a CUDA driver, NVRTC, cuBLASLt or a GPU each test prints
//! `skipped: <reason>` and passes. `scripts/gpu/check.sh` runs it on a GPU machine.
#![cfg(feature = "cuda")]

#[path = "gpu_common/bf16_sim.rs"]
mod bf16_sim;
mod gpu_common;

use bf16_sim::{SBuf, Sim};
use gpu_common::close;
use shardwright_executor::cuda::backend::{Cuda, DBuf};
use shardwright_executor::cuda::device::unavailable;
use shardwright_executor::cuda::launch::AttnImpl;
use shardwright_executor::cuda::precision::{Kind, Precision};
use shardwright_executor::rng::Rng;
use shardwright_executor::{AdamW, AttnSaved, AttnShape, Backend, GemmShape, NormGrads, Operand};

const BF16: f64 = 1e-2;
const F32: f64 = 1e-4;

fn gpu(test: &str) -> Option<Cuda> {
    if let Some(why) = unavailable() {
        println!("{test}: skipped: {why}");
        return None;
    }
    match Cuda::new_with(0, Precision::Bf16) {
        Ok(c) => Some(c),
        Err(e) if e.contains("not on the library path") => {
            println!("{test}: skipped: {e}");
            None
        }
        Err(e) => panic!("a GPU is present but the CUDA backend does not start: {e}"),
    }
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut g = Rng::new(seed);
    (0..n).map(|_| g.sym(1.0)).collect()
}

/// The same host data on both.
fn up(be: &Cuda, x: &[f32]) -> (DBuf, SBuf) {
    (be.upload(x), Sim(Precision::Bf16).upload(x))
}

/// `got` has `want`'s kind and values (within `rel`).
fn same(what: &str, be: &Cuda, got: &DBuf, want: &SBuf, rel: f64) {
    assert_eq!(got.kind(), want.k, "{what}: element type");
    close(what, &be.download(got), &want.v, rel);
}

/// A bf16 activation on both, made as activations are (by a GEMM: `x` times the identity,
/// so the values are `x` rounded to bf16).
fn act(be: &Cuda, x: &[f32], w: usize) -> (DBuf, SBuf) {
    let s = Sim(Precision::Bf16);
    let t = x.len() / w;
    let mut eye = vec![0.0f32; w * w];
    for i in 0..w {
        eye[i * w + i] = 1.0;
    }
    let (xg, xs) = up(be, x);
    let (eg, es) = up(be, &eye);
    let a = (
        be.linear_fwd(&xg, &eg, t, w, w),
        s.linear_fwd(&xs, &es, t, w, w),
    );
    same("activation made by a GEMM", be, &a.0, &a.1, BF16);
    assert_eq!(a.0.kind(), Kind::Bf16);
    a
}

#[test]
fn buffers_and_gemms_in_bf16_follow_the_rules() {
    let Some(be) = gpu("buffers_and_gemms_in_bf16_follow_the_rules") else {
        return;
    };
    let s = Sim(Precision::Bf16);
    let (t, k, n) = (48, 40, 24);
    // zeros are untyped until written; uploads are fp32.
    let z = be.zeros(10);
    assert_eq!(z.kind(), Kind::Zero);
    assert_eq!(be.download(&z), vec![0.0; 10]);
    let (xg, xs) = up(&be, &rand(t * k, 1));
    assert_eq!(xg.kind(), Kind::F32);
    let (wg, ws) = up(&be, &rand(k * n, 2));
    // Forward GEMM: bf16 result; data gradient: bf16; weight gradient into zeros: fp32.
    let yg = be.linear_fwd(&xg, &wg, t, k, n);
    let ys = s.linear_fwd(&xs, &ws, t, k, n);
    same("linear_fwd", &be, &yg, &ys, BF16);
    let (dyg, dys) = act(&be, &rand(t * n, 3), n);
    same(
        "linear_dgrad",
        &be,
        &be.linear_dgrad(&dyg, &wg, t, k, n),
        &s.linear_dgrad(&dys, &ws, t, k, n),
        BF16,
    );
    let (mut dwg, mut dws) = (be.zeros(k * n), s.zeros(k * n));
    for _ in 0..2 {
        be.linear_wgrad(&xg, &dyg, t, k, n, &mut dwg);
        s.linear_wgrad(&xs, &dys, t, k, n, &mut dws);
    }
    same("linear_wgrad (accumulated twice)", &be, &dwg, &dws, F32);
    // A transposed GEMM onto an fp32 accumulator (the tied head's weight gradient).
    let (mut cg, mut cs) = up(&be, &rand(n * k, 4));
    be.gemm(
        GemmShape { m: n, k: t, n: k },
        Operand::t(&dyg),
        Operand::n(&xg),
        1.0,
        &mut cg,
    );
    s.gemm(
        GemmShape { m: n, k: t, n: k },
        Operand::t(&dys),
        Operand::n(&xs),
        1.0,
        &mut cs,
    );
    same("gemm beta 1 onto fp32", &be, &cg, &cs, F32);

    // Element-wise: joined types.
    same(
        "add bf16 + fp32",
        &be,
        &be.add(&yg, &up(&be, &ys.v).0),
        &s.add(&ys, &s.upload(&ys.v)),
        BF16,
    );
    let (ag, as_) = up(&be, &rand(t * n, 5));
    same(
        "add fp32 + fp32",
        &be,
        &be.add(&ag, &ag),
        &s.add(&as_, &as_),
        F32,
    );
    same(
        "scale bf16",
        &be,
        &be.scale(&yg, 0.5),
        &s.scale(&ys, 0.5),
        BF16,
    );
    same(
        "concat bf16, fp32",
        &be,
        &be.concat(&[&yg, &ag]),
        &s.concat(&[&ys, &as_]),
        BF16,
    );
    same(
        "slice",
        &be,
        &be.slice(&yg, 5, 77),
        &s.slice(&ys, 5, 77),
        BF16,
    );
    same(
        "gather",
        &be,
        &be.gather(&yg, &[(3, 9), (40, 20)]),
        &s.gather(&ys, &[(3, 9), (40, 20)]),
        BF16,
    );
    same("copy", &be, &be.copy(&yg), &s.copy(&ys), BF16);

    // Ranges: into untyped zeros (takes the source's type), into fp32 (converted).
    let moves = [(0, 10), (30, 50)];
    let (mut rg, mut rs) = (be.zeros(100), s.zeros(100));
    be.copy_ranges(&mut rg, &yg, 20, &moves);
    s.copy_ranges(&mut rs, &ys, 20, &moves);
    same("copy_ranges into zeros", &be, &rg, &rs, BF16);
    let (mut hg, mut hs) = (be.zeros(100), s.zeros(100));
    be.write(&mut hg, 0, &[3.0, 257.0]);
    s.write(&mut hs, 0, &[3.0, 257.0]);
    be.copy_ranges(&mut hg, &yg, 20, &moves);
    s.copy_ranges(&mut hs, &ys, 20, &moves);
    same("write then copy_ranges (fp32 headers)", &be, &hg, &hs, 0.0);
    let wmoves = [(0, 10, 0.5), (30, 10, -2.0), (60, 70, 1.5)];
    be.axpy_ranges(&mut rg, &yg, 20, &wmoves);
    s.axpy_ranges(&mut rs, &ys, 20, &wmoves);
    same("axpy_ranges bf16", &be, &rg, &rs, BF16);
    be.scale_ranges(&mut hg, &yg, 20, &wmoves);
    s.scale_ranges(&mut hs, &ys, 20, &wmoves);
    same("scale_ranges into fp32", &be, &hg, &hs, F32);
    be.add_into(&mut rg, 7, &be.slice(&yg, 0, 30));
    s.add_into(&mut rs, 7, &s.slice(&ys, 0, 30));
    same("add_into bf16", &be, &rg, &rs, BF16);
    let pairs = [(0, 24), (48, 0), (100, 200)];
    same(
        "dots bf16",
        &be,
        &be.dots(&yg, &yg, 24, &pairs),
        &s.dots(&ys, &ys, 24, &pairs),
        F32,
    );
    same(
        "dots fp32, bf16",
        &be,
        &be.dots(&ag, &yg, 24, &pairs),
        &s.dots(&as_, &ys, 24, &pairs),
        F32,
    );
    same(
        "row_max bf16",
        &be,
        &be.row_max(&yg, n),
        &s.row_max(&ys, n),
        0.0,
    );
    be.fill_zero(&mut rg);
    s.fill_zero(&mut rs);
    same("fill_zero keeps bf16", &be, &rg, &rs, 0.0);

    // Host values into a bf16 buffer would round: a panic, not a silent change.
    let mut b = be.copy(&yg);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        be.write(&mut b, 0, &[257.0]);
    }));
    let msg = r.expect_err("writing host values into bf16 panics");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("bf16"), "{msg}");
}

#[test]
fn kernels_in_bf16_follow_the_rules() {
    let Some(be) = gpu("kernels_in_bf16_follow_the_rules") else {
        return;
    };
    let s = Sim(Precision::Bf16);
    let (t, h, f) = (40, 64, 48);
    let (xg, xs) = act(&be, &rand(t * h, 10), h);
    let (wg, ws) = up(
        &be,
        &rand(h, 11)
            .iter()
            .map(|x| 1.0 + 0.2 * x)
            .collect::<Vec<_>>(),
    );
    let (bg, bs) = up(&be, &rand(h, 12));
    let (dyg, dys) = act(&be, &rand(t * h, 13), h);

    let (y, r) = be.rmsnorm_fwd(&xg, &wg, h, 1e-5);
    let (ys, rs) = s.rmsnorm_fwd(&xs, &ws, h, 1e-5);
    same("rmsnorm y", &be, &y, &ys, BF16);
    same("rmsnorm rstd", &be, &r, &rs, F32);
    let (mut dw, mut dws) = (be.zeros(h), s.zeros(h));
    let dx = be.rmsnorm_bwd(&xg, &wg, &r, &dyg, h, &mut dw);
    let dxs = s.rmsnorm_bwd(&xs, &ws, &rs, &dys, h, &mut dws);
    same("rmsnorm dx", &be, &dx, &dxs, BF16);
    same("rmsnorm dw", &be, &dw, &dws, F32);

    let (y, st) = be.layernorm_fwd(&xg, &wg, &bg, h, 1e-5);
    let (ys, sts) = s.layernorm_fwd(&xs, &ws, &bs, h, 1e-5);
    same("layernorm y", &be, &y, &ys, BF16);
    same("layernorm stats", &be, &st, &sts, F32);
    let (mut dw, mut db, mut dws, mut dbs) = (be.zeros(h), be.zeros(h), s.zeros(h), s.zeros(h));
    let g = NormGrads {
        dw: &mut dw,
        db: &mut db,
    };
    let dx = be.layernorm_bwd(&xg, &wg, &st, &dyg, h, g);
    let gs = NormGrads {
        dw: &mut dws,
        db: &mut dbs,
    };
    let dxs = s.layernorm_bwd(&xs, &ws, &sts, &dys, h, gs);
    same("layernorm dx", &be, &dx, &dxs, BF16);
    same("layernorm dw", &be, &dw, &dws, F32);
    same("layernorm db", &be, &db, &dbs, F32);

    let (gug, gus) = act(&be, &rand(t * 2 * f, 14), 2 * f);
    let (dag, das) = act(&be, &rand(t * f, 15), f);
    same(
        "swiglu_fwd",
        &be,
        &be.swiglu_fwd(&gug, f),
        &s.swiglu_fwd(&gus, f),
        BF16,
    );
    same(
        "swiglu_bwd",
        &be,
        &be.swiglu_bwd(&gug, &dag, f),
        &s.swiglu_bwd(&gus, &das, f),
        BF16,
    );
    same("gelu_fwd", &be, &be.gelu_fwd(&xg), &s.gelu_fwd(&xs), BF16);
    same(
        "gelu_bwd",
        &be,
        &be.gelu_bwd(&xg, &dyg),
        &s.gelu_bwd(&xs, &dys),
        BF16,
    );

    // RoPE in place on a bf16 activation: 40 tokens of 4 heads of 16.
    let pos: Vec<u32> = (0..t as u32).map(|i| i % 20).collect();
    let (mut qg, mut qs) = (be.copy(&xg), s.copy(&xs));
    be.rope_fwd(&mut qg, &pos, 4, 16, 10000.0);
    s.rope_fwd(&mut qs, &pos, 4, 16, 10000.0);
    same("rope_fwd", &be, &qg, &qs, BF16);
    be.rope_bwd(&mut qg, &pos, 4, 16, 10000.0);
    s.rope_bwd(&mut qs, &pos, 4, 16, 10000.0);
    same("rope_bwd", &be, &qg, &qs, BF16);

    // Attention: 2 sequences of 20, 4 heads of 16 over 2 kv heads.
    let sh = AttnShape {
        batch: 2,
        seq_q: 20,
        seq_kv: 20,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        q_offset: 0,
        causal: true,
    };
    let (kg, ks) = act(&be, &rand(t * 32, 16), 32);
    let (vg, vs) = act(&be, &rand(t * 32, 17), 32);
    let (o, lse) = be.attention_fwd(&xg, &kg, &vg, sh);
    let (os, lses) = s.attention_fwd(&xs, &ks, &vs, sh);
    same("attention o", &be, &o, &os, BF16);
    same("attention lse", &be, &lse, &lses, F32);
    let saved = AttnSaved {
        q: &xg,
        k: &kg,
        v: &vg,
        o: &o,
        lse: &lse,
    };
    let (dq, dk, dv) = be.attention_bwd(saved, &dyg, sh);
    let saved_s = AttnSaved {
        q: &xs,
        k: &ks,
        v: &vs,
        o: &os,
        lse: &lses,
    };
    let (dqs, dks, dvs) = s.attention_bwd(saved_s, &dys, sh);
    same("attention dq", &be, &dq, &dqs, BF16);
    same("attention dk", &be, &dk, &dks, BF16);
    same("attention dv", &be, &dv, &dvs, BF16);

    // Embedding of a fp32 table (read through its bf16 copy), gradient into fp32.
    let vocab = 30;
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 7) % 37).collect();
    let (tg, ts) = up(&be, &rand(vocab * h, 18));
    same(
        "embedding_fwd",
        &be,
        &be.embedding_fwd(&ids, &tg, 5, h),
        &s.embedding_fwd(&ids, &ts, 5, h),
        BF16,
    );
    let (mut dt, mut dts) = (be.zeros(vocab * h), s.zeros(vocab * h));
    be.embedding_bwd(&ids, &dyg, 5, h, &mut dt);
    s.embedding_bwd(&ids, &dys, 5, h, &mut dts);
    same("embedding_bwd", &be, &dt, &dts, F32);

    // Cross-entropy over logits from a GEMM (bf16), 100 entries from 50.
    let v = 100;
    let (lg, ls) = act(
        &be,
        &rand(t * v, 19).iter().map(|x| 4.0 * x).collect::<Vec<_>>(),
        v,
    );
    let tgt: Vec<u32> = (0..t as u32).map(|i| (i * 13) % 160).collect();
    let (l, tl) = be.xent_local(&lg, &tgt, v, 50);
    let (lss, tls) = s.xent_local(&ls, &tgt, v, 50);
    same("xent lse", &be, &l, &lss, F32);
    same("xent target", &be, &tl, &tls, F32);
    same(
        "xent_bwd",
        &be,
        &be.xent_bwd(&lg, &tgt, &l, v, 50, 0.01),
        &s.xent_bwd(&ls, &tgt, &lss, v, 50, 0.01),
        BF16,
    );
}

/// The attention switch through the backend (`SHARDWRIGHT_CUDA_ATTENTION`, which
/// `Cuda::new_with` reads; set here with `with_attention_impl`): bf16 attention of
/// head_dim 64 on the scalar kernels and on the tensor-core ones (attention_mma.cu), both
/// against `Sim`; the tensor-core kernels within 5e-2 (they round P and dS to bf16, which
/// `Sim` does not: tests/cuda_kernels.rs `MMA_TOL`).
#[test]
fn attention_switch_picks_the_tensor_core_kernels() {
    let Some(be) = gpu("attention_switch_picks_the_tensor_core_kernels") else {
        return;
    };
    let s = Sim(Precision::Bf16);
    let sh = AttnShape {
        batch: 2,
        seq_q: 80,
        seq_kv: 80,
        heads: 4,
        kv_heads: 1,
        head_dim: 64,
        q_offset: 0,
        causal: true,
    };
    let t = sh.batch * sh.seq_q;
    let (wq, wk) = (sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim);
    let (qg, qs) = act(&be, &rand(t * wq, 41), wq);
    let (kg, ks) = act(&be, &rand(t * wk, 42), wk);
    let (vg, vs) = act(&be, &rand(t * wk, 43), wk);
    let (dyg, dys) = act(&be, &rand(t * wq, 44), wq);
    let (os, lses) = s.attention_fwd(&qs, &ks, &vs, sh);
    let saved_s = AttnSaved {
        q: &qs,
        k: &ks,
        v: &vs,
        o: &os,
        lse: &lses,
    };
    let (dqs, dks, dvs) = s.attention_bwd(saved_s, &dys, sh);
    for (imp, rel) in [(AttnImpl::Scalar, BF16), (AttnImpl::Mma, 5e-2)] {
        let b = be.with_attention_impl(imp);
        assert_eq!(b.attention_impl(), imp);
        let (o, lse) = b.attention_fwd(&qg, &kg, &vg, sh);
        same(&format!("{imp:?} attention o"), &b, &o, &os, rel);
        same(&format!("{imp:?} attention lse"), &b, &lse, &lses, F32);
        let saved = AttnSaved {
            q: &qg,
            k: &kg,
            v: &vg,
            o: &o,
            lse: &lse,
        };
        let (dq, dk, dv) = b.attention_bwd(saved, &dyg, sh);
        same(&format!("{imp:?} attention dq"), &b, &dq, &dqs, rel);
        same(&format!("{imp:?} attention dk"), &b, &dk, &dks, rel);
        same(&format!("{imp:?} attention dv"), &b, &dv, &dvs, rel);
    }
}

/// AdamW updates the fp32 master and refreshes the bf16 copy GEMMs read: a GEMM after
/// the update sees the new weights (made before the update, the copy would be stale).
#[test]
fn the_working_copy_follows_adamw() {
    let Some(be) = gpu("the_working_copy_follows_adamw") else {
        return;
    };
    let s = Sim(Precision::Bf16);
    let (t, k, n) = (32, 24, 16);
    let (xg, xs) = act(&be, &rand(t * k, 20), k);
    let (mut wg, mut ws) = up(&be, &rand(k * n, 21));
    same(
        "GEMM before",
        &be,
        &be.linear_fwd(&xg, &wg, t, k, n),
        &s.linear_fwd(&xs, &ws, t, k, n),
        BF16,
    );
    let (gg, gs) = up(&be, &rand(k * n, 22));
    let (mut mg, mut vg, mut ms, mut vs) = (
        be.zeros(k * n),
        be.zeros(k * n),
        s.zeros(k * n),
        s.zeros(k * n),
    );
    let h = AdamW {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    be.adamw(&mut wg, &gg, &mut mg, &mut vg, h);
    s.adamw(&mut ws, &gs, &mut ms, &mut vs, h);
    same("master weights", &be, &wg, &ws, 1e-6);
    same("first moment", &be, &mg, &ms, 1e-6);
    same("second moment", &be, &vg, &vs, 1e-6);
    same(
        "GEMM after",
        &be,
        &be.linear_fwd(&xg, &wg, t, k, n),
        &s.linear_fwd(&xs, &ws, t, k, n),
        BF16,
    );
}
