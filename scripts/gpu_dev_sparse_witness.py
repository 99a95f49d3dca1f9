#!/usr/bin/env python3
"""Odd-size witnesses for the sparse product kernel's GPU-only paths, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 scripts/gpu_dev_sparse_witness.py [--device cpu --batch 7] [--scale-only]
        [--fused-only] [--all-rows]

The CPU gate's tiny batches never split an out_accumulated product over batch ranges on a GPU (a range is 256
items at least there), and the tl.dot route's tiles are 16 wide and more. Here every op runs with the batch sum
on a batch of 3001 (several ranges, a ragged last one), without it, and with a shared operand on odd channel counts
(17, 33) (``--all-rows``: the product kernel's rows walked by one program, every op), vecsca, scavec and inner on
the fused dense kernels (CG L 2 and 3; fp16 too), mul on its bilinear route
(attnbench/kernels/sparse/bilinear.py) where the held operand pads to 32 and 64 rows and the output spans two row tiles, and
SparseScale on [M, C] (odd M, channels folded into lines and not), in fp32 and bf16, each against the split
implementation in float64. Exits 1 on a mismatch.
"""
import argparse
import sys

import torch

import attnbench  # noqa: F401  sets up the kernels
from attnbench.kernels import poisoned_outputs
from attnbench.kernels.sparse.segment import CHANNEL_RANKS, batch_splits
from attnbench.sparse import random_product_infos, random_scale_infos
from attnbench.sparse.functional import sparse_product_split, sparse_scale_split
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.sparse.triton_ops import _bilinear_table, sparse_product_triton, sparse_scale_triton

SIZES = (7, 5, 9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=3001)
    parser.add_argument("--scale-only", action="store_true", help="SparseScale's witnesses only")
    parser.add_argument("--fused-only", action="store_true", help="the fused dense kernels' witnesses only")
    parser.add_argument("--all-rows", action="store_true",
                        help="the product kernel's ALL_ROWS route (a program walks every row): every op, any batch")
    args = parser.parse_args()
    if args.all_rows:  # every op, every batch
        from attnbench.kernels.sparse import segment as sparse_segment
        sparse_segment.ALL_ROWS.update(min_batch=0, ops=frozenset(CHANNEL_RANKS))
    gen = torch.Generator().manual_seed(0)
    info = random_product_infos(*SIZES, 60, gen, device=args.device)[0]

    def operand(shared, size, channels, rank, dtype, gen, batch=args.batch):
        shape = (() if shared else (batch,)) + (size,) + (channels,) * rank
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(args.device, dtype)

    worst = [0.0]  # the largest fp32 error
    failed = []

    def check(label, z, expected, dtype):
        """z against the float64 split result, max error over max |expected|: 1e-5 in fp32, 2e-2 in bf16 (one
        rounding to the dtype dominates)."""
        error = ((z.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
        if dtype == torch.float32:
            worst[0] = max(worst[0], error)
        if not error <= (1e-5 if dtype == torch.float32 else 2e-2):
            failed.append(f"{label} {dtype}: {error:.2e}")
    for dtype in (torch.float32, torch.bfloat16):
        for op, (rank_x, rank_y, _) in () if args.scale_only or args.fused_only else CHANNEL_RANKS.items():
            for shared_x, shared_y, accumulated in ((False, False, True), (False, False, False), (False, True, False),
                                                    (True, False, False)):
                for channels in (17, 33):
                    x = operand(shared_x, SIZES[0], channels, rank_x, dtype, gen)
                    y = operand(shared_y, SIZES[1], channels, rank_y, dtype, gen)
                    with poisoned_outputs():
                        z = sparse_product_triton(op, x, y, info, accumulated)
                    check(f"{op} shared x/y {shared_x}/{shared_y} sum {accumulated} C{channels}", z,
                          sparse_product_split(op, x.double(), y.double(), info, accumulated), dtype)
    # mul on the bilinear route: 23 held rows (a 32-row tile) and 70 output rows (two tiles of 64); CG L 6 (49 held
    # rows: a 64-row tile); y held, then x (the operand with fewer rows is held)
    bilinear = [random_product_infos(37, 23, 70, 4000, gen, device=args.device)[0],
                random_product_infos(23, 37, 70, 4000, gen, device=args.device)[0]]
    if args.fused_only:
        bilinear = []
    elif args.device == "cuda":
        bilinear.append(cg_product_infos(6, 6, 6, device=args.device)[0])
    for dtype in (torch.float32, torch.bfloat16):
        for mul_info in bilinear:
            for shared_x, shared_y in ((False, False), (False, True), (True, False)):
                # 301 samples, 101 at L 6: the split reference's [N, terms, C] float64 intermediates (0.16 GB each)
                # piled up to the card's 80 GB at 3001 under compute-sanitizer
                batch = min(args.batch, 101 if mul_info.size1 == 49 else 301)
                x = operand(shared_x, mul_info.size1, 17, 1, dtype, gen, batch)
                y = operand(shared_y, mul_info.size2, 17, 1, dtype, gen, batch)
                if _bilinear_table("mul", x, y, mul_info, False) is None:
                    failed.append(f"mul {mul_info.size1} x {mul_info.size2} -> {mul_info.out_size}: not routed")
                    continue
                with poisoned_outputs():
                    z = sparse_product_triton("mul", x, y, mul_info)
                check(f"mul bilinear {mul_info.size1} x {mul_info.size2} -> {mul_info.out_size} shared x/y "
                      f"{shared_x}/{shared_y}", z, sparse_product_split("mul", x.double(), y.double(), mul_info), dtype)
    # vecsca, scavec and inner on the dense route at CG L 2 and 3 (9 and 16 rows), one operand shared or none, odd
    # channels: in 16 bits both steps in one program (attnbench/kernels/sparse/fused_dense.py; not inner at L 2), fp32 on two
    # launches
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for l_max in (2, 3) if not args.scale_only else ():
            fused_info = cg_product_infos(l_max, l_max, l_max, device=args.device)[0]
            for op in ("vecsca", "scavec", "inner"):
                rank_x, rank_y, _ = CHANNEL_RANKS[op]
                for shared_x, shared_y in ((False, False), (False, True), (True, False)):
                    x = operand(shared_x, fused_info.size1, 17, rank_x, dtype, gen)
                    y = operand(shared_y, fused_info.size2, 17, rank_y, dtype, gen)
                    with poisoned_outputs():
                        z = sparse_product_triton(op, x, y, fused_info)
                    check(f"{op} dense route CG L {l_max} shared x/y {shared_x}/{shared_y}", z,
                          sparse_product_split(op, x.double(), y.double(), fused_info), dtype)
    # SparseScale on [M, C] (a batch of one): wide channels fold into lines (kernels/sparse_segment.channel_line),
    # many terms a row (a segment sum) and one (its transpose, the backward's gather); odd M, foldable and not
    for dtype in (torch.float32, torch.bfloat16):
        rows = args.batch  # M (odd) into M // 30 + 1 segments, and the transpose
        for info in [] if args.fused_only else random_scale_infos(rows, rows // 30 + 1, rows, gen, device=args.device):
            for channels in (48, 96, 2048, 17) if args.device == "cuda" else (48, 17):  # the interpreter: small
                x = torch.randn(info.in_size, channels, generator=gen, dtype=torch.float64).to(args.device, dtype)
                with poisoned_outputs():  # an output element the kernel forgets (an empty row's zeros) is NaN
                    z = sparse_scale_triton(x, info)
                check(f"scale M{info.in_size}->{info.out_size} C{channels}", z, sparse_scale_split(x.double(), info),
                      dtype)
    print(f"batch ranges at B{args.batch}: {batch_splits(args.batch, SIZES[2], 17, 132)}; worst fp32 error "
          f"{worst[0]:.2e}")
    print("\n".join(failed) or "all witnesses match the float64 split implementation")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
