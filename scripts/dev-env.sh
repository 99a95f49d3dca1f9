#!/usr/bin/env bash
# Creates (or refreshes) .venv with everything attnbench needs, on a fresh machine.
# Without CUDA it takes torch's CPU build (torch==2.13.0; an unpinned torch pulls GBs of CUDA
# packages); on a GPU machine it keeps or installs a CUDA torch. Prints the venv's python path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv >&2
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >&2 2>&1 | grep -v "^WARNING" >&2 || true
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.11" >&2
  else
    "$VPY" -m pip install -q "torch==2.13.0" >&2
  fi
fi
"$VPY" -m pip install -q -e ".[test]" >&2
echo "$VPY"
