"""``attnbench``: list operators, verify them, benchmark them, or do both (``run``).

On a machine without CUDA everything runs on the CPU: Triton kernels through the interpreter,
on the tiny case set, and the timings say they are interpreter timings.
"""
import argparse
import json
import math
import os
import sys

import torch

from .registry import all_operators, get
from .roofline import ceilings, machine_info
from .runner import bench, check
from .verify import BOUNDS

# Default case set per command, as (on CPU, on CUDA). ``run`` checks and times the same cases.
DEFAULT_SETS = {"check": ("tiny", "gpu"), "bench": ("tiny", "anchor"), "run": ("tiny", "anchor")}


def _device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attnbench: --device cuda asked for, but torch sees no CUDA device")
    return device


def _ops(names):
    if not names:
        return list(all_operators().values())
    return [get(n) for n in names]


def _cases(op, set_name, device, kind):
    set_name = set_name or DEFAULT_SETS[kind][device.type == "cuda"]
    return op.cases(set_name)


def _fmt(value, spec, empty="-"):
    return empty if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def check_table(results):
    rows = []
    for r in results:
        status = "skip" if r.skipped else ("ok" if r.passed else "FAIL")
        errs = " ".join(f"{o.name} {o.error:.1e}/{o.bound:.0e}" for o in r.outputs) or r.skipped
        rows.append((r.case, r.mode, r.variant, status, errs))
    return table(("case", "mode", "variant", "status", "rel. error / bound per output"), rows)


def bench_table(rows, dtype_of):
    body = []
    for r in rows:
        t = r.timing
        err = _fmt(r.max_error, ".1e")
        if t and not math.isnan(r.max_error) and r.max_error > BOUNDS[dtype_of(r.case)]:
            err += " !"  # over the dtype bound: expected of eager bf16, a red flag for anything else
        body.append((r.case, r.mode, r.variant, t.method if t else "-",
                     _fmt(t and t.median_ms, ".3f", r.skipped[:60] if r.skipped else "-"),
                     _fmt(t and t.iqr_ms, ".3f"), _fmt(r.tflops if t else None, ".1f"),
                     _fmt(r.gbps if t else None, ".0f"), _fmt(r.roofline_pct, ".0f"),
                     _fmt(r.speedup, ".2f") + ("" if r.speedup is None else "x"), err))
    return table(("case", "mode", "variant", "clock", "median ms", "IQR ms", "TF/s", "GB/s", "% roof",
                  "vs " + (next((r.baseline for r in rows if r.baseline), None) or "baseline"), "max rel err"), body)


def ratio_lines(rows, subject, peers):
    """'triton is N.NNx <peer>' per case and mode: the side-by-side claim in one line each."""
    lines = []
    by_key = {}
    for r in rows:
        if r.timing:
            by_key.setdefault((r.case, r.mode), {})[r.variant] = r.timing.median_ms
    for (case, mode), times in by_key.items():
        if subject in times:
            parts = [f"{times[p] / times[subject]:.2f}x {p}" for p in peers if p in times]
            if parts:
                lines.append(f"{case:34s} {mode:7s} {subject} speed = " + ", ".join(parts))
    return lines


def _dtype_lookup(cases):
    by_label = {c.label: c.torch_dtype for c in cases}
    return lambda label: by_label[label]


def cmd_list(args):
    device = _device(args.device)
    for op in _ops(args.op):
        print(f"{op.name}: {op.description}")
        print(f"  modes: {', '.join(op.modes)}; case sets: {', '.join(op.case_sets)}")
        for name, v in op.variants.items():
            reason = v.unavailable_reason(device)
            state = "available" if reason is None else f"unavailable on {device.type}: {reason}"
            print(f"  {name:15s} {v.kind:9s} {state}\n  {'':15s} {v.description}")
    return 0


def _header(device):
    info = machine_info(device)
    line = f"# {info['device_name']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']}"
    if device.type == "cpu":
        line += "\n# CPU run: Triton kernels run in the interpreter; timings check that code runs, they are not performance"
    return line


def _run_checks(args, device, report, kind="check"):
    failures = 0
    for op in _ops(args.op):
        cases = _cases(op, args.cases, device, kind)
        results = check(op, cases, device, args.variant, args.mode, args.seed, not args.quiet)
        report.setdefault("checks", []).extend(r.as_dict() for r in results)
        print(f"\n## check {op.name} ({len(cases)} cases)\n" + check_table(results))
        failures += sum(1 for r in results if not r.passed and not r.skipped)
    return failures


def _run_bench(args, device, report, kind="bench"):
    over_bound = 0
    for op in _ops(args.op):
        cases = _cases(op, args.cases, device, kind)
        rows = bench(op, cases, device, args.variant, args.mode, args.seed, args.baseline, args.graphs,
                     progress=not args.quiet)
        report.setdefault("bench", []).extend(r.as_dict() for r in rows)
        dtype_of = _dtype_lookup(cases)
        print(f"\n## bench {op.name} ({len(cases)} cases)\n" + bench_table(rows, dtype_of))
        lines = ratio_lines(rows, op.ratio_subject, op.ratio_peers)
        if lines:
            print("\n" + "\n".join(lines))
        # our implementations must stay within bounds; the eager reference and peers are reported
        over_bound += sum(1 for r in rows if r.timing and op.variants[r.variant].kind in ("split", "triton")
                          and r.max_error > BOUNDS[dtype_of(r.case)])
    return over_bound


def _finish(args, device, report, failures):
    if args.json:
        report["machine"] = machine_info(device)
        c = ceilings(device)
        report["ceilings"] = c.__dict__ if c else None
        text = json.dumps(report, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    if failures:
        print(f"\n{failures} check(s) failed", file=sys.stderr)
    return 1 if failures else 0


def cmd_check(args):
    device = _device(args.device)
    print(_header(device))
    report = {}
    return _finish(args, device, report, _run_checks(args, device, report))


def cmd_bench(args):
    device = _device(args.device)
    print(_header(device))
    report = {}
    return _finish(args, device, report, _run_bench(args, device, report))


def cmd_run(args):
    device = _device(args.device)
    print(_header(device))
    report = {}
    failures = _run_checks(args, device, report, "run")
    failures += _run_bench(args, device, report, "run")
    return _finish(args, device, report, failures)


def cmd_report(args):
    from . import report

    data = report.load(args.report)
    text = report.markdown(data)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.plot:
        try:
            report.plot(data, args.plot)
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'attnbench[plot]'") from None
    return 0


def cmd_calibrate(args):
    device = _device(args.device)
    c = ceilings(device, refresh=True)
    if c is None:
        print("no CUDA device: nothing to calibrate (CPU timings are interpreter timings)")
        return 0
    print(f"{c.device_name}: bf16 matmul {c.matmul_tflops:.0f} TF/s, device copy {c.copy_gbps:.0f} GB/s")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="attnbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, with_cases=True):
        p.add_argument("--op", action="append", help="operator (repeatable; default: all)")
        p.add_argument("--device", default="auto", help="auto (default), cpu or cuda[:N]")
        if with_cases:
            p.add_argument("--cases", help="case set: tiny, gpu, anchor, sweep (default: tiny on CPU; "
                                           "on CUDA check: gpu, bench and run: anchor)")
            p.add_argument("--variant", action="append", help="variant (repeatable; default: all available)")
            p.add_argument("--mode", action="append", help="mode (repeatable; default: all)")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--baseline", help="variant the speedup column divides by")
            p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays")
            p.add_argument("--json", help="write a JSON report to this path ('-' for stdout)")
            p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    common(sub.add_parser("list", help="operators, variants and where they can run"), with_cases=False)
    common(sub.add_parser("check", help="verify variants against the float64 oracle"))
    common(sub.add_parser("bench", help="time variants: latency, TF/s, GB/s, %% of roofline, speedup, error"))
    common(sub.add_parser("run", help="check, then bench: the main job"))
    common(sub.add_parser("calibrate", help="measure this GPU's matmul and copy ceilings"), with_cases=False)
    rep = sub.add_parser("report", help="markdown summary (and a plot) of a --json report")
    rep.add_argument("report", help="a JSON file written by bench/run --json")
    rep.add_argument("--markdown", help="write the summary here instead of printing it")
    rep.add_argument("--plot", help="write a PNG of TF/s per variant (needs matplotlib)")
    return parser


COMMANDS = {"list": cmd_list, "check": cmd_check, "bench": cmd_bench, "run": cmd_run, "calibrate": cmd_calibrate,
            "report": cmd_report}


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (KeyError, ValueError) as exc:
        print(f"attnbench: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `attnbench list | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
