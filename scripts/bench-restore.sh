#!/usr/bin/env bash
# Checkpoint restore against torch.load (issue 25), one run on one machine: the checkpoint
# bench (executor/examples/ckpt_bench.rs: 4 ranks x 8 fp32 tensors; restore = read, xxh3
# checksum while reading, parse every rank file; median of 3) and torch.load of the same
# tensors saved by torch.save (scripts/bench_torch_load.py; plain and mmap=True; median of
# 3, and the first plain load alone: fresh memory, as a restarted job's), both from the
# page cache of the same directory, then the ratios.
#
#   scripts/bench-restore.sh [MB ...]   (default 256)
#
# PyTorch comes from scripts/torch-python.sh: $PYTHON, else target/torch-venv (the one
# scripts/bench-executor.sh uses, created on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(256)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PY="$(scripts/torch-python.sh)"
cargo build --release --quiet -p shardwright-executor --example ckpt_bench
DIR=$(mktemp -d "${TMPDIR:-/tmp}/bench-restore.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
printf '%8s %14s %16s %22s %21s %10s %11s\n' state "restore MB/s" "torch.load MB/s" "torch.load first MB/s" "torch.load mmap MB/s" "vs load" "vs first"
for mb in "${sizes[@]}"; do
    sw=$("$TARGET/release/examples/ckpt_bench" "$DIR" "$mb" | awk -v mb="$mb" '$1 == mb && $2 == "MB" {print $5}')
    # The bench's layout: 4 ranks x 8 tensors of mb MiB / 128 each.
    elems=$(( (mb << 20) / 4 / 4 / 8 ))
    "$PY" scripts/bench_torch_load.py "$DIR/torch" 4 8 "$elems" 3 >"$DIR/t.json"
    python3 - "$mb" "$sw" "$DIR/t.json" <<'PY'
import json, sys
mb, sw, t = int(sys.argv[1]), float(sys.argv[2]), json.load(open(sys.argv[3]))
mib = t["bytes"] / 2**20
load, first = mib / t["torch_load_s"], mib / t["torch_load_first_s"]
mmap = mib / t["torch_load_mmap_s"]
print(f"{mb:>5} MB {sw:>14.0f} {load:>16.0f} {first:>22.0f} {mmap:>21.0f} {sw / load:>9.2f}x {sw / first:>10.2f}x   (torch {t['torch']})")
PY
done
