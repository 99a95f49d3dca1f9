#!/usr/bin/env python3
"""Time kernels/sparse_bilinear.py's kernel under each launch config, forward mul at CG L 3, 4, 6, C 32 and 128,
N 1e5, fp32 and bf16, in one process (CUDA events, L2 flushed):

    python3 scripts/gpu_dev_bilinear_configs.py > sparse-bilinear-configs.md

The candidates: the kernel's first config list (the first eight) and nine more (deeper pipelines, more columns a
program, two warps). Each is forced by replacing the autotuner's configs; "gain" is the best candidate over the best of
the first eight. A config that cannot launch (out of resources) reads nan."""
import torch
import triton

from attnbench.kernels import sparse_bilinear as sb
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.timing import measure

CANDIDATES = [(4, 1, 2, 32), (4, 2, 2, 32), (4, 1, 4, 32), (8, 1, 8, 32), (4, 1, 8, 16), (4, 1, 1, 64),
              (8, 1, 2, 64), (8, 2, 4, 32),
              # new: deeper pipelines, more columns
              (4, 3, 4, 32), (8, 3, 8, 32), (8, 2, 8, 32), (8, 1, 16, 32), (4, 2, 4, 32), (8, 2, 2, 64), (8, 1, 4, 64),
              (2, 1, 2, 32), (2, 2, 1, 32)]
kernel = sb.bilinear_kernel
print("| case | " + " | ".join(f"w{w} s{s} n{n} c{c}" for w, s, n, c in CANDIDATES) + " | best | first-8 best | gain |")
print("|" + " --- |" * (len(CANDIDATES) + 4))
for dtype in (torch.float32, torch.bfloat16):
    for l_max in (3, 4, 6):
        for channels in (32, 128):
            info = cg_product_infos(l_max, l_max, l_max, device="cuda")[0]
            table = info.dense_rows["gram"]
            g = torch.Generator(device="cuda").manual_seed(0)
            n = 100_000
            x = torch.randn(n, info.size1, channels, device="cuda", generator=g).to(dtype)
            y = torch.randn(n, info.size2, channels, device="cuda", generator=g).to(dtype)
            split = table.splits.get(dtype)
            ms = []
            for w, s, bn, bc in CANDIDATES:
                kernel.configs = [triton.Config({"BLOCK_N": bn, "BLOCK_C": bc}, num_warps=w, num_stages=s)]
                kernel.cache = {}
                try:
                    fn = lambda x=x, y=y: sb.bilinear_launch(x, y, table.matrix32, info.out_size, split)  # noqa: E731
                    fn()
                    ms.append(measure(fn, "cuda").median_ms)
                except Exception:  # out of resources
                    ms.append(float("nan"))
            best = min(range(len(ms)), key=lambda i: ms[i] if ms[i] == ms[i] else 1e9)
            first = min(m for m in ms[:8] if m == m)
            label = f"L{l_max} C{channels} {str(dtype)[6:]}"
            print(f"| {label} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {CANDIDATES[best]} | {first:.3f} | "
                  f"{first / ms[best]:.2f}x |", flush=True)
            del x, y
            torch.cuda.empty_cache()
