//! Point-to-point is eager: a send never waits for its receive (NCCL grouped send/recv,
//! Megatron's batched p2p). Hand-built two-rank programs.

use shardwright_ir::matching::{program_of_ranks, run_timeline, verify_program};
use shardwright_ir::text::parse;
use shardwright_ir::Graph;

fn g(text: &str) -> Graph {
    parse(text).unwrap()
}

#[test]
fn both_ranks_send_first_is_no_deadlock() {
    let r0 = g("graph rank=0 world=2\nn0 = send peer=1 bytes=8 bf16 @p2p fwd\nn1 = recv peer=1 bytes=8 bf16 @p2p fwd\n");
    let r1 = g("graph rank=1 world=2\nn0 = send peer=0 bytes=8 bf16 @p2p fwd\nn1 = recv peer=0 bytes=8 bf16 @p2p fwd\n");
    assert!(verify_program(&program_of_ranks(vec![], vec![r0, r1])).is_ok());
}

#[test]
fn both_ranks_receive_first_deadlocks() {
    let r0 = g("graph rank=0 world=2\nn0 = recv peer=1 bytes=8 bf16 @p2p fwd\nn1 = send peer=1 bytes=8 bf16 @p2p fwd\n");
    let r1 = g("graph rank=1 world=2\nn0 = recv peer=0 bytes=8 bf16 @p2p fwd\nn1 = send peer=0 bytes=8 bf16 @p2p fwd\n");
    let e = verify_program(&program_of_ranks(vec![], vec![r0, r1])).unwrap_err();
    assert!(e.iter().any(|x| x.rule == "deadlock"), "{e:?}");
}

#[test]
fn a_send_releases_its_stream_before_the_receive_is_posted() {
    // Rank 0 sends, then runs a second send; rank 1 computes (3 s) before it receives both.
    let r0 = g("graph rank=0 world=2\nn0 = send peer=1 bytes=8 bf16 @p2p fwd\nn1 = send peer=1 bytes=8 bf16 @p2p fwd\n");
    let r1 = g("graph rank=1 world=2\nn0 = norm tokens=1 width=1 flops=0 bytes=0 @compute fwd\nn1 = recv peer=0 bytes=8 bf16 @p2p fwd <- n0\nn2 = recv peer=0 bytes=8 bf16 @p2p fwd\n");
    let p = program_of_ranks(vec![], vec![r0, r1]);
    let mut dur = |_c: usize, n: &shardwright_ir::Node| match n.op {
        shardwright_ir::Op::Norm { .. } => 3.0,
        _ => 1.0,
    };
    let t = run_timeline(&p, &mut dur);
    assert!(t.blocked.is_empty());
    // Sends finish at 1 and 2 without waiting; the receives start once posted: at 3 and 4.
    assert_eq!(t.classes[0].finish, vec![1.0, 2.0]);
    assert_eq!(t.classes[1].finish, vec![3.0, 4.0, 5.0]);
}
