//! The text form of a whole program (what `lower -o prog.ir` writes and `execute prog.ir`
//! reads): round trips, error positions in a class's graph, and the rank-line rules.

mod common;

use common::{any_name, arb_graph, arb_graph_with};
use proptest::collection::vec;
use proptest::prelude::*;
use shardwright_ir::run::{Activation, ModelInfo, MoeInfo, NormKind, RunInfo};
use shardwright_ir::text::{parse_program, print_program, PROGRAM_HEADER};
use shardwright_ir::*;

fn arb_model() -> impl Strategy<Value = ModelInfo> {
    (
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
        ),
        (any::<u64>(), any::<u64>(), any::<u64>()),
        (
            prop::sample::select(NormKind::ALL.to_vec()),
            prop::sample::select(Activation::ALL.to_vec()),
        ),
        vec(any::<bool>(), 5),
        (prop::option::of(any::<u64>()), any::<u64>()),
        prop::option::of((
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
        )),
    )
        .prop_map(
            |(
                (layers, hidden, heads, kv_heads, head_dim),
                (ffn, vocab, seq),
                (norm, activation),
                f,
                (sliding_window, sink),
                moe,
            )| ModelInfo {
                layers,
                hidden,
                heads,
                kv_heads,
                head_dim,
                ffn,
                vocab,
                seq,
                norm,
                activation,
                learned_positions: f[0],
                tied_embeddings: f[1],
                linear_bias: f[2],
                dropout: f[3],
                causal: f[4],
                sliding_window,
                attention_sink_tokens: sink,
                moe: moe.map(
                    |(experts, top_k, expert_ffn, shared_ffn, first_k_dense)| MoeInfo {
                        experts,
                        top_k,
                        expert_ffn,
                        shared_ffn,
                        first_k_dense,
                    },
                ),
            },
        )
}

fn arb_run() -> impl Strategy<Value = RunInfo> {
    (
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
        ),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<u8>(),
            any::<u128>(),
        ),
        vec(any::<bool>(), 3),
    )
        .prop_map(
            |(
                (tp, cp, ep, dp, pp),
                (micro_batch, grad_accum, global_batch, zero_stage, model_flops),
                f,
            )| RunInfo {
                tp,
                cp,
                ep,
                dp,
                pp,
                micro_batch,
                grad_accum,
                global_batch,
                zero_stage,
                sequence_parallel: f[0],
                op_level_recompute: f[1],
                whole_experts: f[2],
                model_flops,
            },
        )
}

/// A program of 1-3 classes of arbitrary graphs over `world` ranks; with or without
/// model, run and coordinates.
fn arb_program(graphs: BoxedStrategy<Graph>) -> impl Strategy<Value = Program> {
    (
        1u32..12,
        vec(graphs, 1..4),
        prop::option::of(arb_model()),
        prop::option::of(arb_run()),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(world, graphs, model, run, with_coords, seed)| {
            let mut x = seed;
            let mut next = move |n: u32| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % n as u64) as u32
            };
            // Every class graph's groups are program groups too.
            let mut groups: Vec<ProcessGroup> = Vec::new();
            for g in &graphs {
                for pg in &g.groups {
                    if !groups.iter().any(|q| q.id == pg.id) {
                        groups.push(pg.clone());
                    }
                }
            }
            groups.sort_by_key(|g| g.id);
            let nclass = graphs.len() as u32;
            let class_of: Vec<u32> = (0..world).map(|_| next(nclass)).collect();
            let membership = (0..world)
                .map(|_| {
                    groups
                        .iter()
                        .filter(|_| next(2) == 0)
                        .map(|g| g.id)
                        .collect()
                })
                .collect();
            let coords = if with_coords {
                (0..world)
                    .map(|_| Coord::from_array([next(9), next(9), next(9), next(9), next(9)]))
                    .collect()
            } else {
                Vec::new()
            };
            let classes = graphs
                .into_iter()
                .enumerate()
                .map(|(i, graph)| RankClass {
                    ranks: (0..world)
                        .filter(|r| class_of[*r as usize] == i as u32)
                        .collect(),
                    graph,
                })
                .collect();
            Program {
                world,
                groups,
                membership,
                classes,
                class_of,
                coords,
                model,
                run,
            }
        })
}

fn tiny() -> Program {
    let mut g = Graph::new(0, 2);
    g.groups.push(ProcessGroup {
        id: GroupId(0),
        axis: Axis::Tp,
        index: 0,
        ranks: vec![0, 1],
        fabric: Fabric::Nvlink,
    });
    Program {
        world: 2,
        groups: g.groups.clone(),
        membership: vec![vec![GroupId(0)], vec![GroupId(0)]],
        classes: vec![RankClass {
            ranks: vec![0, 1],
            graph: g,
        }],
        class_of: vec![0, 0],
        coords: vec![
            Coord::from_array([0, 0, 0, 0, 0]),
            Coord::from_array([1, 0, 0, 0, 0]),
        ],
        model: None,
        run: None,
    }
}

#[test]
fn a_hand_written_program_reads_as_written() {
    let text = format!(
        "{PROGRAM_HEADER}\nprogram world=2\n\
         model layers=2 hidden=64 heads=4 kv_heads=2 head_dim=16 ffn=176 vocab=512 seq=64 \
         norm=rmsnorm activation=swiglu causal sink_tokens=0\n\
         moe experts=8 top_k=2 expert_ffn=32 shared_ffn=64 first_k_dense=1\n\
         run tp=2 cp=1 ep=1 dp=1 pp=1 micro_batch=2 grad_accum=4 global_batch=8 zero=1 \
         model_flops=123456789012345678901234 sequence_parallel\n\
         group g0 tp.0 nvlink ranks=0,1\n\
         rank 0 class=0 groups=g0 coord=0,0,0,0,0\n\
         rank 1 class=0 groups=g0 coord=1,0,0,0,0\n\
         class 0 ranks=0,1\n; shardwright-ir 1\ngraph rank=0 world=2\n\
         group g0 tp.0 nvlink ranks=0,1\n"
    );
    let p = parse_program(&text).unwrap();
    let mut want = tiny();
    want.model = Some(ModelInfo {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 176,
        vocab: 512,
        seq: 64,
        norm: NormKind::Rmsnorm,
        activation: Activation::Swiglu,
        learned_positions: false,
        tied_embeddings: false,
        linear_bias: false,
        dropout: false,
        causal: true,
        sliding_window: None,
        attention_sink_tokens: 0,
        moe: Some(MoeInfo {
            experts: 8,
            top_k: 2,
            expert_ffn: 32,
            shared_ffn: 64,
            first_k_dense: 1,
        }),
    });
    want.run = Some(RunInfo {
        tp: 2,
        cp: 1,
        ep: 1,
        dp: 1,
        pp: 1,
        micro_batch: 2,
        grad_accum: 4,
        global_batch: 8,
        zero_stage: 1,
        sequence_parallel: true,
        op_level_recompute: false,
        whole_experts: false,
        model_flops: 123456789012345678901234,
    });
    assert_eq!(p, want);
    assert_eq!(print_program(&p), text);
}

#[test]
fn errors_name_the_line_in_the_whole_file() {
    let good = print_program(&tiny());
    // A bad node line inside class 0's graph: its line number counts from the file's top.
    let bad = format!("{good}n0 = frobnicate @compute fwd\n");
    let lines = bad.lines().count();
    let e = parse_program(&bad).unwrap_err();
    assert_eq!(e.line, lines, "{e}");
    // Rank lines in order, coordinates on all or none, a known norm.
    for (from, to, needle) in [
        (
            "rank 1 class",
            "rank 2 class",
            "rank 1 (ranks come in order)",
        ),
        (" coord=1,0,0,0,0", "", "coord=tp,cp,ep,dp,pp"),
        (
            "class 0 ranks",
            "class 1 ranks",
            "class 0 (classes come in order)",
        ),
        ("program world=2", "program world=two", "integer"),
    ] {
        let t = good.replacen(from, to, 1);
        let e = parse_program(&t).unwrap_err().to_string();
        assert!(e.contains(needle), "{from} -> {to}: {e}");
    }
    let e = parse_program(&good.replacen("program world=2\n", "program world=2\nmodel layers=1 hidden=1 heads=1 kv_heads=1 head_dim=1 ffn=1 vocab=1 seq=1 norm=batchnorm activation=swiglu sink_tokens=0\n", 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown norm") && e.contains("line 3"), "{e}");
    let e = parse_program(&good.replacen("; shardwright-program 1", "; shardwright-program 2", 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("version `2`"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// parse(print(p)) == p for arbitrary programs of valid graphs.
    #[test]
    fn program_text_round_trips(p in arb_program(arb_graph().boxed())) {
        let text = print_program(&p);
        prop_assert_eq!(parse_program(&text), Ok(p.clone()));
        // JSON too (the `--format json` form).
        let json = serde_json::to_string(&p).unwrap();
        prop_assert_eq!(serde_json::from_str::<Program>(&json).unwrap(), p);
    }

    /// Names that need quoting survive too.
    #[test]
    fn program_text_round_trips_any_names(p in arb_program(arb_graph_with(any_name()).boxed())) {
        prop_assert_eq!(parse_program(&print_program(&p)), Ok(p));
    }
}
