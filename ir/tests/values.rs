//! Values in the IR: nodes name the tensors they read and write. One hand-built violation
//! per value rule, the text form of values, and properties over random valid dataflows
//! and their mutations (wrong operand, wrong shape, use after release).

use proptest::prelude::*;
use shardwright_ir::text::{parse, print};
use shardwright_ir::verify::verify_graph;
use shardwright_ir::*;

/// A tiny forward and loss of one rank of a tp2 pair, written by hand: every value is
/// defined before its use and every activation is released.
const VALUED: &str = "\
; shardwright-ir 1
graph rank=0 world=2
group g0 tp.0 nvlink ranks=0,1
value %0 data f32[8] tokens
value %1 param bf16[32,16] embedding
value %2 activation bf16[8,16] x0
value %3 param bf16[16] L0.attn_norm
value %4 activation bf16[8,16] x1
value %5 param bf16[16,24] L0.qkv
value %6 activation bf16[8,24] L0.qkv.out
value %7 activation bf16[8,24] L0.qkv.sum
value %8 param bf16[24,32] lm_head
value %9 activation f32[8,32] logits
value %10 activation bf16[8,48] L0.qkv.full
n0 = embedding tokens=8 hidden=16 vocab=32 flops=0 bytes=256 %0, %1 -> %2 @compute fwd mb=0
n1 = norm tokens=8 width=16 flops=256 bytes=512 %2, %3 -> %4 @compute fwd mb=0 layer=0 <- n0
n2 = gemm qkv m=8 n=24 k=16 bf16 weight=L0.qkv flops=6144 bytes=1152 %4, %5 -> %6 @compute fwd mb=0 layer=0 <- n1
n3 = collective all_reduce g0 bytes=384 bf16 %6 -> %7 @comm fwd mb=0 layer=0 <- n2
n4 = collective all_gather g0 bytes=768 bf16 %7 -> %10 @comm fwd mb=0 layer=0 <- n3
n5 = gemm lm_head m=8 n=32 k=24 bf16 weight=lm_head flops=12288 bytes=2048 %7, %8 -> %9 @compute fwd mb=0 <- n4
n6 = loss tokens=8 vocab=32 flops=1024 bytes=1024 %9, %0 @compute fwd mb=0 <- n5
n7 = release %2, %4, %6, %7, %9, %10 @compute fwd mb=0 <- n6
";

fn valued() -> Graph {
    parse(VALUED).unwrap()
}

/// VALUED with one exact substring replaced (it must occur exactly once).
fn edit(from: &str, to: &str) -> Graph {
    assert_eq!(VALUED.matches(from).count(), 1, "`{from}` must occur once");
    parse(&VALUED.replace(from, to)).unwrap()
}

fn rules(g: &Graph) -> Vec<&'static str> {
    match verify_graph(g) {
        Ok(()) => vec![],
        Err(es) => es.iter().map(|e| e.rule).collect(),
    }
}

#[test]
fn valued_graph_is_valid_and_canonical() {
    assert_eq!(verify_graph(&valued()), Ok(()));
    assert_eq!(print(&valued()), VALUED);
    let g = valued();
    assert_eq!(g.values[10].shape.as_slice(), [8, 48]);
    assert_eq!(g.nodes[2].operands.as_slice(), [ValueId(4), ValueId(5)]);
    assert_eq!(g.nodes[2].results.as_slice(), [ValueId(6)]);
    // JSON keeps them too.
    let j = serde_json::to_string(&g).unwrap();
    assert_eq!(serde_json::from_str::<Graph>(&j).unwrap(), g);
}

#[test]
fn value_handles() {
    assert_eq!(
        rules(&edit("value %3 param", "value %30 param")),
        ["value-id"]
    );
    assert_eq!(rules(&edit("%4, %5 -> %6", "%4, %55 -> %6")), ["value-ref"]);
}

#[test]
fn use_before_def() {
    // The gemm reads the norm's output before the norm: swap the two definitions' order by
    // reading x1 in the embedding instead.
    assert_eq!(
        rules(&edit("%0, %1 -> %2", "%0, %4 -> %2")),
        ["use-before-def"]
    );
}

#[test]
fn redefinition() {
    // The norm writes x0 again: x1 is then read by the gemm and the release undefined.
    assert_eq!(
        rules(&edit("%2, %3 -> %4", "%2, %3 -> %2")),
        ["redefinition", "use-before-def", "use-before-def"]
    );
    // Data is the step's input: no node defines it (the head gemm writing the token ids:
    // also the wrong size, and the logits it should define are then read undefined).
    assert_eq!(
        rules(&edit("-> %9 @compute", "-> %0 @compute")),
        [
            "redefinition",
            "value-shape",
            "use-before-def",
            "use-before-def"
        ]
    );
}

#[test]
fn use_after_release() {
    let g = parse(&format!(
        "{VALUED}n8 = elementwise scale elems=128 flops=0 bytes=0 %4 -> %4 @compute step\n"
    ))
    .unwrap();
    // Read and written after its release: both.
    assert_eq!(rules(&g), ["use-after-release", "use-after-release"]);
    // Released twice.
    let g = parse(&format!("{VALUED}n8 = release %9 @compute step\n")).unwrap();
    assert_eq!(rules(&g), ["use-after-release"]);
}

#[test]
fn release_state() {
    assert_eq!(
        rules(&edit("release %2, %4", "release %5, %2, %4")),
        ["release-state"]
    );
    assert_eq!(
        rules(&edit(
            "release %2, %4, %6, %7, %9, %10 @",
            "release %2, %4, %6, %7, %9, %10 -> %5 @"
        )),
        ["release-state"]
    );
}

#[test]
fn unreleased() {
    let es = verify_graph(&edit("release %2, %4, %6, %7", "release %2, %6, %7")).unwrap_err();
    assert_eq!(es.len(), 1);
    assert_eq!(es[0].rule, "unreleased");
    assert_eq!(es[0].node, Some(NodeId(1)), "reported where %4 is defined");
    assert!(es[0].message.contains("%4 (`x1`)"), "{}", es[0]);
}

#[test]
fn value_shape() {
    // gemm: [m,k] x [k,n] -> [m,n].
    assert_eq!(
        rules(&edit(
            "value %6 activation bf16[8,24]",
            "value %6 activation bf16[8,25]"
        )),
        ["value-shape", "value-shape"]
    );
    // A wrong operand: the norm's weight where the gemm reads its input.
    assert_eq!(
        rules(&edit("%4, %5 -> %6", "%3, %5 -> %6")),
        ["value-shape"]
    );
    // Collectives: the all-gather's input is one member's share of `bytes`.
    assert_eq!(
        rules(&edit("all_gather g0 bytes=768", "all_gather g0 bytes=384")),
        ["value-shape"]
    );
    // ... and the dtype of what they move.
    assert_eq!(
        rules(&edit(
            "all_reduce g0 bytes=384 bf16",
            "all_reduce g0 bytes=384 f16"
        )),
        ["value-shape"]
    );
    // A loss without its logits.
    assert_eq!(
        rules(&edit("%9, %0 @compute", "%0 @compute")),
        ["value-shape"]
    );
    let es = verify_graph(&edit("%9, %0 @compute", "%0 @compute")).unwrap_err();
    assert!(
        es[0].message.contains("has 8 elements, the op needs 256"),
        "{}",
        es[0]
    );
}

#[test]
fn value_syntax_errors_say_what() {
    let e = parse("graph rank=0 world=1\nvalue %0 activation bf16(8) x").unwrap_err();
    assert!(e.expected.contains("typed shape"), "{e}");
    let e = parse("graph rank=0 world=1\nvalue %0 tensor bf16[8] x").unwrap_err();
    assert!(e.expected.contains("value kind"), "{e}");
    let e = parse("graph rank=0 world=1\nn0 = release %0, @compute step").unwrap_err();
    assert!(e.expected.contains("value id"), "{e}");
}

/// One op of a random dataflow: an elementwise op or a gemm on a weight.
#[derive(Clone, Debug)]
enum Step {
    /// Elementwise over `elems` elements, reading up to two earlier activations.
    Ew { elems: u64, reads: Vec<usize> },
    /// `[1, k] x [k, n]` on a fresh weight, reading an earlier activation as `[1, k]`.
    Gemm { read: usize, n: u64 },
}

fn arb_steps() -> impl Strategy<Value = (u64, Vec<Step>, Vec<usize>)> {
    (
        1u64..64,
        prop::collection::vec(
            prop_oneof![
                (1u64..64, prop::collection::vec(any::<usize>(), 0..3))
                    .prop_map(|(elems, reads)| Step::Ew { elems, reads }),
                (any::<usize>(), 1u64..32).prop_map(|(read, n)| Step::Gemm { read, n }),
            ],
            1..12,
        ),
        prop::collection::vec(any::<usize>(), 12),
    )
}

/// A valid graph from the steps: activation 0 comes from an elementwise op on the data,
/// every step defines one activation, and each activation is released at a random point
/// after its last use.
fn build((first, steps, delay): (u64, Vec<Step>, Vec<usize>)) -> Graph {
    let mut g = Graph::new(0, 1);
    let data = g.value(ValueKind::Data, DType::F32, vec![first], "tokens");
    let mut acts = vec![g.value(ValueKind::Activation, DType::Bf16, vec![first], "a0")];
    let ew = |elems| Op::Elementwise {
        kind: ElementwiseKind::Scale,
        elems,
        work: Work::default(),
    };
    let n = g.push(Stream::Compute, Pass::Fwd, None, None, ew(first), vec![]);
    g.set_values(n, vec![data], vec![acts[0]]);
    let mut last_use = vec![0usize];
    // (node position, values) of the ops; releases are placed afterwards.
    let mut ops: Vec<(Op, Vec<ValueId>, ValueId)> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let name = format!("a{}", i + 1);
        match s {
            Step::Ew { elems, reads } => {
                let reads: Vec<usize> = reads.iter().map(|r| r % acts.len()).collect();
                let out = g.value(ValueKind::Activation, DType::Bf16, vec![*elems], name);
                for &r in &reads {
                    last_use[r] = i + 1;
                }
                ops.push((ew(*elems), reads.iter().map(|&r| acts[r]).collect(), out));
                acts.push(out);
            }
            Step::Gemm { read, n } => {
                let r = read % acts.len();
                let k = g.values[acts[r].index()].elems();
                let w = g.value(
                    ValueKind::Param,
                    DType::Bf16,
                    vec![k, *n],
                    format!("L{i}.fc1"),
                );
                let out = g.value(ValueKind::Activation, DType::Bf16, vec![1, *n], name);
                last_use[r] = i + 1;
                let op = Op::Gemm {
                    name: GemmName::fwd(GemmRole::Fc1),
                    m: 1,
                    n: *n,
                    k,
                    dtype: DType::Bf16,
                    weight: None,
                    work: Work {
                        flops: 2 * n * k,
                        bytes: 0,
                    },
                };
                ops.push((op, vec![acts[r], w], out));
                acts.push(out);
            }
        }
        last_use.push(i + 1);
    }
    // Release each activation after its last use (op index) plus a random delay.
    let total = ops.len();
    let mut releases: Vec<Vec<ValueId>> = vec![Vec::new(); total + 1];
    for (a, &lu) in last_use.iter().enumerate() {
        let at = (lu + delay[a % delay.len()] % 3).min(total);
        releases[at].push(acts[a]);
    }
    let release = |g: &mut Graph, vs: &Vec<ValueId>| {
        if !vs.is_empty() {
            let n = g.push(Stream::Compute, Pass::Fwd, None, None, Op::Release, vec![]);
            g.set_values(n, vs.clone(), vec![]);
        }
    };
    release(&mut g, &releases[0]);
    for (i, (op, operands, out)) in ops.into_iter().enumerate() {
        let n = g.push(Stream::Compute, Pass::Fwd, None, None, op, vec![]);
        g.set_values(n, operands, vec![out]);
        release(&mut g, &releases[i + 1]);
    }
    g
}

fn arb_valued() -> impl Strategy<Value = Graph> {
    arb_steps().prop_map(build)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_dataflows_pass_and_round_trip(g in arb_valued()) {
        prop_assert_eq!(verify_graph(&g), Ok(()));
        prop_assert_eq!(parse(&print(&g)).unwrap(), g);
    }

    /// Wrong shape: resize one activation; its defining node (and any gemm reading it)
    /// no longer agrees with its op.
    #[test]
    fn a_wrong_shape_is_caught(g in arb_valued(), pick in any::<usize>(), grow in 1u64..5) {
        let mut g = g;
        let acts: Vec<usize> = (0..g.values.len())
            .filter(|&v| g.values[v].kind == ValueKind::Activation)
            .collect();
        let v = acts[pick % acts.len()];
        let last = g.values[v].shape.len() - 1;
        g.values[v].shape[last] += grow;
        let es = verify_graph(&g).unwrap_err();
        let def = g.nodes.iter().position(|n| n.results.contains(&ValueId(v as u32))).unwrap();
        prop_assert!(es.iter().any(|e| e.rule == "value-shape" && e.node == Some(NodeId(def as u32))), "{:?}", es);
        prop_assert!(es.iter().all(|e| e.rule == "value-shape"), "{:?}", es);
    }

    /// Use after release: move an activation's release to right after its definition,
    /// before a node that reads it.
    #[test]
    fn a_use_after_release_is_caught(g in arb_valued(), pick in any::<usize>()) {
        let mut g = g;
        // Activations with a reader after their defining node.
        let cands: Vec<(usize, usize)> = g.nodes.iter().enumerate().filter_map(|(d, n)| {
            let v = *n.results.first()?;
            let reader = g.nodes.iter().enumerate().skip(d + 1)
                .find(|(_, m)| !matches!(m.op, Op::Release) && m.operands.contains(&v))?.0;
            Some((v.index(), reader))
        }).collect();
        prop_assume!(!cands.is_empty());
        let (v, reader) = cands[pick % cands.len()];
        let v = ValueId(v as u32);
        for n in &mut g.nodes {
            if matches!(n.op, Op::Release) {
                n.operands.retain(|x| *x != v);
            }
        }
        let def = g.nodes.iter().position(|n| n.results.contains(&v)).unwrap();
        let r = g.push(Stream::Compute, Pass::Fwd, None, None, Op::Release, vec![]);
        g.set_values(r, vec![v], vec![]);
        let node = g.nodes.pop().unwrap();
        g.nodes.insert(def + 1, node);
        for (i, n) in g.nodes.iter_mut().enumerate() {
            n.id = NodeId(i as u32);
        }
        let es = verify_graph(&g).unwrap_err();
        prop_assert!(es.iter().any(|e| e.rule == "use-after-release" && e.node == Some(NodeId(reader as u32 + 1))), "{:?}", es);
    }

    /// Wrong operand: a node reads an activation defined after it.
    #[test]
    fn a_wrong_operand_is_caught(g in arb_valued(), pick in any::<usize>()) {
        let mut g = g;
        let users: Vec<usize> = g.nodes.iter().enumerate()
            .filter(|(i, n)| !n.operands.is_empty() && !matches!(n.op, Op::Release)
                && g.nodes[i + 1..].iter().any(|m| !m.results.is_empty()))
            .map(|(i, _)| i).collect();
        prop_assume!(!users.is_empty());
        let i = users[pick % users.len()];
        let later = g.nodes[i + 1..].iter().find_map(|m| m.results.first().copied()).unwrap();
        g.nodes[i].operands[0] = later;
        let es = verify_graph(&g).unwrap_err();
        prop_assert!(es.iter().any(|e| e.rule == "use-before-def" && e.node == Some(NodeId(i as u32))), "{:?}", es);
    }
}
