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
#   measure    scripts/gpu/measure_kernels.py: the cost model's kernel rates (kernel-rates.json),
#              cut off at MEASURE_LIMIT_S (default 150) with what it saved so far.
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
[ -d "$out/gpu-logs" ] && ! has check && rmdir "$out/gpu-logs" 2>/dev/null
(cd "$out" && tar czf logs.tgz "${logs[@]}" && rm -rf "${logs[@]}")
ls -la "$out"
