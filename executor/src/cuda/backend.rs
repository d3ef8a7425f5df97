//! The CUDA backend (feature `cuda`): [`crate::backend::Backend`] on device buffers, so
//! the interpreter that runs the CPU reference runs unchanged on a GPU.
//!
//! This first implementation keeps every buffer in fp32 (`CudaSlice<f32>`) and uses the
//! kernels' `_f32` variants and fp32 cuBLASLt GEMMs (plain fp32 arithmetic): it computes
//! what the CPU reference computes, in another summation order, so a training step matches
//! the reference within fp32 rounding (`tests/cuda_train.rs`). bf16 activations with fp32
//! master weights (the kernels' `_bf16` variants, bf16 GEMMs with fp32 accumulation) are the
//! next step; the kernels and GEMMs for it are in place and checked (`tests/cuda_kernels.rs`,
//! `tests/cuda_gemm.rs`).
//!
//! Every call queues work on the device's one stream, in order; [`Backend::download`]
//! waits for it. The trait's methods cannot return errors: a CUDA failure here (a launch
//! refused, memory exhausted) panics with the operation and the driver's message, which
//! the rank's thread reports. Routing (`route`, `route_bwd`) runs on the host (the
//! dispatch layout is planned there anyway): the logits come down, the gradient goes up.

use crate::backend::{
    AdamW, AttnSaved, AttnShape, Backend, Cpu, GemmShape, NormGrads, Operand, Routing,
};
use crate::cuda::device::{cuda_include_dir, Device, LaunchArgs, PushKernelArg};
use crate::cuda::gemm::{Blas, Elem, GemmSpec, F32};
use crate::cuda::launch::{self, Attn, Dtype, Launch, Norm};
use crate::cuda::{adamw_bias_corrections, embedding_segments, rope_tables};
use cudarc::driver::CudaSlice;
use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

/// One GPU as a [`Backend`]; clones share the device (every rank thread of an in-process
/// run queues on its one stream).
#[derive(Clone)]
pub struct Cuda {
    pub dev: Arc<Device>,
    blas: Arc<Blas>,
    /// RoPE tables by `(positions, head_dim, theta bits)`, made once.
    rope: Arc<RopeCache>,
    /// `SHARDWRIGHT_CUDA_SYNC=1`: wait for the device after every operation (to tell an
    /// ordering problem from an arithmetic one; slow).
    sync: bool,
}

type RopeCache = Mutex<BTreeMap<(usize, usize, u32), Arc<(CudaSlice<f32>, CudaSlice<f32>)>>>;

/// A device buffer of `n` fp32 values. The driver refuses zero-byte allocations, so an
/// empty buffer holds one unused element.
pub struct DBuf {
    s: ManuallyDrop<CudaSlice<f32>>,
    n: usize,
}

/// A temporary device buffer (token ids, offsets) freed under the API lock.
struct Temp<T>(ManuallyDrop<CudaSlice<T>>);

impl<T> Drop for Temp<T> {
    fn drop(&mut self) {
        let _api = api();
        // SAFETY: dropped once, here.
        unsafe { ManuallyDrop::drop(&mut self.0) }
    }
}

impl<T> std::ops::Deref for Temp<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl Drop for DBuf {
    fn drop(&mut self) {
        let _api = api();
        // SAFETY: dropped once, here; `s` is not used after.
        unsafe { ManuallyDrop::drop(&mut self.s) }
    }
}

impl DBuf {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

// SAFETY: pushes the pointer of the buffer's allocation, as cudarc does for a `CudaSlice`.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b DBuf> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b DBuf) -> &mut Self {
        <Self as PushKernelArg<&'b CudaSlice<f32>>>::arg(self, &*a.s)
    }
}

// SAFETY: as above, for a buffer the kernel writes.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DBuf> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b mut DBuf) -> &mut Self {
        <Self as PushKernelArg<&'b mut CudaSlice<f32>>>::arg(self, &mut *a.s)
    }
}

/// One CUDA call at a time from this backend: the rank threads of an in-process run share
/// the device, its stream and the cuBLASLt handle and workspace, and calls into the
/// driver and the libraries from several threads at once were seen to corrupt results on
/// an H200 (2026-11-27: multi-rank layouts differed from the CPU reference run to run,
/// single-rank ones never). The GPU runs one stream in order either way, so this costs
/// only host-side overlap of launches.
static API: Mutex<()> = Mutex::new(());

fn api() -> std::sync::MutexGuard<'static, ()> {
    API.lock().unwrap_or_else(|e| e.into_inner())
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("CUDA backend: {what}: {e}")
}

impl Cuda {
    /// GPU `ordinal` with every kernel loaded and a cuBLASLt handle.
    pub fn new(ordinal: usize) -> Result<Cuda, String> {
        let dev = Device::new(ordinal, &cuda_include_dir())?;
        let blas = Blas::new(&dev)?;
        Ok(Cuda {
            dev: Arc::new(dev),
            blas: Arc::new(blas),
            rope: Arc::new(Mutex::new(BTreeMap::new())),
            sync: std::env::var("SHARDWRIGHT_CUDA_SYNC").is_ok_and(|v| v == "1"),
        })
    }

    fn run<'a>(
        &'a self,
        l: Result<Launch, launch::LaunchError>,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) {
        let l = l.unwrap_or_else(|e| fail("launch configuration", e));
        // SAFETY: each caller passes the arguments of the kernel's signature in order, on
        // buffers sized for `l`'s shape (the same lists as tests/cuda_kernels.rs).
        let _api = api();
        unsafe { self.dev.launch(&l, args) }.unwrap_or_else(|e| fail(&l.entry, e));
        self.sync_point(&l.entry);
    }

    fn sync_point(&self, what: &str) {
        if self.sync {
            self.dev.synchronize().unwrap_or_else(|e| fail(what, e));
        }
    }

    fn ids(&self, ids: &[u32]) -> Temp<u32> {
        let _api = api();
        Temp(ManuallyDrop::new(
            self.dev
                .upload(ids)
                .unwrap_or_else(|e| fail("token ids", e)),
        ))
    }

    fn new_buf(&self, n: usize) -> DBuf {
        let _api = api();
        let s = self
            .dev
            .zeros(n.max(1))
            .unwrap_or_else(|e| fail(&format!("allocating {n} values"), e));
        DBuf {
            s: ManuallyDrop::new(s),
            n,
        }
    }

    /// `dst[at..at + n] = src[lo..lo + n]` on the device.
    fn copy_into(&self, dst: &mut DBuf, at: usize, src: &DBuf, lo: usize, n: usize) {
        if n == 0 {
            return;
        }
        let _api = api();
        self.dev
            .stream
            .memcpy_dtod(&src.s.slice(lo..lo + n), &mut dst.s.slice_mut(at..at + n))
            .unwrap_or_else(|e| fail("device copy", e));
        self.sync_point("device copy");
    }

    fn rope_tables(
        &self,
        pos: &[u32],
        d: usize,
        theta: f32,
    ) -> Arc<(CudaSlice<f32>, CudaSlice<f32>)> {
        let positions = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let key = (positions.next_power_of_two(), d, theta.to_bits());
        let mut cache = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = cache.get(&key) {
            return t.clone();
        }
        let (c, s) = rope_tables(key.0, d, theta);
        let up = |x: &[f32]| {
            let _api = api();
            self.dev
                .upload(x)
                .unwrap_or_else(|e| fail("RoPE tables", e))
        };
        let t = Arc::new((up(&c), up(&s)));
        cache.insert(key, t.clone());
        t
    }

    fn rope(&self, x: &mut DBuf, pos: &[u32], heads: usize, d: usize, theta: f32, bwd: bool) {
        let t = pos.len() as u64;
        if t == 0 {
            return;
        }
        let tables = self.rope_tables(pos, d, theta);
        let (cos, sin) = (&tables.0, &tables.1);
        let pos_d = self.ids(pos);
        let (hh, dd) = (heads as u32, d as u32);
        self.run(
            launch::rope(Dtype::F32, bwd, t, heads as u64, d as u64),
            |b| {
                b.arg(x)
                    .arg(&*pos_d)
                    .arg(cos)
                    .arg(sin)
                    .arg(&t)
                    .arg(&hh)
                    .arg(&dd);
            },
        );
    }

    fn ranges(
        &self,
        entry: &str,
        dst: &mut DBuf,
        src: &DBuf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        if n == 0 {
            return;
        }
        for &(s, d, a) in moves {
            let x = src.s.slice(s..s + n);
            let mut y = dst.s.slice_mut(d..d + n);
            let nn = n as u64;
            self.run(launch::buffer_op(entry, nn), |b| {
                b.arg(&mut y).arg(&x).arg(&nn).arg(&a);
            });
        }
    }

    fn reduce_rows(&self, red: &Launch, partial: &DBuf, out: &mut DBuf, rows: u32, h: u32) {
        self.run(Ok(red.clone()), |b| {
            b.arg(partial).arg(out).arg(&rows).arg(&h);
        });
    }
}

impl Backend for Cuda {
    type Buf = DBuf;

    fn zeros(&self, n: usize) -> Self::Buf {
        self.new_buf(n)
    }

    fn upload(&self, x: &[f32]) -> Self::Buf {
        if x.is_empty() {
            return self.new_buf(0);
        }
        let _api = api();
        let s = self.dev.upload(x).unwrap_or_else(|e| fail("upload", e));
        DBuf {
            s: ManuallyDrop::new(s),
            n: x.len(),
        }
    }

    fn download(&self, x: &Self::Buf) -> Vec<f32> {
        if x.is_empty() {
            return Vec::new();
        }
        let _api = api();
        self.dev
            .download(&x.s)
            .unwrap_or_else(|e| fail("download", e))
    }

    fn len(&self, x: &Self::Buf) -> usize {
        x.len()
    }

    fn copy(&self, x: &Self::Buf) -> Self::Buf {
        let mut y = self.new_buf(x.len());
        self.copy_into(&mut y, 0, x, 0, x.len());
        y
    }

    fn slice(&self, x: &Self::Buf, lo: usize, hi: usize) -> Self::Buf {
        let mut y = self.new_buf(hi - lo);
        self.copy_into(&mut y, 0, x, lo, hi - lo);
        y
    }

    fn concat(&self, parts: &[&Self::Buf]) -> Self::Buf {
        let mut y = self.new_buf(parts.iter().map(|p| p.len()).sum());
        let mut at = 0;
        for p in parts {
            self.copy_into(&mut y, at, p, 0, p.len());
            at += p.len();
        }
        y
    }

    fn gather(&self, x: &Self::Buf, ranges: &[(usize, usize)]) -> Self::Buf {
        let mut y = self.new_buf(ranges.iter().map(|r| r.1).sum());
        let mut at = 0;
        for &(lo, n) in ranges {
            self.copy_into(&mut y, at, x, lo, n);
            at += n;
        }
        y
    }

    fn write(&self, dst: &mut Self::Buf, at: usize, host: &[f32]) {
        if host.is_empty() {
            return;
        }
        let _api = api();
        self.dev
            .stream
            .memcpy_htod(host, &mut dst.s.slice_mut(at..at + host.len()))
            .unwrap_or_else(|e| fail("write", e));
        self.sync_point("write");
    }

    fn copy_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize)],
    ) {
        for &(s, d) in moves {
            self.copy_into(dst, d, src, s, n);
        }
    }

    fn scale_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        self.ranges("scale_f32", dst, src, n, moves);
    }

    fn axpy_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        self.ranges("axpy_f32", dst, src, n, moves);
    }

    fn add(&self, x: &Self::Buf, y: &Self::Buf) -> Self::Buf {
        assert_eq!(
            x.len(),
            y.len(),
            "CUDA backend: add of {} and {} elements",
            x.len(),
            y.len()
        );
        let mut z = self.new_buf(x.len());
        let n = x.len() as u64;
        if n > 0 {
            self.run(launch::buffer_op("add_f32", n), |b| {
                b.arg(&mut z).arg(x).arg(y).arg(&n);
            });
        }
        z
    }

    fn add_into(&self, dst: &mut Self::Buf, at: usize, src: &Self::Buf) {
        self.ranges("axpy_f32", dst, src, src.len(), &[(0, at, 1.0)]);
    }

    fn scale(&self, x: &Self::Buf, a: f32) -> Self::Buf {
        let mut y = self.new_buf(x.len());
        self.ranges("scale_f32", &mut y, x, x.len(), &[(0, 0, a)]);
        y
    }

    fn fill_zero(&self, x: &mut Self::Buf) {
        if !x.is_empty() {
            let _api = api();
            self.dev
                .stream
                .memset_zeros(&mut *x.s)
                .unwrap_or_else(|e| fail("fill with zeros", e));
        }
    }

    fn dots(&self, a: &Self::Buf, b: &Self::Buf, n: usize, pairs: &[(usize, usize)]) -> Self::Buf {
        let mut out = self.new_buf(pairs.len());
        if pairs.is_empty() || n == 0 {
            return out;
        }
        let ai: Vec<u64> = pairs.iter().map(|p| p.0 as u64).collect();
        let bi: Vec<u64> = pairs.iter().map(|p| p.1 as u64).collect();
        let up = |v: &[u64]| {
            let _api = api();
            Temp(ManuallyDrop::new(
                self.dev
                    .upload(v)
                    .unwrap_or_else(|e| fail("dot offsets", e)),
            ))
        };
        let (ai, bi) = (up(&ai), up(&bi));
        let nn = n as u64;
        self.run(
            launch::buffer_rows("dots_f32", pairs.len() as u64, nn),
            |x| {
                x.arg(a).arg(b).arg(&*ai).arg(&*bi).arg(&nn).arg(&mut out);
            },
        );
        out
    }

    fn row_max(&self, x: &Self::Buf, w: usize) -> Self::Buf {
        let rows = x.len().checked_div(w).unwrap_or(0);
        let mut out = self.new_buf(rows);
        if rows > 0 {
            let ww = w as u64;
            self.run(launch::buffer_rows("row_max_f32", rows as u64, ww), |b| {
                b.arg(x).arg(&ww).arg(&mut out);
            });
        }
        out
    }

    fn layernorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        h: usize,
        eps: f32,
    ) -> (Self::Buf, Self::Buf) {
        let t = x.len() / h;
        let (mut y, mut st) = (self.new_buf(x.len()), self.new_buf(2 * t));
        let hh = h as u32;
        self.run(
            launch::norm_fwd(Norm::Layer, Dtype::F32, t as u64, h as u64),
            |a| {
                a.arg(x)
                    .arg(w)
                    .arg(b)
                    .arg(&mut y)
                    .arg(&mut st)
                    .arg(&hh)
                    .arg(&eps);
            },
        );
        (y, st)
    }

    fn layernorm_bwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        stats: &Self::Buf,
        dy: &Self::Buf,
        h: usize,
        g: NormGrads<'_, Self::Buf>,
    ) -> Self::Buf {
        let t = x.len() / h;
        let [main, red] = launch::norm_bwd(Norm::Layer, Dtype::F32, t as u64, h as u64)
            .unwrap_or_else(|e| fail("layernorm backward", e));
        let blocks = main.grid[0];
        let nb = blocks as usize;
        let (mut pw, mut pb) = (self.new_buf(nb * h), self.new_buf(nb * h));
        let mut dx = self.new_buf(x.len());
        let (tt, hh) = (t as u64, h as u32);
        self.run(Ok(main), |a| {
            a.arg(x)
                .arg(w)
                .arg(stats)
                .arg(dy)
                .arg(&mut dx)
                .arg(&mut pw)
                .arg(&mut pb)
                .arg(&tt)
                .arg(&hh);
        });
        self.reduce_rows(&red, &pw, g.dw, blocks, hh);
        self.reduce_rows(&red, &pb, g.db, blocks, hh);
        dx
    }

    fn gelu_fwd(&self, x: &Self::Buf) -> Self::Buf {
        let mut y = self.new_buf(x.len());
        let n = x.len() as u64;
        self.run(launch::gelu(Dtype::F32, false, n), |b| {
            b.arg(x).arg(&mut y).arg(&n);
        });
        y
    }

    fn gelu_bwd(&self, x: &Self::Buf, dy: &Self::Buf) -> Self::Buf {
        let mut dx = self.new_buf(x.len());
        let n = x.len() as u64;
        self.run(launch::gelu(Dtype::F32, true, n), |b| {
            b.arg(x).arg(dy).arg(&mut dx).arg(&n);
        });
        dx
    }

    fn route(&self, logits: &Self::Buf, e: usize, k: usize) -> Routing {
        Cpu.route(&self.download(logits), e, k)
    }

    fn route_bwd(
        &self,
        r: &Routing,
        dgates: &Self::Buf,
        dprobs: &Self::Buf,
        e: usize,
        k: usize,
    ) -> Self::Buf {
        let dl = Cpu.route_bwd(r, &self.download(dgates), &self.download(dprobs), e, k);
        self.upload(&dl)
    }

    fn gemm(
        &self,
        s: GemmShape,
        a: Operand<'_, Self::Buf>,
        b: Operand<'_, Self::Buf>,
        beta: f32,
        c: &mut Self::Buf,
    ) {
        if s.m == 0 || s.n == 0 {
            return;
        }
        if s.k == 0 {
            // No products: c = beta c (never on a hot path).
            let scaled: Vec<f32> = self.download(c).iter().map(|x| beta * x).collect();
            self.write(c, 0, &scaled);
            return;
        }
        let spec = GemmSpec::new(s, a.trans, b.trans, Elem::F32, Elem::F32);
        let _api = api();
        self.blas
            .gemm::<F32, F32>(&spec, (1.0, beta), &a.data.s, &b.data.s, &mut c.s, None)
            .unwrap_or_else(|e| fail("GEMM", e));
        self.sync_point("GEMM");
    }

    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &Self::Buf,
        vocab_start: usize,
        h: usize,
    ) -> Self::Buf {
        let mut y = self.new_buf(ids.len() * h);
        if ids.is_empty() {
            return y;
        }
        let ids_d = self.ids(ids);
        let (hh, st, rw) = (h as u32, vocab_start as u64, (table.len() / h) as u64);
        self.run(
            launch::embedding_fwd(Dtype::F32, ids.len() as u64, h as u64),
            |b| {
                b.arg(&*ids_d)
                    .arg(table)
                    .arg(&mut y)
                    .arg(&hh)
                    .arg(&st)
                    .arg(&rw);
            },
        );
        y
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        dy: &Self::Buf,
        vocab_start: usize,
        h: usize,
        dtable: &mut Self::Buf,
    ) {
        let seg = embedding_segments(ids, vocab_start, dtable.len() / h);
        if seg.seg_row.is_empty() {
            return;
        }
        let order = self.ids(&seg.order);
        let start = self.ids(&seg.seg_start);
        let row = self.ids(&seg.seg_row);
        let hh = h as u32;
        self.run(
            launch::embedding_bwd(Dtype::F32, seg.seg_row.len() as u64, h as u64),
            |b| {
                b.arg(&*order)
                    .arg(&*start)
                    .arg(&*row)
                    .arg(dy)
                    .arg(dtable)
                    .arg(&hh);
            },
        );
    }

    fn rmsnorm_fwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        h: usize,
        eps: f32,
    ) -> (Self::Buf, Self::Buf) {
        let t = x.len() / h;
        let (mut y, mut rstd) = (self.new_buf(x.len()), self.new_buf(t));
        let hh = h as u32;
        self.run(
            launch::norm_fwd(Norm::Rms, Dtype::F32, t as u64, h as u64),
            |b| {
                b.arg(x)
                    .arg(w)
                    .arg(&mut y)
                    .arg(&mut rstd)
                    .arg(&hh)
                    .arg(&eps);
            },
        );
        (y, rstd)
    }

    fn rmsnorm_bwd(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        dy: &Self::Buf,
        h: usize,
        dw: &mut Self::Buf,
    ) -> Self::Buf {
        let t = x.len() / h;
        let [main, red] = launch::norm_bwd(Norm::Rms, Dtype::F32, t as u64, h as u64)
            .unwrap_or_else(|e| fail("rmsnorm backward", e));
        let blocks = main.grid[0];
        let nb = blocks as usize;
        let mut partial = self.new_buf(nb * h);
        let mut dx = self.new_buf(x.len());
        let (tt, hh) = (t as u64, h as u32);
        self.run(Ok(main), |b| {
            b.arg(x)
                .arg(w)
                .arg(rstd)
                .arg(dy)
                .arg(&mut dx)
                .arg(&mut partial)
                .arg(&tt)
                .arg(&hh);
        });
        self.reduce_rows(&red, &partial, dw, blocks, hh);
        dx
    }

    fn rope_fwd(&self, x: &mut Self::Buf, pos: &[u32], heads: usize, d: usize, theta: f32) {
        self.rope(x, pos, heads, d, theta, false);
    }

    fn rope_bwd(&self, dx: &mut Self::Buf, pos: &[u32], heads: usize, d: usize, theta: f32) {
        self.rope(dx, pos, heads, d, theta, true);
    }

    fn attention_fwd(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        s: AttnShape,
    ) -> (Self::Buf, Self::Buf) {
        let ls =
            launch::attention(Dtype::F32, &Attn::from(&s)).unwrap_or_else(|e| fail("attention", e));
        let mut o = self.new_buf(q.len());
        let mut lse = self.new_buf(s.batch * s.heads * s.seq_q);
        let a = AttnArgs::of(&s);
        self.run(Ok(ls.fwd), |b| {
            b.arg(q).arg(k).arg(v).arg(&mut o).arg(&mut lse);
            a.push(b);
        });
        (o, lse)
    }

    fn attention_bwd(
        &self,
        saved: AttnSaved<'_, Self::Buf>,
        dout: &Self::Buf,
        s: AttnShape,
    ) -> (Self::Buf, Self::Buf, Self::Buf) {
        let ls =
            launch::attention(Dtype::F32, &Attn::from(&s)).unwrap_or_else(|e| fail("attention", e));
        let rows = (s.batch * s.heads * s.seq_q) as u64;
        let mut delta = self.new_buf(rows as usize);
        let a = AttnArgs::of(&s);
        self.run(Ok(ls.bwd_delta), |b| {
            b.arg(saved.o)
                .arg(dout)
                .arg(&mut delta)
                .arg(&rows)
                .arg(&a.sq)
                .arg(&a.hq)
                .arg(&a.hd);
        });
        let (mut dk, mut dv) = (self.new_buf(saved.k.len()), self.new_buf(saved.v.len()));
        self.run(Ok(ls.bwd_dkdv), |b| {
            b.arg(saved.q)
                .arg(saved.k)
                .arg(saved.v)
                .arg(dout)
                .arg(saved.lse)
                .arg(&delta);
            b.arg(&mut dk).arg(&mut dv);
            a.push(b);
        });
        let mut dq = self.new_buf(saved.q.len());
        self.run(Ok(ls.bwd_dq), |b| {
            b.arg(saved.q)
                .arg(saved.k)
                .arg(saved.v)
                .arg(dout)
                .arg(saved.lse)
                .arg(&delta);
            b.arg(&mut dq);
            a.push(b);
        });
        (dq, dk, dv)
    }

    fn swiglu_fwd(&self, gu: &Self::Buf, f: usize) -> Self::Buf {
        let t = (gu.len() / (2 * f)) as u64;
        let mut y = self.new_buf(t as usize * f);
        let ff = f as u32;
        self.run(launch::swiglu(Dtype::F32, false, t, f as u64), |b| {
            b.arg(gu).arg(&mut y).arg(&t).arg(&ff);
        });
        y
    }

    fn swiglu_bwd(&self, gu: &Self::Buf, dy: &Self::Buf, f: usize) -> Self::Buf {
        let t = (gu.len() / (2 * f)) as u64;
        let mut dgu = self.new_buf(gu.len());
        let ff = f as u32;
        self.run(launch::swiglu(Dtype::F32, true, t, f as u64), |b| {
            b.arg(gu).arg(dy).arg(&mut dgu).arg(&t).arg(&ff);
        });
        dgu
    }

    fn xent_local(
        &self,
        logits: &Self::Buf,
        targets: &[u32],
        v: usize,
        vocab_start: usize,
    ) -> (Self::Buf, Self::Buf) {
        let t = targets.len();
        if t == 0 {
            return (self.new_buf(0), self.new_buf(0));
        }
        let ls = launch::xent(Dtype::F32, t as u64, v as u64)
            .unwrap_or_else(|e| fail("cross-entropy", e));
        let tg_d = self.ids(targets);
        let (mut mx, mut se, mut lse, mut tg) = (
            self.new_buf(t),
            self.new_buf(t),
            self.new_buf(t),
            self.new_buf(t),
        );
        let (vv, st) = (v as u32, vocab_start as u64);
        self.run(Ok(ls.fwd_local), |b| {
            b.arg(logits)
                .arg(&*tg_d)
                .arg(&mut mx)
                .arg(&mut se)
                .arg(&mut lse)
                .arg(&mut tg)
                .arg(&vv)
                .arg(&st);
        });
        (lse, tg)
    }

    fn xent_bwd(
        &self,
        logits: &Self::Buf,
        targets: &[u32],
        lse: &Self::Buf,
        v: usize,
        vocab_start: usize,
        scale: f32,
    ) -> Self::Buf {
        let t = targets.len();
        if t == 0 {
            return self.new_buf(0);
        }
        let ls = launch::xent(Dtype::F32, t as u64, v as u64)
            .unwrap_or_else(|e| fail("cross-entropy", e));
        let tg_d = self.ids(targets);
        let mut dl = self.new_buf(t * v);
        let (vv, st) = (v as u32, vocab_start as u64);
        self.run(Ok(ls.bwd), |b| {
            b.arg(logits)
                .arg(&*tg_d)
                .arg(lse)
                .arg(&mut dl)
                .arg(&vv)
                .arg(&st)
                .arg(&scale);
        });
        dl
    }

    fn adamw(
        &self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        h: AdamW,
    ) {
        let n = p.len() as u64;
        if n == 0 {
            return;
        }
        let (bc1, bc2) = adamw_bias_corrections(&h);
        let null = 0u64;
        self.run(launch::adamw(Dtype::F32, n), |b| {
            b.arg(p).arg(g).arg(m).arg(v).arg(&null);
            b.arg(&n).arg(&h.lr).arg(&h.beta1).arg(&h.beta2).arg(&h.eps);
            b.arg(&h.weight_decay).arg(&bc1).arg(&bc2);
        });
    }
}

/// The attention kernels' trailing arguments (ATT_ARGS in attention.cu) for a shape:
/// keys from position 0, no sliding window, scores scaled by `1/sqrt(head_dim)`.
pub struct AttnArgs {
    sq: u32,
    skv: u32,
    hq: u32,
    hk: u32,
    hd: u32,
    q_off: i64,
    k_off: i64,
    causal: u32,
    window: u32,
    scale: f32,
}

impl AttnArgs {
    pub fn of(s: &AttnShape) -> AttnArgs {
        AttnArgs {
            sq: s.seq_q as u32,
            skv: s.seq_kv as u32,
            hq: s.heads as u32,
            hk: s.kv_heads as u32,
            hd: s.head_dim as u32,
            q_off: s.q_offset as i64,
            k_off: 0,
            causal: s.causal as u32,
            window: 0,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
        }
    }

    /// Pushes them after a kernel's buffer arguments.
    pub fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.sq)
            .arg(&self.skv)
            .arg(&self.hq)
            .arg(&self.hk)
            .arg(&self.hd);
        b.arg(&self.q_off)
            .arg(&self.k_off)
            .arg(&self.causal)
            .arg(&self.window)
            .arg(&self.scale);
    }
}
