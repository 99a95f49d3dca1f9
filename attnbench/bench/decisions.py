"""Decision points: is a candidate's measured speedup over its baseline worth acting on?

The rule is data (``RULES``), from the shared-context seed and applied to every operator: a
speedup of the candidate over its baseline below 1.10 -> defer, from 1.10 to below 1.30 ->
implement, 1.30 and above -> prioritize. Verdicts are computed from bench rows measured side by
side in one run (``attnbench bench|run --json``) and written to results/ as JSON and markdown:

    python -m attnbench.bench.decisions REPORT.json --out results/nvidia-h200/shared_context

What is compared with what is data too: ``DEFAULT_COMPARISONS`` (split vs reference, Triton vs
split, Triton vs the fastest peer) unless the operator declares ``decision_comparisons``; an
operator with ``gate_baselines`` also gets Triton vs the fastest of those (its perf-gate bar).
"""
import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCE = "seed 002 (shared-context analysis): under 10% defer, 10-30% implement, over 30% prioritize"


@dataclass(frozen=True)
class Rule:
    verdict: str
    lower: float  # inclusive
    upper: float  # exclusive


RULES = (Rule("defer", 0.0, 1.10), Rule("implement", 1.10, 1.30), Rule("prioritize", 1.30, math.inf))
BEST_PEER = "best peer"  # a baseline spec: the fastest variant of kind "peer" that ran


def verdict(speedup: float, rules=RULES) -> str:
    """The rule's verdict for one speedup (baseline time / candidate time)."""
    if speedup is None or not math.isfinite(speedup) or speedup < 0:
        raise ValueError(f"speedup must be a finite non-negative number, got {speedup!r}")
    return next(r.verdict for r in rules if r.lower <= speedup < r.upper)


@dataclass(frozen=True)
class Comparison:
    candidate: str
    baseline: str | tuple  # a variant name, a tuple of names (the fastest that ran), or BEST_PEER

    @property
    def label(self) -> str:
        if isinstance(self.baseline, tuple):
            return f"{self.candidate} vs best of {{{', '.join(self.baseline)}}}"
        return f"{self.candidate} vs {self.baseline}"


DEFAULT_COMPARISONS = (Comparison("split", "reference"), Comparison("triton", "split"),
                       Comparison("triton", BEST_PEER))


def comparisons_for(op) -> tuple:
    """The operator's own comparisons, or the defaults plus its perf-gate bar."""
    declared = getattr(op, "decision_comparisons", None)
    if declared:
        return tuple(declared)
    gate = getattr(op, "gate_baselines", ())
    subject = getattr(op, "ratio_subject", "triton")
    return DEFAULT_COMPARISONS + ((Comparison(subject, tuple(gate)),) if gate else ())


@dataclass
class Verdict:
    op: str
    case: str
    mode: str
    comparison: str
    candidate: str
    baseline: str  # the variant the speedup divides by
    candidate_ms: float
    baseline_ms: float
    speedup: float
    verdict: str


def _timing(row):
    """(median ms, clock) of a row; the clock is None when the row does not say."""
    timing = row.get("timing") if isinstance(row, dict) else getattr(row, "timing", None)
    if not timing:
        return None, None
    if isinstance(timing, dict):
        return timing.get("median_ms"), timing.get("method")
    return timing.median_ms, timing.method


def _comparable(a, b):
    """As attnbench.bench.timing.comparable: one clock, and never the interpreter's (numpy emulating a
    GPU is no speed). Rows that do not name their clock are taken as measured side by side."""
    if a is None or b is None:
        return True
    return a == b and a != "interpreter"


def _field(row, name):
    return row.get(name) if isinstance(row, dict) else getattr(row, name)


def _kinds(op_name):
    try:
        from .registry import get

        return {name: v.kind for name, v in get(op_name).variants.items()}
    except KeyError:
        return {}


def decide(rows, comparisons=None, kinds=None, rules=RULES) -> list:
    """Verdicts for every (op, case, mode) in ``rows`` (BenchRow objects or their dicts) and every
    comparison whose candidate and baseline both ran. ``kinds``: {op: {variant: kind}} (default:
    the registry's), used to find the peers."""
    times, clocks = {}, {}
    for row in rows:
        ms, clock = _timing(row)
        if ms is not None and math.isfinite(ms) and ms > 0:
            key = (_field(row, "op"), _field(row, "case"), _field(row, "mode"))
            times.setdefault(key, {})[_field(row, "variant")] = ms
            clocks.setdefault(key, {})[_field(row, "variant")] = clock
    verdicts = []
    kinds = kinds if kinds is not None else {}
    for (op_name, case, mode), by_variant in times.items():
        clock = clocks[op_name, case, mode]
        op_kinds = kinds.get(op_name) if op_name in kinds else _kinds(op_name)
        if comparisons is not None:
            wanted = comparisons
        else:
            try:
                from .registry import get

                wanted = comparisons_for(get(op_name))
            except KeyError:
                wanted = DEFAULT_COMPARISONS
        for comp in wanted:
            if comp.candidate not in by_variant:
                continue
            ours = clock[comp.candidate]
            if comp.baseline == BEST_PEER:
                pool = [v for v in by_variant if op_kinds.get(v) == "peer"]
            elif isinstance(comp.baseline, tuple):
                pool = [v for v in comp.baseline if v in by_variant and v != comp.candidate]
            else:
                pool = [comp.baseline] if comp.baseline in by_variant else []
            pool = [v for v in pool if _comparable(ours, clock[v])]
            if not pool:
                continue
            base = min(pool, key=by_variant.get)
            speedup = by_variant[base] / by_variant[comp.candidate]
            verdicts.append(Verdict(op_name, case, mode, comp.label, comp.candidate, base, by_variant[comp.candidate],
                                    by_variant[base], speedup, verdict(speedup, rules)))
    return verdicts


def markdown(verdicts, title="Decision points") -> str:
    lines = [f"# {title}", "", f"Rule ({SOURCE}): " + "; ".join(
        f"{r.verdict} for speedups in [{r.lower:g}, {r.upper:g})" for r in RULES) + ".", "",
        "| op | case | mode | comparison | fastest baseline | candidate ms | baseline ms | speedup | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in verdicts:
        lines.append(f"| {v.op} | {v.case} | {v.mode} | {v.comparison} | {v.baseline} | {v.candidate_ms:.4f} | "
                     f"{v.baseline_ms:.4f} | {v.speedup:.2f}x | **{v.verdict}** |")
    return "\n".join(lines) + "\n"


def write(verdicts, out_dir, stem="decisions", machine=None):
    """Write ``stem``.json and ``stem``.md into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"rule": [asdict(r) for r in RULES], "source": SOURCE, "machine": machine,
               "verdicts": [asdict(v) for v in verdicts]}
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    md_path.write_text(markdown(verdicts))
    return json_path, md_path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attnbench.bench.decisions", description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a JSON report written by attnbench bench/run --json")
    parser.add_argument("--op", action="append", help="only these operators (repeatable)")
    parser.add_argument("--out", help="directory for decisions.json / decisions.md (default: print markdown)")
    parser.add_argument("--stem", default="decisions")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    rows = [r for r in report.get("bench", []) if not args.op or r.get("op") in args.op]
    verdicts = decide(rows)
    if args.out:
        for path in write(verdicts, args.out, args.stem, report.get("machine")):
            print(path)
    else:
        print(markdown(verdicts), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
