#!/usr/bin/env bash
# Lowering speed (issue 22): `lower`, `verify` and `simulate` of the bundled 405B plan
# (16,384 GPUs) and of DeepSeek-V3 (2,048 GPUs), a base build against this tree, timed side
# by side in one run (each command with this tree, then at once with the base).
#
#   BASE_BIN=path/to/base/shardwright scripts/bench-lower.sh [runs]   (default 7)
#
# Without BASE_BIN only this tree is timed. The plans are made once by this tree's binary
# (the cost model decides them; both binaries read the same plan file). Reports the median
# wall time and the median CPU time (user + sys: the steadier figure on a busy machine).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-7}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release --locked --quiet --bin shardwright
NEW=$TARGET/release/shardwright
BASE=${BASE_BIN:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

median_ms() { # bin args... -> "wall ms / CPU ms" (medians over $RUNS runs)
    local bin=$1
    shift
    local walls=() cpus=()
    for _ in $(seq "$RUNS"); do
        /usr/bin/time -o "$TMP/time" -f '%e %U %S' "$bin" "$@" >/dev/null 2>&1
        read -r e u s <"$TMP/time"
        walls+=("$(python3 -c "print(round($e*1000))")")
        cpus+=("$(python3 -c "print(round(($u+$s)*1000))")")
    done
    local mw mc
    mw=$(printf '%s\n' "${walls[@]}" | sort -n | sed -n "$(((RUNS + 1) / 2))p")
    mc=$(printf '%s\n' "${cpus[@]}" | sort -n | sed -n "$(((RUNS + 1) / 2))p")
    echo "$mw / $mc"
}

printf '| plan | command | this tree wall/CPU ms |%s\n' "${BASE:+ base wall/CPU ms |}"
printf '|---|---|---:|%s\n' "${BASE:+---:|}"
for spec in specs/llama3-405b-16k-h100.yaml specs/deepseek-v3-2048xh800.yaml; do
    name=$(basename "$spec" .yaml)
    plan=$TMP/$name.json
    "$NEW" plan "$spec" -o "$plan" >/dev/null
    for cmd in "lower $plan -o $TMP/x.ir" "verify $plan" "simulate $plan"; do
        # shellcheck disable=SC2086
        new=$(median_ms "$NEW" $cmd)
        base=""
        if [ -n "$BASE" ]; then
            # shellcheck disable=SC2086
            base=" $(median_ms "$BASE" $cmd) |"
        fi
        printf '| %s | %s | %s |%s\n' "$name" "${cmd%% *}" "$new" "$base"
    done
done
