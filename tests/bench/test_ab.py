"""attnbench.bench.ab: the same bench at two commits read as one table of ratios (scripts/gpu_gate.sh ab)."""
import json
import subprocess
import sys

import pytest

from attnbench.bench import ab
from attnbench.bench.results import BadResultFile, validate


def _run(path, commit, rows, status="complete"):
    """A bench JSON as `attnbench bench --json` writes it, reduced to what ab reads."""
    bench = []
    for case, gpu_ms, eager_ms, failed in rows:
        bench.append({"op": "flash", "case": case, "mode": "fwd", "variant": "triton", "failed": failed,
                      "skipped": f"failed: {failed}" if failed else "" if gpu_ms else "not run",
                      "timing": {"median_ms": gpu_ms} if gpu_ms else None,
                      "eager": {"median_ms": eager_ms} if eager_ms else None})
    path.write_text(json.dumps({"format": 1, "status": status, "code": {"commit": commit, "dirty": False},
                                "bench": bench}))
    return str(path)


def test_ratios_are_medians_of_each_sides_run_medians_and_nothing_is_dropped(tmp_path):
    old = [_run(tmp_path / "o1.json", "aaaaaaaaaa", [("A", 1.0, 2.0, ""), ("B", 1.0, None, ""), ("C", 1.0, None, "")]),
           _run(tmp_path / "o2.json", "aaaaaaaaaa", [("A", 3.0, 4.0, ""), ("B", 1.0, None, ""), ("C", 1.0, None, "")])]
    new = [_run(tmp_path / "n1.json", "bbbbbbbbbb", [("A", 2.2, 2.0, ""), ("B", None, None, "raised ValueError")],
                "error"),
           _run(tmp_path / "n2.json", "bbbbbbbbbb", [("A", 2.2, 3.0, ""), ("D", 1.0, None, "")])]
    rows = {r["case"]: r for r in ab.compare(old, new)["rows"]}
    assert rows["A"]["timing_ratio"] == pytest.approx(2.2 / 2.0)  # new 2.2 against the old runs' median, 2.0
    assert rows["A"]["eager_ratio"] == pytest.approx(2.5 / 3.0)
    assert rows["A"]["old_timing_ms"] == [1.0, 3.0] and rows["A"]["new_timing_ms"] == [2.2, 2.2]
    assert rows["B"]["timing_ratio"] is None and rows["B"]["note"] == "new: raised ValueError"
    assert rows["C"]["timing_ratio"] is None and rows["C"]["new_timing_ms"] == []  # the new side never ran it
    assert rows["D"]["old_timing_ms"] == [] and rows["D"]["timing_ratio"] is None
    text = ab.markdown(ab.compare(old, new))
    assert "aaaaaaa," in text and "| A | fwd | triton | 1.0000, 3.0000 | 2.2000, 2.2000 |" in text
    assert "new: raised ValueError" in text and "**Stopped early**" in text and "new run 1: error" in text


def test_the_cli_writes_a_study_the_index_leaves_out(tmp_path):
    old = _run(tmp_path / "o.json", "aaaaaaaaaa", [("A", 1.0, None, "")])
    new = _run(tmp_path / "n.json", "bbbbbbbbbb", [("A", 1.5, None, "")])
    out = subprocess.run([sys.executable, "-m", "attnbench.bench.ab", old, "--", new, "--json", str(tmp_path / "ab.json"),
                          "--markdown", str(tmp_path / "ab.md")], capture_output=True, text=True, check=True).stdout
    assert "1.500" in out and (tmp_path / "ab.md").read_text() == out
    study = json.loads((tmp_path / "ab.json").read_text())
    assert study["rows"][0]["timing_ratio"] == pytest.approx(1.5)
    with pytest.raises(BadResultFile, match="not an attnbench result"):  # what `report --index` skips
        validate(study)
    bad = subprocess.run([sys.executable, "-m", "attnbench.bench.ab", old, new], capture_output=True, text=True)
    assert bad.returncode != 0 and "--" in bad.stderr


def test_a_real_bench_run_reads_against_itself_near_one(tmp_path):
    """Two CPU runs of one tiny case through the CLI: the table reads the JSON bench writes today."""
    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-m", "attnbench", "bench", "--op", "flash", "--cases", "tiny", "--variant",
                        "reference", "--mode", "fwd", "--match", "^B1 H2 N37x29 D24 fp32", "--quiet", "--json",
                        str(path)], check=True, capture_output=True)
        paths.append(str(path))
    (row,) = ab.compare(paths[:1], paths[1:])["rows"]
    assert row["case"].startswith("B1 H2 N37x29 D24") and 0.2 < row["timing_ratio"] < 5  # one CPU, same code
