#!/usr/bin/env python3
"""flash's forward and backward beside SDPA's FLASH and cuDNN, and its backward kernels one config at a time.

    python3 scripts/gpu_dev_flash_bwd.py [--json OUT.json] [--dims 64,96,128,160,192,256] [--configs] [--dq-routes]
        [--kernels dkdv,dq,dkdv_tma_atomic,dv,dk] [--cudnn-repeat] [--dkdv-routes]

For each case (the Hopper issue's table, plus D 80, 160 and 192): the forward and the backward of the
Triton variant as shipped (autotuned), SDPA FLASH's and cuDNN's on the same inputs; with --configs also
each of the two backward kernels (dK/dV pass, dQ pass) alone at every candidate configuration, with its
TF/s on the kernel's own matmul count (dK/dV: 4 products of 2 x pairs x D FLOPs, dQ: 3), counted on
the true head dim D, so a power-of-two padding shows as lost TF/s. A configuration the compiler
cannot fit reports the reason. Medians of CUDA-event samples, L2 flushed (attnbench/kernels/gpu_time.py).
"""
import argparse
import functools
import json

import torch

import attnbench
from attnbench.bench import verify
from attnbench.kernels.attention.flash_bwd import (BOTH_PASS, DQ_ROUTES, SPLIT_PASSES, dkdv_route, dq_route,
                                        flash_bwd_dkdv_kernel, flash_bwd_dq_kernel)
from attnbench.kernels.attention.flash_fwd import flash_fwd_launch
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.kernels.launch import descriptor_scratch
from attnbench.kernels.precision import accumulator_dtype, dot_precision, split_scale
from attnbench.kernels.attention.row_dot import row_dot_launch
from attnbench.kernels.tuning import cdiv, head_dim_blocks, seq_bucket
from attnbench.operators.flash import FlashCase
from attnbench.bench.roofline import machine_info

OP = attnbench.get("flash")

# (B, Hq, Hkv, N, D, causal): the backward table, the power-of-two neighbours of D 160/192, and the
# sweep's one backward below SDPA FLASH on the H100 (D 256 N 16384 causal: 0.97x)
CASES = [(4, 16, 16, 4096, 64, None), (4, 16, 16, 4096, 64, "top_left"), (2, 16, 16, 8192, 128, None),
         (2, 16, 16, 8192, 128, "top_left"), (8, 32, 32, 2048, 128, "top_left"), (4, 16, 16, 4096, 96, "top_left"),
         (4, 16, 16, 4096, 80, "top_left"), (2, 8, 8, 4096, 160, "top_left"), (2, 8, 8, 4096, 192, "top_left"),
         (2, 8, 8, 4096, 256, "top_left"), (2, 8, 8, 4096, 256, None), (2, 8, 8, 16384, 256, "top_left")]

# (num_warps, num_stages, BLOCK_M, BLOCK_N) tried for each pass
CANDIDATES = [(4, 3, 32, 128), (8, 2, 64, 128), (4, 3, 64, 64), (4, 2, 32, 64), (8, 2, 64, 64), (8, 1, 64, 64),
              (8, 3, 32, 64), (8, 2, 32, 64), (4, 2, 64, 32), (8, 2, 64, 32), (8, 3, 64, 32), (4, 3, 128, 32),
              (8, 2, 128, 32), (8, 2, 128, 64), (4, 2, 16, 64), (8, 2, 16, 64), (4, 3, 64, 32), (4, 1, 64, 32),
              (8, 3, 128, 32), (8, 1, 128, 32), (4, 3, 128, 64), (8, 3, 128, 64), (4, 3, 64, 128), (8, 3, 64, 128),
              (8, 3, 64, 64), (8, 2, 128, 16), (4, 2, 64, 16)]


# the median of CUDA-event samples over the autotuner's own window (10 ms warm-up, 40 ms of samples)
median_ms = functools.partial(gpu_time_median_ms, warmup_ms=10.0, rep_ms=40.0)


def kernel_runs(case, x):
    """Closures launching each backward kernel at a given config, on the case's forward results."""
    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    offset = case.causal_offset
    o, lse = flash_fwd_launch(q, k, v, case.softmax_scale, offset)
    delta = row_dot_launch(q.shape, q.device, q.dtype, first=(do, o))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale_hi, scale_lo = split_scale(case.softmax_scale)
    block_d, block_d2 = head_dim_blocks(case.head_dim)
    common = dict(BLOCK_D=block_d, BLOCK_D2=block_d2, CAUSAL=offset is not None,
                  ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype))
    tail = (case.seqlen_q, case.seqlen_k, case.head_dim, case.heads_q, case.heads_q // case.heads_kv,
            offset or 0, scale_hi, scale_lo, seq_bucket(case.seqlen_q))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])

    def dkdv(w, s, bm, bn, forms=BOTH_PASS):
        return lambda: flash_bwd_dkdv_kernel.fn[(cdiv(case.seqlen_k, bn), case.heads_kv, case.batch)](
            q, k, v, do, lse, delta, dk, dv, dk, *strides, *dk.stride()[:3], *dv.stride()[:3], *tail, **common,
            ATOMIC_DQ=False, DQ_TMA=False, **forms, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)

    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def dkdv_tma_atomic(w, s, bm, bn):  # dq_route("tma_atomic")'s pass: dS K added into dQ too
        def run():
            with descriptor_scratch(q.device):
                flash_bwd_dkdv_kernel.fn[(cdiv(case.seqlen_k, bn), case.heads_kv, case.batch)](
                    q, k, v, do, lse, delta, dk, dv, dq_acc, *strides, *dk.stride()[:3], *dv.stride()[:3], *tail,
                    **common, ATOMIC_DQ=True, DQ_TMA=True, **BOTH_PASS, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                    num_stages=s)
        return run

    def dq_pass(w, s, bm, bn):
        return lambda: flash_bwd_dq_kernel.fn[(cdiv(case.seqlen_q, bm), case.heads_q, case.batch)](
            q, k, v, do, lse, delta, dq, *strides, *dq.stride()[:3], *tail, **common,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)

    return {"dkdv": dkdv, "dq": dq_pass, "dkdv_tma_atomic": dkdv_tma_atomic,
            "dv": functools.partial(dkdv, forms=SPLIT_PASSES[0]), "dk": functools.partial(dkdv, forms=SPLIT_PASSES[1])}


def route_times(case, x, routes=DQ_ROUTES, switch=dq_route, what="dQ", base_route="recompute"):
    """The backward by each of ``switch``'s ``routes`` (default: the dQ routes): median ms, the max
    relative error against float64, and whether two runs agree bitwise."""
    oracle = OP.oracle(case, x)
    out = {}
    for route in routes:
        try:
            with switch(route):
                fn = OP.variants["triton"].prepare(case, x, "bwd")
                grads = fn()  # the first call after tuning: the atomic routes' sum must start from zero
                error = max(verify.relative_error(grads[name], oracle[name]) for name in grads)
                out[route] = {"ms": median_ms(fn), "error": error, "bitwise_repeat": verify.bitwise_equal_runs(fn)}
        except Exception as exc:  # a route that does not apply or compile here: say why
            out[route] = {"error_message": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    base = out[base_route].get("ms", float("nan"))
    print(f"  {what} routes: " + ", ".join(f"{route} {r['ms']:.3f} ms ({base / r['ms']:.2f}x, error {r['error']:.1e}, "
                                      f"repeat {'=' if r['bitwise_repeat'] else '!='})" if "ms" in r
                                      else f"{route} {r['error_message']}" for route, r in out.items()), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--dims", default="", help="only cases of these head dims (comma-separated)")
    ap.add_argument("--seqlens", default="", help="only cases of these sequence lengths (comma-separated)")
    ap.add_argument("--configs", action="store_true", help="also time each backward kernel at every candidate config")
    ap.add_argument("--dq-routes", action="store_true", help="also time the backward by each dQ route (dq_route)")
    ap.add_argument("--kernels", default="dkdv,dq", help="with --configs: which of dkdv, dq, dkdv_tma_atomic, dv, dk")
    ap.add_argument("--dkdv-routes", action="store_true",
                    help="also time the backward by each dK/dV route (tiles, split)")
    ap.add_argument("--cudnn-repeat", action="store_true", help="also ask whether cuDNN's backward repeats bitwise")
    args = ap.parse_args()
    dims = {int(d) for d in args.dims.split(",") if d}
    seqlens = {int(n) for n in args.seqlens.split(",") if n}
    device = torch.device("cuda")
    doc = {"machine": machine_info(device), "cases": []}
    for row in CASES:
        b, hq, hkv, n, d, causal = row
        if (dims and d not in dims) or (seqlens and n not in seqlens):
            continue
        case = FlashCase(b, hq, hkv, n, n, d, causal, dtype="bfloat16")
        x = OP.make_inputs(case, device, 0)
        pair_flops = 2.0 * case.batch * case.heads_q * case.visible_pairs * case.head_dim
        entry = {"case": case.label, "dkdv": [], "dq": [], "dkdv_tma_atomic": [], "dv": [], "dk": []}
        for mode, products in (("fwd", 2), ("bwd", 5)):
            times = entry[f"{mode}_ms"] = {}
            for name in ("triton", "sdpa_flash", "sdpa_cudnn"):
                try:
                    times[name] = median_ms(OP.variants[name].prepare(case, x, mode))
                except Exception as exc:  # a peer that cannot run the case: say why
                    times[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            ratios = "  ".join(f"{p} {times[p] / times['triton']:.2f}x" for p in ("sdpa_flash", "sdpa_cudnn")
                               if isinstance(times.get(p), float))
            print(f"{case.label:34s} {mode}: ours {times['triton']:.3f} ms "
                  f"({products * pair_flops / times['triton'] / 1e9:.0f} TF/s)  {ratios}", flush=True)
        if args.cudnn_repeat:
            cudnn_bwd = OP.variants["sdpa_cudnn"].prepare(case, x, "bwd")
            entry["cudnn_bwd_bitwise_repeat"] = verify.bitwise_equal_runs(cudnn_bwd, runs=5)
            print(f"  cuDNN backward repeats bitwise: {entry['cudnn_bwd_bitwise_repeat']}", flush=True)
        if args.dq_routes:
            entry["dq_routes"] = route_times(case, x)
        if args.dkdv_routes:
            entry["dkdv_routes"] = route_times(case, x, ("tiles", "split"), dkdv_route, "dK/dV", "tiles")
        if not args.configs:
            doc["cases"].append(entry)
            continue
        runs = kernel_runs(case, x)
        for kernel, products in (("dkdv", 4), ("dq", 3), ("dkdv_tma_atomic", 5), ("dv", 2), ("dk", 3)):
            if kernel not in args.kernels.split(","):
                continue
            for w, s, bm, bn in CANDIDATES:
                try:
                    t = median_ms(runs[kernel](w, s, bm, bn))
                    tfs = products * pair_flops / t / 1e9
                    entry[kernel].append({"config": [w, s, bm, bn], "ms": t, "tflops": tfs})
                    print(f"  {kernel:4s} warps {w} stages {s} BM {bm:3d} BN {bn:3d}: {t:8.3f} ms {tfs:6.0f} TF/s",
                          flush=True)
                except Exception as exc:  # out of shared memory or registers: part of the answer
                    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                    entry[kernel].append({"config": [w, s, bm, bn], "error": reason})
                    print(f"  {kernel:4s} warps {w} stages {s} BM {bm:3d} BN {bn:3d}: {reason}", flush=True)
                torch.cuda.synchronize()
        doc["cases"].append(entry)
        del x, runs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
