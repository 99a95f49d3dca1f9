#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then verify and benchmark every operator on
# whatever device is here (CPU: tiny cases through the Triton interpreter). Extra arguments go
# to `attnbench run` (e.g. --cases sweep --json report.json).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(scripts/dev-env.sh)
exec "$(dirname "$VPY")/attnbench" run "$@"
