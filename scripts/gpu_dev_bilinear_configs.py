#!/usr/bin/env python3
"""Time attnbench/kernels/sparse/bilinear.py's kernel under each launch config, forward mul at CG L 3, 4, 6, C 32 and 128,
N 1e5, fp32 and bf16, in one process (CUDA events, L2 flushed):

    python3 scripts/gpu_dev_bilinear_configs.py > sparse-bilinear-configs.md
    python3 scripts/gpu_dev_bilinear_configs.py --row-caps 64,32,16 > sparse-bilinear-block-o.md

The candidates: the kernel's first config list (the first eight) and nine more (deeper pipelines, more columns a
program, two warps). Each is forced by replacing the autotuner's configs; "gain" is the best candidate over the best of
the first eight. A config that cannot launch (out of resources) reads nan.

--row-caps: fewer output rows a program instead (the module's MAX_BLOCK_O, 64 -> 32 -> 16), at L 4 and 6, every
config of the kernel's own list forced one at a time. At L 6 ncu had found the kernel bound by registers (the
[columns, 64] accumulator, the row's product and the held tile at once); fewer rows shrink the first two at the price
of re-reading x and the held operand once per row tile. Per case and cap: the best config's ms, the gain over the
first cap, and the largest difference from the first cap's outputs relative to their largest magnitude (the tiles only
regroup the output rows, so it should be 0 or a rounding)."""
import argparse

import torch

from attnbench.kernels.sparse import bilinear as sb  # first: it sets Triton's interpreter switch on a CPU
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.bench.timing import measure

import triton  # noqa: E402

CANDIDATES = [(4, 1, 2, 32), (4, 2, 2, 32), (4, 1, 4, 32), (8, 1, 8, 32), (4, 1, 8, 16), (4, 1, 1, 64),
              (8, 1, 2, 64), (8, 2, 4, 32),
              # new: deeper pipelines, more columns
              (4, 3, 4, 32), (8, 3, 8, 32), (8, 2, 8, 32), (8, 1, 16, 32), (4, 2, 4, 32), (8, 2, 2, 64), (8, 1, 4, 64),
              (2, 1, 2, 32), (2, 2, 1, 32)]
kernel = sb.bilinear_kernel


def cases(dtypes, l_maxes, n=100_000):
    """(label, launch) per forward mul case: ``launch()`` runs the kernel once on that case's inputs."""
    for dtype in dtypes:
        for l_max in l_maxes:
            for channels in (32, 128):
                info = cg_product_infos(l_max, l_max, l_max, device="cuda")[0]
                table = info.dense_rows["gram"]
                g = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(n, info.size1, channels, device="cuda", generator=g).to(dtype)
                y = torch.randn(n, info.size2, channels, device="cuda", generator=g).to(dtype)
                split = table.splits.get(dtype)
                yield (f"L{l_max} C{channels} {str(dtype)[6:]}",
                       lambda x=x, y=y: sb.bilinear_launch(x, y, table.matrix32, info.out_size, split))
                del x, y
                torch.cuda.empty_cache()


def forced(launch, warps, stages, blocks):
    """(output, ms) of ``launch`` with the kernel held to one config, or None where it cannot launch."""
    kernel.configs = [triton.Config(blocks, num_warps=warps, num_stages=stages)]
    kernel.cache = {}
    try:
        out = launch()
        return out, measure(launch, "cuda").median_ms
    except triton.runtime.errors.OutOfResources:
        return None


def candidates_study():
    print("| case | " + " | ".join(f"w{w} s{s} n{n} c{c}" for w, s, n, c in CANDIDATES) + " | best | first-8 best | "
          "gain |")
    print("|" + " --- |" * (len(CANDIDATES) + 4))
    for label, launch in cases((torch.float32, torch.bfloat16), (3, 4, 6)):
        runs = [forced(launch, w, s, {"BLOCK_N": bn, "BLOCK_C": bc}) for w, s, bn, bc in CANDIDATES]
        ms = [float("nan") if r is None else r[1] for r in runs]
        best = min(range(len(ms)), key=lambda i: ms[i] if ms[i] == ms[i] else 1e9)
        first = min(m for m in ms[:8] if m == m)
        print(f"| {label} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {CANDIDATES[best]} | {first:.3f} | "
              f"{first / ms[best]:.2f}x |", flush=True)


def row_caps_study(caps):
    configs = [(c.num_warps, c.num_stages, dict(c.kwargs)) for c in sb._CONFIGS]
    print("| case | " + " | ".join(f"O{cap} ms (config)" for cap in caps) + " | "
          + " | ".join(f"O{cap} gain" for cap in caps[1:]) + " | max diff |")
    print("|" + " --- |" * (2 * len(caps) + 1))
    for label, launch in cases((torch.bfloat16, torch.float32), (4, 6)):
        best, outs = {}, {}
        for cap in caps:
            sb.MAX_BLOCK_O = cap
            for warps, stages, blocks in configs:
                run = forced(launch, warps, stages, blocks)
                if run is None:
                    continue
                out, ms = run
                if cap not in best or ms < best[cap][0]:
                    best[cap] = (ms, f"w{warps} s{stages} n{blocks['BLOCK_N']} c{blocks['BLOCK_C']}")
                outs.setdefault(cap, out)
        sb.MAX_BLOCK_O = caps[0]
        if caps[0] not in outs:
            print(f"| {label} | no config ran at {caps[0]} rows |", flush=True)
            continue
        ref = outs[caps[0]].float()
        diff = max(float((o.float() - ref).abs().max()) for o in outs.values()) / float(ref.abs().max())
        cells = " | ".join(f"{best[c][0]:.3f} ({best[c][1]})" if c in best else "-" for c in caps)
        gains = " | ".join(f"{best[caps[0]][0] / best[c][0]:.2f}x" if c in best else "-" for c in caps[1:])
        print(f"| {label} | {cells} | {gains} | {diff:.1e} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row-caps", help="comma list of output rows a program (MAX_BLOCK_O), the first the baseline")
    args = ap.parse_args()
    if args.row_caps:
        row_caps_study([int(c) for c in args.row_caps.split(",")])
    else:
        candidates_study()


if __name__ == "__main__":
    main()
