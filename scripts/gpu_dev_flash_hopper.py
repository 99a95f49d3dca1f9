#!/usr/bin/env python3
"""The Gluon forward (attnbench/kernels/attention/flash_fwd_hopper.py) at several tile shapes beside the shipped routes.

    python3 scripts/gpu_dev_flash_hopper.py [--json OUT] [--dims 64,128]

For each anchor case of the Hopper issue with a head dim the Gluon kernel takes: the pointer tiles as
shipped (autotuned), SDPA FLASH and cuDNN, and the Gluon kernel at every (BLOCK_M, BLOCK_N, STAGES,
num_warps) of TILES, each output checked against float64 first. Medians of CUDA-event samples, L2
flushed (attnbench/kernels/gpu_time.py); TF/s on the visible (query, key) pairs.
"""
import argparse
import functools
import json

import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.kernels.attention.flash_fwd_hopper import flash_fwd_hopper_launch
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.operators.flash import FlashCase
from attnbench.bench.roofline import machine_info

OP = attnbench.get("flash")
CASES = [(4, 16, 16, 4096, 64, None), (4, 16, 16, 4096, 64, "top_left"), (2, 16, 16, 8192, 128, None),
         (2, 16, 16, 8192, 128, "top_left"), (8, 32, 32, 2048, 128, "top_left"), (4, 16, 16, 4096, 96, "top_left"),
         (4, 16, 16, 4096, 80, "top_left"), (2, 8, 8, 4096, 256, "top_left"), (2, 8, 8, 4096, 256, None),
         (2, 8, 8, 4096, 160, "top_left"), (2, 8, 8, 4096, 192, None)]
# (BLOCK_M, BLOCK_N, STAGES, num_warps, Q in registers[, warp-specialized loader, maxnreg]); shared
# memory: Q tile + STAGES x (K + V) blocks
PAIR = (True, 168, "pair", 240)  # a loader warp, maxnreg 168 (12 warps, one program an SM), 240 compute registers
TILES = {64: [(64, 128, 2, 4, False)], 128: [(128, 128, 2, 4, True) + PAIR],
         96: [(128, 128, 2, 4, True) + PAIR, (64, 64, 2, 4, True, True, 128)],
         80: [(128, 128, 2, 4, True) + PAIR],
         256: [(128, 64, 2, 4, False) + PAIR, (128, 64, 3, 4, False) + PAIR],
         160: [(128, 64, 2, 4, False) + PAIR], 192: [(128, 64, 2, 4, False) + PAIR]}
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
        flops = 4.0 * case.batch * case.heads_q * case.visible_pairs * case.head_dim
        oracle = OP.oracle(case, x)
        entry = {"case": case.label, "ms": {}, "error": {}}
        with forward_route("tiles"):
            entry["ms"]["tiles"] = median_ms(OP.variants["triton"].prepare(case, x, "fwd"))
        for name in ("sdpa_flash", "sdpa_cudnn"):
            entry["ms"][name] = median_ms(OP.variants[name].prepare(case, x, "fwd"))
        q, k, v = x["q"], x["k"], x["v"]
        for tiles in TILES[d]:
            label = ("hopper " + "/".join(map(str, tiles[:4])) + (" q-regs" if tiles[4] else "")
                     + (f" ws r{tiles[6]}" if len(tiles) > 5 and tiles[5] else "")
                     + (f" pair r{tiles[8]}" if len(tiles) > 7 else ""))
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=device, dtype=torch.float32)

            def run(tiles=tiles, o=o, lse=lse):
                flash_fwd_hopper_launch(q, k, v, o, lse, case.softmax_scale, case.causal_offset, tiles=tiles)
                return o, lse
            try:
                run()
                entry["error"][label] = max(verify.relative_error(o, oracle["o"]),
                                            verify.relative_error(lse, oracle["lse"]))
                entry["ms"][label] = median_ms(run)
            except Exception as exc:  # out of shared memory or registers: say so
                entry["ms"][label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        ms = entry["ms"]
        print(f"{case.label}: tiles {ms['tiles']:.3f} ms ({flops / ms['tiles'] / 1e9:.0f} TF/s)  FLASH "
              f"{ms['sdpa_flash']:.3f}  cuDNN {ms['sdpa_cudnn']:.3f} ({flops / ms['sdpa_cudnn'] / 1e9:.0f} TF/s)")
        for label, t in ms.items():
            if label.startswith("hopper"):
                if isinstance(t, float):
                    print(f"  {label:22s} {t:.3f} ms {flops / t / 1e9:5.0f} TF/s  tiles/this {ms['tiles'] / t:.2f}x"
                          f"  cuDNN/this {ms['sdpa_cudnn'] / t:.2f}x  error {entry['error'][label]:.1e}", flush=True)
                else:
                    print(f"  {label:22s} {t}", flush=True)
        doc["cases"].append(entry)
        del x, oracle
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
