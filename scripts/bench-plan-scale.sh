#!/usr/bin/env bash
# How plan time scales with the cluster (issue 25): the 405B spec
# (specs/llama3-405b-16k-h100.yaml) planned on 64 to 65,536 GPUs, release build; per row
# the candidates searched, the median wall time and the time per candidate. The search
# scales when the time per candidate does not grow as the GPU count shrinks (fewer GPUs:
# more micro-batches per pipeline, so longer schedule walks per candidate). A row where no
# layout fits (64 GPUs: the plan exits 3) is still timed, with the candidate count from the
# error message.
#
#   scripts/bench-plan-scale.sh [runs]     (default 5 runs per row; median reported)
#
# Set BIN=path to time another build (e.g. an older commit's) on the same rows; set
# BASE_BIN=path as well to time both side by side in one run (a column each).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked --quiet --bin shardwright
    BIN=${CARGO_TARGET_DIR:-target}/release/shardwright
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
median_ms() { # bin spec -> median wall ms over $RUNS runs
    local t=()
    for _ in $(seq "$RUNS"); do
        local s e
        s=$(date +%s%N)
        "$1" plan --quiet "$2" -o /dev/null 2>/dev/null || true
        e=$(date +%s%N)
        t+=($(((e - s) / 1000)))
    done
    printf '%s\n' "${t[@]}" | sort -n | awk '{a[NR]=$1} END {printf "%.1f", a[int((NR+1)/2)]/1000}'
}
if [ -n "${BASE_BIN:-}" ]; then
    echo "| GPUs | candidates | base (ms) | base us/cand | plan (ms, median of $RUNS) | us per candidate |"
    echo "|---:|---:|---:|---:|---:|---:|"
else
    echo "| GPUs | candidates | plan (ms, median of $RUNS) | us per candidate |"
    echo "|---:|---:|---:|---:|"
fi
for n in 64 256 1024 4096 16384 65536; do
    spec="$TMP/405b-$n.yaml"
    sed "s/^\(  num_gpus:\) 16384\$/\1 $n/" specs/llama3-405b-16k-h100.yaml >"$spec"
    grep -q "^  num_gpus: $n\$" "$spec"
    note=""
    if "$BIN" plan --quiet "$spec" -o "$TMP/p.json" 2>"$TMP/err"; then
        c=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["search"]["candidates"])' "$TMP/p.json")
    else
        # No layout fits (exit 3): the search still ran over every candidate, and the
        # error names their count ("no feasible layout among N candidates; ...").
        c=$(sed -n 's/.*no feasible layout among \([0-9]*\) candidates.*/\1/p' "$TMP/err" | head -n 1)
        if [ -z "$c" ]; then
            echo "| $n | - | plan failed: $(head -c 120 "$TMP/err" | tr '\n' ' ') | - |"
            continue
        fi
        note=" (no feasible plan)"
    fi
    base=""
    if [ -n "${BASE_BIN:-}" ]; then
        b=$(median_ms "$BASE_BIN" "$spec")
        base="$b | $(python3 -c "print('%.2f' % ($b * 1000 / $c))") | "
    fi
    ms=$(median_ms "$BIN" "$spec")
    per=$(python3 -c "print('%.2f' % ($ms * 1000 / $c))")
    echo "| $n | $c$note | $base$ms | $per |"
done
echo
echo "machine: $(nproc) cores; $RUNS runs per row; $(date -u +%F); $("$BIN" --version 2>/dev/null || true)"
