#!/usr/bin/env python3
"""``small_matmul``'s launch configs, one by one, against cuBLAS on the dense route's products, on one GPU.

    python3 scripts/gpu_dev_small_matmul.py [--json OUT.json] [--batch N] [--extra] [--warm-shard I/K]
        [--l-max 3,4,6] [--dtypes float32,bfloat16] [--products apply,gram]

The dense route (attnbench/kernels/sparse/dense.py) runs two kinds of product per sample, P = (L + 1)^2 rows:

    apply:  M [N, P, P] (fp32) @ x [N, P, C]     (vecsca and scavec: forward and every derivative)
    gram:   g [N, P, C] @ x[N]^T [N, C, P]       (inner: the backward's gy; x transposed, a strided view)

For L 3, 4, 6 (``--l-max``), C 32 and 128, fp32 and bf16, each row gives cuBLAS's time (torch.matmul; for bf16
``apply`` one bmm on M rounded to bf16: a lower bound of the old route's two), the autotuned small_matmul (and the
config it picked) and every config forced alone, as ms and % of the measured copy bandwidth on the product's bytes
(a, b and out, each once). ``--extra`` adds the other candidates tried when the module's list was chosen. ``--warm-
shard I/K`` only compiles the I-th of K slices of the work (run K of them in parallel first: Triton's disk cache
then serves the timing run).
"""
import argparse
import json

import torch

from attnbench.kernels.sparse import small_matmul as module
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.kernels.tuning import cfg
from attnbench.bench.roofline import ceilings, machine_info

# every candidate tried when the module's list was chosen (warps, stages, samples, column tile, inner step):
# the first list's 8 shapes at inner steps 16 and 64, then deeper steps on small tiles (fp32's FMA layout holds
# rows-per-thread x depth + depth x cols-per-thread operands), more samples a program, more stages
CANDIDATES = [(w, st, sa, q, k) for k in (16, 64) for w, st, sa, q in
              [(4, 1, 2, 64), (8, 1, 2, 128), (4, 1, 1, 64), (8, 1, 1, 128), (4, 2, 2, 64), (8, 2, 1, 128),
               (4, 1, 4, 32), (2, 1, 4, 16)]] + \
    [(2, 1, 8, 16, 16), (1, 1, 8, 16, 32), (2, 1, 4, 16, 32), (4, 1, 4, 32, 32), (4, 1, 8, 32, 16),
     (4, 1, 4, 64, 32), (8, 1, 4, 64, 16), (4, 2, 4, 64, 16), (4, 3, 2, 64, 64), (8, 3, 2, 128, 64)]


def extra_configs():
    """The candidates not in the module's list."""
    def key(c):
        return (c.num_warps, c.num_stages, c.kwargs["SAMPLES"], c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_K"])
    have = {key(c) for c in module._CONFIGS}
    return [cfg(w, st, SAMPLES=sa, BLOCK_Q=q, BLOCK_K=k) for w, st, sa, q, k in CANDIDATES
            if (w, st, sa, q, k) not in have]


def products(l_max, channels, dtype, batch, generator):
    p = (l_max + 1) ** 2
    m = torch.randn(batch, p, p, device="cuda", generator=generator)
    x = torch.randn(batch, p, channels, device="cuda", generator=generator).to(dtype)
    g = torch.randn(batch, p, channels, device="cuda", generator=generator).to(dtype)
    acc = torch.float32
    if dtype == torch.float32:
        cublas_apply = lambda: torch.matmul(m, x)  # noqa: E731
    else:
        m16 = m.to(dtype)
        cublas_apply = lambda: torch.matmul(m16, x)  # noqa: E731
    return [("apply", m, x, dtype, cublas_apply),
            ("gram", g, x.transpose(-1, -2), acc, lambda: torch.matmul(g, x.transpose(-1, -2)))]


def nbytes(a, b, out_dtype):
    p, q = a.shape[-2], b.shape[-1]
    return a.numel() * a.element_size() + b.numel() * b.element_size() + \
        a.shape[0] * p * q * torch.empty((), dtype=out_dtype).element_size()


def forced(kernel, config):
    kernel.configs, kernel.cache = [config], {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--extra", action="store_true")
    parser.add_argument("--warm-shard")
    parser.add_argument("--l-max", default="3,4,6", help="comma-separated L values (P = (L + 1)^2 rows)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--products", default="apply,gram")
    args = parser.parse_args()
    kernel = module.small_matmul_kernel
    all_configs = list(module._CONFIGS) + (extra_configs() if args.extra else [])
    saved = (kernel.configs, dict(kernel.cache))
    copy_gbps = None if args.warm_shard else ceilings("cuda").copy_gbps
    shard = tuple(int(v) for v in args.warm_shard.split("/")) if args.warm_shard else None
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, job = [], 0
    if not shard:
        info = machine_info("cuda")
        print(f"# {info['device_name']} | torch {info['torch']} | triton {info['triton']} | "
              f"copy {copy_gbps:.0f} GB/s | batch {args.batch}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for l_max in (int(v) for v in args.l_max.split(",")):
            for channels in (32, 128):
                for name, a, b, out_dtype, cublas in products(l_max, channels, dtype, args.batch, generator):
                    if name not in args.products.split(","):
                        continue
                    job += 1
                    if shard and job % shard[1] != shard[0]:
                        continue
                    label = f"{name} L{l_max} C{channels} {str(dtype).split('.')[1]}"
                    size = nbytes(a, b, out_dtype)
                    pct = (lambda ms: 100 * size / (ms / 1e3) / 1e9 / copy_gbps) if copy_gbps else None
                    row = {"product": label, "bytes": size, "configs": {}}
                    exact = torch.matmul(a.double(), b.double()) if not shard else None
                    for index, config in enumerate(all_configs):
                        forced(kernel, config)
                        out = module.small_matmul(a, b, out_dtype)
                        if shard:
                            continue
                        err = float(((out.double() - exact).abs().max() / exact.abs().max()))
                        ms = gpu_time_median_ms(lambda: module.small_matmul(a, b, out_dtype))
                        row["configs"][str(config)] = {"index": index, "ms": ms, "pct": pct(ms), "err": err}
                    kernel.configs, kernel.cache = saved[0], dict(saved[1])
                    if shard:
                        continue
                    module.small_matmul(a, b, out_dtype)  # the autotuner's pick, timed after it settles
                    row["auto_ms"] = gpu_time_median_ms(lambda: module.small_matmul(a, b, out_dtype))
                    row["auto_config"] = str(kernel.best_config)
                    row["cublas_ms"] = gpu_time_median_ms(cublas)
                    best = min(row["configs"].items(), key=lambda kv: kv[1]["ms"])
                    row["best_config"], row["best_ms"] = best[0], best[1]["ms"]
                    rows.append(row)
                    print(f"| {label} | cuBLAS {row['cublas_ms']:.3f} ms {pct(row['cublas_ms']):.0f}% | auto "
                          f"{row['auto_ms']:.3f} ms {pct(row['auto_ms']):.0f}% ({row['auto_config']}) | best "
                          f"{row['best_ms']:.3f} ms {pct(row['best_ms']):.0f}% #{best[1]['index']} "
                          f"({row['best_config']}) | max err {max(c['err'] for c in row['configs'].values()):.1e} |",
                          flush=True)
                torch.cuda.empty_cache()
    if args.json and not shard:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info("cuda"), "copy_gbps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
