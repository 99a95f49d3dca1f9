#!/usr/bin/env python3
"""mul's bilinear kernel with fewer output rows a program (kernels/sparse_bilinear.py's MAX_BLOCK_O 64 -> 32 -> 16),
forward at CG L 4 and 6, C 32 and 128, N 1e5, bf16 and fp32, every config of the kernel's list forced one at a time, in
one process (CUDA events, L2 flushed). At L 6 ncu found the kernel bound by registers (255 a thread, spills, 12.5%
occupancy: the [columns, 64] accumulator, the row's product and the held tile at once); fewer rows a program shrink the
first two, at the price of re-reading x and the held operand once per row tile.

    python3 scripts/gpu_dev_bilinear_block_o.py > sparse-bilinear-block-o.md

Per case and row cap: the best config's ms, and the largest difference from the 64-row outputs relative to their
largest magnitude (the tiles only regroup the output rows, so it should be 0 or a rounding)."""
import torch
import triton

from attnbench.kernels import sparse_bilinear as sb
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.timing import measure

CAPS = (64, 32, 16)
SHAPES = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in sb._CONFIGS]
kernel = sb.bilinear_kernel
print("| case | " + " | ".join(f"O{cap} ms (config)" for cap in CAPS) + " | O32 gain | O16 gain | max diff |")
print("|" + " --- |" * (len(CAPS) + 4))
for dtype in (torch.bfloat16, torch.float32):
    for l_max in (4, 6):
        for channels in (32, 128):
            info = cg_product_infos(l_max, l_max, l_max, device="cuda")[0]
            table = info.dense_rows["gram"]
            g = torch.Generator(device="cuda").manual_seed(0)
            n = 100_000
            x = torch.randn(n, info.size1, channels, device="cuda", generator=g).to(dtype)
            y = torch.randn(n, info.size2, channels, device="cuda", generator=g).to(dtype)
            split = table.splits.get(dtype)
            best, outs = {}, {}
            for cap in CAPS:
                sb.MAX_BLOCK_O = cap
                for shape in SHAPES:
                    blocks = {k: v for k, v in shape.items() if k.startswith("BLOCK")}
                    kernel.configs = [triton.Config(blocks, num_warps=shape["num_warps"],
                                                    num_stages=shape["num_stages"])]
                    kernel.cache = {}
                    try:
                        fn = lambda x=x, y=y: sb.bilinear_launch(x, y, table.matrix32, info.out_size, split)  # noqa
                        out = fn()
                        ms = measure(fn, "cuda").median_ms
                    except triton.runtime.errors.OutOfResources:
                        continue
                    if cap not in best or ms < best[cap][0]:
                        best[cap] = (ms, f"w{shape['num_warps']} s{shape['num_stages']} n{blocks['BLOCK_N']} "
                                         f"c{blocks['BLOCK_C']}")
                    outs.setdefault(cap, out)
            if 64 not in outs:
                print(f"| L{l_max} C{channels} {str(dtype)[6:]} | no config ran at 64 rows |", flush=True)
                continue
            ref = outs[64].float()
            diff = max(float((o.float() - ref).abs().max()) for o in outs.values()) / float(ref.abs().max())
            label = f"L{l_max} C{channels} {str(dtype)[6:]}"
            cells = " | ".join(f"{best[c][0]:.3f} ({best[c][1]})" if c in best else "-" for c in CAPS)
            gains = " | ".join(f"{best[64][0] / best[c][0]:.2f}x" if c in best else "-" for c in CAPS[1:])
            print(f"| {label} | {cells} | {gains} | {diff:.1e} |", flush=True)
            del x, y, outs
            torch.cuda.empty_cache()
sb.MAX_BLOCK_O = CAPS[0]
