#!/usr/bin/env bash
# The GPU checks on a lent GPU machine, in one call: the training smoke (train_smoke.py: wanka
# train on 1 GPU, bf16, Triton backends, 30 steps, tokens/s and MFU), then the operator benchmark:
#     bash benchmarks/gpu/run.sh            # full: L 4k..32k, k 512..2048, --budget-s 420
#     bash benchmarks/gpu/run.sh --quick    # any triton_ops.py flag passes through
# Runs $PYTHON (default python3, on the GPU image the one with torch and triton). Installs
# nothing: triton_ops.py imports this checkout's src/ directly (an offline `pip install -e .`
# would try to fetch setuptools/wheel for its build from a registry the machine cannot reach).
# Writes train_smoke.json/.md, triton_ops.json, triton_ops.md (the table) and triton_ops.log to $OUT when it is set
# (the folder the device tool brings back), else to runs/bench/.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DIR=${OUT:-runs/bench}
mkdir -p "$DIR"
{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
            --format=csv || true
    fi
    PYTHONUNBUFFERED=1 timeout 240 "$PY" benchmarks/gpu/train_smoke.py --out "$DIR/train_smoke.json" \
        || echo "train_smoke failed (exit $?)"
    PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu/triton_ops.py --out "$DIR/triton_ops.json" "$@"
} 2>&1 | tee "$DIR/triton_ops.log"
exit "${PIPESTATUS[0]}"
