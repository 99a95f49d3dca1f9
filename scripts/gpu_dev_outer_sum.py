#!/usr/bin/env python3
"""The batch sum of outer products (kernels/sparse_outer_sum.py) on the FC layer's weight-gradient shapes, two
kernel variants interleaved in one process: the scale on the fp32 operand before the dot (one accumulator) against
the scale on each term's product (two accumulators).

    python3 scripts/gpu_dev_outer_sum.py [--json OUT.json]

Shapes: outer(gz, x) summed over the batch with the rotated CG infos of the vecmat anchors (gz [N, M, C], x [N, M,
C]; L 2, 3, 4, 6; C 32, 128; N 1e5, 2e4 at L 4 and 6; fp32, bf16 as a control). Medians by CUDA events, L2 flushed,
each variant autotuned; TF/s on 2 T C^2 N.
"""
import argparse
import json

import torch

from attnbench.kernels import sparse_outer_sum as module
from attnbench.roofline import machine_info
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.timing import measure


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"# {machine_info('cuda')['device_name']}")
    print("| L | C | dtype | scaled operand ms | scaled term ms | ratio | TF/s (operand) | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for l_max in (2, 3, 4, 6):
            infos = cg_product_infos(l_max, l_max, l_max, device="cuda")
            info = infos[2]  # vecmat's weight gradient: outer(gz, x) over (info_bwd2, info_fwd, info_bwd1)
            rotated = (infos[2], infos[0], infos[1])
            for channels in (32, 128):
                n = 100_000 if l_max <= 3 else 20_000
                gen = torch.Generator(device="cuda").manual_seed(0)
                gz = torch.randn(n, info.size1, channels, device="cuda", generator=gen).to(dtype)
                x = torch.randn(n, info.size2, channels, device="cuda", generator=gen).to(dtype)
                out, ms = {}, {}
                for name, dtypes in (("operand", (torch.float32,)), ("term", ())):
                    module.SCALE_OPERAND_DTYPES = dtypes
                    module.outer_sum_kernel.cache.clear()

                    def fn(a=gz, b=x):
                        return module.outer_sum_launch(a, b, rotated[0])

                    out[name] = fn().double()
                    ms[name] = measure(fn, "cuda").median_ms
                best = ms
                flops = 2 * info.index1.numel() * channels * channels * n
                diff = float((out["operand"] - out["term"]).abs().max() / out["term"].abs().max())
                row = {"l": l_max, "c": channels, "dtype": str(dtype)[6:], **{f"{k}_ms": v for k, v in best.items()},
                       "tflops_operand": flops / best["operand"] / 1e9, "diff": diff}
                rows.append(row)
                print(f"| {l_max} | {channels} | {row['dtype']} | {best['operand']:.3f} | {best['term']:.3f} | "
                      f"{best['term'] / best['operand']:.2f}x | {row['tflops_operand']:.1f} | {diff:.1e} |", flush=True)
                gz = x = out = None
                torch.cuda.empty_cache()
    module.SCALE_OPERAND_DTYPES = (torch.float32,)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info("cuda"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
