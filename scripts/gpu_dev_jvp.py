"""GPU dev measurements for the jvp_attention kernels, side by side in one run (CUDA only).

    python3 scripts/gpu_dev_jvp.py [--quick] [--sanitize [--no-tma]]     (JSON under $OUT when set)

For each case of issue 6's performance targets: bf16 error of every route against a float64
oracle, CUDA-event medians (L2 flushed) and peak GPU memory, for ours (torch.func.jvp through
flash_attention, and the fused attention_jvp), SDPA MATH under torch.func, and jvp-flash-attention
when installed; the first-order flash anchors beside SDPA FLASH (the "lose nothing" check).
Predictions (matmul units x 2 B H pairs D at ~400 TF/s of our kernels' forward) print beside.
``--sanitize`` instead runs the new kernels once on odd shapes, for compute-sanitizer memcheck.
"""
import argparse
import json
import os
import sys
import traceback

import torch
import torch.func as tf

import attnbench  # noqa: F401  (sets up the kernels)
from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_attention, flash_bwd, flash_fwd
from attnbench.kernels.attention.flash_bwd import dkdv_route, dq_route
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.operators.flash.reference import attention as reference_attention
from attnbench.bench.timing import measure, peak_memory_bytes

DEV = "cuda"


def randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


def inputs(b, h, n, d, dtype=torch.bfloat16):
    q, k, v, do = (randn(b, h, n, d, dtype=dtype, seed=s) for s in range(4))
    tq, tk, tv = (randn(b, h, n, d, dtype=dtype, seed=10 + s) for s in range(3))
    return (q, k, v), do, (tq, tk, tv)


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if torch.isnan(a).any():
        return float("inf")
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-300)).item()


def sdpa_math(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def jvp_flash(causal):
    from jvp_flash_attention.jvp_attention import JVPAttn

    return lambda q, k, v: JVPAttn.fwd_dual(q, k, v, causal=causal)


def ours(causal):
    return lambda q, k, v: flash_attention(q, k, v, causal=causal)


def oracle_jvp(x, t, causal):
    """O and O_t in float64, one batch element at a time."""
    outs, tans = [], []
    for i in range(x[0].shape[0]):
        xi = tuple(a[i:i + 1].double() for a in x)
        ti = tuple(a[i:i + 1].double() for a in t)
        o, ot = tf.jvp(lambda q, k, v: reference_attention(q, k, v, q.shape[-1] ** -0.5, 0 if causal else None)[0], xi, ti)
        outs.append(o)
        tans.append(ot)
        del o, ot
    return torch.cat(outs), torch.cat(tans)


def oracle_hvp(x, do, u, causal):
    def loss(q, k, v):
        return (reference_attention(q, k, v, q.shape[-1] ** -0.5, 0 if causal else None)[0] * do.double()).sum()
    xd = tuple(a.double() for a in x)
    return tf.jvp(lambda *a: tf.grad(loss, argnums=(0, 1, 2))(*a), xd, tuple(a.double() for a in u))[1]


def hvp_fwd_rev(f, x, do, u):
    def loss(q, k, v):
        return (f(q, k, v).float() * do.float()).sum()
    return tf.jvp(lambda *a: tf.grad(loss, argnums=(0, 1, 2))(*a), x, u)[1]


def hvp_rev_rev(f, x, do, u):
    leaves = [a.detach().requires_grad_() for a in x]
    g = torch.autograd.grad(f(*leaves), leaves, do, create_graph=True)
    return torch.autograd.grad(g, leaves, u)


def timed(name, fn, ref, results, case, flops, pred_ms=None):
    row = {"case": case, "route": name}
    try:
        out = fn()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        row["rel_err"] = max(rel(a, b) for a, b in zip(outs, refs)) if ref is not None else None
        del out, outs
        t = measure(fn, DEV)
        row.update(ms=t.median_ms, iqr_ms=t.iqr_ms, tflops=flops / t.median_ms / 1e9 if flops else None,
                   peak_gb=(peak_memory_bytes(fn, DEV) or 0) / 1e9, pred_ms=pred_ms)
    except Exception as exc:  # noqa: BLE001 - a peer failing is a result
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if os.environ.get("ATTNBENCH_DEBUG"):
            traceback.print_exc()
    torch.cuda.empty_cache()
    results.append(row)
    err = row.get("rel_err")
    print(f"{case:28s} {name:26s} " + (f"{row['ms']:8.3f} ms  {row['tflops'] or 0:6.0f} TF/s  "
          f"{row['peak_gb']:6.2f} GB  err {err if err is None else format(err, '.1e')}"
          f"{'  pred ' + format(pred_ms, '.2f') + ' ms' if pred_ms else ''}" if "ms" in row else row["error"]),
          flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--no-tma", action="store_true", help="with --sanitize: leave out the forward's tensor-descriptor "
                   "route (compute-sanitizer cannot run its kernels: results/gpu/nvidia-h200/flash-notes.md)")
    args = p.parse_args()
    if args.sanitize:
        return sanitize(tma=not args.no_tma)
    results = []
    unit = lambda b, h, n, d, causal: 2 * b * h * n * n * d * (0.5 if causal else 1.0)  # noqa: E731
    rate = 400e9  # FLOP per ms at 400 TF/s

    # fwd + JVP: issue 6's three cases (H200: jvp-flash-attention 1.70 / 4.42 / 10.05 ms, MATH 14.2 / 61.4 / 35.1)
    for b, h, n, d, causal in [(4, 16, 2048, 64, False), (4, 16, 4096, 64, True), (2, 16, 4096, 128, False)][:1 if args.quick else 3]:
        case = f"B{b} H{h} N{n} D{d}{' causal' if causal else ''}"
        x, do, t = inputs(b, h, n, d)
        ref = oracle_jvp(x, t, causal)
        u = unit(b, h, n, d, causal)
        fwd_flops = 2 * u
        timed("ours fwd", lambda: flash_fwd(*x, causal=causal), ref[0], results, case, fwd_flops, 2 * u / rate)
        timed("ours torch.func.jvp", lambda: tf.jvp(ours(causal), x, t), ref, results, case, 3 * fwd_flops, 7 * u / rate)
        timed("ours attention_jvp fused", lambda: attention_jvp(*x, *t, causal=causal)[::2], ref, results, case,
              3 * fwd_flops, 6 * u / rate)
        timed("jvp-flash-attention", lambda: tf.jvp(jvp_flash(causal), x, t), ref, results, case, 3 * fwd_flops)
        timed("sdpa_math torch.func.jvp", lambda: tf.jvp(sdpa_math(causal), x, t), ref, results, case, 3 * fwd_flops)
        del x, do, t, ref

    # HVP routes: B2 H8 N2048 D64 (H200 MATH: 7.2 ms / 3.1 GB rev-rev, 8.6 ms / 2.9 GB fwd-rev)
    for b, h, n, d, causal in [(2, 8, 2048, 64, False), (2, 8, 2048, 64, True)][:1 if args.quick else 2]:
        case = f"hvp B{b} H{h} N{n} D{d}{' causal' if causal else ''}"
        x, do, u_ = inputs(b, h, n, d)
        ref = oracle_hvp(x, do, u_, causal)
        u = unit(b, h, n, d, causal)
        f = ours(causal)
        timed("ours fwd-over-rev", lambda: hvp_fwd_rev(f, x, do, u_), ref, results, case, 17 * u, 30 * u / rate)
        timed("ours rev-over-rev", lambda: hvp_rev_rev(f, x, do, u_), ref, results, case, 17 * u, 30 * u / rate)
        o, lse = flash_fwd(*x, causal=causal)
        timed("ours kernel 3 alone", lambda: attention_bwd_jvp(do, *x, o, lse, *u_, causal=causal), ref, results,
              case, 17 * u, 21 * u / rate)
        timed("sdpa_math fwd-over-rev", lambda: hvp_fwd_rev(sdpa_math(causal), x, do, u_), ref, results, case, 17 * u)
        timed("sdpa_math rev-over-rev", lambda: hvp_rev_rev(sdpa_math(causal), x, do, u_), ref, results, case, 17 * u)
        del x, do, u_, ref

    # first-order flash through the new op: committed H200 figures fwd 0.657 / bwd 1.977 ms (D64),
    # 2.318 / 7.444 ms (D128); SDPA FLASH side by side
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for b, h, n, d, causal in [(4, 16, 4096, 64, False), (2, 16, 8192, 128, True)][:1 if args.quick else 2]:
        case = f"flash B{b} H{h} N{n} D{d}{' causal' if causal else ''}"
        x, do, _ = inputs(b, h, n, d)
        u = unit(b, h, n, d, causal)
        o, lse = flash_fwd(*x, causal=causal)
        timed("ours fwd", lambda: flash_fwd(*x, causal=causal), None, results, case, 2 * u)
        timed("ours bwd", lambda: flash_bwd(do, *x, o, lse, causal=causal), None, results, case, 5 * u)

        def sdpa_flash_fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(*x, is_causal=causal)
        timed("sdpa_flash fwd", sdpa_flash_fwd, None, results, case, 2 * u)
        del x, do, o, lse

    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu-dev-jvp.json"), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, fh, indent=1)


def sanitize(tma=True):
    """One launch of every new kernel path on odd shapes (lengths off the block size, GQA, head dims
    in one and in two column blocks: 24, 80 = 64 + 16, 160 = 128 + 32, and 256); flash's backward by
    both dK/dV routes of the pointer tiles and every dQ route; flash's forward by every route
(tensor descriptors too: their zero fill past N_K and D stands in for load masks; the Gluon kernel on
sm_90 at its head dims)."""
    torch.manual_seed(0)
    for dtype in (torch.float16,):  # memcheck is slow: each kernel specialization once, on odd shapes
        for (b, hq, hk, nq, nk, d, causal) in [(1, 4, 2, 37, 29, 80, None), (2, 2, 1, 70, 41, 24, "bottom_right"),
                                               (1, 2, 1, 130, 97, 160, "top_left"),
                                               (1, 2, 1, 77, 130, 256, "bottom_right"),
                                               (1, 2, 2, 129, 257, 72, "top_left")]:  # head_padding.py
            q = torch.randn(b, hq, nq, d, device=DEV, dtype=dtype)
            k, v = (torch.randn(b, hk, nk, d, device=DEV, dtype=dtype) for _ in range(2))
            do, tq, tdo = (torch.randn_like(q) for _ in range(3))
            tk, tv = torch.randn_like(k), torch.randn_like(v)
            o, lse, ot, lt = attention_jvp(q, k, v, tq, tk, tv, causal=causal)
            dq_t = attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, tdo, causal=causal)
            grads = flash_bwd(do, q, k, v, o, lse, causal=causal)
            with dkdv_route("split" if d < 256 else "tiles"):  # the dK/dV route the default does not take
                grads += flash_bwd(do, q, k, v, o, lse, causal=causal)
            for route in ("atomic", "tma_atomic") if tma else ("atomic", ):
                with dq_route(route):
                    grads += flash_bwd(do, q, k, v, o, lse, causal=causal)
            with forward_route("tiles"):
                o_tiles, _ = flash_fwd(q, k, v, causal=causal)
            o_tma = o_tiles
            if tma:
                with forward_route("tma"):
                    o_tma, _ = flash_fwd(q, k, v, causal=causal)
            torch.cuda.synchronize()
            assert all(torch.isfinite(t).all() for t in (o, ot, *dq_t, *grads, o_tiles, o_tma)), (dtype, b, hq, nq, d)
    if tma and torch.cuda.get_device_capability() == (9, 0):  # the Gluon forward: its head dims, odd lengths
        for (b, hq, hk, nq, nk, d, causal) in [(1, 4, 2, 37, 29, 64, None), (2, 2, 1, 130, 97, 128, "top_left"),
                                               (1, 2, 2, 200, 300, 64, "bottom_right"),
                                               (1, 2, 1, 129, 385, 128, None), (1, 2, 2, 77, 200, 96, None),
                                               (1, 2, 1, 150, 130, 256, "bottom_right")]:
            q = torch.randn(b, hq, nq, d, device=DEV, dtype=torch.bfloat16)
            k, v = (torch.randn(b, hk, nk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
            with forward_route("hopper"):
                o_hopper, _ = flash_fwd(q, k, v, causal=causal)
            torch.cuda.synchronize()
            assert torch.isfinite(o_hopper).all(), (b, hq, nq, nk, d)
    print("sanitize: all paths ran")


if __name__ == "__main__":
    sys.exit(main())
