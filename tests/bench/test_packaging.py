"""The wheel and sdist carry the package as designed: the kernels inside it as attnbench.kernels
(never a top-level ``kernels`` module, a name another PyPI package owns); the wheel holds no
tests or suites, and the sdist holds the whole test gate with everything it needs (MANIFEST.in)."""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(kind, out):
    subprocess.run([sys.executable, "-m", "build", f"--{kind}", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True)
    return next(out.glob("*.whl" if kind == "wheel" else "*.tar.gz"))


def test_wheel_layout(tmp_path):
    wheel = zipfile.ZipFile(build("wheel", tmp_path))  # one build: every check below reads the same wheel
    names = wheel.namelist()
    assert "attnbench/kernels/attention/flash_fwd.py" in names
    assert "attnbench/kernels/attention/flash_bwd.py" in names
    assert "attnbench/shared_context/spec.py" in names and "attnbench/bench/runner.py" in names
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "suites/"))]
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))  # MIT, as declared
    assert "MIT License" in wheel.read(license_file).decode()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "attnbench = attnbench.cli:main" in wheel.read(entry_points).decode()


def test_sdist_has_sources(tmp_path):
    names = tarfile.open(build("sdist", tmp_path)).getnames()
    assert any(n.endswith("attnbench/kernels/attention/flash_fwd.py") for n in names)
    assert any(n.endswith("pyproject.toml") for n in names)


def clean_copy(dest):
    """The tree as a fresh checkout has it: without build/ or the *.egg-info whose cached
    SOURCES.txt would put files in the sdist that MANIFEST.in no longer asks for."""
    if (ROOT / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.split("\0")
        for name in filter(None, listed):
            if (ROOT / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, dest / name)
    else:  # an unpacked sdist
        shutil.copytree(ROOT, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", ".venv"))
    return dest


def test_sdist_runs_its_own_tests(tmp_path):
    """Unpacked, the sdist holds every test (tests/ and its family folders, each with its __init__.py and
    conftest.py) and suite file of this tree, and pytest collects the whole gate there without an error (a
    missing conftest.py or suites/ gave 179 errors) and runs a test that imports the asv suites."""
    source = clean_copy(tmp_path / "checkout")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(source)], check=True, capture_output=True)
    with tarfile.open(next((tmp_path / "dist").glob("*.tar.gz"))) as sdist:
        sdist.extractall(tmp_path / "unpacked", filter="data")
    tree = next((tmp_path / "unpacked").iterdir())
    for folder, pattern in (("tests", "*.py"), ("suites", "*.py"), ("scripts", "*.sh")):
        # every subfolder too: the tests live in tests/<family>/
        missing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob(pattern)
                         if "__pycache__" not in p.parts and not (tree / p.relative_to(ROOT)).exists())
        assert not missing, f"{folder}/ files missing from the sdist: {missing}"
    families = sorted({p.parent for p in (ROOT / "tests").rglob("test_*.py") if "__pycache__" not in p.parts})
    assert len(families) > 1, families  # the walk above saw the subfolders
    for family in families:  # each test folder is a package with its conftest: module names stay unique
        for name in ("__init__.py", "conftest.py"):
            assert (tree / family.relative_to(ROOT) / name).is_file(), family.relative_to(ROOT) / name
    for name in ("README.md", "asv.conf.json", "results/README.md", "tests/conftest.py", "tests/__init__.py"):
        assert (tree / name).is_file(), name
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "test_suite_parameters_match_the_operator and flash"],
                         cwd=tree, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout and "error" not in run.stdout.lower(), run.stdout[-3000:]
