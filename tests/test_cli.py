"""The command line end to end on the CPU (tiny case set, Triton through the interpreter)."""
import json
import math

# Load the built-in operators before the CLI, as any program that called attnbench.get() first
# (or pytest collecting tests/test_bench_flash.py first) does: the CLI must work in that order too.
import attnbench.operators.flash  # noqa: F401, E402
from attnbench.cli import main  # noqa: E402


def test_list_prints_variants(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "flash:" in out
    for name in ("reference", "split", "triton", "sdpa_math", "sdpa_flash", "flex"):
        assert name in out
    triton_line = next(line for line in out.splitlines() if line.strip().startswith("triton "))
    assert "available" in triton_line and "unavailable" not in triton_line
    sdpa_flash_line = next(line for line in out.splitlines() if line.strip().startswith("sdpa_flash "))
    assert "unavailable on cpu" in sdpa_flash_line


def test_check_triton_fwd_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["check", "--quiet", "--mode", "fwd", "--variant", "triton", "--json", str(path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ""  # --quiet: no progress lines
    assert "CPU run" in captured.out
    report = json.loads(path.read_text())
    checks = report["checks"]
    assert checks
    assert len(checks) == 12  # the tiny set: 6 shapes x (fp32, fp16)
    for entry in checks:
        assert entry["passed"] is True, entry
        assert entry["variant"] == "triton" and entry["mode"] == "fwd"
        assert not entry["skipped"]
        assert [o["name"] for o in entry["outputs"]] == ["o", "lse"]
        assert all(o["error"] <= o["bound"] for o in entry["outputs"])
    assert "machine" in report
    assert report["machine"]["device"] == "cpu"
    assert report["ceilings"] is None


def test_bench_split_and_reference_json(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc = main(["bench", "--quiet", "--mode", "fwd", "--variant", "split", "--variant", "reference",
               "--json", str(path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(path.read_text())
    rows = report["bench"]
    assert len(rows) == 24  # 12 tiny cases x 2 variants
    assert {r["variant"] for r in rows} == {"split", "reference"}
    for row in rows:
        assert row["mode"] == "fwd"
        assert not row["skipped"]
        assert row["timing"]["method"] == "cpu-wall"  # plain PyTorch on a CPU: not the interpreter
        assert row["timing"]["samples"] >= 1
        assert row["timing"]["median_ms"] > 0
        assert math.isfinite(row["max_error"]) and row["max_error"] < 1e-2, row
        assert row["roofline_pct"] is None  # no ceilings on a CPU
        assert row["tflops"] > 0 and row["gbps"] > 0
        assert row["baseline"] == "reference"
        if row["variant"] == "reference":
            assert row["speedup"] == 1.0
    assert "machine" in report


def test_unknown_operator(capsys):
    assert main(["check", "--quiet", "--op", "no_such_op"]) == 2
    err = capsys.readouterr().err
    assert "no_such_op" in err
    assert "flash" in err  # the known ones are listed


def test_unknown_operator_in_list(capsys):
    assert main(["list", "--op", "no_such_op"]) == 2
    assert "no_such_op" in capsys.readouterr().err


def test_unknown_variant(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["check", "--quiet", "--variant", "no_such_variant", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_variant" in err
    assert not path.exists()


def test_unknown_case_set(capsys):
    assert main(["bench", "--quiet", "--cases", "huge", "--variant", "reference"]) == 2
    assert "huge" in capsys.readouterr().err


def test_triton_timings_on_cpu_say_interpreter(tmp_path):
    path = tmp_path / "t.json"
    assert main(["bench", "--quiet", "--mode", "fwd", "--variant", "triton", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["bench"]
    assert rows and all(r["timing"]["method"] == "interpreter" for r in rows)
