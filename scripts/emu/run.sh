#!/usr/bin/env bash
# Host emulation of the tensor-core attention kernels (executor/kernels/attention_mma.cu):
# compiles the kernel file with g++ against emu.h (each CUDA thread an OS thread; ldmatrix,
# mma.sync and shuffles emulated with the PTX ISA's fragment layouts) and runs main.cpp's
# shapes against an f64 reference. Checks the kernels' index arithmetic, masking and
# online softmax without a GPU; says nothing about the real instructions' behaviour beyond
# the layouts emu.h encodes. Usage: scripts/emu/run.sh [case index]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
out="${TMPDIR:-/tmp}/shardwright-attn-emu"
mkdir -p "$out"
# The kernel file without its common.cuh include and its inline-PTX helpers (emu.h has
# emulated ones of the same names).
python3 - "$root/executor/kernels/attention_mma.cu" "$out/kernel_emu.inc" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = s.replace('#include "common.cuh"', '')
for name in ("ldsm_x4", "ldsm_x4_t", "mma_bf16", "cp_async16", "cp_async_commit", "cp_async_wait"):
    pat = re.compile(r'(template <int N> )?__device__ __forceinline__ void ' + name + r'\(.*?\n}\n', re.S)
    s, n = pat.subn('', s, count=1)
    assert n == 1, name
open(sys.argv[2], 'w').write(s)
PY
g++ -std=c++20 -O2 -pthread -Wno-unused-parameter -I"$here" -I"$out" "$here/main.cpp" -o "$out/emu"
"$out/emu" "$@"
