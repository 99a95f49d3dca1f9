#!/usr/bin/env python3
"""flash's backward with the dK/dV pass by the pointer tiles and by the Gluon kernel, side by side.

    python3 scripts/gpu_dev_flash_bwd_hopper.py [--json OUT] [--dims 64,128]

For each case: the whole backward (delta rows, dK/dV pass, dQ pass) with ``dkdv_route("tiles")`` and
``dkdv_route("hopper")``, each checked against float64 first (verify.check_variant, "bwd"), bitwise
repeats of the hopper route, and SDPA FLASH's and cuDNN's backward. Medians of CUDA-event samples, L2
flushed (attnbench/kernels/gpu_time.py); TF/s by the 2.5x-forward convention (5 matmuls).
"""
import argparse
import functools
import json

import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.attention.flash_bwd import dkdv_route
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.operators.flash import FlashCase
from attnbench.bench.roofline import machine_info

OP = attnbench.get("flash")
CASES = [(4, 16, 16, 4096, 64, None), (4, 16, 16, 4096, 64, "top_left"), (2, 16, 16, 8192, 128, None),
         (2, 16, 16, 8192, 128, "top_left"), (8, 32, 32, 2048, 128, "top_left"), (4, 16, 16, 4096, 96, "top_left"),
         (2, 16, 4, 4096, 128, None)]
median_ms = functools.partial(gpu_time_median_ms, warmup_ms=10.0, rep_ms=40.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--dims", default="")
    args = ap.parse_args()
    dims = {int(d) for d in args.dims.split(",") if d}
    device = torch.device("cuda")
    doc = {"machine": machine_info(device), "cases": []}
    for b, hq, hkv, n, d, causal in CASES:
        if dims and d not in dims:
            continue
        case = FlashCase(b, hq, hkv, n, n, d, causal, dtype="bfloat16")
        x = OP.make_inputs(case, device, 0)
        oracle = OP.oracle(case, x)
        lowp = OP.oracle(case, x, dtype=case.torch_dtype)
        flops = 2.5 * 4.0 * case.batch * case.heads_q * case.visible_pairs * case.head_dim
        entry = {"case": case.label, "ms": {}, "passed": {}}
        for route in ("tiles", "hopper"):
            with dkdv_route(route):
                result = verify.check_variant(OP, "triton", case, "bwd", x, oracle, lowp)
                entry["passed"][route] = result.passed
                entry[f"{route}_errors"] = {o.name: o.error for o in result.outputs}
                fn = OP.variants["triton"].prepare(case, x, "bwd")
                if route == "hopper":
                    entry["hopper_bitwise"] = verify.bitwise_equal_runs(fn, runs=3)
                entry["ms"][route] = median_ms(fn)
        for name in ("sdpa_flash", "sdpa_cudnn"):
            entry["ms"][name] = median_ms(OP.variants[name].prepare(case, x, "bwd"))
        ms = entry["ms"]
        print(f"{case.label}: bwd tiles {ms['tiles']:.3f} ms ({flops / ms['tiles'] / 1e9:.0f} TF/s)  hopper "
              f"{ms['hopper']:.3f} ms ({flops / ms['hopper'] / 1e9:.0f} TF/s, passed {entry['passed']['hopper']}, "
              f"bitwise {entry['hopper_bitwise']}, errors {entry['hopper_errors']})  tiles/hopper "
              f"{ms['tiles'] / ms['hopper']:.2f}x  FLASH/hopper {ms['sdpa_flash'] / ms['hopper']:.2f}x  "
              f"cuDNN/hopper {ms['sdpa_cudnn'] / ms['hopper']:.2f}x", flush=True)
        doc["cases"].append(entry)
        del x, oracle, lowp
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
