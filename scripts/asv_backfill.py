#!/usr/bin/env python3
"""asv's history for landed commits: time older commits with the current suites (docs/dashboard.md, "History").

    python3 scripts/asv_backfill.py [REV ...] [--count 12] [--from REV] [--parts flash sparse ...] [--budget 540]

Without REVs it takes the newest --count commits on --branch's first-parent line (the commits asv's dashboard draws)
that changed kernel code: attnbench/kernels/, or kernels/ before the layout moves (3539b9c). For each commit, newest
first:

1. a git worktree of it under --work, installed editable into this environment
   (pip install --no-deps --no-build-isolation -e), checked: `import attnbench` must load the worktree's;
2. per part, one `asv run -E existing:PYTHON --set-commit-hash SHA --machine MACHINE --show-stderr --bench ...` over
   the current tree's suites/. A part is one measuring pass (a suite's measure_<part> stub: flash, flash_sweep,
   jvp_attention, shared_context, sparse) with the benchmarks built on it; it runs in a process tree of its own and
   is stopped at --part-timeout, or where the --budget runs out;
3. at the end, or on SIGTERM/SIGINT, the current tree is installed again.

Results go where asv puts them, results/asv/<machine>/<sha8>-<env>.json (or under --results-dir), the machine named
by its GPU (attnbench.bench.roofline.machine_slug); `asv machine` writes only ~/.asv-machine.json. A part whose
benchmarks the commit's result file already holds at their current versions is skipped, so the same command, run
again (the next 10-minute device call), carries on where the last stopped; --force runs them again. Exit status:
0 when nothing selected is left, 3 when the budget ran out first, 1 when a part failed or was stopped by its timeout.

The measuring pass (suites/_anchor.py) looks each operator, variant, mode and case up in the installed commit, and a
point that commit lacks is skipped with the reason. --probe checks that without a GPU: it installs each commit and
says, per part, what the commit lacks. --list only prints the commits and what is left of each.

On the offline GPU machine the working tree's .git is unusable: --bundle FILE (a `git bundle create .gitbundle main`)
is fetched into a bare repository under --work, and that repository serves the commits, the worktrees and asv.
"""
import argparse
import collections
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_PATHS = ("attnbench/kernels", "kernels")  # kernels/ held the kernels until the layout moves (3539b9c)
DEFAULT_PARTS = ("flash", "jvp_attention", "shared_context", "sparse")  # the anchors; flash_sweep on request
RESERVE_S = 45  # kept back from the budget to install the current tree again


def log(*args):
    print("backfill:", *args, flush=True)


def git(repo, *args, **kwargs):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          **kwargs).stdout.strip()


# --- the commits ---------------------------------------------------------------------------------------------

def history_repo(args):
    """The repository that serves the commits: --repo, or the bare one fetched from --bundle."""
    if not args.bundle:
        return Path(args.repo or git(ROOT, "rev-parse", "--show-toplevel")).resolve()
    repo = Path(args.work) / "history.git"
    if not repo.is_dir():
        subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True)
    git(repo, "fetch", "-q", str(Path(args.bundle).resolve()), "+refs/heads/*:refs/heads/*")
    return repo


def kernel_commits(repo, branch, start=None):
    """Full hashes, newest first, of the first-parent commits up to ``start`` (default: ``branch``) that changed
    kernel code."""
    out = git(repo, "log", "--first-parent", "--format=%H", start or branch, "--", *KERNEL_PATHS)
    return out.split()


def resolve(repo, revs):
    return [git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}") for rev in revs]


def subject(repo, sha):
    return git(repo, "log", "-1", "--format=%s", sha)


# --- the parts -----------------------------------------------------------------------------------------------

def discover(suites_dir):
    """{part: {benchmark name: asv version}} of the current suites: a part is a measuring pass (setup_cache),
    named after its stub less "measure_". asv_runner computes the versions asv will record."""
    from asv_runner._aux import update_sys_path
    from asv_runner.discovery import disc_benchmarks

    # asv_runner puts an importer of the suites first in sys.meta_path: it goes again once the suites are read,
    # so that discovering them leaves the calling process's imports as they were
    meta_path = list(sys.meta_path)
    update_sys_path(str(suites_dir))
    parts = collections.defaultdict(dict)
    try:
        for bench in disc_benchmarks(str(suites_dir)):
            module, cls = bench.name.split(".")[:2]
            stub = getattr(getattr(sys.modules[f"{suites_dir.name}.{module}"], cls), "setup_cache", None)
            if stub is not None and hasattr(stub, "op_name"):
                parts[stub.__name__.removeprefix("measure_")][bench.name] = bench.version
    finally:
        sys.meta_path[:] = meta_path
    return dict(parts)


def selected(benchmarks, pattern):
    return {name: v for name, v in benchmarks.items() if not pattern or re.search(pattern, name)}


def bench_regex(names):
    """asv's --bench for exactly these benchmarks (asv searches a parameterized one as ``name(params)``)."""
    return "^(" + "|".join(re.escape(n) for n in sorted(names)) + r")(\(|$)"


def result_file(results_dir, machine, sha):
    """This commit's asv result file on ``machine`` (asv names it <sha8>-<environment>.json), or None."""
    for path in sorted(glob.glob(str(Path(results_dir) / machine / f"{sha[:8]}-*.json"))):
        with open(path) as f:
            data = json.load(f)
        if data.get("commit_hash") == sha:
            return path, data
    return None


def recorded(results_dir, machine, sha):
    """{benchmark name: version} that the commit's result file holds."""
    found = result_file(results_dir, machine, sha)
    if not found:
        return {}
    data = found[1]
    column = data.get("result_columns", []).index("version") if "version" in data.get("result_columns", []) else None
    return {name: (row[column] if column is not None and column < len(row) else None)
            for name, row in data.get("results", {}).items()}


def left_of(benchmarks, have):
    return {n for n, v in benchmarks.items() if have.get(n) != v}


def counts(results_dir, machine, sha, names):
    """(numbers, empty points) the commit's result file holds for ``names``."""
    found = result_file(results_dir, machine, sha)
    numbers = empty = 0
    if found:
        for name in names:
            values = (found[1]["results"].get(name) or [None])[0]
            for value in values if isinstance(values, list) else [values]:
                if isinstance(value, (int, float)) and math.isfinite(value):
                    numbers += 1
                else:
                    empty += 1
    return numbers, empty


# --- installing ----------------------------------------------------------------------------------------------

def install(python, tree):
    """Install ``tree`` editable into ``python``'s environment and check that ``import attnbench`` loads it."""
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "-e", str(tree)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/")
    where = subprocess.run([python, "-c", "import os, attnbench; print(os.path.realpath(attnbench.__file__))"],
                           check=True, capture_output=True, text=True, cwd="/").stdout.strip()
    want = os.path.realpath(Path(tree) / "attnbench" / "__init__.py")
    if where != want:
        raise RuntimeError(f"after installing {tree}, attnbench loads from {where}, not {want}")
    return where


def worktree(repo, work, sha):
    path = Path(work) / "trees" / sha[:12]
    if path.is_dir():
        try:
            if git(path, "rev-parse", "HEAD") == sha:
                return path
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(path)
        git(repo, "worktree", "prune")
    path.parent.mkdir(parents=True, exist_ok=True)
    git(repo, "worktree", "add", "-q", "--detach", "--force", str(path), sha)
    return path


def drop_worktree(repo, path):
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


# --- asv -----------------------------------------------------------------------------------------------------

def asv_config(args, repo, results_dir):
    """asv.conf.json with absolute paths: this tree's suites, the results folder, and the repository that serves
    the commits (asv reads their dates and the branch from it)."""
    with open(ROOT / "asv.conf.json") as f:
        conf = json.load(f)
    conf.update(repo=str(repo), branches=[args.branch], benchmark_dir=str(ROOT / conf["benchmark_dir"]),
                results_dir=str(results_dir), html_dir=str(ROOT / conf["html_dir"]))
    path = Path(args.work) / "asv.conf.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conf, indent=2))
    return path


def run_asv(args, conf, machine, sha, names, timeout, log_path):
    """One `asv run` of ``names`` recorded under ``sha``: (exit status or "timeout", seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for variable, value in (("ATTNBENCH_ASV_REPORTS", args.reports), ("ATTNBENCH_ASV_VARIANTS", args.variants),
                            ("ATTNBENCH_ASV_MODES", args.modes), ("ATTNBENCH_ASV_CASES", args.cases)):
        if value:
            env[variable] = str(Path(value).resolve()) if variable == "ATTNBENCH_ASV_REPORTS" else value
    command = [args.python, "-m", "asv", "--config", str(conf), "run", "-E", f"existing:{args.python}",
               "--set-commit-hash", sha, "--machine", machine, "--launch-method", args.launch_method,
               "--show-stderr", "--bench", bench_regex(names)]
    started = time.monotonic()
    with open(log_path, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: a timeout stops the benchmarks too
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            status = "timeout"
        except BaseException:  # SIGTERM, SIGINT (main turns them into SystemExit)
            stop(proc)
            raise
    return status, time.monotonic() - started


def descendants(pid):
    """The processes below ``pid`` (Linux /proc). asv starts its forkserver in a process group of its own, so
    stopping asv's group alone leaves the server behind."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
        except OSError:
            continue
        parents.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def stop(proc):
    """Stop an `asv run` and everything it started: SIGINT first (asv then stops its forkserver and benchmark
    processes itself), SIGKILL to whatever is left, each in its process group."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [proc.pid, *below, *descendants(proc.pid)]:
        try:
            group = os.getpgid(pid)
            if group != os.getpgrp():  # never this script's own group
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def stop_mark(args, sha, part):
    """A file under --work that says why this part of this commit is not run again: it was stopped at its timeout
    (asv saves a run's results only at its end, so it left nothing), or the commit did not install."""
    return Path(args.work) / f"stopped-{sha[:12]}-{part}"


def skip_reasons(log_path, top=3):
    """The most frequent skip reasons asv printed (--show-stderr), with their counts."""
    found = collections.Counter()
    with open(log_path, errors="replace") as f:
        for line in f:
            match = re.search(r"asv: skipped: NotImplementedError\((['\"])(.*)\1\)", line)
            if match:
                found[match.group(2)] += 1
    return found.most_common(top)


# --- probing -------------------------------------------------------------------------------------------------

PROBE = r"""
import importlib, json, sys
root, parts = sys.argv[1], json.loads(sys.argv[2])
import attnbench
sys.path.insert(0, root)  # after attnbench: the current tree's suites, the installed commit's attnbench
out = {}
try:
    importlib.import_module("attnbench.bench.runner")
except ImportError:
    try:
        importlib.import_module("attnbench.runner")
    except ImportError as exc:
        out = {part: f"no runner: {exc}" for part in parts}
for part, (module, labels, variants, modes) in parts.items():
    if part in out:
        continue
    stub = getattr(importlib.import_module(f"suites.{module}"), f"measure_{part}")
    try:
        op = attnbench.get(stub.op_name)
        have = [c.label for c in op.cases(stub.case_set)]
    except Exception as exc:
        out[part] = f"no {stub.op_name} {stub.case_set} set: {exc!r}"
        continue
    lacks = [f"{kind} {sorted(set(want) - set(got))}" for kind, want, got in
             (("cases", labels, have), ("variants", variants, op.variants), ("modes", modes, op.modes))
             if set(want) - set(got)]
    try:  # the measuring pass's own lookup (suites/_anchor.plan), as a GPU call would make it
        import torch
        from suites import _anchor
        planned = _anchor.plan(stub.op_name, stub.case_set, stub.variants, stub.modes, torch.device("cpu"))
        if isinstance(planned, _anchor._Points):
            lacks.append(planned.why)
    except Exception as exc:
        lacks.append(f"the measuring pass fails: {exc!r}")
    out[part] = "lacks " + ", ".join(lacks) if lacks else "ok"
print(json.dumps(out))
"""


def probe_parts(parts):
    """{part: (suite module, labels, variants, modes)} as the current suites spell them."""
    out = {}
    for part in parts:
        module = part.removesuffix("_sweep")
        suite = sys.modules[f"suites.{module}"]
        prefix = "SWEEP_" if part.endswith("_sweep") else ""
        out[part] = (module, getattr(suite, prefix + "LABELS"), getattr(suite, prefix + "VARIANTS"),
                     getattr(suite, prefix + "MODES"))
    return out


def probe(args, python, tree, parts):
    result = subprocess.run([python, "-c", PROBE, str(ROOT), json.dumps(probe_parts(parts))], capture_output=True,
                            text=True, cwd="/")
    if result.returncode:
        return {part: "import failed: " + (result.stderr.strip().splitlines() or ["?"])[-1] for part in parts}
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- prewarming ----------------------------------------------------------------------------------------------

PREWARM = r"""
import importlib, importlib.util, json, os, sys, time
tree, root, parts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


class OldKernels:
    # before the layout moves (3539b9c) the install mapped attnbench.kernels onto the top-level kernels/
    def find_spec(self, name, path=None, target=None):
        if name != "attnbench.kernels":
            return None
        folder = os.path.join(tree, "kernels")
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


# setuptools' editable finder of the tree installed in this environment maps any attnbench module the commit lacks
# (attnbench.bench before the layout moves) onto that tree: without it such an import fails, as the pass expects
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
sys.path.insert(0, tree)
if not os.path.isdir(os.path.join(tree, "attnbench", "kernels")):
    sys.meta_path.insert(0, OldKernels())
import attnbench
assert os.path.realpath(attnbench.__file__) == os.path.realpath(os.path.join(tree, "attnbench", "__init__.py")), \
    attnbench.__file__
import attnbench.kernels
sys.path.remove(tree)  # attnbench imports the rest through its package path; "suites" must be the current tree's
sys.path.insert(0, root)
import torch
from suites import _anchor
device = torch.device(os.environ.get("ATTNBENCH_PREWARM_DEVICE", "cuda"))
for part in parts:
    stub = getattr(importlib.import_module("suites." + part.removesuffix("_sweep")), "measure_" + part)
    planned = _anchor.plan(stub.op_name, stub.case_set, stub.variants, stub.modes, device)
    if isinstance(planned, _anchor._Points):
        print(f"{part}: nothing to warm: {planned.why}", flush=True)
        continue
    bench, op, cases, names, modes, _ = planned
    started = time.monotonic()
    runner = sys.modules[bench.__module__].__file__
    assert os.path.realpath(runner).startswith(os.path.realpath(tree) + os.sep), runner
    rows = bench(op, cases, device.type, variants=names, modes=modes, progress=False, verify_outputs=False, rep_ms=1)
    print(f"{part}: warmed {sum(1 for r in rows if r.timing)} points in {time.monotonic() - started:.0f} s "
          f"from {attnbench.__file__}, kernels from {attnbench.kernels.__file__}, runner {runner}", flush=True)
"""


def prewarm(args, jobs, log_dir, seconds):
    """Compile (and autotune) each commit's kernels for its parts, several commits at once, before the commits'
    one-at-a-time asv passes: Triton's cache on disk then holds the compiled kernels, and a pass takes the time
    of a commit whose kernels the previous one had compiled (22 s against 68-90 s for the flash anchors on the
    H200). ``jobs``: [(sha, worktree, parts)]. Each commit runs from its worktree on sys.path (no install: the
    environment holds one editable install at a time), through the measuring pass's own lookup
    (suites/_anchor.plan) and runner with the timing cut short; its log is <sha8>-prewarm.log. Returns
    {sha: exit status or "timeout"}."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for variable, value in (("ATTNBENCH_ASV_VARIANTS", args.variants), ("ATTNBENCH_ASV_MODES", args.modes),
                            ("ATTNBENCH_ASV_CASES", args.cases)):
        if value:
            env[variable] = value
    started, running, done = time.monotonic(), {}, {}
    waiting = list(jobs)
    try:
        while waiting or running:
            while waiting and len(running) < args.prewarm:
                sha, tree, parts = waiting.pop(0)
                out = open(log_dir / f"{sha[:8]}-prewarm.log", "w")
                proc = subprocess.Popen([args.python, "-c", PREWARM, str(tree), str(ROOT), json.dumps(parts)],
                                        cwd="/", env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                running[sha] = (proc, out)
            for sha, (proc, out) in list(running.items()):
                if proc.poll() is not None:
                    done[sha] = proc.returncode
                    out.close()
                    del running[sha]
            if time.monotonic() - started > seconds:
                for sha, (proc, out) in running.items():
                    stop(proc)
                    out.close()
                    done[sha] = "timeout"
                running = {}
                done.update({sha: "not started" for sha, _, _ in waiting})
                waiting = []
            time.sleep(0.5)
    except BaseException:
        for proc, out in running.values():
            stop(proc)
        raise
    return done


# --- the run -------------------------------------------------------------------------------------------------

def machine_name(args):
    """--machine, or the GPU's name as the gate gives it (nvidia-h100-80gb-hbm3, nvidia-h200)."""
    if args.machine:
        return args.machine
    found = subprocess.run([args.python, "-c", "from attnbench.bench.roofline import machine_slug; "
                            "print(machine_slug('cuda'))"], capture_output=True, text=True, cwd="/")
    if found.returncode:
        raise SystemExit(f"backfill: no GPU name here ({found.stderr.strip().splitlines()[-1:]}): pass --machine")
    return found.stdout.strip()


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("revs", nargs="*", help="commits to time (default: the newest --count kernel commits)")
    p.add_argument("--count", type=int, default=12, help="how many kernel commits (default 12)")
    p.add_argument("--from", dest="start", help="list kernel commits from this one back (default: --branch)")
    p.add_argument("--branch", default="main", help="the first-parent line asv draws (default main)")
    p.add_argument("--parts", nargs="+", help=f"measuring passes to run (default: {' '.join(DEFAULT_PARTS)})")
    p.add_argument("--bench", help="only the benchmarks whose name this regular expression finds")
    p.add_argument("--variants", help="ATTNBENCH_ASV_VARIANTS: time only these variants (space-separated)")
    p.add_argument("--modes", help="ATTNBENCH_ASV_MODES: time only these modes")
    p.add_argument("--cases", help="ATTNBENCH_ASV_CASES: time only the cases whose label this expression finds")
    p.add_argument("--reports", help="ATTNBENCH_ASV_REPORTS: record the `attnbench run` JSONs in this folder")
    p.add_argument("--machine", help="asv machine name (default: the GPU's, machine_slug('cuda'))")
    p.add_argument("--python", default="python3", help="the environment to install into and run (default python3)")
    p.add_argument("--results-dir", help="asv results folder (default: asv.conf.json's, results/asv)")
    p.add_argument("--repo", help="the repository that serves the commits (default: this tree's)")
    p.add_argument("--bundle", help="a git bundle to fetch the commits from instead (the offline GPU machine)")
    p.add_argument("--work", default="/tmp/attnbench-backfill", help="worktrees, asv's config, logs")
    p.add_argument("--log-dir", help="one log per commit and part (default: WORK/logs)")
    p.add_argument("--budget", type=float, default=0, help="seconds for this whole call (0: no limit)")
    p.add_argument("--part-timeout", type=float, default=0, help="seconds for one part of one commit (0: none)")
    p.add_argument("--min-part", type=float, default=60,
                   help="start a part only with this many seconds of budget left (default 60; once a part ran, the "
                        "longest it took)")
    p.add_argument("--launch-method", default="forkserver", help="asv's (default forkserver)")
    p.add_argument("--force", action="store_true", help="run parts the result files already hold")
    p.add_argument("--prewarm", type=int, default=0,
                   help="compile the kernels of the next N commits with parts left, N processes at once, before their asv "
                        "passes (0: off)")
    p.add_argument("--prewarm-timeout", type=float, default=240, help="seconds for all prewarming (default 240)")
    p.add_argument("--list", action="store_true", help="print the commits and what is left; install nothing")
    p.add_argument("--probe", action="store_true", help="install each commit and say what each part lacks there")
    args = p.parse_args(argv)
    if os.sep in args.python:  # a path: the script runs commands from other folders
        args.python = os.path.abspath(args.python)
    return args


def main(argv=None):
    args = parse(argv)
    started = time.monotonic()

    def left():
        return args.budget - (time.monotonic() - started) if args.budget else math.inf

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    Path(args.work).mkdir(parents=True, exist_ok=True)
    repo = history_repo(args)
    shas = resolve(repo, args.revs) if args.revs else kernel_commits(repo, args.branch, args.start)[:args.count]
    if not shas:
        log("no commits selected")
        return 1
    all_parts = discover(ROOT / "suites")
    parts = args.parts or [p for p in DEFAULT_PARTS if p in all_parts]
    unknown = [p for p in parts if p not in all_parts]
    if unknown:
        log(f"unknown part(s) {unknown}; the suites have {sorted(all_parts)}")
        return 2
    wanted = {p: selected(all_parts[p], args.bench) for p in parts}
    results_dir = Path(args.results_dir or ROOT / json.loads((ROOT / "asv.conf.json").read_text())["results_dir"])
    log_dir = Path(args.log_dir or Path(args.work) / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)

    if args.probe:
        return probe_all(args, repo, shas, parts)

    installed_other = False
    outcome = collections.OrderedDict()
    status = 0
    try:
        if not args.list:
            install(args.python, ROOT)  # also mends an install a cut call left on an old worktree
        machine = machine_name(args)
        conf = asv_config(args, repo, results_dir)
        if not args.list:
            subprocess.run([args.python, "-m", "asv", "--config", str(conf), "machine", "--yes", "--machine", machine],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        log(f"{len(shas)} commit(s), parts {' '.join(parts)}, machine {machine}, results in {results_dir}")

        def parts_left(sha):
            """(the parts left to run at sha, those of them an earlier call stopped: not run again without --force)"""
            have = recorded(results_dir, machine, sha)
            todo = [p for p in parts if wanted[p] and (args.force or left_of(wanted[p], have))]
            return todo, [p for p in todo if not args.force and stop_mark(args, sha, p).exists()]

        if args.prewarm and not args.list:
            jobs = []
            for sha in shas:  # the next --prewarm commits with parts left, as the loop below finds them
                todo, stopped = parts_left(sha)
                todo = [p for p in todo if p not in stopped]
                if todo and len(jobs) < args.prewarm:
                    jobs.append((sha, worktree(repo, args.work, sha), todo))
            seconds = min(args.prewarm_timeout, left() - RESERVE_S - args.min_part)
            if jobs and seconds > 0:
                log(f"prewarming {len(jobs)} commit(s) at once, {seconds:.0f} s at most")
                begun = time.monotonic()
                warmed = prewarm(args, jobs, log_dir, seconds)
                log(f"prewarmed in {time.monotonic() - begun:.0f} s: "
                    + ", ".join(f"{sha[:8]} {'ok' if warmed[sha] == 0 else warmed[sha]}" for sha, _, _ in jobs))
        estimate = {}
        for sha in shas:
            todo, stopped = parts_left(sha)
            head = f"{sha[:8]} {subject(repo, sha)[:70]}"
            if stopped:  # a part that outlasted its timeout would again: narrow it, or --force
                why = stop_mark(args, sha, stopped[0]).read_text().strip()
                log(f"{head}: {' '.join(stopped)} not run again ({why} in an earlier call; --force runs it)")
                todo = [p for p in todo if p not in stopped]
                status = status or 1
            if not todo:
                log(f"{head}: {'nothing else to run' if stopped else 'done'}")
                outcome[sha] = "stopped" if stopped else "done before"
                continue
            if args.list:
                log(f"{head}: left {' '.join(todo)}")
                outcome[sha] = "left"
                continue
            if left() - RESERVE_S < estimate.get(todo[0], args.min_part):
                log(f"{head}: budget spent, left {' '.join(todo)}")
                status = status or 3
                outcome[sha] = "left"
                continue
            tree = worktree(repo, args.work, sha)
            installed_other = True
            try:
                install(args.python, tree)
            except (subprocess.CalledProcessError, RuntimeError) as exc:
                why = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()[-1:]
                log(f"{head}: does not install: {' '.join(why)}")
                for part in todo:
                    stop_mark(args, sha, part).write_text("it did not install\n")
                drop_worktree(repo, tree)
                status, outcome[sha] = 1, "stopped"
                continue
            log(f"{head}: installed {tree}")
            finished, timed_out = True, False
            for part in todo:
                timeout = min(args.part_timeout or math.inf, left() - RESERVE_S)
                if timeout < estimate.get(part, args.min_part):
                    log(f"  {part}: budget spent")
                    status, finished = status or 3, False
                    continue
                log_path = log_dir / f"{sha[:8]}-{part}.log"
                names = sorted(wanted[part])
                rc, seconds = run_asv(args, conf, machine, sha, names, None if timeout == math.inf else timeout,
                                      log_path)
                estimate[part] = max(estimate.get(part, 0), seconds)
                numbers, empty = counts(results_dir, machine, sha, names)
                reasons = "; ".join(f"{n}x {why}" for why, n in skip_reasons(log_path))
                log(f"  {part}: {'stopped at its timeout' if rc == 'timeout' else f'asv exit {rc}'} after "
                    f"{seconds:.0f} s; {numbers} numbers, {empty} empty; log {log_path}"
                    + (f"; skips: {reasons}" if reasons else ""))
                if rc == "timeout":
                    stop_mark(args, sha, part).write_text("stopped at its timeout\n")
                    timed_out = True
                if rc != 0:
                    status, finished = 1, False
            outcome[sha] = "stopped" if timed_out else "ran" if finished else "partly"
            if finished:
                drop_worktree(repo, tree)
    finally:
        restore(args, repo, installed_other)
    left_commits = [sha[:8] for sha, what in outcome.items() if what in ("left", "partly")]
    log(f"left: {' '.join(left_commits)} (run the same command again)" if left_commits else "nothing left")
    stuck = [sha[:8] for sha, what in outcome.items() if what == "stopped"]
    if stuck:
        log(f"stopped at a timeout or not installed: {' '.join(stuck)} (narrow the part, or --force)")
    return status


def restore(args, repo, installed_other):
    """This tree installed again where another commit's install was tried (one that failed may have replaced it
    before failing), and the worktrees pruned."""
    if installed_other:
        install(args.python, ROOT)
        log(f"installed {ROOT} again")
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def probe_all(args, repo, shas, parts):
    installed_other = False
    try:
        for sha in shas:
            tree = worktree(repo, args.work, sha)
            installed_other = True
            try:
                install(args.python, tree)
                found = probe(args, args.python, tree, parts)
            except (subprocess.CalledProcessError, RuntimeError) as exc:
                found = {p: f"does not install: {getattr(exc, 'stderr', None) or exc}".strip()[:200] for p in parts}
            print(f"{sha[:8]} {subject(repo, sha)[:60]}")
            for part in parts:
                print(f"    {part}: {found.get(part, '?')}")
            drop_worktree(repo, tree)
    finally:
        restore(args, repo, installed_other)
    return 0


if __name__ == "__main__":
    sys.exit(main())
