//! Launch configurations of every CUDA kernel for the shapes of every bundled spec
//! (`specs/*.yaml`, planned as `shardwright plan` plans them), checked against sm_90 and
//! sm_80 limits: threads per block, grid dimensions (y, z <= 65535), dynamic shared memory
//! (48 KiB without the opt-in, 227 KiB / 163 KiB with it). No GPU needed.

mod common;
use common::bundled_plans as specs;
use shardwright_executor::cuda::kernels::file_of;
use shardwright_executor::cuda::launch::{self, Attn, Dtype, Launch, Limits, Norm};
use shardwright_executor::cuda::rope_tables;
use shardwright_executor::{Backend, Cpu};
use shardwright_spec::Plan;

/// Every launch one rank of `p` makes in a step (both element types), with a label.
fn launches(p: &Plan) -> Vec<(String, Result<Launch, launch::LaunchError>)> {
    let m = &p.inputs.model;
    let l = &p.layout;
    let (tp, cp) = (l.tp as u64, l.cp as u64);
    let mb = l.micro_batch as u64;
    let seq_local = m.seq_len / cp;
    let t = mb * seq_local; // tokens of a micro-batch on this rank
    let t_sp = if l.sequence_parallel { t / tp } else { t }; // rows of norms under SP
    let h = m.hidden_size;
    let heads = m.num_attention_heads as u64 / tp;
    // Fewer kv heads than tp ranks: each rank keeps one (Megatron replicates them).
    let kv = (m.num_kv_heads as u64 / tp).max(1);
    let d = m.head_dim;
    let vocab = m.vocab_size.div_ceil(tp);
    let window = m.sliding_window.filter(|&w| w < m.seq_len).unwrap_or(0);
    let norm = match m.norm {
        shardwright_spec::spec::Norm::Layernorm => Norm::Layer,
        _ => Norm::Rms,
    };
    // The largest parameter shard AdamW updates at once: all of a rank's parameters.
    let params = (m.params_total / (tp * p.layout.pp as u64) as f64).ceil() as u64;

    let mut out: Vec<(String, Result<Launch, launch::LaunchError>)> = Vec::new();
    let mut add = |label: String, r: Result<Launch, launch::LaunchError>| out.push((label, r));
    for dt in [Dtype::F32, Dtype::Bf16] {
        let s = dt.suffix();
        add(
            format!("embedding fwd {s}"),
            launch::embedding_fwd(dt, t, h),
        );
        add(
            format!("embedding bwd {s}"),
            launch::embedding_bwd(dt, t, h),
        );
        add(format!("norm fwd {s}"), launch::norm_fwd(norm, dt, t_sp, h));
        match launch::norm_bwd(norm, dt, t_sp, h) {
            Ok([a, b]) => {
                add(format!("norm bwd {s}"), Ok(a));
                add(format!("norm bwd reduce {s}"), Ok(b));
            }
            Err(e) => add(format!("norm bwd {s}"), Err(e)),
        }
        for bwd in [false, true] {
            add(
                format!("rope q {s} bwd={bwd}"),
                launch::rope(dt, bwd, t, heads, d),
            );
            add(
                format!("rope k {s} bwd={bwd}"),
                launch::rope(dt, bwd, t, kv, d),
            );
            add(
                format!("swiglu {s} bwd={bwd}"),
                launch::swiglu(dt, bwd, t, m.ffn_hidden_size / tp),
            );
            add(
                format!("gelu {s} bwd={bwd}"),
                launch::gelu(dt, bwd, t * (m.ffn_hidden_size / tp)),
            );
        }
        // Attention as the reference runs it under cp (local queries, all keys), and as a
        // ring step (a chunk of keys).
        for (what, seq_kv) in [("all keys", m.seq_len), ("ring chunk", seq_local)] {
            let a = Attn {
                batch: mb,
                seq_q: seq_local,
                seq_kv,
                heads,
                kv_heads: kv,
                head_dim: d,
                window,
            };
            match launch::attention(dt, &a) {
                Ok(x) => {
                    for (k, lc) in [
                        ("fwd", x.fwd),
                        ("delta", x.bwd_delta),
                        ("dkdv", x.bwd_dkdv),
                        ("dq", x.bwd_dq),
                    ] {
                        add(format!("attention {what} {k} {s}"), Ok(lc));
                    }
                }
                Err(e) => add(format!("attention {what} {s}"), Err(e)),
            }
            // On sm_80 and newer (unless SHARDWRIGHT_CUDA_ATTENTION=scalar), bf16 calls of
            // head_dim 64 or 128 run the tensor-core kernels.
            if launch::attn_uses_mma(launch::AttnImpl::Mma, dt, d) {
                match launch::attention_mma(&a) {
                    Ok(x) => {
                        for (k, lc) in [("fwd", x.fwd), ("dkdv", x.bwd_dkdv), ("dq", x.bwd_dq)] {
                            add(format!("attention mma {what} {k}"), Ok(lc));
                        }
                    }
                    Err(e) => add(format!("attention mma {what}"), Err(e)),
                }
            }
        }
        match launch::xent(dt, t, vocab) {
            Ok(x) => {
                for (k, lc) in [
                    ("fwd", x.fwd_local),
                    ("rescale", x.rescale),
                    ("finish", x.finish),
                    ("bwd", x.bwd),
                ] {
                    add(format!("xent {k} {s}"), Ok(lc));
                }
            }
            Err(e) => add(format!("xent {s}"), Err(e)),
        }
        add(format!("adamw grad {s}"), launch::adamw(dt, params));
        if let Some(moe) = &m.moe {
            // Routed tokens: this rank's sequence shard (SP) of the micro-batch.
            match launch::moe(dt, t_sp, moe.num_experts as u64, moe.top_k as u64, h) {
                Ok(x) => {
                    for (k, lc) in [
                        ("route", x.route),
                        ("route bwd", x.route_bwd),
                        ("count", x.count),
                        ("index", x.index),
                        ("permute", x.permute),
                        ("unpermute", x.unpermute),
                        ("unpermute bwd", x.unpermute_bwd),
                    ] {
                        add(format!("moe {k} {s}"), Ok(lc));
                    }
                }
                Err(e) => add(format!("moe {s}"), Err(e)),
            }
            add(
                format!("expert swiglu {s}"),
                launch::swiglu(
                    dt,
                    false,
                    t_sp * moe.top_k as u64,
                    moe.expert_ffn_hidden_size / tp.max(1),
                ),
            );
        }
    }
    add("cast to bf16".into(), launch::cast(true, params));
    add("cast to f32".into(), launch::cast(false, params));
    out
}

#[test]
fn every_bundled_spec_launches_within_sm90_and_sm80_limits() {
    let mut failures = Vec::new();
    let mut summary = String::new();
    for (name, p) in specs() {
        let l = &p.layout;
        let ls = launches(&p);
        let mut max_smem = 0;
        let mut max_grid_y = 0;
        for (label, r) in &ls {
            match r {
                Ok(lc) => {
                    max_smem = max_smem.max(lc.smem);
                    max_grid_y = max_grid_y.max(lc.grid[1].max(lc.grid[2]));
                    for lim in [Limits::SM90, Limits::SM80] {
                        if let Err(e) = lc.check(&lim) {
                            failures.push(format!("{name}: {label}: {e}"));
                        }
                    }
                }
                Err(e) => failures.push(format!("{name}: {label}: {e}")),
            }
        }
        summary += &format!(
            "{name}: tp{} cp{} mb{} sp={} -> {} launches, max dynamic smem {} B, max grid y/z {}\n",
            l.tp,
            l.cp,
            l.micro_batch,
            l.sequence_parallel,
            ls.len(),
            max_smem,
            max_grid_y
        );
    }
    eprintln!("{summary}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn limits_are_enforced() {
    let ok = launch::attention(
        Dtype::Bf16,
        &Attn {
            batch: 1,
            seq_q: 4096,
            seq_kv: 4096,
            heads: 16,
            kv_heads: 2,
            head_dim: 128,
            window: 0,
        },
    )
    .unwrap();
    // 32 queries per block of 128 threads at d = 128; K and V tiles of 32 x 128 fp32 and
    // 32 x 33 scores.
    assert_eq!(ok.fwd.entry, "attn_fwd_bf16_d128");
    assert_eq!(ok.fwd.grid, [128, 16, 1]);
    assert_eq!(ok.fwd.block, [128, 1, 1]);
    assert_eq!(ok.fwd.smem, 32 * 1024 + 32 * 33 * 4);
    assert_eq!(ok.bwd_dq.smem, 32 * 1024);
    assert_eq!(ok.bwd_dkdv.smem, 32 * 1024 + 2 * 32 * 4);
    assert!(!ok.fwd.needs_smem_optin(&Limits::SM90));
    assert_eq!(ok.bwd_dkdv.grid, [128, 2, 1]);
    ok.fwd.check(&Limits::SM90).unwrap();

    // Each limit, one at a time.
    let mut l = ok.fwd.clone();
    l.grid[1] = 65536;
    assert!(l
        .check(&Limits::SM90)
        .unwrap_err()
        .0
        .contains("grid dimension 1"));
    let mut l = ok.fwd.clone();
    l.block = [2048, 1, 1];
    assert!(l
        .check(&Limits::SM90)
        .unwrap_err()
        .0
        .contains("threads per block"));
    let mut l = ok.fwd.clone();
    l.smem = 100 * 1024;
    assert!(l.needs_smem_optin(&Limits::SM90));
    l.check(&Limits::SM90).unwrap();
    l.smem = 200 * 1024;
    l.check(&Limits::SM90).unwrap();
    assert!(l.check(&Limits::SM80).unwrap_err().0.contains("opt-in"));
    l.smem = 228 * 1024;
    assert!(l.check(&Limits::SM90).is_err());
    let mut l = ok.fwd.clone();
    l.entry = "no_such_kernel".into();
    assert!(l
        .check(&Limits::SM90)
        .unwrap_err()
        .0
        .contains("no such kernel"));

    // Shapes without a kernel.
    let bad = |a: Attn| launch::attention(Dtype::F32, &a).unwrap_err().0;
    let base = Attn {
        batch: 1,
        seq_q: 8,
        seq_kv: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        window: 0,
    };
    assert!(bad(Attn {
        head_dim: 256,
        ..base
    })
    .contains("head_dim 256"));
    assert!(bad(Attn {
        kv_heads: 3,
        ..base
    })
    .contains("not a multiple"));
    assert!(launch::rope(Dtype::F32, false, 4, 2, 7).is_err());
    assert!(launch::moe(Dtype::F32, 10, 4, 5, 8).is_err());
    assert!(launch::moe(Dtype::F32, 1 << 22, 64, 8, 8)
        .unwrap_err()
        .0
        .contains("routed slots"));
    assert!(launch::norm_fwd(Norm::Rms, Dtype::F32, 0, 8).is_err());

    // Small head dims use the smallest variant; every variant is a registered kernel.
    assert_eq!(
        launch::attention(Dtype::F32, &base).unwrap().fwd.entry,
        "attn_fwd_f32_d64"
    );
    for d in [8, 56, 64, 100, 128] {
        let x = launch::attention(
            Dtype::Bf16,
            &Attn {
                head_dim: d,
                ..base
            },
        )
        .unwrap();
        for lc in [x.fwd, x.bwd_delta, x.bwd_dkdv, x.bwd_dq] {
            assert!(file_of(&lc.entry).is_some(), "{}", lc.entry);
        }
    }
}

/// Which attention kernels a call runs: the tensor-core ones only when the switch says
/// `mma`, storage is bf16 and head_dim is exactly 64 or 128; their launches at the GPU
/// bench's shapes, within both devices' limits.
#[test]
fn attention_kernel_dispatch() {
    use launch::{attention_for, attn_uses_mma, AttnImpl};
    // Unset, the device picks: the tensor-core kernels from sm_80 (Ampere's mma.sync bf16
    // shape and ldmatrix), the scalar ones on Volta and Turing.
    for (sm, want) in [
        (70, AttnImpl::Scalar),
        (75, AttnImpl::Scalar),
        (80, AttnImpl::Mma),
        (86, AttnImpl::Mma),
        (90, AttnImpl::Mma),
    ] {
        assert_eq!(AttnImpl::default_for(sm), want, "sm_{sm}");
    }
    assert_eq!(AttnImpl::parse("mma"), Ok(AttnImpl::Mma));
    assert_eq!(AttnImpl::parse(" Scalar "), Ok(AttnImpl::Scalar));
    assert!(AttnImpl::parse("flash")
        .unwrap_err()
        .contains("`scalar` or `mma`"));
    for (sw, dt, d, want) in [
        (AttnImpl::Mma, Dtype::Bf16, 64, true),
        (AttnImpl::Mma, Dtype::Bf16, 128, true),
        (AttnImpl::Mma, Dtype::Bf16, 80, false),
        (AttnImpl::Mma, Dtype::Bf16, 32, false),
        (AttnImpl::Mma, Dtype::F32, 64, false),
        (AttnImpl::Mma, Dtype::F32, 128, false),
        (AttnImpl::Scalar, Dtype::Bf16, 64, false),
        (AttnImpl::Scalar, Dtype::Bf16, 128, false),
    ] {
        assert_eq!(attn_uses_mma(sw, dt, d), want, "{sw:?} {dt:?} d={d}");
        let a = Attn {
            batch: 2,
            seq_q: 100,
            seq_kv: 100,
            heads: 8,
            kv_heads: 2,
            head_dim: d,
            window: 0,
        };
        let x = attention_for(sw, dt, &a).unwrap();
        let prefix = if want { "attn_mma_" } else { "attn_" };
        assert!(x.fwd.entry.starts_with(prefix), "{}", x.fwd.entry);
        assert_eq!(x.fwd.entry.starts_with("attn_mma_"), want);
        assert_eq!(x.bwd_delta.entry, format!("attn_bwd_delta_{}", dt.suffix()));
    }
    // head_dim 80 under the scalar kernels is padded to 128; the tensor-core ones refuse it.
    let a = |b, s, hq, hk, d| Attn {
        batch: b,
        seq_q: s,
        seq_kv: s,
        heads: hq,
        kv_heads: hk,
        head_dim: d,
        window: 0,
    };
    assert!(launch::attention_mma(&a(1, 8, 4, 2, 80))
        .unwrap_err()
        .0
        .contains("head_dim 80"));
    // The bench's shapes: 64 rows a block of 128 threads; shared memory as attention_mma.cu
    // lays it out (rows of d + 8 bf16; the streamed tiles twice).
    let x = launch::attention_mma(&a(8, 2048, 32, 4, 64)).unwrap();
    assert_eq!(x.fwd.entry, "attn_mma_fwd_bf16_d64");
    assert_eq!(x.fwd.grid, [32, 32, 8]);
    assert_eq!(x.fwd.block, [128, 1, 1]);
    assert_eq!(x.fwd.smem, (64 + 4 * 64) * 72 * 2);
    assert_eq!(x.bwd_dq.smem, (128 + 4 * 64) * 72 * 2);
    assert_eq!(x.bwd_dkdv.smem, (128 + 4 * 64) * 72 * 2 + 4 * 64 * 4);
    assert_eq!(x.bwd_dkdv.grid, [32, 4, 8]);
    let y = launch::attention_mma(&a(1, 4096, 32, 8, 128)).unwrap();
    assert_eq!(y.fwd.entry, "attn_mma_fwd_bf16_d128");
    assert_eq!(y.fwd.smem, (64 + 4 * 64) * 136 * 2);
    assert_eq!(y.bwd_dq.smem, (128 + 4 * 32) * 136 * 2);
    assert_eq!(y.bwd_dkdv.smem, (128 + 4 * 32) * 136 * 2 + 4 * 32 * 4);
    assert!(y.fwd.needs_smem_optin(&Limits::SM80));
    for lc in [x.fwd, x.bwd_dkdv, x.bwd_dq, y.fwd, y.bwd_dkdv, y.bwd_dq] {
        for lim in [Limits::SM90, Limits::SM80] {
            lc.check(&lim).unwrap();
        }
    }
}

#[test]
fn row_blocks_and_grid_stride_grids() {
    assert_eq!(launch::row_block(1), 32);
    assert_eq!(launch::row_block(4096), 512);
    assert_eq!(launch::row_block(7168), 896);
    assert_eq!(launch::row_block(16384), 1024);
    assert_eq!(launch::row_block(1 << 20), 1024);
    // A tensor of 10^11 elements loops over a capped grid.
    let l = launch::adamw(Dtype::F32, 100_000_000_000).unwrap();
    assert_eq!(l.grid, [65536, 1, 1]);
    l.check(&Limits::SM90).unwrap();
    // The norm backward's partial-sum rows depend on the shape only.
    assert_eq!(launch::norm_bwd_blocks(3), 3);
    assert_eq!(launch::norm_bwd_blocks(100_000), 256);
}

/// The RoPE tables the kernels read give the reference's rotation exactly: rotating the
/// unit pair (1, 0) with the CPU backend yields (cos, sin) of each angle.
#[test]
fn rope_tables_match_the_reference_angles() {
    let (positions, d, theta) = (37usize, 16usize, 10000.0f32);
    let (cos, sin) = rope_tables(positions, d, theta);
    let half = d / 2;
    for p in 0..positions {
        let mut x = vec![0.0f32; d];
        x[..half].fill(1.0);
        Cpu.rope_fwd(&mut x, &[p as u32], 1, d, theta);
        for j in 0..half {
            assert_eq!(
                x[j].to_bits(),
                cos[p * half + j].to_bits(),
                "cos p={p} j={j}"
            );
            assert_eq!(
                x[j + half].to_bits(),
                sin[p * half + j].to_bits(),
                "sin p={p} j={j}"
            );
        }
    }
}

/// The embedding backward's segments, summed as `embedding_bwd_*` sums them (per row, its
/// tokens in order, onto the existing gradient), give the reference's gradient bit for bit.
#[test]
fn embedding_segments_reproduce_the_reference_gradient() {
    use shardwright_executor::cuda::embedding_segments;
    let (h, vocab_start, rows) = (5usize, 10usize, 7usize);
    // Ids below, inside and above the shard, repeated, unsorted.
    let ids: Vec<u32> = vec![12, 3, 16, 12, 10, 17, 12, 16, 25, 10, 11];
    let dy: Vec<f32> = (0..ids.len() * h)
        .map(|i| ((i * 7919) % 113) as f32 * 0.013 - 0.7)
        .collect();
    let init: Vec<f32> = (0..rows * h).map(|i| (i as f32 * 0.37).sin()).collect();

    let mut want = init.clone();
    Cpu.embedding_bwd(&ids, &dy, vocab_start, h, &mut want);

    let seg = embedding_segments(&ids, vocab_start, rows);
    assert_eq!(seg.seg_row, vec![0, 1, 2, 6]);
    assert_eq!(seg.seg_start, vec![0, 2, 3, 6, 8]);
    assert_eq!(seg.order, vec![4, 9, 10, 0, 3, 6, 2, 7]);
    let mut got = init;
    for s in 0..seg.seg_row.len() {
        let r = seg.seg_row[s] as usize;
        for j in 0..h {
            let mut acc = got[r * h + j];
            for n in seg.seg_start[s]..seg.seg_start[s + 1] {
                acc += dy[seg.order[n as usize] as usize * h + j];
            }
            got[r * h + j] = acc;
        }
    }
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

/// Which range lists run `moves_strided_*` (`backend::progression`): per-row views of a 2-D
/// tensor with one factor, by hand; not descending offsets, a second factor, one move, or
/// an offset that breaks the step.
#[test]
fn strided_moves_are_arithmetic_progressions() {
    use shardwright_executor::cuda::launch::progression;
    // Columns 32..72 of 4 rows of 96, packed: (32 + 96 r, 40 r).
    let rows: Vec<(usize, usize, f32)> = (0..4).map(|r| (32 + 96 * r, 40 * r, 1.0)).collect();
    assert_eq!(progression(&rows), Some((32, 96, 0, 40, 1.0)));
    // One row broadcast (source step 0), factor 0.5.
    let b: Vec<(usize, usize, f32)> = (0..3).map(|r| (7, 10 + 5 * r, 0.5)).collect();
    assert_eq!(progression(&b), Some((7, 0, 10, 5, 0.5)));
    assert_eq!(progression(&[(0, 0, 1.0)]), None, "one move");
    assert_eq!(
        progression(&[(10, 0, 1.0), (5, 8, 1.0)]),
        None,
        "descending source"
    );
    assert_eq!(
        progression(&[(0, 8, 1.0), (4, 0, 1.0)]),
        None,
        "descending destination"
    );
    assert_eq!(
        progression(&[(0, 0, 1.0), (4, 8, 2.0), (8, 16, 1.0)]),
        None,
        "two factors"
    );
    assert_eq!(
        progression(&[(0, 0, 1.0), (4, 8, 1.0), (9, 16, 1.0)]),
        None,
        "a broken step"
    );
    // The launch: y walks the ranges (at most 65,535 blocks), x one range's elements.
    let l = launch::buffer_moves_strided(Dtype::Bf16, 70_000, 2048).unwrap();
    assert_eq!((l.grid, l.block[0]), ([8, 65_535, 1], 256));
    // A short range takes one warp: 3 values, 32 threads.
    let l = launch::buffer_moves_strided(Dtype::F32, 10, 3).unwrap();
    assert_eq!((l.grid, l.block[0]), ([1, 10, 1], 32));
    assert!(launch::buffer_moves_strided(Dtype::F32, 0, 8).is_err());
}
