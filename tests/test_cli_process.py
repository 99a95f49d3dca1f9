"""The CLI as a process, as a shell runs it: a reader that leaves early (``| head -2``) and Ctrl-C.
Each test starts one ``python -m attnbench`` (a few seconds of imports) on a narrow run."""
import json
import os
import signal
import subprocess
import sys
import time

from attnbench.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def attnbench(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "attnbench", *args], cwd=ROOT, text=True, **kwargs)


def test_a_closed_stdout_still_writes_the_file(tmp_path):
    """`attnbench bench --json out.json | head -2`: head leaves after the header; the run goes on,
    writes every row, and ends quietly with its own status."""
    path = tmp_path / "out.json"
    proc = attnbench("bench", "--op", "flash", "--mode", "fwd", "--variant", "split", "--quiet", "--json", str(path),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()  # what head does when it has its two lines
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert head[0].startswith("# ")
    assert err == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    report = json.loads(path.read_text())
    assert report["status"] == "complete" and len(report["bench"]) == 12


def test_ctrl_c_keeps_every_finished_row(tmp_path, capsys):
    """SIGINT after the first row: exit 130, one line saying so, the rows so far in the file, and
    `attnbench report` reads the partial run."""
    path = tmp_path / "out.json"
    # Triton rows in the interpreter take about a second each: time to interrupt mid-run
    proc = attnbench("bench", "--op", "flash", "--mode", "fwd", "--variant", "triton", "--json", str(path),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stderr.readline()
    assert first.startswith("[ 1/12]"), first + proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert time.monotonic() - start < 30  # stops within the row it was in, not at the end of the run
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("attnbench: interrupted;") and f"kept in {path}" in last
    report = json.loads(path.read_text())
    assert report["status"] == "interrupted"
    rows = report["bench"]
    assert 1 <= len(rows) < 12 and all(r["timing"] for r in rows)
    assert f"{len(rows)} finished row(s)" in last
    assert "## bench" not in out  # stopped before the table
    assert main(["report", str(path)]) == 0
    md = capsys.readouterr().out
    assert "Partial run" in md and "interrupted" in md
    assert md.count("| fwd |") == len(rows)
