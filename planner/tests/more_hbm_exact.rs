//! More HBM never lowers the plan's goodput, with no slack: the plan is the optimum over
//! its layouts and their stage splits, and more HBM only lets more splits and layouts fit.
//! Small dense and MoE specs on one GPU per node (tp 1) with HBM low enough to bind, drawn
//! by a fixed generator; `MORE_HBM_CASES=N` draws N (default 60).

use shardwright_cost::resolve::{resolve, ResolveOptions};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::plan::round_sig;

struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

fn goodput(text: &str) -> Option<(f64, String)> {
    let spec = parse_spec(text, Format::Yaml).unwrap();
    let r = resolve(&spec, &ResolveOptions::default()).unwrap();
    let opts = PlanOptions {
        top_k: 3,
        refine: true,
    };
    plan(&r.job, &r.warnings, &opts, &mut |_, _| {})
        .ok()
        .map(|p| (p.estimate.goodput_tokens_per_s, p.layout.to_string()))
}

pub fn spec_text(seed: u64, hbm_scale: f64) -> String {
    let mut r = Lcg(seed);
    let layers = 4 + r.below(29);
    let hidden = r.pick(&[512u64, 1024, 2048]);
    let heads = r.pick(&[4u32, 8, 16]);
    let ffn = hidden * r.pick(&[2u64, 3, 4]);
    let vocab = 1000 + r.below(64000);
    let seq = r.pick(&[512u64, 1024, 2048]);
    let world = r.pick(&[4u64, 6, 8, 10, 12, 16, 20, 25]);
    let gb = world * (1 + r.below(6));
    let hbm = (2.25 + r.below(1000) as f64 * 0.00975) * 1024.0 * 1024.0 * 1024.0 * hbm_scale;
    let moe = if r.below(3) == 0 {
        format!(
            ", arch: moe, moe: {{num_experts: 8, top_k: {}, expert_ffn_hidden_size: {hidden}, first_k_dense: {}}}",
            1 + r.below(2),
            r.below(3).min(layers - 1)
        )
    } else {
        ", arch: dense".to_string()
    };
    format!(
        "job:
  model: {{num_layers: {layers}, hidden_size: {hidden}, num_attention_heads: {heads},
          ffn_hidden_size: {ffn}, vocab_size: {vocab}, seq_len: {seq}{moe}}}
  batch: {{global_batch: {gb}}}
cluster: {{gpu: A100-40GB, gpus_per_node: 1, num_gpus: {world}, hardware: {{hbm_bytes: {hbm}}}}}
"
    )
}

#[test]
fn more_hbm_never_lowers_the_plan() {
    let n: u64 = std::env::var("MORE_HBM_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let mut bad = Vec::new();
    let mut planned = 0;
    for seed in 0..n {
        let small = spec_text(seed, 1.0);
        let Some((g0, l0)) = goodput(&small) else {
            continue;
        };
        planned += 1;
        for factor in [1.05, 1.25, 1.5, 2.0] {
            let (g1, l1) = goodput(&spec_text(seed, factor)).expect("feasible with more HBM");
            if round_sig(g1, 6) < round_sig(g0, 6) {
                bad.push(format!(
                    "seed {seed} x{factor}: {l1} at {g1} < {l0} at {g0}"
                ));
            }
        }
    }
    eprintln!("{planned} of {n} specs planned");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
