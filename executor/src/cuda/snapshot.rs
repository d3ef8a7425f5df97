//! Checkpoint snapshots of device tensors through page-locked host memory (feature `cuda`).
//!
//! The blocking part of an asynchronous checkpoint is the copy of the rank's state out of
//! device memory ([`crate::checkpoint`]: building the [`RankState`] is the copy that
//! blocks training; the writer thread does the rest). [`PinnedStaging`] makes that copy at
//! the DMA engine's rate: every tensor is copied device-to-host into its own page-locked
//! buffer, all copies queued on one stream of their own and waited for once (pageable
//! memory would make the driver stage each copy through a bounce buffer, synchronously).
//! The pinned buffers are kept and reused by the next snapshot (pinning is slow: it maps
//! and locks every page), reallocated only when a tensor grows.
//!
//! The buffers are allocated without `CU_MEMHOSTALLOC_WRITECOMBINED` (cudarc's
//! `alloc_pinned` default): write-combined memory is uncached for the CPU, and the host
//! reads every byte of it once more to build the [`RankState`].
//!
//! The writer takes a [`RankState`] of owned `Vec<f32>`s, so each pinned buffer is then
//! copied once on the host (memory bandwidth, not PCIe); handing the pinned buffers
//! themselves to the writer would need it to accept borrowed storage, which it does not.

use crate::checkpoint::{Checkpointer, RankState};
use crate::cuda::device::Device;
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Page-locked staging buffers for one rank's snapshots, one per tensor name.
pub struct PinnedStaging {
    stream: Arc<CudaStream>,
    /// The device's stream, where everything that writes the tensors is queued.
    main: Arc<CudaStream>,
    buffers: BTreeMap<String, PinnedHostSlice<f32>>,
}

impl PinnedStaging {
    /// Staging on `dev`, with a stream of its own for the copies. The device runs without
    /// cudarc's per-buffer events (`Device::new`: one stream), so nothing orders a copy
    /// after the work that wrote its tensor but [`PinnedStaging::stage`]'s wait on the
    /// device's stream; the next writes come after `stage` returns, which waits for the
    /// copies.
    pub fn new(dev: &Device) -> Result<PinnedStaging, String> {
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| format!("snapshot stream: {e}"))?;
        Ok(PinnedStaging {
            stream,
            main: dev.stream.clone(),
            buffers: BTreeMap::new(),
        })
    }

    /// Bytes of page-locked memory held.
    pub fn pinned_bytes(&self) -> u64 {
        self.buffers.values().map(|b| b.num_bytes() as u64).sum()
    }

    /// Copies every `(name, tensor)` into its pinned buffer (all queued, then waited for)
    /// and returns them as rank `rank`'s state with `meta`. Names must be distinct.
    pub fn stage(
        &mut self,
        rank: u32,
        tensors: &[(&str, &CudaSlice<f32>)],
        meta: serde_json::Value,
    ) -> Result<RankState, String> {
        for (i, (name, _)) in tensors.iter().enumerate() {
            if tensors[..i].iter().any(|(n, _)| n == name) {
                return Err(format!(
                    "snapshot of rank {rank}: tensor `{name}` given twice"
                ));
            }
        }
        let ctx = self.stream.context().clone();
        // The copies start after everything queued on the device's stream so far (the
        // uploads, kernels and collectives that wrote the tensors). Without this wait a
        // copy could read a tensor before its last write: a checkpoint of stale values
        // (seen on an H200: a freshly uploaded tensor snapshotted as zeros).
        self.stream.join(&self.main).map_err(|e| {
            format!("snapshot of rank {rank}: ordering after the device's work: {e}")
        })?;
        for (name, t) in tensors {
            let fits = self.buffers.get(*name).is_some_and(|b| b.len() >= t.len());
            if !fits {
                // SAFETY: the buffer is written by the copy below before anything reads it.
                let b = unsafe { ctx.alloc_pinned_with_flags::<f32>(t.len().max(1), 0) }.map_err(
                    |e| {
                        format!(
                            "pinning {} bytes for `{name}`: {e}",
                            t.len().max(1) * std::mem::size_of::<f32>()
                        )
                    },
                )?;
                self.buffers.insert(name.to_string(), b);
            }
            let buf = self.buffers.get_mut(*name).expect("just inserted");
            self.stream
                .memcpy_dtoh(*t, buf)
                .map_err(|e| format!("copying `{name}` ({} values) to the host: {e}", t.len()))?;
        }
        let mut out = BTreeMap::new();
        for (name, t) in tensors {
            let host = self.buffers[*name]
                .as_slice()
                .map_err(|e| format!("waiting for the copy of `{name}`: {e}"))?;
            out.insert(name.to_string(), host[..t.len()].to_vec());
        }
        Ok(RankState {
            rank,
            tensors: out,
            meta,
        })
    }
}

/// Snapshot of rank `rank` of `world` at `step` from device tensors: staged through
/// `staging` (the blocking copy), then queued on `ckpt`'s background writer, which
/// returns at once ([`Checkpointer::snapshot`]).
pub fn snapshot_device(
    ckpt: &Checkpointer,
    staging: &mut PinnedStaging,
    step: u64,
    world: u32,
    rank: u32,
    tensors: &[(&str, &CudaSlice<f32>)],
    meta: serde_json::Value,
) -> Result<(), String> {
    let state = staging.stage(rank, tensors, meta)?;
    ckpt.snapshot(step, world, state)
        .map_err(|e| format!("step {step} rank {rank}: {e}"))
}
