#!/usr/bin/env bash
# The GPU check of the CUDA backend, for a machine with a GPU (an H100 box, the device
# tool): builds the executor's GPU tests with `--features cuda`, runs every one of them
# under a wall-clock limit and writes one JSON report.
#
#   scripts/gpu/check.sh              build, run, report (exit 0 when nothing failed)
#   scripts/gpu/check.sh --build-only build the test binaries into target/gpu-check/bin
#                                     (stripped), to run them where there is no cargo
#   scripts/gpu/check.sh --env        find the CUDA libraries and headers as below and print
#                                     the `export` lines that set them up (for `eval`)
#   scripts/gpu/check.sh --vendor     pack every crate of Cargo.lock into
#                                     target/gpu-vendor.tar.gz (from this machine's cargo
#                                     cache or the network), for a machine without network
#
# Tests (all of `-p shardwright-executor`, nothing else is built): cuda_kernels (every
# kernel against the CPU reference), cuda_gemm (cuBLASLt GEMMs, every transpose and
# precision, bias/GELU epilogues, against the CPU reference and a product by hand),
# cuda_train (training steps through the interpreter on the CUDA backend against the CPU
# backend, one-rank and multi-rank layouts sharing the GPU, in fp32 at 1e-4 and in bf16
# mixed precision at bf16 bounds), cuda_bf16 (the backend's bf16 mode method by method
# against the CPU emulation of its precision rules, element types included), cuda_precision
# (those rules through the interpreter on the CPU, no GPU needed), cuda_nccl (a one-rank NCCL communicator from the bootstrap's id: every collective),
# cuda_snapshot (checkpoints of device tensors through
# pinned memory, restored bit-exactly), nvrtc_compile (NVRTC + ptxas, registers and spills),
# cuda_launch (launch configurations of the bundled specs), nccl_bootstrap (the unique-id
# exchange). Each test runs in its own process (`--exact`), up to 8 at a time; its seconds
# are that process's wall time, which for the CUDA tests includes compiling the kernels with
# NVRTC and loading them (a few seconds). A test passes, fails (a non-zero exit or the time
# limit) or is skipped (it exited 0 after printing `skipped: <reason>`: no GPU, no NVRTC).
#
# Report: $OUT/gpu-report.json when $OUT is set, else target/gpu-report.json; each test's
# output in gpu-logs/ beside it. It holds per test name, status and seconds, the build's
# status and seconds, nvidia-smi's summary (name, driver, memory, compute capability), the
# git commit (with `-dirty` for uncommitted changes; "unknown" in a copy without .git),
# where the CUDA libraries and headers were found, and `bf16`: the bf16-mode tests (every
# test whose name or binary says bf16: cuda_train's `*_in_bf16_*`, cuda_bf16's) with their
# own pass/fail/skip counts and, per cuda_train bf16 layout, the drift lines it printed
# (losses / gradient norms and gradients / weights against the fp32 CPU reference and
# against the bf16 rules on the CPU).
#
# Limit: GPU_CHECK_LIMIT_S seconds in all (default 230, under 4 minutes); the build gets
# what is left minus 40 s, each test at most 120 s or what is left. Target directory:
# $CARGO_TARGET_DIR, else target/. Profile: dev (opt-level 1, dependencies at 2). A cold
# build of what these tests need (104 compilation units) took 324 CPU-seconds on the
# machine this was written on; on 16 cores that should be one to two minutes (critical
# path syn -> serde_derive -> the workspace crates -> the executor), not yet measured on
# a GPU machine: GPU_CHECK_LIMIT_S leaves the tests at least 40 s either way.
#
# Finding CUDA: libcuda from the driver; NVRTC, NCCL and cuBLASLt (any major version) from
# the LD_LIBRARY_PATH, $CUDA_HOME/lib64 (/usr/local/cuda), the `nvidia` pip packages next to
# PyTorch (found with python3; CUDA 12's and 13's layouts), else target/cuda-tools
# ($SHARDWRIGHT_CUDA_TOOLS, scripts/gpu/install-cuda-tools.sh); the headers (cuda_bf16.h) from
# $SHARDWRIGHT_CUDA_INCLUDE, $CUDA_HOME/include, /usr/local/cuda/include, the pip packages
# or target/cuda-tools, in that order. The kernels are compiled to PTX by NVRTC and JIT-ed
# by the driver, which must be at least as new as that NVRTC: the pip NVRTC that PyTorch
# brings matches a driver that runs PyTorch.
#
# Limitations. Cargo needs the crates of Cargo.lock: a machine without network (the device
# machines) must get them some other way, else the build fails at once and the report says
# why. In order of preference:
#   1. vendored sources: a `cargo vendor` directory in $SHARDWRIGHT_VENDOR or vendor/, or
#      the archive target/gpu-vendor.tar.gz (`--vendor` makes it here: about 30 MB, which
#      a device run can carry), then the build is `--offline` with that source;
#   2. a cargo cache that already has them (~/.cargo/registry): the build tries
#      `--offline` first;
#   3. the network, if there is one.
# It also needs a Rust toolchain (rust-version 1.80+). Without cargo (or with
# GPU_CHECK_PREBUILT=1), binaries built by `--build-only` (about 7 MB, stripped) on an
# x86_64 Linux machine with a glibc no newer than this one's can be carried in
# target/gpu-check/bin: they are run as they are (cuda_launch reads specs/ through the path the binaries were
# built at; when that path does not exist here the script links it to this checkout, and
# reports cuda_launch as failed if it cannot).
set -uo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
mode="${1:-check}"
case "$mode" in
check | --build-only | --vendor | --env) ;;
*)
    echo "usage: scripts/gpu/check.sh [--build-only | --vendor | --env]" >&2
    exit 2
    ;;
esac
start=$(date +%s)
limit="${GPU_CHECK_LIMIT_S:-230}"
deadline=$((start + limit))
target="${CARGO_TARGET_DIR:-$repo/target}"
work="$target/gpu-check"
bin_dir="$work/bin"
out_dir="${OUT:-$repo/target}"
report="$out_dir/gpu-report.json"
logs="$out_dir/gpu-logs"
tests=(cuda_kernels cuda_gemm cuda_train cuda_bf16 cuda_precision cuda_nccl cuda_snapshot nvrtc_compile cuda_launch nccl_bootstrap)
mkdir -p "$work" "$out_dir" "$logs"

left() { echo $((deadline - $(date +%s))); }
log() { echo "gpu-check: $*" >&2; }

# ---------------------------------------------------------------- --vendor
if [ "$mode" = "--vendor" ]; then
    tmp="$work/vendor"
    rm -rf "$tmp"
    # From the local cargo cache when it has everything, else from the network.
    if ! cargo vendor --locked --offline --versioned-dirs "$tmp" >/dev/null 2>"$work/vendor.log"; then
        cargo vendor --locked --versioned-dirs "$tmp" >/dev/null 2>>"$work/vendor.log" || { tail -5 "$work/vendor.log" >&2; exit 1; }
    fi
    tar -C "$work" -czf "$repo/target/gpu-vendor.tar.gz" vendor
    rm -rf "$tmp"
    log "wrote target/gpu-vendor.tar.gz ($(du -h "$repo/target/gpu-vendor.tar.gz" | cut -f1))"
    exit 0
fi

# ---------------------------------------------------------------- CUDA libraries and headers
# cudarc (built for CUDA 12.9) opens `libX.so`, `libX.so.12` and a few other names, not
# `libnvrtc.so.13` or `libnccl.so.2`: whatever major version this machine has (CUDA 12 pip
# wheels put libraries in nvidia/<lib>/lib, CUDA 13 ones in nvidia/cu13/lib, a toolkit in
# /usr/local/cuda/lib64), each library found is linked as `libX.so` in one shim directory
# at the front of LD_LIBRARY_PATH, and its own directory is added after it (NVRTC loads its
# builtins library from there).
py_nvidia=""
if command -v python3 >/dev/null 2>&1; then
    py_nvidia="$(python3 -c 'import nvidia, os; print(os.pathsep.join(nvidia.__path__))' 2>/dev/null || true)"
fi
tools="${SHARDWRIGHT_CUDA_TOOLS:-$repo/target/cuda-tools}"
IFS=: read -r -a nv_roots <<<"$py_nvidia"
IFS=: read -r -a ld_dirs <<<"${LD_LIBRARY_PATH:-}"
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
search_dirs=("${ld_dirs[@]}" "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib")
for root in "${nv_roots[@]}" "$tools/nvidia"; do
    [ -n "$root" ] || continue
    for sub in "$root"/*/lib; do [ -d "$sub" ] && search_dirs+=("$sub"); done
done
search_dirs+=(/usr/lib/x86_64-linux-gnu /usr/lib64)
shim="$work/libshim"
rm -rf "$shim"
mkdir -p "$shim"
extra=""
declare -A found_lib=()
for name in nvrtc nccl cublasLt cublas cudart; do
    for d in "${search_dirs[@]}"; do
        [ -n "$d" ] && [ -d "$d" ] || continue
        f="$(ls -1 "$d"/lib$name.so.[0-9]* 2>/dev/null | sort -V | tail -1)"
        [ -z "$f" ] && [ -e "$d/lib$name.so" ] && f="$d/lib$name.so"
        if [ -n "$f" ]; then
            found_lib[$name]="$f"
            ln -sf "$f" "$shim/lib$name.so"
            case ":$extra:" in *":$d:"*) ;; *) extra="${extra:+$extra:}$d" ;; esac
            break
        fi
    done
    log "lib$name: ${found_lib[$name]:-not found}"
done
export LD_LIBRARY_PATH="$shim${extra:+:$extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
include=""
for d in "${SHARDWRIGHT_CUDA_INCLUDE:-}" "$cuda_home/include" /usr/local/cuda/include \
    $(for r in "${nv_roots[@]}"; do [ -n "$r" ] && ls -d "$r"/*/include 2>/dev/null; done) \
    "$tools/nvidia/cuda_runtime/include"; do
    if [ -n "$d" ] && [ -f "$d/cuda_bf16.h" ]; then
        include="$d"
        break
    fi
done
[ -n "$include" ] && export SHARDWRIGHT_CUDA_INCLUDE="$include"
log "headers: ${include:-not found}"
# nvrtc_compile: the NVRTC found above, and a ptxas (the pinned tools, a toolkit's, pip's).
[ -n "${found_lib[nvrtc]:-}" ] && export SHARDWRIGHT_NVRTC_LIB="${SHARDWRIGHT_NVRTC_LIB:-${found_lib[nvrtc]}}"
ptxas=""
for p in "$tools/nvidia/cuda_nvcc/bin/ptxas" "$cuda_home/bin/ptxas" "$(command -v ptxas 2>/dev/null)" \
    $(for r in "${nv_roots[@]}"; do [ -n "$r" ] && ls "$r"/*/bin/ptxas 2>/dev/null; done); do
    if [ -n "$p" ] && [ -x "$p" ]; then
        ptxas="$p"
        break
    fi
done
[ -n "$ptxas" ] && export SHARDWRIGHT_PTXAS="${SHARDWRIGHT_PTXAS:-$ptxas}"
log "ptxas: ${ptxas:-not found}"
export SHARDWRIGHT_CUDA_TOOLS="$tools"
if [ "$mode" = "--env" ]; then
    for v in LD_LIBRARY_PATH SHARDWRIGHT_CUDA_INCLUDE SHARDWRIGHT_NVRTC_LIB SHARDWRIGHT_PTXAS SHARDWRIGHT_CUDA_TOOLS; do
        [ -n "${!v:-}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    exit 0
fi

# ---------------------------------------------------------------- build
build_status="skipped"
build_s=0
build_offline="false"
vendor=""
build_log="$logs/build.log"
: >"$build_log"
declare -A binary=()

build() {
    local cargo_args=(test -p shardwright-executor --features cuda --locked --no-run
        --message-format=json-render-diagnostics)
    for t in "${tests[@]}"; do cargo_args+=(--test "$t"); done
    local src="${SHARDWRIGHT_VENDOR:-}"
    if [ -z "$src" ] && [ -d "$repo/vendor" ]; then src="$repo/vendor"; fi
    if [ -z "$src" ] && [ -f "$repo/target/gpu-vendor.tar.gz" ]; then
        rm -rf "$work/vendor"
        tar -C "$work" -xzf "$repo/target/gpu-vendor.tar.gz" && src="$work/vendor"
    fi
    local t0
    t0=$(date +%s)
    local budget=$(($(left) - 40))
    if [ "$budget" -lt 20 ]; then
        echo "no time left to build (${budget}s)" >>"$build_log"
        return 1
    fi
    local ok=1
    if [ -n "$src" ]; then
        vendor="$src"
        build_offline="true"
        timeout "$budget" cargo "${cargo_args[@]}" --offline \
            --config "source.crates-io.replace-with=\"vendored-sources\"" \
            --config "source.vendored-sources.directory=\"$src\"" \
            >"$work/artifacts.json" 2>>"$build_log" && ok=0
    else
        build_offline="true"
        if timeout "$budget" cargo "${cargo_args[@]}" --offline >"$work/artifacts.json" 2>>"$build_log"; then
            ok=0
        else
            echo "--- offline build failed; trying with the network" >>"$build_log"
            build_offline="false"
            budget=$(($(left) - 40))
            # No network fails fast instead of retrying until the limit.
            [ "$budget" -ge 20 ] && CARGO_NET_RETRY=0 CARGO_HTTP_TIMEOUT=15 \
                timeout "$budget" cargo "${cargo_args[@]}" \
                >"$work/artifacts.json" 2>>"$build_log" && ok=0
        fi
    fi
    build_s=$(($(date +%s) - t0))
    [ $ok -eq 0 ] || return 1
    # The test executables, by target name.
    while IFS=$'\t' read -r name exe; do
        binary[$name]="$exe"
    done < <(python3 - "$work/artifacts.json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"] + "\t" + m["executable"])
EOF
    )
    return 0
}

prebuilt="false"
if [ "$mode" != "--build-only" ] && [ -f "$bin_dir/manifest" ] \
    && { [ "${GPU_CHECK_PREBUILT:-}" = 1 ] || ! command -v cargo >/dev/null 2>&1; }; then
    # Binaries from --build-only, carried here: link the path they were built at.
    prebuilt="true"
    build_status="prebuilt"
    built_at="$(cat "$bin_dir/manifest")"
    if [ "$built_at" != "$repo" ] && [ ! -e "$built_at" ]; then
        mkdir -p "$(dirname "$built_at")" 2>/dev/null && ln -s "$repo" "$built_at" 2>/dev/null \
            || log "cannot link $built_at to $repo: cuda_launch will not find specs/"
    fi
    for t in "${tests[@]}"; do
        [ -x "$bin_dir/$t" ] && binary[$t]="$bin_dir/$t"
    done
elif ! command -v cargo >/dev/null 2>&1; then
    build_status="failed"
    echo "cargo is not installed (and no binaries from --build-only in $bin_dir)" >>"$build_log"
elif build; then
    build_status="ok"
else
    build_status="failed"
fi
log "build: $build_status (${build_s}s)"

if [ "$mode" = "--build-only" ]; then
    [ "$build_status" = "ok" ] || { tail -20 "$build_log" >&2; exit 1; }
    rm -rf "$bin_dir"
    mkdir -p "$bin_dir"
    for t in "${tests[@]}"; do
        cp "${binary[$t]}" "$bin_dir/$t"
        strip "$bin_dir/$t" 2>/dev/null || true
    done
    # The package's manifest directory the binaries have compiled in, minus executor/.
    echo "$repo" >"$bin_dir/manifest"
    log "binaries in $bin_dir ($(du -sh "$bin_dir" | cut -f1))"
    exit 0
fi

# ---------------------------------------------------------------- run
results="$work/results.tsv"
: >"$results"
run_one() { # binary-name test-name
    local t="$1" name="$2"
    local lf="$logs/$t.$(echo "$name" | tr -c 'A-Za-z0-9_.-' '_').log"
    local budget
    budget=$(left)
    [ "$budget" -gt 120 ] && budget=120
    if [ "$budget" -lt 5 ]; then
        printf '%s\t%s\tfail\t0\t%s\n' "$t" "$name" "$lf" >>"$results"
        echo "not run: the wall-clock limit was reached" >"$lf"
        return
    fi
    local t0 t1 rc status
    t0=$(date +%s.%N)
    timeout "$budget" "${binary[$t]}" --exact "$name" --nocapture --test-threads=1 >"$lf" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    if [ $rc -eq 0 ] && grep -q "skipped:" "$lf"; then
        status=skip
    elif [ $rc -eq 0 ] && grep -q "^test result: ok. 1 passed" "$lf"; then
        status=pass
    else
        status=fail
        [ $rc -eq 124 ] && echo "gpu-check: killed after ${budget}s (the time limit)" >>"$lf"
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$name" "$status" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')" "$lf" >>"$results"
}

jobs_max="${GPU_CHECK_JOBS:-8}"
for t in "${tests[@]}"; do
    if [ -z "${binary[$t]:-}" ]; then
        printf '%s\t%s\tfail\t0\t%s\n' "$t" "(not built)" "$build_log" >>"$results"
        continue
    fi
    names="$("${binary[$t]}" --list 2>/dev/null | sed -n 's/: test$//p')"
    if [ -z "$names" ]; then
        printf '%s\t%s\tfail\t0\t%s\n' "$t" "(no tests listed)" "$build_log" >>"$results"
        continue
    fi
    while IFS= read -r name; do
        while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
        run_one "$t" "$name" &
    done <<<"$names"
done
wait

# ---------------------------------------------------------------- report
smi=""
if command -v nvidia-smi >/dev/null 2>&1; then
    smi="$(nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap \
        --format=csv,noheader 2>&1 || true)"
fi
commit="unknown"
if git rev-parse HEAD >/dev/null 2>&1; then
    commit="$(git rev-parse HEAD)"
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit-dirty"
fi
export GC_SMI="$smi" GC_COMMIT="$commit" GC_LIMIT="$limit" GC_START="$start" \
    GC_BUILD_STATUS="$build_status" GC_BUILD_S="$build_s" GC_BUILD_OFFLINE="$build_offline" \
    GC_VENDOR="$vendor" GC_BUILD_LOG="$build_log"
python3 - "$report" "$results" <<'EOF'
import json, os, sys, time
report, results = sys.argv[1], sys.argv[2]
env = os.environ
tests = []
for line in open(results):
    b, name, status, secs, lf = line.rstrip("\n").split("\t")
    t = {"binary": b, "name": name, "status": status, "seconds": float(secs),
         "log": os.path.relpath(lf, os.path.dirname(report))}
    if status == "fail":
        try:
            t["tail"] = open(lf, errors="replace").read()[-3000:]
        except OSError:
            pass
    tests.append(t)
tests.sort(key=lambda t: (t["binary"], t["name"]))
smi = env["GC_SMI"].strip()
gpus = []
for row in smi.splitlines():
    f = [x.strip() for x in row.split(",")]
    if len(f) == 5:
        gpus.append(dict(zip(["index", "name", "driver", "memory_total", "compute_cap"], f)))
build = {"status": env["GC_BUILD_STATUS"], "seconds": int(env["GC_BUILD_S"]),
         "offline": env["GC_BUILD_OFFLINE"] == "true", "vendor": env["GC_VENDOR"] or None}
if build["status"] == "failed":
    try:
        build["tail"] = open(env["GC_BUILD_LOG"], errors="replace").read()[-3000:]
    except OSError:
        pass
count = {s: sum(t["status"] == s for t in tests) for s in ("pass", "fail", "skip")}
# The bf16 mode's tests, and the drift lines cuda_train's bf16 tests print per layout.
bf16_tests = [t for t in tests if "bf16" in t["name"] or t["binary"] == "cuda_bf16"]
drift = []
for t in bf16_tests:
    try:
        for line in open(os.path.join(os.path.dirname(report), t["log"]), errors="replace"):
            if " bf16: " in line and "against the fp32 CPU reference" in line:
                drift.append(line.strip())
    except OSError:
        pass
bf16 = {
    "tests": [{"binary": t["binary"], "name": t["name"], "status": t["status"]} for t in bf16_tests],
    "summary": {s: sum(t["status"] == s for t in bf16_tests) for s in ("pass", "fail", "skip")},
    "train_drift": drift,
}
out = {
    "schema": "shardwright-gpu-check/1",
    "commit": env["GC_COMMIT"],
    "limit_s": int(env["GC_LIMIT"]),
    "wall_s": int(time.time()) - int(env["GC_START"]),
    "cores": os.cpu_count(),
    "nvidia_smi": {"available": bool(gpus), "gpus": gpus, "raw": smi},
    "build": build,
    "cuda": {"include": env.get("SHARDWRIGHT_CUDA_INCLUDE") or None,
             "tools": env.get("SHARDWRIGHT_CUDA_TOOLS"),
             "ld_library_path": env.get("LD_LIBRARY_PATH", "")},
    "summary": count,
    "bf16": bf16,
    "tests": tests,
}
with open(report, "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
print(f"gpu-check: {count['pass']} passed, {count['fail']} failed, {count['skip']} skipped; "
      f"build {build['status']} ({build['seconds']} s); report {report}", file=sys.stderr)
sys.exit(0 if count["fail"] == 0 and build["status"] in ("ok", "prebuilt") else 1)
EOF
