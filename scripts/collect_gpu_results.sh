#!/usr/bin/env bash
# Files GPU gate artefacts under results/ (run here, after the device call returned).
#   scripts/collect_gpu_results.sh DIR     (DIR: a call's files_at folder, holding gpu-gate-*.tgz)
set -euo pipefail
for archive in "$1"/gpu-gate-*.tgz; do
  src=$(mktemp -d)
  tar xzf "$archive" -C "$src"
  machine=$(cat "$src/machine.txt")
  dest=results/gpu/$machine
  mkdir -p "$dest"
  # every file the gate wrote, except the asv archive, which unpacks into results/asv
  find "$src" -maxdepth 1 -type f ! -name asv-results.tgz -exec cp {} "$dest/" \;
  [[ -f "$src/asv-results.tgz" ]] && tar xzf "$src/asv-results.tgz"
  for json in "$src"/*-"$machine".json; do
    [[ -f "$json" && "$(basename "$json")" != capabilities-* ]] || continue
    out="$dest/$(basename "${json%.json}")"
    attnbench report "$json" --markdown "$out.md" --plot "$out.png"
  done
done
ls results/gpu/*/ results/asv
