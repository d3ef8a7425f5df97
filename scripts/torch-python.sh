#!/usr/bin/env bash
# Prints the path of a Python with PyTorch for the benchmark scripts (bench-executor.sh,
# bench-restore.sh): $PYTHON when set, else the virtual environment target/torch-venv,
# created on first use with the registry's torch wheel (run on the CPU here).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
    exit 0
fi
venv=target/torch-venv
if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch' 2>/dev/null; }; then
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet torch numpy >&2
fi
echo "$PWD/$venv/bin/python"
