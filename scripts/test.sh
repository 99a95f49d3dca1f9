#!/usr/bin/env bash
# The test gate on a fresh machine: set up .venv, then pytest. Without CUDA the Triton kernels
# run through the interpreter and GPU-marked tests are skipped (scripts/gpu_gate.sh runs them).
# Without a GPU the tests run on one worker process per CPU (pytest-xdist: the interpreter is
# single-threaded; on CI's 2 cores the gate took 529 s against 871 s in one process). With one,
# in this process: GPU tests time kernels and must not share the card. ATTNBENCH_TEST_WORKERS=N
# sets the count (0: this process, for --pdb), and a later -n in the arguments wins.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(scripts/dev-env.sh)
workers=auto
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  workers=0
fi
exec "$VPY" -m pytest -n "${ATTNBENCH_TEST_WORKERS:-$workers}" "$@"
