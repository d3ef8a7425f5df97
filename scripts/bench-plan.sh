#!/usr/bin/env bash
# Plan speed (issue 25): `shardwright plan` on four rows, a base commit against this tree,
# both release builds timed side by side in one run (rows alternate, so both binaries see
# the same machine load). The base is the commit before the search's pruning by ceilings
# and walk bounds (b55d883); BASE_REV=b8a4374 compares with the commit before the parallel
# search.
#
#   scripts/bench-plan.sh [runs]     (default 11 runs per binary and row; median reported)
#
# Exports $BASE_REV with `git archive` into target/bench-plan/src-$BASE_REV (no worktree)
# and builds it there with its own target dir; this tree builds into $CARGO_TARGET_DIR
# (default target/). Besides the wall time, the CPU time (user + sys) per run is reported:
# on a busy shared machine it is the steadier figure. The 256-GPU and de-pinned DeepSeek-V3
# specs are generated into a temp dir. Uses hyperfine when installed, else a loop taking
# the median. Also checks that both binaries write the same plan bytes for every row.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RUNS=${1:-11}
BASE_REV=${BASE_REV:-b55d883}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$TARGET/bench-plan
BASE_SRC=$WORK/src-$BASE_REV
mkdir -p "$WORK"

# BASE_BIN=path: a release binary of $BASE_REV already built (skips its build).
BASE=${BASE_BIN:-$WORK/target-base/release/shardwright}
if [ -z "${BASE_BIN:-}" ]; then
    if [ ! -d "$BASE_SRC" ]; then
        mkdir -p "$BASE_SRC"
        git archive "$BASE_REV" | tar -x -C "$BASE_SRC"
    fi
    echo "building $BASE_REV (release) ..." >&2
    (cd "$BASE_SRC" && CARGO_TARGET_DIR=$WORK/target-base cargo build --release --locked --quiet --bin shardwright)
fi
echo "building this tree (release) ..." >&2
cargo build --release --locked --quiet --bin shardwright
NEW=$TARGET/release/shardwright

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# The 405B on 256 GPUs instead of 16,384.
sed 's/^\(  num_gpus:\) 16384$/\1 256/' specs/llama3-405b-16k-h100.yaml >"$TMP/llama3-405b-256xh100.yaml"
grep -q '^  num_gpus: 256$' "$TMP/llama3-405b-256xh100.yaml"
# DeepSeek-V3 with its parallelism pins removed.
sed '/^  parallelism:/d' specs/deepseek-v3-2048xh800.yaml >"$TMP/deepseek-v3-2048xh800-unpinned.yaml"
! grep -q 'parallelism' "$TMP/deepseek-v3-2048xh800-unpinned.yaml"

ROWS=(
    "specs/llama3-405b-16k-h100.yaml"
    "specs/llama3-405b-table4-16k-h100.yaml"
    "$TMP/deepseek-v3-2048xh800-unpinned.yaml"
    "$TMP/llama3-405b-256xh100.yaml"
)

candidates() { # candidates searched, from the plan JSON
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["search"]["candidates"])' "$1"
}

median_ms() { # bin spec -> "median wall ms / median CPU ms" over $RUNS runs
    local bin=$1 spec=$2 t=() c=()
    for _ in $(seq "$RUNS"); do
        local s e
        s=$(date +%s%N)
        /usr/bin/time -f '%U %S' -o "$TMP/cpu" "$bin" plan --quiet "$spec" -o /dev/null 2>/dev/null
        e=$(date +%s%N)
        t+=($(((e - s) / 1000)))
        c+=($(awk '{printf "%d", ($1 + $2) * 1e6}' "$TMP/cpu"))
    done
    local med='sort -n | awk '"'"'{a[NR]=$1} END {printf "%.1f", a[int((NR+1)/2)]/1000}'"'"
    printf '%s / %s' "$(printf '%s\n' "${t[@]}" | eval "$med")" "$(printf '%s\n' "${c[@]}" | eval "$med")"
}

hyperfine_ms() { # bin spec -> median wall ms (hyperfine)
    hyperfine -N --warmup 1 --runs "$RUNS" --export-json "$TMP/h.json" "$1 plan --quiet $2 -o /dev/null" >/dev/null
    python3 -c 'import json,sys; print("%.1f" % (json.load(open(sys.argv[1]))["results"][0]["median"]*1e3))' "$TMP/h.json"
}

TIMER=median_ms
[ -n "${HYPERFINE:-}" ] && command -v hyperfine >/dev/null && TIMER=hyperfine_ms
echo "| row | candidates | $BASE_REV wall / CPU (ms) | this tree wall / CPU (ms) | speed-up (wall) | same plan |"
echo "|---|---:|---:|---:|---:|---|"
for spec in "${ROWS[@]}"; do
    "$BASE" plan --quiet "$spec" -o "$TMP/base.json" 2>/dev/null
    "$NEW" plan --quiet "$spec" -o "$TMP/new.json" 2>/dev/null
    same=no
    cmp -s "$TMP/base.json" "$TMP/new.json" && same=yes
    n=$(candidates "$TMP/new.json")
    # Alternate the binaries row by row so both see the same machine load.
    b=$($TIMER "$BASE" "$spec")
    a=$($TIMER "$NEW" "$spec")
    x=$(python3 -c "print('%.1fx' % (${b%% *} / ${a%% *}))")
    echo "| $(basename "$spec" .yaml) | $n | $b | $a | $x | $same |"
done
echo
echo "machine: $(nproc) cores; timer: $TIMER; $RUNS runs per cell; $(date -u +%F)"
