//! The host side of the CUDA backend through `cudarc` (feature `cuda`). Every CUDA library
//! is loaded at run time (`dynamic-loading`): building and starting need no CUDA; what a
//! machine lacks is an error here, never a failed link.
//!
//! [`Device`] owns a context on one GPU, compiles every file of the registry
//! ([`crate::cuda::kernels::FILES`]) with NVRTC for the device's compute capability, loads
//! the modules and resolves every entry point. [`Device::prepare`] turns a
//! [`Launch`](crate::cuda::launch::Launch) into `cudarc`'s launch configuration after checking
//! it against the device's limits (setting the shared-memory opt-in when needed).
//! [`Device::upload`], [`Device::zeros`], [`Device::download`] and [`Device::launch`] are
//! what a caller (the kernel tests, `tests/cuda_kernels.rs`) needs to run one kernel.
//! [`nccl_unique_id`] is rank 0's half of the NCCL bootstrap
//! ([`crate::cuda::bootstrap`]).

use crate::cuda::bootstrap::{UniqueId, NCCL_UNIQUE_ID_BYTES};
use crate::cuda::kernels::{nvrtc_options, FILES};
use crate::cuda::launch::{Launch, Limits};
/// CUDA event flags (`CU_EVENT_DEFAULT` makes a timing event).
pub use cudarc::driver::sys::CUevent_flags as EventFlags;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
/// Re-exported for callers of [`Device::launch`] (device buffers, element types, kernel
/// arguments).
pub use cudarc::driver::{CudaSlice, DeviceRepr, LaunchArgs, PushKernelArg, ValidAsZeroBits};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use std::collections::HashMap;
use std::sync::Arc;

/// Which of the CUDA libraries this process can load: `(driver, nvrtc, nccl)`.
pub fn libraries_present() -> (bool, bool, bool) {
    // SAFETY: these only try to open the shared libraries (dlopen), nothing is called.
    unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    }
}

/// Why no GPU can be used here, or `None` when the driver loads and sees a device.
pub fn unavailable() -> Option<String> {
    let (driver, nvrtc, _) = libraries_present();
    if !driver {
        return Some("the CUDA driver library (libcuda.so) is not installed".into());
    }
    if !nvrtc {
        return Some(
            "libnvrtc is not on the library path (scripts/gpu/install-cuda-tools.sh installs it under target/cuda-tools)"
                .into(),
        );
    }
    match CudaContext::device_count() {
        Ok(0) => Some("the CUDA driver sees no device".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA driver failed: {e}")),
    }
}

/// The include directory with `cuda_bf16.h`: `$SHARDWRIGHT_CUDA_INCLUDE`, else
/// `$CUDA_HOME/include`, else `/usr/local/cuda/include`.
pub fn cuda_include_dir() -> String {
    std::env::var("SHARDWRIGHT_CUDA_INCLUDE")
        .or_else(|_| std::env::var("CUDA_HOME").map(|h| format!("{h}/include")))
        .unwrap_or_else(|_| "/usr/local/cuda/include".into())
}

/// The stream-ordered allocator's pool keeps what is freed instead of handing it back to
/// the driver at every synchronization (the default release threshold is 0 bytes): a
/// training step frees and allocates the same activation sizes again and again, and
/// mapping them afresh after each `download` (which waits for the stream) costs
/// milliseconds per buffer. As PyTorch's caching allocator, the memory stays reserved
/// for the process (freed with it). Devices without memory pools allocate synchronously
/// and are left as they are.
fn keep_freed_memory(ctx: &CudaContext, ordinal: usize) -> Result<(), String> {
    use cudarc::driver::{result, sys};
    let dev = ctx.cu_device();
    let what = |e: cudarc::driver::DriverError| format!("CUDA device {ordinal}: memory pool: {e}");
    // SAFETY: `dev` is the context's device; the attribute is an int.
    let pools = unsafe {
        result::device::get_attribute(
            dev,
            sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
        )
    }
    .map_err(what)?;
    if pools == 0 {
        return Ok(());
    }
    let mut keep = u64::MAX;
    // SAFETY: the device's current pool; the release threshold is a u64 (cuuint64_t) that
    // outlives the call.
    unsafe {
        let pool = result::device::get_mem_pool(dev).map_err(what)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )
        .map_err(what)
    }
}

/// One GPU with every kernel loaded.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Compute capability as `major * 10 + minor` (90 for H100).
    pub sm: u32,
    pub limits: Limits,
    functions: HashMap<&'static str, CudaFunction>,
}

impl Device {
    /// A context on GPU `ordinal` with every kernel compiled (NVRTC, `compute_<sm>`) and
    /// loaded; `include_dir` holds the CUDA headers ([`cuda_include_dir`]).
    pub fn new(ordinal: usize, include_dir: &str) -> Result<Device, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let mut d = Device::open(ordinal)?;
        let sm = d.sm;
        for f in FILES {
            let opts = CompileOptions {
                options: nvrtc_options(sm),
                include_paths: vec![include_dir.to_string()],
                name: Some(f.file.to_string()),
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(f.source(), opts)
                .map_err(|e| format!("NVRTC: {} for sm_{sm}: {e:?}", f.file))?;
            let module = d
                .ctx
                .load_module(ptx)
                .map_err(|e| format!("loading {} on device {ordinal}: {e}", f.file))?;
            for &entry in f.entries {
                let func = module
                    .load_function(entry)
                    .map_err(|e| format!("{}: entry point {entry}: {e}", f.file))?;
                d.functions.insert(entry, func);
            }
        }
        Ok(d)
    }

    /// A context on GPU `ordinal` with no kernels loaded (NVRTC not needed): for library
    /// calls only (cuBLASLt, NCCL), as `calibrate --device` makes them.
    pub fn open(ordinal: usize) -> Result<Device, String> {
        // SAFETY: only tries to open the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) is not installed".into());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        let sm = (major * 10 + minor) as u32;
        let limits = if sm >= 90 { Limits::SM90 } else { Limits::SM80 };
        keep_freed_memory(&ctx, ordinal)?;
        // SAFETY: every buffer is allocated, used and freed on the one stream below (the
        // kernels, cuBLASLt, NCCL and the copies all queue on it), so no cross-stream
        // events are needed; without this cudarc creates two events per allocation and
        // records them at every use.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(Device {
            ctx,
            stream,
            sm,
            limits,
            functions: HashMap::new(),
        })
    }

    /// The device's name as the driver reports it (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> Result<String, String> {
        self.ctx
            .name()
            .map_err(|e| format!("the device's name: {e}"))
    }

    /// The loaded entry point `entry`.
    pub fn function(&self, entry: &str) -> Option<&CudaFunction> {
        self.functions.get(entry)
    }

    /// The function and `cudarc` configuration of `l`, checked against this device's
    /// limits; sets the dynamic shared-memory opt-in when `l` needs more than the default.
    pub fn prepare(&self, l: &Launch) -> Result<(&CudaFunction, LaunchConfig), String> {
        l.check(&self.limits).map_err(|e| e.to_string())?;
        let f = self
            .function(&l.entry)
            .ok_or_else(|| format!("{}: not loaded", l.entry))?;
        if l.needs_smem_optin(&self.limits) {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem as i32,
            )
            .map_err(|e| format!("{}: shared-memory opt-in of {} bytes: {e}", l.entry, l.smem))?;
        }
        Ok((
            f,
            LaunchConfig {
                grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                block_dim: (l.block[0], l.block[1], l.block[2]),
                shared_mem_bytes: l.smem,
            },
        ))
    }
}

impl Device {
    /// A new device buffer holding `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, String> {
        self.stream
            .clone_htod(host)
            .map_err(|e| format!("copying {} values to the device: {e}", host.len()))
    }

    /// A new device buffer of `n` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, String> {
        self.stream
            .alloc_zeros(n)
            .map_err(|e| format!("allocating {n} values on the device: {e}"))
    }

    /// The contents of `d`, after everything queued on the stream has finished (so a kernel
    /// error surfaces here, named).
    pub fn download<T: DeviceRepr>(&self, d: &CudaSlice<T>) -> Result<Vec<T>, String> {
        let v = self
            .stream
            .clone_dtoh(d)
            .map_err(|e| format!("copying {} values from the device: {e}", d.len()))?;
        self.stream
            .synchronize()
            .map_err(|e| format!("waiting for the stream: {e}"))?;
        Ok(v)
    }

    /// Queues `l` (checked and prepared by [`Device::prepare`]) on the device's stream with
    /// the arguments `args` pushes, in the order of the kernel's parameters: device buffers
    /// as `&CudaSlice` (read) or `&mut CudaSlice` (written), scalars by reference with the
    /// exact C type (`u32`, `u64`, `i64`, `f32`), a null pointer as `&0u64`.
    ///
    /// # Safety
    ///
    /// The arguments must match the kernel's signature in number, order and type, and the
    /// buffers must be as large as the kernel reads and writes for `l`'s shape: nothing
    /// checks either.
    pub unsafe fn launch<'a>(
        &'a self,
        l: &Launch,
        args: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), String> {
        let (f, cfg) = self.prepare(l)?;
        let mut b = self.stream.launch_builder(f);
        args(&mut b);
        b.launch(cfg).map_err(|e| {
            format!(
                "{}: launch of grid {:?} block {:?} smem {}: {e}",
                l.entry, l.grid, l.block, l.smem
            )
        })?;
        Ok(())
    }

    /// Seconds of each of `reps` runs of `f` (which queues work on the stream) after
    /// `warmup` untimed runs, each timed by CUDA events recorded around it.
    pub fn time_each(
        &self,
        warmup: u32,
        reps: u32,
        mut f: impl FnMut() -> Result<(), String>,
    ) -> Result<Vec<f64>, String> {
        for _ in 0..warmup {
            f()?;
        }
        let ev = || {
            self.ctx
                .new_event(Some(EventFlags::CU_EVENT_DEFAULT))
                .map_err(|e| format!("creating a CUDA event: {e}"))
        };
        let mut out = Vec::with_capacity(reps as usize);
        for _ in 0..reps {
            let (t0, t1) = (ev()?, ev()?);
            t0.record(&self.stream)
                .map_err(|e| format!("recording: {e}"))?;
            f()?;
            t1.record(&self.stream)
                .map_err(|e| format!("recording: {e}"))?;
            let ms = t0
                .elapsed_ms(&t1)
                .map_err(|e| format!("reading the timing events: {e}"))?;
            out.push(ms as f64 / 1e3);
        }
        self.synchronize()?;
        Ok(out)
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| format!("waiting for the stream: {e}"))
    }
}

/// A fresh NCCL unique id (`ncclGetUniqueId`), rank 0's side of the bootstrap.
pub fn nccl_unique_id() -> Result<UniqueId, String> {
    if !libraries_present().2 {
        return Err("libnccl is not installed (NCCL's unique id needs it on rank 0)".into());
    }
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
    let mut out = [0u8; NCCL_UNIQUE_ID_BYTES];
    for (o, &c) in out.iter_mut().zip(id.internal.iter()) {
        *o = c as u8;
    }
    Ok(out)
}
