//! The value path: a program names every tensor its nodes read and write, and the
//! interpreter runs those nodes on their values (`interp/values.rs`,
//! `interp/moe_values.rs`). Over the layouts of the equivalence matrix (dense and MoE: TP,
//! SP, PP with each schedule, CP, EP, whole experts, DP with ZeRO 0-3, full and selective
//! recompute, GPT blocks with LayerNorm, GeLU, learned positions and tied embeddings) every
//! layer and end node carries values, and two runs of a program give the same bits (every
//! rank's loss, gradient norm, gradients and weights, every step): no thread count, map
//! order or allocation changes a number. The numbers themselves are checked against the
//! single-rank run (`equivalence.rs`) and the naive model (`single_rank.rs`).
//!
//! These layouts were also checked bit for bit against the role-inferring interpreter the
//! value path replaced, before it was deleted (`SHARDWRIGHT_BITS_OUT` dumps the bits of a
//! build to compare two builds).
//!
//! The interpreter is generic over the backend's buffer type: a backend whose buffers it
//! cannot index (`value_path/devbuf.rs`) gives the [`Cpu`] bits.

mod common;
#[path = "value_path/devbuf.rs"]
mod devbuf;

use shardwright_executor::{run_program, Cpu, RankReport};

const STEPS: u32 = 2;

/// `a` and `b` hold the same bits.
fn same(what: &str, a: &[RankReport], b: &[RankReport]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        for (s, (p, q)) in x.steps.iter().zip(&y.steps).enumerate() {
            let at = format!("{what}: rank {} step {s}", x.rank);
            assert_eq!(
                p.loss.map(f64::to_bits),
                q.loss.map(f64::to_bits),
                "{at}: loss"
            );
            assert_eq!(
                p.grad_norm.to_bits(),
                q.grad_norm.to_bits(),
                "{at}: grad norm"
            );
            assert_eq!(
                p.global_loss.to_bits(),
                q.global_loss.to_bits(),
                "{at}: loss"
            );
            for (map, which) in [(&p.grads, &q.grads), (&p.params, &q.params)] {
                assert_eq!(
                    map.keys().collect::<Vec<_>>(),
                    which.keys().collect::<Vec<_>>()
                );
                for (k, v) in map {
                    let w = &which[k];
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(bits(v) == bits(w), "{at}: {k} differs");
                }
            }
        }
    }
}

/// With `SHARDWRIGHT_BITS_OUT=FILE`, append each rank's loss, gradient norm and weight
/// bits per step to FILE (to compare two builds of the executor bit for bit).
fn dump(layout: &str, runs: &[RankReport]) {
    let Ok(path) = std::env::var("SHARDWRIGHT_BITS_OUT") else {
        return;
    };
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("bits file");
    for r in runs {
        for (s, x) in r.steps.iter().enumerate() {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for (k, v) in &x.params {
                for b in k
                    .bytes()
                    .chain(v.iter().flat_map(|y| y.to_bits().to_le_bytes()))
                {
                    h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
                }
            }
            // One write per line: tests run in parallel append to the same file.
            let line = format!(
                "{layout} rank {} step {s} loss {:?} aux {:?} norm {:x} weights {h:x}\n",
                r.rank,
                x.loss.map(f64::to_bits),
                x.aux_loss.map(f64::to_bits),
                x.grad_norm.to_bits()
            );
            f.write_all(line.as_bytes()).expect("write");
        }
    }
}

fn check(tpl: &shardwright_spec::Plan, layouts: &[&str]) {
    for layout in layouts {
        let plan = common::plan_for(tpl, common::layout(layout));
        let program = shardwright_lowering::lower(&plan).expect("lowers").program;
        let valued: usize = program
            .classes
            .iter()
            .flat_map(|c| &c.graph.nodes)
            .filter(|n| !n.operands.is_empty() || !n.results.is_empty())
            .count();
        assert!(valued > 0, "{layout}: the program names no values");
        let first = run_program(&program, Cpu, &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout}: {e}"));
        let again = run_program(&program, Cpu, &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout} again: {e}"));
        same(layout, &first, &again);
        dump(layout, &first);
        eprintln!("{layout}: {valued} valued nodes, the same bits twice");
    }
}

#[test]
fn llama_layouts_train_to_the_same_bits_every_run() {
    check(
        &common::template(false, common::LAYERS),
        &[
            "ga4",
            "tp2,ga4",
            "tp2,ga4,sp=on",
            "pp2,ga4",
            "pp2,ga4,schedule=gpipe",
            "pp2,vpp2,ga4,tp2,schedule=interleaved,sp=on",
            "cp2,ga4",
            "dp2,ga2,zero1",
            "dp2,ga2,zero2",
            "dp2,ga2,zero3",
            "ga4,rc=full",
            "tp2,cp2,dp2,ga2,zero2,rc=selective",
            "pp2,cp2,dp2,ga2,schedule=gpipe,rc=full",
            "tp2,pp2,dp2,ga2,sp=on,zero1",
        ],
    );
}

#[test]
fn gpt_layouts_train_to_the_same_bits_every_run() {
    check(
        &common::gpt_template(false, common::LAYERS),
        &[
            "tp2,ga4,sp=on",
            "pp2,ga4",
            "cp2,ga4",
            "tp2,pp2,dp2,ga2,sp=on,zero1",
        ],
    );
    check(
        &common::gpt_template(true, common::LAYERS),
        &["tp2,ga4", "dp2,ga2,zero3"],
    );
}

#[test]
fn selective_module_recompute_trains_to_the_same_bits_every_run() {
    use shardwright_spec::spec::RecomputeModule as R;
    let tpl = common::template(false, common::LAYERS);
    for mods in [
        vec![R::CoreAttn, R::Mlp, R::Layernorm],
        vec![R::Mlp],
        vec![R::Layernorm],
    ] {
        let mut t = tpl.clone();
        t.inputs.training.recompute_modules = mods;
        check(
            &t,
            &["tp2,pp2,ga4,rc=selective,sp=on", "tp2,ga4,rc=selective"],
        );
    }
}

/// MoE models (4 experts, top-2; layer 0 dense, the rest MoE; with and without a shared
/// expert): routing, dispatch buffers, grouped expert GEMMs, the routing statistics and
/// the load-balancing loss on values, over the MoE layouts of the equivalence matrix (EP,
/// TP with and without SP, whole experts, CP, PP, ZeRO 0-3, full recompute).
#[test]
fn moe_layouts_train_to_the_same_bits_every_run() {
    check(
        &common::moe_template(2, 1, 1),
        &[
            "ga4",
            "ep2,ga2",
            "ep4,ga1",
            "ep2,ga1,mb2",
            "tp2,ga4",
            "ep2,tp2,ga2",
            "ep2,cp2,ga2",
            "ep2,tp2,cp2,ga2,zero1",
            "ep2,pp2,ga2",
            "ep2,dp2,ga1,zero3",
            "ep2,ga2,rc=full",
            "ep2,tp2,sp=on,etp1,ga2",
            "tp2,pp2,sp=on,etp1,ga4,zero2",
        ],
    );
    check(
        &common::moe_template(2, 1, 0),
        &["tp2,sp=on,etp1,ga4", "ep2,tp2,sp=on,ga2", "tp2,sp=on,ga4"],
    );
}

/// Megatron's MoE recompute modules (`moe`, `moe_act`, `shared_experts`) replay on values.
#[test]
fn moe_selective_recompute_trains_to_the_same_bits_every_run() {
    use shardwright_spec::spec::RecomputeModule as R;
    let tpl = common::moe_template(2, 1, 1);
    for mods in [
        vec![R::Moe],
        vec![R::MoeAct, R::SharedExperts],
        vec![R::Layernorm, R::Moe],
    ] {
        let mut t = tpl.clone();
        t.inputs.training.recompute_modules = mods;
        check(
            &t,
            &["ep2,tp2,ga2,rc=selective", "tp2,ga4,sp=on,rc=selective"],
        );
    }
}

/// The interpreter on a backend whose buffers it cannot index ([`devbuf::Opaque`]: the CPU
/// reference behind an opaque buffer type, as a GPU backend's device memory is) trains to
/// the [`Cpu`] run's bits, over dense and MoE layouts with every kind of host crossing
/// (tp/cp/ep collectives, pipeline sends, ZeRO shards and gathers, the loss statistics).
#[test]
fn an_opaque_buffer_backend_trains_to_the_cpu_bits() {
    let cases = [
        (
            common::template(false, common::LAYERS),
            "tp2,pp2,dp2,ga2,sp=on,zero1",
        ),
        (common::template(false, common::LAYERS), "cp2,ga4"),
        (common::gpt_template(true, common::LAYERS), "dp2,ga2,zero3"),
        (common::moe_template(2, 1, 1), "ep2,tp2,cp2,ga2,zero1"),
        (common::moe_template(2, 1, 0), "ep2,tp2,sp=on,ga2"),
    ];
    for (tpl, layout) in cases {
        let plan = common::plan_for(&tpl, common::layout(layout));
        let program = shardwright_lowering::lower(&plan).expect("lowers").program;
        let cpu = run_program(&program, Cpu, &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout}: {e}"));
        let be = devbuf::Opaque::default();
        let opaque = run_program(&program, be.clone(), &common::cfg(), STEPS)
            .unwrap_or_else(|e| panic!("{layout} opaque: {e}"));
        same(layout, &cpu, &opaque);
        let (up, down) = be.crossings();
        assert!(
            up > 0 && down > 0,
            "{layout}: {up} uploads, {down} downloads"
        );
        eprintln!("{layout}: the Cpu bits through opaque buffers; {up} uploads, {down} downloads");
    }
}
