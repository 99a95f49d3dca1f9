#!/usr/bin/env bash
# What tests/bench/test_dashboard_browser.py needs beyond .venv (asv and selenium come with the test extra):
# Debian's chromium and chromium-driver from apt (dashboard/node_modules comes from scripts/dashboard.sh, which
# the test runs: npm ci where it is missing or older than the lock). CI runs it before scripts/test.sh (.ci/run).
# Best effort: it always exits 0; whatever fails is said here, and the browser test then skips saying what it
# could not find. Measured on the 2-core CI VM (Debian 12): apt-get update + install 36 s with recommends.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
log=$(mktemp)
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  echo "browser-deps: chromium and chromedriver are installed"
elif ! command -v apt-get >/dev/null; then
  echo "browser-deps: no apt-get here; install chromium and its chromedriver by hand, or the browser test skips"
else
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo -n)
  if "${sudo[@]}" apt-get update -q >"$log" 2>&1 &&
     DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
       chromium chromium-driver >>"$log" 2>&1; then
    echo "browser-deps: installed chromium and chromium-driver ($((SECONDS - start)) s)"
  else
    echo "browser-deps: apt-get could not install chromium chromium-driver; the browser test will skip. Its last lines:"
    tail -n 5 "$log"
  fi
fi
rm -f "$log"
echo "browser-deps: done in $((SECONDS - start)) s"
exit 0
