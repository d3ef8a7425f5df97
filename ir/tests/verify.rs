//! The single-graph verifier: one hand-built violation per rule, error formatting, and
//! properties over random valid graphs.

mod common;

use common::{arb_graph, remove_node};
use proptest::prelude::*;
use shardwright_ir::text::{parse, print};
use shardwright_ir::verify::{is_transient, verify_graph, VerifyError, RULES};
use shardwright_ir::*;

/// A small valid graph touching every op kind, written in the text form.
const BASE: &str = "\
; shardwright-ir 1
graph rank=1 world=16
group g0 tp.0 nvlink ranks=0,1,2,3
group g2 dp.0 network ranks=1,5,9,13
buffer b0 weight L0.weights bytes=1024
buffer b1 activation L0.act bytes=4096
buffer b2 workspace attn.ws bytes=64
n0 = alloc b0 @compute step
n1 = alloc b1 @compute fwd mb=0
n2 = embedding tokens=8 hidden=16 vocab=32 flops=0 bytes=256 @compute fwd mb=0 <- n0, n1
n3 = gemm qkv m=8 n=24 k=16 bf16 weight=L0.qkv flops=6144 bytes=1152 @compute fwd mb=0 layer=0 <- n2
n4 = collective all_gather g0 bytes=64 bf16 @comm fwd mb=0 layer=0 <- n3
n5 = alloc b2 @compute fwd mb=0 layer=0
n6 = attention causal heads=2 kv_heads=1 seq_q=8 seq_kv=8 head_dim=8 batch=1 cp=0/2 flash flops=2048 bytes=512 @compute fwd mb=0 layer=0 <- n4, n5
n7 = free b2 @compute fwd mb=0 layer=0 <- n6
n8 = send peer=5 bytes=16 bf16 @p2p fwd mb=0
n9 = recv peer=5 bytes=16 bf16 @comm bwd mb=0 <- n8
n10 = norm tokens=8 width=16 flops=256 bytes=512 @compute bwd mb=0 layer=0 <- n9
n11 = elementwise residual elems=128 flops=128 bytes=768 @compute bwd mb=0 layer=0 <- n10
n12 = loss tokens=8 vocab=32 flops=1024 bytes=512 @compute fwd mb=0 <- n11
n13 = free b1 @compute bwd mb=0 <- n12
n14 = collective reduce_scatter g2 bytes=1024 f32 @dp step <- n13
n15 = optimizer_step params=64 flops=1024 bytes=2048 @compute step <- n14
n16 = checkpoint every=100 bytes=1024 @io step <- n15
";

fn base() -> Graph {
    parse(BASE).unwrap()
}

/// BASE with one exact substring replaced (it must occur exactly once).
fn edit(from: &str, to: &str) -> Graph {
    assert_eq!(BASE.matches(from).count(), 1, "`{from}` must occur once");
    parse(&BASE.replace(from, to)).unwrap()
}

/// BASE with extra lines appended.
fn append(lines: &str) -> Graph {
    parse(&format!("{BASE}{lines}\n")).unwrap()
}

fn rules(g: &Graph) -> Vec<&'static str> {
    match verify_graph(g) {
        Ok(()) => vec![],
        Err(es) => es.iter().map(|e| e.rule).collect(),
    }
}

#[test]
fn base_is_valid_and_canonical() {
    assert_eq!(verify_graph(&base()), Ok(()));
    assert_eq!(print(&base()), BASE);
}

#[test]
fn every_rule_has_a_test() {
    // Keep in sync with the tests below (and the module doc).
    // The value rules are tested in tests/values.rs, `bucket` in tests/buckets.rs,
    // `slice` in tests/slices.rs, `param-name` in tests/roles.rs.
    assert_eq!(RULES.len(), 33);
}

#[test]
fn node_id() {
    assert_eq!(rules(&edit("n5 = ", "n50 = ")), ["node-id"]);
}

#[test]
fn buffer_id() {
    assert_eq!(rules(&edit("buffer b2", "buffer b7")), ["buffer-id"]);
}

#[test]
fn group_order() {
    let mut g = base();
    g.groups.swap(0, 1);
    assert_eq!(rules(&g), ["group-order"]);
    let mut g = base();
    g.groups.push(g.groups[1].clone());
    assert_eq!(rules(&g), ["group-order"]);
}

#[test]
fn group_ref() {
    assert_eq!(
        rules(&edit("all_gather g0", "all_gather g1")),
        ["group-ref"]
    );
}

#[test]
fn buffer_ref() {
    assert_eq!(rules(&edit("free b2", "free b9")), ["buffer-ref"]);
}

#[test]
fn dep_ref() {
    assert_eq!(rules(&edit("<- n3\n", "<- n99\n")), ["dep-ref"]);
}

#[test]
fn handle_errors_stop_before_semantics() {
    // Also a stream error, but the handle error is all that is reported.
    let g = edit(
        "n4 = collective all_gather g0 bytes=64 bf16 @comm",
        "n4 = collective all_gather g1 bytes=64 bf16 @io",
    );
    assert_eq!(rules(&g), ["group-ref"]);
}

#[test]
fn rank() {
    assert_eq!(rules(&parse("graph rank=2 world=2").unwrap()), ["rank"]);
    assert_eq!(rules(&parse("graph rank=0 world=0").unwrap()), ["rank"]);
}

#[test]
fn name() {
    assert_eq!(rules(&edit("attn.ws", "\"attn ws\"")), ["name"]);
    // A group's axis is an enum: a name outside it does not parse (text.rs tests).
    assert!(parse(&BASE.replace("group g2 dp.0", "group g2 \"d p\".0")).is_err());
}

#[test]
fn unknown_roles_do_not_parse() {
    // A gemm's role and its weight's are enums (`vocab::GemmRole`, `vocab::Role`): an
    // unknown one is a parse error naming it and the known ones, never a default.
    for (from, to, named) in [
        (
            "weight=L0.qkv",
            "weight=L0.qkv_w",
            "unknown parameter role \"qkv_w\"",
        ),
        ("weight=L0.qkv", "weight=\"\"", "unknown parameter role"),
        ("weight=L0.qkv", "weight=qkv", "without its layer"),
        ("gemm qkv", "gemm q_proj", "unknown gemm role \"q_proj\""),
        (
            "gemm qkv",
            "gemm qkv.xgrad",
            "unknown gemm role \"qkv.xgrad\"",
        ),
        ("gemm qkv", "gemm \"q;kv\"", "unknown gemm role"),
    ] {
        let e = parse(&BASE.replace(from, to)).unwrap_err();
        assert_eq!(e.line, 11, "{e}");
        assert!(e.expected.contains(named), "{to}: {e}");
        if named.starts_with("unknown") {
            assert!(e.expected.contains("(one of "), "{to}: {e}");
        }
    }
    assert_eq!(
        rules(&edit("gemm qkv", "gemm k_proj.dgrad")),
        Vec::<&str>::new()
    );
}

#[test]
fn param_name() {
    let g = append("value %0 param bf16[16] L0.attn_norm\nvalue %1 grad f32[16] L0.attn_norm.grad");
    assert_eq!(rules(&g), Vec::<&str>::new());
    for (bad, why) in [
        (
            "value %0 param bf16[16] L0.normal",
            "unknown parameter role \"normal\"",
        ),
        ("value %0 param bf16[16] attn_norm", "without its layer"),
        (
            "value %0 grad f32[16] L0.attn_norm",
            "does not end in `.grad`",
        ),
        (
            "value %0 grad f32[16] L0.attn.grad",
            "unknown parameter role \"attn\"",
        ),
    ] {
        let es = verify_graph(&append(bad)).unwrap_err();
        assert_eq!(es.len(), 1, "{bad}: {es:?}");
        assert_eq!(es[0].rule, "param-name");
        assert!(es[0].message.contains(why), "{bad}: {}", es[0]);
    }
    // Activations and data are named freely.
    assert_eq!(
        rules(&append("value %0 activation bf16[16] L0.whatever")),
        Vec::<&str>::new()
    );
}

#[test]
fn group_ranks() {
    assert_eq!(
        rules(&edit("ranks=1,5,9,13", "ranks=1,9,5,13")),
        ["group-ranks"]
    );
    assert_eq!(
        rules(&edit("ranks=1,5,9,13", "ranks=1,5,9,16")),
        ["group-ranks"]
    );
    assert_eq!(
        rules(&edit("ranks=1,5,9,13", "ranks=1,5,5,13")),
        ["group-ranks"]
    );
}

#[test]
fn dep() {
    // n1 waits for the later n8 (which waits for nothing): out of order but acyclic.
    assert_eq!(
        rules(&edit(
            "n1 = alloc b1 @compute fwd mb=0\n",
            "n1 = alloc b1 @compute fwd mb=0 <- n8\n"
        )),
        ["dep"]
    );
}

#[test]
fn cycle_comes_with_dep() {
    let t = BASE
        .replace(
            "n1 = alloc b1 @compute fwd mb=0\n",
            "n1 = alloc b1 @compute fwd mb=0 <- n8\n",
        )
        .replace("@p2p fwd mb=0\n", "@p2p fwd mb=0 <- n1\n");
    let g = parse(&t).unwrap();
    let mut r = rules(&g);
    r.sort();
    assert_eq!(r, ["cycle", "dep"]);
    // A self-dep is a cycle too.
    let mut r = rules(&edit("<- n15", "<- n16"));
    r.sort();
    assert_eq!(r, ["cycle", "dep"]);
}

#[test]
fn group_member() {
    assert_eq!(
        rules(&edit("ranks=0,1,2,3", "ranks=0,2,3,4")),
        ["group-member"]
    );
}

#[test]
fn peer() {
    assert_eq!(rules(&edit("send peer=5", "send peer=1")), ["peer"]);
    assert_eq!(rules(&edit("recv peer=5", "recv peer=16")), ["peer"]);
}

#[test]
fn stream() {
    assert_eq!(rules(&edit("bf16 @comm fwd", "bf16 @io fwd")), ["stream"]);
    assert_eq!(rules(&edit("bf16 @p2p fwd", "bf16 @dp fwd")), ["stream"]);
    assert_eq!(
        rules(&edit("bytes=1024 @io", "bytes=1024 @compute")),
        ["stream"]
    );
    assert_eq!(
        rules(&edit("n5 = alloc b2 @compute", "n5 = alloc b2 @comm")),
        ["stream"]
    );
    assert_eq!(
        rules(&edit("bytes=2048 @compute", "bytes=2048 @dp")),
        ["stream"]
    );
}

#[test]
fn double_alloc() {
    assert_eq!(
        rules(&append("n17 = alloc b0 @compute step")),
        ["double-alloc"]
    );
}

#[test]
fn free_before_alloc() {
    assert_eq!(
        rules(&append(
            "buffer b3 comm bucket bytes=8\nn17 = free b3 @compute step"
        )),
        ["free-before-alloc"]
    );
}

#[test]
fn double_free() {
    assert_eq!(
        rules(&append("n17 = free b1 @compute step")),
        ["double-free"]
    );
}

#[test]
fn persistent_free() {
    assert_eq!(
        rules(&append("n17 = free b0 @compute step")),
        ["persistent-free"]
    );
}

#[test]
fn leak() {
    let g = append("buffer b3 logits head.logits bytes=8\nn17 = alloc b3 @compute step");
    assert_eq!(rules(&g), ["leak"]);
    assert_eq!(verify_graph(&g).unwrap_err()[0].node, Some(NodeId(17)));
}

#[test]
fn message_size() {
    // 68 is a multiple of bf16 (2) but not of 4 ranks x 2.
    assert_eq!(
        rules(&edit("all_gather g0 bytes=64", "all_gather g0 bytes=68")),
        ["message-size"]
    );
    assert_eq!(
        rules(&edit("send peer=5 bytes=16", "send peer=5 bytes=15")),
        ["message-size"]
    );
    // all_reduce needs only the dtype size.
    assert_eq!(
        rules(&edit("all_gather g0 bytes=64", "all_reduce g0 bytes=68")),
        Vec::<&str>::new()
    );
}

#[test]
fn gemm_flops() {
    assert_eq!(rules(&edit("flops=6144", "flops=6145")), ["gemm-flops"]);
    // Overflowing u64 is not a match either.
    let big = "m=4294967296 n=4294967296 k=2 bf16 weight=L0.qkv flops=0";
    assert_eq!(
        rules(&edit("m=8 n=24 k=16 bf16 weight=L0.qkv flops=6144", big)),
        ["gemm-flops"]
    );
}

#[test]
fn reduce_op() {
    // `max` is a reduction: fine on an all-reduce or reduce-scatter, an error elsewhere.
    assert_eq!(
        rules(&edit(
            "all_gather g0 bytes=64 bf16",
            "all_reduce g0 bytes=64 f32 tensor=loss.max reduce=max"
        )),
        Vec::<&str>::new()
    );
    assert_eq!(
        rules(&edit(
            "reduce_scatter g2 bytes=1024 f32",
            "reduce_scatter g2 bytes=1024 f32 reduce=max"
        )),
        Vec::<&str>::new()
    );
    assert_eq!(
        rules(&edit(
            "all_gather g0 bytes=64 bf16",
            "all_gather g0 bytes=64 bf16 reduce=max"
        )),
        ["reduce-op"]
    );
}

#[test]
fn collective_tensor_name() {
    assert_eq!(
        rules(&edit(
            "all_gather g0 bytes=64 bf16",
            "all_gather g0 bytes=64 bf16 tensor=\"L0 norm\""
        )),
        ["name"]
    );
}

#[test]
fn all_errors_are_reported_in_node_order() {
    let g = parse(
        &BASE
            .replace("send peer=5", "send peer=1")
            .replace("flops=6144", "flops=1")
            .replace("ranks=1,5,9,13", "ranks=1,9,5,13"),
    )
    .unwrap();
    let es = verify_graph(&g).unwrap_err();
    let got: Vec<_> = es.iter().map(|e| (e.node, e.rule)).collect();
    assert_eq!(
        got,
        [
            (None, "group-ranks"),
            (Some(NodeId(3)), "gemm-flops"),
            (Some(NodeId(8)), "peer")
        ]
    );
}

#[test]
fn display() {
    let es = verify_graph(&edit("send peer=5", "send peer=1")).unwrap_err();
    assert_eq!(
        es[0].to_string(),
        "rank 1, n8 [peer]: peer 1 must be another rank below world 16 (this is rank 1)\n    \
         n8 = send peer=1 bytes=16 bf16 @p2p fwd mb=0"
    );
    let e = VerifyError {
        rank: 2,
        node: None,
        rule: "rank",
        message: "m".into(),
        line: None,
    };
    assert_eq!(e.to_string(), "rank 2 [rank]: m");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_valid_graphs_pass(g in arb_graph()) {
        prop_assert_eq!(verify_graph(&g), Ok(()));
    }

    #[test]
    fn deleting_a_transient_free_is_a_leak(g in arb_graph(), pick in any::<usize>()) {
        let frees: Vec<usize> = g.nodes.iter().enumerate().filter_map(|(i, n)| match n.op {
            Op::Free { buffer } if is_transient(g.buffers[buffer.index()].kind) => Some(i),
            _ => None,
        }).collect();
        prop_assume!(!frees.is_empty());
        let mut g = g;
        remove_node(&mut g, frees[pick % frees.len()]);
        let r: Vec<_> = verify_graph(&g).unwrap_err().iter().map(|e| e.rule).collect();
        prop_assert_eq!(r, ["leak"]);
    }

    #[test]
    fn breaking_a_dep_is_caught(g in arb_graph(), pick in any::<usize>(), to in any::<u32>()) {
        prop_assume!(!g.nodes.is_empty());
        let mut g = g;
        let len = g.nodes.len();
        let i = pick % len;
        // Point a dep at this node or a later one (possibly past the end).
        let bad = NodeId(i as u32 + to % (len as u32 - i as u32 + 3));
        let deps = &mut g.nodes[i].deps;
        if deps.is_empty() {
            deps.push(bad);
        } else {
            let j = pick % deps.len();
            deps[j] = bad;
        }
        let es = verify_graph(&g).unwrap_err();
        prop_assert!(es.iter().any(|e| (e.rule == "dep" || e.rule == "dep-ref") && e.node == Some(NodeId(i as u32))), "{:?}", es);
    }
}
