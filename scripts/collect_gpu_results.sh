#!/usr/bin/env bash
# Files a GPU gate run's artefacts under results/ (run here, after the device call returned).
#   scripts/collect_gpu_results.sh DIR     (DIR: the call's files_at folder, holding gpu-gate.tgz)
set -euo pipefail
src=$(mktemp -d)
tar xzf "$1/gpu-gate.tgz" -C "$src"
machine=$(cat "$src/machine.txt")
dest=results/gpu/$machine
mkdir -p "$dest"
for f in machine.txt nvidia-smi.csv calibration.txt gpu-tests.log gpu-tests.xml pytest-benchmark.json flash-progress.log asv-run.log; do
  [[ -f "$src/$f" ]] && cp "$src/$f" "$dest/"
done
cp "$src"/flash-*.json "$src"/flash-*.txt "$dest/" 2>/dev/null || true
[[ -f "$src/asv-results.tgz" ]] && tar xzf "$src/asv-results.tgz"
for json in "$dest"/flash-*.json; do
  [[ -f "$json" ]] && attnbench report "$json" --markdown "${json%.json}.md" --plot "${json%.json}.png"
done
ls "$dest" results/asv
