#!/usr/bin/env bash
# Files GPU gate artefacts under results/ (run here, from the repository root, after the device call returned).
#   scripts/collect_gpu_results.sh DIR     (DIR: a call's files_at folder, holding gpu-gate-*.tgz)
#
# Layout: results/<gpu>/<op>/<run>.<ext> (docs/layout.md). <gpu> is the machine slug the gate wrote
# (machine.txt) less its memory and form-factor words (nvidia-h100-80gb-hbm3 -> nvidia-h100; GPU=name
# overrides). The gate's <op>-<machine>.* (`attnbench run` on the anchors) becomes <op>/anchor.*,
# <op>-<tag>-<machine>.* (TAG=<tag>) <op>/<tag>.*, capabilities-<machine>.* jvp_attention/capabilities.*;
# what spans operators (calibration, machine state, the pytest gate, sanitize, asv's output) goes to
# <gpu>/gate/. Logs land beside their run but stay out of git (.gitignore): quote the lines a claim
# needs in docs/measurements/<op>.md. Each run JSON gets its markdown summary and TF/s plot, and
# results/index.csv and the results pages (docs/report/) are regenerated. A run that replaces a committed file says so: git keeps the old one,
# but docs/measurements may cite it, so give a study its own TAG.
set -euo pipefail
python=${PYTHON:-python3}
ops=$($python -c "import attnbench; print(' '.join(attnbench.all_operators()))")
new_json=()

place() {  # place FILE DEST: copy, saying when a committed file is replaced
  mkdir -p "$(dirname "$2")"
  if git ls-files --error-unmatch "$2" >/dev/null 2>&1 && ! cmp -s "$1" "$2"; then
    echo "collect: replaces the committed $2 (git keeps the old version)" >&2
  fi
  cp "$1" "$2"
}

for archive in "$1"/gpu-gate-*.tgz; do
  src=$(mktemp -d)
  tar xzf "$archive" -C "$src"
  machine=$(cat "$src/machine.txt")
  gpu=${GPU:-$(echo "$machine" | sed -E 's/-([0-9]+gb|hbm[0-9a-z]*|sxm[0-9]*|pcie|nvl)//g')}
  dest=results/$gpu
  for path in "$src"/*; do
    [[ -f "$path" ]] || continue
    name=$(basename "$path")
    stem=${name%%.*} ext=${name#*.}
    case "$name" in
      asv-results.tgz) tar xzf "$path"; continue ;;  # asv's own layout: results/asv/<machine>/
      ab-old-*|ab-new-*) continue ;;  # the ab stage's runs: two commits' code, for its table (ab-<commit>.*) only
      capabilities-*) run=capabilities; op=jvp_attention
                      [[ "$stem" == capabilities-progress ]] && run=capabilities-progress ;;
      *) op=gate run=$stem
         for o in $ops; do
           if [[ "$stem" == "$o" || "$stem" == "$o"-* ]]; then
             op=$o run=${stem#"$o"}; run=${run#-}
             run=${run%-"$machine"}; [[ "$run" == "$machine" ]] && run=""
             [[ "$run" == progress ]] && run=anchor-progress
             [[ "$run" == *-progress ]] || run=${run:-anchor}
             break
           fi
         done ;;
    esac
    place "$path" "$dest/$op/$run.$ext"
    [[ "$ext" == json && "$op" != gate && "$run" != capabilities ]] && new_json+=("$dest/$op/$run.json")
  done
  rm -rf "$src"
done

for json in "${new_json[@]}"; do
  $python -m attnbench report "$json" --markdown "${json%.json}.md" --plot "${json%.json}.png" \
    || echo "collect: no summary for $json (see above)" >&2
done
$python -m attnbench report --index results
$python -m attnbench report --site results --out docs/report || echo "collect: no results pages (see above)" >&2
git status --short results docs/report
