//! What a training framework's implementation overlaps and how it moves data.
//!
//! The cost model charges the same physics for every framework; the framework only decides
//! which mechanisms exist (see [`shardwright_spec::spec::Framework`] for the table and the
//! sources). No factor here is fitted: each is a count of transfers, a divisor of a message
//! or a switch on an overlap.
//!
//! - **Pipeline sends.** Megatron-Core batches a stage's send and receive of a micro-batch
//!   into one `batch_isend_irecv` (`send_forward_recv_backward` and the mirror), so a
//!   steady-state micro-batch pays two transfer times on the critical path. DeepSpeed's
//!   pipeline engine runs `RecvActivation`, `SendActivation`, `RecvGrad`, `SendGrad` as
//!   separate blocking instructions (`deepspeed/runtime/pipe/engine.py`), four transfer
//!   times per micro-batch.
//! - **Pipeline send size.** Without sequence parallelism every TP rank holds the full
//!   activation. Megatron splits the send over the TP ranks and all-gathers it on NVLink
//!   after the receive (`scatter_gather_tensors_in_pipeline`, on by default), so each NIC
//!   carries `1/tp`; DeepSpeed and torchtitan send the full tensor from every TP rank.
//!   With sequence parallelism the activation is already split, for everyone.
//! - **DP gradient reduction with PP.** Megatron and FSDP2/DDP hooks start reducing a
//!   bucket as soon as its gradients are final, beside the backward (the calibrated
//!   `dp_overlap` share hides). DeepSpeed's pipeline engine reduces after the last
//!   micro-batch's backward (`ReduceGrads` in `TrainSchedule`): nothing hides.
//! - **TP all-reduce.** Megatron overlaps the input-gradient all-reduce with the
//!   weight-gradient GEMM (async TP all-reduce), later the TE userbuffer overlap (the
//!   calibrated `tp_overlap`); Megatron-DeepSpeed's transformer layers issue them
//!   synchronously: nothing hides.

use shardwright_spec::spec::Framework;

/// The mechanisms of one framework, as numbers the cost model uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mechanisms {
    /// Transfer times one micro-batch pays per stage boundary on the critical path
    /// (forward activation and backward gradient, batched or not).
    pub p2p_transfers_per_microbatch: f64,
    /// Pipeline sends are split over the TP ranks (each sends `1/tp` of the activation)
    /// when sequence parallelism has not split it already.
    pub p2p_scatter_gather: bool,
    /// DP gradient traffic overlaps the backward when pipelining (else fully exposed).
    pub dp_overlap_with_pp: bool,
    /// TP collectives can hide behind GEMMs (else fully exposed).
    pub tp_overlap: bool,
}

pub fn mechanisms(f: Framework) -> Mechanisms {
    match f {
        Framework::Megatron | Framework::Nemo => Mechanisms {
            p2p_transfers_per_microbatch: 2.0,
            p2p_scatter_gather: true,
            dp_overlap_with_pp: true,
            tp_overlap: true,
        },
        Framework::Deepspeed => Mechanisms {
            p2p_transfers_per_microbatch: 4.0,
            p2p_scatter_gather: false,
            dp_overlap_with_pp: false,
            tp_overlap: false,
        },
        Framework::Torchtitan => Mechanisms {
            p2p_transfers_per_microbatch: 2.0,
            p2p_scatter_gather: false,
            dp_overlap_with_pp: true,
            tp_overlap: true,
        },
    }
}
