//! The data-parallel stream on values: buckets (the parameter-shard map), the gradient
//! reduce-scatter into a ZeRO shard, the clipping statistics, the optimizer and the
//! parameter all-gather, written by hand for one rank of a two-member `dense_dp` group;
//! one violation per rule they are held to.

use shardwright_ir::text::{parse, print};
use shardwright_ir::verify::verify_graph;
use shardwright_ir::*;

/// Two parameters of 3 x 2 = 6 and 2 elements: 8 in all, padded to 8 (two members, four
/// each); a second bucket of 5 elements padded to 6 at ZeRO-1.
const ZERO1: &str = "\
; shardwright-ir 1
graph rank=0 world=2
group g0 dense_dp.0 network ranks=0,1
group g1 world.0 network ranks=0,1
value %0 param bf16[3,2] L0.qkv
value %1 grad f32[3,2] L0.qkv.grad
value %2 param bf16[2] L0.attn_norm
value %3 grad f32[2] L0.attn_norm.grad
value %4 param bf16[4] L0.shard
value %5 grad f32[4] L0.shard.grad
value %6 master f32[4] L0.shard.master
value %7 moment f32[4] L0.shard.exp_avg
value %8 moment f32[4] L0.shard.exp_avg_sq
value %9 param bf16[5] final_norm
value %10 grad f32[5] final_norm.grad
value %11 param bf16[3] ends.shard
value %12 grad f32[3] ends.shard.grad
value %13 master f32[3] ends.shard.master
value %14 moment f32[3] ends.shard.exp_avg
value %15 moment f32[3] ends.shard.exp_avg_sq
value %16 activation f32[2] grad_stats
value %17 activation f32[2] grad_norm
bucket L0 dense_dp padded=8 params=%0,%2 shard=%4,%5,%6,%7,%8
bucket ends dense_dp padded=6 params=%9 shard=%11,%12,%13,%14,%15
n0 = collective reduce_scatter g0 bytes=32 f32 %1, %3 -> %5 @dp step
n1 = collective reduce_scatter g0 bytes=24 f32 %10 -> %12 @dp step
n2 = elementwise sum_squares elems=7 flops=0 bytes=28 %5, %12 -> %16 @compute step <- n0, n1
n3 = collective all_reduce g1 bytes=8 f32 %16 -> %17 @dp step <- n2
n4 = optimizer_step params=7 flops=0 bytes=112 %17, %5, %12 -> %6, %7, %8, %4, %13, %14, %15, %11 @compute step <- n3
n5 = release %16, %17 @compute step <- n4
n6 = collective all_gather g0 bytes=16 bf16 %4 -> %0, %2 @dp step <- n4
n7 = collective all_gather g0 bytes=12 bf16 %11 -> %9 @dp step <- n4
";

fn zero1() -> Graph {
    parse(ZERO1).unwrap()
}

/// ZERO1 with one exact substring replaced (it must occur exactly once).
fn edit(from: &str, to: &str) -> Graph {
    assert_eq!(ZERO1.matches(from).count(), 1, "`{from}` must occur once");
    parse(&ZERO1.replace(from, to)).unwrap()
}

fn rules(g: &Graph) -> Vec<&'static str> {
    match verify_graph(g) {
        Ok(()) => vec![],
        Err(es) => es.iter().map(|e| e.rule).collect(),
    }
}

#[test]
fn a_zero1_step_is_valid_and_canonical() {
    let g = zero1();
    assert_eq!(verify_graph(&g), Ok(()));
    assert_eq!(print(&g), ZERO1);
    assert_eq!(g.buckets.len(), 2);
    assert_eq!(g.buckets[0].params, [ValueId(0), ValueId(2)]);
    assert_eq!(g.buckets[0].axis, Axis::DenseDp);
    assert_eq!(g.buckets[0].shard.unwrap().exp_avg_sq, ValueId(8));
    let j = serde_json::to_string(&g).unwrap();
    assert_eq!(serde_json::from_str::<Graph>(&j).unwrap(), g);
}

#[test]
fn a_zero0_bucket_has_no_shard_and_round_trips() {
    let g = parse(
        "graph rank=0 world=1\nvalue %0 param bf16[3] L0.attn_norm\nbucket L0 dense_dp padded=3 params=%0\n",
    )
    .unwrap();
    assert_eq!(verify_graph(&g), Ok(()));
    assert_eq!(g.buckets[0].shard, None);
    assert_eq!(parse(&print(&g)).unwrap(), g);
    // No parameters at all (a rank with nothing of the kind) prints and parses too.
    let e = parse("graph rank=0 world=1\nbucket ends dense_dp padded=0 params=\n").unwrap();
    assert!(e.buckets[0].params.is_empty());
    assert_eq!(parse(&print(&e)).unwrap(), e);
}

#[test]
fn padding_is_the_next_multiple_of_the_group() {
    let messages = |g: &Graph| -> Vec<String> {
        verify_graph(g)
            .unwrap_err()
            .iter()
            .map(|e| {
                assert_eq!(e.rule, "bucket", "{e}");
                e.to_string()
            })
            .collect()
    };
    // 8 elements over 2 members need no padding; 10 is a whole element per member more
    // (and the shard's values no longer hold the member's share).
    let m = messages(&edit("padded=8 params=%0,%2", "padded=10 params=%0,%2"));
    assert!(m[0].contains("8 elements padded to 10"), "{m:?}");
    assert_eq!(m.len(), 6, "{m:?}");
    // 5 elements over 2 members: 5 is not a multiple of 2.
    let m = messages(&edit("padded=6 params=%9", "padded=5 params=%9"));
    assert!(m[0].contains("5 elements padded to 5"), "{m:?}");
}

#[test]
fn a_bucket_holds_parameters_once_each() {
    assert_eq!(
        rules(&edit("params=%0,%2 shard", "params=%0,%1 shard")),
        ["bucket", "bucket"]
    );
    assert_eq!(
        rules(&edit("params=%9 shard", "params=%9,%0 shard")),
        ["bucket", "bucket"]
    );
}

#[test]
fn a_shard_is_state_of_the_members_share() {
    // The master weights declared as a moment.
    assert_eq!(
        rules(&edit("value %6 master f32[4]", "value %6 moment f32[4]")),
        ["bucket"]
    );
    // A shard of the wrong length is caught by the bucket and by the collectives using it.
    let r = rules(&edit("value %13 master f32[3]", "value %13 master f32[4]"));
    assert_eq!(r, ["bucket"]);
    let r = rules(&edit("value %12 grad f32[3]", "value %12 grad f32[2]"));
    assert!(r.contains(&"bucket") && r.contains(&"value-shape"), "{r:?}");
}

#[test]
fn bucket_values_must_be_declared() {
    assert_eq!(
        rules(&edit(
            "shard=%11,%12,%13,%14,%15",
            "shard=%11,%12,%13,%14,%95"
        )),
        ["value-ref"]
    );
}

#[test]
fn sum_squares_reads_what_it_says_and_writes_a_pair() {
    assert_eq!(
        rules(&edit("sum_squares elems=7", "sum_squares elems=8")),
        ["value-shape"]
    );
    assert_eq!(
        rules(&edit(
            "value %16 activation f32[2]",
            "value %16 activation f32[3]"
        )),
        ["value-shape", "value-shape"]
    );
}

#[test]
fn a_reduce_scatter_must_read_the_whole_bucket() {
    // Dropping the norm's gradient leaves 6 of the message's 8 elements.
    assert_eq!(
        rules(&edit("bytes=32 f32 %1, %3 -> %5", "bytes=32 f32 %1 -> %5")),
        ["value-shape"]
    );
}

#[test]
fn malformed_bucket_lines_are_parse_errors() {
    let e = parse(&ZERO1.replace("shard=%4,%5,%6,%7,%8", "shard=%4,%5,%6,%7")).unwrap_err();
    assert!(e.to_string().contains("five value ids, not 4"), "{e}");
    let e = parse(&ZERO1.replace("bucket L0 dense_dp", "bucket L0 data_parallel")).unwrap_err();
    assert!(e.to_string().contains("an axis"), "{e}");
}
