"""Where a variant's time goes when CUDA events read far above its CUDA-graph replay: the host.

    python3 scripts/gpu_dev_host.py --op jvp_attention --cases anchor --variant triton --mode hvp_rev_rev \
        [--case-index 3] [--profile]

Per (case, variant, mode): CUDA-event median (L2 flushed), CUDA-graph median (GPU time alone),
host submission time (the wall time of 50 back-to-back calls without a sync, divided by 50: when it
exceeds the graph time the GPU waits on Python) and, with --profile, the 45 costliest host functions
by cumulative time (cProfile over 20 calls). Works on any registered operator.
"""
import argparse
import cProfile
import pstats
import time

import torch

import attnbench
from attnbench.bench.registry import Unsupported
from attnbench.bench.timing import measure, synchronize


def host_ms(fn, device, calls=50):
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    submitted = time.perf_counter() - start
    synchronize(device)
    return submitted / calls * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", required=True)
    parser.add_argument("--cases", default="anchor")
    parser.add_argument("--case-index", type=int, action="append")
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--mode", action="append")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu checks that the script runs")
    args = parser.parse_args()
    op = attnbench.get(args.op)
    cases = op.cases(args.cases)
    picked = args.case_index or range(len(cases))
    for index in picked:
        case = cases[index]
        x = op.make_inputs(case, args.device)
        for mode in args.mode or op.modes:
            for name in args.variant:
                try:
                    fn = op.variants[name].prepare(case, x, mode)
                    events = measure(fn, args.device).median_ms
                    try:
                        graph = f"{measure(fn, args.device, cuda_graph=True).median_ms:.4f}"
                    except Unsupported as exc:
                        graph = f"n/a ({exc})"
                    host = host_ms(fn, args.device)
                except Unsupported as exc:
                    print(f"{case.label} {mode} {name}: declined: {exc}")
                    continue
                print(f"{case.label} {mode} {name}: events {events:.4f} ms, graph {graph} ms, host {host:.4f} ms/call",
                      flush=True)
                if args.profile:
                    profile = cProfile.Profile()
                    profile.enable()
                    for _ in range(20):
                        fn()
                    synchronize(args.device)
                    profile.disable()
                    pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
