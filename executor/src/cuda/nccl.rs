//! NCCL communicators on device buffers (feature `cuda`): one per process group of the
//! program, created from the unique id the bootstrap hands out
//! ([`crate::cuda::bootstrap`]: rank 0 makes it with [`crate::cuda::device::nccl_unique_id`],
//! every rank reads it from the rendezvous store), and the collectives the lowering emits:
//! all-reduce (sum or average), all-gather, reduce-scatter and broadcast, on fp32 or bf16
//! buffers, queued on the device's stream.
//!
//! Layouts are NCCL's and the CPU communicator's ([`crate::comm`]): an all-gather's output
//! is the members' inputs in rank order; a reduce-scatter's input is `world` equal chunks in
//! rank order and member `r` keeps the reduction of chunk `r`.
//!
//! NCCL refuses two ranks of one communicator on one GPU, so on a one-GPU machine only a
//! one-rank communicator runs (`tests/cuda_nccl.rs`); every rank of a multi-GPU machine runs
//! the same code.

use crate::cuda::bootstrap::UniqueId;
use crate::cuda::device::Device;
use crate::cuda::gemm::{Elem, Elemental};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};
use std::ffi::c_void;
use std::sync::Arc;

/// The reduction of an all-reduce or reduce-scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// The sum over the members divided by their number (`ncclAvg`).
    Avg,
    /// The elementwise maximum (`ncclMax`: the vocabulary-parallel loss's logit maximum).
    Max,
}

/// A communicator of `world` ranks, this process being `rank`.
pub struct DeviceComm {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time; `&mut self` on
// every collective serializes the calls.
unsafe impl Send for DeviceComm {}

impl Drop for DeviceComm {
    fn drop(&mut self) {
        // SAFETY: created once in `new`, destroyed once. Errors while tearing down cannot be
        // reported from a drop.
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}

fn dtype(e: Elem) -> sys::ncclDataType_t {
    match e {
        Elem::F32 => sys::ncclDataType_t::ncclFloat32,
        Elem::Bf16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

fn op(r: Reduce) -> sys::ncclRedOp_t {
    match r {
        Reduce::Sum => sys::ncclRedOp_t::ncclSum,
        Reduce::Avg => sys::ncclRedOp_t::ncclAvg,
        Reduce::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl DeviceComm {
    /// Joins the communicator of `world` ranks identified by `id` as `rank`, on `d`'s
    /// stream (`ncclCommInitRank`; blocks until every rank has joined).
    pub fn new(d: &Device, id: &UniqueId, rank: usize, world: usize) -> Result<Self, String> {
        if rank >= world {
            return Err(format!("NCCL: rank {rank} of a communicator of {world}"));
        }
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("libnccl is not on the library path".into());
        }
        d.ctx
            .bind_to_thread()
            .map_err(|e| format!("NCCL: binding the context: {e}"))?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (o, &b) in internal.iter_mut().zip(id.iter()) {
            *o = b as std::ffi::c_char;
        }
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful init and read only then.
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                world as i32,
                sys::ncclUniqueId { internal },
                rank as i32,
            )
            .map_err(|e| format!("ncclCommInitRank (rank {rank} of {world}): {e:?}"))?;
            comm.assume_init()
        };
        Ok(DeviceComm {
            comm,
            stream: d.stream.clone(),
            rank,
            world,
        })
    }

    fn stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// `out = reduce over members of x` (`x` and `out` of equal length).
    pub fn all_reduce<T: Elemental>(
        &mut self,
        x: &CudaSlice<T::Item>,
        out: &mut CudaSlice<T::Item>,
        r: Reduce,
    ) -> Result<(), String> {
        if x.len() != out.len() {
            return Err(format!(
                "all-reduce: {} elements in, {} out",
                x.len(),
                out.len()
            ));
        }
        let (src, _rs) = x.device_ptr(&self.stream);
        let (dst, _rd) = out.device_ptr_mut(&self.stream);
        // SAFETY: both buffers hold `x.len()` elements of `T` on this communicator's stream.
        unsafe {
            result::all_reduce(
                src as *const c_void,
                dst as *mut c_void,
                x.len(),
                dtype(T::ELEM),
                op(r),
                self.comm,
                self.stream(),
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclAllReduce of {} elements: {e:?}", x.len()))
    }

    /// `out` = every member's `x`, in rank order (`out` holds `world x.len()` elements).
    pub fn all_gather<T: Elemental>(
        &mut self,
        x: &CudaSlice<T::Item>,
        out: &mut CudaSlice<T::Item>,
    ) -> Result<(), String> {
        if out.len() != x.len() * self.world {
            return Err(format!(
                "all-gather over {}: {} elements in, {} out (needs {})",
                self.world,
                x.len(),
                out.len(),
                x.len() * self.world
            ));
        }
        let (src, _rs) = x.device_ptr(&self.stream);
        let (dst, _rd) = out.device_ptr_mut(&self.stream);
        // SAFETY: sizes checked above; both on this communicator's stream.
        unsafe {
            result::all_gather(
                src as *const c_void,
                dst as *mut c_void,
                x.len(),
                dtype(T::ELEM),
                self.comm,
                self.stream(),
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclAllGather of {} elements: {e:?}", x.len()))
    }

    /// `out` = the reduction of chunk `rank` of every member's `x` (`x` holds `world
    /// out.len()` elements).
    pub fn reduce_scatter<T: Elemental>(
        &mut self,
        x: &CudaSlice<T::Item>,
        out: &mut CudaSlice<T::Item>,
        r: Reduce,
    ) -> Result<(), String> {
        if x.len() != out.len() * self.world {
            return Err(format!(
                "reduce-scatter over {}: {} elements in, {} out (needs {} in)",
                self.world,
                x.len(),
                out.len(),
                out.len() * self.world
            ));
        }
        let n = out.len();
        let (src, _rs) = x.device_ptr(&self.stream);
        let (dst, _rd) = out.device_ptr_mut(&self.stream);
        // SAFETY: sizes checked above; both on this communicator's stream.
        unsafe {
            result::reduce_scatter(
                src as *const c_void,
                dst as *mut c_void,
                n,
                dtype(T::ELEM),
                op(r),
                self.comm,
                self.stream(),
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclReduceScatter of {n} elements: {e:?}"))
    }

    /// Every member's `buf` = member `root`'s (in place).
    pub fn broadcast<T: Elemental>(
        &mut self,
        buf: &mut CudaSlice<T::Item>,
        root: usize,
    ) -> Result<(), String> {
        if root >= self.world {
            return Err(format!("broadcast from rank {root} of {}", self.world));
        }
        let n = buf.len();
        let (p, _r) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in place on one live buffer of `n` elements.
        unsafe {
            result::broadcast(
                p as *const c_void,
                p as *mut c_void,
                n,
                dtype(T::ELEM),
                root as i32,
                self.comm,
                self.stream(),
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclBroadcast of {n} elements: {e:?}"))
    }
}
