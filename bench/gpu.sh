#!/usr/bin/env bash
# Issue 23's GPU bench: training steps of bench/llama-1.1b-1xh100.yaml (a ~1.1B Llama,
# sequence 2048, micro-batch 8, one GPU) on shardwright's CUDA backend and, in the same run
# on the same GPU, PyTorch eager and torch.compile on the same shape and batch
# (scripts/bench_torch.py: bf16 autocast, fp32 master weights and AdamW state). Prints a
# table (tokens/s, MFU, peak memory, loss) with the plan's predicted step time and memory
# beside the measured ones, and writes $OUT/bench-gpu.json.
#
# MFU counts the same model FLOPs for both (the plan's `model_flops_per_token`) against
# the device's dense bf16 peak (what `shardwright execute --backend cuda` reports). Peak
# memory is the most `nvidia-smi` saw in use on the GPU while each ran (sampled every
# 200 ms, the CUDA context included, the same way for both); PyTorch's own allocator peak
# is in the JSON too.
#
# On the device (no cargo there): build here first with `scripts/gpu/session.sh --prepare`
# (it leaves the CUDA CLI in target/gpu-session), carry target/gpu-session, run
# `bash bench/gpu.sh` (or `STEPS=bench bash scripts/gpu/session.sh`). Under 5 minutes.
# Here, without a GPU: `BENCH_CPU=1 bash bench/gpu.sh` runs the same flow on a tiny
# one-rank shape on the CPU backend and PyTorch on the CPU (PYTHON names an interpreter
# with torch), to check the plumbing.
#
# Environment: OUT (default target/gpu-out), SHARDWRIGHT_BIN, PYTHON (default python3),
# BENCH_STEPS (timed shardwright steps, default 8; the first is warm-up), BENCH_TORCH_STEPS
# (default 8), BENCH_LIMIT_S (per run, default 150), BENCH_PROFILE=1 (then a 3-step
# `execute --profile` run after the timed one prints where the step's time goes),
# BENCH_TORCH_VARIANTS (default "eager compile").
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
out="${OUT:-$repo/target/gpu-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
steps="${BENCH_STEPS:-8}"
tsteps="${BENCH_TORCH_STEPS:-8}"
limit="${BENCH_LIMIT_S:-150}"
bin="${SHARDWRIGHT_BIN:-}"
if [ -z "$bin" ]; then
    for b in target/gpu-session/shardwright target/release/shardwright; do
        [ -x "$b" ] && bin="$b" && break
    done
fi
[ -n "$bin" ] || { echo "bench/gpu.sh: no shardwright binary (scripts/gpu/session.sh --prepare, or SHARDWRIGHT_BIN)" >&2; exit 2; }
work="$out/bench"
rm -rf "$work"
mkdir -p "$work"

if [ "${BENCH_CPU:-0}" = 1 ]; then
    backend=cpu device=cpu
    # The bench's spec at a shape the CPU trains in seconds (one rank, the same layout).
    sed -e 's/num_layers: 22/num_layers: 2/' -e 's/hidden_size: 2048/hidden_size: 64/' \
        -e 's/num_attention_heads: 32/num_attention_heads: 4/' -e 's/num_kv_heads: 4/num_kv_heads: 2/' \
        -e 's/ffn_hidden_size: 5632/ffn_hidden_size: 176/' -e 's/vocab_size: 32000/vocab_size: 512/' \
        -e 's/seq_len: 2048/seq_len: 64/' bench/llama-1.1b-1xh100.yaml >"$work/spec.yaml"
else
    backend=cuda device=cuda
    # bf16 compute, fp32 master weights and moments (the backend's bf16 mode), as PyTorch runs.
    export SHARDWRIGHT_CUDA_PRECISION="${SHARDWRIGHT_CUDA_PRECISION:-bf16}"
    cp bench/llama-1.1b-1xh100.yaml "$work/spec.yaml"
    command -v nvidia-smi >/dev/null || { echo "bench/gpu.sh: no nvidia-smi: no GPU here (BENCH_CPU=1 runs the CPU dry run)" >&2; exit 2; }
    # The CUDA libraries, found as check.sh finds them.
    eval "$(bash scripts/gpu/check.sh --env 2>/dev/null)" || true
fi

"$bin" plan "$work/spec.yaml" -o "$work/plan.json" >"$work/plan.log" 2>&1 || { cat "$work/plan.log"; exit 1; }

# The most memory nvidia-smi sees in use on GPU 0 while `$@` runs, in MiB (0 on the CPU).
sample_start() {
    if [ "$device" = cuda ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 200 >"$work/$1.mem" 2>/dev/null &
        echo $! >"$work/$1.mem.pid"
    fi
}
sample_stop() {
    if [ -f "$work/$1.mem.pid" ]; then
        kill "$(cat "$work/$1.mem.pid")" 2>/dev/null
        wait "$(cat "$work/$1.mem.pid")" 2>/dev/null
    fi
}

shape="$("$py" - "$work/plan.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
m = p["inputs"]["model"]
l = p["layout"]
print(f'--layers {m["num_layers"]} --hidden {m["hidden_size"]} --heads {m["num_attention_heads"]} '
      f'--kv-heads {m["num_kv_heads"]} --ffn {m["ffn_hidden_size"]} --vocab {m["vocab_size"]} '
      f'--seq {m["seq_len"]} --micro-batch {l["micro_batch"]} '
      f'--global-batch {l["micro_batch"] * l["grad_accum"] * l["dp"]} '
      f'--flops-per-token {p["estimate"]["model_flops_per_token"]}')
EOF
)" || exit 1

echo "== shardwright execute --backend $backend ($steps steps)"
sample_start shardwright
timeout "$limit" "$bin" execute "$work/plan.json" --backend "$backend" --steps "$steps" \
    --quiet --out "$work/run" >"$work/shardwright.log" 2>&1
sw_rc=$?
sample_stop shardwright
tail -3 "$work/shardwright.log"
if [ "${BENCH_PROFILE:-0}" = 1 ]; then
    # Where the step's time goes: `execute --profile` (the device synchronized after every
    # node, so this run is a little slower than the timed one above).
    echo "== shardwright execute --backend $backend --profile (3 steps)"
    timeout "$limit" "$bin" execute "$work/plan.json" --backend "$backend" --steps 3 \
        --quiet --profile >/dev/null 2>"$work/shardwright-profile.log"
    echo "exit $?"
    sed -n '/^profile of rank/,/between nodes/p' "$work/shardwright-profile.log" | head -70
fi
peak_flops="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["peak_flops"])' "$work/run/summary.json" 2>/dev/null || echo 0)"

torch_rc=()
for variant in ${BENCH_TORCH_VARIANTS:-eager compile}; do
    flag=""
    [ "$variant" = compile ] && flag="--compile"
    echo "== PyTorch $variant ($tsteps steps)"
    sample_start "torch-$variant"
    # shellcheck disable=SC2086
    timeout "$limit" "$py" scripts/bench_torch.py --threads "$(nproc)" --device "$device" $flag \
        --steps "$tsteps" --warmup 3 --peak-flops "$peak_flops" $shape \
        >"$work/torch-$variant.json" 2>"$work/torch-$variant.log"
    torch_rc+=("$?")
    sample_stop "torch-$variant"
    tail -2 "$work/torch-$variant.log"
done

# A variant left out of BENCH_TORCH_VARIANTS reports "no result; exit -1".
while [ "${#torch_rc[@]}" -lt 2 ]; do torch_rc+=(-1); done
"$py" - "$work" "$out/bench-gpu.json" "$sw_rc" "${torch_rc[@]}" <<'EOF'
import json, os, sys
work, dest, sw_rc, eager_rc, compile_rc = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
plan = json.load(open(f"{work}/plan.json"))
est = plan["estimate"]

def peak_mib(name):
    try:
        vals = [int(x) for x in open(f"{work}/{name}.mem").read().split() if x.isdigit()]
        return max(vals) if vals else None
    except OSError:
        return None

rows = {}
try:
    s = json.load(open(f"{work}/run/summary.json"))
    rows["shardwright"] = {
        "tokens_per_s": s["median_tokens_per_s"], "mfu": s["median_mfu"],
        "step_s": s["tokens_per_step"] / s["median_tokens_per_s"],
        "first_loss": s["first_loss"], "last_loss": s["last_loss"],
        "peak_mib": peak_mib("shardwright"), "peak_basis": s["peak_basis"], "rc": sw_rc,
    }
except (OSError, KeyError, ValueError, ZeroDivisionError) as e:
    rows["shardwright"] = {"error": f"no summary ({e}); exit {sw_rc}", "rc": sw_rc}
for v, rc in (("eager", eager_rc), ("compile", compile_rc)):
    try:
        t = json.loads(open(f"{work}/torch-{v}.json").read().strip().splitlines()[-1])
        t.update(step_s=t["median_step_s"], tokens_per_s=t["median_tokens_per_s"],
                 peak_mib=peak_mib(f"torch-{v}"), rc=rc)
        rows[f"pytorch {v}"] = t
    except (OSError, IndexError, ValueError, KeyError) as e:
        rows[f"pytorch {v}"] = {"error": f"no result ({e}); exit {rc}", "rc": rc}
report = {
    "spec": plan["inputs"]["name"],
    "layout": plan["layout"],
    "predicted": {"step_s": est["step"]["step_s"], "tokens_per_s": est["tokens_per_s"],
                  "mfu": est["mfu"], "memory_bytes": est["memory"]["total_bytes"]},
    "runs": rows,
}
sw = rows["shardwright"]
if "step_s" in sw:
    report["predicted_vs_measured_step"] = est["step"]["step_s"] / sw["step_s"] - 1
if sw.get("peak_mib"):
    report["predicted_vs_measured_memory"] = est["memory"]["total_bytes"] / (sw["peak_mib"] * 2**20) - 1
tmp = dest + ".tmp"
with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
os.replace(tmp, dest)
fmt = lambda x, f: "-" if x is None else format(x, f)
print(f"\n{'run':<20} {'tokens/s':>10} {'MFU':>7} {'step s':>8} {'peak MiB':>9} {'loss first->last':>18}")
p = report["predicted"]
print(f"{'plan (predicted)':<20} {p['tokens_per_s']:>10.0f} {p['mfu']:>7.1%} {p['step_s']:>8.3f} {p['memory_bytes'] / 2**20:>9.0f}")
for name, r in rows.items():
    if "error" in r:
        print(f"{name:<20} {r['error']}")
        continue
    print(f"{name:<20} {r['tokens_per_s']:>10.0f} {fmt(r.get('mfu'), '>7.1%')} {r['step_s']:>8.3f} "
          f"{fmt(r.get('peak_mib'), '>9')} {r['first_loss']:>8.3f}->{r['last_loss']:.3f}")
for k in ("predicted_vs_measured_step", "predicted_vs_measured_memory"):
    if k in report:
        print(f"{k}: {report[k]:+.1%}")
print(f"wrote {dest}")
sys.exit(0 if sw_rc == 0 and eager_rc == 0 else 1)
EOF
