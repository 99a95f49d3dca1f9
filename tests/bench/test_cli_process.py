"""The CLI as a process, as a shell runs it: a reader that leaves early (``| head -2``) and Ctrl-C.
Each test starts one ``python -m attnbench`` (a few seconds of imports) on a narrow run."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from attnbench.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_keeps_every_finished_row(tmp_path, capsys, sig):
    """SIGINT (or SIGTERM, what `timeout` sends) after the first row: exit 130, one line saying so, the rows so far
    in the file with the status "interrupted", and `attnbench report` reads the partial run."""
    path = tmp_path / "out.json"
    # Triton rows in the interpreter take about a second each: time to interrupt mid-run
    proc = attnbench("bench", "--op", "flash", "--mode", "fwd", "--variant", "triton", "--json", str(path),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stderr.readline()
    assert first.startswith("[ 1/12]"), first + proc.stderr.read()
    proc.send_signal(sig)
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


def test_ctrl_c_swallowed_by_a_library_still_stops_the_run(tmp_path, monkeypatch, capsys):
    """A Ctrl-C whose KeyboardInterrupt a library swallows (C code that clears any error of an
    attribute lookup does) must still stop the run after the row it came in, exit 130: CI once
    saw such a run go on to its last row and exit 0."""
    from attnbench import cli

    real_bench = cli.bench

    def bench_with_a_swallowed_interrupt(*args, on_row, **kwargs):
        def on_row_after_swallow(row):
            if not on_row_after_swallow.fired:
                on_row_after_swallow.fired = True
                try:
                    signal.raise_signal(signal.SIGINT)  # what the terminal sends
                except KeyboardInterrupt:
                    pass  # ... and what the library does with it
            on_row(row)
        on_row_after_swallow.fired = False
        return real_bench(*args, on_row=on_row_after_swallow, **kwargs)

    monkeypatch.setattr(cli, "bench", bench_with_a_swallowed_interrupt)
    before = signal.getsignal(signal.SIGINT)
    path = tmp_path / "out.json"
    try:
        code = main(["bench", "--op", "flash", "--mode", "fwd", "--variant", "split", "--quiet", "--json", str(path)])
    finally:
        signal.signal(signal.SIGINT, before)  # main ignores a second Ctrl-C after the first; undo for pytest
    assert code == 130
    assert json.loads(path.read_text())["status"] == "interrupted"
    assert len(json.loads(path.read_text())["bench"]) == 1  # the row it came in, and no more
    assert "1 finished row(s) kept" in capsys.readouterr().err


def test_ctrl_c_before_any_row_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    """A Ctrl-C before the first row finished (while the cases were being planned, or in the
    first row) had printed only "attnbench: interrupted": now the line says no row finished
    and no file was written, and an earlier file at the --json path is left as it was."""
    from attnbench import cli

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    path = tmp_path / "out.json"
    argv = ["bench", "--op", "flash", "--mode", "fwd", "--variant", "split", "--quiet", "--json", str(path)]
    for where in ("make_plans", "bench"):
        with monkeypatch.context() as patch:
            patch.setattr(cli, where, interrupt)
            before = signal.getsignal(signal.SIGINT)
            try:
                assert main(argv) == 130
            finally:
                signal.signal(signal.SIGINT, before)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == f"attnbench: interrupted before any row finished; no file was written ({path} does not exist)"
        assert not path.exists()
    path.write_text("an earlier run")
    with monkeypatch.context() as patch:
        patch.setattr(cli, "bench", interrupt)
        before = signal.getsignal(signal.SIGINT)
        try:
            assert main(argv) == 130
        finally:
            signal.signal(signal.SIGINT, before)
    assert f"no file was written ({path} is unchanged)" in capsys.readouterr().err
    assert path.read_text() == "an earlier run"


def test_version(capsys):
    import attnbench

    proc = subprocess.run([sys.executable, "-m", "attnbench", "--version"], cwd=ROOT, text=True, capture_output=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"attnbench {attnbench.__version__}", proc.stderr


def test_ctrl_c_without_a_json_file_prints_the_finished_rows(monkeypatch, capsys):
    """Without --json a Ctrl-C said 'N finished row(s) kept' while printing none of them: the tables were printed
    only at the end of each operator (found by review). The finished rows are printed now."""
    from attnbench import cli

    real_bench = cli.bench

    def bench_then_interrupt(*args, on_row=None, **kwargs):
        seen = []

        def row_then_stop(row):
            on_row(row)
            seen.append(row)
            if len(seen) == 3:
                raise KeyboardInterrupt

        return real_bench(*args, on_row=row_then_stop, **kwargs)

    monkeypatch.setattr(cli, "bench", bench_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert main(["bench", "--op", "flash", "--mode", "fwd", "--variant", "split", "--quiet"]) == 130
    finally:
        signal.signal(signal.SIGINT, before)
    captured = capsys.readouterr()
    assert "## bench (finished before the interrupt)" in captured.out
    assert sum(" split " in line for line in captured.out.splitlines()) == 3
    assert "3 finished row(s) kept in the tables above" in captured.err
