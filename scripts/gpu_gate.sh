#!/usr/bin/env bash
# The GPU gate in one call: install, calibrate, run the GPU-marked tests (with pytest-benchmark
# timings), benchmark the anchor cases, and record an asv run; every artefact lands in $OUT.
#
#   scripts/gpu_gate.sh [tests] [bench] [asv]      (default: all three)
#
# For the lent GPU machine (offline), first, here: ../shared/device/wheelhouse.sh .wheelhouse and
# git bundle create .gitbundle main; carry both; bring the artefacts home with
# scripts/collect_gpu_results.sh.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# The device tool returns at most 8 files: artefacts collect in ART and travel as one archive.
ART=$(mktemp -d)
trap 'tar czf "$OUT/gpu-gate.tgz" -C "$ART" .' EXIT
stages=${*:-tests bench asv}
export PYTHONUNBUFFERED=1
status=0

if compgen -G ".wheelhouse/*.whl" >/dev/null; then
  python3 -m pip install --no-index --no-deps -q .wheelhouse/*.whl 2>&1 | grep -v "^WARNING" || true
fi
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v "^WARNING" || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$ART/nvidia-smi.csv"
machine=$(python3 -c "from attnbench.roofline import machine_slug; print(machine_slug('cuda'))")
echo "$machine" | tee "$ART/machine.txt"
attnbench calibrate | tee "$ART/calibration.txt"

if [[ " $stages " == *" tests "* ]]; then
  # Correctness at the default launch configs (no tuning sweep per shape); the perf gate and the
  # pytest-benchmark timings retune (tests/conftest.py: tuned_kernels); `attnbench run` below
  # verifies the tuned configs on the anchor cases.
  ATTNBENCH_AUTOTUNE=0 python3 -m pytest -m gpu -q -p no:cacheprovider \
      --junitxml "$ART/gpu-tests.xml" --benchmark-json "$ART/pytest-benchmark.json" \
      --benchmark-timer attnbench.timing.cuda_synchronized_clock 2>&1 | tee "$ART/gpu-tests.log"
  status=$((status | $?))
fi
if [[ " $stages " == *" bench "* ]]; then
  attnbench run --json "$ART/flash-$machine.json" 2>"$ART/flash-progress.log" | tee "$ART/flash-$machine.txt"
  status=$((status | $?))
fi
if [[ " $stages " == *" asv "* ]]; then
  git config --global --add safe.directory "$PWD" 2>/dev/null
  # asv files results under a commit it must find in the repo. The device tool's copy of .git
  # cannot resolve HEAD, so history travels as a bundle: `git bundle create .gitbundle main`.
  if ! git rev-parse -q --verify "HEAD^{commit}" >/dev/null 2>&1; then
    if [[ -f .gitbundle ]]; then
      rm -rf .git && git init -q && git fetch -q .gitbundle "+refs/heads/*:refs/heads/*" \
        && git symbolic-ref HEAD refs/heads/main
    fi
  fi
  commit=$(git rev-parse -q --verify "HEAD^{commit}") || { echo "asv: no git history here (carry .gitbundle)"; exit 1; }
  asv machine --yes --machine "$machine" >/dev/null
  asv run -E existing:python3 --set-commit-hash "$commit" --machine "$machine" \
      --launch-method spawn --show-stderr 2>&1 | tee "$ART/asv-run.log" | tail -n 30
  status=$((status | $?))
  grep -q "Traceback" "$ART/asv-run.log" && status=1
  tar czf "$ART/asv-results.tgz" results/asv
fi
exit $status
