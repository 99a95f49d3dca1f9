"""attnbench.bench.provenance: the code a result file names (its "code" record, and the report's "Code:" line)."""
import json
import subprocess
from pathlib import Path

import attnbench
from attnbench.bench import provenance
from attnbench.cli import main

ROOT = Path(attnbench.__file__).parent.parent


def _head():
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 and (ROOT / ".git").exists() else None


def test_this_checkout_is_named():
    """In a git checkout the commit is HEAD's; outside one (the sdist's own test run) there is none; the source
    hash is there either way."""
    code = provenance.code_version()
    assert code["version"] == attnbench.__version__
    assert len(code["source_sha256"]) == 16 and int(code["source_sha256"], 16) >= 0
    head = _head()
    assert code["commit"] == head
    assert (code["dirty"] is None) == (head is None)


def test_the_source_hash_follows_the_files_not_their_order(tmp_path, monkeypatch):
    files = {}
    for name, text in (("attnbench/a.py", "x = 1\n"), ("attnbench/kernels/b.py", "y = 2\n")):
        path = tmp_path / name.replace("/", "_")
        path.write_text(text)
        files[name] = path

    def version(source):
        monkeypatch.setattr(provenance, "_source_files", lambda: source)
        return provenance.code_version.__wrapped__()["source_sha256"]

    first = version(files)
    assert version(dict(reversed(list(files.items())))) == first
    files["attnbench/kernels/b.py"].write_text("y = 3\n")
    assert version(files) != first
    renamed = {"attnbench/c.py" if k == "attnbench/a.py" else k: v for k, v in files.items()}
    assert version(renamed) != version(files)


def test_result_files_carry_it(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["check", "--quiet", "--op", "flash", "--mode", "fwd", "--match", "fp32", "--variant",
                 "reference", "--json", str(path)]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["code"] == provenance.code_version()
    assert main(["report", str(path)]) == 0
    assert f"Code: {provenance.describe(provenance.code_version())}." in capsys.readouterr().out


def test_describe():
    base = {"version": "1.2", "commit": "c0ffee" + "0" * 34, "dirty": False, "source_sha256": "ab" * 8}
    assert provenance.describe(base) == "attnbench 1.2, commit c0ffee0 (source abababababababab)"
    source = "(source abababababababab)"
    assert provenance.describe(dict(base, dirty=True)).endswith(f"commit c0ffee0 + local changes {source}")
    assert provenance.describe(dict(base, commit=None, dirty=None)) == f"attnbench 1.2, no git commit {source}"
    assert provenance.describe(None).startswith("unknown")
