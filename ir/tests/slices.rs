//! The parameter-shard map's tensor-parallel half: each parameter's `slice` of its full
//! tensor. Hand-written graphs of one rank of a two-member tp group, the cut and paste
//! against hand-laid-out tensors, and one violation per check of the `slice` rule.

use proptest::prelude::*;
use shardwright_ir::text::{parse, print};
use shardwright_ir::verify::verify_graph;
use shardwright_ir::*;

/// A GQA layer's QKV (hidden 4; Q 4 wide, K and V 2 each: full 4 x 8, the rank's half
/// 4 x 4), its row-parallel projection (full 4 x 4, the rank's 2 x 4), a norm whole.
const TP2: &str = "\
; shardwright-ir 1
graph rank=1 world=2
group g0 tp.0 nvlink ranks=0,1
value %0 param bf16[4,4] L0.qkv
value %1 grad f32[4,4] L0.qkv.grad
value %2 param bf16[2,4] L0.proj
value %3 grad f32[2,4] L0.proj.grad
value %4 param bf16[4] L0.attn_norm
value %5 grad f32[4] L0.attn_norm.grad
slice %0 full=4x8 cols=tp:4,2,2
slice %2 full=4x4 rows=tp
slice %4 full=1x4 whole
";

fn tp2() -> Graph {
    parse(TP2).unwrap()
}

/// TP2 with one exact substring replaced (it must occur exactly once).
fn edit(from: &str, to: &str) -> Graph {
    assert_eq!(TP2.matches(from).count(), 1, "`{from}` must occur once");
    parse(&TP2.replace(from, to)).unwrap()
}

fn slice_errors(g: &Graph) -> Vec<String> {
    match verify_graph(g) {
        Ok(()) => vec![],
        Err(es) => es
            .iter()
            .map(|e| {
                assert_eq!(e.rule, "slice", "{e}");
                e.to_string()
            })
            .collect(),
    }
}

#[test]
fn a_tp_rank_is_valid_and_canonical() {
    let g = tp2();
    assert_eq!(verify_graph(&g), Ok(()));
    assert_eq!(print(&g), TP2);
    assert_eq!(
        g.slices[0].split,
        Split::Cols {
            axis: Axis::Tp,
            blocks: vec![4, 2, 2]
        }
    );
    assert_eq!(g.slices[1].split, Split::Rows { axis: Axis::Tp });
    assert_eq!(g.slices[2].full, [1, 4]);
    let j = serde_json::to_string(&g).unwrap();
    assert_eq!(serde_json::from_str::<Graph>(&j).unwrap(), g);
}

/// The full QKV numbered `10 r + c`; Megatron's column-parallel layout gives rank 1 the
/// second half of Q's columns (2, 3), of K's (5) and of V's (7), side by side.
#[test]
fn cut_takes_each_blocks_chunk_as_megatron_lays_it_out() {
    let g = tp2();
    let full: Vec<u32> = (0..4)
        .flat_map(|r| (0..8).map(move |c| 10 * r + c))
        .collect();
    let rank1 = g.slices[0].cut(&full, 1, 2);
    assert_eq!(
        rank1,
        [2, 3, 5, 7, 12, 13, 15, 17, 22, 23, 25, 27, 32, 33, 35, 37]
    );
    let rank0 = g.slices[0].cut(&full, 0, 2);
    assert_eq!(&rank0[..4], [0, 1, 4, 6]);
    // Row-parallel: rank 1 holds rows 2 and 3.
    let proj: Vec<u32> = (0..16).collect();
    assert_eq!(g.slices[1].cut(&proj, 1, 2), (8..16).collect::<Vec<_>>());
    // Whole: every rank holds it all.
    assert_eq!(g.slices[2].cut(&[7, 8, 9, 10], 1, 2), [7, 8, 9, 10]);
    // Both parts pasted back give the full tensor.
    let mut back = vec![0; 32];
    g.slices[0].paste(&mut back, &rank0, 0, 2);
    g.slices[0].paste(&mut back, &rank1, 1, 2);
    assert_eq!(back, full);
}

#[test]
fn a_slice_must_cut_its_value() {
    // Rows not a multiple of the group.
    let m = slice_errors(&edit("full=4x4 rows=tp", "full=3x4 rows=tp"));
    assert!(
        m.iter()
            .any(|e| e.contains("3 rows are not a multiple of its 2 tp members")),
        "{m:?}"
    );
    // Blocks that do not sum to the columns, or do not split evenly.
    let m = slice_errors(&edit("cols=tp:4,2,2", "cols=tp:4,2,1"));
    assert!(
        m.iter()
            .any(|e| e.contains("column blocks [4, 2, 1] do not cut 8 columns")),
        "{m:?}"
    );
    let m = slice_errors(&edit("full=4x8 cols=tp:4,2,2", "full=4x8 cols=tp:5,1,2"));
    assert_eq!(m.len(), 1, "{m:?}");
    // A full shape whose part is not the value's.
    let m = slice_errors(&edit("full=4x8", "full=4x10"));
    assert!(
        m.iter()
            .any(|e| e.contains("the value has 16 elements, part of 4x10 over 2 has 20")),
        "{m:?}"
    );
    let m = slice_errors(&edit("full=1x4 whole", "full=2x4 whole"));
    assert_eq!(m.len(), 1, "{m:?}");
}

#[test]
fn every_parameter_has_one_slice_and_only_parameters_do() {
    // A parameter left out.
    let m = slice_errors(&edit("slice %4 full=1x4 whole\n", ""));
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(
        m[0].contains("parameter %4 (`L0.attn_norm`) has no slice"),
        "{m:?}"
    );
    // A gradient sliced instead.
    let m = slice_errors(&edit("slice %4 full=1x4 whole", "slice %5 full=1x4 whole"));
    assert!(
        m.iter()
            .any(|e| e.contains("grad is not a parameter tensor")),
        "{m:?}"
    );
    // Twice.
    let g = parse(&format!("{TP2}slice %4 full=1x4 whole\n")).unwrap();
    assert!(slice_errors(&g).iter().any(|e| e.contains("sliced twice")));
    // An undeclared value is a reference error.
    let g = parse(&format!("{TP2}slice %9 full=1x4 whole\n")).unwrap();
    let es = verify_graph(&g).unwrap_err();
    assert!(es.iter().any(|e| e.rule == "value-ref"), "{es:?}");
    // A graph without slices (hand-built, no shard map) is not held to them.
    let bare = parse(&TP2[..TP2.find("slice").unwrap()]).unwrap();
    assert_eq!(verify_graph(&bare), Ok(()));
}

#[test]
fn malformed_slice_lines_name_what_is_wrong() {
    for (line, says) in [
        ("slice %0 full=4 whole", "ROWSxCOLS"),
        ("slice %0 full=4x8 cols=mp:4,2,2", "an axis"),
        ("slice %0 full=4x8 cols=tp", "AXIS:WIDTH"),
        ("slice %0 full=4x8 rows=tp extra", "extra"),
        ("slice %0 full=4x8", "cols"),
    ] {
        let e = parse(&format!("graph rank=0 world=1\n{line}\n")).unwrap_err();
        assert!(e.to_string().contains(says), "{line}: {e}");
    }
}

fn arb_slice() -> impl Strategy<Value = (Slice, usize)> {
    (
        1u64..5,
        1u64..4,
        prop::collection::vec(1u64..4, 1..4),
        0u8..3,
    )
        .prop_map(|(rows, n, widths, kind)| {
            let blocks: Vec<u64> = widths.iter().map(|w| w * n).collect();
            let cols = blocks.iter().sum();
            let (full, split) = match kind {
                0 => ([rows, cols], Split::Whole),
                1 => ([rows * n, cols], Split::Rows { axis: Axis::Tp }),
                _ => (
                    [rows, cols],
                    Split::Cols {
                        axis: Axis::Tp,
                        blocks,
                    },
                ),
            };
            (
                Slice {
                    param: ValueId(0),
                    full,
                    split,
                },
                n as usize,
            )
        })
}

proptest! {
    /// Every element of the full tensor lands in exactly one part (or, whole, in every
    /// part), and pasting the parts back gives the tensor.
    #[test]
    fn the_parts_tile_the_full_tensor((s, n) in arb_slice()) {
        let len = (s.full[0] * s.full[1]) as usize;
        let full: Vec<usize> = (0..len).collect();
        let mut seen = vec![0usize; len];
        let mut back = vec![usize::MAX; len];
        for i in 0..n {
            let part = s.cut(&full, i, n);
            prop_assert_eq!(part.len() as u64, s.part_elems(n as u64));
            for &x in &part {
                seen[x] += 1;
            }
            s.paste(&mut back, &part, i, n);
        }
        let want = if s.split == Split::Whole { n } else { 1 };
        prop_assert!(seen.iter().all(|&c| c == want), "{:?}", seen);
        prop_assert_eq!(back, full);
    }

    #[test]
    fn slice_lines_round_trip((s, _) in arb_slice()) {
        let mut g = Graph::new(0, 1);
        g.slices.push(s);
        prop_assert_eq!(parse(&print(&g)).unwrap(), g);
    }
}
