#!/usr/bin/env bash
# Conformance of the golden exports with the engines' own code (issue 27).
#
# Installs pinned engine releases from the Python registry into virtual environments
# under target/conformance/ (one PyTorch install shared through a .pth file; no GPU is
# used: torch's CPU paths, the meta device and a fake process group), feeds every golden
# export (golden/export/*.snap) to each engine's own config and setup code
# (scripts/conformance.py), prints the table (engine/version | accepted | meaning kept)
# and writes the results, keyed by each export's sha256, to
# golden/export/conformance.json. `cargo test -p shardwright-export --test
# conformance_drift` fails when a golden export changes and this was not re-run.
#
# CI does not run this (it needs the network and several GB); run it by hand after an
# export change:   nice scripts/conformance.sh            (RECORD=0: print only)
set -euo pipefail
cd "$(dirname "$0")/.."

# Python 3.12 (the registry's newest megatron-core and -bridge need it).
PY=${CONFORMANCE_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      PY=$c
      break
    fi
  done
fi
[ -n "$PY" ] || { echo "conformance.sh: needs python3.12 (set CONFORMANCE_PYTHON)" >&2; exit 2; }
DIR=target/conformance
# The pinned releases (the Python registry's, for Python 3.12).
TORCH=2.15.0
TITAN_OLD=0.2.2
TITAN=0.3.0
DEEPSPEED=0.19.8
MCORE=0.19.2
MBRIDGE=0.6.2
export PIP_DISABLE_PIP_VERSION_CHECK=1

mkdir -p "$DIR"
# venv NAME PIP-ARGS...: a virtual environment that sees the shared torch install.
venv() {
  local name=$1
  shift
  local v="$DIR/$name"
  if [ -f "$v/.installed" ] && [ "$(cat "$v/.installed")" = "$*" ]; then return; fi
  rm -rf "$v"
  "$PY" -m venv "$v"
  if [ "$name" != torch ]; then
    local site
    site=$("$DIR/torch/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' |
      xargs -I{} sh -c "echo '$PWD/$site' > {}/shared-torch.pth"
  fi
  echo "installing $name: $*" >&2
  # setuptools first: DeepSpeed's sdist builds without isolation (its setup.py imports torch).
  "$v/bin/python" -m pip install --quiet setuptools wheel >"$DIR/$name.log" 2>&1
  "$v/bin/python" -m pip install --quiet "$@" >>"$DIR/$name.log" 2>&1 ||
    { tail -20 "$DIR/$name.log" >&2; return 1; }
  echo "$*" >"$v/.installed"
}

venv torch "torch==$TORCH" numpy
venv titan-old "torchtitan==$TITAN_OLD" tomli
venv titan "torchtitan==$TITAN"
# DeepSpeed builds no ops here (DS_BUILD_OPS=0); its setup.py imports torch.
DS_BUILD_OPS=0 venv deepspeed --no-build-isolation "deepspeed==$DEEPSPEED"
# Megatron-Bridge without its training extras (Transformer Engine, flash attention...):
# only its config classes and override parsing run here.
venv megatron "megatron-core==$MCORE" einops omegaconf "hydra-core>=1.3,<1.4" pyyaml
"$DIR/megatron/bin/python" -m pip install --quiet --no-deps "megatron-bridge==$MBRIDGE" \
  >>"$DIR/megatron.log" 2>&1

[ "${INSTALL_ONLY:-0}" = 1 ] && exit 0

out="$DIR/results"
rm -rf "$out"
mkdir -p "$out"
run() { # run VENV ENGINE VERSION
  "$DIR/$1/bin/python" scripts/conformance.py check --engine "$2" --version "$3" \
    --golden golden/export --out "$out/$2-$3.json" || echo "conformance.py failed for $2 $3" >&2
}
run titan-old torchtitan "$TITAN_OLD"
run titan torchtitan "$TITAN"
run deepspeed deepspeed "$DEEPSPEED"
run megatron megatron-core "$MCORE"
run megatron megatron-bridge "$MBRIDGE"
record=(--record golden/export/conformance.json)
[ "${RECORD:-1}" = 0 ] && record=()
"$PY" scripts/conformance.py report --golden golden/export --results "$out" "${record[@]}"
