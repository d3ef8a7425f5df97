//! NCCL through `cuda::nccl` on a GPU: the bootstrap's unique id (`nccl_unique_id`, the
//! bytes rank 0 hands out over the store) joins a one-rank communicator, and every
//! collective the lowering emits runs on device buffers with the results a one-member group
//! must give (NCCL refuses two ranks of one communicator on one GPU; a multi-GPU machine
//! runs the same code on every rank): sum and average all-reduce, all-gather,
//! reduce-scatter and broadcast, fp32 and bf16, the result written into a buffer poisoned
//! beforehand. Mismatched sizes are errors naming both sizes.
//!
//! Feature `cuda` only. Without a CUDA driver, NCCL or a GPU the test prints
//! `skipped: <reason>` and passes. `scripts/gpu/check.sh` runs it on a GPU machine.
#![cfg(feature = "cuda")]

use shardwright_executor::cuda::device::{
    cuda_include_dir, libraries_present, nccl_unique_id, unavailable, Device,
};
use shardwright_executor::cuda::gemm::{Bf16, F32};
use shardwright_executor::cuda::nccl::{DeviceComm, Reduce};
use shardwright_executor::cuda::{bf16_bits, bf16_value};
use shardwright_executor::rng::Rng;

#[test]
fn one_rank_communicator_runs_every_collective() {
    let name = "one_rank_communicator_runs_every_collective";
    if let Some(why) = unavailable() {
        println!("{name}: skipped: {why}");
        return;
    }
    if !libraries_present().2 {
        println!("{name}: skipped: libnccl is not on the library path");
        return;
    }
    let d = Device::new(0, &cuda_include_dir()).expect("a GPU is present but does not start");
    let id = nccl_unique_id().expect("ncclGetUniqueId");
    let mut comm = DeviceComm::new(&d, &id, 0, 1).expect("a one-rank communicator");
    let mut g = Rng::new(0x9cc1);
    let x = g.vec(1000, 4.0);
    let poison = vec![f32::NAN; 1000];
    let dx = d.upload(&x).unwrap();
    for r in [Reduce::Sum, Reduce::Avg] {
        let mut out = d.upload(&poison).unwrap();
        comm.all_reduce::<F32>(&dx, &mut out, r).unwrap();
        assert_eq!(
            d.download(&out).unwrap(),
            x,
            "all-reduce {r:?} of one member"
        );
        let mut out = d.upload(&poison).unwrap();
        comm.reduce_scatter::<F32>(&dx, &mut out, r).unwrap();
        assert_eq!(
            d.download(&out).unwrap(),
            x,
            "reduce-scatter {r:?} of one member"
        );
    }
    let mut out = d.upload(&poison).unwrap();
    comm.all_gather::<F32>(&dx, &mut out).unwrap();
    assert_eq!(d.download(&out).unwrap(), x, "all-gather of one member");
    let mut b = d.upload(&x).unwrap();
    comm.broadcast::<F32>(&mut b, 0).unwrap();
    assert_eq!(d.download(&b).unwrap(), x, "broadcast from the only member");
    // bf16: the bits survive.
    let xb: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
    let dxb = d.upload(&xb).unwrap();
    let mut outb = d.upload(&vec![0xffffu16; 1000]).unwrap();
    comm.all_reduce::<Bf16>(&dxb, &mut outb, Reduce::Sum)
        .unwrap();
    let back = d.download(&outb).unwrap();
    assert_eq!(back, xb, "bf16 all-reduce of one member");
    assert!(back.iter().all(|&b| bf16_value(b).is_finite()));
    // Sizes that do not fit are named.
    let mut short = d.zeros::<f32>(999).unwrap();
    let e = comm
        .all_reduce::<F32>(&dx, &mut short, Reduce::Sum)
        .unwrap_err();
    assert!(e.contains("1000 elements in, 999 out"), "{e}");
    let e = comm.all_gather::<F32>(&dx, &mut short).unwrap_err();
    assert!(e.contains("needs 1000"), "{e}");
    let e = comm.broadcast::<F32>(&mut short, 1).unwrap_err();
    assert!(e.contains("from rank 1 of 1"), "{e}");
    println!("{name}: NCCL one-rank communicator: every collective returned its input");
}
