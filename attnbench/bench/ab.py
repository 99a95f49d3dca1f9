"""A change measured side by side with its baseline: the same bench run at two commits, in alternating processes
on one machine (``scripts/gpu_gate.sh ab``), read as one table of per-case ratios.

    python -m attnbench.bench.ab OLD.json [OLD.json ...] -- NEW.json [NEW.json ...] [--json OUT] [--markdown OUT]

Each side's figure for a (case, mode, variant) is the median over its runs of each run's median GPU time (its
eager latency too, where the runs timed it); the ratio is new over old (above 1: the change is slower). Rows that
failed, were skipped, or did not run on both sides are listed, never dropped silently. The JSON it writes is a
study (``"study"`` at the top, no ``bench`` list), so ``attnbench report --index`` leaves it out of the headline
tables: it holds two commits' numbers, which no single run's table should mix.
"""
import argparse
import json
import statistics
import sys

from . import results
from .report import _short_commit

CLOCKS = (("timing", "GPU ms"), ("eager", "eager ms"))


def _figures(paths):
    """{(case, mode, variant): {clock: [median per run]}}, each key's failure or skip reason, the runs' commits and
    their statuses ("complete", or "error", "interrupted", "running": a run that stopped early)."""
    figures, reasons, commits, statuses = {}, {}, [], []
    for path in paths:
        run = results.load(path)  # validated: a file that is no bench result says so in one line
        commits.append(_short_commit(run.get("code")) or "?")
        statuses.append(run.get("status", "complete"))
        for row in run.get("bench", []):
            key = (row["case"], row["mode"], row["variant"])
            if row.get("failed") or row.get("skipped"):
                reasons[key] = row.get("failed") or row.get("skipped")
                continue
            for clock, _ in CLOCKS:
                median = (row.get(clock) or {}).get("median_ms")
                if median:
                    figures.setdefault(key, {}).setdefault(clock, []).append(median)
    return figures, reasons, commits, statuses


def compare(old_paths, new_paths):
    """The side-by-side rows: one dict per (case, mode, variant) either side timed."""
    old, old_reasons, old_commits, old_statuses = _figures(old_paths)
    new, new_reasons, new_commits, new_statuses = _figures(new_paths)
    rows = []
    for key in sorted(set(old) | set(new) | set(old_reasons) | set(new_reasons)):
        row = {"case": key[0], "mode": key[1], "variant": key[2]}
        for clock, _ in CLOCKS:
            a, b = old.get(key, {}).get(clock, []), new.get(key, {}).get(clock, [])
            row[f"old_{clock}_ms"], row[f"new_{clock}_ms"] = a, b
            row[f"{clock}_ratio"] = statistics.median(b) / statistics.median(a) if a and b else None
        row["note"] = "; ".join(f"{side}: {why}" for side, why in (("old", old_reasons.get(key)),
                                                                    ("new", new_reasons.get(key))) if why)
        rows.append(row)
    return {"study": "side by side: the same bench at two commits in alternating processes (attnbench.bench.ab)",
            "old": {"files": list(old_paths), "commits": old_commits, "statuses": old_statuses},
            "new": {"files": list(new_paths), "commits": new_commits, "statuses": new_statuses},
            "rows": rows}


def markdown(result) -> str:
    clocks = [(clock, label) for clock, label in CLOCKS if any(r[f"{clock}_ratio"] is not None for r in result["rows"])]
    head = ["case", "mode", "variant"] + [f"{side} {label}" for clock, label in clocks for side in ("old", "new")]
    head += [f"new / old ({label})" for _, label in clocks] + ["note"]
    stopped = [f"{side} run {i + 1}: {status}" for side in ("old", "new")
               for i, status in enumerate(result[side]["statuses"]) if status != "complete"]
    lines = [f"old: {', '.join(result['old']['commits'])} · new: {', '.join(result['new']['commits'])} "
             "(medians of each run's median; new / old above 1: slower)",
             *([f"**Stopped early** (their missing rows are missing, not dropped): {'; '.join(stopped)}"] if stopped
               else []), "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["rows"]:
        cells = [r["case"], r["mode"], r["variant"]]
        for clock, _ in clocks:
            for side in ("old", "new"):
                cells.append(", ".join(f"{x:.4f}" for x in r[f"{side}_{clock}_ms"]) or "-")
        cells += [f"{r[f'{clock}_ratio']:.3f}" if r[f"{clock}_ratio"] is not None else "-" for clock, _ in clocks]
        cells.append(r["note"] or "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m attnbench.bench.ab OLD.json ... -- NEW.json ... [--json OUT] [--markdown OUT]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m attnbench.bench.ab")
    parser.add_argument("new", nargs="+")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv[split + 1:])
    old = argv[:split]
    if not old:
        raise SystemExit("ab: no OLD run before '--'")
    result = compare(old, args.new)
    text = markdown(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
