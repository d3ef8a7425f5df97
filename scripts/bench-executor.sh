#!/usr/bin/env bash
# CPU executor throughput next to the data loader's, in one run (issue 9's benchmark):
# trains the bundled tiny-llama-cpu plan (8 ranks: tp2 pp2 dp2) and its 1-rank twin on the
# bundled corpus, then times one loader of the 8-rank layout's shape (prefetch 4 and 0).
# Usage: scripts/bench-executor.sh [STEPS]   (prints a markdown table)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-60}"
cargo build --release --quiet --bin shardwright
cargo build --release --quiet -p shardwright-data --example loader_rate
bin=target/release/shardwright
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
$bin data prepare --input corpus/shakespeare.txt --out "$tmp/data" 2>/dev/null
$bin plan specs/tiny-llama-cpu.yaml -o "$tmp/p8.json" --quiet 2>/dev/null
sed -e 's/^  parallelism:.*/  parallelism: {tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: 2, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}/' \
    -e 's/num_gpus: 8/num_gpus: 1/' specs/tiny-llama-cpu.yaml > "$tmp/p1.yaml"
$bin plan "$tmp/p1.yaml" -o "$tmp/p1.json" --quiet 2>/dev/null
field() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))[sys.argv[2]], 4))" "$1" "$2"; }
echo "| what | tokens/s | note |"
echo "|---|---:|---|"
for r in 8 1; do
  $bin execute "$tmp/p$r.json" --steps "$steps" --data "$tmp/data" --out "$tmp/run$r" --quiet 2>/dev/null
  echo "| execute, $r rank(s), $steps steps | $(field "$tmp/run$r/summary.json" median_tokens_per_s) | loss $(field "$tmp/run$r/summary.json" first_loss) -> $(field "$tmp/run$r/summary.json" last_loss), MFU $(field "$tmp/run$r/summary.json" median_mfu) of the measured GEMM peak |"
done
# One loader of the 8-rank layout (dp 2: micro-batch 2, grad_accum 4, seq 64) needs half
# of the job's tokens/s.
for pf in 4 0; do
  echo "| loader, one dp rank, prefetch $pf | $(target/release/examples/loader_rate "$tmp/data" 64 2 4 $pf) | needs 1/2 of the 8-rank job's rate |"
done

# shardwright vs PyTorch (issue 25): 1 rank, the same tiny-Llama shape and global batch 16
# at micro-batch 1, 4 and 16 on the same thread count; tokens/s, the ratio, peak RSS.
# BENCH_THREADS (default: all cores) threads each; BENCH_BASE=REV adds the binary of an
# older commit (built under target/bench-base) as a third column. PyTorch: the registry's
# wheel in target/torch-venv (created on first use; $PYTHON overrides), run on the CPU.
threads="${BENCH_THREADS:-$(nproc)}"
py="$(scripts/torch-python.sh)"
base=""
if [ -n "${BENCH_BASE:-}" ]; then
  mkdir -p target/bench-base && git archive "$BENCH_BASE" | tar -x -C target/bench-base
  (cd target/bench-base && CARGO_TARGET_DIR="$PWD/target" cargo build --release --locked --quiet --bin shardwright)
  base=target/bench-base/target/release/shardwright
fi
rss() { /usr/bin/time -f '%M' -o "$tmp/rss" "$@" > "$tmp/out" 2>/dev/null; echo "$(( $(tail -1 "$tmp/rss") / 1024 ))"; }
echo
echo "| micro-batch | shardwright tok/s (RSS MiB) | ${base:+base $BENCH_BASE tok/s (RSS MiB) | }PyTorch tok/s (RSS MiB) | shardwright / PyTorch |"
echo "|---:|---:|${base:+---:|}---:|---:|"
for mb in 1 4 16; do
  sed -e "s/^  parallelism:.*/  parallelism: {tp: 1, pp: 1, dp: 1, cp: 1, ep: 1, micro_batch: $mb, zero_stage: 0, recompute: none, sequence_parallel: false, schedule: 1f1b}/" \
      -e 's/num_gpus: 8/num_gpus: 1/' specs/tiny-llama-cpu.yaml > "$tmp/m$mb.yaml"
  $bin plan "$tmp/m$mb.yaml" -o "$tmp/m$mb.json" --quiet 2>/dev/null
  m=$(SHARDWRIGHT_THREADS=$threads rss $bin execute "$tmp/m$mb.json" --steps "$steps" --data "$tmp/data" --out "$tmp/s$mb" --overwrite --quiet)
  s=$(field "$tmp/s$mb/summary.json" median_tokens_per_s)
  bcol=""
  if [ -n "$base" ]; then
    bm=$(rss $base execute "$tmp/m$mb.json" --steps "$steps" --data "$tmp/data" --out "$tmp/b$mb" --overwrite --quiet)
    bcol="$(field "$tmp/b$mb/summary.json" median_tokens_per_s) ($bm) | "
  fi
  tm=$(rss "$py" scripts/bench_torch.py --threads "$threads" --micro-batch "$mb" --steps "$steps")
  t=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['median_tokens_per_s'], 1))" "$tmp/out")
  echo "| $mb | $s ($m) | $bcol$t ($tm) | $(python3 -c "print(round($s / $t, 2))")x |"
done
