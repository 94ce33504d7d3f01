#!/usr/bin/env bash
# scripts/gpu_check.sh — the GPU path's device check (see scripts/gpu_check.py): FSDP2 steps on the GPU, the
# CUDA IPC packed sync between two processes (latency against a device-to-device copy), the seqlock under
# back-to-back writes, and trainer/receiver log-prob agreement after each sync. Needs one GPU, PyTorch and
# transformers; not vLLM. Prints one JSON line on stdout (progress on stderr); exit 0 = every check passed,
# 1 = a check failed, 2 = no GPU or a package missing, 124 = it ran past its time limit.
#   PYTHON      interpreter to use (default: python3)
#   WHEELS      a folder of wheels (e.g. transformers and its dependencies) to install offline first
#   LIMIT_S     wall-clock limit in seconds (default 450: under 8 minutes)
# Extra arguments go to gpu_check.py (e.g. --sizes tiny --steps 3; --device cpu for a dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/asyncgrpo-site "$WHEELS"/*.whl >&2
  export PYTHONPATH="/tmp/asyncgrpo-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec timeout --kill-after=10 "${LIMIT_S:-450}" "$PY" scripts/gpu_check.py "$@"
