//! Random small plans lower and verify; every mutation of one rank's graph is caught.
//!
//! Plans: a tiny Llama-style model (dense or MoE) with a random fully pinned layout on up to
//! 16 ranks (tp, pp, dp, cp, ep, vpp, schedule, ZeRO stage, recompute, sequence parallel).
//! Layouts the rules refuse are skipped. Mutations are applied to one rank, split out of its
//! class first, so the other members of its groups still run the unmutated graph:
//! - drop a recv, swap two different collectives on one group, grow a collective's size:
//!   caught by the cross-rank matching (`shardwright_ir::matching`);
//! - delete the free of a transient buffer: caught by the graph verifier (`leak`).

use proptest::prelude::*;
use shardwright_cost::{resolve, ResolveOptions};
use shardwright_ir::matching::{refine_classes, verify_program};
use shardwright_ir::verify::{is_transient, verify_graph};
use shardwright_ir::{Graph, NodeId, Op, Program};
use shardwright_planner::{plan, PlanOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::Plan;

#[derive(Debug, Clone)]
struct Case {
    tp: u32,
    pp: u32,
    dp: u32,
    cp: u32,
    ep: u32,
    vpp: u32,
    mb: u32,
    zero: u8,
    recompute: &'static str,
    sp: bool,
    schedule: &'static str,
    moe: bool,
    layers: u32,
    gpn: u32,
}

fn spec_text(c: &Case) -> String {
    let world = c.tp * c.pp * c.dp * c.cp * c.ep;
    let moe = if c.moe {
        "    arch: moe\n    moe: {num_experts: 4, top_k: 2, num_shared_experts: 1, expert_ffn_hidden_size: 256, first_k_dense: 1}\n"
    } else {
        "    arch: dense\n"
    };
    let ga_mb = 2 * c.pp; // micro-batches per step: a multiple of pp (interleaving needs it)
    let global = ga_mb * c.mb * c.dp * c.ep;
    format!(
        "job:
  name: tiny
  model:
    name: tiny
{moe}    num_layers: {layers}
    hidden_size: 256
    num_attention_heads: 8
    num_kv_heads: 4
    ffn_hidden_size: 512
    ffn_activation: swiglu
    vocab_size: 1024
    seq_len: 1024
  parallelism: {{tp: {tp}, pp: {pp}, dp: {dp}, cp: {cp}, ep: {ep}, vpp: {vpp}, micro_batch: {mb}, zero_stage: {zero}, recompute: {rc}, sequence_parallel: {sp}, schedule: {sched}}}
  batch: {{global_batch: {global}}}
cluster:
  gpu: H100-SXM
  gpus_per_node: {gpn}
  num_gpus: {world}
",
        layers = c.layers,
        tp = c.tp,
        pp = c.pp,
        dp = c.dp,
        cp = c.cp,
        ep = c.ep,
        vpp = c.vpp,
        mb = c.mb,
        zero = c.zero,
        rc = c.recompute,
        sp = c.sp,
        sched = c.schedule,
        gpn = c.gpn.min(world).max(1),
    )
}

fn plan_of(c: &Case) -> Option<Plan> {
    let spec = parse_spec(&spec_text(c), Format::Yaml).expect("generated spec parses");
    let r = resolve(&spec, &ResolveOptions::default()).ok()?;
    let p = plan(&r.job, &r.warnings, &PlanOptions::default(), &mut |_, _| {}).ok()?;
    Some(serde_json::from_str(&shardwright_spec::plan::to_json(&p)).expect("plan JSON"))
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            prop::sample::select(vec![1u32, 2]),
            prop::sample::select(vec![1u32, 2, 4]),
            prop::sample::select(vec![1u32, 2]),
            prop::sample::select(vec![1u32, 2]),
            prop::sample::select(vec![1u32, 2]),
            prop::sample::select(vec![1u32, 2]),
            prop::sample::select(vec![1u32, 2]),
        ),
        (
            0u8..4,
            prop::sample::select(vec!["none", "selective", "full"]),
            any::<bool>(),
            prop::sample::select(vec!["gpipe", "1f1b", "interleaved"]),
            any::<bool>(),
            prop::sample::select(vec![4u32, 6, 8]),
            prop::sample::select(vec![2u32, 4, 8]),
        ),
    )
        .prop_map(
            |((tp, pp, dp, cp, ep, vpp, mb), (zero, recompute, sp, schedule, moe, layers, gpn))| {
                let interleaved = schedule == "interleaved" && pp > 1;
                Case {
                    tp,
                    pp,
                    dp,
                    cp,
                    ep: if moe { ep } else { 1 },
                    vpp: if interleaved { vpp } else { 1 },
                    mb,
                    zero,
                    recompute,
                    sp: sp && tp > 1,
                    schedule: if pp == 1 { "1f1b" } else { schedule },
                    moe,
                    layers,
                    gpn,
                }
            },
        )
}

fn errors(p: &Program) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in &p.classes {
        if let Err(e) = verify_graph(&c.graph) {
            out.extend(e.iter().map(|x| x.to_string()));
        }
    }
    if out.is_empty() {
        if let Err(e) = verify_program(p) {
            out.extend(e.iter().map(|x| x.to_string()));
        }
    }
    out
}

/// Remove node `i`, renumbering the later nodes and their deps.
fn remove_node(g: &mut Graph, i: usize) {
    g.nodes.remove(i);
    for (k, n) in g.nodes.iter_mut().enumerate() {
        n.id = NodeId(k as u32);
        n.deps = n
            .deps
            .iter()
            .filter(|d| d.index() != i)
            .map(|d| if d.index() > i { NodeId(d.0 - 1) } else { *d })
            .collect();
    }
}

/// Rank `r` in a class of its own.
fn isolate(p: &Program, r: u32) -> (Program, usize) {
    let q = refine_classes(p, &[r]).into_owned();
    let c = q.class_of[r as usize] as usize;
    assert_eq!(q.classes[c].ranks, vec![r]);
    (q, c)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_plans_lower_verify_and_mutations_are_caught(c in case(), pick in any::<u64>()) {
        let Some(plan) = plan_of(&c) else { return Ok(()); };
        let l = shardwright_lowering::lower(&plan).unwrap();
        let errs = errors(&l.program);
        prop_assert!(errs.is_empty(), "{c:?}: {errs:?}");
        let (_, check_errs) = shardwright_lowering::check::check(&l, &plan);
        let check_errs: Vec<String> = check_errs.iter().map(|e| e.to_string()).collect();
        prop_assert!(check_errs.is_empty(), "{c:?}: {check_errs:?}");

        let world = l.program.world;
        // Every rank's coordinates, recomposed with the mesh convention written out here
        // (tp fastest, then cp, ep, dp, pp), give the rank back; each is in range.
        prop_assert_eq!(l.program.coords.len(), world as usize);
        for (rank, k) in l.program.coords.iter().enumerate() {
            prop_assert!(k.tp < c.tp && k.cp < c.cp && k.ep < c.ep && k.dp < c.dp && k.pp < c.pp);
            let back = k.tp + c.tp * (k.cp + c.cp * (k.ep + c.ep * (k.dp + c.dp * k.pp)));
            prop_assert_eq!(back, rank as u32);
        }
        let r = (pick % world as u64) as u32;
        let (base, ci) = isolate(&l.program, r);
        let g = &base.classes[ci].graph;
        let idx = |f: &dyn Fn(&Op) -> bool| -> Vec<usize> {
            g.nodes.iter().enumerate().filter(|(_, n)| f(&n.op)).map(|(i, _)| i).collect()
        };
        let choose = |v: &[usize], salt: u64| v[((pick >> 8).wrapping_add(salt) % v.len() as u64) as usize];

        // Drop a recv.
        let recvs = idx(&|o| matches!(o, Op::Recv { .. }));
        if !recvs.is_empty() {
            let mut m = base.clone();
            remove_node(&mut m.classes[ci].graph, choose(&recvs, 1));
            prop_assert!(!errors(&m).is_empty(), "{c:?}: dropped recv on rank {r} not caught");
        }
        // Grow a collective by one element per member.
        let colls = idx(&|o| matches!(o, Op::Collective { .. }));
        if !colls.is_empty() {
            let mut m = base.clone();
            let i = choose(&colls, 2);
            let n = {
                let Op::Collective { group, .. } = &g.nodes[i].op else { unreachable!() };
                base.group(*group).ranks.len() as u64
            };
            if let Op::Collective { bytes, dtype, .. } = &mut m.classes[ci].graph.nodes[i].op {
                *bytes += n * dtype.bytes();
            }
            prop_assert!(!errors(&m).is_empty(), "{c:?}: size change on rank {r} not caught");
        }
        // Swap two different collectives of one group (same stream).
        let mut pairs = Vec::new();
        for (a, &i) in colls.iter().enumerate() {
            for &j in &colls[a + 1..] {
                let (x, y) = (&g.nodes[i], &g.nodes[j]);
                if let (Op::Collective { group: g1, .. }, Op::Collective { group: g2, .. }) = (&x.op, &y.op) {
                    if g1 == g2 && x.stream == y.stream && x.op != y.op {
                        pairs.push((i, j));
                        break;
                    }
                }
            }
        }
        if !pairs.is_empty() {
            let (i, j) = pairs[((pick >> 16) % pairs.len() as u64) as usize];
            let mut m = base.clone();
            let gm = &mut m.classes[ci].graph;
            let tmp = gm.nodes[i].op.clone();
            gm.nodes[i].op = gm.nodes[j].op.clone();
            gm.nodes[j].op = tmp;
            prop_assert!(!errors(&m).is_empty(), "{c:?}: swapped collectives n{i}, n{j} on rank {r} not caught");
        }
        // A graph (dense or MoE) names the values of every op but memory events, the
        // checkpoint and torchtitan's op-level replays: the data-parallel stream and the
        // optimizer included.
        {
            for n in &g.nodes {
                let valued = !matches!(&n.op, Op::Alloc { .. } | Op::Free { .. } | Op::Checkpoint { .. });
                if valued {
                    prop_assert!(!n.operands.is_empty() || !n.results.is_empty(),
                        "{c:?}: rank {r}: {} carries no values", shardwright_ir::text::print_node(g, n));
                }
            }
            // A bucket's gradient reduction that leaves out its largest gradient.
            let dp = idx(&|o| matches!(o, Op::Collective { kind: shardwright_ir::CollectiveKind::AllReduce | shardwright_ir::CollectiveKind::ReduceScatter, tensor: None, .. }));
            let dp: Vec<usize> = dp.into_iter().filter(|&i| g.nodes[i].stream == shardwright_ir::Stream::Dp && g.nodes[i].operands.len() > 1).collect();
            if !dp.is_empty() {
                let i = choose(&dp, 7);
                let big = (0..g.nodes[i].operands.len()).max_by_key(|&k| g.values[g.nodes[i].operands[k].index()].elems()).unwrap();
                let mut m = base.clone();
                m.classes[ci].graph.nodes[i].operands.remove(big);
                let e = errors(&m);
                prop_assert!(e.iter().any(|x| x.contains("[value-shape]")), "{c:?}: a gradient left out of n{i} on rank {r} not caught: {e:?}");
            }
            // Every parameter has its slice of the full tensor; one cut from a tensor of
            // twice the rows no longer gives its value.
            prop_assert!(!g.slices.is_empty(), "{c:?}: rank {r} has no slices");
            {
                let k = choose(&(0..g.slices.len()).collect::<Vec<_>>(), 8);
                let mut m = base.clone();
                m.classes[ci].graph.slices[k].full[0] *= 2;
                let e = errors(&m);
                prop_assert!(e.iter().any(|x| x.contains("[slice]")), "{c:?}: a slice of the wrong tensor on rank {r} not caught: {e:?}");
            }
            // Delete a release: its activations are never released.
            let rels = idx(&|o| matches!(o, Op::Release));
            prop_assert!(!rels.is_empty(), "{c:?}: no release");
            let mut m = base.clone();
            remove_node(&mut m.classes[ci].graph, choose(&rels, 4));
            let e = errors(&m);
            prop_assert!(e.iter().any(|x| x.contains("[unreleased]")), "{c:?}: deleted release on rank {r} not caught: {e:?}");
            // A value used after its release.
            let i = choose(&rels, 5);
            let gone = g.nodes[i].operands[0];
            if let Some(j) = (i + 1..g.nodes.len()).find(|&j| !g.nodes[j].operands.is_empty() && !matches!(g.nodes[j].op, Op::Release)) {
                let mut m = base.clone();
                m.classes[ci].graph.nodes[j].operands[0] = gone;
                let e = errors(&m);
                prop_assert!(e.iter().any(|x| x.contains("[use-after-release]")), "{c:?}: use after release on rank {r} not caught: {e:?}");
            }
            // A GEMM reading the wrong operand (another value of another size).
            let gemms = idx(&|o| matches!(o, Op::Gemm { .. }));
            let i = choose(&gemms, 6);
            let want = g.values[g.nodes[i].operands[1].index()].elems();
            if let Some(v) = g.values.iter().find(|v| v.elems() != want && v.kind == shardwright_ir::ValueKind::Param) {
                let mut m = base.clone();
                m.classes[ci].graph.nodes[i].operands[1] = v.id;
                let e = errors(&m);
                prop_assert!(e.iter().any(|x| x.contains("[value-shape]")), "{c:?}: wrong operand on rank {r} not caught: {e:?}");
            }
        }
        // Delete the free of a transient buffer.
        let frees: Vec<usize> = g.nodes.iter().enumerate().filter(|(_, n)| match n.op {
            Op::Free { buffer } => is_transient(g.buffers[buffer.index()].kind),
            _ => false,
        }).map(|(i, _)| i).collect();
        if !frees.is_empty() {
            let mut m = base.clone();
            remove_node(&mut m.classes[ci].graph, choose(&frees, 3));
            let e = errors(&m);
            prop_assert!(e.iter().any(|x| x.contains("[leak]")), "{c:?}: deleted free on rank {r} not caught: {e:?}");
        }
    }
}
