"""Which code produced a result: the package version, the git commit of its source tree where it is one (and
whether the package's files differ from it), and a hash of the source itself, which names the code where git cannot
(the GPU machine's copy of the tree, an installed wheel or sdist). Result files carry it as "code" so that parts of
a grid measured on different commits, or a table read months later, say what they measured.
"""
import functools
import hashlib
import subprocess
from pathlib import Path

__all__ = ["code_version", "describe"]


def _source_files() -> dict:
    """{module path ("attnbench/kernels/x.py"): file} of the package's Python sources."""
    import attnbench

    root = Path(attnbench.__file__).parent
    return {f"attnbench/{path.relative_to(root).as_posix()}": path
            for path in root.rglob("*.py") if "__pycache__" not in path.parts}


def _git(folder: Path, *args):
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """{"version", "commit" (None outside a git checkout of the package), "dirty" (its files differ from the
    commit; None without one), "source_sha256" (the first 16 hex digits over every source file's path and bytes)}."""
    import attnbench

    files = _source_files()
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].read_bytes() + b"\0")
    package = Path(attnbench.__file__).parent
    commit = dirty = None
    # a checkout of this package, not some other repository the package happens to sit in
    if _git(package, "ls-files", "--error-unmatch", "__init__.py") is not None:
        commit = _git(package, "rev-parse", "HEAD")
        if commit is not None:
            status = _git(package, "status", "--porcelain", "--untracked-files=no", "--",
                          *sorted({str(p.parent) for p in files.values()}))
            dirty = None if status is None else bool(status)
    return {"version": attnbench.__version__, "commit": commit, "dirty": dirty,
            "source_sha256": digest.hexdigest()[:16]}


def describe(code) -> str:
    """One line for a report header: "attnbench 0.1.0, commit 1234abc (source 89ab...)", "+ local changes" where
    the tree differed from its commit."""
    if not isinstance(code, dict):
        return "unknown (the result file predates this record)"
    commit = code.get("commit")
    where = f"commit {commit[:7]}{' + local changes' if code.get('dirty') else ''}" if commit else "no git commit"
    return f"attnbench {code.get('version')}, {where} (source {code.get('source_sha256')})"
