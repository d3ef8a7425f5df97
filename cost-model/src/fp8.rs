//! What FP8 training adds around its GEMMs, besides the FP8 rate itself.
//!
//! - **Casts.** An FP8 GEMM reads FP8 operands, but the activations that feed it and the
//!   gradients that flow back are produced in BF16 by the kernels before it, so each is
//!   quantized first, through HBM. DeepSeek-V3 (arXiv 2412.19437 §3.5.2, "Suggestions on
//!   hardware design", online quantization): "we need to read 128 BF16 activation values (the output of the
//!   previous computation) from HBM for quantization, and the quantized FP8 values are
//!   then written back to HBM, only to be read again for MMA". The weight gradient needs
//!   the same tensors transposed (it contracts over the tokens), so Transformer Engine
//!   casts with `cast_transpose` (`transformer_engine/common/transpose/cast_transpose.cu`):
//!   one read of the BF16 tensor, two FP8 writes (row-wise and column-wise). Per pass:
//!   the forward (and a recompute) casts the GEMM's input `x` (`m x k`), the backward its
//!   output gradient `dy` (`m x n`), each `2 + 1 + 1 = 4` bytes per element. The weights'
//!   FP8 copies are made once per step and reused by every micro-batch (Megatron passes
//!   Transformer Engine `is_first_microbatch`), so they are not charged per micro-batch.
//!   The FP8 read by the GEMM itself is the GEMM's own traffic, inside its rate.
//!   A forward input that comes out of a normalization is not cast apart: Transformer
//!   Engine's `LayerNormLinear` / `LayerNormMLP` (Megatron's QKV and FC1) and Inductor's
//!   fusion under torch.compile have the norm write the FP8 copies in place of its BF16
//!   output (1 + 1 bytes for 2: no extra traffic), so the GEMMs fed by a norm (QKV, the
//!   MLP's and shared experts' FC1, the router) pay no forward cast ([`gemm_cast_bytes`]).
//!   The routed experts' FC1 reads the permuted (dispatched) tokens, BF16 again.
//! - **The LM head stays BF16.** FP8 recipes keep the embedding and the output head in
//!   BF16: DeepSeek-V3 §3.3.1 ("we maintain the original precision (e.g., BF16 or FP32)
//!   for the following components: the embedding module, the output head, MoE gating
//!   modules, normalization operators, and attention operators"); Megatron-Core builds the
//!   output layer as a plain `ColumnParallelLinear` outside Transformer Engine's FP8
//!   autocast; torchtitan's Float8 converter skips `output` (`filter_fqns`). The head GEMM
//!   is charged at the BF16 rate and without casts (`layer::Ctx::gemm`).

use shardwright_ir::vocab::GemmRole;

/// HBM bytes of the FP8 casts of one GEMM `(m x k) @ (k x n)` (all `groups` of it: `m` is
/// the total rows) in one pass: the forward (and recompute) quantizes the input, `4 m k`;
/// the backward the output gradient, `4 m n` (read BF16, write FP8 and its transpose).
pub fn cast_bytes(m: f64, n: f64, k: f64, backward: bool) -> f64 {
    const BYTES_PER_ELEMENT: f64 = 2.0 + 1.0 + 1.0;
    BYTES_PER_ELEMENT * m * if backward { n } else { k }
}

/// [`cast_bytes`] of the GEMM `role` in one pass, less the forward casts fused into the
/// normalization that feeds QKV, FC1 and the router, and none for the router, which
/// Megatron-Core computes outside FP8 (a plain linear; DeepSeek-V3 §3.3.1 keeps "MoE gating
/// modules" in higher precision), nor for the LM head (BF16, [`crate::fp8`]).
pub fn gemm_cast_bytes(role: GemmRole, m: f64, n: f64, k: f64, backward: bool) -> f64 {
    use GemmRole as R;
    match (role, backward) {
        (R::LmHead | R::Router, _) => 0.0,
        (R::Qkv | R::KProj | R::Fc1 | R::Fc1Up | R::SharedFc1, false) => 0.0,
        _ => cast_bytes(m, n, k, backward),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek-V3's §3.5.2 round trip, per element of a BF16 activation: one 2-byte read
    /// and one 1-byte FP8 write; Transformer Engine's transposed copy adds one more 1-byte
    /// write. A token entering a 7168-wide GEMM (DeepSeek-V3's hidden size) therefore moves
    /// 7168 x 2 + 7168 + 7168 = 28672 bytes in the forward; its 2048-wide output
    /// gradient (an expert's FFN width) 2048 x 4 = 8192 in the backward.
    #[test]
    fn one_token_moves_what_the_round_trip_says() {
        assert_eq!(cast_bytes(1.0, 2048.0, 7168.0, false), 28672.0);
        assert_eq!(cast_bytes(1.0, 2048.0, 7168.0, true), 8192.0);
        // 4096 tokens: 4096 x 28672 = 117,440,512 bytes (112 MiB), 35 us at 3.35 TB/s.
        let t = cast_bytes(4096.0, 2048.0, 7168.0, false) / 3.35e12;
        assert!((t - 35.06e-6).abs() < 0.01e-6, "{t}");
    }

    /// Per token of a Llama-3-70B layer at tp 1 (h 8192, FFN 28672, SwiGLU, GQA 8 x 128):
    /// the forward casts the attention output entering the output projection (8192 wide)
    /// and the SwiGLU output entering FC2 (28672), 4 bytes each: 147456 bytes; QKV and
    /// FC1 read the norm's own FP8 output. The backward casts each GEMM's output gradient:
    /// QKV 8192 + 2 x 1024 = 10240, proj 8192, FC1 2 x 28672 = 57344, FC2 8192, 4 bytes
    /// each: 335872 bytes.
    #[test]
    fn a_llama_layer_casts_what_its_producers_do_not_fuse() {
        use GemmRole as R;
        let (h, f, kv) = (8192.0, 28672.0, 1024.0);
        let gemms = [
            (R::Qkv, h + 2.0 * kv, h),
            (R::Proj, h, h),
            (R::Fc1, 2.0 * f, h),
            (R::Fc2, h, f),
        ];
        let pass = |bwd: bool| -> f64 {
            gemms
                .iter()
                .map(|&(r, n, k)| gemm_cast_bytes(r, 1.0, n, k, bwd))
                .sum()
        };
        assert_eq!(pass(false), 147456.0);
        assert_eq!(pass(true), 335872.0);
        assert_eq!(gemm_cast_bytes(R::LmHead, 1.0, 128256.0, h, true), 0.0);
    }
}
