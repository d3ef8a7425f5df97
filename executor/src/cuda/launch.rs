//! Launch configurations: grid, block and dynamic shared memory of every kernel for given
//! shapes, as the kernels' comments in `executor/kernels/*.cu` describe them, checked
//! against a device's limits ([`Limits::SM90`], [`Limits::SM80`]). Pure arithmetic: no
//! CUDA needed, so the bundled specs' shapes are checked in the normal test run
//! (`tests/cuda_launch.rs`).

// `x % n != 0` rather than `is_multiple_of` (Rust 1.87): the workspace supports Rust 1.80.
#![allow(clippy::manual_is_multiple_of)]

use std::fmt;

/// Per-block and per-grid limits of a compute capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub name: &'static str,
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    /// Dynamic shared memory per block without the opt-in attribute.
    pub smem_default: u32,
    /// With `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` set.
    pub smem_optin: u32,
}

impl Limits {
    /// H100 / H200 (sm_90): 227 KiB of shared memory per block with the opt-in.
    pub const SM90: Limits = Limits {
        name: "sm_90",
        max_threads_per_block: 1024,
        max_block: [1024, 1024, 64],
        max_grid: [i32::MAX as u32, 65535, 65535],
        smem_default: 48 * 1024,
        smem_optin: 227 * 1024,
    };
    /// A100 (sm_80): 163 KiB with the opt-in.
    pub const SM80: Limits = Limits {
        name: "sm_80",
        max_threads_per_block: 1024,
        max_block: [1024, 1024, 64],
        max_grid: [i32::MAX as u32, 65535, 65535],
        smem_default: 48 * 1024,
        smem_optin: 163 * 1024,
    };
}

/// Storage type of a kernel's tensors (arithmetic is fp32 either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// One kernel launch: the entry point and its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub entry: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub smem: u32,
}

/// Why a shape cannot be launched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchError(pub String);

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LaunchError {}

fn err<T>(msg: String) -> Result<T, LaunchError> {
    Err(LaunchError(msg))
}

impl Launch {
    fn new(entry: String, grid: [u64; 3], block: u32, smem: u32) -> Result<Launch, LaunchError> {
        let mut g = [0u32; 3];
        for (i, &x) in grid.iter().enumerate() {
            g[i] = u32::try_from(x).map_err(|_| {
                LaunchError(format!("{entry}: grid dimension {i} = {x} overflows u32"))
            })?;
        }
        Ok(Launch {
            entry,
            grid: g,
            block: [block, 1, 1],
            smem,
        })
    }

    pub fn threads_per_block(&self) -> u64 {
        self.block.iter().map(|&b| b as u64).product()
    }

    /// Whether the dynamic shared memory needs the opt-in attribute on `l`.
    pub fn needs_smem_optin(&self, l: &Limits) -> bool {
        self.smem > l.smem_default
    }

    /// Checks the configuration against `l`; the message names the entry and the limit.
    pub fn check(&self, l: &Limits) -> Result<(), LaunchError> {
        let e = &self.entry;
        if crate::cuda::kernels::file_of(e).is_none() {
            return err(format!("{e}: no such kernel in executor/kernels"));
        }
        if self.grid.contains(&0) || self.block.contains(&0) {
            return err(format!(
                "{e}: empty launch (grid {:?}, block {:?})",
                self.grid, self.block
            ));
        }
        if self.threads_per_block() > l.max_threads_per_block as u64 {
            return err(format!(
                "{e}: {} threads per block > {} on {}",
                self.threads_per_block(),
                l.max_threads_per_block,
                l.name
            ));
        }
        for i in 0..3 {
            if self.block[i] > l.max_block[i] {
                return err(format!(
                    "{e}: block dimension {i} = {} > {} on {}",
                    self.block[i], l.max_block[i], l.name
                ));
            }
            if self.grid[i] > l.max_grid[i] {
                return err(format!(
                    "{e}: grid dimension {i} = {} > {} on {}",
                    self.grid[i], l.max_grid[i], l.name
                ));
            }
        }
        if self.block[0] % 32 != 0 {
            return err(format!(
                "{e}: block of {} threads is not whole warps",
                self.block[0]
            ));
        }
        if self.smem > l.smem_optin {
            return err(format!(
                "{e}: {} bytes of dynamic shared memory > {} (opt-in) on {}",
                self.smem, l.smem_optin, l.name
            ));
        }
        Ok(())
    }
}

/// Grid of a grid-stride element-wise kernel over `n` elements (the result does not depend
/// on it; capped so huge tensors loop).
const ELEMENTWISE_BLOCK: u32 = 256;
const ELEMENTWISE_MAX_GRID: u64 = 1 << 16;

fn elementwise(entry: String, n: u64) -> Result<Launch, LaunchError> {
    let grid = n
        .div_ceil(ELEMENTWISE_BLOCK as u64)
        .clamp(1, ELEMENTWISE_MAX_GRID);
    if n == 0 {
        return err(format!("{entry}: no elements"));
    }
    Launch::new(entry, [grid, 1, 1], ELEMENTWISE_BLOCK, 0)
}

/// Threads for a kernel with one block per row of `width` values: about 8 values per
/// thread, whole warps, 32..=1024.
pub fn row_block(width: u64) -> u32 {
    (width.div_ceil(8).div_ceil(32) * 32).clamp(32, 1024) as u32
}

fn per_row(entry: String, rows: u64, width: u64) -> Result<Launch, LaunchError> {
    if rows == 0 || width == 0 {
        return err(format!("{entry}: empty rows ({rows} x {width})"));
    }
    if width > u32::MAX as u64 {
        return err(format!("{entry}: row width {width} overflows u32"));
    }
    Launch::new(entry, [rows, 1, 1], row_block(width), 0)
}

/// Embedding forward over `tokens` ids, width `h`.
pub fn embedding_fwd(dt: Dtype, tokens: u64, h: u64) -> Result<Launch, LaunchError> {
    per_row(format!("embedding_fwd_{}", dt.suffix()), tokens, h)
}

/// Embedding backward over `segments` distinct local rows (at most the tokens).
pub fn embedding_bwd(dt: Dtype, segments: u64, h: u64) -> Result<Launch, LaunchError> {
    per_row(format!("embedding_bwd_{}", dt.suffix()), segments, h)
}

/// RMSNorm or LayerNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    Rms,
    Layer,
}

impl Norm {
    fn name(self) -> &'static str {
        match self {
            Norm::Rms => "rmsnorm",
            Norm::Layer => "layernorm",
        }
    }
}

/// Norm forward over `t` rows of width `h`.
pub fn norm_fwd(n: Norm, dt: Dtype, t: u64, h: u64) -> Result<Launch, LaunchError> {
    per_row(format!("{}_fwd_{}", n.name(), dt.suffix()), t, h)
}

/// Row blocks of a norm backward: rows of the fp32 partial weight-gradient buffer
/// (`[rows, h]`, one per block, each summing the rows `b, b + G, ...`). A function of the
/// shape alone, so the summation order does not depend on the device.
pub fn norm_bwd_blocks(t: u64) -> u64 {
    t.clamp(1, 256)
}

/// A norm backward: the row kernel and `reduce_rows_f32` over its partial buffer.
pub fn norm_bwd(n: Norm, dt: Dtype, t: u64, h: u64) -> Result<[Launch; 2], LaunchError> {
    let g = norm_bwd_blocks(t);
    let main = per_row(format!("{}_bwd_{}", n.name(), dt.suffix()), g, h)?;
    let reduce = Launch::new("reduce_rows_f32".into(), [h.div_ceil(256), 1, 1], 256, 0)?;
    if t == 0 {
        return err(format!("{}_bwd: no rows", n.name()));
    }
    Ok([main, reduce])
}

/// Rotary embedding (forward or backward) on `t` tokens of `heads` heads of `d` values.
pub fn rope(dt: Dtype, backward: bool, t: u64, heads: u64, d: u64) -> Result<Launch, LaunchError> {
    let entry = format!(
        "rope_{}_{}",
        if backward { "bwd" } else { "fwd" },
        dt.suffix()
    );
    if d % 2 != 0 {
        return err(format!("{entry}: head_dim {d} is odd (rotary needs pairs)"));
    }
    elementwise(entry, t * heads * (d / 2))
}

/// SwiGLU forward or backward on `t` rows of `f` outputs.
pub fn swiglu(dt: Dtype, backward: bool, t: u64, f: u64) -> Result<Launch, LaunchError> {
    if f > u32::MAX as u64 {
        return err(format!("swiglu: width {f} overflows u32"));
    }
    elementwise(
        format!(
            "swiglu_{}_{}",
            if backward { "bwd" } else { "fwd" },
            dt.suffix()
        ),
        t * f,
    )
}

/// GeLU forward or backward on `n` values.
pub fn gelu(dt: Dtype, backward: bool, n: u64) -> Result<Launch, LaunchError> {
    elementwise(
        format!(
            "gelu_{}_{}",
            if backward { "bwd" } else { "fwd" },
            dt.suffix()
        ),
        n,
    )
}

/// One attention call (the reference's `AttnShape` plus a key offset and a window).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attn {
    pub batch: u64,
    pub seq_q: u64,
    pub seq_kv: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Sliding window (0: none).
    pub window: u64,
}

impl From<&crate::backend::AttnShape> for Attn {
    /// The launch shape of a backend call (no sliding window).
    fn from(s: &crate::backend::AttnShape) -> Attn {
        Attn {
            batch: s.batch as u64,
            seq_q: s.seq_q as u64,
            seq_kv: s.seq_kv as u64,
            heads: s.heads as u64,
            kv_heads: s.kv_heads as u64,
            head_dim: s.head_dim as u64,
            window: 0,
        }
    }
}

/// Threads per attention block (`ATT_THREADS` in attention.cu) and tile rows (`ATT_TILE`).
pub const ATT_THREADS: u32 = 128;
pub const ATT_TILE: u64 = 32;

/// The padded head dimension an attention kernel is instantiated for.
pub fn attn_head_dim_variant(d: u64) -> Option<u64> {
    [64, 128].into_iter().find(|&v| d <= v)
}

/// The four launches of attention: forward, and the backward's delta, dK/dV and dQ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttnLaunches {
    pub fwd: Launch,
    pub bwd_delta: Launch,
    pub bwd_dkdv: Launch,
    pub bwd_dq: Launch,
}

pub fn attention(dt: Dtype, a: &Attn) -> Result<AttnLaunches, LaunchError> {
    let s = dt.suffix();
    if a.head_dim == 0
        || a.heads == 0
        || a.kv_heads == 0
        || a.batch == 0
        || a.seq_q == 0
        || a.seq_kv == 0
    {
        return err(format!("attention: empty shape {a:?}"));
    }
    if a.heads % a.kv_heads != 0 {
        return err(format!(
            "attention: {} heads not a multiple of {} kv heads",
            a.heads, a.kv_heads
        ));
    }
    let Some(dv) = attn_head_dim_variant(a.head_dim) else {
        return err(format!(
            "attention: head_dim {} > 128 has no kernel",
            a.head_dim
        ));
    };
    for (what, x) in [
        ("seq_q", a.seq_q),
        ("seq_kv", a.seq_kv),
        ("heads", a.heads),
        ("kv_heads", a.kv_heads),
    ] {
        if x > u32::MAX as u64 {
            return err(format!("attention: {what} {x} overflows u32"));
        }
    }
    let per_block = ATT_THREADS as u64 / (dv / 32);
    // Two tiles of ATT_TILE rows x dv fp32 (K and V, or Q and dO); the forward adds each
    // query's scores of a tile (padded rows of ATT_TILE + 1), dK/dV the tile's lse and delta.
    let tiles = 2 * ATT_TILE * dv * 4;
    let smem_fwd = (tiles + per_block * (ATT_TILE + 1) * 4) as u32;
    let smem = tiles as u32;
    let smem_dkdv = smem + (2 * ATT_TILE * 4) as u32;
    let rows = a.batch * a.seq_q * a.heads;
    let warps = 1024 / 32;
    Ok(AttnLaunches {
        fwd: Launch::new(
            format!("attn_fwd_{s}_d{dv}"),
            [a.seq_q.div_ceil(per_block), a.heads, a.batch],
            ATT_THREADS,
            smem_fwd,
        )?,
        bwd_delta: Launch::new(
            format!("attn_bwd_delta_{s}"),
            [rows.div_ceil(warps), 1, 1],
            1024,
            0,
        )?,
        bwd_dkdv: Launch::new(
            format!("attn_bwd_dkdv_{s}_d{dv}"),
            [a.seq_kv.div_ceil(per_block), a.kv_heads, a.batch],
            ATT_THREADS,
            smem_dkdv,
        )?,
        bwd_dq: Launch::new(
            format!("attn_bwd_dq_{s}_d{dv}"),
            [a.seq_q.div_ceil(per_block), a.heads, a.batch],
            ATT_THREADS,
            smem,
        )?,
    })
}

/// Which attention kernels the CUDA backend runs (`SHARDWRIGHT_CUDA_ATTENTION`): the
/// tensor-core kernels of attention_mma.cu where they apply (see [`attn_uses_mma`]; the
/// default on sm_80 and newer), or the scalar fp32-arithmetic kernels of attention.cu (the
/// default before sm_80, and every call the tensor-core kernels do not cover).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnImpl {
    Scalar,
    Mma,
}

/// The environment variable naming the [`AttnImpl`].
pub const ATTENTION_ENV: &str = "SHARDWRIGHT_CUDA_ATTENTION";

impl AttnImpl {
    /// `scalar` or `mma`, case-insensitive.
    pub fn parse(s: &str) -> Result<AttnImpl, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Ok(AttnImpl::Scalar),
            "mma" => Ok(AttnImpl::Mma),
            other => Err(format!(
                "attention kernels `{other}`: expected `scalar` or `mma`"
            )),
        }
    }

    /// From [`ATTENTION_ENV`]; `None` where it is unset or empty (then the device picks:
    /// [`AttnImpl::default_for`]).
    pub fn from_env() -> Result<Option<AttnImpl>, String> {
        match std::env::var(ATTENTION_ENV) {
            Ok(s) if !s.trim().is_empty() => AttnImpl::parse(&s)
                .map(Some)
                .map_err(|e| format!("{ATTENTION_ENV}: {e}")),
            _ => Ok(None),
        }
    }

    /// The kernels a GPU of compute capability `sm` (major * 10 + minor) runs when
    /// [`ATTENTION_ENV`] is unset: the tensor-core kernels from sm_80 (their `mma.sync`
    /// bf16 shapes and `ldmatrix` need Ampere), the scalar ones before.
    pub fn default_for(sm: u32) -> AttnImpl {
        if sm >= 80 {
            AttnImpl::Mma
        } else {
            AttnImpl::Scalar
        }
    }
}

/// Whether an attention call runs the tensor-core kernels: the switch says `mma`, storage
/// is bf16, and the head dimension is exactly 64 or 128 (no padding: the kernels load rows
/// as 16-byte vectors). Every other call runs the scalar kernels.
pub fn attn_uses_mma(switch: AttnImpl, dt: Dtype, head_dim: u64) -> bool {
    switch == AttnImpl::Mma && dt == Dtype::Bf16 && matches!(head_dim, 64 | 128)
}

/// The launches of an attention call under `switch`: [`attention_mma`] where
/// [`attn_uses_mma`], else [`attention`].
pub fn attention_for(switch: AttnImpl, dt: Dtype, a: &Attn) -> Result<AttnLaunches, LaunchError> {
    if attn_uses_mma(switch, dt, a.head_dim) {
        attention_mma(a)
    } else {
        attention(dt, a)
    }
}

/// Threads per tensor-core attention block (`MMA_THREADS` in attention_mma.cu: 4 warps),
/// rows per block (`MMA_ROWS`: 16 per warp; queries in the forward and dQ, keys in dK/dV),
/// and the padding of a shared-memory row (`MMA_PAD`, bf16 elements).
pub const MMA_THREADS: u32 = 128;
pub const MMA_ROWS: u64 = 64;
pub const MMA_PAD: u64 = 8;

/// attention_mma.cu's `MmaTiles<d>`: rows of the other side's tiles, `(keys per forward
/// tile, keys per dQ tile, queries per dK/dV tile)`.
pub fn attn_mma_tiles(d: u64) -> Option<(u64, u64, u64)> {
    match d {
        64 => Some((64, 64, 64)),
        128 => Some((64, 32, 32)),
        _ => None,
    }
}

/// The tensor-core attention launches (bf16, head_dim 64 or 128); the backward's delta is
/// attention.cu's. Dynamic shared memory, bf16 rows of `d + MMA_PAD`, the streamed tiles
/// double-buffered: forward Q (64 rows) and two K and V tiles; dQ Q and dO (64 rows each)
/// and two K and V tiles; dK/dV K and V (64 rows each) and two Q and dO tiles with their
/// lse and delta (fp32).
pub fn attention_mma(a: &Attn) -> Result<AttnLaunches, LaunchError> {
    // The shape checks and the delta launch are the scalar path's.
    let scalar = attention(Dtype::Bf16, a)?;
    let d = a.head_dim;
    let Some((fwd_keys, dq_keys, dkdv_queries)) = attn_mma_tiles(d) else {
        return err(format!(
            "attention (tensor cores): head_dim {d} has no kernel (64 or 128)"
        ));
    };
    let row = (d + MMA_PAD) * 2;
    let smem_fwd = (MMA_ROWS + 2 * 2 * fwd_keys) * row;
    let smem_dq = (2 * MMA_ROWS + 2 * 2 * dq_keys) * row;
    let smem_dkdv = (2 * MMA_ROWS + 2 * 2 * dkdv_queries) * row + 2 * 2 * dkdv_queries * 4;
    let q_blocks = a.seq_q.div_ceil(MMA_ROWS);
    Ok(AttnLaunches {
        fwd: Launch::new(
            format!("attn_mma_fwd_bf16_d{d}"),
            [q_blocks, a.heads, a.batch],
            MMA_THREADS,
            smem_fwd as u32,
        )?,
        bwd_delta: scalar.bwd_delta,
        bwd_dkdv: Launch::new(
            format!("attn_mma_bwd_dkdv_bf16_d{d}"),
            [a.seq_kv.div_ceil(MMA_ROWS), a.kv_heads, a.batch],
            MMA_THREADS,
            smem_dkdv as u32,
        )?,
        bwd_dq: Launch::new(
            format!("attn_mma_bwd_dq_bf16_d{d}"),
            [q_blocks, a.heads, a.batch],
            MMA_THREADS,
            smem_dq as u32,
        )?,
    })
}

/// The cross-entropy launches on `t` tokens of a `v`-entry vocabulary shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XentLaunches {
    pub fwd_local: Launch,
    pub rescale: Launch,
    pub finish: Launch,
    pub bwd: Launch,
}

pub fn xent(dt: Dtype, t: u64, v: u64) -> Result<XentLaunches, LaunchError> {
    let s = dt.suffix();
    Ok(XentLaunches {
        fwd_local: per_row(format!("xent_fwd_local_{s}"), t, v)?,
        rescale: elementwise("xent_rescale".into(), t)?,
        finish: elementwise("xent_finish".into(), t)?,
        bwd: per_row(format!("xent_bwd_{s}"), t, v)?,
    })
}

/// AdamW over `n` fp32 master weights with gradients of type `grad`.
pub fn adamw(grad: Dtype, n: u64) -> Result<Launch, LaunchError> {
    elementwise(format!("adamw_{}", grad.suffix()), n)
}

/// A cast of `n` values.
pub fn cast(to_bf16: bool, n: u64) -> Result<Launch, LaunchError> {
    elementwise(
        if to_bf16 {
            "cast_f32_to_bf16"
        } else {
            "cast_bf16_to_f32"
        }
        .into(),
        n,
    )
}

/// The buffer primitives' element-wise kernels (`buffers.cu`: `axpy_*`, `scale_*`, `add_*`
/// with `*` = `f32` or `bf16`) over `n` elements.
pub fn buffer_op(entry: &str, n: u64) -> Result<Launch, LaunchError> {
    elementwise(entry.into(), n)
}

/// `moves_*` over `count` ranges of `n` elements (`*` = `f32` or `bf16`).
pub fn buffer_moves(dt: Dtype, count: u64, n: u64) -> Result<Launch, LaunchError> {
    elementwise(format!("moves_{}", dt.suffix()), count * n)
}

/// `moves` as an arithmetic progression with one factor, `(s0, s_step, d0, d_step, a)`:
/// move `r` is `(s0 + r s_step, d0 + r d_step, a)` (steps of zero or more; two moves or
/// more). The per-row views of a 2-D tensor (the QKV split's columns, token by token) are;
/// `moves_strided_*` runs them without uploading the offsets.
pub fn progression(moves: &[(usize, usize, f32)]) -> Option<(u64, u64, u64, u64, f32)> {
    let (&(s0, d0, a), &(s1, d1, _)) = (moves.first()?, moves.get(1)?);
    let (ss, ds) = (s1.checked_sub(s0)?, d1.checked_sub(d0)?);
    let fits = moves.iter().enumerate().all(|(r, m)| {
        r.checked_mul(ss).and_then(|o| o.checked_add(s0)) == Some(m.0)
            && r.checked_mul(ds).and_then(|o| o.checked_add(d0)) == Some(m.1)
            && m.2.to_bits() == a.to_bits()
    });
    fits.then_some((s0 as u64, ss as u64, d0 as u64, ds as u64, a))
}

/// Most blocks along one strided range (`moves_strided_*`'s x), and most along the ranges (y;
/// the device limit is 65,535: the kernel walks the rest).
const STRIDED_MAX_X: u64 = 64;
const STRIDED_MAX_Y: u64 = 65_535;

/// `moves_strided_*` over `count` ranges of `n` elements in arithmetic progression.
pub fn buffer_moves_strided(dt: Dtype, count: u64, n: u64) -> Result<Launch, LaunchError> {
    let entry = format!("moves_strided_{}", dt.suffix());
    if count == 0 || n == 0 {
        return err(format!("{entry}: no elements ({count} ranges of {n})"));
    }
    // Whole warps, no more than a short range needs.
    let block = (n.div_ceil(32) * 32).min(ELEMENTWISE_BLOCK as u64);
    let x = n.div_ceil(block).clamp(1, STRIDED_MAX_X);
    Launch::new(entry, [x, count.min(STRIDED_MAX_Y), 1], block as u32, 0)
}

/// Blocks of a whole-buffer reduction (`sum_squares_*`: one f64 partial per block, added
/// on the host in order; `checksum_*`): the grid depends on `n` alone, so the order of
/// the sums does too.
pub const REDUCE_BLOCK: u32 = 256;
pub const REDUCE_MAX_GRID: u64 = 1024;

/// `sum_squares_*` or `checksum_*` over `n` elements (`*` = `f32` or `bf16`).
pub fn buffer_reduce(entry: &str, n: u64) -> Result<Launch, LaunchError> {
    if n == 0 {
        return err(format!("{entry}: no elements"));
    }
    let grid = n.div_ceil(REDUCE_BLOCK as u64).clamp(1, REDUCE_MAX_GRID);
    Launch::new(entry.into(), [grid, 1, 1], REDUCE_BLOCK, 0)
}

/// `dots_*` over `pairs` dot products of length `n` (one block per pair), or `row_max_*`
/// over `rows` rows of width `n` (`*` = `f32` or `bf16`: the storage read; fp32 results).
pub fn buffer_rows(entry: &str, rows: u64, n: u64) -> Result<Launch, LaunchError> {
    per_row(entry.into(), rows, n)
}

/// The MoE launches for `t` tokens, `e` experts, top `k`, width `h`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeLaunches {
    pub route: Launch,
    pub route_bwd: Launch,
    pub count: Launch,
    pub index: Launch,
    pub permute: Launch,
    pub unpermute: Launch,
    pub unpermute_bwd: Launch,
}

/// Routed slots `t k` above this are not counted exactly (`moe_count` sums in f32).
pub const MOE_MAX_SLOTS: u64 = 1 << 24;

pub fn moe(dt: Dtype, t: u64, e: u64, k: u64, h: u64) -> Result<MoeLaunches, LaunchError> {
    let s = dt.suffix();
    let slots = t * k;
    if e == 0 || k == 0 || k > e {
        return err(format!("moe: top-{k} of {e} experts"));
    }
    if slots > MOE_MAX_SLOTS {
        return err(format!("moe: {slots} routed slots > {MOE_MAX_SLOTS}"));
    }
    let per_token = |entry: &str| Launch::new(entry.into(), [t.div_ceil(128), 1, 1], 128, 0);
    Ok(MoeLaunches {
        route: per_token("moe_route_topk")?,
        route_bwd: per_token("moe_route_bwd")?,
        count: Launch::new("moe_count".into(), [e, 1, 1], 256, 0)?,
        index: Launch::new("moe_index".into(), [e, 1, 1], 256, 0)?,
        permute: per_row(format!("moe_permute_{s}"), slots, h)?,
        unpermute: per_row(format!("moe_unpermute_{s}"), t, h)?,
        unpermute_bwd: per_row(format!("moe_unpermute_bwd_{s}"), slots, h)?,
    })
}
