"""The wheel and sdist carry the package as designed: kernels/ installed as attnbench.kernels
(never as a top-level ``kernels`` module, a name another PyPI package owns), and no tests or suites."""
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(kind, out):
    subprocess.run([sys.executable, "-m", "build", f"--{kind}", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True)
    return next(out.glob("*.whl" if kind == "wheel" else "*.tar.gz"))


def test_wheel_layout(tmp_path):
    names = zipfile.ZipFile(build("wheel", tmp_path)).namelist()
    assert "attnbench/kernels/flash_fwd.py" in names
    assert "attnbench/kernels/flash_bwd.py" in names
    assert "attnbench/operators/flash/triton.py" in names
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "suites/"))]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "attnbench = attnbench.cli:main" in zipfile.ZipFile(build("wheel", tmp_path / "again")).read(entry_points).decode()


def test_sdist_has_sources(tmp_path):
    names = tarfile.open(build("sdist", tmp_path)).getnames()
    assert any(n.endswith("kernels/flash_fwd.py") for n in names)
    assert any(n.endswith("pyproject.toml") for n in names)
