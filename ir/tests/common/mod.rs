//! Shared by the integration tests: a proptest strategy of arbitrary *valid* graphs
//! (every op kind, random names, options present and absent, deps to earlier nodes, memory
//! events that respect the verifier) and graph surgery helpers.
#![allow(dead_code)]

use proptest::collection::{btree_set, vec};
use proptest::prelude::*;
use shardwright_ir::verify::is_transient;
use shardwright_ir::*;

/// Names the verifier accepts (printed bare).
pub fn bare_name() -> BoxedStrategy<String> {
    "[A-Za-z0-9_.:/-]{1,10}".boxed()
}

/// Any string at all (printed quoted when not bare): for round-trip tests.
pub fn any_name() -> BoxedStrategy<String> {
    prop_oneof![
        bare_name(),
        any::<String>(),
        Just(String::new()),
        "[ -~]{0,8}",
        Just("a\"b\\c\n\t\r \u{0}\u{2028}\u{a0}é".to_string()),
    ]
    .boxed()
}

/// Any GEMM name (role and product).
pub fn gemm_name() -> impl Strategy<Value = GemmName> {
    (
        prop::sample::select(GemmRole::ALL.to_vec()),
        prop::sample::select(GemmPass::ALL.to_vec()),
    )
        .prop_map(|(r, p)| GemmName::new(r, p))
}

/// Any parameter name: a role of the ends, of a layer, or of an expert (global or local).
pub fn param_name() -> impl Strategy<Value = ParamName> {
    (
        prop::sample::select(Role::ALL.to_vec()),
        0u32..100,
        proptest::option::of((any::<bool>(), 0u32..64)),
    )
        .prop_map(|(role, l, e)| {
            if !role.in_layer() {
                ParamName::ends(role)
            } else if let (true, Some((local, i))) = (role.is_expert(), e) {
                ParamName::expert(
                    l,
                    if local {
                        Expert::Local(i)
                    } else {
                        Expert::Global(i)
                    },
                    role,
                )
            } else {
                ParamName::layer(l, role)
            }
        })
}

fn work() -> impl Strategy<Value = Work> {
    (any::<u64>(), any::<u64>()).prop_map(|(flops, bytes)| Work { flops, bytes })
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

/// An op with placeholder handles (`group` is a raw index into the groups, `bytes` of
/// messages a raw unit count, `peer` a raw offset), fixed up by [`build`].
fn raw_op(names: BoxedStrategy<String>) -> impl Strategy<Value = Op> {
    let small = 0u64..1 << 20;
    let tensor_names = names;
    prop_oneof![
        (
            gemm_name(),
            small.clone(),
            small.clone(),
            small.clone(),
            dtype(),
            proptest::option::of(param_name()),
            any::<u64>()
        )
            .prop_map(|(name, m, n, k, dtype, weight, bytes)| Op::Gemm {
                name,
                m,
                n,
                k,
                dtype,
                weight,
                work: Work {
                    flops: 2 * m * n * k,
                    bytes
                },
            }),
        (
            (
                any::<bool>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>()
            ),
            (
                any::<u32>(),
                any::<u32>(),
                proptest::option::of((any::<u32>(), any::<u32>())),
                any::<bool>(),
                work()
            )
        )
            .prop_map(
                |(
                    (causal, heads, kv_heads, seq_q, seq_kv),
                    (head_dim, batch, cp_chunk, flash, work),
                )| {
                    Op::Attention {
                        causal,
                        heads,
                        kv_heads,
                        seq_q,
                        seq_kv,
                        head_dim,
                        batch,
                        cp_chunk,
                        flash,
                        work,
                    }
                }
            ),
        (any::<u64>(), any::<u64>(), work()).prop_map(|(tokens, width, work)| Op::Norm {
            tokens,
            width,
            work
        }),
        (
            prop::sample::select(ElementwiseKind::ALL.to_vec()),
            any::<u64>(),
            work()
        )
            .prop_map(|(kind, elems, work)| Op::Elementwise { kind, elems, work }),
        (any::<u64>(), any::<u64>(), any::<u64>(), work()).prop_map(
            |(tokens, hidden, vocab, work)| Op::Embedding {
                tokens,
                hidden,
                vocab,
                work
            }
        ),
        (any::<u64>(), any::<u64>(), work()).prop_map(|(tokens, vocab, work)| Op::Loss {
            tokens,
            vocab,
            work
        }),
        (any::<u64>(), work()).prop_map(|(params, work)| Op::OptimizerStep { params, work }),
        (
            prop::sample::select(CollectiveKind::ALL.to_vec()),
            0u32..8,
            0u64..1 << 30,
            dtype(),
            proptest::option::of(tensor_names),
            prop::sample::select(ReduceOp::ALL.to_vec())
        )
            .prop_map(|(kind, g, bytes, dtype, tensor, reduce)| Op::Collective {
                kind,
                group: GroupId(g),
                bytes,
                dtype,
                tensor,
                reduce,
            }),
        (any::<u32>(), 0u64..1 << 40, dtype()).prop_map(|(peer, bytes, dtype)| Op::Send {
            peer,
            bytes,
            dtype
        }),
        (any::<u32>(), 0u64..1 << 40, dtype()).prop_map(|(peer, bytes, dtype)| Op::Recv {
            peer,
            bytes,
            dtype
        }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(every_steps, bytes)| Op::Checkpoint { every_steps, bytes }),
    ]
}

type NodeSpec = (Op, bool, Pass, Option<u32>, Option<u32>, Vec<u32>);
type GroupSpec = (u32, Axis, u32, Fabric, std::collections::BTreeSet<u32>);
type BufferSpec = (String, BufferKind, u64, bool, u32, u32);

fn node_spec(names: BoxedStrategy<String>) -> impl Strategy<Value = NodeSpec> {
    (
        raw_op(names),
        any::<bool>(),
        prop::sample::select(Pass::ALL.to_vec()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(any::<u32>()),
        vec(any::<u32>(), 0..4),
    )
}

/// Arbitrary valid graphs (they pass `verify_graph`) with bare names.
pub fn arb_graph() -> impl Strategy<Value = Graph> {
    arb_graph_with(bare_name())
}

/// Arbitrary graphs with names drawn from `names`; valid when the names are bare.
pub fn arb_graph_with(names: BoxedStrategy<String>) -> impl Strategy<Value = Graph> {
    let fabric = prop::sample::select(vec![Fabric::Nvlink, Fabric::Network]);
    (
        2u32..64,
        any::<u32>(),
        vec(
            (
                1u32..4,
                prop::sample::select(Axis::ALL.to_vec()),
                0u32..100,
                fabric,
                btree_set(any::<u32>(), 0..6),
            ),
            1..4,
        ),
        vec(
            (
                names.clone(),
                prop::sample::select(BufferKind::ALL.to_vec()),
                any::<u64>(),
                any::<bool>(),
                any::<u32>(),
                any::<u32>(),
            ),
            0..6,
        ),
        vec(node_spec(names), 0..20),
    )
        .prop_map(|(world, rank, groups, buffers, nodes)| {
            build(world, rank, groups, buffers, nodes)
        })
}

fn build(
    world: u32,
    rank: u32,
    group_specs: Vec<GroupSpec>,
    buffer_specs: Vec<BufferSpec>,
    mut specs: Vec<NodeSpec>,
) -> Graph {
    let rank = rank % world;
    let mut g = Graph::new(rank, world);
    let mut next = 0;
    for (gap, axis, index, fabric, members) in group_specs {
        let id = next + gap - 1;
        next = id + 1;
        let mut ranks: std::collections::BTreeSet<u32> =
            members.into_iter().map(|r| r % world).collect();
        ranks.insert(rank);
        g.groups.push(ProcessGroup {
            id: GroupId(id),
            axis,
            index,
            ranks: ranks.into_iter().collect(),
            fabric,
        });
    }
    for (name, kind, bytes, alloc, pa, pf) in buffer_specs {
        let id = g.buffer(name, kind, bytes);
        if !alloc {
            continue;
        }
        let mem = |op| (op, false, Pass::Step, None, None, vec![pa]);
        let a = pa as usize % (specs.len() + 1);
        specs.insert(a, mem(Op::Alloc { buffer: id }));
        if is_transient(kind) {
            let f = a + 1 + pf as usize % (specs.len() - a);
            specs.insert(f, mem(Op::Free { buffer: id }));
        }
    }
    for (i, (mut op, alt, pass, mb, layer, deps_raw)) in specs.into_iter().enumerate() {
        let stream = match &mut op {
            Op::Collective {
                kind,
                group,
                bytes,
                dtype,
                reduce,
                ..
            } => {
                if !matches!(
                    kind,
                    CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
                ) {
                    *reduce = ReduceOp::Sum;
                }
                let pg = &g.groups[group.index() % g.groups.len()];
                *group = pg.id;
                let shards = match kind {
                    CollectiveKind::AllGather
                    | CollectiveKind::ReduceScatter
                    | CollectiveKind::AllToAll => pg.ranks.len() as u64,
                    _ => 1,
                };
                *bytes *= shards * dtype.bytes();
                if alt {
                    Stream::Dp
                } else {
                    Stream::Comm
                }
            }
            Op::Send { peer, bytes, dtype } | Op::Recv { peer, bytes, dtype } => {
                *peer = (rank + 1 + *peer % (world - 1)) % world;
                *bytes *= dtype.bytes();
                if alt {
                    Stream::Comm
                } else {
                    Stream::P2p
                }
            }
            Op::Checkpoint { .. } => Stream::Io,
            _ => Stream::Compute,
        };
        let mut deps: Vec<NodeId> = if i == 0 {
            Vec::new()
        } else {
            deps_raw.iter().map(|r| NodeId(r % i as u32)).collect()
        };
        deps.sort();
        deps.dedup();
        g.push(stream, pass, mb, layer, op, deps);
    }
    g
}

/// Remove `nodes[idx]`, renumbering the later nodes and dropping deps on it.
pub fn remove_node(g: &mut Graph, idx: usize) {
    g.nodes.remove(idx);
    for (i, n) in g.nodes.iter_mut().enumerate() {
        n.id = NodeId(i as u32);
        n.deps = n
            .deps
            .iter()
            .filter(|d| d.index() != idx)
            .map(|d| if d.index() > idx { NodeId(d.0 - 1) } else { *d })
            .collect();
    }
}
