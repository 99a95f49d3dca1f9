"""attnbench report --site: one page per operator with its plots, from a results tree. A GPU tree gets the roofline
(measured where a calibration is committed, else the datasheet's, labelled), speedup bars on both clocks, the
headline table from the newest run, verdicts and the capability matrix; a CPU tree shows only what it measured; a
peer that never ran gets no column; every link on the pages resolves."""
import json
import re
import struct
from pathlib import Path

import pytest

from attnbench.bench import report, site
from attnbench.cli import main

pytest.importorskip("matplotlib")

CASE_A, CASE_B = "B1 H2 N256 D64 bf16", "B1 H2 N512 D64 bf16"


def _row(case, variant, ms, mode="fwd", method="cuda-events", eager=None, tflops=None, gbps=None, **extra):
    return {"op": "flash", "case": case, "mode": mode, "variant": variant, "max_error": 2e-3,
            "tflops": 100.0 / ms if tflops is None else tflops, "gbps": 50.0 / ms if gbps is None else gbps,
            "roofline_pct": 40.0 / ms, "timing": {"median_ms": ms, "method": method},
            "eager": {"median_ms": eager, "method": "eager-wall"} if eager else None, **extra}


def _doc(rows, case_set="anchor", device="cuda", name="NVIDIA H100 80GB HBM3", date="2026-11-26T10:00:00+00:00",
         ceilings=None):
    return {"format": 1, "status": "complete", "date": date, "machine": {"device": device, "device_name": name},
            "code": {"commit": "a" * 40, "dirty": False}, "ceilings": ceilings,
            "operators": {"flash": {"case_set": case_set, "baseline": "sdpa_flash", "ratio_subject": "triton",
                                    "ratio_peers": ["sdpa_flash", "sdpa_cudnn", "flex"]}},
            "bench": rows}


def _write(path: Path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _gpu_tree(root: Path):
    """An H100 folder with an older and a newer anchor run (the newer times case A on both clocks, sdpa_math
    beside it; flex never runs), a sweep, no calibration (the runs' recorded ceilings are the roofline); an H200
    folder with a calibration, a verdict file and a capability matrix."""
    old = _doc([_row(CASE_A, "triton", 2.0), _row(CASE_A, "sdpa_flash", 3.0), _row(CASE_B, "triton", 1.0),
                _row(CASE_B, "sdpa_flash", 1.5), _row(CASE_B, "sdpa_cudnn", 0.8),
                {"op": "flash", "case": CASE_B, "mode": "fwd", "variant": "flex", "timing": None, "skipped": "no"}],
               date="2026-11-25T10:00:00+00:00", ceilings={"matmul_tflops": 700.0, "copy_gbps": 3000.0})
    new = _doc([_row(CASE_A, "triton", 1.0, eager=2.0), _row(CASE_A, "sdpa_flash", 1.6, eager=1.0),
                _row(CASE_A, "sdpa_math", 8.0, eager=9.0)],
               ceilings={"matmul_tflops": 780.0, "copy_gbps": 3100.0})
    sweep = _doc([_row("B1 H2 N4096 D128 bf16", "triton", 0.5, tflops=600.0, gbps=30000.0),
                  _row("B1 H2 N4096 D128 bf16", "reference", 9.0)], case_set="sweep", date="2026-11-24T09:00:00+00:00")
    _write(root / "nvidia-h100" / "flash" / "anchor-old.json", old)
    _write(root / "nvidia-h100" / "flash" / "anchor-new.json", new)
    _write(root / "nvidia-h100" / "flash" / "sweep.json", sweep)
    (root / "nvidia-h100" / "flash" / "study.json").write_text(json.dumps({"configs": [1, 2]}))
    h200 = _doc([_row(CASE_A, "triton", 1.0), _row(CASE_A, "sdpa_flash", 1.2), _row(CASE_A, "split", 30.0),
                 _row(CASE_A, "reference", 10.0)], name="NVIDIA H200")
    _write(root / "nvidia-h200" / "flash" / "anchor.json", h200)
    (root / "nvidia-h200" / "gate").mkdir(parents=True)
    (root / "nvidia-h200" / "gate" / "calibration.txt").write_text(
        "NVIDIA H200: bf16 matmul 807 TF/s, device copy 4245 GB/s\n")
    verdicts = {"rule": [], "source": "s", "machine": {"device_name": "NVIDIA H200"},
                "verdicts": [{"op": "flash", "case": CASE_A, "mode": "fwd", "comparison": "triton vs split",
                              "candidate": "triton", "baseline": "split", "candidate_ms": 1.0, "baseline_ms": 30.0,
                              "speedup": 30.0, "verdict": "prioritize"}]}
    _write(root / "nvidia-h200" / "flash" / "decisions.json", verdicts)
    (root / "nvidia-h200" / "flash" / "decisions.md").write_text("# Decision points\n")
    matrix = {"device": {"device_name": "NVIDIA H200"}, "columns": ["fwd", "jvp"], "shapes": [["s", "S"]],
              "cells": {"ours": {"s": {"fwd": "verified", "jvp": "verified"}},
                        "theirs": {"s": {"fwd": "verified", "jvp": "wrong: rel. err 0.2"}}}}
    _write(root / "nvidia-h200" / "jvp_attention" / "capabilities.json", matrix)
    (root / "index.csv").write_text("operator,case\nflash,x\n")  # stale on purpose: the index page says so


def _png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height, len(data)


def _table(text, first_header):
    """The rows (lists of cells) of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows[0], [r for r in rows[2:]]


def _section(text, heading):
    start = text.index(heading)
    nxt = text.find("\n## ", start + 1)
    return text[start:nxt if nxt > 0 else None]


def test_gpu_site_has_rooflines_speedups_headline_verdicts_and_capabilities(tmp_path, capsys):
    root, out = tmp_path / "results", tmp_path / "site"
    _gpu_tree(root)
    assert main(["report", "--site", str(root), "--out", str(out)]) == 0
    assert "2 pages" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "flash-nvidia-h100-roofline.png", "flash-nvidia-h100-speedup.png",
                     "flash-nvidia-h200-roofline.png", "flash-nvidia-h200-speedup.png", "flash.md"]
    for name in names:
        if name.endswith(".png"):
            width, height, size = _png_size(out / name)
            assert width >= 600 and height >= 200 and size > 10_000, name  # a drawn figure, not an empty canvas
    page = (out / "flash.md").read_text()
    h100 = _section(page, "## nvidia-h100")
    # the roofline: the newest run's recorded ceilings on the H100 (no calibration there), the H200's calibration
    assert "measured, bf16 matmul 780 TF/s and device copy 3100 GB/s" in h100 and "anchor-new.json" in h100
    assert "measured, bf16 matmul 807 TF/s and device copy 4245 GB/s" in _section(page, "## nvidia-h200")
    assert "calibration.txt" in _section(page, "## nvidia-h200")
    # the sweep's triton point (600 TF/s at 20 FLOP/B) is above the 3100 GB/s line: the page says so
    assert "Points above the line (triton)" in h100
    # headline: case A from the newer run (both clocks, sdpa_math beside it), case B from the older one
    header, rows = _table(h100, "| case | mode | triton ms")
    assert header == ["case", "mode", "triton ms", "triton TF/s", "% roofline", "vs sdpa_flash (baseline)",
                      "vs best peer", "eager ms", "eager vs sdpa_flash (baseline)", "eager vs best peer",
                      "max rel. error", "run"]
    assert [r[0] for r in rows] == [CASE_A, CASE_B]
    a, b = rows
    assert a[2] == "1.000" and a[5] == "1.60x" and a[6] == "1.60x sdpa_flash" and a[7] == "2.000"
    assert a[8] == "0.50x" and a[9] == "0.50x sdpa_flash" and "anchor-new" in a[11]
    assert b[5] == "1.50x" and b[6] == "0.80x sdpa_cudnn" and b[7] == "-" and "anchor-old" in b[11]
    assert "flex" not in h100.split("### Runs")[0]  # it never ran: no column, no bar
    # verdicts computed from the headline, the committed verdict file, the runs with the study left out
    assert "| triton vs best peer | 2 |" in h100
    h200 = _section(page, "## nvidia-h200")
    assert "| triton vs split | 1 | 0 | 0 | 1 | 30.00x / 30.00x / 30.00x |" in h200 and "decisions.json" in h200
    _, runs = _table(h100, "| run | case set")
    assert [(r[0].split("](")[0], r[1]) for r in runs] == [  # newest first
        ("[nvidia-h100/flash/anchor-new.json", "anchor"), ("[nvidia-h100/flash/anchor-old.json", "anchor"),
        ("[nvidia-h100/flash/sweep.json", "sweep")]
    assert "study" not in h100
    index = (out / "README.md").read_text()
    assert "[flash](flash.md)" in index and "It lists 1 measurements where the result files now hold 17" in index
    assert len(report.index(str(root))[0]) == 17  # the page counts as the index does
    assert "Its columns are not the documented ones" in index
    assert "1 capability matrix read" in index
    _links_resolve(out)


def test_a_complete_run_outranks_a_newer_partial_one(tmp_path):
    """A run cut short may lack the peers of its last case: where a complete run has the case, it is shown even
    when a partial run is newer; a case only the partial run reached comes from it, marked."""
    root, out = tmp_path / "results", tmp_path / "site"
    _gpu_tree(root)
    cut = _doc([_row(CASE_B, "triton", 0.9), _row("B1 H2 N1024 D64 bf16", "triton", 3.0),
                _row("B1 H2 N1024 D64 bf16", "sdpa_flash", 4.5)], date="2026-11-28T10:00:00+00:00")
    cut["status"] = "interrupted"
    _write(root / "nvidia-h100" / "flash" / "anchor-cut.json", cut)
    site.write(str(root), str(out))
    _, rows = _table(_section((out / "flash.md").read_text(), "## nvidia-h100"), "| case | mode | triton ms")
    runs = {r[0]: r[-1] for r in rows}
    assert "anchor-old" in runs[CASE_B] and "1.50x" in [c for r in rows if r[0] == CASE_B for c in r]
    assert "anchor-cut" in runs["B1 H2 N1024 D64 bf16"] and runs["B1 H2 N1024 D64 bf16"].endswith("(interrupted)")


def test_an_autotuned_run_outranks_a_newer_one_with_fixed_configs(tmp_path):
    """A run with ATTNBENCH_AUTOTUNE=0 ("autotune": false, a study's default configs) is not the
    headline where an autotuned run has the case, however new; the runs table marks it."""
    root, out = tmp_path / "results", tmp_path / "site"
    _gpu_tree(root)
    fixed = _doc([_row(CASE_B, "triton", 5.0), _row(CASE_B, "sdpa_flash", 1.5)], date="2026-11-28T10:00:00+00:00")
    fixed["autotune"] = False
    _write(root / "nvidia-h100" / "flash" / "moves-fixed.json", fixed)
    site.write(str(root), str(out))
    section = _section((out / "flash.md").read_text(), "## nvidia-h100")
    _, rows = _table(section, "| case | mode | triton ms")
    assert "moves-fixed" not in {r[-1] for r in rows if r[0] == CASE_B}
    assert "(fixed configs)" in next(line for line in section.splitlines() if "moves-fixed.json" in line)


def test_capability_matrix_lands_on_its_operators_page(tmp_path):
    """jvp_attention's page exists once it has a timed run, and shows the committed matrix's worst verdicts."""
    root, out = tmp_path / "results", tmp_path / "site"
    _gpu_tree(root)
    doc = _doc([dict(_row(CASE_A, "triton", 1.0, mode="fwd_jvp"), op="jvp_attention"),
                dict(_row(CASE_A, "sdpa_math", 4.0, mode="fwd_jvp"), op="jvp_attention")], name="NVIDIA H200")
    doc["operators"] = {"jvp_attention": {"case_set": "anchor", "baseline": "sdpa_math", "ratio_subject": "triton",
                                          "ratio_peers": ["sdpa_math"]}}
    _write(root / "nvidia-h200" / "jvp_attention" / "anchor.json", doc)
    site.write(str(root), str(out))
    page = (out / "jvp_attention.md").read_text()
    header, rows = _table(page, "| implementation |")
    assert header == ["implementation", "fwd", "jvp"]
    assert rows == [["ours", "verified", "verified"], ["theirs", "verified", "wrong: rel. err 0.2"]]
    _links_resolve(out)


def test_cpu_site_shows_only_what_was_measured(tmp_path):
    """A CPU run: the subject timed by the interpreter, the peers on the CPU wall clock. No TF/s, no roofline, no
    ratio between the two clocks, no eager: the table is the times and errors, and no plot pretends otherwise."""
    root, out = tmp_path / "results", tmp_path / "site"
    rows = [_row(CASE_A, "triton", 50.0, method="interpreter", roofline_pct=None),  # as a CPU run records them
            _row(CASE_A, "sdpa_math", 2.0, method="cpu-wall", roofline_pct=None),
            _row(CASE_A, "reference", 1.0, method="cpu-wall", roofline_pct=None)]
    _write(root / "cpu" / "flash" / "tiny.json", _doc(rows, case_set="tiny", device="cpu", name="x86_64"))
    site.write(str(root), str(out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "flash.md"]
    page = (out / "flash.md").read_text()
    header, table = _table(page, "| case | mode | triton ms")
    assert header == ["case", "mode", "triton ms", "max rel. error", "run"]
    assert table[0][:4] == [CASE_A, "fwd", "50.000", "2.0e-03"]
    assert "no roofline plot" in page and "no speedup plot" in page and "TF/s" not in page
    assert "| cpu | x86_64 | none | 3 rows, 1 run |" in (out / "README.md").read_text()
    _links_resolve(out)


def test_spec_roofline_is_labelled_and_out_folder_is_guarded(tmp_path, capsys):
    """An H100 folder with no ceilings anywhere is drawn against the datasheet, and the page says so; --out refuses
    a folder holding other files, and replaces an earlier site whole (no stale plot left)."""
    root, out = tmp_path / "results", tmp_path / "site"
    _write(root / "nvidia-h100" / "flash" / "anchor.json",
           _doc([_row(CASE_A, "triton", 1.0), _row(CASE_A, "sdpa_flash", 2.0)]))
    site.write(str(root), str(out))
    page = (out / "flash.md").read_text()
    assert "spec, bf16 matmul 989 TF/s and device copy 3350 GB/s, from the H100 SXM datasheet (not measured" in page
    (out / "flash-nvidia-h100-old-speedup-2.png").write_bytes(b"stale")
    site.write(str(root), str(out))
    assert not (out / "flash-nvidia-h100-old-speedup-2.png").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["report", "--site", str(root), "--out", str(other)]) == 2
    assert "holds files this command did not write" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"
    # an --out that names a file had raised FileExistsError with a traceback (found by review)
    assert main(["report", "--site", str(root), "--out", str(other / "notes.txt")]) == 2
    assert "cannot be the site's folder" in capsys.readouterr().err
    assert main(["report", "--site", str(root), "--index"]) == 2
    assert "--site renders every result under its folder: give no --index" in capsys.readouterr().err
    assert main(["report", "--out", str(out)]) == 2


def _links_resolve(out: Path):
    for page in out.glob("*.md"):
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            file_part = target.split("#")[0]
            assert (page.parent / file_part).exists(), f"{page.name}: {target} does not resolve"
