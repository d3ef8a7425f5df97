//! The CUDA backend's precision (issue 23): which element type each kind of tensor is stored
//! in, and the rules by which a buffer's type follows from the operation that makes it.
//! Pure logic, always compiled (no CUDA), so the rules are unit-tested in the normal test
//! run and a CPU emulation of the bf16 mode (`tests/cuda_precision.rs`) follows the very
//! functions the CUDA backend ([`crate::cuda::backend`]) calls.
//!
//! Two modes:
//!
//! - [`Precision::Fp32`], the reference-comparison mode: every buffer fp32, fp32 kernels and
//!   GEMMs (plain fp32 arithmetic): a training step matches the CPU reference within fp32
//!   rounding of another summation order.
//! - [`Precision::Bf16`], mixed precision as Megatron-LM and torchtitan train: activations
//!   and the working copy of the weights in bf16, GEMMs on bf16 operands with fp32
//!   accumulation (`CUBLAS_COMPUTE_32F`), weight gradients accumulated in fp32 (Megatron's
//!   `main_grad`), fp32 master weights and AdamW moments, and the loss, the logits' softmax
//!   statistics, the norms' statistics and every reduction to a statistic in fp32. Every
//!   kernel computes in fp32 whatever it loads and stores.
//!
//! | role ([`Role`]) | [`Precision::Fp32`] | [`Precision::Bf16`] |
//! |---|---|---|
//! | activations and their gradients | fp32 | bf16 |
//! | statistics (norm `[mean,] rstd`, attention `lse`, cross-entropy `lse`/target/max, dot products) | fp32 | fp32 |
//! | master weights (what `upload` makes, what AdamW updates) | fp32 | fp32 |
//! | working copy of the weights (what kernels and GEMMs read) | none (the master) | bf16, made from the master on first read and refreshed by AdamW |
//! | weight gradients (accumulated `+=`) | fp32 | fp32 |
//! | AdamW moments | fp32 | fp32 |
//!
//! The host interface stays `f32` (the [`crate::backend::Backend`] trait): `upload` makes an
//! fp32 buffer, `download` widens bf16 exactly. The interpreter does not know the roles, so
//! the backend infers a buffer's type from the operation ([`Kind`] and the functions below):
//! a buffer made by `zeros` in bf16 mode is *untyped zeros* ([`Kind::Zero`], not allocated)
//! until its first write gives it that write's type; kernels read an operand in the type
//! they compute on (an fp32 activation, say a collective's result the host uploaded, is cast
//! to bf16 at that boundary; an fp32 weight is read through its bf16 working copy); and the
//! roles that must stay fp32 (statistics, accumulated gradients, master weights, moments)
//! refuse a bf16 buffer with a panic that names the operation ([`require_f32`]) rather than
//! read its bits as fp32.

use crate::cuda::launch::Dtype;

/// The environment variable [`Precision::from_env`] reads: `fp32` (the default) or `bf16`.
pub const PRECISION_ENV: &str = "SHARDWRIGHT_CUDA_PRECISION";

/// The CUDA backend's compute precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Every buffer fp32: the reference-comparison mode.
    #[default]
    Fp32,
    /// bf16 activations and working weights, fp32 master weights, gradients, moments and
    /// statistics.
    Bf16,
}

/// What a tensor is, for the table of element types ([`Precision::dtype`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Activations and activation gradients (the value table's tensors).
    Activation,
    /// Per-row statistics and reductions: norm statistics, log-sum-exps, maxima, targets'
    /// logits, dot products, the loss.
    Statistic,
    /// The weights the optimizer updates.
    MasterWeight,
    /// The copy of the weights kernels and GEMMs read.
    WorkingWeight,
    /// Weight gradients, accumulated over micro-batches.
    WeightGrad,
    /// AdamW's first and second moments.
    Moment,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Activation,
        Role::Statistic,
        Role::MasterWeight,
        Role::WorkingWeight,
        Role::WeightGrad,
        Role::Moment,
    ];
}

impl Precision {
    /// `fp32` (or `f32`) and `bf16`, case-insensitive.
    pub fn parse(s: &str) -> Result<Precision, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("precision `{other}`: expected `fp32` or `bf16`")),
        }
    }

    /// From [`PRECISION_ENV`]; unset or empty is [`Precision::Fp32`].
    pub fn from_env() -> Result<Precision, String> {
        match std::env::var(PRECISION_ENV) {
            Ok(s) if !s.trim().is_empty() => {
                Precision::parse(&s).map_err(|e| format!("{PRECISION_ENV}: {e}"))
            }
            _ => Ok(Precision::Fp32),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The element type of activations, which is also the type kernels and GEMMs load
    /// their activation and weight operands in.
    pub fn activations(self) -> Dtype {
        match self {
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16 => Dtype::Bf16,
        }
    }

    /// The element type a tensor of role `r` is stored in; `None` when this precision
    /// keeps no such tensor (fp32 mode reads the master weights themselves).
    pub fn dtype(self, r: Role) -> Option<Dtype> {
        match (self, r) {
            (_, Role::Activation) => Some(self.activations()),
            (Precision::Fp32, Role::WorkingWeight) => None,
            (Precision::Bf16, Role::WorkingWeight) => Some(Dtype::Bf16),
            (_, Role::Statistic | Role::MasterWeight | Role::WeightGrad | Role::Moment) => {
                Some(Dtype::F32)
            }
        }
    }

    /// Device bytes per parameter under ZeRO stage 0 (nothing sharded): master, working
    /// copy, gradient and AdamW's two moments: 16 in fp32 (4 + 4 + 8), 18 in bf16
    /// (4 + 2 + 4 + 8, Megatron's mixed precision with fp32 `main_grad`).
    pub fn state_bytes_per_param(self) -> u64 {
        [
            Role::MasterWeight,
            Role::WorkingWeight,
            Role::WeightGrad,
            Role::Moment,
            Role::Moment,
        ]
        .iter()
        .filter_map(|&r| self.dtype(r))
        .map(dtype_bytes)
        .sum()
    }

    /// What `zeros` makes: an fp32 buffer in fp32 mode (allocated and zeroed, as before
    /// this mode existed); untyped zeros in bf16 mode, typed by their first write.
    pub fn zeros(self) -> Kind {
        match self {
            Precision::Fp32 => Kind::F32,
            Precision::Bf16 => Kind::Zero,
        }
    }
}

/// Bytes of one element.
pub fn dtype_bytes(d: Dtype) -> u64 {
    match d {
        Dtype::F32 => 4,
        Dtype::Bf16 => 2,
    }
}

/// What a device buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Zeros with no element type yet (nothing allocated): `zeros` in bf16 mode. Reads see
    /// zeros in whatever type they need; the first write gives the buffer its type.
    Zero,
    F32,
    Bf16,
}

impl Kind {
    pub fn of(d: Dtype) -> Kind {
        match d {
            Dtype::F32 => Kind::F32,
            Dtype::Bf16 => Kind::Bf16,
        }
    }

    /// The element type, `None` for untyped zeros.
    pub fn dtype(self) -> Option<Dtype> {
        match self {
            Kind::Zero => None,
            Kind::F32 => Some(Dtype::F32),
            Kind::Bf16 => Some(Dtype::Bf16),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Zero => "untyped zeros",
            Kind::F32 => "fp32",
            Kind::Bf16 => "bf16",
        }
    }
}

/// The type of an element-wise combination of activations (`add`, `concat`): untyped zeros
/// take the other's type; two fp32 buffers stay fp32 (host-made data kept exact); anything
/// with a bf16 operand is bf16 (the fp32 one is cast at this boundary).
pub fn joined(a: Kind, b: Kind) -> Kind {
    match (a, b) {
        (Kind::Zero, x) | (x, Kind::Zero) => x,
        (Kind::F32, Kind::F32) => Kind::F32,
        _ => Kind::Bf16,
    }
}

/// The type a destination has after data moves into it (`copy_ranges`, `scale_ranges`,
/// `axpy_ranges`, `add_into`): its own, the source converted to it; untyped zeros take the
/// source's type.
pub fn into_dst(dst: Kind, src: Kind) -> Kind {
    match dst {
        Kind::Zero => src,
        d => d,
    }
}

/// The type of a GEMM's result `c = beta c + op(a) op(b)`: with `beta == 0` a fresh
/// activation (the activation type, whatever `c` held); otherwise `c` is accumulated onto
/// in its own type, untyped zeros becoming fp32 (weight gradients: fp32 `main_grad`).
pub fn gemm_out(p: Precision, beta: f32, c: Kind) -> Kind {
    if beta == 0.0 {
        return Kind::of(p.activations());
    }
    match c {
        Kind::Zero => Kind::F32,
        k => k,
    }
}

/// The type `write` (host values into a buffer: the MoE dispatch buffers' row-count
/// headers) leaves: fp32 (untyped zeros become fp32). Host values would be rounded in a bf16
/// buffer (a row count above 256 would change), so that is an error.
pub fn write_dst(dst: Kind) -> Result<Kind, String> {
    match dst {
        Kind::Zero | Kind::F32 => Ok(Kind::F32),
        Kind::Bf16 => Err("host values written into a bf16 buffer would be rounded".into()),
    }
}

/// A buffer whose role must be fp32 (`what`: a statistic, an accumulated gradient, a master
/// weight, a moment): fp32, or untyped zeros (read as fp32 zeros). Panics otherwise, naming
/// the operation, rather than read bf16 bits as fp32.
pub fn require_f32(k: Kind, what: &str) {
    if k == Kind::Bf16 {
        panic!("CUDA backend: {what} must be fp32, got a bf16 buffer");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_by_hand() {
        use Dtype::{Bf16, F32};
        let want = [
            (Role::Activation, Some(F32), Some(Bf16)),
            (Role::Statistic, Some(F32), Some(F32)),
            (Role::MasterWeight, Some(F32), Some(F32)),
            (Role::WorkingWeight, None, Some(Bf16)),
            (Role::WeightGrad, Some(F32), Some(F32)),
            (Role::Moment, Some(F32), Some(F32)),
        ];
        for (r, fp32, bf16) in want {
            assert_eq!(Precision::Fp32.dtype(r), fp32, "{r:?} in fp32 mode");
            assert_eq!(Precision::Bf16.dtype(r), bf16, "{r:?} in bf16 mode");
        }
        assert_eq!(want.len(), Role::ALL.len());
        // 4 (master) + 4 (grad) + 2 x 4 (moments); bf16 adds the 2-byte working copy.
        assert_eq!(Precision::Fp32.state_bytes_per_param(), 16);
        assert_eq!(Precision::Bf16.state_bytes_per_param(), 18);
    }

    #[test]
    fn parsing() {
        assert_eq!(Precision::parse("bf16"), Ok(Precision::Bf16));
        assert_eq!(Precision::parse(" BF16 "), Ok(Precision::Bf16));
        assert_eq!(Precision::parse("fp32"), Ok(Precision::Fp32));
        assert_eq!(Precision::parse("f32"), Ok(Precision::Fp32));
        assert!(Precision::parse("fp16").unwrap_err().contains("fp16"));
        assert_eq!(Precision::default(), Precision::Fp32);
        for p in [Precision::Fp32, Precision::Bf16] {
            assert_eq!(Precision::parse(p.name()), Ok(p));
        }
    }

    #[test]
    fn buffer_kinds() {
        use Kind::{Bf16, Zero, F32};
        assert_eq!(Precision::Fp32.zeros(), F32);
        assert_eq!(Precision::Bf16.zeros(), Zero);
        // joined: commutative, Zero is the identity, bf16 absorbs.
        let all = [Zero, F32, Bf16];
        for a in all {
            assert_eq!(joined(Zero, a), a);
            for b in all {
                assert_eq!(joined(a, b), joined(b, a));
            }
        }
        assert_eq!(joined(F32, F32), F32);
        assert_eq!(joined(F32, Bf16), Bf16);
        assert_eq!(joined(Bf16, Bf16), Bf16);
        // Data moved into a buffer takes the buffer's type; zeros take the source's.
        for s in all {
            assert_eq!(into_dst(F32, s), F32);
            assert_eq!(into_dst(Bf16, s), Bf16);
            assert_eq!(into_dst(Zero, s), s);
        }
        // GEMMs: fresh results in the activation type, accumulations in their own,
        // gradients (zeros accumulated onto) in fp32.
        for c in all {
            assert_eq!(gemm_out(Precision::Bf16, 0.0, c), Bf16);
            assert_eq!(gemm_out(Precision::Fp32, 0.0, c), F32);
        }
        assert_eq!(gemm_out(Precision::Bf16, 1.0, Zero), F32);
        assert_eq!(gemm_out(Precision::Bf16, 1.0, F32), F32);
        assert_eq!(gemm_out(Precision::Bf16, 1.0, Bf16), Bf16);
        assert_eq!(write_dst(Zero), Ok(F32));
        assert_eq!(write_dst(F32), Ok(F32));
        assert!(write_dst(Bf16).is_err());
        require_f32(F32, "x");
        require_f32(Zero, "x");
        assert_eq!(Kind::of(Dtype::Bf16), Bf16);
        assert_eq!(Bf16.dtype(), Some(Dtype::Bf16));
        assert_eq!(Zero.dtype(), None);
    }

    #[test]
    #[should_panic(expected = "the layernorm statistics must be fp32, got a bf16 buffer")]
    fn a_bf16_statistic_panics() {
        require_f32(Kind::Bf16, "the layernorm statistics");
    }
}
