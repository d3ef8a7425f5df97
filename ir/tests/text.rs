//! The canonical text form: golden example, round trips (text and JSON), determinism,
//! error messages, and that parsing arbitrary or mutated text never panics.

mod common;

use common::{any_name, arb_graph, arb_graph_with};
use proptest::prelude::*;
use shardwright_ir::text::{parse, print, print_node, ParseError};
use shardwright_ir::*;

fn example() -> Graph {
    let mut g = Graph::new(0, 16384);
    g.groups.push(ProcessGroup {
        id: GroupId(0),
        axis: Axis::Tp,
        index: 0,
        ranks: (0..8).collect(),
        fabric: Fabric::Nvlink,
    });
    g.groups.push(ProcessGroup {
        id: GroupId(5),
        axis: Axis::DenseDp,
        index: 0,
        ranks: vec![0, 8, 16, 24],
        fabric: Fabric::Network,
    });
    let b0 = g.buffer("stage.weights", BufferKind::Weight, 123456);
    let w = Work {
        flops: 0,
        bytes: 262144,
    };
    let c = Stream::Compute;
    let n0 = g.push(c, Pass::Step, None, None, Op::Alloc { buffer: b0 }, vec![]);
    let n1 = g.push(
        c,
        Pass::Fwd,
        Some(0),
        None,
        Op::Embedding {
            tokens: 8192,
            hidden: 16384,
            vocab: 128256,
            work: w,
        },
        vec![n0],
    );
    let n2 = g.push(
        c,
        Pass::Fwd,
        Some(0),
        Some(0),
        Op::Gemm {
            name: GemmName::fwd(GemmRole::Qkv),
            m: 8192,
            n: 2560,
            k: 16384,
            dtype: DType::Bf16,
            weight: Some(ParamName::layer(0, Role::Qkv)),
            work: Work {
                flops: 687194767360,
                bytes: 123,
            },
        },
        vec![n1],
    );
    let n3 = g.push(
        Stream::Comm,
        Pass::Fwd,
        Some(0),
        Some(0),
        Op::Collective {
            kind: CollectiveKind::AllReduce,
            group: GroupId(0),
            bytes: 33554432,
            dtype: DType::Bf16,
            tensor: None,
            reduce: Default::default(),
        },
        vec![n2],
    );
    let n4 = g.push(
        Stream::P2p,
        Pass::Fwd,
        Some(0),
        None,
        Op::Send {
            peer: 8,
            bytes: 33554432,
            dtype: DType::Bf16,
        },
        vec![n3],
    );
    g.push(
        c,
        Pass::Fwd,
        Some(0),
        Some(0),
        Op::Attention {
            causal: true,
            heads: 16,
            kv_heads: 1,
            seq_q: 2048,
            seq_kv: 8192,
            head_dim: 128,
            batch: 1,
            cp_chunk: Some((0, 4)),
            flash: true,
            work: Work {
                flops: 17,
                bytes: 18,
            },
        },
        vec![n1, n4],
    );
    g
}

const EXAMPLE: &str = "\
; shardwright-ir 1
graph rank=0 world=16384
group g0 tp.0 nvlink ranks=0,1,2,3,4,5,6,7
group g5 dense_dp.0 network ranks=0,8,16,24
buffer b0 weight stage.weights bytes=123456
n0 = alloc b0 @compute step
n1 = embedding tokens=8192 hidden=16384 vocab=128256 flops=0 bytes=262144 @compute fwd mb=0 <- n0
n2 = gemm qkv m=8192 n=2560 k=16384 bf16 weight=L0.qkv flops=687194767360 bytes=123 @compute fwd mb=0 layer=0 <- n1
n3 = collective all_reduce g0 bytes=33554432 bf16 @comm fwd mb=0 layer=0 <- n2
n4 = send peer=8 bytes=33554432 bf16 @p2p fwd mb=0 <- n3
n5 = attention causal heads=16 kv_heads=1 seq_q=2048 seq_kv=8192 head_dim=128 batch=1 cp=0/4 flash flops=17 bytes=18 @compute fwd mb=0 layer=0 <- n1, n4
";

#[test]
fn golden_example() {
    let g = example();
    assert_eq!(print(&g), EXAMPLE);
    assert_eq!(parse(EXAMPLE).unwrap(), g);
    assert_eq!(
        print_node(&g, &g.nodes[3]),
        "n3 = collective all_reduce g0 bytes=33554432 bf16 @comm fwd mb=0 layer=0 <- n2"
    );
    assert_eq!(shardwright_ir::verify::verify_graph(&g), Ok(()));
}

#[test]
fn options_absent_and_flags_off() {
    let mut g = Graph::new(3, 4);
    g.push(
        Stream::Compute,
        Pass::Recompute,
        None,
        None,
        Op::Attention {
            causal: false,
            heads: 1,
            kv_heads: 1,
            seq_q: 1,
            seq_kv: 1,
            head_dim: 1,
            batch: 1,
            cp_chunk: None,
            flash: false,
            work: Work::default(),
        },
        vec![],
    );
    let t = print(&g);
    assert!(t.ends_with(
        "n0 = attention heads=1 kv_heads=1 seq_q=1 seq_kv=1 head_dim=1 batch=1 flops=0 bytes=0 \
         @compute recompute\n"
    ));
    assert_eq!(parse(&t).unwrap(), g);
}

#[test]
fn collective_tensor_and_reduction() {
    let line =
        "n0 = collective all_reduce g0 bytes=32 f32 tensor=loss.max reduce=max @comm fwd mb=1";
    let g = parse(&format!(
        "graph rank=0 world=2\ngroup g0 tp.0 nvlink ranks=0,1\n{line}\n"
    ))
    .unwrap();
    assert_eq!(
        g.nodes[0].op,
        Op::Collective {
            kind: CollectiveKind::AllReduce,
            group: GroupId(0),
            bytes: 32,
            dtype: DType::F32,
            tensor: Some("loss.max".into()),
            reduce: ReduceOp::Max,
        }
    );
    assert_eq!(print_node(&g, &g.nodes[0]), line);
    // Canonical: the default `sum` is never written, so `reduce=sum` is not accepted.
    let e = parse(
        "graph rank=0 world=2\ngroup g0 tp.0 nvlink ranks=0,1\n\
         n0 = collective all_reduce g0 bytes=32 f32 reduce=sum @comm fwd\n",
    )
    .unwrap_err();
    assert!(e.expected.contains("`sum` is the default"), "{e}");
    // Fields in order: the tensor comes before the reduction.
    assert!(parse(
        "graph rank=0 world=2\ngroup g0 tp.0 nvlink ranks=0,1\n\
         n0 = collective all_reduce g0 bytes=32 f32 reduce=max tensor=x @comm fwd\n",
    )
    .is_err());
    // JSON leaves the defaults out.
    let json = serde_json::to_string(&g.nodes[0].op).unwrap();
    assert!(
        json.contains(r#""tensor":"loss.max""#) && json.contains(r#""reduce":"max""#),
        "{json}"
    );
    let plain: Op = serde_json::from_str(
        r#"{"op":"collective","kind":"all_reduce","group":0,"bytes":8,"dtype":"f32"}"#,
    )
    .unwrap();
    assert!(matches!(
        plain,
        Op::Collective {
            tensor: None,
            reduce: ReduceOp::Sum,
            ..
        }
    ));
}

#[test]
fn non_bare_names_are_quoted() {
    let mut g = Graph::new(0, 1);
    g.buffer("two words", BufferKind::Comm, 8);
    g.buffer("", BufferKind::Comm, 8);
    g.buffer("q\"\\\n\u{1}", BufferKind::Comm, 8);
    g.groups.push(ProcessGroup {
        id: GroupId(0),
        axis: Axis::ExpertDp,
        index: 7,
        ranks: vec![],
        fabric: Fabric::Nvlink,
    });
    let t = print(&g);
    assert!(t.contains("buffer b0 comm \"two words\" bytes=8\n"), "{t}");
    assert!(t.contains("buffer b1 comm \"\" bytes=8\n"), "{t}");
    assert!(
        t.contains(r#"buffer b2 comm "q\"\\\n\u{1}" bytes=8"#),
        "{t}"
    );
    assert!(t.contains("group g0 expert_dp.7 nvlink ranks=\n"), "{t}");
    assert_eq!(parse(&t).unwrap(), g);
}

fn err(s: &str) -> ParseError {
    parse(s).unwrap_err()
}

#[test]
fn parse_errors_say_where_and_what() {
    let e = err("");
    assert_eq!(e.expected, "`graph rank=<integer> world=<integer>`");
    assert_eq!(e.found, "end of input");

    let e =
        err("graph rank=0 world=2\nn0 = gemm qkv m=1 x=2 k=3 bf16 flops=6 bytes=0 @compute fwd\n");
    assert_eq!((e.line, e.column), (2, 19));
    assert_eq!(e.found, "`x=2`");
    assert_eq!(e.expected, "`n=<integer>`");
    assert_eq!(
        e.to_string(),
        "line 2, column 19: expected `n=<integer>`, found `x=2`"
    );

    // An unknown mesh axis is an error naming the axes there are, never a default.
    let e = err("graph rank=0 world=2\ngroup g0 tensor.0 nvlink ranks=0,1");
    assert_eq!((e.line, e.column), (2, 10));
    assert!(e.expected.contains("unknown axis \"tensor\""), "{e}");
    assert!(e.expected.contains("dense_dp"), "{e}");

    let e = err("graph rank=0 world=2\nn0 = frobnicate @compute fwd");
    assert_eq!((e.line, e.column), (2, 6));
    assert!(e.expected.starts_with("an op (gemm"), "{e}");

    let e = err("graph rank=0 world=2\nn0 = alloc b0 @compute");
    assert_eq!((e.line, e.column, e.found.as_str()), (2, 23, "end of line"));
    assert!(e.expected.starts_with("a pass"), "{e}");

    let e = err("graph rank=0 world=2\nbuffer b0 comm \"abc bytes=1");
    assert_eq!((e.line, e.column), (2, 16));
    assert_eq!(e.expected, "a closing `\"`");

    let e = err("graph rank=0 world=99999999999");
    assert!(e.expected.contains("out of range"), "{e}");

    let e = err("graph rank=0 world=2\nn0 = free b0 @compute step extra");
    assert_eq!(
        (e.found.as_str(), e.expected.as_str()),
        ("`extra`", "end of line")
    );

    let e = err("graph rank=0 world=2\nn0 = free b0 @compute step <- n1,");
    assert_eq!(e.found, "end of line");

    let e = err("; shardwright-ir 2\ngraph rank=0 world=2");
    assert_eq!(e.line, 1);

    let e = err("graph rank=0 world=2\ngraph rank=0 world=2");
    assert!(e.expected.contains("comes once"), "{e}");

    let e = err("graph rank=0 world=2\nbuffer b0 comm +1 bytes=1");
    assert!(e.expected.starts_with("a buffer name"), "{e}");
}

#[test]
fn comments_blank_lines_and_crlf_are_accepted() {
    let t = print(&example()).replace('\n', "\r\n");
    let t = format!("\n; a comment\n\n{t}\n   \n; end\n");
    assert_eq!(parse(&t).unwrap(), example());
}

/// Mutate `s` at character positions: delete, insert, duplicate or truncate.
fn mutate(s: &str, op: u8, at: usize, len: usize, ins: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let at = at % (chars.len() + 1);
    let end = (at + len).min(chars.len());
    let mut out: Vec<char> = chars[..at].to_vec();
    match op % 4 {
        0 => out.extend(&chars[end..]),
        1 => {
            out.extend(ins.chars());
            out.extend(&chars[at..]);
        }
        2 => {
            out.extend(&chars[at..end]);
            out.extend(&chars[at..]);
        }
        _ => {}
    }
    out.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_any_names(g in arb_graph_with(any_name())) {
        let t = print(&g);
        prop_assert_eq!(parse(&t), Ok(g.clone()), "{}", t);
        for n in &g.nodes {
            let line = format!("{}\n", print_node(&g, n));
            prop_assert!(t.contains(&line));
        }
    }

    #[test]
    fn valid_graphs_round_trip_and_print_deterministically(g in arb_graph()) {
        let t = print(&g);
        prop_assert_eq!(&t, &print(&g.clone()));
        let back = parse(&t).unwrap();
        prop_assert_eq!(&back, &g);
        prop_assert_eq!(print(&back), t);
    }

    #[test]
    fn json_round_trips(g in arb_graph_with(any_name())) {
        let j = serde_json::to_string(&g).unwrap();
        let back: Graph = serde_json::from_str(&j).unwrap();
        prop_assert_eq!(back, g);
    }

    #[test]
    fn parse_never_panics_on_arbitrary_text(s in any::<String>(), t in "[ -~\n]{0,200}") {
        let _ = parse(&s);
        let _ = parse(&t);
        let _ = parse(&format!("graph rank=0 world=2\n{t}"));
    }

    #[test]
    fn parse_never_panics_on_mutated_text(
        g in arb_graph_with(any_name()),
        muts in proptest::collection::vec((any::<u8>(), any::<usize>(), 0usize..8, "[ -~]{0,4}|\\PC{0,2}"), 1..4),
    ) {
        let mut t = print(&g);
        for (op, at, len, ins) in &muts {
            t = mutate(&t, *op, *at, *len, ins);
        }
        if let Err(e) = parse(&t) {
            prop_assert!(e.line >= 1 && e.line <= t.split('\n').count().max(1));
            prop_assert!(e.column >= 1);
        }
    }
}

#[test]
fn bad_escapes_are_errors() {
    for bad in [
        r#""\u{+41}""#,
        r#""\u{}""#,
        r#""\u{110000}""#,
        r#""\u{d800}""#,
        r#""\x""#,
        r#""\u41""#,
    ] {
        let t = format!("graph rank=0 world=1\nbuffer b0 comm {bad} bytes=1");
        let e = parse(&t).unwrap_err();
        assert_eq!((e.line, e.column), (2, 16), "{bad}: {e}");
    }
    let t = "graph rank=0 world=1\nbuffer b0 comm \"\\u{41}\\u{1F600}\" bytes=1";
    assert_eq!(parse(t).unwrap().buffers[0].name, "A\u{1F600}");
}
