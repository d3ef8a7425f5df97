//! The kernel registry: every CUDA source file in `executor/kernels/`, embedded with
//! `include_str!`, and the entry points it defines.
//!
//! Each file starts with `#include "common.cuh"`; [`KernelFile::source`] puts the text of
//! `common.cuh` in place of that line, so NVRTC compiles a file with nothing but the CUDA
//! headers (`cuda_bf16.h`) on its include path. Kernels whose math has an element type
//! exist twice, `<name>_f32` (the storage of the CPU reference, for comparing against it)
//! and `<name>_bf16` (activations in bf16, arithmetic and statistics in fp32).

/// `executor/kernels/common.cuh`: types, conversions, warp and block reductions.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// The line of a kernel file that [`KernelFile::source`] replaces with [`COMMON`].
pub const COMMON_INCLUDE: &str = "#include \"common.cuh\"";

/// One `.cu` file of `executor/kernels/`.
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    /// File name, e.g. `attention.cu`.
    pub file: &'static str,
    /// The file's text as written (with the `common.cuh` include).
    pub text: &'static str,
    /// Its `extern "C" __global__` functions.
    pub entries: &'static [&'static str],
    /// Hot kernels (attention, norms, cross-entropy): a register spill in any of its
    /// entries fails the compile check (`tests/nvrtc_compile.rs`).
    pub hot: bool,
}

impl KernelFile {
    /// The text NVRTC compiles: [`COMMON`] inlined at its include line.
    pub fn source(&self) -> String {
        self.text.replacen(COMMON_INCLUDE, COMMON, 1)
    }
}

/// NVRTC options for compute capability `sm` (80, 90, ...): virtual architecture
/// `compute_<sm>`, C++17, precise division and square root, no flush-to-zero (the
/// reference's f32 semantics). The caller adds `-I<dir>` for the CUDA headers.
pub fn nvrtc_options(sm: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{sm}"),
        "--std=c++17".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
    ]
}

/// The `.cu` file defining `entry`, if any.
pub fn file_of(entry: &str) -> Option<&'static KernelFile> {
    FILES.iter().find(|f| f.entries.contains(&entry))
}

/// Every kernel file.
pub const FILES: &[KernelFile] = &[
    KernelFile {
        file: "embedding.cu",
        text: include_str!("../../kernels/embedding.cu"),
        entries: &[
            "embedding_fwd_f32",
            "embedding_bwd_f32",
            "embedding_fwd_bf16",
            "embedding_bwd_bf16",
        ],
        hot: false,
    },
    KernelFile {
        file: "norms.cu",
        text: include_str!("../../kernels/norms.cu"),
        entries: &[
            "rmsnorm_fwd_f32",
            "rmsnorm_bwd_f32",
            "layernorm_fwd_f32",
            "layernorm_bwd_f32",
            "rmsnorm_fwd_bf16",
            "rmsnorm_bwd_bf16",
            "layernorm_fwd_bf16",
            "layernorm_bwd_bf16",
            "reduce_rows_f32",
        ],
        hot: true,
    },
    KernelFile {
        file: "rope.cu",
        text: include_str!("../../kernels/rope.cu"),
        entries: &[
            "rope_fwd_f32",
            "rope_bwd_f32",
            "rope_fwd_bf16",
            "rope_bwd_bf16",
        ],
        hot: false,
    },
    KernelFile {
        file: "activations.cu",
        text: include_str!("../../kernels/activations.cu"),
        entries: &[
            "swiglu_fwd_f32",
            "swiglu_bwd_f32",
            "gelu_fwd_f32",
            "gelu_bwd_f32",
            "swiglu_fwd_bf16",
            "swiglu_bwd_bf16",
            "gelu_fwd_bf16",
            "gelu_bwd_bf16",
        ],
        hot: false,
    },
    KernelFile {
        file: "attention.cu",
        text: include_str!("../../kernels/attention.cu"),
        entries: &[
            "attn_fwd_f32_d64",
            "attn_bwd_dkdv_f32_d64",
            "attn_bwd_dq_f32_d64",
            "attn_fwd_f32_d128",
            "attn_bwd_dkdv_f32_d128",
            "attn_bwd_dq_f32_d128",
            "attn_bwd_delta_f32",
            "attn_fwd_bf16_d64",
            "attn_bwd_dkdv_bf16_d64",
            "attn_bwd_dq_bf16_d64",
            "attn_fwd_bf16_d128",
            "attn_bwd_dkdv_bf16_d128",
            "attn_bwd_dq_bf16_d128",
            "attn_bwd_delta_bf16",
        ],
        hot: true,
    },
    KernelFile {
        file: "attention_mma.cu",
        text: include_str!("../../kernels/attention_mma.cu"),
        entries: &[
            "attn_mma_fwd_bf16_d64",
            "attn_mma_bwd_dkdv_bf16_d64",
            "attn_mma_bwd_dq_bf16_d64",
            "attn_mma_fwd_bf16_d128",
            "attn_mma_bwd_dkdv_bf16_d128",
            "attn_mma_bwd_dq_bf16_d128",
        ],
        hot: true,
    },
    KernelFile {
        file: "xent.cu",
        text: include_str!("../../kernels/xent.cu"),
        entries: &[
            "xent_fwd_local_f32",
            "xent_bwd_f32",
            "xent_fwd_local_bf16",
            "xent_bwd_bf16",
            "xent_rescale",
            "xent_finish",
        ],
        hot: true,
    },
    KernelFile {
        file: "adamw.cu",
        text: include_str!("../../kernels/adamw.cu"),
        entries: &["adamw_f32", "adamw_bf16"],
        hot: false,
    },
    KernelFile {
        file: "moe.cu",
        text: include_str!("../../kernels/moe.cu"),
        entries: &[
            "moe_route_topk",
            "moe_route_bwd",
            "moe_count",
            "moe_index",
            "moe_permute_f32",
            "moe_unpermute_f32",
            "moe_unpermute_bwd_f32",
            "moe_permute_bf16",
            "moe_unpermute_bf16",
            "moe_unpermute_bwd_bf16",
        ],
        hot: false,
    },
    KernelFile {
        file: "cast.cu",
        text: include_str!("../../kernels/cast.cu"),
        entries: &["cast_f32_to_bf16", "cast_bf16_to_f32"],
        hot: false,
    },
    KernelFile {
        file: "buffers.cu",
        text: include_str!("../../kernels/buffers.cu"),
        entries: &[
            "axpy_f32",
            "scale_f32",
            "add_f32",
            "dots_f32",
            "row_max_f32",
            "sum_squares_f32",
            "checksum_f32",
            "moves_f32",
            "moves_strided_f32",
            "axpy_bf16",
            "scale_bf16",
            "add_bf16",
            "dots_bf16",
            "row_max_bf16",
            "sum_squares_bf16",
            "checksum_bf16",
            "moves_bf16",
            "moves_strided_bf16",
        ],
        hot: false,
    },
];
