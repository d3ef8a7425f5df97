#!/usr/bin/env bash
# Everything a session lent a GPU runs, in one call of the device tool, from binaries built
# here (the device machines have no cargo and no network). Steps, in order (STEPS, default
# all of them; each under its own time limit so one that hangs leaves the rest):
#   check      scripts/gpu/check.sh: every GPU test, one JSON report (gpu-report.json);
#   bench      bench/gpu.sh: the 1.1B training step on the CUDA backend beside PyTorch eager
#              and torch.compile (bench-gpu.json; not in the default list: about 4 minutes,
#              run it as STEPS=bench in a call of its own);
#   calibrate  `shardwright calibrate --device`: bf16 GEMMs through cuBLASLt, the fitted
#              curve and a hardware profile (device-profile.json, gemm-table.json), then
#              scripts/gpu/torch_gemm.py: PyTorch on the same shapes (torch-gemm.json);
#   kernels    executor/benches/gpu_kernels.rs (the backend's kernels at the 1.1B step's
#              shapes, then the backend's MLP block of that step in bf16 mode and in fp32
#              mode) and scripts/gpu/torch_kernels.py (PyTorch on the same shapes):
#              kernels.log, torch-kernels.json;
#   mma        the bf16 training tests and the 1.1B bench with its profile with the attention
#              kernels forced to the tensor-core ones (SHARDWRIGHT_CUDA_ATTENTION=mma, the
#              default on sm_80+ since 2026-11-27; `check` runs
#              cuda_train::tensor_core_attention_trains_like_the_scalar_kernels), mma/; not
#              in the default list;
#   race       the multi-rank training tests of cuda_train RACE_REPEATS times (default 4),
#              twice with SHARDWRIGHT_CUDA_SYNC=1, then once under compute-sanitizer's
#              memcheck (race/ in logs.tgz);
#   program    `shardwright lower` then `execute PROG.ir` (no plan) on the CPU and on the GPU,
#              the tiny Llama on one rank and on eight, and the one-rank program as a
#              one-process job on NCCL; losses side by side (program/);
#   measure    scripts/gpu/measure_kernels.py: the cost model's kernel rates (kernel-rates.json),
#              cut off at MEASURE_LIMIT_S (default 150) with what it saved so far;
#   ncu        Nsight Compute on the tensor-core attention kernels of the kernel bench
#              (`--clock-control none`; the first launch of each: forward, dK/dV and dQ at
#              head_dim 64 and 128): throughput, occupancy, shared-memory and warp-stall
#              sections (ncu.csv, ncu.log); not in the default list, never run yet.
# Outputs go to $OUT (at most 8 files come back from the device tool: logs are packed).
#
# Prepare here:  scripts/gpu/session.sh --prepare   (test binaries, the release CLI with
#                `--features cuda` and the kernel bench, stripped, in target/gpu-session)
# Device call:   carry ["target/gpu-check/bin", "target/gpu-session"],
#                command `bash scripts/gpu/session.sh`, timeout_s about 420.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
sess="$repo/target/gpu-session"
if [ "${1:-}" = "--prepare" ]; then
    set -e
    GPU_CHECK_LIMIT_S=1800 scripts/gpu/check.sh --build-only
    cargo build --release --locked --features cuda --bin shardwright
    exe="$(cargo bench -p shardwright-executor --features cuda --locked --bench gpu_kernels --no-run \
        --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)"
    mkdir -p "$sess"
    cp target/release/shardwright "$sess/shardwright"
    cp "$exe" "$sess/gpu_kernels"
    strip "$sess/shardwright" "$sess/gpu_kernels"
    du -sh "$sess" target/gpu-check/bin
    exit 0
fi
steps="${STEPS:-check calibrate kernels measure}"
has() { case " $steps " in *" $1 "*) return 0 ;; esac; return 1; }
out="${OUT:-$repo/target/gpu-out}"
mkdir -p "$out"
export OUT="$out" PYTHONUNBUFFERED=1
logs=(smi.txt)
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee "$out/smi.txt"
if has check; then
    GPU_CHECK_PREBUILT=1 GPU_CHECK_LIMIT_S="${GPU_CHECK_LIMIT_S:-200}" bash scripts/gpu/check.sh 2>&1 | tail -40
    logs+=(gpu-logs)
fi
# The CUDA libraries and headers, found as check.sh finds them.
eval "$(bash scripts/gpu/check.sh --env 2>/dev/null)"
if has bench; then
    BENCH_LIMIT_S="${BENCH_LIMIT_S:-150}" SHARDWRIGHT_BIN="$sess/shardwright" bash bench/gpu.sh 2>&1 | tail -20
    [ -d "$out/bench" ] && (cd "$out" && tar czf bench-runs.tgz bench && rm -rf bench)
fi
if has calibrate; then
    timeout 120 "$sess/shardwright" calibrate --device -o "$out/device-profile.json" \
        --table "$out/gemm-table.json" 2>&1 | tee "$out/calibrate.log"
    logs+=(calibrate.log)
    if [ -f "$out/gemm-table.json" ]; then
        timeout 90 python3 scripts/gpu/torch_gemm.py "$out/torch-gemm.json" "$out/gemm-table.json" 2>&1 | tee "$out/torch-gemm.log"
        logs+=(torch-gemm.log)
    fi
fi
if has kernels; then
    timeout 120 "$sess/gpu_kernels" 2>&1 | tee "$out/kernels.log"
    timeout 120 python3 scripts/gpu/torch_kernels.py "$out/torch-kernels.json" 2>&1 | tee "$out/torch-kernels.log"
    logs+=(torch-kernels.log)
fi
if has measure; then
    timeout "${MEASURE_LIMIT_S:-150}" python3 scripts/gpu/measure_kernels.py "$out/kernel-rates.json" >"$out/measure.log" 2>&1
    echo "measure_kernels: exit $? ($(grep -c '^\[' "$out/measure.log") sections)"
    logs+=(measure.log)
fi
if has ncu; then
    # Where the attention kernels' time goes (the next kernel work: README, CUDA section).
    nc="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
    # The first launch of each tensor-core kernel (invocation numbers count per function).
    timeout "${NCU_LIMIT_S:-150}" "$nc" --clock-control none --kernel-id ::regex:attn_mma_:1 \
        --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --csv --page details "$sess/gpu_kernels" >"$out/ncu.csv" 2>"$out/ncu.log"
    echo "ncu: exit $? ($(wc -l <"$out/ncu.csv") lines)"
    grep -h "Duration\|Compute (SM) Throughput\|Memory Throughput\|Achieved Occupancy\|Registers Per Thread\|Shared Memory Configuration Size\|L1/TEX Hit Rate\|Executed Ipc Active" "$out/ncu.csv" | cut -c1-220 | head -60
    logs+=(ncu.log)
fi
if has mma; then
    # The tensor-core attention kernels (SHARDWRIGHT_CUDA_ATTENTION=mma) in training: the
    # bf16 training tests against the fp32 CPU reference, then the 1.1B bench with them
    # (profile included), beside PyTorch eager. `check` runs their kernel tests.
    bin="$repo/target/gpu-check/bin"
    mkdir -p "$out/mma"
    for t in llama_steps_in_bf16_stay_near_the_cpu_reference gpt_steps_in_bf16_stay_near_the_cpu_reference moe_steps_in_bf16_stay_near_the_cpu_reference; do
        SHARDWRIGHT_CUDA_ATTENTION=mma timeout 120 "$bin/cuda_train" --exact "$t" --nocapture >"$out/mma/$t.log" 2>&1
        echo "mma: $t: exit $?"
        grep -h "bf16:" "$out/mma/$t.log" | head -8
    done
    SHARDWRIGHT_CUDA_ATTENTION=mma OUT="$out/mma" BENCH_PROFILE=1 BENCH_TORCH_VARIANTS=eager \
        BENCH_LIMIT_S="${BENCH_LIMIT_S:-120}" SHARDWRIGHT_BIN="$sess/shardwright" bash bench/gpu.sh 2>&1 | tail -50
    [ -d "$out/mma/bench" ] && (cd "$out/mma" && tar czf bench-runs.tgz bench && rm -rf bench)
    logs+=(mma)
fi
if has race; then
    # Several ranks sharing the GPU in one process (issue 23's open race): the multi-rank
    # training tests again and again (each layout against the CPU reference), then with a
    # wait after every operation, then under compute-sanitizer's memcheck.
    bin="$repo/target/gpu-check/bin"
    r="$out/race"
    mkdir -p "$r"
    for i in $(seq "${RACE_REPEATS:-4}"); do
        for t in tiny_llama_cpu_features_one_by_one moe_steps_on_the_gpu_match_the_cpu_reference llama_steps_on_the_gpu_match_the_cpu_reference; do
            timeout 90 "$bin/cuda_train" --exact "$t" --nocapture --test-threads=1 >"$r/$t.$i.log" 2>&1
            echo "race: $t run $i: exit $? $(grep -c 'worst relative' "$r/$t.$i.log") layouts"
        done
    done
    for i in 1 2; do
        SHARDWRIGHT_CUDA_SYNC=1 timeout 90 "$bin/cuda_train" --exact tiny_llama_cpu_features_one_by_one --nocapture >"$r/sync.$i.log" 2>&1
        echo "race: SHARDWRIGHT_CUDA_SYNC=1 run $i: exit $?"
    done
    grep -h "worst relative\|panicked\|layouts that differ" "$r"/*.log | sort | uniq -c | sort -rn | head -60
    if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
        cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
        timeout "${SANITIZER_LIMIT_S:-100}" "$cs" --tool memcheck --leak-check no --print-limit 20 \
            "$bin/cuda_train" --exact tiny_llama_cpu_features_one_by_one --nocapture >"$r/memcheck.log" 2>&1
        echo "race: memcheck exit $?: $(grep -c 'Invalid\|ERROR' "$r/memcheck.log") error lines"
        tail -5 "$r/memcheck.log"
    fi
    logs+=(race)
fi
if has program; then
    # A lowered program file run by `execute` alone (no spec, no plan), on the CPU and on
    # the GPU, one rank and eight: the losses side by side.
    p="$out/program"
    mkdir -p "$p"
    x="$sess/shardwright"
    sed -e 's/num_gpus: 8/num_gpus: 1/' -e 's/gpus_per_node: 8/gpus_per_node: 1/' \
        -e 's/{tp: 2, pp: 2, dp: 2,/{tp: 1, pp: 1, dp: 1,/' -e 's/zero_stage: 1/zero_stage: 0/' \
        -e 's/sequence_parallel: true/sequence_parallel: false/' specs/tiny-llama-cpu.yaml >"$p/one.yaml"
    for name in one eight; do
        spec="$p/one.yaml"
        [ "$name" = eight ] && spec=specs/tiny-llama-cpu.yaml
        "$x" plan "$spec" -o "$p/$name.json" >/dev/null && "$x" lower "$p/$name.json" -o "$p/$name.ir" >/dev/null
        for be in cpu cuda; do
            timeout 90 "$x" execute "$p/$name.ir" --backend "$be" --steps 5 --quiet \
                >"$p/$name.$be.jsonl" 2>"$p/$name.$be.err"
            echo "program $name on $be: exit $?"
        done
        if [ "$name" = one ]; then
            # The same program as a one-process job (torchrun's variables): NCCL
            # communicators joined per group, the value path's collectives on them.
            RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 timeout 90 \
                "$x" execute "$p/$name.ir" --backend cuda --steps 5 --quiet \
                >"$p/$name.nccl.jsonl" 2>"$p/$name.nccl.err"
            echo "program $name as a one-process job on cuda (NCCL): exit $?"
            python3 - "$p/$name.cpu.jsonl" "$p/$name.nccl.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
b = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
for x, y in zip(a, b):
    print(f"  step {x['step']}: loss cpu {x['loss']} nccl job {y['loss']}")
if len(a) != len(b) or not a:
    print(f"  steps: cpu {len(a)}, nccl job {len(b)}")
PY
        fi
        python3 - "$p/$name.cpu.jsonl" "$p/$name.cuda.jsonl" <<'PY'
import json, sys
def losses(f):
    out = []
    for l in open(f):
        l = l.strip()
        if l.startswith("{"):
            m = json.loads(l)
            out.append((m.get("step"), m.get("loss"), m.get("grad_norm")))
    return out
a, b = losses(sys.argv[1]), losses(sys.argv[2])
for x, y in zip(a, b):
    rel = abs(x[1] - y[1]) / max(abs(x[1]), 1e-30) if x[1] is not None and y[1] is not None else None
    print(f"  step {x[0]}: loss cpu {x[1]} cuda {y[1]} rel {rel}; grad norm cpu {x[2]} cuda {y[2]}")
if len(a) != len(b) or not a:
    print(f"  steps: cpu {len(a)}, cuda {len(b)}")
PY
    done
    rm -f "$p"/*.ir "$p"/*.json
    logs+=(program)
fi
[ -d "$out/gpu-logs" ] && ! has check && rmdir "$out/gpu-logs" 2>/dev/null
(cd "$out" && tar czf logs.tgz "${logs[@]}" && rm -rf "${logs[@]}")
ls -la "$out"
