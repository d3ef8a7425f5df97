//! GEMMs through cuBLASLt (feature `cuda`), with the CPU reference's row-major convention
//! ([`crate::backend::Backend::gemm`]): `c[m, n] = alpha op(a)[m, k] op(b)[k, n] + beta c`,
//! where `op(x)` is the stored matrix or its transpose.
//!
//! cuBLASLt is column-major. A row-major `m x n` matrix is the column-major `n x m` matrix
//! with the same bytes (its transpose), so the row-major product `C = op(A) op(B)` is run as
//! the column-major `C^T = op(B)^T op(A)^T`: cuBLASLt's first operand is `b`, its second is
//! `a`, its `m, n` are our `n, m`, and each operand's transpose flag is the one the caller
//! gave (a row-major matrix read as column-major is already transposed, so "no transpose"
//! on our side is "no transpose" on theirs).
//!
//! Precision, as Megatron and torchtitan train: bf16 operands with fp32 accumulation
//! (`CUBLAS_COMPUTE_32F`) and a bf16 or fp32 result (fp32 for weight gradients accumulated
//! into fp32 main gradients, Megatron's `gradient_accumulation_fusion`); fp32 operands use
//! plain fp32 arithmetic (no TF32), so the reference comparison is tight. Epilogues fuse a
//! bias (one per output column) or bias + GELU (tanh form) into the GEMM's store, saving a
//! pass over the output.
//!
//! The descriptors, layouts and the heuristic's algorithm are made once per distinct
//! [`GemmSpec`] and cached; a call sets only the bias pointer and launches.

use crate::backend::GemmShape;
use crate::cuda::device::Device;
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Element type of a GEMM operand or result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Elem {
    F32,
    Bf16,
}

impl Elem {
    fn cuda(self) -> sys::cudaDataType {
        match self {
            Elem::F32 => sys::cudaDataType_t::CUDA_R_32F,
            Elem::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// What the GEMM's store does besides `alpha op(a) op(b) + beta c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Epilogue {
    None,
    /// `+ bias[col]`.
    Bias,
    /// `gelu(. + bias[col])`, GELU in its tanh form (the CPU reference's).
    GeluBias,
}

/// Everything that fixes a GEMM's cuBLASLt plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GemmSpec {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `a` is stored as `op(a)`'s transpose (`k x m`).
    pub trans_a: bool,
    /// `b` is stored as `op(b)`'s transpose (`n x k`).
    pub trans_b: bool,
    /// Element type of `a` and `b`.
    pub ab: Elem,
    /// Element type of `c` (and of the bias).
    pub c: Elem,
    pub epilogue: Epilogue,
}

impl GemmSpec {
    /// A plain GEMM of `shape` with operands of type `ab` and a result of type `c`.
    pub fn new(shape: GemmShape, trans_a: bool, trans_b: bool, ab: Elem, c: Elem) -> Self {
        GemmSpec {
            m: shape.m,
            k: shape.k,
            n: shape.n,
            trans_a,
            trans_b,
            ab,
            c,
            epilogue: Epilogue::None,
        }
    }
}

/// One cached plan: descriptors, layouts and the chosen algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the handles are plain descriptors, used only under `Blas::plans`' lock or after
// it (read-only) on the stream the `Blas` owns.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once and is destroyed once, here. Failures while
        // tearing down cannot be reported from a drop and leak at most a descriptor.
        unsafe {
            let _ = result::destroy_matrix_layout(self.c);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle on a device's stream with its workspace and plan cache.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: Mutex<BTreeMap<GemmSpec, Arc<Mutex<Plan>>>>,
}

// SAFETY: cuBLASLt handles may be used from any thread; calls on one handle are serialized
// by the plan locks and all work goes to the one stream.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.lock().map(|mut p| p.clear()).ok();
        // SAFETY: created in `Blas::new`, destroyed once.
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

fn blas_err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuBLASLt: {what}: {e:?}")
}

/// Workspace bytes NVIDIA recommends for Hopper (32 MiB; 4 MiB before it).
fn workspace_bytes(sm: u32) -> usize {
    if sm >= 90 {
        32 << 20
    } else {
        4 << 20
    }
}

impl Blas {
    /// A handle on `d`'s stream.
    pub fn new(d: &Device) -> Result<Blas, String> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublasLt is not on the library path".into());
        }
        let handle = result::create_handle().map_err(|e| blas_err("creating a handle", e))?;
        let workspace = d
            .stream
            .alloc_zeros::<u8>(workspace_bytes(d.sm))
            .map_err(|e| format!("cuBLASLt workspace: {e}"))?;
        Ok(Blas {
            handle,
            stream: d.stream.clone(),
            workspace,
            plans: Mutex::new(BTreeMap::new()),
        })
    }

    /// The cached plan of `s`, made on first use.
    fn plan(&self, s: &GemmSpec) -> Result<Arc<Mutex<Plan>>, String> {
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| "cuBLASLt plan cache poisoned")?;
        if let Some(p) = plans.get(s) {
            return Ok(p.clone());
        }
        let p = Arc::new(Mutex::new(self.make_plan(s)?));
        plans.insert(*s, p.clone());
        Ok(p)
    }

    fn make_plan(&self, s: &GemmSpec) -> Result<Plan, String> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (m, k, n) = (s.m as u64, s.k as u64, s.n as u64);
        // cuBLASLt's A is our b: column-major `n x k` (ld n) untransposed, else `k x n` (ld k).
        let (ar, ac) = if s.trans_b { (k, n) } else { (n, k) };
        // cuBLASLt's B is our a: column-major `k x m` (ld k) untransposed, else `m x k` (ld m).
        let (br, bc) = if s.trans_a { (m, k) } else { (k, m) };
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| blas_err("matmul descriptor", e))?;
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let layout = |t: Elem, r: u64, c: u64| {
            result::create_matrix_layout(t.cuda(), r, c, r as i64)
                .map_err(|e| blas_err("matrix layout", e))
        };
        plan.a = layout(s.ab, ar, ac)?;
        plan.b = layout(s.ab, br, bc)?;
        plan.c = layout(s.c, n, m)?;
        let set = |attr: D, v: &i32| {
            // SAFETY: `v` outlives the call; the attribute takes an int32.
            unsafe {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    v as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
            }
            .map_err(|e| blas_err("descriptor attribute", e))
        };
        set(D::CUBLASLT_MATMUL_DESC_TRANSA, &(s.trans_b as i32))?;
        set(D::CUBLASLT_MATMUL_DESC_TRANSB, &(s.trans_a as i32))?;
        let epi = match s.epilogue {
            Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epi as i32))?;
        if s.epilogue != Epilogue::None {
            // A placeholder so the heuristic sees a bias; each call sets the real one.
            self.set_bias(desc, self.workspace_ptr())?;
            let bt = s.c.cuda() as i32;
            set(D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt)?;
        }
        plan.algo = self.heuristic(&plan)?;
        Ok(plan)
    }

    fn workspace_ptr(&self) -> u64 {
        let (p, _rec) = self.workspace.device_ptr(&self.stream);
        p
    }

    fn set_bias(&self, desc: sys::cublasLtMatmulDesc_t, ptr: u64) -> Result<(), String> {
        // SAFETY: `ptr` outlives the call; the attribute takes a device pointer.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &ptr as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        }
        .map_err(|e| blas_err("bias pointer", e))
    }

    fn heuristic(&self, p: &Plan) -> Result<sys::cublasLtMatmulAlgo_t, String> {
        let pref = result::create_matmul_pref().map_err(|e| blas_err("preference", e))?;
        let size = self.workspace.len();
        // SAFETY: `size` outlives the call; every handle is live.
        let r = unsafe {
            result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &size as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .and_then(|_| {
                result::get_matmul_algo_heuristic(self.handle, p.desc, p.a, p.b, p.c, p.c, pref)
            })
        };
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = result::destroy_matmul_pref(pref);
        }
        r.map(|h| h.algo)
            .map_err(|e| blas_err("no algorithm for this GEMM (heuristic)", e))
    }

    /// Queues `c = alpha op(a) op(b) + beta c` (with `s.epilogue`'s bias, of `s.n` elements
    /// of `c`'s type) on the device's stream. Checks the element types and buffer sizes
    /// against `s`.
    pub fn gemm<A: Elemental, C: Elemental>(
        &self,
        s: &GemmSpec,
        (alpha, beta): (f32, f32),
        a: &CudaSlice<A::Item>,
        b: &CudaSlice<A::Item>,
        c: &mut CudaSlice<C::Item>,
        bias: Option<&CudaSlice<C::Item>>,
    ) -> Result<(), String> {
        check(
            s,
            A::ELEM,
            C::ELEM,
            a.len(),
            b.len(),
            c.len(),
            bias.map(|x| x.len()),
        )?;
        // cuBLASLt works in the calling thread's current context (a rank's thread may not
        // have made one current yet).
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("cuBLASLt: binding the context: {e}"))?;
        let plan = self.plan(s)?;
        let plan = plan.lock().map_err(|_| "cuBLASLt plan poisoned")?;
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pbias, _rbias) = match bias {
            Some(x) => {
                let (p, r) = x.device_ptr(&self.stream);
                (p, Some(r))
            }
            None => (0, None),
        };
        if s.epilogue != Epilogue::None {
            self.set_bias(plan.desc, pbias)?;
        }
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        let (pw, _rw) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the sizes were checked against the layouts; every pointer is live on
        // `self.stream` until the records drop after the launch is queued.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                pb as *const c_void,
                plan.a,
                pa as *const c_void,
                plan.b,
                pc as *const c_void,
                plan.c,
                pc as *mut c_void,
                plan.c,
                &plan.algo,
                pw as *mut c_void,
                self.workspace.len(),
                self.stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| blas_err(&format!("matmul {s:?}"), e))
    }
}

/// An element type with its host representation (`f32`, or `u16` for bf16 bits).
pub trait Elemental {
    type Item: cudarc::driver::DeviceRepr;
    const ELEM: Elem;
}

/// fp32 elements.
pub struct F32;
/// bf16 elements (stored as their bits, `u16`).
pub struct Bf16;

impl Elemental for F32 {
    type Item = f32;
    const ELEM: Elem = Elem::F32;
}

impl Elemental for Bf16 {
    type Item = u16;
    const ELEM: Elem = Elem::Bf16;
}

/// `s` against the buffers a caller passes: element types, and enough elements for each
/// matrix and the bias.
fn check(
    s: &GemmSpec,
    ab: Elem,
    c: Elem,
    a_len: usize,
    b_len: usize,
    c_len: usize,
    bias_len: Option<usize>,
) -> Result<(), String> {
    if (s.ab, s.c) != (ab, c) {
        return Err(format!(
            "GEMM {s:?} called with {ab:?} operands and a {c:?} result"
        ));
    }
    if s.m == 0 || s.n == 0 || s.k == 0 {
        return Err(format!("GEMM {s:?}: an empty dimension"));
    }
    let need = [
        ("a", s.m * s.k, a_len),
        ("b", s.k * s.n, b_len),
        ("c", s.m * s.n, c_len),
    ];
    for (what, want, have) in need {
        if have < want {
            return Err(format!(
                "GEMM {s:?}: `{what}` has {have} elements, needs {want}"
            ));
        }
    }
    match (s.epilogue, bias_len) {
        (Epilogue::None, None) => Ok(()),
        (Epilogue::None, Some(_)) => Err(format!("GEMM {s:?}: a bias without a bias epilogue")),
        (_, None) => Err(format!("GEMM {s:?}: the epilogue needs a bias")),
        (_, Some(l)) if l < s.n => Err(format!(
            "GEMM {s:?}: the bias has {l} elements, needs {}",
            s.n
        )),
        _ => Ok(()),
    }
}

/// Host values for timing: `n` bf16 values uniform in [-1, 1) (not zeros: a GEMM on zeros
/// runs faster than on real data).
pub fn random_bf16(n: usize, seed: u64) -> Vec<u16> {
    let mut g = crate::rng::Rng::new(seed);
    (0..n).map(|_| crate::cuda::bf16_bits(g.sym(1.0))).collect()
}

/// Seconds of each of `reps` runs of the bf16 GEMM `s` (bf16 result) after `warmup` runs,
/// timed with CUDA events around each run; operands are taken from `pool` (random values,
/// at least as long as the largest operand).
pub fn time_bf16_gemm(
    d: &Device,
    blas: &Blas,
    s: &GemmSpec,
    pool: &[u16],
    warmup: u32,
    reps: u32,
) -> Result<Vec<f64>, String> {
    let need = (s.m * s.k).max(s.k * s.n).max(s.m * s.n);
    if pool.len() < need {
        return Err(format!(
            "timing pool of {} values, {need} needed",
            pool.len()
        ));
    }
    let a = d.upload(&pool[..s.m * s.k])?;
    let b = d.upload(&pool[pool.len() - s.k * s.n..])?;
    let mut c = d.upload(&pool[..s.m * s.n])?;
    d.time_each(warmup, reps, || {
        blas.gemm::<Bf16, Bf16>(s, (1.0, 0.0), &a, &b, &mut c, None)
    })
}
