#!/usr/bin/env python3
"""flash's split-KV forward beside FA2's query tiles and SDPA's FLASH and cuDNN, in one run on one GPU.

    python3 scripts/gpu_dev_flash_decode.py [--json OUT.json] [--quick] [--cases decode|gpu]
    compute-sanitizer --tool memcheck python3 scripts/gpu_dev_flash_decode.py --sanitize
    python3 scripts/gpu_dev_flash_decode.py --plot-from OUT.json --plot OUT.png    (no GPU needed)

Over flash's ``decode`` case set (Nq 1 and 16, GQA 32/8, D 64-256, Nk 2K-32K): the forward of the
Triton variant by each route (``forward_route``), and the SDPA backends on the same inputs. Each row
gives the medians (CUDA events, L2 flushed), decode over tiles, FLASH and cuDNN, the decode route's
GB/s on the minimum-bytes model (q, K, V read once, o and lse written) as % of the measured copy
bandwidth, the split count it took, and its error against the float64 reference (max relative, as
the verifier measures it). ``--sanitize`` instead runs the route once on odd shapes (lengths off the
block sizes, row tiles, empty splits, blind rows, D 24-256), each checked against the float64
reference: the workload for compute-sanitizer.
"""
import argparse
import functools
import json

import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.attention.flash_decode import decode_plan
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.operators.flash.peers import sdpa_forward
from attnbench.bench.registry import Unsupported
from attnbench.bench.roofline import ceilings, machine_info
from attnbench.bench.timing import measure

OP = attnbench.get("flash")


def splits_of(case, device):
    return decode_plan(case.batch, case.heads_q, case.seqlen_q, case.heads_kv, case.seqlen_k, device)[2]


# (B, Hq, Hkv, Nq, Nk, D, causal): odd sizes for the sanitizer
ODD_SHAPES = [(3, 6, 2, 1, 1001, 24, None), (2, 8, 1, 17, 333, 80, "bottom_right"),
              (1, 4, 4, 50, 31, 256, "bottom_right"), (2, 32, 8, 5, 4097, 128, None), (1, 2, 1, 64, 70, 96, "top_left"),
              (5, 12, 3, 3, 129, 64, "bottom_right")]


def sanitize():
    from attnbench.operators.flash import FlashCase

    device = torch.device("cuda")
    for shape in ODD_SHAPES:
        for dtype in ("bfloat16", "float32"):
            case = FlashCase(*shape, dtype=dtype)
            x = OP.make_inputs(case, device, 0)
            with forward_route("decode"):
                out = OP.variants["triton"].prepare(case, x, "fwd")()
            oracle = OP.oracle(case, x)
            err = max(verify.relative_error(out[name], oracle[name]) for name in ("o", "lse"))
            print(f"{case.label:48s} splits {splits_of(case, device):3d}  error {err:.1e} "
                  f"{'ok' if err < verify.BOUNDS[case.torch_dtype] else 'OVER BOUND'}", flush=True)


def plot(doc, path):
    """Per case: decode's speedup over the tiles route, SDPA FLASH and cuDNN (bars, log scale), and
    its % of copy bandwidth (dots, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    labels = [r["case"].replace(" bf16", "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 5.5))
    width = 0.27
    for k, (name, label) in enumerate((("tiles", "over FA2 query tiles"), ("FLASH_ATTENTION", "over SDPA FLASH"),
                                       ("CUDNN_ATTENTION", "over SDPA cuDNN"))):
        values = [r["times_ms"][name] / r["times_ms"]["decode"] if r["times_ms"].get(name) else 0 for r in rows]
        ax.bar([i + (k - 1) * width for i in range(len(rows))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("split-KV forward: speedup (x)")
    ax.set_xticks(range(len(rows)), labels, rotation=70, ha="right", fontsize=7)
    right = ax.twinx()
    right.plot(range(len(rows)), [r["copy_pct"] for r in rows], "ko", markersize=4, label="% of copy bandwidth")
    right.axhline(80, color="gray", linestyle="--", linewidth=0.8)
    right.set_ylim(0, 110)
    right.set_ylabel("% of copy bandwidth (dots; dashed: 80%)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"flash forward, decode shapes (bf16), {doc['machine'].get('device_name', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="the D 128 cases only")
    parser.add_argument("--cases", default="decode")
    parser.add_argument("--sanitize", action="store_true", help="odd shapes once each, for compute-sanitizer")
    parser.add_argument("--plot", help="write a PNG of the rows (after the run, or of --plot-from)")
    parser.add_argument("--plot-from", help="a JSON this script wrote: plot it, run nothing")
    args = parser.parse_args()
    if args.sanitize:
        return sanitize()
    if args.plot_from:
        with open(args.plot_from) as f:
            return plot(json.load(f), args.plot or args.plot_from.replace(".json", ".png"))
    device = torch.device("cuda")
    ceil = ceilings(device)
    cases = OP.cases(args.cases)
    if args.quick:
        cases = [c for c in cases if c.head_dim == 128]
    rows = []
    print(f"{'case':44s} {'decode':>9s} {'tiles':>9s} {'FLASH':>9s} {'cuDNN':>9s} {'/tiles':>7s} {'/FLASH':>7s} "
          f"{'/cuDNN':>7s} {'GB/s':>7s} {'%copy':>6s} {'splits':>6s} {'err':>8s}", flush=True)
    for case in cases:
        x = OP.make_inputs(case, device, 0)
        q, k, v = x["q"], x["k"], x["v"]
        offset = case.causal_offset
        oracle = OP.oracle(case, x)
        times, err = {}, None
        for route in ("decode", "tiles"):
            with forward_route(route):
                fn = OP.variants["triton"].prepare(case, x, "fwd")
                if route == "decode":
                    out = fn()
                    err = max(verify.relative_error(out[name], oracle[name]) for name in ("o", "lse"))
                times[route] = measure(fn, device).median_ms
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            forward = sdpa_forward(backend, case, offset)
            try:
                with torch.no_grad():
                    forward(q, k, v)
                times[backend] = measure(functools.partial(forward, q, k, v), device).median_ms
            except (RuntimeError, Unsupported) as exc:
                times[backend] = None
                print(f"  {backend}: {str(exc).splitlines()[0][:100]}")
        nbytes = OP.bytes(case, "fwd")
        gbps = nbytes / times["decode"] / 1e6
        row = dict(case=case.label, times_ms=times, gbps=gbps, copy_pct=100 * gbps / ceil.copy_gbps,
                   splits=splits_of(case, device), max_rel_error=err)
        rows.append(row)

        def ratio(name):
            return f"{times[name] / times['decode']:7.2f}" if times.get(name) else f"{'-':>7s}"

        def ms(name):
            return f"{times[name]:9.4f}" if times.get(name) else f"{'-':>9s}"

        print(f"{case.label:44s} {ms('decode')} {ms('tiles')} {ms('FLASH_ATTENTION')} {ms('CUDNN_ATTENTION')} "
              f"{ratio('tiles')} {ratio('FLASH_ATTENTION')} {ratio('CUDNN_ATTENTION')} {gbps:7.0f} "
              f"{row['copy_pct']:6.1f} {row['splits']:6d} {err if err is None else f'{err:8.1e}'}", flush=True)
        del x, q, k, v, oracle
        torch.cuda.empty_cache()
    doc = {"machine": machine_info(device), "ceilings": ceil.__dict__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)


if __name__ == "__main__":
    main()
