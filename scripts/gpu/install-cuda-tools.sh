#!/usr/bin/env bash
# The CUDA compile tools the kernel check needs (executor/tests/nvrtc_compile.rs), from
# NVIDIA's pip wheels, no GPU and no driver needed:
#   - nvidia-cuda-nvrtc-cu12:   libnvrtc.so.12 (CUDA C++ -> PTX, the compiler the backend
#                               uses at run time);
#   - nvidia-cuda-nvcc-cu12:    ptxas (PTX -> SASS, reports registers and spills);
#   - nvidia-cuda-runtime-cu12: the headers (cuda_bf16.h, cuda_fp16.h), which neither of
#                               the two above ships.
# Installed with `pip install --target` into DEST (default: target/cuda-tools of this
# repository; or the first argument, or $SHARDWRIGHT_CUDA_TOOLS). Idempotent: when DEST
# already holds these exact versions it returns at once. Only this script downloads (PyPI).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-${SHARDWRIGHT_CUDA_TOOLS:-$repo/target/cuda-tools}}"

# Pinned: change all three together (one CUDA release, 12.9).
wheels=(
    "nvidia-cuda-nvrtc-cu12==12.9.86"
    "nvidia-cuda-nvcc-cu12==12.9.86"
    "nvidia-cuda-runtime-cu12==12.9.79"
)
stamp="$dest/.installed"
want="${wheels[*]}"

have_all() {
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && [ -f "$dest/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] \
        && [ -x "$dest/nvidia/cuda_nvcc/bin/ptxas" ] \
        && [ -f "$dest/nvidia/cuda_runtime/include/cuda_bf16.h" ]
}

if have_all; then
    echo "cuda-tools: $want already in $dest"
    exit 0
fi

python="${PYTHON:-python3}"
if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "cuda-tools: $python -m pip is not available; install pip (or set PYTHON)" >&2
    exit 1
fi

# Into a fresh folder beside DEST, then renamed: an interrupted run leaves no half install.
tmp="$dest.partial.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$dest")"
echo "cuda-tools: installing $want into $dest"
"$python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --no-compile \
    --target "$tmp" "${wheels[@]}"
# ptxas keeps its executable bit from the wheel; make sure of it.
chmod +x "$tmp/nvidia/cuda_nvcc/bin/ptxas"
echo "$want" > "$tmp/.installed"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
if ! have_all; then
    echo "cuda-tools: the install in $dest is incomplete" >&2
    exit 1
fi
"$dest/nvidia/cuda_nvcc/bin/ptxas" --version | tail -1
echo "cuda-tools: ready in $dest"
