"""scripts/asv_backfill.py on a CPU: two landed kernel commits (the newest, and the newest from before the layout
moves, when the kernels were the top-level kernels/ folder) are each installed editable into a scratch environment
and recorded by asv with the current suites, the numbers coming from a made-up `attnbench run` report
(ATTNBENCH_ASV_REPORTS) since nothing can be timed here. The history comes from a git bundle as on the GPU machine,
the results go to a temporary folder, and the scratch environment sees this environment's packages but not its
attnbench."""
import ast
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "asv_backfill.py"
MACHINE = "backfill-test"
POINTS = {("B1024 H4 Lq2 ctx2048 buf32 D32 bf16", "triton"): 0.5, ("B256 H4 Lq1 ctx512 buf0 D32 bf16", "split"): 1.5}
LATENCY = "shared_context.SharedContextAnchor.track_latency_ms"

# Asked through package metadata, not importlib.util.find_spec: find_spec("pip") runs setuptools' distutils shim's
# pip hook, which turns the shim off for the whole process, and torch.compile's C++ build (import setuptools) then
# failed in every later test of the same pytest worker.
for needed in ("asv", "asv-runner", "pip", "setuptools"):
    try:
        importlib.metadata.distribution(needed)
    except importlib.metadata.PackageNotFoundError:
        pytestmark = pytest.mark.skip(reason=f"no {needed} in this environment")


@pytest.fixture(scope="module")
def backfill():
    return load_script("scripts/asv_backfill.py")


def git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def setting(tmp_path_factory, backfill):
    """A bundle of this checkout's history as `main`, a scratch environment, a report, and the two commits."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("no git history here (an unpacked sdist?)")
    tmp = tmp_path_factory.mktemp("backfill")
    history = tmp / "history.git"
    git("clone", "-q", "--bare", str(ROOT), str(history))
    git("update-ref", "refs/heads/main", git("rev-parse", "HEAD"), cwd=history)
    git("bundle", "create", "-q", str(tmp / ".gitbundle"), "main", cwd=history)
    commits = backfill.kernel_commits(history, "main")
    old = [c for c in commits if subprocess.run(["git", "cat-file", "-e", f"{c}:kernels"], cwd=history).returncode == 0]
    if not commits or not old:
        pytest.skip("this checkout's history has no kernel commits from before the layout moves (a shallow clone?)")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # a plain path line: this environment's packages, without running its .pth files (its editable attnbench)
    Path(site, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    reports = tmp / "reports"
    reports.mkdir()
    rows = [{"op": "shared_context", "case": case, "variant": variant, "mode": "fwd", "tflops": 1.0, "gbps": 2.0,
             "roofline_pct": 3.0, "peak_mem_bytes": 2**21, "eager": {"median_ms": ms + 0.25},
             "timing": {"median_ms": ms, "iqr_ms": 0.01, "method": "cuda-events"}} for (case, variant), ms in
            POINTS.items()]
    (reports / "shared_context-anchor-cpu.json").write_text(json.dumps(
        {"status": "complete", "machine": {"device_name": platform.processor() or "cpu"}, "bench": rows}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNBENCH_ASV_REPORTS")}
    env["HOME"] = str(tmp)  # asv machine writes ~/.asv-machine.json
    return {"tmp": tmp, "python": python, "reports": reports, "env": env, "newest": commits[0], "old": old[0],
            "commits": commits, "results": tmp / "results"}


def running(python):
    """Processes of the scratch environment's interpreter still alive (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(python).encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            pass
    return found


def run(setting, *args):
    command = [sys.executable, str(SCRIPT), "--bundle", str(setting["tmp"] / ".gitbundle"), "--machine", MACHINE,
               "--python", str(setting["python"]), "--results-dir", str(setting["results"]),
               "--work", str(setting["tmp"] / "work"), *args]
    return subprocess.run(command, cwd=ROOT, env=setting["env"], capture_output=True, text=True, timeout=600)


def test_it_lists_the_newest_first_parent_kernel_commits(setting):
    done = run(setting, "--list", "--count", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    listed = [line.split()[1] for line in done.stdout.splitlines() if ": left " in line]
    assert listed == [c[:8] for c in setting["commits"][:3]]
    first_parent = git("log", "--first-parent", "--format=%H", "-n", "40", "HEAD").split()
    assert setting["commits"][0] in first_parent  # the line asv's dashboard draws


def test_two_commits_get_a_result_file_each_with_their_numbers(setting):
    shas = [setting["newest"], setting["old"]]
    part = ["--parts", "shared_context", "--bench", "SharedContextAnchor.track_latency_ms",
            "--reports", str(setting["reports"])]
    done = run(setting, *shas, *part)
    assert done.returncode == 0, done.stdout + done.stderr
    for sha in shas:
        assert f"installed {setting['tmp'] / 'work' / 'trees' / sha[:12]}" in done.stdout
    assert f"installed {ROOT} again" in done.stdout

    files = sorted((setting["results"] / MACHINE).glob("*-existing-*.json"))
    assert len(files) == 2 and (setting["results"] / MACHINE / "machine.json").is_file()
    recorded = {}
    for path in files:
        data = json.loads(path.read_text())
        assert path.name.startswith(data["commit_hash"][:8])
        values, params = data["results"][LATENCY][:2]
        cases, variants, modes = ([json.loads(p.replace("'", '"')) for p in axis] for axis in params)
        grid = [(c, v) for c in cases for v in variants for m in modes]
        recorded[data["commit_hash"]] = {point: x for point, x in zip(grid, values) if x == x}
    assert recorded == {sha: POINTS for sha in shas}

    log = (setting["tmp"] / "work" / "logs" / f"{shas[1][:8]}-shared_context.log").read_text()
    assert "asv: skipped: NotImplementedError('no row of it in the shared_context runs of a" in log
    where = subprocess.run([str(setting["python"]), "-c", "import attnbench; print(attnbench.__file__)"], cwd="/",
                           capture_output=True, text=True, env=setting["env"]).stdout.strip()
    assert where == str(ROOT / "attnbench" / "__init__.py")  # the current tree is installed again

    again = run(setting, *shas, *part)  # the next call carries on: nothing is left of these two
    assert again.returncode == 0 and again.stdout.count(": done") == 2 and "nothing left" in again.stdout


def test_a_spent_budget_leaves_the_rest_for_the_next_call(setting):
    sha = next(c for c in setting["commits"] if c not in (setting["newest"], setting["old"]))
    done = run(setting, sha, "--parts", "shared_context", "--reports", str(setting["reports"]), "--budget", "1")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "budget spent, left shared_context" in done.stdout and f"left: {sha[:8]}" in done.stdout
    assert not list((setting["results"] / MACHINE).glob(f"{sha[:8]}-*.json"))


def test_a_part_stopped_at_its_timeout_is_not_run_again_unasked(setting):
    """asv saves a run's results only at its end: a part its timeout stopped left nothing and would be stopped
    again, so the next call passes it by (saying so) until it is narrowed or forced."""
    sha = [c for c in setting["commits"] if c not in (setting["newest"], setting["old"])][1]
    args = [sha, "--parts", "shared_context", "--reports", str(setting["reports"]), "--part-timeout", "1",
            "--min-part", "0"]
    done = run(setting, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shared_context: stopped at its timeout" in done.stdout and f"installed {ROOT} again" in done.stdout
    assert not list((setting["results"] / MACHINE).glob(f"{sha[:8]}-*.json"))
    assert not running(setting["python"])  # asv's forkserver, in a process group of its own, was stopped too
    again = run(setting, *args)
    assert again.returncode == 1 and "not run again (stopped at its timeout in an earlier call" in again.stdout
    assert ": installed " not in again.stdout and f"installed {ROOT} again" not in again.stdout  # that commit not


def test_the_probe_makes_the_measuring_pass_lookup_each_commit_gets_on_the_gpu(setting):
    """--probe runs suites/_anchor.plan (the lookup a GPU pass makes before it times) against each installed commit:
    a commit from before Operator.variant (the forced routes) once failed there on the GPU, after its probe said ok."""
    done = run(setting, setting["newest"], setting["old"], "--probe", "--parts", "flash", "shared_context")
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line.strip() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert len(verdicts) == 4, done.stdout
    for verdict in verdicts:  # what a part may lack is a newer variant or mode; its lookup itself must work
        assert "cannot measure" not in verdict and "fails" not in verdict and "failed" not in verdict, verdict
    # the newest kernel commit runs every part, but for variants registered since (a peer added without kernel code)
    for verdict, part in zip(verdicts[:2], ("flash", "shared_context")):
        lacking = re.fullmatch(rf"{part}: lacks variants \[(.*)\]", verdict)
        assert verdict == f"{part}: ok" or lacking, done.stdout
        for name in ast.literal_eval(f"[{lacking.group(1)}]") if lacking else ():
            there = subprocess.run(["git", "grep", "-q", f'"{name}"', setting["newest"], "--",
                                    f"attnbench/operators/{part}"], cwd=ROOT)
            assert there.returncode == 1, f"{name} was registered at {setting['newest']}: {verdict}"


def test_prewarm_runs_each_commit_from_its_worktree_before_the_passes(setting):
    """--prewarm imports each commit from its worktree (no install), the pre-layout one with attnbench.kernels mapped
    onto its top-level kernels/ as its install did, and runs the measuring pass's lookup and runner there; on this
    CPU over no case (ATTNBENCH_PREWARM_DEVICE=cpu; the anchors are too large for the interpreter)."""
    shas = [setting["newest"], setting["old"]]
    env = dict(setting["env"], ATTNBENCH_PREWARM_DEVICE="cpu")
    command = [sys.executable, str(SCRIPT), "--bundle", str(setting["tmp"] / ".gitbundle"), "--machine", MACHINE,
               "--python", str(setting["python"]), "--results-dir", str(setting["tmp"] / "prewarm-results"),
               "--work", str(setting["tmp"] / "prewarm-work"), *shas, "--parts", "shared_context", "--cases", "no such case",
               "--reports", str(setting["reports"]), "--prewarm", "2"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "prewarming 2 commit(s) at once" in done.stdout and f"{shas[0][:8]} ok, {shas[1][:8]} ok" in done.stdout, done.stdout
    for sha, kernels, runner in ((shas[0], "attnbench/kernels/__init__.py", "attnbench/bench/runner.py"),
                                 (shas[1], "kernels/__init__.py", "attnbench/runner.py")):
        tree = setting["tmp"] / "prewarm-work" / "trees" / sha[:12]
        log = (setting["tmp"] / "prewarm-work" / "logs" / f"{sha[:8]}-prewarm.log").read_text()
        assert "shared_context: warmed 0 points in" in log, log
        assert f"from {tree / 'attnbench' / '__init__.py'}, kernels from {tree / kernels}, runner {tree / runner}" in log, log
