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
//! - **Pipeline sends beside compute (interleaved schedule).** Megatron-Core's interleaved
//!   1F1B posts the next chunk's receive and this chunk's send asynchronously and waits
//!   for them only before the compute that needs them (`overlap_p2p_comm`,
//!   `megatron/core/pipeline_parallel/schedules.py`), so a steady-state transfer runs
//!   beside a chunk's compute. Megatron-LM turns it on for every interleaved run (flag
//!   `--no-overlap-p2p-communication` to turn it off, `megatron/training/arguments.py`;
//!   it is forced off without interleaving), and Megatron-Bridge / NeMo's
//!   `CommOverlapConfig` sets `overlap_p2p_comm = True, batch_p2p_comm = False` whenever
//!   the virtual pipeline size is above 1 (`src/megatron/bridge/training/comm_overlap.py`).
//!   The warm-up and cool-down transfers still wait. DeepSpeed's blocking instructions
//!   and torchtitan's schedules are left as they were (every transfer on the path).
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
//! - **Context-parallel attention.** Megatron-Core and NeMo run Transformer Engine's
//!   `AttnFuncWithCPAndKVP2P`: a ring of P2P sends of 16-bit K/V chunks overlapped with
//!   the attention of the chunk in hand, dK/dV sent back the same way, the output
//!   correction fused into one kernel per step. torchtitan runs PyTorch's
//!   `torch.distributed.tensor.experimental.context_parallel`
//!   (`_templated_ring_attention`), whose defaults all-gather K/V once per pass, merge
//!   the block outputs with separate fp32 kernels and rotate fp32 dK/dV
//!   ([`crate::ring`] counts both).
//! - **Attention kernel on Hopper.** Transformer Engine (Megatron-Core, NeMo) picks cuDNN's
//!   fused attention over FlashAttention on sm90+; PyTorch SDPA (torchtitan) tries
//!   FlashAttention-2 first and cuDNN last, and DeepSpeed's Megatron fork calls the
//!   `flash_attn` package (FlashAttention-2). The measured ratio of the two kernels is in
//!   [`crate::attention::kernel_factor`].
//! - **Selective activation checkpointing.** Megatron's `--recompute-granularity selective`
//!   recomputes the attention core (plus the `recompute_modules` a NeMo/Megatron-Core run
//!   names); DeepSpeed's Megatron fork does the same. torchtitan's `selective` AC with its
//!   default `op` option (`torchtitan/models/llama*/parallelize.py`, `_save_list`) is an
//!   op-level policy instead: it keeps the outputs of the attention kernel, of the TP
//!   reduce-scatters and of every other `aten.mm` of a block (the 1st, 3rd, ... in forward
//!   order: wq, wv, w1, w2 of a Llama block) and recomputes everything else from the block
//!   input (wk, wo, w3, the norms, rotary, the activation, the TP all-gathers).

use shardwright_spec::job::Model;
use shardwright_spec::spec::{Activation, Framework, Norm};

/// What `recompute: selective` recomputes (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectiveAc {
    /// Megatron: the attention core, plus the spec's `recompute_modules`.
    Modules,
    /// torchtitan's op-level policy: every other matmul of a dense block and every
    /// elementwise op; the attention kernel's output kept. MoE blocks keep the module
    /// semantics (their grouped GEMMs are not `aten.mm`).
    EveryOtherMatmul,
}

/// How a framework runs context-parallel (ring) attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpRing {
    /// Transformer Engine's `AttnFuncWithCPAndKVP2P` (Megatron-Core, NeMo): K/V chunks
    /// passed to the next rank by P2P send/recv in 16 bits while the current chunk's
    /// attention runs, dK/dV passed back the same way; output corrections fused.
    P2p,
    /// PyTorch's `context_parallel` (torchtitan): K/V all-gathered once per pass, block
    /// outputs merged and gradients accumulated by separate fp32 kernels, dK/dV rotated in
    /// fp32 ([`crate::ring`]).
    TorchAllGather,
}

/// Which flash-attention kernel a framework's attention runs on a Hopper GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// Transformer Engine's backend choice (Megatron-Core, NeMo, Megatron-Bridge): cuDNN's
    /// fused attention on Hopper ("Disabling FlashAttention to give FusedAttention
    /// preference on Hopper+ for performance reasons", `get_attention_backend`).
    TeFused,
    /// FlashAttention-2: PyTorch SDPA's first backend (`sdp_utils.cpp` `priority_order`:
    /// flash, efficient, math, cuDNN last; torchtitan under CP restricts SDPA to the flash
    /// and efficient backends), and the `flash_attn` package DeepSpeed's Megatron fork calls.
    ///
    /// PyTorch 2.5.0 had put cuDNN first on H100; after its 2.5 bugs cuDNN became opt-in
    /// again (pytorch/pytorch#138522, tracked in #138649), so the December 2024 nightlies
    /// that torchtitan's published Grand Teton benchmarks ran on picked FlashAttention-2
    /// there: pytorch/pytorch#142132 (closed as expected behaviour) measured native SDPA at
    /// 329 TFLOP/s against cuDNN's 631 on an H100 with `2.6.0.dev20241204`, forward, head
    /// dim 128. Later releases prefer cuDNN on sm90 only with a bundled cuDNN newer than
    /// 9.15 (`check_prefer_cudnn_attention` in `sdp_utils.cpp`).
    FlashAttention2,
}

/// The mechanisms of one framework, as numbers the cost model uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mechanisms {
    /// Transfer times one micro-batch pays per stage boundary on the critical path
    /// (forward activation and backward gradient, batched or not).
    pub p2p_transfers_per_microbatch: f64,
    /// Pipeline sends are split over the TP ranks (each sends `1/tp` of the activation)
    /// when sequence parallelism has not split it already.
    pub p2p_scatter_gather: bool,
    /// Steady-state pipeline sends of the interleaved schedule run beside a chunk's
    /// compute (Megatron-Core's `overlap_p2p_comm`); else every transfer is on the path.
    pub p2p_overlap_interleaved: bool,
    /// DP gradient traffic overlaps the backward when pipelining (else fully exposed).
    pub dp_overlap_with_pp: bool,
    /// TP collectives can hide behind GEMMs (else fully exposed).
    pub tp_overlap: bool,
    /// What selective activation recompute means.
    pub selective: SelectiveAc,
    /// Context-parallel attention's implementation.
    pub cp_ring: CpRing,
    /// The attention kernel on Hopper ([`crate::attention::kernel_factor`]).
    pub attn_kernel: AttnKernel,
}

pub fn mechanisms(f: Framework) -> Mechanisms {
    match f {
        Framework::Megatron | Framework::Nemo => Mechanisms {
            p2p_transfers_per_microbatch: 2.0,
            p2p_scatter_gather: true,
            p2p_overlap_interleaved: true,
            dp_overlap_with_pp: true,
            tp_overlap: true,
            selective: SelectiveAc::Modules,
            cp_ring: CpRing::P2p,
            attn_kernel: AttnKernel::TeFused,
        },
        Framework::Deepspeed => Mechanisms {
            p2p_transfers_per_microbatch: 4.0,
            p2p_scatter_gather: false,
            p2p_overlap_interleaved: false,
            dp_overlap_with_pp: false,
            tp_overlap: false,
            selective: SelectiveAc::Modules,
            cp_ring: CpRing::P2p,
            attn_kernel: AttnKernel::FlashAttention2,
        },
        Framework::Torchtitan => Mechanisms {
            p2p_transfers_per_microbatch: 2.0,
            p2p_scatter_gather: false,
            p2p_overlap_interleaved: false,
            dp_overlap_with_pp: true,
            tp_overlap: true,
            selective: SelectiveAc::EveryOtherMatmul,
            cp_ring: CpRing::TorchAllGather,
            attn_kernel: AttnKernel::FlashAttention2,
        },
    }
}

/// Whether `recompute: selective` means torchtitan's op-level policy under framework `f`
/// (on dense blocks; MoE blocks keep the module semantics).
pub fn op_level_ac(f: Framework) -> bool {
    mechanisms(f).selective == SelectiveAc::EveryOtherMatmul
}

/// Whether a job's block elementwise ops run as separate eager PyTorch kernels: torchtitan
/// without torch.compile. Megatron, NeMo and DeepSpeed use fused kernels (Apex/TE norms,
/// fused rotary, bias-activation and bias-dropout-add fusions).
pub fn eager_elementwise(f: Framework, torch_compile: bool) -> bool {
    f == Framework::Torchtitan && !torch_compile
}

/// Bytes the hidden-size elementwise ops of a block (two norms, two residual adds, rotary
/// on q and k) move in eager PyTorch over what fused kernels move, forward, per element of
/// the hidden state (16-bit activations; the backward's autograd kernels are as unfused).
/// Counted kernel by kernel (reads + writes):
///
/// - RMSNorm as torchtitan's Llama writes it (`x.float()`, `pow(2)`, `mean`, `x * rsqrt`,
///   `type_as`, `* weight`): 6 + 8 + 4 + 8 + 6 + 4 = 36 B; fused 4 B (read, write).
///   LayerNorm is one kernel in eager PyTorch too (`F.layer_norm`): 4 B either way.
/// - Residual add: 6 B either way.
/// - Rotary per q/k element (`float()` into a complex view, complex multiply, `type_as`):
///   6 + 8 + 6 = 20 B; fused 4 B. None with learned positions.
/// - Grouped-query attention: eager `repeat_kv` materialises k and v at the query width
///   (read `kvd`, write `qd`, 16-bit, each); fused kernels read the shared heads in place.
pub fn eager_hidden_traffic(m: &Model) -> f64 {
    let h = m.hidden_size as f64;
    let qd = m.num_attention_heads as f64 * m.head_dim as f64;
    let kvd = m.num_kv_heads as f64 * m.head_dim as f64;
    let norm_eager = match m.norm {
        Norm::Rmsnorm => 36.0,
        Norm::Layernorm => 4.0,
    };
    let rope = if m.learned_positions {
        0.0
    } else {
        (qd + kvd) / h
    };
    let repeat_kv = if kvd < qd {
        2.0 * 2.0 * (kvd + qd) / h
    } else {
        0.0
    };
    let fused = 2.0 * 4.0 + 2.0 * 6.0 + 4.0 * rope;
    let eager = 2.0 * norm_eager + 2.0 * 6.0 + 20.0 * rope + repeat_kv;
    eager / fused
}

/// The same ratio for the MLP activation, per element of its output: gated (`silu(a) * b`)
/// eager 4 + 6 = 10 B against a fused 6 B (read both halves, write); squared ReLU eager
/// `relu` then `pow`, 4 + 4 B against 4 B; GeLU and ReLU are one kernel either way.
pub fn eager_act_traffic(m: &Model) -> f64 {
    match m.ffn_activation {
        Activation::Swiglu | Activation::Geglu => 10.0 / 6.0,
        Activation::SquaredRelu => 2.0,
        Activation::Gelu | Activation::Relu => 1.0,
    }
}
