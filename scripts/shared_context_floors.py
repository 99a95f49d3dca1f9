#!/usr/bin/env python3
"""shared_context against its two bars, per case of a report: the copy-bandwidth bar beside the most of the copy
bandwidth the case's other work allows, and the speed over the best gated baseline.

    python scripts/shared_context_floors.py REPORT.json [MORE.json ...] [--markdown X.md] [--plot X.png]
        [--copy-bar 50] [--speed-bar 1.3] [--sm-clock-ghz 1.98] [--exp-rate-factor 1] [--matmul-tflops T]
        [--launch-floor-us U]
    python scripts/shared_context_floors.py --model-only [--copy-gbps G] [--matmul-tflops T] [--multiprocessors M]

REPORT.json: `attnbench bench` or `run` reports (parts of one run, as `attnbench report` reads them) holding
shared_context rows: the triton variant and the gated baselines (per_batch_flash, split, expand0_flash, fold_flash).
Per case, the least time each resource allows:
- the minimum bytes at the report's measured copy bandwidth;
- the exponentials, one per visible (row, key) pair, on every SM's special-function units: 16 a clock at the highest
  SM clock (attnbench.bench.roofline.exp_floor_s), times --exp-rate-factor (2: as if half of them ran as polynomials on the
  FMA units at no cost, FlashAttention-4's trick, more than a Hopper SM's issue slots allow);
- the matmuls at the report's measured matmul ceiling, or at --matmul-tflops (e.g. a datasheet peak);
- with --launch-floor-us, one timed kernel launch (scripts/gpu_dev_launch_floor.py; it holds for CUDA-event timings,
  not for CUDA-graph replays).
The attainable % of copy bandwidth is the bytes' time over the longest of these (roofline.attainable_copy_pct): no
kernel shows more under those assumptions. Then the triton variant's measured % of copy and its speed over the
fastest gated baseline timed on the same clock.
"""
import argparse
import sys

import attnbench
from attnbench.bench.decisions import Comparison, decide
from attnbench.bench.results import BadResultFile, load, merge
from attnbench.bench.roofline import MAX_SM_CLOCK_GHZ, attainable_copy_pct, exp_floor_s

OP = attnbench.get("shared_context")
# the speed bar: triton over the fastest gated baseline timed on its clock (attnbench.bench.decisions)
GATE = Comparison("triton", tuple(OP.gate_baselines))


def cases_by_label():
    return {c.label: c for name in OP.case_sets for c in OP.cases(name)}


def rows_of(report):
    """The report's timed shared_context fwd rows."""
    return [r for r in report.get("bench", []) if r.get("op") == "shared_context" and r.get("mode") == "fwd"
            and not r.get("skipped") and r.get("timing")]


def floors(case, copy_gbps, matmul_tflops, sms, args):
    nbytes, exps = OP.bytes(case, "fwd"), OP.exponentials(case, "fwd")
    exp_s = exp_floor_s(exps, sms, args.sm_clock_ghz) / args.exp_rate_factor
    matmul_s = OP.flops(case, "fwd") / (matmul_tflops * 1e12)
    launch_s = args.launch_floor_us * 1e-6
    return {"bytes": nbytes, "exps": exps, "copy_us": nbytes / (copy_gbps * 1e9) * 1e6, "exp_us": exp_s * 1e6,
            "matmul_us": matmul_s * 1e6,
            "attainable_pct": attainable_copy_pct(nbytes, copy_gbps, exp_s, matmul_s, launch_s)}


def _measured(row, ours, verdict):
    """The triton variant's share of copy bandwidth, and its speed over the fastest gated baseline."""
    if ours is None or ours["timing"].get("method") not in ("cuda-events", "cuda-graph"):
        return
    row["triton_us"] = ours["timing"]["median_ms"] * 1e3
    row["copy_pct"] = 100.0 * row["copy_us"] / row["triton_us"]
    if verdict is not None:
        row["best_baseline"], row["speedup"] = verdict.baseline, verdict.speedup


def machine_figures(report, args):
    """(copy GB/s, matmul TF/s, SMs, device) of a report, or of the flags with --model-only."""
    if report is None:
        return args.copy_gbps, args.matmul_tflops or 785.0, args.multiprocessors, "the model alone"
    ceilings, machine = report.get("ceilings") or {}, report.get("machine") or {}
    missing = [k for k in ("copy_gbps", "matmul_tflops") if not ceilings.get(k)]
    if missing or not machine.get("multiprocessors"):
        sys.exit(f"shared_context_floors: the report has no GPU ceilings or multiprocessor count "
                 f"({', '.join(missing + ([] if machine.get('multiprocessors') else ['machine.multiprocessors']))}):"
                 " a CPU run, or a report older than these fields")
    return (ceilings["copy_gbps"], args.matmul_tflops or ceilings["matmul_tflops"], machine["multiprocessors"],
            machine.get("device_name", "?"))


def table(report, args):
    copy_gbps, matmul_tflops, sms, device = machine_figures(report, args)
    known = cases_by_label()
    rows = rows_of(report) if report else []
    ours = {r["case"]: r for r in rows if r["variant"] == "triton"}
    verdicts = {v.case: v for v in decide(rows, comparisons=(GATE,))}
    labels = dict.fromkeys(r["case"] for r in rows) if report else [c.label for c in OP.cases("tabpfn")]
    out = []
    for label in labels:
        case = known.get(label)
        if case is None:
            print(f"skipped {label!r}: not a case of any shared_context case set", file=sys.stderr)
            continue
        row = {"case": label, **floors(case, copy_gbps, matmul_tflops, sms, args)}
        _measured(row, ours.get(label), verdicts.get(label))
        out.append(row)
    return out, (copy_gbps, matmul_tflops, sms, device)


def markdown(rows, args, figures, measured):
    copy_gbps, matmul_tflops, sms, device = figures
    source = "measured" if measured else "given"
    matmul_source = "given" if args.matmul_tflops else source
    launch = f"{args.launch_floor_us:g} us" if args.launch_floor_us else "not counted"
    lines = [f"# shared_context against its bars on {device}", "",
             f"Copy bandwidth {copy_gbps:.0f} GB/s ({source}); matmuls at {matmul_tflops:.0f} TF/s ({matmul_source}); "
             f"exponentials at {sms} SMs x 16 a clock x {args.sm_clock_ghz} GHz x {args.exp_rate_factor:g}; one timed "
             f"launch: {launch}. Bars: >= {args.copy_bar:g}% of copy bandwidth, >= {args.speed_bar:g}x the best gated "
             "baseline.", "",
             "| case | MB | exps (M) | bytes us | exps us | matmul us | attainable % copy | triton us | % copy | "
             "best baseline | speedup |", "|" + " --- |" * 11]
    for r in rows:
        bold = "**" if r["attainable_pct"] < args.copy_bar else ""
        measured_cells = ("", "", "", "")
        if "triton_us" in r:
            measured_cells = (f"{r['triton_us']:.1f}", f"{r['copy_pct']:.1f}", r.get("best_baseline", "-"),
                              f"{r['speedup']:.2f}x" if "speedup" in r else "-")
        lines.append(f"| {r['case']} | {r['bytes'] / 1e6:.1f} | {r['exps'] / 1e6:.1f} | {r['copy_us']:.2f} | "
                     f"{r['exp_us']:.2f} | {r['matmul_us']:.2f} | {bold}{r['attainable_pct']:.1f}{bold} | "
                     + " | ".join(measured_cells) + " |")
    unreachable = [r for r in rows if r["attainable_pct"] < args.copy_bar]
    timed = [r for r in rows if "copy_pct" in r]
    lines += ["", f"- Copy bar above what the floors allow (bold): {len(unreachable)} of {len(rows)} cases."]
    if timed:
        judged = [r for r in timed if "speedup" in r]
        lines += [f"- Copy bar met: {sum(r['copy_pct'] >= args.copy_bar for r in timed)} of {len(timed)} timed; "
                  f"reachable but not met: {sum(r['copy_pct'] < args.copy_bar <= r['attainable_pct'] for r in timed)}.",
                  f"- Speed bar met: {sum(r['speedup'] >= args.speed_bar for r in judged)} of {len(judged)} with a "
                  f"gated baseline on the same clock ({GATE.label})."]
    return "\n".join(lines) + "\n"


def plot(rows, args, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "copy_pct" in r]
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(timed)), 4.5))
    x = range(len(timed))
    ax.bar(x, [r["attainable_pct"] for r in timed], color="#cfd8e3", label="attainable (the floors')")
    ax.bar(x, [r["copy_pct"] for r in timed], width=0.5, color="#2f6db3", label="triton measured")
    ax.axhline(args.copy_bar, color="#c0392b", linestyle="--", linewidth=1, label=f"bar {args.copy_bar:g}%")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["case"].replace(" H4", "").replace(" D32 bf16", "") for r in timed], rotation=70,
                       ha="right", fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"shared_context: copy bandwidth, measured and attainable ({device})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="*", help="attnbench bench/run JSON with shared_context rows (parts of one run)")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    ap.add_argument("--copy-bar", type=float, default=50.0)
    ap.add_argument("--speed-bar", type=float, default=1.3)
    ap.add_argument("--sm-clock-ghz", type=float, default=MAX_SM_CLOCK_GHZ)
    ap.add_argument("--exp-rate-factor", type=float, default=1.0, help="exponentials this many times faster than the "
                    "special-function units alone (2: a generous bound for emulating some on the FMA units)")
    ap.add_argument("--matmul-tflops", type=float, default=None, help="matmul rate instead of the report's measured "
                    "ceiling (e.g. 989, the H100 SXM's dense bf16 datasheet peak)")
    ap.add_argument("--launch-floor-us", type=float, default=0.0, help="the least time one timed kernel launch reads "
                    "(scripts/gpu_dev_launch_floor.py; CUDA-event timings only)")
    ap.add_argument("--model-only", action="store_true", help="no report: the tabpfn set's floors on a card given "
                    "by --copy-gbps, --matmul-tflops and --multiprocessors")
    ap.add_argument("--copy-gbps", type=float, default=3021.0, help="with --model-only (default: an H100's)")
    ap.add_argument("--multiprocessors", type=int, default=132, help="with --model-only")
    args = ap.parse_args()
    if bool(args.reports) == args.model_only:
        ap.error("give report files, or --model-only (not both)")
    if args.model_only and args.plot:
        ap.error("--plot draws measured shares: it needs a report")
    if args.exp_rate_factor <= 0:
        ap.error("--exp-rate-factor must be > 0")
    report = None
    if args.reports:
        try:
            report = merge([load(p) for p in args.reports], args.reports)
        except BadResultFile as exc:
            sys.exit(f"shared_context_floors: {exc}")
    rows, figures = table(report, args)
    if report is not None:
        graphs = {r["timing"].get("method") for r in rows_of(report)} == {"cuda-graph"}
        if graphs and args.launch_floor_us:
            print("note: CUDA-graph timings: the launch floor (measured with CUDA events) may not hold",
                  file=sys.stderr)
        if not rows:
            sys.exit(f"shared_context_floors: no timed shared_context fwd rows of a known case in "
                     f"{', '.join(args.reports)}")
    text = markdown(rows, args, figures, measured=report is not None)
    print(text)
    if args.markdown:
        open(args.markdown, "w").write(text)
    if args.plot:
        plot(rows, args, args.plot, figures[3])


if __name__ == "__main__":
    main()
