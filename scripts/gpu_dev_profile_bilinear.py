#!/usr/bin/env python3
"""Launches of attnbench/kernels/sparse/bilinear.py's kernel on one mul case, for ncu:

    ATTNBENCH_AUTOTUNE=0 ncu --clock-control none -k regex:bilinear --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats ... python3 scripts/gpu_dev_profile_bilinear.py [L N C DTYPE]

Default case: CG L 6, N 1e5, C 128, bf16 (results/gpu/nvidia-h100/ncu-bilinear-l6-nvidia-h100.txt)."""
import sys

import torch

from attnbench.kernels.sparse import bilinear as sb
from attnbench.sparse.tensor_product import cg_product_infos

l_max, n, channels, dtype = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                             getattr(torch, sys.argv[4])) if len(sys.argv) > 4 else (6, 100_000, 128, torch.bfloat16)
info = cg_product_infos(l_max, l_max, l_max, device="cuda")[0]
table = info.dense_rows["gram"]
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, info.size1, channels, device="cuda", generator=g).to(dtype)
y = torch.randn(n, info.size2, channels, device="cuda", generator=g).to(dtype)
for _ in range(2):
    sb.bilinear_launch(x, y, table.matrix32, info.out_size, table.splits.get(dtype))
torch.cuda.synchronize()
