#!/usr/bin/env bash
# Issue 26's held-out protocol in one line: the profile fitted without the `mbridge` source
# scores mbridge and the held-out files (torchtitan, Blackwell); leave-one-source /
# framework / GPU-kind-out and in-sample figures come from a full calibrate report.
# Nothing in the repository is written (work files under ${HELDOUT_DIR:-/tmp/shardwright-heldout}).
# EXP: SHARDWRIGHT_VALIDATE_EXPERIMENTS for both calibrate and validate (e.g. no_fp8_costs).
# Usage: cargo build --release && EXP= scripts/heldout.sh   (about 3 s)
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/shardwright
[ -x "$B" ] || { echo "heldout: build first (cargo build --release)" >&2; exit 1; }
d="${HELDOUT_DIR:-/tmp/shardwright-heldout}"
mkdir -p "$d"
export SHARDWRIGHT_VALIDATE_EXPERIMENTS="${EXP:-}"
python3 - "$d" <<'PY'
import json, sys
d = sys.argv[1]
runs = json.load(open("data/published-runs.json"))
held = lambda r: r["id"].startswith("mbridge")
json.dump(dict(runs, runs=[r for r in runs["runs"] if not held(r)]), open(f"{d}/train.json", "w"))
json.dump(dict(runs, runs=[r for r in runs["runs"] if held(r)]), open(f"{d}/mbridge.json", "w"))
PY
"$B" calibrate --runs "$d/train.json" -o "$d/train-profile.json" >"$d/calibrate-train.log" 2>&1
score() { # median/p90/max of a runs file under the held-out profile, and its rows' errors
    "$B" validate --runs "$1" --profile "$d/train-profile.json" >"$d/$2.log" 2>&1
    local all rows oom
    all=$(awk '$1 == "all" {printf "%s/%s/%s", $3, $4, $5}' "$d/$2.log")
    # Each row's error, for files of a few rows.
    rows=$(awk '$2 ~ /^[a-z]+[0-9]+$/ && $5 ~ /%$/ {n++; s = s $5 " "} END {if (n <= 6) printf "%s", s; else printf "%d rows", n}' "$d/$2.log")
    oom=$(grep -o "^not fitting ([0-9]*)" "$d/$2.log" | grep -o "[0-9]*")
    echo "$2 $all (${rows% }; OOM ${oom:-?})"
}
line="EXP=[${EXP:-}] $(score "$d/mbridge.json" mbridge) | $(score validate/heldout/torchtitan-runs.json torchtitan) | $(score validate/heldout/blackwell-runs.json blackwell)"
"$B" calibrate -o "$d/full-profile.json" --report "$d/report.json" >"$d/calibrate-full.log" 2>&1
loo=$(python3 - "$d/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
g = lambda x: "%.2f/%.2f" % (x["median_abs_pct"], x["p90_abs_pct"])
print("LOSO", g(r["loso"]), "LOFO", g(r["leave_one_framework_out"]["all"]),
      "LOGO", g(r["leave_one_gpu_kind_out"]["all"]), "in", g(r["in_sample"]))
PY
)
echo "$line | $loo"
