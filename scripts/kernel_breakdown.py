"""Where a call's GPU time goes, kernel by kernel: each variant's timed call of an operator's case under
torch.profiler, its kernels' mean GPU time per call (issue 37: "measure where each microsecond goes before
cutting"; the bench's GPU time is the sum, launch gaps included).

    python scripts/kernel_breakdown.py --op flash --cases random --mode bwd --match 'B3 H1 N8x5549 ' \
        --variant triton --variant sdpa_flash [--calls 20] [--json out.json]

One line per kernel: its mean us per call, how many launches a call makes of it, and its share of the variant's
kernel time; then the variant's kernel sum a call, and the GPU's span a call: the first kernel's start to the last
one's end over all the calls, divided by their number. The span counts the gaps between kernels and between calls, so
a host-bound call reads its host's pace there. GPU only.
"""
import argparse
import json
import re
from collections import defaultdict

import torch

import attnbench
from attnbench.bench import registry


def kernels_per_call(run, calls):
    """tally() over ``calls`` calls of ``run`` after three warm ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    return tally(prof.events(), calls)


def tally(events, calls):
    """{kernel name: (us a call, launches a call)} of the GPU events among ``events`` (torch.profiler's), and the
    span from the first kernel's start to the last one's end over all ``calls``, divided by ``calls``."""
    table, first, last = defaultdict(lambda: [0.0, 0]), None, None
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = table[event.name]
        row[0] += event.device_time
        row[1] += 1
        start, end = event.time_range.start, event.time_range.end
        first = start if first is None else min(first, start)
        last = end if last is None else max(last, end)
    span = (last - first) / calls if first is not None else 0.0
    return {name: (total / calls, count / calls) for name, (total, count) in table.items()}, span


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="flash")
    parser.add_argument("--cases", default="random")
    parser.add_argument("--match", default=".", help="only the cases whose label matches (re.search)")
    parser.add_argument("--mode", default="bwd")
    parser.add_argument("--variant", action="append", help="variants or forced routes (default: triton)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args()
    op = attnbench.get(args.op)
    for name in args.variant or []:
        try:
            op.variant(name)
        except KeyError as exc:
            parser.error(exc.args[0])
    if not torch.cuda.is_available():
        parser.error("kernel_breakdown profiles a GPU's kernels: no GPU here")
    device = torch.device("cuda")
    rows = []
    for case in op.cases(args.cases):
        if not re.search(args.match, case.label):
            continue
        inputs = op.make_inputs(case, device)
        for name in args.variant or ["triton"]:
            variant = op.variant(name)
            reason = variant.unavailable_reason(device)
            try:
                if reason:
                    raise registry.Unsupported(reason)
                run = variant.prepare(case, inputs, args.mode)
                table, span = kernels_per_call(run, args.calls)
            except (registry.Unsupported, RuntimeError, NotImplementedError) as exc:
                print(f"{case.label} {args.mode} {name}: not run ({str(exc).strip().splitlines()[0][:120]})")
                continue
            total = sum(us for us, _ in table.values())
            print(f"{case.label} {args.mode} {name}: kernels {total:.1f} us a call in "
                  f"{sum(n for _, n in table.values()):.0f} launches; GPU span {span:.1f} us a call")
            for kernel, (us, count) in sorted(table.items(), key=lambda kv: -kv[1][0]):
                print(f"  {us:9.1f} us  x{count:<4.0f} {100 * us / max(total, 1e-9):5.1f}%  {kernel[:110]}")
            rows.append(dict(case=case.label, mode=args.mode, variant=name, kernel_us=total, span_us=span,
                             kernels={k: dict(us=us, launches=n) for k, (us, n) in table.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(op=args.op, mode=args.mode, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
