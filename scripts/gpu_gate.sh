#!/usr/bin/env bash
# The GPU gate: install, calibrate, then the stages asked for; every artefact lands in $OUT as one
# archive (gpu-gate-<stages>.tgz), which scripts/collect_gpu_results.sh files under
# results/<gpu>/<op>/<run>.* (docs/gpu-gate.md, docs/layout.md).
#
#   scripts/gpu_gate.sh [tests] [bench] [graphs] [capabilities] [sanitize] [asv] [traffic] [ab] [peers]
#                                                    (default: all but traffic, ab and peers, which run when named)
#
#   tests         GPU-marked pytest (real sizes vs float64, determinism, boundary witnesses, perf
#                 gates, pytest-benchmark timings); TESTS= picks files, TESTS_MARK= a marker expression
#   bench         `attnbench run --op OP` on the anchor cases, one JSON + table per operator
#                 (OPS="flash jvp_attention" limits the operators; default: every operator;
#                 RUN_ARGS="--mode fwd_jvp" is passed on and TAG=fwd names the files <op>-fwd-<gpu>.*
#                 here, filed as results/<gpu>/<op>/fwd.* (without a TAG: <op>/anchor.*),
#                 so that a run longer than one call splits into parts that asv reads together; RUN=bench
#                 times without the check pass first, about half the time: `attnbench bench` still fails on
#                 our variants' outputs past their float64 bounds; WARM=14 WARM_ARGS="--cases random --mode fwd"
#                 first compiles what the run will autotune over in 14 processes: `attnbench warm`)
#   graphs        jvp_attention's routes as CUDA-graph replays beside CUDA events (the GPU's time
#                 without the host's, for the sizes where eager PyTorch is host-bound)
#   capabilities  `attnbench capabilities`: the differentiation matrix of every implementation
#   sanitize      compute-sanitizer memcheck over every operator's Triton kernels on odd shapes
#   traffic       `attnbench traffic --op OP`: each operator's Triton variant on the anchor cases under
#                 `ncu --clock-control none`, DRAM bytes read and written per call beside the analytic
#                 minimum (docs/traffic.md); TRAFFIC_ARGS="--match ^vecsca" is passed on and TAG=vecsca names
#                 the files <op>-traffic-vecsca-<gpu>.*, filed as results/<gpu>/<op>/traffic-vecsca.*;
#                 TRAFFIC_BUDGET (default 540) is the seconds since this script started after which no ncu part
#                 starts, so that a call keeps what finished
#   ab            a change side by side with its baseline: `attnbench bench $AB_ARGS` at AB_OLD (a commit of the carried
#                 .gitbundle, checked out under /tmp) and on this tree, AB_ROUNDS (default 2) rounds of alternating
#                 processes, then `python -m attnbench.bench.ab`'s ratio table (ab-<AB_OLD>.md and .json, which the
#                 collect script files under <gpu>/gate/; the runs, ab-old-<r>.json and ab-new-<r>.json, stay in the
#                 archive), e.g. AB_OLD=1ed63fd AB_ARGS="--op shared_context --variant triton"
#   peers         the external peers (FA-4, FlashInfer, cuEquivariance, jvp-flash-attention) beside ours and the SDPA
#                 backends: one `attnbench $PEERS_RUN` (default run: checks against float64, then timings) per line of
#                 the list below, files <op>-peers-<name>-<gpu>.*, filed as results/<gpu>/<op>/peers-<name>.*; the
#                 libraries come from `scripts/peer_wheels.sh collect` on this warm machine (/tmp/site; a library
#                 that is not there is listed as unavailable with the reason); PEERS_ONLY="fa4 decode" runs those
#                 lines, PEERS_ARGS="--match ^vecmat" is added to each; PEERS_BUDGET (default 540) is the seconds since this script started after which no line
#                 starts, and each line is stopped (SIGTERM: its finished rows kept) when the budget runs out
#   asv           an asv run on this commit (ASV_BENCH=regex: those benchmarks only); with
#                 ASV_REPORTS=DIR it records the numbers of the
#                 `attnbench run` JSONs in DIR (same commit, same machine) instead of timing again
#
# For the lent GPU machine (offline), first, here: ../shared/device/wheelhouse.sh .wheelhouse and
# git bundle create .gitbundle main; carry both. One call has 10 minutes: split the stages.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
stages=${*:-tests bench graphs capabilities sanitize asv}
ART=$(mktemp -d)
trap 'tar czf "$OUT/gpu-gate-${stages// /-}.tgz" -C "$ART" .' EXIT
# Stopped by `timeout` (TERM to the process group), bash runs the EXIT trap at once, and archives while the running
# step, which got the TERM too, may still be writing what it finished: a call lost a finished bench shard's JSON so.
# Around the stages whose steps run in the foreground of this process group (bench, graphs, capabilities, ab) a TERM
# trap makes bash let the step exit first. Not around the others: a step under a `timeout` of its own is in a group
# of its own and never sees the TERM (bash would wait it out), and `wait` on background jobs returns at a trapped
# signal anyway.
finish_steps_on_term() { trap 'exit 143' TERM; }
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $stages " == *" $1 "* ]]; }

if compgen -G ".wheelhouse/*.whl" >/dev/null; then
  python3 -m pip install --no-index --no-deps -q .wheelhouse/*.whl 2>&1 | grep -v "^WARNING" || true
fi
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | grep -v "^WARNING" || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$ART/nvidia-smi.csv"
machine=$(python3 -c "from attnbench.bench.roofline import machine_slug; print(machine_slug('cuda'))")
echo "$machine" | tee "$ART/machine.txt"
attnbench calibrate | tee "$ART/calibration.txt"
ops=${OPS:-$(python3 -c "import attnbench; print(' '.join(attnbench.all_operators()))")}

if has tests; then
  # Correctness at the default launch configs (no tuning sweep per shape); the perf gates and the
  # pytest-benchmark timings retune (tests/attention/conftest.py: tuned_kernels); `attnbench run` below
  # verifies the tuned configs on the anchor cases.
  # TESTS_MARK='gpu and not perf' runs the correctness tests (they may share the GPU with other work), 'gpu and
  # perf' the timed ones (alone on the GPU); TESTS_TIMEOUT stops pytest in time for the archive. TESTS_PROCS=N
  # deals the selected tests round-robin to N pytest processes side by side (correctness only: the attention
  # tests take about 20 minutes in one process, mostly compiling; logs and records gpu-tests-<i>.*).
  run_tests() {  # run_tests SUFFIX [pytest args]: one pytest process, its log and records in $ART
    local suffix=$1; shift
    ATTNBENCH_AUTOTUNE=0 timeout "${TESTS_TIMEOUT:-0}" python3 -m pytest -m "${TESTS_MARK:-gpu}" -q -p no:cacheprovider \
        -rA --junitxml "$ART/gpu-tests$suffix.xml" --benchmark-json "$ART/pytest-benchmark$suffix.json" \
        --benchmark-timer attnbench.bench.timing.cuda_synchronized_clock "$@" >"$ART/gpu-tests$suffix.log" 2>&1
  }
  procs=${TESTS_PROCS:-1}
  if ((procs > 1)); then
    # shellcheck disable=SC2086
    python3 -m pytest -m "${TESTS_MARK:-gpu}" --co -q -p no:cacheprovider ${TESTS:-} | grep "::" >"$ART/gpu-test-ids.txt"
    pids=()
    for ((i = 0; i < procs; i++)); do
      # one id a line: ids hold spaces (parametrize ids such as "B2 H8 N64 D32")
      mapfile -t ids < <(awk -v n="$procs" -v i="$i" 'NR % n == i' "$ART/gpu-test-ids.txt")
      run_tests "-$i" "${ids[@]}" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  else
    # shellcheck disable=SC2086
    run_tests "" ${TESTS:-} || status=1
  fi
  grep -hE "^(FAILED|ERROR)|^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed)" "$ART"/gpu-tests*.log
fi
finish_steps_on_term
if has bench; then
  for op in $ops; do
    name="$op${TAG:+-$TAG}"
    if [[ -n "${WARM:-}" ]]; then  # compile ahead in WARM processes (WARM_ARGS: the run's --cases/--match/--mode)
      # shellcheck disable=SC2086
      attnbench warm --op "$op" --procs "$WARM" ${WARM_ARGS:-} >"$ART/$name-warm.log" 2>&1
      tail -n 1 "$ART/$name-warm.log"
    fi
    # shellcheck disable=SC2086
    attnbench "${RUN:-run}" --op "$op" ${RUN_ARGS:-} --json "$ART/$name-$machine.json" 2>"$ART/$name-progress.log" \
        | tee "$ART/$name-$machine.txt"
    status=$((status | $?))
  done
fi
if has graphs; then
  attnbench bench --op jvp_attention --graphs --variant triton --variant triton_fused --variant sdpa_math \
      --mode fwd_jvp --mode hvp_fwd_rev --mode hvp_rev_rev --json "$ART/jvp_attention-graphs-$machine.json" \
      2>"$ART/jvp_attention-graphs-progress.log" | tee "$ART/jvp_attention-graphs-$machine.txt" | tail -n 30
  status=$((status | $?))
fi
if has capabilities; then
  attnbench capabilities --json "$ART/capabilities-$machine.json" --markdown "$ART/capabilities-$machine.md" \
      2>"$ART/capabilities-progress.log" | tee "$ART/capabilities-$machine.txt"
  status=$((status | $?))
fi
trap - TERM
if has sanitize; then
  # compute-sanitizer memcheck over each operator's odd case set (`attnbench check --cases odd`: lengths off
  # every block, head dims in masked column blocks, odd channel counts, empty segments and buffers, batch sums
  # over ragged ranges), every output against float64, through its Triton variants and forced routes; a route
  # this GPU cannot run is left out with the reason (runnable).
  runnable() {
    python3 - "$@" <<'PY'
import sys
import torch
import attnbench
op = attnbench.get(sys.argv[1])
for name in sys.argv[2:]:
    reason = op.variant(name).unavailable_reason(torch.device("cuda"))
    print("" if reason else f"--variant {name}", end=" ")
    if reason:
        print(f"sanitize: {op.name} {name} left out: {reason}", file=sys.stderr)
PY
  }
  : >"$ART/sanitize.log"
  # One memcheck process per operator and variant (OPS limits the operators; SANITIZE_ARGS is passed on, split into
  # words: SANITIZE_ARGS='--match fp16$' runs a part of a set). Memcheck is bound by the host, so SANITIZE_JOBS
  # processes (default: 6) run side by side; each job's log is sanitize-<op>-<variant>.log, and the
  # stage fails when any job does (memcheck's exit status, a check past its float64 bound, or SANITIZE_TIMEOUT).
  # What it takes is in docs/gpu-gate.md.
  jobs=()
  for target in "flash triton triton@tiles triton@tma triton@hopper triton@decode triton@dq-atomic triton@dq-tma-atomic triton@dkdv-tiles triton@dkdv-split triton@dkdv-hopper triton@dkdv-per-head triton@dq-split triton@copies triton@grouped-copies" \
      "jvp_attention triton triton_fused" \
      "shared_context triton triton_composed triton@splits1 triton@splits32" \
      "sparse triton triton@segment triton@all-rows triton@two-launch triton@fused-dense triton@channelwise triton@matrix-units triton@gather-kernel triton@unfolded triton@cublas-pair triton@split-matmul"; do
    op=${target%% *}
    [[ " $ops " == *" $op "* ]] || continue
    # shellcheck disable=SC2086
    for variant in $(runnable $target 2>>"$ART/sanitize.log" | sed 's/--variant //g'); do
      # SANITIZE_ONLY="sparse:triton flash:triton@tma" keeps those jobs alone (a rerun of a part)
      # SANITIZE_PARTS="^mul ^outer ..." runs each job as one process per case regex (a fresh process each: a
      # memcheck process's device memory grows with the cases it has run, and sparse's whole set outgrew the card)
      if [[ -z "${SANITIZE_ONLY:-}" || " $SANITIZE_ONLY " == *" $op:$variant "* ]]; then
        for part in ${SANITIZE_PARTS:-.}; do jobs+=("$op $variant $part"); done
      fi
    done
  done
  sanitize_one() {  # sanitize_one OP VARIANT PART: one memcheck job, its log in $ART
    local op=$1 variant=$2 part=$3 modes="" log="$ART/sanitize-$1-${2//@/-}.log" match=()
    if [[ $part != . ]]; then
      match=(--match "$part")
      log="$ART/sanitize-$1-${2//@/-}-$(tr -c 'A-Za-z0-9_\n-' '_' <<<"$part").log"
    fi
    [[ $op == flash ]] && modes="--mode fwd --mode bwd"  # fwd_bwd launches the same kernels again
    # shellcheck disable=SC2086
    # Without torch's caching allocator every tensor is its own allocation, so memcheck sees each tensor's bounds
    # (not a pooled block's) and a job holds only its live tensors: side by side, cached pools ran the card out of
    # memory (measured: 10 jobs beside two pytest processes, every failure an allocation).
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 ATTNBENCH_AUTOTUNE=0 timeout "${SANITIZE_TIMEOUT:-540}" compute-sanitizer --tool memcheck --error-exitcode 1 \
        $SANITIZE_FILTER python3 -m attnbench check --quiet --device cuda --cases odd --op "$op" $modes --variant "$variant" \
        "${match[@]}" ${SANITIZE_ARGS:-} >"$log" 2>&1
    local rc=$?
    echo "== memcheck check --op $op --cases odd $modes --variant $variant ${match[*]}: exit $rc; $(grep -h "ERROR SUMMARY" "$log" | tail -n 1); $(grep -h "^summary:" "$log" | tail -n 1)"
    return $rc
  }
  # PyTorch's own kernels (the float64 oracle, elementwise glue: all in at::native) are not under test and
  # only slow memcheck down; they run uninstrumented where this compute-sanitizer can exclude kernels by name.
  # Ours (Triton's, named after their jit functions) and the libraries they call (cuBLAS) stay checked.
  # SANITIZE_EXCLUDE=none instruments everything.
  SANITIZE_FILTER=""
  # (the help is read whole first: grep -q closing the pipe early fails the pipeline under pipefail)
  if [[ ${SANITIZE_EXCLUDE:-kns=native} != none && $(compute-sanitizer --help 2>&1) == *--kernel-name-exclude* ]]; then
    SANITIZE_FILTER="--kernel-name-exclude ${SANITIZE_EXCLUDE:-kns=native}"
  fi
  echo "sanitize: memcheck ${SANITIZE_FILTER:-on every kernel}" | tee -a "$ART/sanitize.log"
  export -f sanitize_one
  export ART SANITIZE_ARGS SANITIZE_TIMEOUT SANITIZE_FILTER
  printf '%s\n' "${jobs[@]}" | xargs -r -P "${SANITIZE_JOBS:-6}" -L 1 bash -c 'sanitize_one "$0" "$1" "$2"' \
      | tee -a "$ART/sanitize.log"
  status=$((status | ${PIPESTATUS[1]}))
fi
if has traffic; then
  # One `attnbench traffic` per operator, each given what is left of TRAFFIC_BUDGET (seconds since this script started,
  # install and calibration included); its parts (one ncu process each) that finish are kept in the JSON, the rest
  # say "not profiled". ncu's own CSV and the driver's files stay in the archive under traffic-raw/ (not filed):
  # `attnbench traffic --rebuild DIR --json OUT` rewrites a JSON from them.
  for op in $ops; do
    name="$op-traffic${TAG:+-$TAG}"
    left=$(( ${TRAFFIC_BUDGET:-540} - SECONDS ))
    if (( left < 60 )); then
      echo "traffic: $op not started, ${left}s of TRAFFIC_BUDGET left" | tee "$ART/$name-progress.log"
      status=1
      continue
    fi
    # shellcheck disable=SC2086
    attnbench traffic --op "$op" ${TRAFFIC_ARGS:-} --budget "$left" --keep-raw "$ART/traffic-raw/$name" \
        --json "$ART/$name-$machine.json" 2>"$ART/$name-progress.log" | tee "$ART/$name-$machine.txt"
    status=$((status | $?))
  done
fi
if has ab; then
  finish_steps_on_term
  # a folder of this gate's own: gates side by side on one host each check their old commit out (a shared path was
  # removed and cloned again under the others' running processes)
  old_root=$(mktemp -d /tmp/attnbench-ab-old.XXXXXX) || exit 1
  old_tree=$old_root/tree
  if [[ -z "${AB_OLD:-}" || ! -f .gitbundle ]]; then
    echo "gpu_gate: ab needs AB_OLD=<commit> and a carried .gitbundle (git bundle create .gitbundle main)" >&2
    status=1
  elif git clone -q .gitbundle "$old_tree" && git -C "$old_tree" checkout -q "$AB_OLD"; then
    for ((round = 1; round <= ${AB_ROUNDS:-2}; round++)); do
      order="old new"
      ((round % 2 == 0)) && order="new old"  # no side always runs first (the GPU's clocks and caches drift)
      for side in $order; do
        tree=$PWD
        [[ $side == old ]] && tree=$old_tree
        # the old side imports its own package: its tree first on the path, this checkout's editable install after
        # shellcheck disable=SC2086
        (cd "$tree" && PYTHONPATH=$tree python3 -m attnbench bench ${AB_ARGS:-} --quiet \
            --json "$ART/ab-$side-$round.json" >"$ART/ab-$side-$round.txt" 2>"$ART/ab-$side-$round.log")
        rc=$?
        status=$((status | rc))  # a failed or wrong row fails the gate, as in the bench stage
        echo "ab: $side round $round done at $SECONDS s (rc $rc)"
      done
    done
    python3 -m attnbench.bench.ab $(compgen -G "$ART/ab-old-*.json") -- $(compgen -G "$ART/ab-new-*.json") \
        --json "$ART/ab-$AB_OLD.json" --markdown "$ART/ab-$AB_OLD.md"
    status=$((status | $?))
  else
    echo "gpu_gate: ab: cannot check out $AB_OLD from .gitbundle (git's message above)" >&2
    status=1
  fi
  rm -rf "$old_root"
  trap - TERM
fi
if has peers; then
  eval "$(bash scripts/peer_wheels.sh env)"
  export PYTHONPATH
  # name | op | the run's arguments
  peer_runs="fa4|flash|--cases anchor --mode fwd --mode bwd --variant triton --variant sdpa_flash --variant sdpa_cudnn --variant fa4 --variant fa4_deterministic
decode|flash|--cases decode --mode fwd --variant triton --variant sdpa_flash --variant sdpa_cudnn --variant flashinfer
cascade|shared_context|--cases anchor --variant triton --variant fold_flash --variant fold_cudnn --variant flashinfer_cascade
tabpfn|shared_context|--cases tabpfn --variant triton --variant fold_flash --variant fold_cudnn --variant flashinfer_cascade
cueq|sparse|--cases anchor --variant triton --variant cuequivariance
layer|sparse|--cases layer --variant triton --variant cuequivariance
cueq-routes|sparse|--cases anchor --match ^vecsca.L[23] --variant triton --variant triton@fused-dense --variant cuequivariance
channelwise|sparse|--cases anchor --match ^vecsca.L[23] --variant triton --variant triton@channelwise --variant cuequivariance
jvp|jvp_attention|--cases host --mode fwd_jvp --variant triton --variant triton_fused --variant sdpa_math --variant jvp_flash"
  attnbench list 2>&1 | grep -E "^[a-z_]+:|^  (fa4|fa4_deterministic|flashinfer|flashinfer_cascade|cuequivariance|jvp_flash) " \
      | tee "$ART/peers-available.txt"
  set -f  # the lines' regexes ([23]) are words, not file patterns
  while IFS='|' read -r name op args; do
    [[ -z "${PEERS_ONLY:-}" || " $PEERS_ONLY " == *" $name "* ]] || continue
    left=$(( ${PEERS_BUDGET:-540} - SECONDS ))
    if (( left < 30 )); then
      echo "peers: $name not started, ${left}s of PEERS_BUDGET left" | tee -a "$ART/peers-skipped.txt"
      status=1
      continue
    fi
    # shellcheck disable=SC2086
    # -k: a library's native build (a JIT compile) holds SIGTERM until it returns; SIGKILL 20 s later ends it, and
    # the JSON keeps the rows finished before. </dev/null: the loop's list is on stdin
    timeout -k 20 "$left" attnbench "${PEERS_RUN:-run}" --op "$op" $args ${PEERS_ARGS:-} \
        --json "$ART/$op-peers-$name-$machine.json" </dev/null 2>"$ART/$op-peers-$name-progress.log" | tee "$ART/$op-peers-$name-$machine.txt" | tail -n 25
    rc=${PIPESTATUS[0]}
    echo "peers: $name exit $rc at $SECONDS s"
    status=$((status | rc))
  done <<<"$peer_runs"
  set +f
fi
if has asv; then
  git config --global --add safe.directory "$PWD" 2>/dev/null
  # asv files results under a commit it must find in the repo. The device tool's copy of .git
  # cannot resolve HEAD, so history travels as a bundle: `git bundle create .gitbundle main`.
  # The copy's own .git may also resolve to an older commit (measured: asv filed a run of this tree
  # under the commit before), so a carried bundle always wins.
  if [[ -f .gitbundle ]]; then
    rm -rf .git && git init -q && git fetch -q .gitbundle "+refs/heads/*:refs/heads/*" \
      && git symbolic-ref HEAD refs/heads/main
  fi
  commit=$(git rev-parse -q --verify "HEAD^{commit}") || { echo "asv: no git history here (carry .gitbundle)"; exit 1; }
  asv machine --yes --machine "$machine" >/dev/null
  # ASV_BENCH=regex runs only the matching benchmarks (results of a commit accumulate). asv runs a
  # process per parameter combination: forked from a server that imported the suites (forkserver) that
  # is ~12x faster than a fresh interpreter each (spawn: ~0.5 s a combination on the H200 machine, so
  # every suite together took longer than one call; measured on a CPU: the sparse speedup suite's 1152
  # combinations 107 s -> 8.9 s, all suites 66 s; with a faked measurement that gives sparse points a
  # number: its 1440 x 5 anchor points and 1152 speedups in 62 s, the faked 576 x 5 and 288 recorded).
  # ASV_LAUNCH=spawn goes back.
  ATTNBENCH_ASV_REPORTS=${ASV_REPORTS:-} asv run -E existing:python3 --set-commit-hash "$commit" --machine "$machine" \
      --launch-method "${ASV_LAUNCH:-forkserver}" --show-stderr ${ASV_BENCH:+--bench "$ASV_BENCH"} 2>&1 | tee "$ART/asv-run.log" | tail -n 30
  status=$((status | $?))
  grep -q "Traceback" "$ART/asv-run.log" && status=1
  tar czf "$ART/asv-results.tgz" results/asv
fi
exit $status
