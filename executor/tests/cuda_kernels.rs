//! Every CUDA kernel of `executor/kernels/*.cu` on a GPU against the CPU reference
//! (`backend.rs`'s [`Cpu`], or for the MoE index and permutation kernels, which the
//! reference does inside the interpreter, the dispatch order written out here): random
//! inputs, launched through `cuda::device` with the configurations of `cuda::launch`, in
//! both storage types. bf16 inputs are rounded on the host first and the reference gets the
//! same rounded values, so the comparison measures the kernel's arithmetic and the rounding
//! of its outputs: bf16 outputs within 1e-2 relative, fp32 outputs within 1e-6 to 1e-4
//! (element-wise kernels tighter than reductions and attention); see [`close`]. The
//! tensor-core attention kernels (attention_mma.cu, bf16 only) round probabilities and dS
//! to bf16 as well, so they are held to [`MMA_TOL`], against a host reference that also
//! has key offsets and sliding windows.
//!
//! Feature `cuda` only. Without a CUDA driver, NVRTC or a GPU each test prints
//! `skipped: <reason>` and passes; with a GPU whose kernels fail to compile or load it fails.
//! `scripts/gpu/check.sh` runs it on a GPU machine.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::close;
use shardwright_executor::backend::Routing;
use shardwright_executor::cuda::device::{
    cuda_include_dir, unavailable, CudaSlice, Device, DeviceRepr, LaunchArgs, PushKernelArg,
    ValidAsZeroBits,
};
use shardwright_executor::cuda::launch::{self, Attn, Dtype, Launch, MoeLaunches, Norm};
use shardwright_executor::cuda::{
    adamw_bias_corrections, bf16_bits, bf16_value, embedding_segments, rope_tables,
};
use shardwright_executor::rng::Rng;
use shardwright_executor::{AdamW, AttnSaved, AttnShape, Backend, Cpu, NormGrads};
use std::sync::OnceLock;

static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();

/// GPU 0 with every kernel loaded, or `None` (printing why) when this machine has no GPU.
fn device(test: &str) -> Option<&'static Device> {
    let d = DEVICE.get_or_init(|| match unavailable() {
        Some(why) => Err(why),
        None => Ok(Device::new(0, &cuda_include_dir())
            .unwrap_or_else(|e| panic!("a GPU is present but the kernels do not load: {e}"))),
    });
    match d {
        Ok(d) => Some(d),
        Err(why) => {
            println!("{test}: skipped: {why}");
            None
        }
    }
}

/// A storage type of the kernels: `f32`, or bf16 as its bits (`u16`).
trait Elem: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    const DT: Dtype;
    /// The tolerance of an output stored in this type (fp32 outputs pass their own).
    const TOL: f64;
    fn enc(x: f32) -> Self;
    fn dec(self) -> f32;
}

impl Elem for f32 {
    const DT: Dtype = Dtype::F32;
    const TOL: f64 = 1e-5;
    fn enc(x: f32) -> f32 {
        x
    }
    fn dec(self) -> f32 {
        self
    }
}

impl Elem for u16 {
    const DT: Dtype = Dtype::Bf16;
    const TOL: f64 = 1e-2;
    fn enc(x: f32) -> u16 {
        bf16_bits(x)
    }
    fn dec(self) -> f32 {
        bf16_value(self)
    }
}

fn enc<T: Elem>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::enc(v)).collect()
}

/// The values a kernel storing `T` sees: `x` rounded through `T`.
fn seen<T: Elem>(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| T::enc(v).dec()).collect()
}

fn up<T: Elem>(d: &Device, x: &[f32]) -> CudaSlice<T> {
    d.upload(&enc::<T>(x)).unwrap()
}

fn down<T: Elem>(d: &Device, x: &CudaSlice<T>) -> Vec<f32> {
    d.download(x).unwrap().into_iter().map(T::dec).collect()
}

fn down_f32(d: &Device, x: &CudaSlice<f32>) -> Vec<f32> {
    d.download(x).unwrap()
}

fn u32s(g: &mut Rng, n: usize, below: u64) -> Vec<u32> {
    (0..n).map(|_| g.below(below) as u32).collect()
}

// ---------------------------------------------------------------- embedding

fn embedding<T: Elem>(d: &Device) {
    let s = T::DT.suffix();
    let mut g = Rng::new(11);
    let (tokens, h, vocab) = (96usize, 200usize, 64usize);
    // This shard holds rows [16, 48): about half of the ids are elsewhere.
    let (start, rows) = (16usize, 32usize);
    let ids = u32s(&mut g, tokens, vocab as u64);
    let table = seen::<T>(&g.vec(rows * h, 1.0));
    let want = Cpu.embedding_fwd(&ids, &table, start, h);
    let ids_d = d.upload(&ids).unwrap();
    let table_d = up::<T>(d, &table);
    let mut y = d.zeros::<T>(tokens * h).unwrap();
    let l = launch::embedding_fwd(T::DT, tokens as u64, h as u64).unwrap();
    let (hh, st, rw) = (h as u32, start as u64, rows as u64);
    unsafe {
        d.launch(&l, |b| {
            b.arg(&ids_d)
                .arg(&table_d)
                .arg(&mut y)
                .arg(&hh)
                .arg(&st)
                .arg(&rw);
        })
    }
    .unwrap();
    // A copy: exact in either type.
    close(&format!("embedding_fwd_{s}"), &down(d, &y), &want, 0.0);

    let dy = seen::<T>(&g.vec(tokens * h, 1.0));
    let mut dtable = g.vec(rows * h, 1.0); // accumulated into
    let seg = embedding_segments(&ids, start, rows);
    assert!(
        seg.seg_row.len() > 1,
        "the ids hit several rows of the shard"
    );
    let order_d = d.upload(&seg.order).unwrap();
    let seg_start_d = d.upload(&seg.seg_start).unwrap();
    let seg_row_d = d.upload(&seg.seg_row).unwrap();
    let dy_d = up::<T>(d, &dy);
    let mut dtable_d = d.upload(&dtable).unwrap();
    Cpu.embedding_bwd(&ids, &dy, start, h, &mut dtable);
    let l = launch::embedding_bwd(T::DT, seg.seg_row.len() as u64, h as u64).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&order_d)
                .arg(&seg_start_d)
                .arg(&seg_row_d)
                .arg(&dy_d)
                .arg(&mut dtable_d)
                .arg(&hh);
        })
    }
    .unwrap();
    // fp32 sums in token order on both sides.
    close(
        &format!("embedding_bwd_{s}"),
        &down_f32(d, &dtable_d),
        &dtable,
        1e-6,
    );
}

#[test]
fn embedding_fwd_bwd() {
    if let Some(d) = device("embedding_fwd_bwd") {
        embedding::<f32>(d);
        embedding::<u16>(d);
    }
}

// ---------------------------------------------------------------- norms

/// Adds the `G` rows of `partial` into `out` with `reduce_rows_f32`.
fn reduce_rows(
    d: &Device,
    l: &Launch,
    partial: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    g: u64,
    h: u32,
) {
    let rows = g as u32;
    unsafe {
        d.launch(l, |b| {
            b.arg(partial).arg(out).arg(&rows).arg(&h);
        })
    }
    .unwrap();
}

fn rmsnorm<T: Elem>(d: &Device, t: usize, h: usize) {
    let s = format!("rmsnorm_{}[t={t},h={h}]", T::DT.suffix());
    let mut g = Rng::new(21 + h as u64);
    let x = seen::<T>(&g.vec(t * h, 2.0));
    let w = seen::<T>(&g.vec(h, 1.0));
    let eps = 1e-5f32;
    let (y_ref, rstd_ref) = Cpu.rmsnorm_fwd(&x, &w, h, eps);
    let (x_d, w_d) = (up::<T>(d, &x), up::<T>(d, &w));
    let mut y_d = d.zeros::<T>(t * h).unwrap();
    let mut rstd_d = d.zeros::<f32>(t).unwrap();
    let hh = h as u32;
    let l = launch::norm_fwd(Norm::Rms, T::DT, t as u64, h as u64).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&x_d)
                .arg(&w_d)
                .arg(&mut y_d)
                .arg(&mut rstd_d)
                .arg(&hh)
                .arg(&eps);
        })
    }
    .unwrap();
    close(
        &format!("{s} fwd y"),
        &down(d, &y_d),
        &y_ref,
        T::TOL.max(1e-5),
    );
    close(
        &format!("{s} fwd rstd"),
        &down_f32(d, &rstd_d),
        &rstd_ref,
        1e-5,
    );

    // Backward from the reference's rstd, so only the backward is compared.
    let dy = seen::<T>(&g.vec(t * h, 1.0));
    let mut dw = g.vec(h, 1.0);
    let rstd_in = d.upload(&rstd_ref).unwrap();
    let dy_d = up::<T>(d, &dy);
    let mut dx_d = d.zeros::<T>(t * h).unwrap();
    let mut dw_d = d.upload(&dw).unwrap();
    let dx_ref = Cpu.rmsnorm_bwd(&x, &w, &rstd_ref, &dy, h, &mut dw);
    let [main, red] = launch::norm_bwd(Norm::Rms, T::DT, t as u64, h as u64).unwrap();
    let blocks = main.grid[0] as u64;
    let mut partial = d.zeros::<f32>(blocks as usize * h).unwrap();
    let tt = t as u64;
    unsafe {
        d.launch(&main, |b| {
            b.arg(&x_d)
                .arg(&w_d)
                .arg(&rstd_in)
                .arg(&dy_d)
                .arg(&mut dx_d)
                .arg(&mut partial)
                .arg(&tt)
                .arg(&hh);
        })
    }
    .unwrap();
    reduce_rows(d, &red, &partial, &mut dw_d, blocks, hh);
    close(
        &format!("{s} bwd dx"),
        &down(d, &dx_d),
        &dx_ref,
        T::TOL.max(1e-4),
    );
    close(&format!("{s} bwd dw"), &down_f32(d, &dw_d), &dw, 1e-4);
}

fn layernorm<T: Elem>(d: &Device, t: usize, h: usize) {
    let s = format!("layernorm_{}[t={t},h={h}]", T::DT.suffix());
    let mut g = Rng::new(31 + h as u64);
    // An offset, so the mean matters.
    let x: Vec<f32> = seen::<T>(
        &g.vec(t * h, 2.0)
            .iter()
            .map(|v| v + 0.5)
            .collect::<Vec<_>>(),
    );
    let w = seen::<T>(&g.vec(h, 1.0));
    let bias = seen::<T>(&g.vec(h, 1.0));
    let eps = 1e-5f32;
    let (y_ref, stats_ref) = Cpu.layernorm_fwd(&x, &w, &bias, h, eps);
    let (x_d, w_d, b_d) = (up::<T>(d, &x), up::<T>(d, &w), up::<T>(d, &bias));
    let mut y_d = d.zeros::<T>(t * h).unwrap();
    let mut stats_d = d.zeros::<f32>(2 * t).unwrap();
    let hh = h as u32;
    let l = launch::norm_fwd(Norm::Layer, T::DT, t as u64, h as u64).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&x_d)
                .arg(&w_d)
                .arg(&b_d)
                .arg(&mut y_d)
                .arg(&mut stats_d)
                .arg(&hh)
                .arg(&eps);
        })
    }
    .unwrap();
    close(
        &format!("{s} fwd y"),
        &down(d, &y_d),
        &y_ref,
        T::TOL.max(1e-5),
    );
    close(
        &format!("{s} fwd stats"),
        &down_f32(d, &stats_d),
        &stats_ref,
        1e-5,
    );

    let dy = seen::<T>(&g.vec(t * h, 1.0));
    let mut dw = g.vec(h, 1.0);
    let mut db = g.vec(h, 1.0);
    let stats_in = d.upload(&stats_ref).unwrap();
    let dy_d = up::<T>(d, &dy);
    let mut dx_d = d.zeros::<T>(t * h).unwrap();
    let mut dw_d = d.upload(&dw).unwrap();
    let mut db_d = d.upload(&db).unwrap();
    let dx_ref = Cpu.layernorm_bwd(
        &x,
        &w,
        &stats_ref,
        &dy,
        h,
        NormGrads {
            dw: &mut dw,
            db: &mut db,
        },
    );
    let [main, red] = launch::norm_bwd(Norm::Layer, T::DT, t as u64, h as u64).unwrap();
    let blocks = main.grid[0] as u64;
    let mut pw = d.zeros::<f32>(blocks as usize * h).unwrap();
    let mut pb = d.zeros::<f32>(blocks as usize * h).unwrap();
    let tt = t as u64;
    unsafe {
        d.launch(&main, |b| {
            b.arg(&x_d)
                .arg(&w_d)
                .arg(&stats_in)
                .arg(&dy_d)
                .arg(&mut dx_d)
                .arg(&mut pw)
                .arg(&mut pb)
                .arg(&tt)
                .arg(&hh);
        })
    }
    .unwrap();
    reduce_rows(d, &red, &pw, &mut dw_d, blocks, hh);
    reduce_rows(d, &red, &pb, &mut db_d, blocks, hh);
    close(
        &format!("{s} bwd dx"),
        &down(d, &dx_d),
        &dx_ref,
        T::TOL.max(1e-4),
    );
    close(&format!("{s} bwd dw"), &down_f32(d, &dw_d), &dw, 1e-4);
    close(&format!("{s} bwd db"), &down_f32(d, &db_d), &db, 1e-4);
}

/// 300 rows: more than the 256 partial rows, so blocks loop; width 9000: more than 8 values
/// per thread of a 1024-thread block.
#[test]
fn rmsnorm_and_layernorm_fwd_bwd() {
    if let Some(d) = device("rmsnorm_and_layernorm_fwd_bwd") {
        for (t, h) in [(300, 200), (16, 9000)] {
            rmsnorm::<f32>(d, t, h);
            rmsnorm::<u16>(d, t, h);
            layernorm::<f32>(d, t, h);
            layernorm::<u16>(d, t, h);
        }
    }
}

// ---------------------------------------------------------------- rope

fn rope<T: Elem>(d: &Device) {
    let mut g = Rng::new(41);
    let (t, heads, hd, positions, theta) = (48usize, 3usize, 64usize, 4096usize, 10000.0f32);
    let pos = u32s(&mut g, t, positions as u64);
    let (cos, sin) = rope_tables(positions, hd, theta);
    let (pos_d, cos_d, sin_d) = (
        d.upload(&pos).unwrap(),
        d.upload(&cos).unwrap(),
        d.upload(&sin).unwrap(),
    );
    let (tt, hh, dd) = (t as u64, heads as u32, hd as u32);
    for bwd in [false, true] {
        let x = seen::<T>(&g.vec(t * heads * hd, 1.0));
        let mut want = x.clone();
        if bwd {
            Cpu.rope_bwd(&mut want, &pos, heads, hd, theta);
        } else {
            Cpu.rope_fwd(&mut want, &pos, heads, hd, theta);
        }
        let mut x_d = up::<T>(d, &x);
        let l = launch::rope(T::DT, bwd, tt, heads as u64, hd as u64).unwrap();
        unsafe {
            d.launch(&l, |b| {
                b.arg(&mut x_d)
                    .arg(&pos_d)
                    .arg(&cos_d)
                    .arg(&sin_d)
                    .arg(&tt)
                    .arg(&hh)
                    .arg(&dd);
            })
        }
        .unwrap();
        close(&l.entry, &down(d, &x_d), &want, T::TOL);
    }
}

#[test]
fn rope_fwd_bwd() {
    if let Some(d) = device("rope_fwd_bwd") {
        rope::<f32>(d);
        rope::<u16>(d);
    }
}

// ---------------------------------------------------------------- activations

fn activations<T: Elem>(d: &Device) {
    let mut g = Rng::new(51);
    let (t, f) = (37usize, 300usize);
    let gu = seen::<T>(&g.vec(t * 2 * f, 4.0));
    let dy = seen::<T>(&g.vec(t * f, 1.0));
    let (gu_d, dy_d) = (up::<T>(d, &gu), up::<T>(d, &dy));
    let (tt, ff) = (t as u64, f as u32);

    let mut y_d = d.zeros::<T>(t * f).unwrap();
    let l = launch::swiglu(T::DT, false, tt, f as u64).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&gu_d).arg(&mut y_d).arg(&tt).arg(&ff);
        })
    }
    .unwrap();
    close(&l.entry, &down(d, &y_d), &Cpu.swiglu_fwd(&gu, f), T::TOL);

    let mut dgu_d = d.zeros::<T>(t * 2 * f).unwrap();
    let l = launch::swiglu(T::DT, true, tt, f as u64).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&gu_d).arg(&dy_d).arg(&mut dgu_d).arg(&tt).arg(&ff);
        })
    }
    .unwrap();
    close(
        &l.entry,
        &down(d, &dgu_d),
        &Cpu.swiglu_bwd(&gu, &dy, f),
        T::TOL,
    );

    // GeLU over the gate|up values (t * 2f of them).
    let n = (t * 2 * f) as u64;
    let mut y_d = d.zeros::<T>(t * 2 * f).unwrap();
    let l = launch::gelu(T::DT, false, n).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&gu_d).arg(&mut y_d).arg(&n);
        })
    }
    .unwrap();
    close(&l.entry, &down(d, &y_d), &Cpu.gelu_fwd(&gu), T::TOL);

    let dy2 = seen::<T>(&g.vec(t * 2 * f, 1.0));
    let dy2_d = up::<T>(d, &dy2);
    let mut dx_d = d.zeros::<T>(t * 2 * f).unwrap();
    let l = launch::gelu(T::DT, true, n).unwrap();
    unsafe {
        d.launch(&l, |b| {
            b.arg(&gu_d).arg(&dy2_d).arg(&mut dx_d).arg(&n);
        })
    }
    .unwrap();
    close(&l.entry, &down(d, &dx_d), &Cpu.gelu_bwd(&gu, &dy2), T::TOL);
}

#[test]
fn swiglu_and_gelu_fwd_bwd() {
    if let Some(d) = device("swiglu_and_gelu_fwd_bwd") {
        activations::<f32>(d);
        activations::<u16>(d);
    }
}

// ---------------------------------------------------------------- attention

/// One attention call on the device: its inputs and the kernels' trailing arguments
/// (ATT_ARGS in attention.cu and attention_mma.cu, which share the argument lists), so a
/// test runs any set of launches (`AttnLaunches`) on it.
struct AttnCall<T: Elem> {
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    dims: [u32; 5],
    offsets: [i64; 2],
    mask: [u32; 2],
    scale: f32,
    nq: usize,
    nk: usize,
    rows: usize,
}

impl<T: Elem> AttnCall<T> {
    /// Shape `s`, keys from `k_offset`, sliding `window` (0: none).
    fn new(d: &Device, s: &AttnShape, k_offset: usize, window: usize, qkv: [&[f32]; 3]) -> Self {
        AttnCall {
            q: up::<T>(d, qkv[0]),
            k: up::<T>(d, qkv[1]),
            v: up::<T>(d, qkv[2]),
            dims: [s.seq_q, s.seq_kv, s.heads, s.kv_heads, s.head_dim].map(|x| x as u32),
            offsets: [s.q_offset as i64, k_offset as i64],
            mask: [s.causal as u32, window as u32],
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            nq: s.batch * s.seq_q * s.heads * s.head_dim,
            nk: s.batch * s.seq_kv * s.kv_heads * s.head_dim,
            rows: s.batch * s.heads * s.seq_q,
        }
    }

    /// The trailing arguments, in ATT_ARGS order.
    fn tail<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        for x in &self.dims {
            b.arg(x);
        }
        b.arg(&self.offsets[0]).arg(&self.offsets[1]);
        b.arg(&self.mask[0]).arg(&self.mask[1]).arg(&self.scale);
    }

    /// The forward: (o, lse) on the host.
    fn fwd(&self, d: &Device, ls: &launch::AttnLaunches) -> (Vec<f32>, Vec<f32>) {
        let mut o = d.zeros::<T>(self.nq).unwrap();
        let mut lse = d.zeros::<f32>(self.rows).unwrap();
        unsafe {
            d.launch(&ls.fwd, |b| {
                b.arg(&self.q).arg(&self.k).arg(&self.v);
                b.arg(&mut o).arg(&mut lse);
                self.tail(b);
            })
        }
        .unwrap();
        (down(d, &o), down_f32(d, &lse))
    }

    /// The backward from a given forward (`o` in the storage type, `lse`) and `dout`:
    /// (delta, dq, dk, dv) on the host.
    fn bwd(
        &self,
        d: &Device,
        ls: &launch::AttnLaunches,
        o: &[f32],
        lse: &[f32],
        dout: &[f32],
    ) -> [Vec<f32>; 4] {
        let (o_d, dout_d, lse_d) = (up::<T>(d, o), up::<T>(d, dout), d.upload(lse).unwrap());
        let mut delta = d.zeros::<f32>(self.rows).unwrap();
        let rows = self.rows as u64;
        let [sq, _, hq, _, hd] = self.dims;
        unsafe {
            d.launch(&ls.bwd_delta, |b| {
                b.arg(&o_d).arg(&dout_d).arg(&mut delta);
                b.arg(&rows).arg(&sq).arg(&hq).arg(&hd);
            })
        }
        .unwrap();
        let mut dk = d.zeros::<T>(self.nk).unwrap();
        let mut dv = d.zeros::<T>(self.nk).unwrap();
        unsafe {
            d.launch(&ls.bwd_dkdv, |b| {
                b.arg(&self.q).arg(&self.k).arg(&self.v);
                b.arg(&dout_d).arg(&lse_d).arg(&delta);
                b.arg(&mut dk).arg(&mut dv);
                self.tail(b);
            })
        }
        .unwrap();
        let mut dq = d.zeros::<T>(self.nq).unwrap();
        unsafe {
            d.launch(&ls.bwd_dq, |b| {
                b.arg(&self.q).arg(&self.k).arg(&self.v);
                b.arg(&dout_d).arg(&lse_d).arg(&delta);
                b.arg(&mut dq);
                self.tail(b);
            })
        }
        .unwrap();
        [
            down_f32(d, &delta),
            down(d, &dq),
            down(d, &dk),
            down(d, &dv),
        ]
    }
}

fn attention<T: Elem>(d: &Device, s: AttnShape) {
    let label = format!(
        "attention_{}[b={} sq={} skv={} h={}/{} d={} q_offset={} causal={}]",
        T::DT.suffix(),
        s.batch,
        s.seq_q,
        s.seq_kv,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.q_offset,
        s.causal
    );
    let mut g = Rng::new(61 + s.head_dim as u64);
    let nq = s.batch * s.seq_q * s.heads * s.head_dim;
    let nk = s.batch * s.seq_kv * s.kv_heads * s.head_dim;
    let q = seen::<T>(&g.vec(nq, 1.5));
    let k = seen::<T>(&g.vec(nk, 1.5));
    let v = seen::<T>(&g.vec(nk, 1.0));
    let (o_ref, lse_ref) = Cpu.attention_fwd(&q, &k, &v, s);
    let ls = launch::attention(T::DT, &Attn::from(&s)).unwrap();
    let call = AttnCall::<T>::new(d, &s, 0, 0, [&q, &k, &v]);
    let (o_got, lse_got) = call.fwd(d, &ls);
    close(&format!("{label} o"), &o_got, &o_ref, T::TOL.max(1e-4));
    close(&format!("{label} lse"), &lse_got, &lse_ref, 1e-5);

    // Backward from the reference's forward (o in the storage type), so only it is compared.
    let o = seen::<T>(&o_ref);
    let dout = seen::<T>(&g.vec(nq, 1.0));
    let (dq_ref, dk_ref, dv_ref) = Cpu.attention_bwd(
        AttnSaved {
            q: &q,
            k: &k,
            v: &v,
            o: &o,
            lse: &lse_ref,
        },
        &dout,
        s,
    );
    let [delta, dq, dk, dv] = call.bwd(d, &ls, &o, &lse_ref, &dout);
    let nrows = call.rows;
    // delta = <dout, o> per (batch, head, query), in the lse layout.
    let mut delta_ref = vec![0.0f32; nrows];
    for bi in 0..s.batch {
        for i in 0..s.seq_q {
            for h in 0..s.heads {
                let off = ((bi * s.seq_q + i) * s.heads + h) * s.head_dim;
                delta_ref[(bi * s.heads + h) * s.seq_q + i] =
                    (0..s.head_dim).map(|c| dout[off + c] * o[off + c]).sum();
            }
        }
    }
    close(&format!("{label} delta"), &delta, &delta_ref, 1e-5);
    let tol = T::TOL.max(1e-4);
    close(&format!("{label} dq"), &dq, &dq_ref, tol);
    close(&format!("{label} dk"), &dk, &dk_ref, tol);
    close(&format!("{label} dv"), &dv, &dv_ref, tol);
}

/// Both head-dimension instantiations (64; 80 padded to 128; 128), grouped-query heads,
/// sequences that are not whole tiles, a context-parallel chunk (the second half of the
/// queries against every key) and a non-causal call.
#[test]
fn attention_fwd_bwd() {
    let Some(d) = device("attention_fwd_bwd") else {
        return;
    };
    let shapes = [
        AttnShape {
            batch: 2,
            seq_q: 70,
            seq_kv: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            q_offset: 0,
            causal: true,
        },
        AttnShape {
            batch: 1,
            seq_q: 35,
            seq_kv: 70,
            heads: 4,
            kv_heads: 1,
            head_dim: 80,
            q_offset: 35,
            causal: true,
        },
        AttnShape {
            batch: 2,
            seq_q: 40,
            seq_kv: 40,
            heads: 2,
            kv_heads: 2,
            head_dim: 128,
            q_offset: 0,
            causal: false,
        },
    ];
    for s in shapes {
        attention::<f32>(d, s);
        attention::<u16>(d, s);
    }
}

// ---------------------------------------------------------------- tensor-core attention

/// One call of the tensor-core attention test: a reference shape plus what the CPU
/// reference has no field for (a key offset, as a ring step gives, and a sliding window).
#[derive(Clone, Copy, Debug)]
struct MmaCase {
    s: AttnShape,
    k_offset: usize,
    window: usize,
}

impl MmaCase {
    /// The case's random inputs `[q, k, v, dout]`, as bf16 holds them (the same for the
    /// host-only bound check and the GPU test).
    fn inputs(&self) -> [Vec<f32>; 4] {
        let s = self.s;
        let mut g = Rng::new(91 + s.head_dim as u64);
        let nq = s.batch * s.seq_q * s.heads * s.head_dim;
        let nk = s.batch * s.seq_kv * s.kv_heads * s.head_dim;
        [(nq, 1.5), (nk, 1.5), (nk, 1.0), (nq, 1.0)].map(|(n, a)| seen::<u16>(&g.vec(n, a)))
    }
}

/// Host attention in f64 with a key offset and a window (the kernels' visibility rule):
/// `(o, lse, dq, dk, dv)`; `dout` and `o` give the backward (delta = rowsum(dout o)).
/// With `round` the probabilities and dS are rounded to bf16 where attention_mma.cu rounds
/// them (the operands of P V, P^T dO, dS K and dS^T Q), which is how the bound of
/// [`MMA_TOL`] is checked without a GPU ([`mma_bound_holds_for_bf16_rounding`]).
#[allow(clippy::type_complexity)]
fn attn_ref(
    c: &MmaCase,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    o_in: Option<&[f32]>,
    round: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let s = &c.s;
    let (d, hq, hk) = (s.head_dim, s.heads, s.kv_heads);
    let group = hq / hk;
    let scale = 1.0 / (d as f32).sqrt();
    let r = |x: f64| {
        if round {
            shardwright_executor::cuda::round_bf16(x as f32) as f64
        } else {
            x
        }
    };
    let qi = |b: usize, i: usize, h: usize| ((b * s.seq_q + i) * hq + h) * d;
    let ki = |b: usize, j: usize, h: usize| ((b * s.seq_kv + j) * hk + h) * d;
    let vis = |i: usize, j: usize| {
        let (qp, kp) = ((s.q_offset + i) as i64, (c.k_offset + j) as i64);
        (!s.causal || kp <= qp) && (c.window == 0 || qp - kp < c.window as i64)
    };
    let mut o = vec![0.0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; s.batch * hq * s.seq_q];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f64; q.len()],
        vec![0.0f64; k.len()],
        vec![0.0f64; v.len()],
    );
    for b in 0..s.batch {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..s.seq_q {
                let js: Vec<usize> = (0..s.seq_kv).filter(|&j| vis(i, j)).collect();
                if js.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = js
                    .iter()
                    .map(|&j| {
                        (0..d)
                            .map(|x| q[qi(b, i, h) + x] as f64 * k[ki(b, j, kh) + x] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = sc.iter().map(|&x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                lse[(b * hq + h) * s.seq_q + i] = (m + l.ln()) as f32;
                let mut orow = vec![0.0f64; d];
                for (jj, &j) in js.iter().enumerate() {
                    for x in 0..d {
                        orow[x] += r(p[jj]) * v[ki(b, j, kh) + x] as f64;
                    }
                }
                for x in 0..d {
                    o[qi(b, i, h) + x] = (orow[x] / l) as f32;
                }
                // Backward, from the given o (the stored one) or this one.
                let orow: Vec<f64> = (0..d)
                    .map(|x| match o_in {
                        Some(oi) => oi[qi(b, i, h) + x] as f64,
                        None => orow[x] / l,
                    })
                    .collect();
                let delta: f64 = (0..d).map(|x| dout[qi(b, i, h) + x] as f64 * orow[x]).sum();
                for (jj, &j) in js.iter().enumerate() {
                    // The backward's P from lse (as the kernels recompute it).
                    let pj = p[jj] / l;
                    let dp: f64 = (0..d)
                        .map(|x| dout[qi(b, i, h) + x] as f64 * v[ki(b, j, kh) + x] as f64)
                        .sum();
                    let ds = pj * (dp - delta) * scale as f64;
                    for x in 0..d {
                        dv[ki(b, j, kh) + x] += r(pj) * dout[qi(b, i, h) + x] as f64;
                        dk[ki(b, j, kh) + x] += r(ds) * q[qi(b, i, h) + x] as f64;
                        dq[qi(b, i, h) + x] += r(ds) * k[ki(b, j, kh) + x] as f64;
                    }
                }
            }
        }
    }
    let f = |x: Vec<f64>| x.into_iter().map(|v| v as f32).collect::<Vec<f32>>();
    (o, lse, f(dq), f(dk), f(dv))
}

/// The bound of the tensor-core kernels' bf16 outputs (relative to |ref| + rms): bf16
/// storage and bf16 probabilities and dS. The host model of that rounding
/// ([`mma_bound_holds_for_bf16_rounding`]) reaches 2.0e-2 (dq of the window case; o stays
/// under 7.4e-3), and the kernels themselves under `scripts/emu/run.sh` (a host emulation
/// of ldmatrix and mma.sync, these shapes with other random inputs) 1.7e-2; 5e-2 leaves
/// room for the kernels' other differences (rounding P at the running maximum, fp32
/// accumulation order) while an indexing fault (errors of order 1) still fails.
const MMA_TOL: f64 = 5e-2;

/// The shapes of the tensor-core test: head dims 64 and 128, sequences that are not whole
/// tiles (of 64 rows, 32 or 64 keys), GQA ratios 1, 4 and 8, causal and not, a
/// context-parallel query chunk (q_offset > 0), ring steps (k_offset > 0: the diagonal
/// chunk and one wholly in the past), and a sliding window under which some queries see
/// no key (o = 0, lse = -inf).
fn mma_cases() -> Vec<MmaCase> {
    let sh = |batch, seq_q, seq_kv, heads, kv_heads, head_dim, q_offset, causal| AttnShape {
        batch,
        seq_q,
        seq_kv,
        heads,
        kv_heads,
        head_dim,
        q_offset,
        causal,
    };
    let c = |s, k_offset, window| MmaCase {
        s,
        k_offset,
        window,
    };
    vec![
        c(sh(2, 100, 100, 4, 1, 64, 0, true), 0, 0),
        c(sh(1, 70, 140, 8, 1, 128, 70, true), 0, 0),
        c(sh(2, 90, 90, 2, 2, 128, 0, false), 0, 0),
        c(sh(1, 77, 77, 4, 4, 64, 0, false), 0, 0),
        c(sh(1, 150, 150, 4, 2, 64, 0, true), 0, 40),
        c(sh(1, 50, 50, 4, 2, 128, 50, true), 50, 0),
        c(sh(1, 64, 64, 4, 1, 64, 128, true), 64, 0),
        c(sh(1, 40, 100, 4, 1, 64, 100, true), 0, 16),
        c(sh(1, 130, 130, 8, 2, 128, 0, true), 0, 33),
        // Warps without a valid row; a few queries at the end of a long sequence.
        c(sh(2, 5, 5, 2, 1, 64, 0, true), 0, 0),
        c(sh(1, 3, 200, 4, 2, 128, 197, true), 0, 0),
    ]
}

/// The rounding the kernels add (bf16 P and dS) stays within [`MMA_TOL`] of the f32
/// reference on every shape of [`mma_cases`], with a factor of 2 to spare; and the host
/// reference without rounding is the CPU reference's attention where that has the call
/// (no key offset, no window). Runs without a GPU.
#[test]
fn mma_bound_holds_for_bf16_rounding() {
    for c in mma_cases() {
        let s = c.s;
        let [q, k, v, dout] = c.inputs();
        let exact = attn_ref(&c, &q, &k, &v, &dout, None, false);
        let rounded = attn_ref(&c, &q, &k, &v, &dout, None, true);
        let label = format!("{c:?}");
        if c.k_offset == 0 && c.window == 0 {
            let (o, lse) = Cpu.attention_fwd(&q, &k, &v, s);
            close(&format!("{label} ref o"), &exact.0, &o, 1e-5);
            close(&format!("{label} ref lse"), &exact.1, &lse, 1e-6);
            let (dq, dk, dv) = Cpu.attention_bwd(
                AttnSaved {
                    q: &q,
                    k: &k,
                    v: &v,
                    o: &o,
                    lse: &lse,
                },
                &dout,
                s,
            );
            close(&format!("{label} ref dq"), &exact.2, &dq, 1e-4);
            close(&format!("{label} ref dk"), &exact.3, &dk, 1e-4);
            close(&format!("{label} ref dv"), &exact.4, &dv, 1e-4);
        }
        // Stored outputs are rounded to bf16 too.
        for (what, got, want) in [
            ("o", &rounded.0, &exact.0),
            ("dq", &rounded.2, &exact.2),
            ("dk", &rounded.3, &exact.3),
            ("dv", &rounded.4, &exact.4),
        ] {
            let got = seen::<u16>(got);
            close(
                &format!("{label} rounded {what}"),
                &got,
                want,
                MMA_TOL / 2.0,
            );
        }
    }
}

/// Runs the launches `ls` (forward; delta, dK/dV and dQ from the reference's o) on case `c`
/// and compares each output with the host reference within `tol` (lse within 1e-4).
fn attention_case(d: &Device, c: &MmaCase, ls: &launch::AttnLaunches, tol: f64) {
    let s = c.s;
    let label = format!("{} {c:?}", ls.fwd.entry);
    let [q, k, v, dout] = c.inputs();
    let (o_ref, lse_ref, ..) = attn_ref(c, &q, &k, &v, &dout, None, false);
    // The backward from the reference's forward (o stored as bf16), as attention_fwd_bwd.
    let o = seen::<u16>(&o_ref);
    let (_, _, dq_ref, dk_ref, dv_ref) = attn_ref(c, &q, &k, &v, &dout, Some(&o), false);

    let call = AttnCall::<u16>::new(d, &s, c.k_offset, c.window, [&q, &k, &v]);
    let (o_got, lse_got) = call.fwd(d, ls);
    close(&format!("{label} o"), &o_got, &o_ref, tol);
    close(&format!("{label} lse"), &lse_got, &lse_ref, 1e-4);
    let [_, dq, dk, dv] = call.bwd(d, ls, &o, &lse_ref, &dout);
    close(&format!("{label} dq"), &dq, &dq_ref, tol);
    close(&format!("{label} dk"), &dk, &dk_ref, tol);
    close(&format!("{label} dv"), &dv, &dv_ref, tol);
}

fn attn_launch_shape(c: &MmaCase) -> Attn {
    Attn {
        window: c.window as u64,
        ..Attn::from(&c.s)
    }
}

/// The tensor-core kernels (attention_mma.cu) against the host reference on every shape
/// of [`mma_cases`], bf16 bounds ([`MMA_TOL`]); the scalar bf16 kernels on the same cases
/// (key offsets and windows are otherwise untested on them) within bf16 storage's bound.
#[test]
fn attention_mma_fwd_bwd() {
    let Some(d) = device("attention_mma_fwd_bwd") else {
        return;
    };
    for c in mma_cases() {
        let a = attn_launch_shape(&c);
        let mma = launch::attention_mma(&a).unwrap();
        assert!(mma.fwd.entry.starts_with("attn_mma_fwd_bf16_d"));
        attention_case(d, &c, &mma, MMA_TOL);
        let scalar = launch::attention(Dtype::Bf16, &a).unwrap();
        attention_case(d, &c, &scalar, u16::TOL);
    }
}

// ---------------------------------------------------------------- cross-entropy

/// Vocabulary-parallel over two shards: per shard the local pass, the all-reduces done
/// here on the host (max, then sums), `xent_rescale` and `xent_finish`; the loss against
/// the reference's on the whole vocabulary, and each shard's gradient against its
/// `xent_bwd` with the global lse.
fn xent<T: Elem>(d: &Device) {
    let s = T::DT.suffix();
    let mut g = Rng::new(71);
    let (t, vocab, shards) = (33usize, 1000usize, 2usize);
    let v = vocab / shards;
    let logits = seen::<T>(&g.vec(t * vocab, 6.0));
    let targets = u32s(&mut g, t, vocab as u64);
    let (lse_full, tgt_full) = Cpu.xent_local(&logits, &targets, vocab, 0);
    let targets_d = d.upload(&targets).unwrap();
    let ls = launch::xent(T::DT, t as u64, v as u64).unwrap();
    let (tt, vv) = (t as u64, v as u32);
    let shard = |r: usize| -> Vec<f32> {
        (0..t)
            .flat_map(|i| logits[i * vocab + r * v..i * vocab + (r + 1) * v].to_vec())
            .collect()
    };
    let mut locals = Vec::new();
    for r in 0..shards {
        let x = shard(r);
        let start = (r * v) as u64;
        let x_d = up::<T>(d, &x);
        let mut mx = d.zeros::<f32>(t).unwrap();
        let mut se = d.zeros::<f32>(t).unwrap();
        let mut lse = d.zeros::<f32>(t).unwrap();
        let mut tg = d.zeros::<f32>(t).unwrap();
        unsafe {
            d.launch(&ls.fwd_local, |b| {
                b.arg(&x_d)
                    .arg(&targets_d)
                    .arg(&mut mx)
                    .arg(&mut se)
                    .arg(&mut lse)
                    .arg(&mut tg)
                    .arg(&vv)
                    .arg(&start);
            })
        }
        .unwrap();
        let (lse_ref, tg_ref) = Cpu.xent_local(&x, &targets, v, r * v);
        let mx_ref: Vec<f32> = (0..t)
            .map(|i| {
                x[i * v..(i + 1) * v]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        close(
            &format!("xent_fwd_local_{s} shard {r} max"),
            &down_f32(d, &mx),
            &mx_ref,
            0.0,
        );
        close(
            &format!("xent_fwd_local_{s} shard {r} lse"),
            &down_f32(d, &lse),
            &lse_ref,
            1e-5,
        );
        close(
            &format!("xent_fwd_local_{s} shard {r} target"),
            &down_f32(d, &tg),
            &tg_ref,
            0.0,
        );
        locals.push((x_d, mx, se, down_f32(d, &tg)));
    }
    // all-reduce(max)
    let maxes: Vec<Vec<f32>> = locals.iter().map(|l| down_f32(d, &l.1)).collect();
    let gmax: Vec<f32> = (0..t)
        .map(|i| maxes.iter().map(|m| m[i]).fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let gmax_d = d.upload(&gmax).unwrap();
    // rescale per shard, then all-reduce(sum) of it and of the target logits
    let mut gsum = vec![0.0f32; t];
    let mut gtgt = vec![0.0f32; t];
    for (_, mx, se, tg) in &locals {
        let mut out = d.zeros::<f32>(t).unwrap();
        unsafe {
            d.launch(&ls.rescale, |b| {
                b.arg(mx).arg(se).arg(&gmax_d).arg(&mut out).arg(&tt);
            })
        }
        .unwrap();
        let out = down_f32(d, &out);
        for i in 0..t {
            gsum[i] += out[i];
            gtgt[i] += tg[i];
        }
    }
    let (gsum_d, gtgt_d) = (d.upload(&gsum).unwrap(), d.upload(&gtgt).unwrap());
    let mut lse_d = d.zeros::<f32>(t).unwrap();
    let mut loss_d = d.zeros::<f32>(t).unwrap();
    unsafe {
        d.launch(&ls.finish, |b| {
            b.arg(&gmax_d)
                .arg(&gsum_d)
                .arg(&gtgt_d)
                .arg(&mut lse_d)
                .arg(&mut loss_d)
                .arg(&tt);
        })
    }
    .unwrap();
    let loss_ref: Vec<f32> = lse_full.iter().zip(&tgt_full).map(|(l, x)| l - x).collect();
    close(
        &format!("xent_finish ({s} logits) lse"),
        &down_f32(d, &lse_d),
        &lse_full,
        1e-5,
    );
    close(
        &format!("xent_finish ({s} logits) loss"),
        &down_f32(d, &loss_d),
        &loss_ref,
        1e-5,
    );

    // Backward per shard with the reference's global lse.
    let lse_in = d.upload(&lse_full).unwrap();
    let scale = 1.0 / t as f32;
    for (r, (x_d, ..)) in locals.iter().enumerate() {
        let start = (r * v) as u64;
        let mut dl = d.zeros::<T>(t * v).unwrap();
        unsafe {
            d.launch(&ls.bwd, |b| {
                b.arg(x_d)
                    .arg(&targets_d)
                    .arg(&lse_in)
                    .arg(&mut dl)
                    .arg(&vv)
                    .arg(&start)
                    .arg(&scale);
            })
        }
        .unwrap();
        let want = Cpu.xent_bwd(&shard(r), &targets, &lse_full, v, r * v, scale);
        close(
            &format!("xent_bwd_{s} shard {r}"),
            &down(d, &dl),
            &want,
            T::TOL,
        );
    }
}

#[test]
fn vocab_parallel_cross_entropy() {
    if let Some(d) = device("vocab_parallel_cross_entropy") {
        xent::<f32>(d);
        xent::<u16>(d);
    }
}

// ---------------------------------------------------------------- adamw

fn adamw<T: Elem>(d: &Device) {
    let s = T::DT.suffix();
    let mut g = Rng::new(81);
    let n = 10_000usize;
    let h = AdamW {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    };
    let mut p = g.vec(n, 1.0);
    let grad = seen::<T>(&g.vec(n, 1.0));
    let mut m = g.vec(n, 0.1);
    let mut v: Vec<f32> = g.vec(n, 0.1).iter().map(|x| x * x).collect();
    let mut p_d = d.upload(&p).unwrap();
    let g_d = up::<T>(d, &grad);
    let mut m_d = d.upload(&m).unwrap();
    let mut v_d = d.upload(&v).unwrap();
    let mut pb_d = d.zeros::<u16>(n).unwrap();
    Cpu.adamw(&mut p, &grad, &mut m, &mut v, h);
    let (bc1, bc2) = adamw_bias_corrections(&h);
    let nn = n as u64;
    let l = launch::adamw(T::DT, nn).unwrap();
    // The bf16 copy-out for bf16 gradients; a null pointer (none) for fp32 ones.
    let with_copy = T::DT == Dtype::Bf16;
    let null = 0u64;
    unsafe {
        d.launch(&l, |b| {
            b.arg(&mut p_d).arg(&g_d).arg(&mut m_d).arg(&mut v_d);
            if with_copy {
                b.arg(&mut pb_d);
            } else {
                b.arg(&null);
            }
            b.arg(&nn)
                .arg(&h.lr)
                .arg(&h.beta1)
                .arg(&h.beta2)
                .arg(&h.eps)
                .arg(&h.weight_decay)
                .arg(&bc1)
                .arg(&bc2);
        })
    }
    .unwrap();
    let p_gpu = down_f32(d, &p_d);
    close(&format!("adamw_{s} p"), &p_gpu, &p, 1e-6);
    close(&format!("adamw_{s} m"), &down_f32(d, &m_d), &m, 1e-6);
    close(&format!("adamw_{s} v"), &down_f32(d, &v_d), &v, 1e-6);
    let pb = d.download(&pb_d).unwrap();
    if with_copy {
        let want: Vec<u16> = p_gpu.iter().map(|&x| bf16_bits(x)).collect();
        assert_eq!(
            pb, want,
            "adamw_{s}: the bf16 copy is the updated weight rounded"
        );
    } else {
        assert!(
            pb.iter().all(|&b| b == 0),
            "adamw_{s}: no copy-out through a null pointer"
        );
    }
}

#[test]
fn adamw_fp32_and_bf16_gradients() {
    if let Some(d) = device("adamw_fp32_and_bf16_gradients") {
        adamw::<f32>(d);
        adamw::<u16>(d);
    }
}

// ---------------------------------------------------------------- moe

/// The dispatch order (interp.rs): rows grouped by expert, each group in slot order
/// (slot `s = i k + j`). Returns `(counts, offsets, row_slot, slot_row)`.
fn dispatch_order(experts: &[u32], e: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut counts = vec![0u32; e];
    for &x in experts {
        counts[x as usize] += 1;
    }
    let mut offsets = vec![0u32; e + 1];
    for x in 0..e {
        offsets[x + 1] = offsets[x] + counts[x];
    }
    let mut row_slot = Vec::with_capacity(experts.len());
    for x in 0..e as u32 {
        row_slot.extend((0..experts.len() as u32).filter(|&s| experts[s as usize] == x));
    }
    let mut slot_row = vec![0u32; experts.len()];
    for (row, &s) in row_slot.iter().enumerate() {
        slot_row[s as usize] = row as u32;
    }
    (counts, offsets, row_slot, slot_row)
}

/// The sizes of the MoE test and its launches: `t` tokens routed to `k` of `e` experts,
/// hidden size `h`; the `u64`/`u32` copies are the kernels' arguments.
struct MoeCase {
    t: usize,
    e: usize,
    k: usize,
    h: usize,
    slots: usize,
    ls: MoeLaunches,
    tt: u64,
    ee: u32,
    kk: u32,
    hh: u32,
    ss: u64,
}

/// The device side of the routing: expert ids and gates per slot (the reference's).
struct MoeRouted {
    x_in: CudaSlice<u32>,
    g_in: CudaSlice<f32>,
}

/// The dispatch order (the reference's) and its device copies.
struct MoeDispatch {
    row_slot: Vec<u32>,
    slot_row: Vec<u32>,
    row_slot_d: CudaSlice<u32>,
    slot_row_d: CudaSlice<u32>,
}

fn moe<T: Elem>(d: &Device) {
    let mut g = Rng::new(91);
    let (t, e, k, h) = (100usize, 8usize, 2usize, 96usize);
    let slots = t * k;
    let m = MoeCase {
        t,
        e,
        k,
        h,
        slots,
        ls: launch::moe(T::DT, t as u64, e as u64, k as u64, h as u64).unwrap(),
        tt: t as u64,
        ee: e as u32,
        kk: k as u32,
        hh: h as u32,
        ss: slots as u64,
    };
    let r = moe_route(d, &m, &mut g);
    let routed = moe_route_bwd(d, &m, &mut g, &r);
    let dispatch = moe_count_index(d, &m, &r, &routed);
    moe_permute::<T>(d, &m, &mut g, &dispatch);
    moe_unpermute::<T>(d, &m, &mut g, &r, &routed, &dispatch);
}

/// `moe_route_topk` against [`Cpu::route`]; the reference's routing.
fn moe_route(d: &Device, m: &MoeCase, g: &mut Rng) -> Routing {
    let (t, e, k, slots) = (m.t, m.e, m.k, m.slots);
    let (tt, ee, kk) = (m.tt, m.ee, m.kk);
    let logits = g.vec(t * e, 3.0);
    let r = Cpu.route(&logits, e, k);
    let logits_d = d.upload(&logits).unwrap();
    let mut probs_d = d.zeros::<f32>(t * e).unwrap();
    let mut experts_d = d.zeros::<u32>(slots).unwrap();
    let mut gates_d = d.zeros::<f32>(slots).unwrap();
    unsafe {
        d.launch(&m.ls.route, |b| {
            b.arg(&logits_d)
                .arg(&mut probs_d)
                .arg(&mut experts_d)
                .arg(&mut gates_d)
                .arg(&tt)
                .arg(&ee)
                .arg(&kk);
        })
    }
    .unwrap();
    close(
        "moe_route_topk probs",
        &down_f32(d, &probs_d),
        &r.probs,
        1e-5,
    );
    assert_eq!(
        d.download(&experts_d).unwrap(),
        r.experts,
        "moe_route_topk experts"
    );
    close(
        "moe_route_topk gates",
        &down_f32(d, &gates_d),
        &r.gates,
        1e-5,
    );
    r
}

/// `moe_route_bwd`, from the reference's routing (which stays on the device for the rest).
fn moe_route_bwd(d: &Device, m: &MoeCase, g: &mut Rng, r: &Routing) -> MoeRouted {
    let (t, e, k, slots) = (m.t, m.e, m.k, m.slots);
    let (tt, ee, kk) = (m.tt, m.ee, m.kk);
    let dgates = g.vec(slots, 1.0);
    let dprobs = g.vec(t * e, 0.1);
    let want = Cpu.route_bwd(r, &dgates, &dprobs, e, k);
    let (p_in, x_in, g_in) = (
        d.upload(&r.probs).unwrap(),
        d.upload(&r.experts).unwrap(),
        d.upload(&r.gates).unwrap(),
    );
    let (dg_d, dp_d) = (d.upload(&dgates).unwrap(), d.upload(&dprobs).unwrap());
    let mut dl_d = d.zeros::<f32>(t * e).unwrap();
    unsafe {
        d.launch(&m.ls.route_bwd, |b| {
            b.arg(&p_in)
                .arg(&x_in)
                .arg(&g_in)
                .arg(&dg_d)
                .arg(&dp_d)
                .arg(&mut dl_d)
                .arg(&tt)
                .arg(&ee)
                .arg(&kk);
        })
    }
    .unwrap();
    close("moe_route_bwd", &down_f32(d, &dl_d), &want, 1e-5);
    MoeRouted { x_in, g_in }
}

/// `moe_count` and `moe_index` against [`dispatch_order`] (exact).
fn moe_count_index(d: &Device, m: &MoeCase, r: &Routing, routed: &MoeRouted) -> MoeDispatch {
    let (e, slots) = (m.e, m.slots);
    let (ee, ss) = (m.ee, m.ss);
    let x_in = &routed.x_in;
    let (counts, offsets, row_slot, slot_row) = dispatch_order(&r.experts, e);
    let mut counts_d = d.zeros::<u32>(e).unwrap();
    unsafe {
        d.launch(&m.ls.count, |b| {
            b.arg(x_in).arg(&mut counts_d).arg(&ss);
        })
    }
    .unwrap();
    assert_eq!(d.download(&counts_d).unwrap(), counts, "moe_count");
    let mut offsets_d = d.zeros::<u32>(e + 1).unwrap();
    let mut row_slot_d = d.zeros::<u32>(slots).unwrap();
    let mut slot_row_d = d.zeros::<u32>(slots).unwrap();
    unsafe {
        d.launch(&m.ls.index, |b| {
            b.arg(x_in)
                .arg(&counts_d)
                .arg(&mut offsets_d)
                .arg(&mut row_slot_d)
                .arg(&mut slot_row_d)
                .arg(&ss)
                .arg(&ee);
        })
    }
    .unwrap();
    assert_eq!(
        d.download(&offsets_d).unwrap(),
        offsets,
        "moe_index offsets"
    );
    assert_eq!(
        d.download(&row_slot_d).unwrap(),
        row_slot,
        "moe_index row_slot"
    );
    assert_eq!(
        d.download(&slot_row_d).unwrap(),
        slot_row,
        "moe_index slot_row"
    );
    println!("moe_count, moe_index: {slots} slots over {e} experts, exact");
    MoeDispatch {
        row_slot,
        slot_row,
        row_slot_d,
        slot_row_d,
    }
}

/// Permute: y[row] = x[row_slot[row] / k].
fn moe_permute<T: Elem>(d: &Device, m: &MoeCase, g: &mut Rng, dispatch: &MoeDispatch) {
    let s = T::DT.suffix();
    let (t, k, h, slots) = (m.t, m.k, m.h, m.slots);
    let (hh, kk) = (m.hh, m.kk);
    let x = seen::<T>(&g.vec(t * h, 1.0));
    let x_d = up::<T>(d, &x);
    let mut y_d = d.zeros::<T>(slots * h).unwrap();
    unsafe {
        d.launch(&m.ls.permute, |b| {
            b.arg(&x_d)
                .arg(&dispatch.row_slot_d)
                .arg(&mut y_d)
                .arg(&hh)
                .arg(&kk);
        })
    }
    .unwrap();
    let y_ref: Vec<f32> = dispatch
        .row_slot
        .iter()
        .flat_map(|&sl| {
            let tok = sl as usize / k;
            x[tok * h..(tok + 1) * h].to_vec()
        })
        .collect();
    close(&format!("moe_permute_{s}"), &down(d, &y_d), &y_ref, 0.0);
}

/// Unpermute (the combine, gates weighted; and without gates, the dispatch's backward),
/// then its backward: dy[row] = gate dout[token], dgates[slot] = <y[row], dout[token]>.
fn moe_unpermute<T: Elem>(
    d: &Device,
    m: &MoeCase,
    g: &mut Rng,
    r: &Routing,
    routed: &MoeRouted,
    dispatch: &MoeDispatch,
) {
    let s = T::DT.suffix();
    let (t, k, h, slots) = (m.t, m.k, m.h, m.slots);
    let (hh, kk) = (m.hh, m.kk);
    let (g_in, slot_row, slot_row_d) = (&routed.g_in, &dispatch.slot_row, &dispatch.slot_row_d);
    let y = seen::<T>(&g.vec(slots * h, 1.0));
    let y_in = up::<T>(d, &y);
    let null = 0u64;
    for gated in [true, false] {
        let mut out_d = d.zeros::<T>(t * h).unwrap();
        unsafe {
            d.launch(&m.ls.unpermute, |b| {
                b.arg(&y_in).arg(slot_row_d);
                if gated {
                    b.arg(g_in);
                } else {
                    b.arg(&null);
                }
                b.arg(&mut out_d).arg(&hh).arg(&kk);
            })
        }
        .unwrap();
        let mut want = vec![0.0f32; t * h];
        for i in 0..t {
            for c in 0..h {
                let mut acc = 0.0f32;
                for j in 0..k {
                    let gate = if gated { r.gates[i * k + j] } else { 1.0 };
                    acc += gate * y[slot_row[i * k + j] as usize * h + c];
                }
                want[i * h + c] = acc;
            }
        }
        close(
            &format!("moe_unpermute_{s} gated={gated}"),
            &down(d, &out_d),
            &want,
            T::TOL,
        );
    }

    let dout = seen::<T>(&g.vec(t * h, 1.0));
    let dout_d = up::<T>(d, &dout);
    let mut dy_d = d.zeros::<T>(slots * h).unwrap();
    let mut dgates_d = d.zeros::<f32>(slots).unwrap();
    unsafe {
        d.launch(&m.ls.unpermute_bwd, |b| {
            b.arg(&dout_d)
                .arg(&y_in)
                .arg(slot_row_d)
                .arg(g_in)
                .arg(&mut dy_d)
                .arg(&mut dgates_d)
                .arg(&hh)
                .arg(&kk);
        })
    }
    .unwrap();
    let mut dy_ref = vec![0.0f32; slots * h];
    let mut dg_ref = vec![0.0f32; slots];
    for sl in 0..slots {
        let (tok, row) = (sl / k, slot_row[sl] as usize);
        for c in 0..h {
            dy_ref[row * h + c] = r.gates[sl] * dout[tok * h + c];
            dg_ref[sl] += y[row * h + c] * dout[tok * h + c];
        }
    }
    close(
        &format!("moe_unpermute_bwd_{s} dy"),
        &down(d, &dy_d),
        &dy_ref,
        T::TOL,
    );
    close(
        &format!("moe_unpermute_bwd_{s} dgates"),
        &down_f32(d, &dgates_d),
        &dg_ref,
        1e-4,
    );
}

#[test]
fn moe_route_permute_unpermute() {
    if let Some(d) = device("moe_route_permute_unpermute") {
        moe::<f32>(d);
        moe::<u16>(d);
    }
}

// ---------------------------------------------------------------- casts

#[test]
fn casts_round_to_nearest_even() {
    let Some(d) = device("casts_round_to_nearest_even") else {
        return;
    };
    let mut g = Rng::new(101);
    let mut x = g.vec(4000, 100.0);
    // Ties (to even), signed zeros, infinities, overflow, subnormals.
    x.extend([
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        -0.0,
        0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::from_bits(1),
        f32::from_bits(0x0001_8000),
        1e-40,
    ]);
    let n = x.len() as u64;
    let x_d = d.upload(&x).unwrap();
    let mut y_d = d.zeros::<u16>(x.len()).unwrap();
    unsafe {
        d.launch(&launch::cast(true, n).unwrap(), |b| {
            b.arg(&x_d).arg(&mut y_d).arg(&n);
        })
    }
    .unwrap();
    let bits = d.download(&y_d).unwrap();
    let want: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
    for (i, (&b, &w)) in bits.iter().zip(&want).enumerate() {
        assert_eq!(
            b, w,
            "cast_f32_to_bf16({:e}) [{i}]: GPU {b:#06x}, host {w:#06x}",
            x[i]
        );
    }
    let mut back_d = d.zeros::<f32>(x.len()).unwrap();
    unsafe {
        d.launch(&launch::cast(false, n).unwrap(), |b| {
            b.arg(&y_d).arg(&mut back_d).arg(&n);
        })
    }
    .unwrap();
    let back = d.download(&back_d).unwrap();
    for (i, (&b, &w)) in back.iter().zip(&want).enumerate() {
        assert_eq!(
            b.to_bits(),
            bf16_value(w).to_bits(),
            "cast_bf16_to_f32 [{i}]"
        );
    }
    println!("cast_f32_to_bf16, cast_bf16_to_f32: {n} values, bit-exact");
}

/// `sum_squares_*` and `checksum_*` (the gradient norm's and the replicas' weight hashes
/// on the device) against the host: the f64 sum of squares of the values the kernel reads
/// (within f64 rounding of another order), and `weights_hash` of them bit for bit (a
/// wrapping sum, so any order gives the same bits); a single flipped bit changes the
/// hash. Sizes below one block, across the grid cap, and ragged.
fn reductions<T: Elem>(d: &Device) {
    let mut g = Rng::new(77);
    for n in [1usize, 255, 257, 70_001, 300_000] {
        let x = g.vec(n, 3.0);
        let want_ss: f64 = seen::<T>(&x).iter().map(|&v| (v as f64).powi(2)).sum();
        let x_d = up::<T>(d, &x);
        let nn = n as u64;
        let l = launch::buffer_reduce(&format!("sum_squares_{}", T::DT.suffix()), nn).unwrap();
        let mut part = d.zeros::<f64>(l.grid[0] as usize).unwrap();
        unsafe {
            d.launch(&l, |b| {
                b.arg(&x_d).arg(&nn).arg(&mut part);
            })
        }
        .unwrap();
        let got_ss: f64 = d.download(&part).unwrap().iter().sum();
        assert!(
            (got_ss - want_ss).abs() <= 1e-12 * want_ss,
            "sum_squares_{} n={n}: GPU {got_ss}, host {want_ss}",
            T::DT.suffix()
        );
        let hash = |x_d: &CudaSlice<T>| {
            let l = launch::buffer_reduce(&format!("checksum_{}", T::DT.suffix()), nn).unwrap();
            let mut out = d.zeros::<u64>(1).unwrap();
            unsafe {
                d.launch(&l, |b| {
                    b.arg(x_d).arg(&nn).arg(&mut out);
                })
            }
            .unwrap();
            d.download(&out).unwrap()[0]
        };
        let want = shardwright_executor::backend::weights_hash(&seen::<T>(&x));
        assert_eq!(hash(&x_d), want, "checksum_{} n={n}", T::DT.suffix());
        let mut y = enc::<T>(&x);
        let i = n / 2;
        y[i] = T::enc(-x[i]);
        let y_d = d.upload(&y).unwrap();
        assert_ne!(
            hash(&y_d),
            want,
            "checksum_{} n={n}: a sign flip",
            T::DT.suffix()
        );
    }
}

#[test]
fn sum_squares_and_checksums_match_the_host() {
    let Some(d) = device("sum_squares_and_checksums_match_the_host") else {
        return;
    };
    reductions::<f32>(d);
    reductions::<u16>(d);
}

/// Many ranges in one launch (`moves_*`, the QKV split's per-token rows; `moves_strided_*`
/// where they are in arithmetic progression with one factor): the CUDA backend's `gather`,
/// `copy_ranges`, `scale_ranges` and `axpy_ranges` over 3,000 rows against the CPU
/// reference: copies and scalings bit for bit, adds within one rounding (a fused
/// multiply-add on the GPU); overlapping destinations (applied in order) too.
#[test]
fn batched_ranges_match_the_cpu_reference() {
    use shardwright_executor::cuda::backend::Cuda;
    if device("batched_ranges_match_the_cpu_reference").is_none() {
        return;
    }
    let gpu = Cuda::new(0).expect("CUDA backend");
    let mut g = Rng::new(5);
    let (rows, w, lo, n) = (3000usize, 96usize, 32usize, 40usize);
    let x = g.vec(rows * w, 2.0);
    let base = g.vec(rows * n, 1.0);
    let xg = gpu.upload(&x);
    let ranges: Vec<(usize, usize)> = (0..rows).map(|r| (r * w + lo, n)).collect();
    assert_eq!(
        gpu.download(&gpu.gather(&xg, &ranges)),
        Cpu.gather(&x, &ranges)
    );
    let moves: Vec<(usize, usize)> = (0..rows)
        .map(|r| (r * w + lo, (rows - 1 - r) * n))
        .collect();
    let scaled: Vec<(usize, usize, f32)> = moves
        .iter()
        .enumerate()
        .map(|(i, &(s, d))| (s, d, 0.5 + i as f32 * 1e-3))
        .collect();
    let mut want = base.clone();
    Cpu.copy_ranges(&mut want, &x, n, &moves);
    let mut got = gpu.upload(&base);
    gpu.copy_ranges(&mut got, &xg, n, &moves);
    assert_eq!(gpu.download(&got), want, "copy_ranges");
    let mut want = base.clone();
    Cpu.scale_ranges(&mut want, &x, n, &scaled);
    let mut got = gpu.upload(&base);
    gpu.scale_ranges(&mut got, &xg, n, &scaled);
    assert_eq!(gpu.download(&got), want, "scale_ranges");
    // Disjoint destinations (one launch) and overlapping ones (in order, one per range).
    let overlapping: Vec<(usize, usize, f32)> = scaled.iter().map(|&(s, _, a)| (s, 0, a)).collect();
    for (what, m) in [("disjoint", &scaled), ("overlapping", &overlapping)] {
        let mut want = base.clone();
        Cpu.axpy_ranges(&mut want, &x, n, m);
        let mut got = gpu.upload(&base);
        gpu.axpy_ranges(&mut got, &xg, n, m);
        close(
            &format!("axpy_ranges ({what})"),
            &gpu.download(&got),
            &want,
            1e-5,
        );
    }
    // Ranges in arithmetic progression with one factor run `moves_strided_*` (no offsets
    // uploaded): ascending destinations, a source step of zero (one row broadcast), and
    // more ranges (70,000) than the grid's y dimension holds (65,535).
    let up: Vec<(usize, usize)> = (0..rows).map(|r| (r * w + lo, r * n)).collect();
    let bcast: Vec<(usize, usize)> = (0..rows).map(|r| (lo, r * n)).collect();
    for (what, m) in [("ascending", &up), ("broadcast", &bcast)] {
        assert!(shardwright_executor::cuda::launch::progression(
            &m.iter().map(|&(s, d)| (s, d, 1.0)).collect::<Vec<_>>()
        )
        .is_some());
        let mut want = base.clone();
        Cpu.copy_ranges(&mut want, &x, n, m);
        let mut got = gpu.upload(&base);
        gpu.copy_ranges(&mut got, &xg, n, m);
        assert_eq!(gpu.download(&got), want, "copy_ranges ({what}, strided)");
        let f: Vec<(usize, usize, f32)> = m.iter().map(|&(s, d)| (s, d, 0.75)).collect();
        let mut want = base.clone();
        Cpu.scale_ranges(&mut want, &x, n, &f);
        let mut got = gpu.upload(&base);
        gpu.scale_ranges(&mut got, &xg, n, &f);
        assert_eq!(gpu.download(&got), want, "scale_ranges ({what}, strided)");
        let mut want = base.clone();
        Cpu.axpy_ranges(&mut want, &x, n, &f);
        let mut got = gpu.upload(&base);
        gpu.axpy_ranges(&mut got, &xg, n, &f);
        close(
            &format!("axpy_ranges ({what}, strided)"),
            &gpu.download(&got),
            &want,
            1e-5,
        );
    }
    let (many, k) = (70_000usize, 3usize);
    let y = g.vec(many * 5, 1.0);
    let yg = gpu.upload(&y);
    let cols: Vec<(usize, usize)> = (0..many).map(|r| (r * 5 + 1, k)).collect();
    assert_eq!(
        gpu.download(&gpu.gather(&yg, &cols)),
        Cpu.gather(&y, &cols),
        "gather of 70,000 rows"
    );
}
