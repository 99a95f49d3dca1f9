"""attnbench report --index: every result file under results/ becomes tidy rows of results/index.csv, one
per measurement; files that are not result files are named with a one-line reason, asv's folders are not read;
and the committed index matches the committed result files."""
import csv
import json
import os
from pathlib import Path

import pytest

from attnbench.bench import report
from attnbench.cli import main

REPO = Path(__file__).resolve().parents[2]


def _row(variant, ms, method="cuda-events", **extra):
    return {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": variant, "tflops": 400.0 / ms,
            "gbps": 100.0, "roofline_pct": 50.0, "max_error": 2e-3,
            "timing": {"median_ms": ms, "iqr_ms": 0.01, "method": method, **extra}}


def _tree(root: Path):
    run = {"format": 1, "status": "complete", "date": "2026-11-27T10:00:00+00:00",
           "machine": {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"},
           "code": {"commit": "1b6cca5a4356c27ffea853f07257960b4c36ad31", "dirty": True},
           "bench": [_row("triton", 1.0), _row("sdpa_flash", 1.5, method="cuda-graph"),
                     _row("eager_thing", 2.0, clock="eager"),
                     {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": "flex", "timing": None,
                      "skipped": "needs CUDA"}]}
    (root / "nvidia-h100" / "flash").mkdir(parents=True)
    (root / "nvidia-h100" / "flash" / "anchor.json").write_text(json.dumps(run))
    (root / "nvidia-h100" / "flash" / "configs.json").write_text(json.dumps({"configs": [1, 2]}))  # a study's output
    (root / "nvidia-h100" / "flash" / "broken.json").write_text("{not json")
    (root / "nvidia-h100" / "flash" / "checks.json").write_text(json.dumps({"checks": []}))
    (root / "asv" / "nvidia-h100").mkdir(parents=True)
    (root / "asv" / "nvidia-h100" / "abc-existing.json").write_text(json.dumps({"results": {}}))  # asv's, not read


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_index_is_one_tidy_row_per_timed_measurement(tmp_path, capsys):
    root = tmp_path / "results"
    _tree(root)
    assert main(["report", "--index", str(root)]) == 0
    captured = capsys.readouterr()
    rows = _read(root / "index.csv")
    assert list(rows[0]) == list(report.INDEX_COLUMNS)
    assert [r["variant"] for r in rows] == ["triton", "sdpa_flash", "eager_thing"]  # the skipped row is no measurement
    triton = rows[0]
    assert triton["operator"] == "flash" and triton["mode"] == "fwd" and triton["case"] == "B1 H1 N64 D64 bf16"
    assert float(triton["median_ms"]) == 1.0 and float(triton["tflops"]) == 400.0 and float(triton["gbps"]) == 100.0
    assert triton["gpu"] == "nvidia-h100" and triton["device_name"] == "NVIDIA H100 80GB HBM3"
    assert triton["commit"] == "1b6cca5+dirty" and triton["date"] == "2026-11-27"
    assert triton["file"].endswith("results/nvidia-h100/flash/anchor.json")
    # the clock is a column: CUDA events and graph replays are GPU time; a row may name its own clock
    assert [r["clock"] for r in rows] == ["gpu_time", "gpu_time", "eager"]
    assert [r["method"] for r in rows] == ["cuda-events", "cuda-graph", "cuda-events"]
    # every file not indexed is named on stderr, one line each, with why; asv's folder is not walked
    errors = captured.err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("attnbench: ") for line in errors)
    assert any("configs.json: skipped: not an attnbench result" in line for line in errors)
    assert any("broken.json: skipped: not JSON" in line for line in errors)
    assert any("checks.json: no timed rows" in line for line in errors)
    assert "asv" not in captured.err
    assert "3 measurements from 1 result files; 3 files not indexed" in captured.out


def test_index_writes_where_asked_and_refuses_mixed_requests(tmp_path, capsys):
    root = tmp_path / "results"
    _tree(root)
    out = tmp_path / "elsewhere.csv"
    assert main(["report", "--index", str(root), "--csv", str(out)]) == 0
    assert len(_read(out)) == 3 and not (root / "index.csv").exists()
    capsys.readouterr()
    assert main(["report", "--index", str(root), str(root / "nvidia-h100" / "flash" / "anchor.json")]) == 2
    assert main(["report", "--index", str(tmp_path / "missing")]) == 2
    assert main(["report"]) == 2
    err = capsys.readouterr().err
    assert "--index" in err and "not a directory" in err


def test_old_files_without_a_date_or_method_still_index(tmp_path):
    """Files written before "date" and "method": GPU rows are GPU time; the date is left empty outside git."""
    root = tmp_path / "results"
    (root / "nvidia-h200" / "sparse").mkdir(parents=True)
    doc = {"machine": {"device_name": "NVIDIA H200"}, "code": None,
           "bench": [{"op": "sparse", "case": "c", "mode": "bwd", "variant": "triton", "timing": {"median_ms": 2.5}}]}
    (root / "nvidia-h200" / "sparse" / "old.json").write_text(json.dumps(doc))
    rows, problems = report.index(root)
    assert problems == []
    assert rows[0]["clock"] == "gpu_time" and rows[0]["gpu"] == "nvidia-h200" and rows[0]["commit"] == ""
    assert rows[0]["tflops"] is None


@pytest.mark.skipif(not (REPO / "results" / "index.csv").exists(), reason="no committed results in this tree")
def test_the_committed_index_matches_the_committed_results(tmp_path):
    """results/index.csv is regenerated with the results (scripts/collect_gpu_results.sh does it); dates aside,
    which come from git and so are empty in a tree without history."""
    fresh = tmp_path / "index.csv"
    cwd = os.getcwd()
    os.chdir(REPO)  # the index names files as results/..., relative to the checkout
    try:
        report.write_index("results", str(fresh))
    finally:
        os.chdir(cwd)

    def without_dates(rows):
        return [{k: v for k, v in r.items() if k != "date"} for r in rows]

    assert without_dates(_read(fresh)) == without_dates(_read(REPO / "results" / "index.csv")), \
        "results/index.csv is stale: run `python -m attnbench report --index` and commit it"
