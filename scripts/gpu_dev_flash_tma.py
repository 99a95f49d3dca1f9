#!/usr/bin/env python3
"""flash's forward routes side by side: the query tiles through pointers, through tensor descriptors
(TMA), and the Gluon wgmma kernel (flash_fwd_hopper.py).

    python3 scripts/gpu_dev_flash_tma.py [--json OUT] [--dims 64,128] [--routes tiles,hopper] [--configs]

For each case (the Hopper issue's anchors and large head dims): the forward by each route named in
--routes as shipped (``forward_route(route)``; the last one is the candidate the others are compared
with), SDPA FLASH's and cuDNN's, in TF/s on the true head dim, and every route's error against float64.
With --configs also both pointer-style kernels at every candidate configuration (the TMA kernel with
and without a warp-specialized key loop), each output checked against the pointer route's; a
configuration the compiler rejects reports why. Medians of CUDA-event samples, L2 flushed (attnbench/kernels/gpu_time.py).
"""
import argparse
import functools
import json

import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.attention.flash_fwd import flash_fwd_kernel, flash_fwd_tma_kernel, forward_route
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.kernels.launch import descriptor_scratch
from attnbench.kernels.precision import accumulator_dtype, dot_precision, lse_dtype, split_scale
from attnbench.kernels.tuning import cdiv, head_dim_blocks, seq_bucket
from attnbench.operators.flash import FlashCase
from attnbench.bench.roofline import machine_info

OP = attnbench.get("flash")

# (B, Hq, Hkv, N, D, causal): the anchors and its large-head-dim rows
CASES = [(4, 16, 16, 4096, 64, None), (4, 16, 16, 4096, 64, "top_left"), (2, 16, 16, 8192, 128, None),
         (2, 16, 16, 8192, 128, "top_left"), (8, 32, 32, 2048, 128, "top_left"), (4, 16, 16, 4096, 96, "top_left"),
         (2, 8, 8, 4096, 256, "top_left"), (2, 8, 8, 4096, 256, None)]

# (num_warps, num_stages, BLOCK_M, BLOCK_N, warp-specialized key loop) for --configs (the pointer kernel: not)
TILE_CONFIGS = [(4, 3, 128, 64), (8, 3, 128, 128), (8, 3, 128, 64), (4, 4, 64, 64), (8, 2, 128, 128),
                (8, 4, 128, 64), (4, 3, 64, 128), (8, 2, 128, 64)]
CANDIDATES = {"flash_fwd_kernel": [c + (False,) for c in TILE_CONFIGS],
              "flash_fwd_tma_kernel": [c + (ws,) for ws in (False, True) for c in TILE_CONFIGS]}


# the median of CUDA-event samples over the autotuner's own window (10 ms warm-up, 40 ms of samples)
median_ms = functools.partial(gpu_time_median_ms, warmup_ms=10.0, rep_ms=40.0)


def config_run(kernel, case, x, warps, stages, block_m, block_n, warp_specialize):
    """A closure launching one forward kernel at one config; returns its (o, lse)."""
    q, k, v = x["q"], x["k"], x["v"]
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device, dtype=lse_dtype(q.dtype))
    block_d, block_d2 = head_dim_blocks(case.head_dim)
    offset = case.causal_offset
    args = (q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            case.seqlen_q, case.seqlen_k, case.head_dim, case.heads_q, case.heads_q // case.heads_kv, offset or 0,
            *split_scale(case.softmax_scale), seq_bucket(max(case.seqlen_q, case.seqlen_k)))
    kw = dict(BLOCK_D=block_d, BLOCK_D2=block_d2, CAUSAL=offset is not None, ACC_DTYPE=accumulator_dtype(q.dtype),
              DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
              num_stages=stages)
    if kernel is flash_fwd_tma_kernel:
        kw["WARP_SPECIALIZE"] = warp_specialize
    grid = (cdiv(case.seqlen_q, block_m), case.heads_q, case.batch)

    def run():
        with descriptor_scratch(q.device):
            kernel.fn[grid](*args, **kw)
        return o, lse

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--dims", default="", help="only cases of these head dims (comma-separated)")
    ap.add_argument("--routes", default="tiles,tma", help="forward routes to time; the last is the candidate")
    ap.add_argument("--configs", action="store_true", help="also time both kernels at every candidate config")
    args = ap.parse_args()
    dims = {int(d) for d in args.dims.split(",") if d}
    routes = args.routes.split(",")
    new = routes[-1]
    device = torch.device("cuda")
    doc = {"machine": machine_info(device), "cases": []}
    for b, hq, hkv, n, d, causal in CASES:
        if dims and d not in dims:
            continue
        case = FlashCase(b, hq, hkv, n, n, d, causal, dtype="bfloat16")
        x = OP.make_inputs(case, device, 0)
        flops = 4.0 * case.batch * case.heads_q * case.visible_pairs * case.head_dim
        oracle = OP.oracle(case, x)
        entry = {"case": case.label, "ms": {}, "configs": []}
        for route in routes:
            with forward_route(route):
                fn = OP.variants["triton"].prepare(case, x, "fwd")
                out = fn()
                entry[f"{route}_error"] = max(verify.relative_error(out[k], oracle[k]) for k in ("o", "lse"))
                entry["ms"][route] = median_ms(fn)
        for name in ("sdpa_flash", "sdpa_cudnn"):
            try:
                entry["ms"][name] = median_ms(OP.variants[name].prepare(case, x, "fwd"))
            except Exception as exc:  # a peer that cannot run the case: say why
                entry["ms"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        ms = entry["ms"]
        peers = "  ".join(f"{p} {ms[p] / ms[new]:.2f}x" for p in routes[:-1] + ["sdpa_flash", "sdpa_cudnn"]
                          if isinstance(ms.get(p), float))
        times = "  ".join(f"{r} {ms[r]:.3f} ms ({flops / ms[r] / 1e9:.0f} TF/s, error {entry[r + '_error']:.1e})"
                          for r in routes)
        print(f"{case.label:34s} fwd: {times}  over {new}: {peers}", flush=True)
        if args.configs:
            with forward_route("tiles"):
                reference = OP.variants["triton"].prepare(case, x, "fwd")()
            for kernel in (flash_fwd_kernel, flash_fwd_tma_kernel):
                for w, s, bm, bn, ws in CANDIDATES[kernel.fn.__name__]:
                    label = f"{kernel.fn.__name__:20s} warps {w} stages {s} BM {bm:3d} BN {bn:3d} ws {int(ws)}"
                    row = {"kernel": kernel.fn.__name__, "config": [w, s, bm, bn, ws]}
                    try:
                        run = config_run(kernel, case, x, w, s, bm, bn, ws)
                        o, lse = run()
                        row["vs_tiles"] = max(verify.relative_error(o, reference["o"]),
                                              verify.relative_error(lse, reference["lse"]))
                        row["ms"] = median_ms(run)
                        row["tflops"] = flops / row["ms"] / 1e9
                        print(f"  {label}: {row['ms']:8.3f} ms {row['tflops']:6.0f} TF/s "
                              f"(vs tiles {row['vs_tiles']:.1e})", flush=True)
                    except Exception as exc:  # out of resources, or a pass that rejects the loop
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                        print(f"  {label}: {row['error']}", flush=True)
                    entry["configs"].append(row)
                    torch.cuda.synchronize()
        doc["cases"].append(entry)
        del x, oracle
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
