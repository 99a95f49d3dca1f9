"""Every committed result file is well-formed (results/README.md and docs/layout.md say what the tree holds):

- every JSON under results/ parses; every attnbench run report (a JSON object with "bench" or "checks") passes
  ``results.load``, names its device, sits under the GPU folder of that device, and the readers (``report.markdown``,
  ``report.index``, the results pages) take it without skipping it; verdict files and capability matrices hold what
  the pages read, and each verdict is the rule's for its speedup;
- every results/asv/<machine>/ folder has asv's machine.json and results asv loads (commit_hash, params naming the
  machine, results), of commits the history holds;
- results/index.csv parses, has the columns docs/cli.md documents, and every row names a committed result file;
- every report summary (a .md in ``attnbench report``'s form) is backed by committed JSON: its sibling <run>.json,
  or, for a run filed in parts, the parts' rows, each of its subject's medians found there; every .png has its
  run (a sibling .json or a backed summary), or is a study's plot that docs/measurements cites;
- no log is committed (the lines a claim needs are quoted in docs/measurements).

A study's output (configs one at a time, routes side by side, floors) may be a .md or .txt alone: the layout asks
a JSON of runs and their summaries, not of write-ups.
"""
import csv
import glob
import json
import math
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attnbench.bench import decisions, report, results, site

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
pytestmark = pytest.mark.skipif(not (RESULTS / "index.csv").exists(), reason="no committed results in this tree")

# the first lines of `attnbench report`'s markdown (report.markdown): "# <ops> on <device>", then the stack
SUMMARY = re.compile(r"# (.+) on (.+)\n\ntorch \S+, triton \S+, CUDA \S+\.\n")


def _git(*args):
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _tracked():
    """Paths (relative to the checkout) of the files git tracks under results/; None outside a git checkout."""
    listed = _git("ls-files", "-z", "--", "results")
    return None if listed is None else {p for p in listed.split("\0") if p}


def _files(pattern):
    return sorted(Path(p) for p in glob.glob(str(RESULTS / pattern), recursive=True))


def _rel(path):
    return str(Path(path).relative_to(REPO))


def _json(path):
    with open(path) as f:
        return json.load(f)  # NaN and Infinity are the result files' own spelling (results.py)


def _gpu_folders():
    return sorted(p for p in RESULTS.iterdir() if p.is_dir() and p.name not in ("asv", "html"))


def _run_reports():
    out = []
    for path in _files("**/*.json"):
        if path.is_relative_to(RESULTS / "asv"):
            continue
        try:
            data = _json(path)
        except (OSError, ValueError):  # test_every_json_parses names it
            continue
        if isinstance(data, dict) and ("bench" in data or "checks" in data):
            out.append((path, data))
    return out


def test_every_json_parses():
    bad = []
    for path in _files("**/*.json"):
        try:
            _json(path)
        except (OSError, ValueError) as exc:
            bad.append(f"{_rel(path)}: {exc}")
    assert not bad, "JSON that does not parse:\n" + "\n".join(bad)


def test_run_reports_hold_what_the_readers_need():
    """Each run report loads, names its device, is filed under that device's folder, and neither the markdown
    report nor the index skips it."""
    reports = _run_reports()
    assert reports, "no attnbench run report under results/"
    problems = []
    for path, data in reports:
        where = _rel(path)
        try:
            results.load(str(path))
        except results.BadResultFile as exc:
            problems.append(f"{where}: {exc}")
            continue
        name = (data.get("machine") or {}).get("device_name")
        if not name:
            problems.append(f"{where}: no machine.device_name: the index's device_name column and the report's "
                            "title have nothing to name")
            continue
        gpu = path.relative_to(RESULTS).parts[0]
        slug = "".join(c if c.isalnum() else "-" for c in name.lower())
        if not slug.startswith(gpu):
            problems.append(f"{where}: measured on {name!r} but filed under results/{gpu}/")
        try:
            text = report.markdown(data)
        except Exception as exc:  # noqa: BLE001: any failure of the reader is the finding
            problems.append(f"{where}: attnbench report fails: {type(exc).__name__}: {exc}")
            continue
        timed = [r for r in data.get("bench", []) if r.get("timing")]
        if timed and "| case | mode |" not in text:
            problems.append(f"{where}: {len(timed)} timed rows, but the report shows no table")
    _, skipped = report.index(str(RESULTS))
    reports_by_name = {str(path.relative_to(RESULTS)) for path, _ in reports}
    problems += [f"index skips a run report: {line}" for line in skipped if line.split(":")[0] in reports_by_name
                 and "no timed rows" not in line]
    assert not problems, "\n".join(problems)


def test_verdict_files_and_capability_matrices_hold_what_the_pages_read():
    loaded = site.load(str(RESULTS))
    assert loaded.verdicts and loaded.capabilities, "the committed verdict files or capability matrix went missing"
    problems = []
    keys = {"op", "case", "mode", "comparison", "candidate", "baseline", "candidate_ms", "baseline_ms", "speedup",
            "verdict"}
    for rel, data in loaded.verdicts:
        if not data["verdicts"]:
            problems.append(f"{rel}: no verdicts")
        for i, v in enumerate(data["verdicts"]):
            if not keys <= set(v):
                problems.append(f"{rel}: verdicts[{i}] lacks {sorted(keys - set(v))}")
                continue
            ratio = v["baseline_ms"] / v["candidate_ms"]
            if not math.isclose(ratio, v["speedup"], rel_tol=1e-6):
                problems.append(f"{rel}: verdicts[{i}]: speedup {v['speedup']} is not baseline/candidate {ratio}")
            if decisions.verdict(v["speedup"]) != v["verdict"]:
                problems.append(f"{rel}: verdicts[{i}]: {v['verdict']} at {v['speedup']:.3f}x, the rule says "
                                f"{decisions.verdict(v['speedup'])}")
    for rel, data in loaded.capabilities:
        shapes = [name for name, _ in data["shapes"]]
        for impl, by_shape in data["cells"].items():
            if sorted(by_shape) != sorted(shapes):
                problems.append(f"{rel}: {impl} has shapes {sorted(by_shape)}, the matrix {sorted(shapes)}")
            for shape, cells in by_shape.items():
                if list(cells) != list(data["columns"]):
                    problems.append(f"{rel}: {impl} / {shape}: columns {list(cells)}")
                words = {v.split(":")[0] for v in cells.values()} - set(site.VERDICT_RANK)
                if words:
                    problems.append(f"{rel}: {impl} / {shape}: verdicts {sorted(words)} are none of "
                                    f"{sorted(site.VERDICT_RANK)}")
    assert not problems, "\n".join(problems)


def test_asv_results_are_asv_results():
    machines = sorted(p for p in (RESULTS / "asv").iterdir() if p.is_dir())
    assert machines, "no asv machine folder under results/asv/"
    assert "version" in _json(RESULTS / "asv" / "benchmarks.json"), "results/asv/benchmarks.json is not asv's"
    try:
        from asv.results import Results
    except ImportError:  # asv is an optional extra: the structural checks below still run
        Results = None
    shallow = (_git("rev-parse", "--is-shallow-repository") or "true").strip() != "false"
    problems = []
    for folder in machines:
        machine_json = folder / "machine.json"
        if not machine_json.exists():
            problems.append(f"{_rel(folder)}: no machine.json (asv publish reads it)")
        else:
            m = _json(machine_json)
            if m.get("version") != 1 or m.get("machine") != folder.name:
                problems.append(f"{_rel(machine_json)}: version {m.get('version')}, machine {m.get('machine')!r}; "
                                f"asv wants version 1 and the folder's name {folder.name!r}")
        runs = sorted(p for p in folder.glob("*.json") if p.name != "machine.json")
        if not runs:
            problems.append(f"{_rel(folder)}: no results")
        for path in runs:
            d = _json(path)
            missing = {"commit_hash", "params", "results", "result_columns", "version"} - set(d)
            if missing:
                problems.append(f"{_rel(path)}: lacks {sorted(missing)}")
                continue
            if d["version"] != 2 or (d["params"] or {}).get("machine") != folder.name:
                problems.append(f"{_rel(path)}: version {d['version']}, params.machine "
                                f"{(d['params'] or {}).get('machine')!r} in folder {folder.name!r}")
            if not re.fullmatch(r"[0-9a-f]{40}", str(d["commit_hash"])):
                problems.append(f"{_rel(path)}: commit_hash {d['commit_hash']!r} is not a full hash")
            elif not path.name.startswith(d["commit_hash"][:8]):
                problems.append(f"{_rel(path)}: named for another commit than its {d['commit_hash'][:8]}")
            elif not shallow and _git("cat-file", "-e", d["commit_hash"] + "^{commit}") is None:
                problems.append(f"{_rel(path)}: commit {d['commit_hash'][:8]} is not in the history: asv cannot "
                                "place it")
            for name, values in d["results"].items():
                if not isinstance(values, list) or len(values) > len(d["result_columns"]):
                    problems.append(f"{_rel(path)}: results[{name!r}] does not fit result_columns")
            if Results is not None:
                try:
                    Results.load(str(path), machine_name=folder.name)
                except Exception as exc:  # noqa: BLE001: asv's own loader is the judge
                    problems.append(f"{_rel(path)}: asv cannot load it: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems)


def test_index_has_the_documented_columns_and_names_committed_result_files():
    documented = re.search(r"one row per timed bench row: `([^`]+)`", (REPO / "docs" / "cli.md").read_text())
    assert documented, "docs/cli.md no longer lists the index's columns"
    columns = tuple(c.strip() for c in re.sub(r"\s+", " ", documented.group(1)).split(","))
    with open(RESULTS / "index.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == report.INDEX_COLUMNS == columns, \
        f"index.csv columns {reader.fieldnames}; code {report.INDEX_COLUMNS}; docs/cli.md {columns}"
    assert rows, "results/index.csv is empty"
    tracked = _tracked()
    problems, loaded = [], {}
    for i, row in enumerate(rows, start=2):  # line numbers of the file, its header line 1
        file = row["file"]
        if not file.startswith("results/") or not (REPO / file).is_file():
            problems.append(f"index.csv line {i}: {file!r} is no file under results/")
            continue
        if tracked is not None and file not in tracked:
            problems.append(f"index.csv line {i}: {file} is not committed")
        if file not in loaded:
            try:
                loaded[file] = results.load(str(REPO / file))
            except results.BadResultFile as exc:
                loaded[file] = exc
        if isinstance(loaded[file], Exception):
            problems.append(f"index.csv line {i}: {file} is not a result file: {loaded[file]}")
        elif row["gpu"] != Path(file).parts[1]:
            problems.append(f"index.csv line {i}: gpu {row['gpu']!r} but the file is under {Path(file).parts[1]}/")
        try:
            ok = float(row["median_ms"]) > 0
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"index.csv line {i}: median_ms {row['median_ms']!r}")
    assert not problems, "\n".join(problems[:40]) + (f"\n... {len(problems) - 40} more" if len(problems) > 40 else "")


def _summary_rows(text):
    """(op or None, case, mode, subject, median as printed) of each row of a report summary's tables."""
    ops = SUMMARY.match(text).group(1).split(", ")
    op, subject, rows = (ops[0] if len(ops) == 1 else None), None, []
    for line in text.splitlines():
        if line.startswith("## "):
            op, subject = line[3:].strip(), None
        header = re.match(r"\| case \| mode \| (\S+) ms \|", line)
        if header:
            subject = header.group(1)
        elif subject and line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((op, cells[0], cells[1], subject, cells[2]))
        elif not line.startswith("|"):
            subject = None if line.strip() else subject
    return rows


def _medians(paths):
    """{(op, case, mode, variant, median as the report prints it)} of the result files among ``paths``."""
    out = set()
    for path in paths:
        try:
            data = results.load(str(path))
        except results.BadResultFile:
            continue
        out |= {(r["op"], r["case"], r["mode"], r["variant"], f"{r['timing']['median_ms']:.3f}")
                for r in data.get("bench", []) if r.get("timing")}
    return out


def _backed(summary):
    """'' where every row of a report summary is in its sibling JSON (or, with no sibling, in the result files of
    its folder: the parts of a run filed in parts); else what is missing."""
    sibling = summary.with_suffix(".json")
    pool = [sibling] if sibling.exists() else sorted(summary.parent.glob("*.json"))
    have = _medians(pool)
    rows = _summary_rows(summary.read_text())
    if not rows:
        return "its tables have no rows"
    missing = [r for r in rows if not any((r[0] is None or r[0] == h[0]) and r[1:] == h[1:] for h in have)]
    if missing:
        source = sibling.name if sibling.exists() else f"any result file of {_rel(summary.parent)}/"
        return f"{len(missing)} of {len(rows)} rows are not in {source}, e.g. {missing[0][1:]}"
    return ""


def test_summaries_and_plots_have_their_runs():
    problems, summaries = [], set()
    for folder in _gpu_folders():
        for md in sorted(folder.rglob("*.md")):
            if SUMMARY.match(md.read_text()):
                why = _backed(md)
                if why:
                    problems.append(f"{_rel(md)}: an attnbench report summary without its run: {why}")
                else:
                    summaries.add(md.with_suffix(""))
            elif md.stem.startswith(("decisions", "capabilities", "graphs")) and not md.with_suffix(".json").exists():
                problems.append(f"{_rel(md)}: no {md.with_suffix('.json').name} beside it (results/README.md)")
    cited = "\n".join(p.read_text() for p in (REPO / "docs" / "measurements").glob("*.md"))
    for folder in _gpu_folders():
        for png in sorted(folder.rglob("*.png")):
            if png.with_suffix(".json").exists() or png.with_suffix("") in summaries:
                continue
            stem = re.escape(str(png.relative_to(RESULTS).with_suffix("")))  # cited as x.png or x.{md,png}
            if not re.search(stem + r"\.(png\b|\{[^}]*\bpng\b[^}]*\})", cited):
                problems.append(f"{_rel(png)}: a plot with no run beside it (no {png.stem}.json, no report summary) "
                                "that docs/measurements does not cite with its source")
    assert not problems, "\n".join(problems)


def test_xml_reports_parse():
    bad = []
    for path in _files("**/*.xml"):
        try:
            ET.parse(path)
        except ET.ParseError as exc:
            bad.append(f"{_rel(path)}: {exc}")
    assert not bad, "\n".join(bad)


def test_no_log_is_committed():
    tracked = _tracked()
    files = tracked if tracked is not None else {_rel(p) for p in RESULTS.rglob("*") if p.is_file()}
    logs = sorted(p for p in files if p.endswith(".log") or os.path.basename(p).startswith("nohup"))
    assert not logs, "logs are committed (quote the lines a claim needs in docs/measurements instead): " + ", ".join(
        logs)
