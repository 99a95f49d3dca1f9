#!/usr/bin/env python3
"""flash's forward and backward at head dims whose column blocks are masked (D 40, 68, 72, 88, ...), query lengths
one past a tile, against float64; with --ops also the decode route (Nq <= 64, GQA) and every jvp_attention mode
(the JVP kernels through PyTorch's AD) at those dims. Run under compute-sanitizer memcheck to find out-of-bounds
accesses.

    compute-sanitizer --tool memcheck python3 scripts/gpu_dev_odd_head_dims.py [--dims 72,88] [--fwd-only]
        [--config 4,3,128,64] [--cases 0,1] [--ops flash,decode,jvp]
"""
import argparse

import torch

from attnbench.bench import verify
from attnbench.attention import flash_attention
from attnbench.operators.flash import reference
from attnbench.operators.jvp_attention import reference as jvp_reference, routes
from attnbench.kernels.attention.flash_fwd import flash_fwd_kernel
from attnbench.kernels.precision import accumulator_dtype, dot_precision, split_scale
from attnbench.kernels.tuning import cdiv, head_dim_blocks, seq_bucket
from attnbench.attention import flash_bwd, flash_fwd


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: through the interpreter


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


CASES = ((129, 257, "top_left"), (129, 257, None), (128, 257, "top_left"))
# (Hq, Hkv, Nq, Nk, causal): the decode route's packed GQA rows, lengths off its key blocks.
DECODE_CASES = ((8, 2, 1, 8193, None), (8, 2, 16, 1031, "bottom_right"), (4, 4, 33, 257, "bottom_right"))


def picked(args):
    return [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES


def randn(shape, g):
    return torch.randn(shape, device=DEV, dtype=torch.float16, generator=g)


def forward_at_config(args):
    w, stages, bm, bn = (int(x) for x in args.config.split(","))
    for d in (int(x) for x in args.dims.split(",")):
        for nq, nk, causal in picked(args):
            g = torch.Generator(device=DEV).manual_seed(d)
            q, k, v = randn((1, 2, nq, d), g), randn((1, 2, nk, d), g), randn((1, 2, nk, d), g)
            o = torch.empty_like(q)
            lse = torch.empty(1, 2, nq, device=DEV, dtype=torch.float32)
            block_d, block_d2 = head_dim_blocks(d)
            flash_fwd_kernel.fn[(cdiv(nq, bm), 2, 1)](
                q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], nq, nk, d, 2, 1,
                0, *split_scale(d ** -0.5), seq_bucket(max(nq, nk)), BLOCK_D=block_d, BLOCK_D2=block_d2,
                CAUSAL=causal is not None, ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
                BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=stages)
            sync()
            ref = reference.evaluate(q, k, v, torch.ones_like(q), d ** -0.5, None if causal is None else 0,
                                     torch.float64)
            print(f"config {args.config} D{d} Nq{nq} Nk{nk} {causal}: fwd error "
                  f"{verify.relative_error(o, ref['o']):.1e}", flush=True)


def decode(dims):
    for d in dims:
        for hq, hkv, nq, nk, causal in DECODE_CASES:
            g = torch.Generator(device=DEV).manual_seed(d)
            q, k, v = randn((2, hq, nq, d), g), randn((2, hkv, nk, d), g), randn((2, hkv, nk, d), g)
            o, lse = flash_fwd(q, k, v, causal=causal)
            sync()
            offset = None if causal is None else nk - nq
            ref = reference.evaluate(q, k, v, torch.ones_like(q), d ** -0.5, offset, torch.float64)
            print(f"decode D{d} H{hq}/{hkv} Nq{nq} Nk{nk} {causal}: fwd error "
                  f"{verify.relative_error(o, ref['o']):.1e}, lse {verify.relative_error(lse, ref['lse']):.1e}",
                  flush=True)


def jvp_modes(dims):
    """Every jvp_attention mode through flash_attention (the JVP and backward-JVP kernels) against float64."""
    for d in dims:
        for nq, nk, causal in CASES[:2]:
            g = torch.Generator(device=DEV).manual_seed(d)
            x = {n: randn((1, 2, nq, d), g) for n in ("q", "do", "tq")}
            x.update({n: randn((1, 2, nk, d), g) for n in ("k", "v", "tk", "tv")})
            offset = None if causal is None else 0

            def f(q, k, v):
                return flash_attention(q, k, v, causal=causal, return_lse=True)

            for mode in routes.MODES:
                got = routes.run(mode, f, x)
                sync()
                want = jvp_reference.evaluate(mode, x, d ** -0.5, offset, torch.float64)
                errs = ", ".join(f"{n} {verify.relative_error(got[n], want[n]):.1e}" for n in got)
                print(f"jvp D{d} Nq{nq} Nk{nk} {causal} {mode}: {errs}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="68,72,88")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--config", default="", help="num_warps,num_stages,BLOCK_M,BLOCK_N: the forward kernel at this "
                    "config only (launched directly, no autotuning)")
    ap.add_argument("--cases", default="", help="only these (nq,nk,causal) cases by index, e.g. 0,1")
    ap.add_argument("--ops", default="flash", help="comma list of flash (forward and backward), decode (Nq <= 64), "
                    "jvp (every jvp_attention mode)")
    args = ap.parse_args()
    if args.config:
        forward_at_config(args)
        return
    dims = [int(x) for x in args.dims.split(",")]
    ops = args.ops.split(",")
    unknown = set(ops) - {"flash", "decode", "jvp"}
    if unknown:
        ap.error(f"--ops: unknown {', '.join(sorted(unknown))} (flash, decode, jvp)")
    if "decode" in ops:
        decode(dims)
    if "jvp" in ops:
        jvp_modes(dims)
    if "flash" not in ops:
        return
    for d in dims:
        for nq, nk, causal in picked(args):
            g = torch.Generator(device=DEV).manual_seed(d)
            q, k, v = randn((1, 2, nq, d), g), randn((1, 2, nk, d), g), randn((1, 2, nk, d), g)
            o, lse = flash_fwd(q, k, v, causal=causal)
            sync()
            offset = None if causal is None else 0
            ref = reference.evaluate(q, k, v, torch.ones_like(q), q.shape[-1] ** -0.5, offset, torch.float64)
            line = f"D{d} Nq{nq} Nk{nk} {causal}: fwd error {verify.relative_error(o, ref['o']):.1e}"
            if not args.fwd_only:
                dq, dk, dv = flash_bwd(torch.ones_like(q), q, k, v, o, lse, causal=causal)
                sync()
                line += (f", dq {verify.relative_error(dq, ref['dq']):.1e}, "
                         f"dk {verify.relative_error(dk, ref['dk']):.1e}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
