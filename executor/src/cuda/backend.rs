//! The CUDA backend (feature `cuda`): [`crate::backend::Backend`] on device buffers, so
//! the interpreter that runs the CPU reference runs unchanged on a GPU.
//!
//! Two precisions ([`Precision`], chosen at construction: [`Cuda::new`] is fp32,
//! [`Cuda::new_with`] takes one, [`Cuda::from_env`] reads `SHARDWRIGHT_CUDA_PRECISION`):
//!
//! - **fp32**, the reference-comparison mode: every buffer fp32, the kernels' `_f32`
//!   variants and fp32 cuBLASLt GEMMs (plain fp32 arithmetic): a training step matches the
//!   CPU reference within fp32 rounding of another summation order (`tests/cuda_train.rs`).
//! - **bf16**, mixed precision as Megatron-LM and torchtitan train: activations and the
//!   working copy of the weights in bf16 (the kernels' `_bf16` variants), GEMMs on bf16
//!   operands with fp32 accumulation (`CUBLAS_COMPUTE_32F`), weight gradients accumulated in
//!   fp32 (`main_grad`), fp32 master weights and AdamW moments, fp32 loss, softmax, norm and
//!   reduction statistics (see [`crate::cuda::precision`] for the table by role).
//!
//! Each [`DBuf`] carries its element type ([`Kind`]: fp32, bf16, or untyped zeros not yet
//! allocated), so nothing reads one type's bits as another's: an operand is read in the
//! type its kernel computes on (converted with `cast.cu`'s kernels at the boundary where
//! it differs), and roles that must be fp32 panic on a bf16 buffer, naming the operation.
//! An fp32 buffer read as bf16 (a master weight read by a GEMM) keeps that bf16 copy until
//! it is written again; AdamW refreshes it in the same kernel (`adamw_f32`'s `p_bf16`), so
//! the working copy of a weight is made once and updated with the master.
//!
//! Per method in bf16 mode ("act" is bf16; in fp32 mode every entry is fp32, `zeros`
//! included):
//!
//! | method | operands read as | result |
//! |---|---|---|
//! | `zeros` | | untyped zeros (typed by the first write) |
//! | `upload` / `download` | host f32 | fp32 / host f32 (bf16 widened exactly) |
//! | `copy`, `slice`, `gather` | as stored | the source's type |
//! | `concat`, `add` | [`precision::joined`]: fp32 if all fp32, else bf16 | that type |
//! | `copy_ranges`, `scale_ranges`, `axpy_ranges`, `add_into` | source converted to the destination's type | the destination's (untyped zeros take the source's) |
//! | `scale` | as stored | the source's type |
//! | `write` (MoE row-count headers) | host f32 | fp32 (a bf16 destination panics: counts would round) |
//! | `fill_zero` | | keeps its type |
//! | `dots`, `row_max` | as stored (bf16 pairs: the bf16 kernel; else fp32) | fp32 |
//! | `layernorm_fwd`, `rmsnorm_fwd` | x, w, b: act | y: act; stats / rstd: fp32 |
//! | `layernorm_bwd`, `rmsnorm_bwd` | x, w, dy: act; stats: fp32 (required) | dx: act; dw, db: fp32 accumulated (required) |
//! | `gelu_*`, `swiglu_*` | act | act |
//! | `route` / `route_bwd` | host (downloaded) | host / fp32 (uploaded) |
//! | `gemm`, `linear_*` | a, b: act (bf16 operands, fp32 accumulation) | beta 0: act; beta != 0: `c`'s type, untyped zeros fp32 (weight gradients) |
//! | `embedding_fwd` | table: act (the working copy) | act |
//! | `embedding_bwd` | dy: act | dtable: fp32 accumulated (required) |
//! | `rope_fwd`, `rope_bwd` | in place | keeps its type |
//! | `attention_fwd` | q, k, v: act | o: act; lse: fp32 |
//! | `attention_bwd` | q, k, v, o, dout: act; lse: fp32 (required) | dq, dk, dv: act |
//! | `xent_local` | logits: act | lse, target logit: fp32 |
//! | `xent_bwd` | logits: act; lse: fp32 (required) | dlogits: act |
//! | `adamw` | p, m, v, g: fp32 (required) | p, m, v: fp32; p's bf16 copy refreshed |
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
use crate::cuda::gemm::{Bf16, Blas, Elem, GemmSpec, F32};
use crate::cuda::launch::{self, Attn, AttnImpl, Dtype, Launch, Norm};
use crate::cuda::precision::{self, require_f32, Kind, Precision};
use crate::cuda::{adamw_bias_corrections, bf16_value, embedding_segments, rope_tables};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, OnceLock};

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
    precision: Precision,
    /// `SHARDWRIGHT_CUDA_ATTENTION` (`scalar` or `mma`; unset: `mma` on sm_80 and newer,
    /// [`AttnImpl::default_for`]): which attention kernels bf16 calls with head_dim 64 or
    /// 128 run ([`launch::attn_uses_mma`]).
    attn: AttnImpl,
}

type RopeCache = Mutex<BTreeMap<(usize, usize, u32), Arc<(CudaSlice<f32>, CudaSlice<f32>)>>>;

/// A buffer's storage.
enum Store {
    /// Untyped zeros: nothing allocated yet.
    Zero,
    F32(CudaSlice<f32>),
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
}

/// A device buffer of `n` values of its [`Kind`]. The driver refuses zero-byte
/// allocations, so an allocated empty buffer holds one unused element.
pub struct DBuf {
    st: ManuallyDrop<Store>,
    n: usize,
    /// An fp32 buffer's bf16 copy, made when a kernel first reads it as bf16 (the working
    /// copy of a master weight); dropped by every write except AdamW's, which refreshes it.
    shadow: ManuallyDrop<OnceLock<CudaSlice<u16>>>,
}

/// A temporary device buffer (token ids, offsets, casts, zeros) freed under the API lock.
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

/// A buffer read in one element type: its own storage or bf16 copy, or a temporary (a
/// cast, or zeros for untyped zeros).
enum Src<'a, T> {
    Ref(&'a CudaSlice<T>),
    Temp(Temp<T>),
}

impl<T> std::ops::Deref for Src<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        match self {
            Src::Ref(s) => s,
            Src::Temp(t) => t,
        }
    }
}

/// A kernel operand in the element type of the kernel's variant.
enum In<'a> {
    F32(Src<'a, f32>),
    Bf16(Src<'a, u16>),
}

impl Drop for DBuf {
    fn drop(&mut self) {
        let _api = api();
        // SAFETY: dropped once, here; neither is used after.
        unsafe {
            ManuallyDrop::drop(&mut self.st);
            ManuallyDrop::drop(&mut self.shadow);
        }
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

    /// What it holds.
    pub fn kind(&self) -> Kind {
        match &*self.st {
            Store::Zero => Kind::Zero,
            Store::F32(_) => Kind::F32,
            Store::Bf16(_) => Kind::Bf16,
        }
    }

    /// Drops the bf16 copy (before the buffer is written).
    fn invalidate(&mut self) {
        if self.shadow.get().is_some() {
            let _api = api();
            drop(self.shadow.take());
        }
    }

    /// The storage, to write into (the bf16 copy dropped).
    fn store_mut(&mut self) -> &mut Store {
        self.invalidate();
        &mut self.st
    }

    /// Puts `st` in place of the storage (the old one and the bf16 copy freed).
    fn replace(&mut self, st: Store) {
        let _api = api();
        let old = std::mem::replace(&mut *self.st, st);
        drop(old);
        drop(self.shadow.take());
    }
}

// SAFETY: pushes the pointer of the buffer's allocation, as cudarc does for a `CudaSlice`;
// the caller allocated it in the type of the kernel's variant (`Cuda::alloc`).
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DBuf> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b mut DBuf) -> &mut Self {
        match &mut *a.st {
            Store::F32(s) => <Self as PushKernelArg<&'b mut CudaSlice<f32>>>::arg(self, s),
            Store::Bf16(s) => <Self as PushKernelArg<&'b mut CudaSlice<u16>>>::arg(self, s),
            Store::Zero => panic!("CUDA backend: an unallocated buffer passed to a kernel"),
        }
    }
}

// SAFETY: as above, for an operand read in the kernel's type.
unsafe impl<'a, 'b: 'a, 'c> PushKernelArg<&'b In<'c>> for LaunchArgs<'a> {
    fn arg(&mut self, a: &'b In<'c>) -> &mut Self {
        match a {
            In::F32(s) => <Self as PushKernelArg<&'b CudaSlice<f32>>>::arg(self, &**s),
            In::Bf16(s) => <Self as PushKernelArg<&'b CudaSlice<u16>>>::arg(self, &**s),
        }
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

/// Whether `moves` (source, destination, factor) of `n` elements can run as one `moves_*`
/// launch: more than one, with pairwise disjoint destination ranges (so no element is
/// written twice and the order of the ranges does not matter).
fn batchable(moves: &[(usize, usize, f32)], n: usize) -> bool {
    if moves.len() < 2 || n == 0 {
        return false;
    }
    // Destinations already in ascending order (a tensor's rows, one after another) need no
    // sort: a linear pass over thousands of per-token ranges, not an O(m log m) sort of
    // them at every QKV split.
    if moves.windows(2).all(|w| w[1].1 >= w[0].1.saturating_add(n)) {
        return true;
    }
    let mut d: Vec<usize> = moves.iter().map(|m| m.1).collect();
    d.sort_unstable();
    d.windows(2).all(|w| w[1] - w[0] >= n)
}

fn suffix(k: Kind) -> &'static str {
    match k.dtype() {
        Some(d) => d.suffix(),
        None => panic!("CUDA backend: untyped zeros have no kernel variant"),
    }
}

impl Cuda {
    /// GPU `ordinal` with every kernel loaded and a cuBLASLt handle, in fp32 (the
    /// reference-comparison mode).
    pub fn new(ordinal: usize) -> Result<Cuda, String> {
        Cuda::new_with(ordinal, Precision::Fp32)
    }

    /// GPU `ordinal` in precision `precision`.
    pub fn new_with(ordinal: usize, precision: Precision) -> Result<Cuda, String> {
        let asked = AttnImpl::from_env()?;
        let dev = Device::new(ordinal, &cuda_include_dir())?;
        if asked == Some(AttnImpl::Mma) && dev.sm < 80 {
            return Err(format!(
                "{}=mma: the tensor-core attention kernels need sm_80 or newer (GPU {ordinal} is sm_{})",
                launch::ATTENTION_ENV,
                dev.sm
            ));
        }
        let attn = asked.unwrap_or(AttnImpl::default_for(dev.sm));
        let blas = Blas::new(&dev)?;
        Ok(Cuda {
            dev: Arc::new(dev),
            blas: Arc::new(blas),
            rope: Arc::new(Mutex::new(BTreeMap::new())),
            sync: std::env::var("SHARDWRIGHT_CUDA_SYNC").is_ok_and(|v| v == "1"),
            precision,
            attn,
        })
    }

    /// GPU `ordinal` in the precision `SHARDWRIGHT_CUDA_PRECISION` names (`fp32`, the
    /// default, or `bf16`).
    pub fn from_env(ordinal: usize) -> Result<Cuda, String> {
        Cuda::new_with(ordinal, Precision::from_env()?)
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The device this backend runs on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// A library call that reads `x` as fp32 (bf16 widened, untyped zeros materialized)
    /// and writes a fresh fp32 buffer of `n` elements (NCCL's collectives), under the
    /// backend's lock, on its stream; returns that buffer.
    pub(crate) fn f32_call(
        &self,
        x: &DBuf,
        n: usize,
        f: impl FnOnce(&CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<(), String>,
    ) -> Result<DBuf, String> {
        let mut out = self.alloc(Kind::F32, n);
        if n == 0 || x.is_empty() {
            return Ok(out);
        }
        let xs = self.read_f32(x);
        let Store::F32(o) = out.store_mut() else {
            unreachable!("an fp32 buffer")
        };
        {
            let _api = api();
            f(&xs, o)?;
        }
        drop(xs);
        self.sync_point("collective");
        Ok(out)
    }

    /// The attention kernels' switch: from `SHARDWRIGHT_CUDA_ATTENTION`, else the device's
    /// default ([`AttnImpl::default_for`]).
    pub fn attention_impl(&self) -> AttnImpl {
        self.attn
    }

    /// This backend with the attention kernels' switch set to `a` (tests and benches; `mma`
    /// needs an sm_80 or newer GPU, as `new_with` checks).
    pub fn with_attention_impl(&self, a: AttnImpl) -> Cuda {
        Cuda {
            attn: a,
            ..self.clone()
        }
    }

    /// The launches of an attention call of shape `s` (the switch, the precision and the
    /// head dimension pick the kernels).
    fn attention_launches(&self, s: &AttnShape) -> launch::AttnLaunches {
        launch::attention_for(self.attn, self.act(), &Attn::from(s))
            .unwrap_or_else(|e| fail("attention", e))
    }

    /// This backend (the same device, kernels and cuBLASLt handle) in precision `p`.
    pub fn with_precision(&self, p: Precision) -> Cuda {
        Cuda {
            precision: p,
            ..self.clone()
        }
    }

    /// The element type of activations (and of the kernels' variants).
    fn act(&self) -> Dtype {
        self.precision.activations()
    }

    fn run<'a>(
        &'a self,
        l: Result<Launch, launch::LaunchError>,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) {
        let l = l.unwrap_or_else(|e| fail("launch configuration", e));
        // SAFETY: each caller passes the arguments of the kernel's signature in order, on
        // buffers sized for `l`'s shape and of the element types of `l`'s variant (the same
        // lists as tests/cuda_kernels.rs).
        let _api = api();
        unsafe { self.dev.launch(&l, args) }.unwrap_or_else(|e| fail(&l.entry, e));
        self.sync_point(&l.entry);
    }

    fn sync_point(&self, what: &str) {
        if self.sync {
            self.dev.synchronize().unwrap_or_else(|e| fail(what, e));
        }
    }

    fn temp<T: DeviceRepr>(&self, what: &str, host: &[T]) -> Temp<T> {
        let _api = api();
        Temp(ManuallyDrop::new(
            self.dev.upload(host).unwrap_or_else(|e| fail(what, e)),
        ))
    }

    fn ids(&self, ids: &[u32]) -> Temp<u32> {
        self.temp("token ids", ids)
    }

    fn dzeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> CudaSlice<T> {
        let _api = api();
        self.dev
            .zeros(n.max(1))
            .unwrap_or_else(|e| fail(&format!("allocating {n} values"), e))
    }

    /// `n` zeros of kind `k` (untyped zeros allocate nothing).
    fn alloc(&self, k: Kind, n: usize) -> DBuf {
        let st = match k {
            Kind::Zero => Store::Zero,
            Kind::F32 => Store::F32(self.dzeros(n)),
            Kind::Bf16 => Store::Bf16(self.dzeros(n)),
        };
        DBuf {
            st: ManuallyDrop::new(st),
            n,
            shadow: ManuallyDrop::new(OnceLock::new()),
        }
    }

    /// `n` fp32 zeros (statistics, partial sums).
    fn new_buf(&self, n: usize) -> DBuf {
        self.alloc(Kind::F32, n)
    }

    /// `n` zeros in the activation type.
    fn act_buf(&self, n: usize) -> DBuf {
        self.alloc(Kind::of(self.act()), n)
    }

    /// Gives untyped zeros the type `k` (allocated, zeroed); other buffers keep theirs.
    fn materialize(&self, x: &mut DBuf, k: Kind) {
        if x.kind() != Kind::Zero {
            return;
        }
        let st = match k {
            Kind::Zero => return,
            Kind::F32 => Store::F32(self.dzeros(x.n)),
            Kind::Bf16 => Store::Bf16(self.dzeros(x.n)),
        };
        // The untyped storage replaced holds no allocation.
        *x.st = st;
    }

    /// `x` (`n` values) converted by `cast.cu`'s kernel into `y`.
    fn cast<A, B>(&self, to_bf16: bool, x: &CudaSlice<A>, y: &mut CudaSlice<B>, n: usize) {
        if n == 0 {
            return;
        }
        let nn = n as u64;
        self.run(launch::cast(to_bf16, nn), |b| {
            b.arg(x).arg(y).arg(&nn);
        });
    }

    /// `x` read as fp32: itself, or a temporary (bf16 widened exactly, untyped zeros).
    fn read_f32<'a>(&self, x: &'a DBuf) -> Src<'a, f32> {
        match &*x.st {
            Store::F32(s) => Src::Ref(s),
            Store::Zero => Src::Temp(Temp(ManuallyDrop::new(self.dzeros(x.n)))),
            Store::Bf16(s) => {
                let mut y = Temp(ManuallyDrop::new(self.dzeros::<f32>(x.n)));
                self.cast(false, s, &mut y.0, x.n);
                Src::Temp(y)
            }
        }
    }

    /// `x` read as bf16: itself, its bf16 copy (made now if need be: the working copy of
    /// a master weight), or zeros.
    fn read_bf16<'a>(&self, x: &'a DBuf) -> Src<'a, u16> {
        match &*x.st {
            Store::Bf16(s) => Src::Ref(s),
            Store::Zero => Src::Temp(Temp(ManuallyDrop::new(self.dzeros(x.n)))),
            Store::F32(s) => Src::Ref(x.shadow.get_or_init(|| {
                let mut y = self.dzeros::<u16>(x.n);
                self.cast(true, s, &mut y, x.n);
                y
            })),
        }
    }

    /// `x` read in type `d`.
    fn read<'a>(&self, x: &'a DBuf, d: Dtype) -> In<'a> {
        match d {
            Dtype::F32 => In::F32(self.read_f32(x)),
            Dtype::Bf16 => In::Bf16(self.read_bf16(x)),
        }
    }

    /// `x` read as an activation operand.
    fn act_in<'a>(&self, x: &'a DBuf) -> In<'a> {
        self.read(x, self.act())
    }

    /// A statistic (`what`): must be fp32.
    fn stat<'a>(&self, x: &'a DBuf, what: &str) -> Src<'a, f32> {
        require_f32(x.kind(), what);
        self.read_f32(x)
    }

    /// A buffer accumulated into in fp32 (`what`: a weight gradient): fp32 required,
    /// untyped zeros allocated as fp32; the bf16 copy dropped.
    fn acc<'a>(&self, x: &'a mut DBuf, what: &str) -> &'a mut CudaSlice<f32> {
        require_f32(x.kind(), what);
        self.materialize(x, Kind::F32);
        match x.store_mut() {
            Store::F32(s) => s,
            _ => unreachable!("materialized as fp32"),
        }
    }

    /// `dst[at..at + n] = src[lo..lo + n]` on the device, converted to `dst`'s type
    /// (`dst` allocated; untyped zeros in `src` copy as zeros).
    fn copy_into(&self, dst: &mut DBuf, at: usize, src: &DBuf, lo: usize, n: usize) {
        if n == 0 {
            return;
        }
        let (r, w) = (lo..lo + n, at..at + n);
        let nn = n as u64;
        match (dst.store_mut(), &*src.st) {
            (Store::Zero, _) => panic!("CUDA backend: a copy into an unallocated buffer"),
            (Store::F32(d), Store::F32(s)) => {
                let _api = api();
                self.dev
                    .stream
                    .memcpy_dtod(&s.slice(r), &mut d.slice_mut(w))
                    .unwrap_or_else(|e| fail("device copy", e));
            }
            (Store::Bf16(d), Store::Bf16(s)) => {
                let _api = api();
                self.dev
                    .stream
                    .memcpy_dtod(&s.slice(r), &mut d.slice_mut(w))
                    .unwrap_or_else(|e| fail("device copy", e));
            }
            (Store::Bf16(d), Store::F32(s)) => {
                let (x, mut y) = (s.slice(r), d.slice_mut(w));
                self.run(launch::cast(true, nn), |b| {
                    b.arg(&x).arg(&mut y).arg(&nn);
                });
            }
            (Store::F32(d), Store::Bf16(s)) => {
                let (x, mut y) = (s.slice(r), d.slice_mut(w));
                self.run(launch::cast(false, nn), |b| {
                    b.arg(&x).arg(&mut y).arg(&nn);
                });
            }
            (Store::F32(d), Store::Zero) => {
                let _api = api();
                self.dev
                    .stream
                    .memset_zeros(&mut d.slice_mut(w))
                    .unwrap_or_else(|e| fail("zeroing a range", e));
            }
            (Store::Bf16(d), Store::Zero) => {
                let _api = api();
                self.dev
                    .stream
                    .memset_zeros(&mut d.slice_mut(w))
                    .unwrap_or_else(|e| fail("zeroing a range", e));
            }
        }
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

    /// The rotation in place, in `x`'s own type (untyped zeros rotate to themselves).
    fn rope(&self, x: &mut DBuf, pos: &[u32], heads: usize, d: usize, theta: f32, bwd: bool) {
        let t = pos.len() as u64;
        let k = x.kind();
        if t == 0 || k == Kind::Zero {
            return;
        }
        let dt = k.dtype().expect("typed");
        let tables = self.rope_tables(pos, d, theta);
        let (cos, sin) = (&tables.0, &tables.1);
        let pos_d = self.ids(pos);
        let (hh, dd) = (heads as u32, d as u32);
        x.invalidate();
        self.run(launch::rope(dt, bwd, t, heads as u64, d as u64), |b| {
            b.arg(x)
                .arg(&*pos_d)
                .arg(cos)
                .arg(sin)
                .arg(&t)
                .arg(&hh)
                .arg(&dd);
        });
    }

    /// `op` (`axpy` or `scale`) of `src`'s ranges onto `dst`'s, in `dst`'s type
    /// ([`precision::into_dst`]).
    fn ranges(
        &self,
        op: &str,
        dst: &mut DBuf,
        src: &DBuf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        if n == 0 || moves.is_empty() {
            return;
        }
        if op == "axpy" && src.kind() == Kind::Zero {
            return; // adding zeros
        }
        let k = precision::into_dst(dst.kind(), src.kind());
        if k == Kind::Zero {
            return; // zeros scaled into zeros
        }
        self.materialize(dst, k);
        let entry = format!("{op}_{}", suffix(k));
        // One launch for many disjoint ranges (moves_*: mode 1 scales, 2 adds scaled).
        let batch = batchable(moves, n).then_some(if op == "axpy" { 2 } else { 1 });
        match k {
            Kind::F32 => {
                let x = self.read_f32(src);
                let Store::F32(y) = dst.store_mut() else {
                    unreachable!("an fp32 destination")
                };
                match batch {
                    Some(mode) => self.moves(Dtype::F32, mode, y, &x, n, moves),
                    None => self.ranges_typed(&entry, y, &x, n, moves),
                }
            }
            _ => {
                let x = self.read_bf16(src);
                let Store::Bf16(y) = dst.store_mut() else {
                    unreachable!("a bf16 destination")
                };
                match batch {
                    Some(mode) => self.moves(Dtype::Bf16, mode, y, &x, n, moves),
                    None => self.ranges_typed(&entry, y, &x, n, moves),
                }
            }
        }
    }

    fn ranges_typed<T>(
        &self,
        entry: &str,
        y: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        let nn = n as u64;
        for &(s, d, a) in moves {
            let xv = x.slice(s..s + n);
            let mut yv = y.slice_mut(d..d + n);
            self.run(launch::buffer_op(entry, nn), |b| {
                b.arg(&mut yv).arg(&xv).arg(&nn).arg(&a);
            });
        }
    }

    /// One `moves_*` launch for `moves` (disjoint destination ranges of `n` elements):
    /// mode 0 copies, 1 scales, 2 adds scaled (see buffers.cu).
    fn moves<T: DeviceRepr>(
        &self,
        dt: Dtype,
        mode: u32,
        y: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        let (count, nn) = (moves.len() as u64, n as u64);
        if let Some((s0, ss, d0, ds, a)) = launch::progression(moves) {
            self.run(launch::buffer_moves_strided(dt, count, nn), |b| {
                b.arg(y)
                    .arg(x)
                    .arg(&s0)
                    .arg(&ss)
                    .arg(&d0)
                    .arg(&ds)
                    .arg(&a)
                    .arg(&count)
                    .arg(&nn)
                    .arg(&mode);
            });
            return;
        }
        let src: Vec<u64> = moves.iter().map(|m| m.0 as u64).collect();
        let dst: Vec<u64> = moves.iter().map(|m| m.1 as u64).collect();
        let a: Vec<f32> = moves.iter().map(|m| m.2).collect();
        let (src, dst, a) = (
            self.temp("range offsets", &src),
            self.temp("range offsets", &dst),
            self.temp("range factors", &a),
        );
        self.run(launch::buffer_moves(dt, count, nn), |b| {
            b.arg(y)
                .arg(x)
                .arg(&*src)
                .arg(&*dst)
                .arg(&*a)
                .arg(&count)
                .arg(&nn)
                .arg(&mode);
        });
    }

    /// `dst[d..d + n] = src[s..s + n]` for each move, in one launch when the moves allow
    /// it ([`batchable`], and neither buffer is untyped zeros); else one copy per move.
    fn copy_moves(&self, dst: &mut DBuf, src: &DBuf, n: usize, moves: &[(usize, usize)]) {
        let m: Vec<(usize, usize, f32)> = moves.iter().map(|&(s, d)| (s, d, 1.0)).collect();
        let typed = dst.kind().dtype().filter(|_| src.kind() != Kind::Zero);
        match typed.filter(|_| batchable(&m, n)) {
            Some(Dtype::F32) => {
                let x = self.read_f32(src);
                let Store::F32(y) = dst.store_mut() else {
                    unreachable!("an fp32 destination")
                };
                self.moves(Dtype::F32, 0, y, &x, n, &m);
            }
            Some(Dtype::Bf16) => {
                let x = self.read_bf16(src);
                let Store::Bf16(y) = dst.store_mut() else {
                    unreachable!("a bf16 destination")
                };
                self.moves(Dtype::Bf16, 0, y, &x, n, &m);
            }
            None => {
                for &(s, d) in moves {
                    self.copy_into(dst, d, src, s, n);
                }
            }
        }
    }

    /// The whole-buffer reduction `kernel_*` (buffers.cu: `sum_squares`, `checksum`) over
    /// `x` read as `d`, into one zeroed output per block (`per_block`) or one in all, on
    /// the host.
    fn reduce_buf<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        kernel: &str,
        x: &DBuf,
        d: Dtype,
        per_block: bool,
    ) -> Vec<T> {
        let n = x.len() as u64;
        let l = launch::buffer_reduce(&format!("{kernel}_{}", d.suffix()), n);
        let outs = match (&l, per_block) {
            (Ok(l), true) => l.grid[0] as usize,
            _ => 1,
        };
        let mut out = self.dzeros::<T>(outs);
        let xs = self.read(x, d);
        self.run(l, |b| {
            b.arg(&xs).arg(&n).arg(&mut out);
        });
        let _api = api();
        let host = self.dev.download(&out).unwrap_or_else(|e| fail(kernel, e));
        drop(out);
        host
    }

    fn reduce_rows(
        &self,
        red: &Launch,
        partial: &DBuf,
        out: &mut CudaSlice<f32>,
        rows: u32,
        h: u32,
    ) {
        let p = self.read_f32(partial);
        self.run(Ok(red.clone()), |b| {
            b.arg(&*p).arg(out).arg(&rows).arg(&h);
        });
    }
}

impl Backend for Cuda {
    type Buf = DBuf;

    fn zeros(&self, n: usize) -> Self::Buf {
        self.alloc(self.precision.zeros(), n)
    }

    fn upload(&self, x: &[f32]) -> Self::Buf {
        if x.is_empty() {
            return self.new_buf(0);
        }
        let _api = api();
        let s = self.dev.upload(x).unwrap_or_else(|e| fail("upload", e));
        DBuf {
            st: ManuallyDrop::new(Store::F32(s)),
            n: x.len(),
            shadow: ManuallyDrop::new(OnceLock::new()),
        }
    }

    fn download(&self, x: &Self::Buf) -> Vec<f32> {
        if x.is_empty() {
            return Vec::new();
        }
        let _api = api();
        match &*x.st {
            Store::Zero => vec![0.0; x.n],
            Store::F32(s) => self.dev.download(s).unwrap_or_else(|e| fail("download", e)),
            Store::Bf16(s) => self
                .dev
                .download(s)
                .unwrap_or_else(|e| fail("download", e))
                .into_iter()
                .map(bf16_value)
                .collect(),
        }
    }

    fn len(&self, x: &Self::Buf) -> usize {
        x.len()
    }

    fn copy(&self, x: &Self::Buf) -> Self::Buf {
        let mut y = self.alloc(x.kind(), x.len());
        if x.kind() != Kind::Zero {
            self.copy_into(&mut y, 0, x, 0, x.len());
        }
        y
    }

    fn slice(&self, x: &Self::Buf, lo: usize, hi: usize) -> Self::Buf {
        let mut y = self.alloc(x.kind(), hi - lo);
        if x.kind() != Kind::Zero {
            self.copy_into(&mut y, 0, x, lo, hi - lo);
        }
        y
    }

    fn concat(&self, parts: &[&Self::Buf]) -> Self::Buf {
        let k = parts
            .iter()
            .fold(Kind::Zero, |k, p| precision::joined(k, p.kind()));
        let mut y = self.alloc(k, parts.iter().map(|p| p.len()).sum());
        if k == Kind::Zero {
            return y;
        }
        let mut at = 0;
        for p in parts {
            if p.kind() != Kind::Zero {
                self.copy_into(&mut y, at, p, 0, p.len());
            }
            at += p.len();
        }
        y
    }

    fn gather(&self, x: &Self::Buf, ranges: &[(usize, usize)]) -> Self::Buf {
        let mut y = self.alloc(x.kind(), ranges.iter().map(|r| r.1).sum());
        if x.kind() == Kind::Zero {
            return y;
        }
        let n = ranges.first().map_or(0, |r| r.1);
        if ranges.iter().all(|r| r.1 == n) {
            // Ranges of one length (a tensor's columns, row by row): one launch.
            let moves: Vec<(usize, usize)> = ranges
                .iter()
                .enumerate()
                .map(|(i, r)| (r.0, i * n))
                .collect();
            self.copy_moves(&mut y, x, n, &moves);
            return y;
        }
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
        let k = precision::write_dst(dst.kind())
            .unwrap_or_else(|e| panic!("CUDA backend: write of {} values: {e}", host.len()));
        self.materialize(dst, k);
        let Store::F32(d) = dst.store_mut() else {
            unreachable!("an fp32 destination")
        };
        let _api = api();
        self.dev
            .stream
            .memcpy_htod(host, &mut d.slice_mut(at..at + host.len()))
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
        if n == 0 || moves.is_empty() {
            return;
        }
        let k = precision::into_dst(dst.kind(), src.kind());
        if k == Kind::Zero {
            return; // zeros onto zeros
        }
        self.materialize(dst, k);
        self.copy_moves(dst, src, n, moves);
    }

    fn scale_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        self.ranges("scale", dst, src, n, moves);
    }

    fn axpy_ranges(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        n: usize,
        moves: &[(usize, usize, f32)],
    ) {
        self.ranges("axpy", dst, src, n, moves);
    }

    fn add(&self, x: &Self::Buf, y: &Self::Buf) -> Self::Buf {
        assert_eq!(
            x.len(),
            y.len(),
            "CUDA backend: add of {} and {} elements",
            x.len(),
            y.len()
        );
        let k = precision::joined(x.kind(), y.kind());
        let mut z = self.alloc(k, x.len());
        let n = x.len() as u64;
        if n > 0 && k != Kind::Zero {
            let d = k.dtype().expect("typed");
            let (xs, ys) = (self.read(x, d), self.read(y, d));
            self.run(launch::buffer_op(&format!("add_{}", d.suffix()), n), |b| {
                b.arg(&mut z).arg(&xs).arg(&ys).arg(&n);
            });
        }
        z
    }

    fn add_into(&self, dst: &mut Self::Buf, at: usize, src: &Self::Buf) {
        self.ranges("axpy", dst, src, src.len(), &[(0, at, 1.0)]);
    }

    fn scale(&self, x: &Self::Buf, a: f32) -> Self::Buf {
        let mut y = self.alloc(x.kind(), x.len());
        self.ranges("scale", &mut y, x, x.len(), &[(0, 0, a)]);
        y
    }

    fn fill_zero(&self, x: &mut Self::Buf) {
        if x.is_empty() {
            return;
        }
        let _guard;
        match x.store_mut() {
            Store::Zero => {}
            Store::F32(s) => {
                _guard = api();
                self.dev
                    .stream
                    .memset_zeros(s)
                    .unwrap_or_else(|e| fail("fill with zeros", e));
            }
            Store::Bf16(s) => {
                _guard = api();
                self.dev
                    .stream
                    .memset_zeros(s)
                    .unwrap_or_else(|e| fail("fill with zeros", e));
            }
        }
    }

    fn dots(&self, a: &Self::Buf, b: &Self::Buf, n: usize, pairs: &[(usize, usize)]) -> Self::Buf {
        let mut out = self.new_buf(pairs.len());
        if pairs.is_empty() || n == 0 {
            return out;
        }
        let ai: Vec<u64> = pairs.iter().map(|p| p.0 as u64).collect();
        let bi: Vec<u64> = pairs.iter().map(|p| p.1 as u64).collect();
        let (ai, bi) = (self.temp("dot offsets", &ai), self.temp("dot offsets", &bi));
        // Both bf16: the bf16 kernel; otherwise fp32 (a bf16 operand widened exactly).
        let d = if a.kind() == Kind::Bf16 && b.kind() == Kind::Bf16 {
            Dtype::Bf16
        } else {
            Dtype::F32
        };
        let (x, y) = (self.read(a, d), self.read(b, d));
        let nn = n as u64;
        self.run(
            launch::buffer_rows(&format!("dots_{}", d.suffix()), pairs.len() as u64, nn),
            |l| {
                l.arg(&x).arg(&y).arg(&*ai).arg(&*bi).arg(&nn).arg(&mut out);
            },
        );
        out
    }

    fn row_max(&self, x: &Self::Buf, w: usize) -> Self::Buf {
        let rows = x.len().checked_div(w).unwrap_or(0);
        let mut out = self.new_buf(rows);
        if rows > 0 {
            let d = if x.kind() == Kind::Bf16 {
                Dtype::Bf16
            } else {
                Dtype::F32
            };
            let xs = self.read(x, d);
            let ww = w as u64;
            self.run(
                launch::buffer_rows(&format!("row_max_{}", d.suffix()), rows as u64, ww),
                |b| {
                    b.arg(&xs).arg(&ww).arg(&mut out);
                },
            );
        }
        out
    }

    fn sum_squares(&self, x: &Self::Buf) -> f64 {
        match x.kind().dtype().filter(|_| !x.is_empty()) {
            // One f64 partial per block, added here in block order.
            Some(d) => self
                .reduce_buf::<f64>("sum_squares", x, d, true)
                .iter()
                .sum(),
            None => 0.0, // empty, or untyped zeros
        }
    }

    fn checksum(&self, x: &Self::Buf) -> u64 {
        match x.kind().dtype().filter(|_| !x.is_empty()) {
            Some(d) => self.reduce_buf::<u64>("checksum", x, d, false)[0],
            None => crate::backend::weights_hash(&self.download(x)),
        }
    }

    fn synchronize(&self) {
        let _api = api();
        self.dev
            .synchronize()
            .unwrap_or_else(|e| fail("waiting for the device", e));
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
        let (xs, ws, bs) = (self.act_in(x), self.act_in(w), self.act_in(b));
        let (mut y, mut st) = (self.act_buf(x.len()), self.new_buf(2 * t));
        let hh = h as u32;
        self.run(
            launch::norm_fwd(Norm::Layer, self.act(), t as u64, h as u64),
            |a| {
                a.arg(&xs)
                    .arg(&ws)
                    .arg(&bs)
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
        let [main, red] = launch::norm_bwd(Norm::Layer, self.act(), t as u64, h as u64)
            .unwrap_or_else(|e| fail("layernorm backward", e));
        let blocks = main.grid[0];
        let nb = blocks as usize;
        let (xs, ws, dys) = (self.act_in(x), self.act_in(w), self.act_in(dy));
        let st = self.stat(stats, "the layernorm statistics");
        let (mut pw, mut pb) = (self.new_buf(nb * h), self.new_buf(nb * h));
        let mut dx = self.act_buf(x.len());
        let (tt, hh) = (t as u64, h as u32);
        self.run(Ok(main), |a| {
            a.arg(&xs)
                .arg(&ws)
                .arg(&*st)
                .arg(&dys)
                .arg(&mut dx)
                .arg(&mut pw)
                .arg(&mut pb)
                .arg(&tt)
                .arg(&hh);
        });
        let dw = self.acc(g.dw, "a layernorm weight gradient");
        self.reduce_rows(&red, &pw, dw, blocks, hh);
        let db = self.acc(g.db, "a layernorm bias gradient");
        self.reduce_rows(&red, &pb, db, blocks, hh);
        dx
    }

    fn gelu_fwd(&self, x: &Self::Buf) -> Self::Buf {
        let xs = self.act_in(x);
        let mut y = self.act_buf(x.len());
        let n = x.len() as u64;
        self.run(launch::gelu(self.act(), false, n), |b| {
            b.arg(&xs).arg(&mut y).arg(&n);
        });
        y
    }

    fn gelu_bwd(&self, x: &Self::Buf, dy: &Self::Buf) -> Self::Buf {
        let (xs, dys) = (self.act_in(x), self.act_in(dy));
        let mut dx = self.act_buf(x.len());
        let n = x.len() as u64;
        self.run(launch::gelu(self.act(), true, n), |b| {
            b.arg(&xs).arg(&dys).arg(&mut dx).arg(&n);
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
            if beta == 0.0 {
                self.fill_zero(c);
            } else {
                *c = self.scale(c, beta);
            }
            return;
        }
        let out = precision::gemm_out(self.precision, beta, c.kind());
        match self.precision {
            Precision::Fp32 => {
                require_f32(c.kind(), "an fp32-mode GEMM's result");
                let (x, y) = (self.read_f32(a.data), self.read_f32(b.data));
                self.materialize(c, Kind::F32);
                let Store::F32(cs) = c.store_mut() else {
                    unreachable!("an fp32 result")
                };
                let spec = GemmSpec::new(s, a.trans, b.trans, Elem::F32, Elem::F32);
                let _api = api();
                self.blas
                    .gemm::<F32, F32>(&spec, (1.0, beta), &x, &y, cs, None)
                    .unwrap_or_else(|e| fail("GEMM", e));
            }
            Precision::Bf16 => {
                let (x, y) = (self.read_bf16(a.data), self.read_bf16(b.data));
                if out != c.kind() {
                    if c.kind() == Kind::Zero {
                        self.materialize(c, out);
                    } else {
                        // beta == 0: a fresh bf16 result in place of what `c` held.
                        let fresh = match out {
                            Kind::Bf16 => Store::Bf16(self.dzeros(c.n)),
                            _ => Store::F32(self.dzeros(c.n)),
                        };
                        c.replace(fresh);
                    }
                }
                let ab = Elem::Bf16;
                match c.store_mut() {
                    Store::F32(cs) => {
                        let spec = GemmSpec::new(s, a.trans, b.trans, ab, Elem::F32);
                        let _api = api();
                        self.blas
                            .gemm::<Bf16, F32>(&spec, (1.0, beta), &x, &y, cs, None)
                            .unwrap_or_else(|e| fail("GEMM", e));
                    }
                    Store::Bf16(cs) => {
                        let spec = GemmSpec::new(s, a.trans, b.trans, ab, Elem::Bf16);
                        let _api = api();
                        self.blas
                            .gemm::<Bf16, Bf16>(&spec, (1.0, beta), &x, &y, cs, None)
                            .unwrap_or_else(|e| fail("GEMM", e));
                    }
                    Store::Zero => unreachable!("materialized"),
                }
            }
        }
        self.sync_point("GEMM");
    }

    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &Self::Buf,
        vocab_start: usize,
        h: usize,
    ) -> Self::Buf {
        let mut y = self.act_buf(ids.len() * h);
        if ids.is_empty() {
            return y;
        }
        let tb = self.act_in(table);
        let ids_d = self.ids(ids);
        let (hh, st, rw) = (h as u32, vocab_start as u64, (table.len() / h) as u64);
        self.run(
            launch::embedding_fwd(self.act(), ids.len() as u64, h as u64),
            |b| {
                b.arg(&*ids_d)
                    .arg(&tb)
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
        let dys = self.act_in(dy);
        let order = self.ids(&seg.order);
        let start = self.ids(&seg.seg_start);
        let row = self.ids(&seg.seg_row);
        let hh = h as u32;
        let dt = self.acc(dtable, "an embedding gradient");
        self.run(
            launch::embedding_bwd(self.act(), seg.seg_row.len() as u64, h as u64),
            |b| {
                b.arg(&*order)
                    .arg(&*start)
                    .arg(&*row)
                    .arg(&dys)
                    .arg(dt)
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
        let (xs, ws) = (self.act_in(x), self.act_in(w));
        let (mut y, mut rstd) = (self.act_buf(x.len()), self.new_buf(t));
        let hh = h as u32;
        self.run(
            launch::norm_fwd(Norm::Rms, self.act(), t as u64, h as u64),
            |b| {
                b.arg(&xs)
                    .arg(&ws)
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
        let [main, red] = launch::norm_bwd(Norm::Rms, self.act(), t as u64, h as u64)
            .unwrap_or_else(|e| fail("rmsnorm backward", e));
        let blocks = main.grid[0];
        let nb = blocks as usize;
        let (xs, ws, dys) = (self.act_in(x), self.act_in(w), self.act_in(dy));
        let r = self.stat(rstd, "the rmsnorm statistics");
        let mut partial = self.new_buf(nb * h);
        let mut dx = self.act_buf(x.len());
        let (tt, hh) = (t as u64, h as u32);
        self.run(Ok(main), |b| {
            b.arg(&xs)
                .arg(&ws)
                .arg(&*r)
                .arg(&dys)
                .arg(&mut dx)
                .arg(&mut partial)
                .arg(&tt)
                .arg(&hh);
        });
        let dw = self.acc(dw, "an rmsnorm weight gradient");
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
        let ls = self.attention_launches(&s);
        let (qs, ks, vs) = (self.act_in(q), self.act_in(k), self.act_in(v));
        let mut o = self.act_buf(q.len());
        let mut lse = self.new_buf(s.batch * s.heads * s.seq_q);
        let a = AttnArgs::of(&s);
        self.run(Ok(ls.fwd), |b| {
            b.arg(&qs).arg(&ks).arg(&vs).arg(&mut o).arg(&mut lse);
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
        let ls = self.attention_launches(&s);
        let (q, k, v) = (
            self.act_in(saved.q),
            self.act_in(saved.k),
            self.act_in(saved.v),
        );
        let (o, dos) = (self.act_in(saved.o), self.act_in(dout));
        let lse = self.stat(saved.lse, "the attention log-sum-exp");
        let rows = (s.batch * s.heads * s.seq_q) as u64;
        let mut delta = self.new_buf(rows as usize);
        let a = AttnArgs::of(&s);
        self.run(Ok(ls.bwd_delta), |b| {
            b.arg(&o)
                .arg(&dos)
                .arg(&mut delta)
                .arg(&rows)
                .arg(&a.sq)
                .arg(&a.hq)
                .arg(&a.hd);
        });
        let delta = self.stat(&delta, "the attention delta");
        let (mut dk, mut dv) = (self.act_buf(saved.k.len()), self.act_buf(saved.v.len()));
        self.run(Ok(ls.bwd_dkdv), |b| {
            b.arg(&q).arg(&k).arg(&v).arg(&dos).arg(&*lse).arg(&*delta);
            b.arg(&mut dk).arg(&mut dv);
            a.push(b);
        });
        let mut dq = self.act_buf(saved.q.len());
        self.run(Ok(ls.bwd_dq), |b| {
            b.arg(&q).arg(&k).arg(&v).arg(&dos).arg(&*lse).arg(&*delta);
            b.arg(&mut dq);
            a.push(b);
        });
        (dq, dk, dv)
    }

    fn swiglu_fwd(&self, gu: &Self::Buf, f: usize) -> Self::Buf {
        let t = (gu.len() / (2 * f)) as u64;
        let g = self.act_in(gu);
        let mut y = self.act_buf(t as usize * f);
        let ff = f as u32;
        self.run(launch::swiglu(self.act(), false, t, f as u64), |b| {
            b.arg(&g).arg(&mut y).arg(&t).arg(&ff);
        });
        y
    }

    fn swiglu_bwd(&self, gu: &Self::Buf, dy: &Self::Buf, f: usize) -> Self::Buf {
        let t = (gu.len() / (2 * f)) as u64;
        let (g, d) = (self.act_in(gu), self.act_in(dy));
        let mut dgu = self.act_buf(gu.len());
        let ff = f as u32;
        self.run(launch::swiglu(self.act(), true, t, f as u64), |b| {
            b.arg(&g).arg(&d).arg(&mut dgu).arg(&t).arg(&ff);
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
        let ls = launch::xent(self.act(), t as u64, v as u64)
            .unwrap_or_else(|e| fail("cross-entropy", e));
        let lg = self.act_in(logits);
        let tg_d = self.ids(targets);
        let (mut mx, mut se, mut lse, mut tg) = (
            self.new_buf(t),
            self.new_buf(t),
            self.new_buf(t),
            self.new_buf(t),
        );
        let (vv, st) = (v as u32, vocab_start as u64);
        self.run(Ok(ls.fwd_local), |b| {
            b.arg(&lg)
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
            return self.act_buf(0);
        }
        let ls = launch::xent(self.act(), t as u64, v as u64)
            .unwrap_or_else(|e| fail("cross-entropy", e));
        let lg = self.act_in(logits);
        let l = self.stat(lse, "the cross-entropy log-sum-exp");
        let tg_d = self.ids(targets);
        let mut dl = self.act_buf(t * v);
        let (vv, st) = (v as u32, vocab_start as u64);
        self.run(Ok(ls.bwd), |b| {
            b.arg(&lg)
                .arg(&*tg_d)
                .arg(&*l)
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
        require_f32(p.kind(), "AdamW's master weights");
        require_f32(g.kind(), "the gradient AdamW applies");
        let gs = self.read_f32(g);
        let ms = self.acc(m, "AdamW's first moment");
        let vs = self.acc(v, "AdamW's second moment");
        self.materialize(p, Kind::F32);
        let (bc1, bc2) = adamw_bias_corrections(&h);
        let null = 0u64;
        // The master in place; its bf16 copy (when a kernel has read one) refreshed by the
        // same kernel (`p_bf16`), so it stays the master rounded to bf16.
        let DBuf { st, shadow, .. } = p;
        let Store::F32(ps) = &mut **st else {
            unreachable!("fp32 master weights")
        };
        let copy = shadow.get_mut();
        self.run(launch::adamw(Dtype::F32, n), |b| {
            b.arg(ps).arg(&*gs).arg(ms).arg(vs);
            match copy {
                Some(c) => b.arg(c),
                None => b.arg(&null),
            };
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
