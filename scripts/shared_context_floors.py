#!/usr/bin/env python3
"""shared_context against its two bars, per case of a report: the copy-bandwidth bar beside the most of the copy
bandwidth the case's exponentials allow at all, and the speed over the best gated baseline.

    python scripts/shared_context_floors.py REPORT.json [--markdown X.md] [--plot X.png] [--copy-bar 50]
        [--speed-bar 1.3] [--sm-clock-ghz 1.98]

REPORT.json is an `attnbench bench` or `run` report holding shared_context rows (the triton variant and the gated
baselines: per_batch_flash, split, expand0_flash, fold_flash). Per case: the minimum bytes and their time at the
report's measured copy bandwidth; the exponentials (one per visible (row, key) pair) and their time on every SM's
special-function units at the highest SM clock (attnbench.roofline.exp_floor_s); the matmuls at the measured matmul
ceiling; the attainable % of copy bandwidth (100 where the bytes take longest, else the bytes' time over the longest
floor, with --launch-floor-us the least time one timed kernel launch reads): no kernel can show more, whatever else
it does. Then the triton variant's measured % of copy and its speed
over the fastest gated baseline.
Without a report (--model-only) it prints the floors alone for the tabpfn case set on a given card.
"""
import argparse
import json
import sys

import attnbench
from attnbench.roofline import MAX_SM_CLOCK_GHZ, attainable_copy_pct, exp_floor_s

OP = attnbench.get("shared_context")


def cases_by_label():
    return {c.label: c for name in OP.case_sets for c in OP.cases(name)}


def rows_of(report):
    """{case label: {variant: median ms}} of the report's shared_context fwd rows that were timed."""
    out = {}
    for r in report.get("bench", []):
        if r.get("op") == "shared_context" and r.get("mode") == "fwd" and not r.get("skipped") and r.get("timing"):
            out.setdefault(r["case"], {})[r["variant"]] = r["timing"]["median_ms"]
    return out


def floors(case, copy_gbps, matmul_tflops, sms, clock_ghz, launch_s=0.0):
    nbytes, exps = OP.bytes(case, "fwd"), OP.exponentials(case, "fwd")
    exp_s, matmul_s = exp_floor_s(exps, sms, clock_ghz), OP.flops(case, "fwd") / (matmul_tflops * 1e12)
    return {"bytes": nbytes, "exps": exps, "copy_us": nbytes / (copy_gbps * 1e9) * 1e6, "exp_us": exp_s * 1e6,
            "matmul_us": matmul_s * 1e6,
            "attainable_pct": attainable_copy_pct(nbytes, copy_gbps, exp_s, matmul_s, launch_s)}


def table(report, args):
    copy_gbps = report["ceilings"]["copy_gbps"] if report else args.copy_gbps
    matmul_tflops = report["ceilings"]["matmul_tflops"] if report else args.matmul_tflops
    sms = report["machine"]["multiprocessors"] if report else args.multiprocessors
    known = cases_by_label()
    timed = rows_of(report) if report else {c.label: {} for c in OP.cases("tabpfn")}
    out = []
    for label, ms in timed.items():
        case = known.get(label)
        if case is None:
            print(f"skipped {label!r}: not a case of any shared_context case set", file=sys.stderr)
            continue
        row = {"case": label, **floors(case, copy_gbps, matmul_tflops, sms, args.sm_clock_ghz,
                                       args.launch_floor_us * 1e-6)}
        if "triton" in ms:
            row["triton_us"] = ms["triton"] * 1e3
            row["copy_pct"] = 100.0 * row["copy_us"] / row["triton_us"]
            gated = {v: t for v, t in ms.items() if v in OP.gate_baselines}
            if gated:
                best = min(gated, key=gated.get)
                row["best_baseline"], row["speedup"] = best, gated[best] / ms["triton"]
        out.append(row)
    return out, copy_gbps, matmul_tflops, sms


def markdown(rows, args, copy_gbps, matmul_tflops, sms, device):
    lines = [f"# shared_context against its bars on {device}", "",
             f"Copy bandwidth {copy_gbps:.0f} GB/s and matmul {matmul_tflops:.0f} TF/s (measured); exponentials at "
             f"{sms} SMs x 16 a clock x {args.sm_clock_ghz} GHz; one timed launch {args.launch_floor_us:g} us. "
             f"Bars: >= {args.copy_bar:g}% of copy bandwidth, >= {args.speed_bar:g}x the best gated baseline.", "",
             "| case | MB | exps (M) | bytes us | exps us | matmul us | attainable % copy | triton us | % copy | "
             "best baseline | speedup |", "|" + " --- |" * 11]
    for r in rows:
        unreachable = r["attainable_pct"] < args.copy_bar
        measured = ("", "", "", "")
        if "triton_us" in r:
            measured = (f"{r['triton_us']:.1f}", f"{r['copy_pct']:.0f}", r.get("best_baseline", "-"),
                        f"{r['speedup']:.2f}x" if "speedup" in r else "-")
        bold = "**" if unreachable else ""
        lines.append(f"| {r['case']} | {r['bytes'] / 1e6:.1f} | {r['exps'] / 1e6:.1f} | {r['copy_us']:.1f} | "
                     f"{r['exp_us']:.1f} | {r['matmul_us']:.1f} | {bold}{r['attainable_pct']:.0f}{bold} | "
                     + " | ".join(measured) + " |")
    unreachable = [r for r in rows if r["attainable_pct"] < args.copy_bar]
    timed = [r for r in rows if "copy_pct" in r]
    lines += ["", f"- Copy bar above what the floors allow (bold): "
              f"{len(unreachable)} of {len(rows)} cases.",
              f"- Copy bar met: {sum(r['copy_pct'] >= args.copy_bar for r in timed)} of {len(timed)} timed; "
              f"reachable but not met: {sum(r['copy_pct'] < args.copy_bar <= r['attainable_pct'] for r in timed)}.",
              f"- Speed bar met: {sum(r.get('speedup', 0) >= args.speed_bar for r in timed)} of "
              f"{sum('speedup' in r for r in timed)} with a gated baseline."]
    return "\n".join(lines) + "\n"


def plot(rows, args, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "copy_pct" in r]
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(timed)), 4.5))
    x = range(len(timed))
    ax.bar(x, [r["attainable_pct"] for r in timed], color="#cfd8e3",
           label="attainable (the floors')")
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
    ap.add_argument("report", nargs="?", help="attnbench bench/run JSON with shared_context rows")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    ap.add_argument("--copy-bar", type=float, default=50.0)
    ap.add_argument("--speed-bar", type=float, default=1.3)
    ap.add_argument("--sm-clock-ghz", type=float, default=MAX_SM_CLOCK_GHZ)
    ap.add_argument("--launch-floor-us", type=float, default=0.0, help="the least time one timed kernel launch "
                    "reads on the report's GPU (scripts/gpu_dev_launch_floor.py), a floor beside the others")
    ap.add_argument("--model-only", action="store_true", help="no report: the tabpfn set's floors on a card given "
                    "by --copy-gbps and --multiprocessors")
    ap.add_argument("--copy-gbps", type=float, default=3019.0, help="with --model-only (default: an H100's)")
    ap.add_argument("--matmul-tflops", type=float, default=785.0, help="with --model-only (default: an H100's)")
    ap.add_argument("--multiprocessors", type=int, default=132, help="with --model-only")
    args = ap.parse_args()
    if not args.report and not args.model_only:
        ap.error("give a report, or --model-only")
    report = None if args.model_only else json.load(open(args.report))
    rows, copy_gbps, matmul_tflops, sms = table(report, args)
    device = report["machine"].get("device_name", "?") if report else f"{sms} SMs, {copy_gbps:.0f} GB/s"
    text = markdown(rows, args, copy_gbps, matmul_tflops, sms, device)
    print(text)
    if args.markdown:
        open(args.markdown, "w").write(text)
    if args.plot and report:
        plot(rows, args, args.plot, device)


if __name__ == "__main__":
    main()
