//! Tiny plans for the executor's tests, and the comparison of a run with the single-rank run.
//!
//! How a plan for a tiny model is built: the planner's rules refuse many tiny shapes (the CP
//! shard minimum of 256 tokens, for one), so a *template* plan is planned once for a world
//! of one rank (`resolve` + `plan` of a pinned tp1/pp1/dp1 spec, which passes the rules),
//! and each layout under test overrides the template's `layout`, `stages` (an even layer
//! split), `inputs.training.global_batch` and `inputs.cluster.num_gpus`. The lowering reads
//! exactly those fields (plus the model), so the plan lowers to the layout asked for.

#![allow(dead_code)]

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_executor::model::{role_of, Dims};
use shardwright_executor::{run_program, Cpu, ExecConfig, RankReport};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::spec::{Recompute, Schedule};
use shardwright_spec::{Layout, Plan};

pub const LAYERS: u32 = 2;

pub fn spec_text(tied: bool, layers: u32) -> String {
    format!(
        "job:
  name: tiny-exec
  model:
    name: tiny
    arch: dense
    num_layers: {layers}
    hidden_size: 32
    num_attention_heads: 4
    num_kv_heads: 2
    ffn_hidden_size: 64
    ffn_activation: swiglu
    vocab_size: 64
    seq_len: 16
    tied_embeddings: {tied}
  parallelism: {{tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, vpp: 1, micro_batch: 1, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}}
  batch: {{global_batch: 4}}
cluster:
  gpu: H100-SXM
  gpus_per_node: 8
  num_gpus: 1
"
    )
}

/// GPT-style blocks: LayerNorm with bias, GeLU MLP, learned absolute positions.
pub fn gpt_spec_text(tied: bool, layers: u32) -> String {
    spec_text(tied, layers).replace(
        "    ffn_activation: swiglu\n",
        "    ffn_activation: gelu\n    norm: layernorm\n    learned_positions: true\n",
    )
}

/// [`template`] of the GPT-style model ([`gpt_spec_text`]).
pub fn gpt_template(tied: bool, layers: u32) -> Plan {
    template_of(&gpt_spec_text(tied, layers))
}

/// The MoE model: 4 experts, top-2, one shared expert; layers `0..first_k_dense` dense.
pub fn moe_spec_text(layers: u32, first_k_dense: u32, shared: u32) -> String {
    spec_text(false, layers).replace(
        "    arch: dense\n",
        "    arch: moe\n",
    ).replace(
        "    tied_embeddings: false\n",
        &format!(
            "    tied_embeddings: false\n    moe: {{num_experts: 4, top_k: 2, num_shared_experts: {shared}, expert_ffn_hidden_size: 32, first_k_dense: {first_k_dense}}}\n"
        ),
    )
}

pub fn template(tied: bool, layers: u32) -> Plan {
    template_of(&spec_text(tied, layers))
}

/// [`template`] of the MoE model ([`moe_spec_text`]).
pub fn moe_template(layers: u32, first_k_dense: u32, shared: u32) -> Plan {
    template_of(&moe_spec_text(layers, first_k_dense, shared))
}

pub fn template_of(text: &str) -> Plan {
    let spec = parse_spec(text, Format::Yaml).expect("spec parses");
    let r = resolve(&spec, &ResolveOptions::default()).expect("tiny spec resolves");
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).expect("plans");
    serde_json::from_str(&shardwright_spec::plan::to_json(&p)).expect("plan JSON")
}

/// A layout written like `plan --baseline`'s argument: `tp2,pp2,dp1,cp1,mb1,ga4,zero1,
/// rc=full,sp=on,schedule=gpipe,vpp1` (missing keys: 1 / off / none / 1f1b).
pub fn layout(text: &str) -> Layout {
    let mut l = Layout {
        tp: 1,
        pp: 1,
        dp: 1,
        cp: 1,
        ep: 1,
        vpp: 1,
        micro_batch: 1,
        grad_accum: 1,
        zero_stage: 0,
        recompute: Recompute::None,
        sequence_parallel: false,
        schedule: Schedule::OneFOneB,
        expert_tp: None,
    };
    for tok in text.split(',').filter(|t| !t.is_empty()) {
        let (k, v) = match tok.split_once('=') {
            Some(x) => x,
            None => {
                let i = tok.find(|c: char| c.is_ascii_digit()).expect("number");
                (&tok[..i], &tok[i..])
            }
        };
        let n = || v.parse::<u32>().expect("number");
        match k {
            "tp" => l.tp = n(),
            "pp" => l.pp = n(),
            "dp" => l.dp = n(),
            "cp" => l.cp = n(),
            "ep" => l.ep = n(),
            "etp" => l.expert_tp = Some(n()),
            "vpp" => l.vpp = n(),
            "mb" => l.micro_batch = n(),
            "ga" => l.grad_accum = n() as u64,
            "zero" => l.zero_stage = n() as u8,
            "rc" => {
                l.recompute = match v {
                    "full" => Recompute::Full,
                    "selective" => Recompute::Selective,
                    _ => Recompute::None,
                }
            }
            "sp" => l.sequence_parallel = v == "on",
            "schedule" => {
                l.schedule = match v {
                    "gpipe" => Schedule::Gpipe,
                    "interleaved" => Schedule::Interleaved,
                    _ => Schedule::OneFOneB,
                }
            }
            _ => panic!("unknown layout key {k}"),
        }
    }
    l
}

/// The template with `layout` applied (global batch = dp x ep x ga x mb).
pub fn plan_for(template: &Plan, l: Layout) -> Plan {
    let mut p = template.clone();
    p.layout = l;
    let world = l.world();
    p.inputs.cluster.num_gpus = world;
    p.inputs.training.global_batch =
        l.dp as u64 * l.ep as u64 * l.grad_accum * l.micro_batch as u64;
    let layers = p.inputs.model.num_layers;
    let mut stages = Vec::new();
    let mut first = 0;
    for s in 0..l.pp {
        let n = layers / l.pp + u32::from(s < layers % l.pp);
        let mut st = template.stages[0].clone();
        st.stage = s;
        st.num_layers = n;
        st.layers = vec![format!("{}-{}", first, first + n - 1)];
        st.has_embedding = s == 0;
        st.has_lm_head = s == l.pp - 1;
        stages.push(st);
        first += n;
    }
    p.stages = stages;
    p
}

/// The tests' hyper-parameters. AdamW's `eps` is 1e-3, above every gradient's f32
/// rounding noise: the first step's update is `lr g / (|g| + eps)`, whose sensitivity to
/// `g` peaks at `lr / (4 eps)` where `|g| = eps`. With 1e-8 a gradient element of a few
/// 1e-8 (rounding across layouts is about 1e-7 of its tensor's largest element) moves its
/// weight by a visibly different fraction of `lr` in two layouts that agree in exact
/// arithmetic (seen on a rarely routed expert under tp2); with 1e-3 the update moves by at
/// most the gradient's own difference, so a weight difference means a real one.
pub fn cfg() -> ExecConfig {
    ExecConfig {
        eps: 1e-3,
        lr: 1e-3,
        min_lr: 1e-4,
        total_steps: 3,
        warmup_steps: 1,
        ..ExecConfig::default()
    }
}

/// Lower `plan`, write its program in the text form that `lower -o prog.ir` writes, read
/// it back (it must be the same program) and run `steps` steps of what was read: every
/// layout these tests run is run from the program text alone (no plan, job or layout).
pub fn run(plan: &Plan, steps: u32) -> Vec<RankReport> {
    let lowered = shardwright_lowering::lower(plan).expect("lowers");
    let text = shardwright_ir::text::print_program(&lowered.program);
    let program = shardwright_ir::text::parse_program(&text).expect("the program text parses");
    assert!(
        program == lowered.program,
        "the program text does not round-trip"
    );
    run_program(&program, Cpu, &cfg(), steps).unwrap_or_else(|e| panic!("{e}"))
}

/// Relative error of `a` against `b`: max |a - b| / max |b|.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0.0f64, |m, x| m.max(x.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()))
        / scale
}

/// Compare every rank of `runs` with the single-rank run `base`: per step the loss, each
/// rank's gradient norm and global loss, the gradient and the updated weights of every tensor (each rank's tensor-parallel shard of
/// the full tensor). Panics naming the first differing tensor, rank and step; returns the
/// largest relative error seen.
pub fn compare(what: &str, dims: &Dims, base: &[RankReport], runs: &[RankReport], tol: f64) -> f64 {
    assert_eq!(base.len(), 1);
    let b = &base[0];
    let mut worst = 0.0f64;
    for (step, bs) in b.steps.iter().enumerate() {
        let loss: f64 = runs.iter().filter_map(|r| r.steps[step].loss).sum();
        let want = bs.loss.expect("single rank has the loss");
        let e = (loss - want).abs() / want.abs();
        worst = worst.max(e);
        assert!(
            e <= tol,
            "{what}: step {step}: loss {loss} vs {want} (rel {e:.2e})"
        );
        // The MoE load-balancing loss: every MoE layer's share reported once.
        match bs.aux_loss {
            Some(want) => {
                let got: f64 = runs.iter().filter_map(|r| r.steps[step].aux_loss).sum();
                let e = (got - want).abs() / want.abs();
                worst = worst.max(e);
                assert!(
                    e <= tol,
                    "{what}: step {step}: aux loss {got} vs {want} (rel {e:.2e})"
                );
            }
            None => assert!(
                runs.iter().all(|r| r.steps[step].aux_loss.is_none()),
                "{what}: aux loss without MoE layers"
            ),
        }
        for r in runs {
            let rs = &r.steps[step];
            // The clipping norm and the step's loss every rank knows (the graph's
            // `grad_norm` all-reduce).
            for (what_, got, want) in [
                ("gradient norm", rs.grad_norm, bs.grad_norm),
                ("global loss", rs.global_loss, bs.global_loss),
            ] {
                let e = (got - want).abs() / want.abs().max(1e-30);
                worst = worst.max(e);
                assert!(
                    e <= tol,
                    "{what}: step {step}, rank {}: {what_} {got} vs {want} (rel {e:.2e})",
                    r.rank
                );
            }
            for (kind, got, full) in [
                ("grad", &rs.grads, &bs.grads),
                ("weight", &rs.params, &bs.params),
            ] {
                for (name, v) in got {
                    let f = &full[name];
                    // A rank holds a tp shard, or the whole tensor (replicated weights,
                    // and whole experts under expert TP 1).
                    let want = if v.len() == f.len() {
                        f.clone()
                    } else {
                        megatron_tp_part(f, dims, name, r.tp_index, r.tp)
                    };
                    let e = rel(v, &want);
                    worst = worst.max(e);
                    assert!(
                        e <= tol,
                        "{what}: first difference at step {step}, rank {}, {kind} {name}: relative error {e:.2e}",
                        r.rank
                    );
                }
            }
        }
    }
    // Every parameter is held by some rank.
    let names: std::collections::BTreeSet<&String> =
        runs.iter().flat_map(|r| r.steps[0].params.keys()).collect();
    assert_eq!(
        names.len(),
        b.steps[0].params.len(),
        "{what}: parameters missing"
    );
    worst
}

/// The plan of every bundled spec (`specs/`), by file name, sorted.
pub fn bundled_plans() -> Vec<(String, Plan)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".json"))
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no specs in {}", dir.display());
    names
        .into_iter()
        .map(|n| {
            let text = std::fs::read_to_string(dir.join(&n)).unwrap();
            let spec = parse_spec(&text, Format::from_path(&n)).unwrap();
            let r = resolve(&spec, &ResolveOptions::default()).unwrap();
            let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).unwrap();
            (n, p)
        })
        .collect()
}

/// Rank `i`'s part (of `tp`) of the full tensor `full` of parameter `name`, by Megatron's
/// tensor-parallel layout, written here independently of the lowering's slices (which the
/// executor cuts by): column-parallel QKV (Q, K and V each cut in `tp` column chunks, rank
/// `i` holding chunk `i` of each), FC1 (gate and up each cut likewise) and LM head;
/// row-parallel projection, FC2 and embedding (contiguous row blocks); the rest whole.
pub fn megatron_tp_part(full: &[f32], dims: &Dims, name: &str, i: usize, tp: usize) -> Vec<f32> {
    use shardwright_ir::{Role, TpSplit};
    let [r, c] = dims.shape(name);
    let role = role_of(name);
    match role.tp_split() {
        TpSplit::Replicated => full.to_vec(),
        TpSplit::Rows => {
            let n = r / tp;
            full[i * n * c..(i + 1) * n * c].to_vec()
        }
        TpSplit::Cols => {
            let blocks: Vec<usize> = match role {
                Role::Qkv => vec![
                    dims.heads * dims.d,
                    dims.kv_heads * dims.d,
                    dims.kv_heads * dims.d,
                ],
                Role::LmHead => vec![c],
                // gate | up (gated activations), or one block
                _ => {
                    let k = if dims.gelu { 1 } else { 2 };
                    vec![c / k; k]
                }
            };
            let mut out = Vec::with_capacity(full.len() / tp);
            for row in full.chunks_exact(c) {
                let mut start = 0;
                for w in &blocks {
                    let n = w / tp;
                    out.extend_from_slice(&row[start + i * n..start + (i + 1) * n]);
                    start += w;
                }
            }
            out
        }
    }
}

/// The bundled `specs/tiny-llama-cpu.yaml` model (4 layers, hidden 64, 4 / 2 heads of 16,
/// FFN 176, vocabulary 512, sequences of 64) as a plan template.
pub fn tiny_llama_cpu_template() -> Plan {
    let text = spec_text(false, 4)
        .replace("hidden_size: 32", "hidden_size: 64")
        .replace("ffn_hidden_size: 64", "ffn_hidden_size: 176")
        .replace("vocab_size: 64", "vocab_size: 512")
        .replace("seq_len: 16", "seq_len: 64");
    template_of(&text)
}
