#!/usr/bin/env bash
# Publishes asv's dashboard of results/asv into a folder that works offline (docs/dashboard.md):
#   scripts/dashboard.sh [DIR]      (default: results/html, asv.conf.json's html_dir, git-ignored)
# then serve it: python3 -m http.server -d DIR 8080 (or asv preview) and open http://127.0.0.1:8080.
#
# 1. dashboard/node_modules from package-lock.json (npm ci: exact versions, each tarball's sha512 checked);
#    skipped when it is already installed from this lock, so it runs offline after the first time
# 2. asv publish -o DIR (reads results/asv, writes nothing there)
# 3. dashboard/offline.py DIR: copies the pinned files into DIR/vendor (each checked against
#    dashboard/assets.json), points the html at them, and fails if anything in DIR still names another host
# PYTHON picks the interpreter that has asv (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
out=${1:-results/html}
mkdir -p "$out"
out=$(cd "$out" && pwd)

lock=dashboard/package-lock.json installed=dashboard/node_modules/.package-lock.json
if [[ ! -f "$installed" || "$lock" -nt "$installed" ]]; then
  command -v npm >/dev/null || { echo "dashboard: npm is needed once to install dashboard/node_modules" >&2; exit 2; }
  (cd dashboard && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
fi
"$PY" -m asv publish --no-pull -o "$out" >&2
exec "$PY" dashboard/offline.py "$out"
