#!/usr/bin/env bash
# Everything a session lent a GPU runs, in one call of the device tool, from binaries built
# here (no cargo there): first `scripts/gpu/check.sh` (every GPU test), then the
# measurements, each under its own time limit so one that hangs leaves the rest:
#   1. `shardwright calibrate --device`: bf16 GEMMs through cuBLASLt, the fitted curve and
#      a hardware profile (h-device.json, gemm-table.json);
#   2. scripts/gpu/torch_gemm.py: PyTorch on the same shapes, same GPU (torch-gemm.json);
#   3. scripts/gpu/measure_kernels.py: the cost model's kernel rates (kernels.json),
#      cut off at MEASURE_LIMIT_S (default 150) with what it saved so far.
# Outputs go to $OUT (at most 8 files come back: logs are packed into one archive).
#
# Prepare here:  scripts/gpu/check.sh --build-only
#                cargo build --release --features cuda --bin shardwright
#                mkdir -p target/gpu-session && cp target/release/shardwright target/gpu-session/
#                strip target/gpu-session/shardwright
# Device call:   carry ["target/gpu-check/bin", "target/gpu-session"],
#                command `bash scripts/gpu/session.sh`, timeout_s about 420.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
out="${OUT:-$repo/target/gpu-out}"
mkdir -p "$out"
export OUT="$out" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee "$out/smi.txt"

GPU_CHECK_PREBUILT=1 GPU_CHECK_LIMIT_S="${GPU_CHECK_LIMIT_S:-200}" bash scripts/gpu/check.sh 2>&1 | tail -40
# check.sh leaves LD_LIBRARY_PATH to itself: the shim it made serves the binary below too.
shim="$repo/target/gpu-check/libshim"
export LD_LIBRARY_PATH="$shim:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin="$repo/target/gpu-session/shardwright"
if [ -x "$bin" ]; then
    timeout 120 "$bin" calibrate --device -o "$out/device-profile.json" --table "$out/gemm-table.json" 2>&1 | tee "$out/calibrate.log"
else
    echo "session: $bin missing (see the header)" | tee "$out/calibrate.log"
fi
if [ -f "$out/gemm-table.json" ]; then
    timeout 90 python3 scripts/gpu/torch_gemm.py "$out/torch-gemm.json" "$out/gemm-table.json" 2>&1 | tee "$out/torch-gemm.log"
fi
timeout "${MEASURE_LIMIT_S:-150}" python3 scripts/gpu/measure_kernels.py "$out/kernels.json" >"$out/measure.log" 2>&1
echo "measure_kernels: exit $? ($(grep -c '^\[' "$out/measure.log") sections)"
tar czf "$out/logs.tgz" -C "$out" gpu-logs smi.txt calibrate.log measure.log $(cd "$out" && ls torch-gemm.log 2>/dev/null) && rm -rf "$out/gpu-logs" "$out/smi.txt" "$out/calibrate.log" "$out/measure.log" "$out/torch-gemm.log"
ls -la "$out"
