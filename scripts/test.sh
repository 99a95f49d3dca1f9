#!/usr/bin/env bash
# The test gate on a fresh machine: set up .venv, then pytest. Without CUDA the Triton kernels
# run through the interpreter and GPU-marked tests are skipped (scripts/gpu_gate.sh runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(scripts/dev-env.sh)
exec "$VPY" -m pytest "$@"
