#!/usr/bin/env python3
"""Odd-size witnesses for the sparse product kernel's GPU-only paths, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 scripts/gpu_dev_sparse_witness.py [--device cpu --batch 7]

The CPU gate's tiny batches never split an out_accumulated product over batch ranges on a GPU (a range is 256
items at least there), and the tl.dot route's tiles are 16 wide and more. Here every op runs with the batch sum
on a batch of 3001 (several ranges, a ragged last one) and every op with a shared operand on odd channel counts
(17, 33), in fp32 and bf16, each against the split implementation in float64. Exits 1 on a mismatch.
"""
import argparse
import sys

import torch

import attnbench  # noqa: F401  sets up the kernels
from attnbench.kernels.sparse_segment import CHANNEL_RANKS, batch_splits
from attnbench.sparse import random_product_infos
from attnbench.sparse.functional import sparse_product_split
from attnbench.sparse.triton_ops import sparse_product_triton

SIZES = (7, 5, 9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=3001)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    info = random_product_infos(*SIZES, 60, gen, device=args.device)[0]

    def operand(shared, size, channels, rank, dtype, gen):
        shape = (() if shared else (args.batch,)) + (size,) + (channels,) * rank
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(args.device, dtype)

    worst = 0.0
    failed = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, (rank_x, rank_y, _) in CHANNEL_RANKS.items():
            for shared_x, shared_y, accumulated in ((False, False, True), (False, True, False), (True, False, False)):
                for channels in (17, 33):
                    x = operand(shared_x, SIZES[0], channels, rank_x, dtype, gen)
                    y = operand(shared_y, SIZES[1], channels, rank_y, dtype, gen)
                    z = sparse_product_triton(op, x, y, info, accumulated)
                    expected = sparse_product_split(op, x.double(), y.double(), info, accumulated)
                    scale = expected.abs().max().clamp_min(1e-30)
                    error = ((z.double() - expected).abs().max() / scale).item()
                    bound = 1e-5 if dtype == torch.float32 else 2e-2  # one rounding to the dtype dominates
                    worst = max(worst, error if dtype == torch.float32 else 0.0)
                    if not error <= bound:
                        failed.append(f"{op} {dtype} shared x/y {shared_x}/{shared_y} sum {accumulated} C{channels}: "
                                      f"{error:.2e}")
    print(f"batch ranges at B{args.batch}: {batch_splits(args.batch, SIZES[2], 17, 132)}; worst fp32 error "
          f"{worst:.2e}")
    print("\n".join(failed) or "all witnesses match the float64 split implementation")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
