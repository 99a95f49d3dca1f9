"""The batch sum of sparse outer products on matrix units: the weight gradient of the fully connected layer.

    z[o, a, b] = sum_n sum_{t in segment o} s[t] x[n, i1[t], a] y[n, i2[t], b]

is ``outer`` with ``out_accumulated`` and both inputs batched. The FC layer's shared weight (vecmat with a shared
y) has it as its gradient, in the backward and again in the double backward. The segment kernel
(``segment.py``) sums it on CUDA cores, a broadcast multiply per (batch item, term): the layer's backward
then takes many times its forward, no faster than split-PyTorch at C 128. Per term it is a [C1, N] x [N, C2] matrix
product with the batch as the contraction dim, so here it is ``tl.dot``, which makes the layer's backward many times
faster than the segment kernel's in fp32 and in bf16 (docs/measurements/sparse.md).

* Grid (channel tile, output row, batch split). A program owns a [BLOCK_A, BLOCK_B] tile of one output row and
  a contiguous range of batch blocks. For each batch block it walks the row's terms in CSR order; a term's
  product x[n-block, i1]^T @ y[n-block, i2] is summed into the tile after its scale (in the accumulator dtype: the
  scale is never rounded into a 16-bit operand).
* Channel tiles and rows vary fastest in launch order, so that the programs resident together work on the same
  batch range and a batch block's x and y rows, read once per term that uses them, can come from L2 (the intent;
  the order is not measured against another).
* The batch splits' partial tiles are summed afterwards in a fixed order (``sparse_segment.batch_splits`` picks
  the count; no atomics), so the result is bitwise deterministic for a launch config (the autotuner's pick, as in
  the segment kernel, may differ between processes).
* fp32 inputs use full-precision dots (never TF32), 16-bit inputs the tensor cores with fp32 accumulation; fp64
  keeps the segment kernel (no fp64 dot here).
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..outputs import new_output
from ..precision import accumulator_dtype, accumulator_torch_dtype, dot_precision
from .segment import MAX_GRID_YZ, batch_splits, compact_channels
from ..tuning import autotune, autotune_enabled, cfg, configs, config_list, multiprocessors, next_pow2

__all__ = ["outer_sum_launch", "outer_sum_kernel", "channel_tiles"]

# GPU: square tiles for square channel counts (C 32 and 128 at the anchors), 32-128 batch rows a dot (its
# contraction). Defaults, not tuned yet (the autotuner picks among them); default first. Interpreter: blocks of 2,
# so tiny test shapes span several channel tiles and batch blocks.
_CONFIGS = config_list(
    configs("BLOCK_N BLOCK_A BLOCK_B",
            (4, 3, 64, 64, 64), (8, 3, 64, 128, 128), (8, 3, 32, 128, 128),
            (4, 3, 128, 64, 64), (4, 3, 64, 32, 32), (4, 3, 128, 32, 32),
            (4, 3, 64, 128, 32), (4, 3, 64, 32, 128)),
    cfg(1, 1, BLOCK_N=2, BLOCK_A=2, BLOCK_B=2))


def _prune(configs, named_args, **constexprs):
    """Tiles wider than a (power-of-two, at least 16: tl.dot's) channel count only idle lanes: drop them, keeping at
    least the smallest tile; ATTNBENCH_AUTOTUNE=0 keeps the first survivor only."""
    width_a = max(16, next_pow2(int(named_args["CA"])))
    width_b = max(16, next_pow2(int(named_args["CB"])))
    fitting = [c for c in configs if c.kwargs["BLOCK_A"] <= width_a and c.kwargs["BLOCK_B"] <= width_b]
    fitting = fitting or [min(configs, key=lambda c: c.kwargs["BLOCK_A"] * c.kwargs["BLOCK_B"])]
    return fitting if autotune_enabled() else fitting[:1]


def channel_tiles(ca, cb, meta):
    """Programs per output row: the [BLOCK_A, BLOCK_B] tiles of the (a, b) channel plane."""
    return triton.cdiv(ca, meta["BLOCK_A"]) * triton.cdiv(cb, meta["BLOCK_B"])


@autotune(_CONFIGS, key=["CA", "CB", "HAS_GATHER", "DOT_PRECISION"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def outer_sum_kernel(X, Y, Z, SCALE, INDEX1, INDEX2, GATHER, BOUNDS, N, OUT_SIZE, ROW0, CA, CB,
                     s_xn, s_xm, s_xa, s_yn, s_ym, s_yb, s_zs, s_zm,
                     HAS_SCALE: tl.constexpr, HAS_GATHER: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     ACC_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    b_tiles = tl.cdiv(CB, BLOCK_B)
    offs_a = (tl.program_id(0) // b_tiles) * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_b = (tl.program_id(0) % b_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
    row = ROW0 + tl.program_id(1)
    start = tl.load(BOUNDS + row)
    end = tl.load(BOUNDS + OUT_SIZE + row)
    blocks = tl.cdiv(N, BLOCK_N)
    per_split = tl.cdiv(blocks, tl.num_programs(2))
    first = tl.program_id(2) * per_split
    last = tl.minimum(first + per_split, blocks)
    last = tl.where(end > start, last, first)  # a row without terms skips its batch range (and stores zeros)
    a_mask = offs_a < CA
    b_mask = offs_b < CB
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=ACC_DTYPE)
    for nb in range(first, last):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        x_n = X + offs_n.to(tl.int64)[:, None] * s_xn + offs_a[None, :] * s_xa  # [BLOCK_N, BLOCK_A]
        y_n = Y + offs_n.to(tl.int64)[:, None] * s_yn + offs_b[None, :] * s_yb  # [BLOCK_N, BLOCK_B]
        x_mask = n_mask[:, None] & a_mask[None, :]
        y_mask = n_mask[:, None] & b_mask[None, :]
        for k in range(start, end):  # the row's terms in CSR order: a fixed summation order
            if HAS_GATHER:
                t = tl.load(GATHER + k)
            else:
                t = k
            xt = tl.load(x_n + tl.load(INDEX1 + t) * s_xm, mask=x_mask, other=0.0)
            yt = tl.load(y_n + tl.load(INDEX2 + t) * s_ym, mask=y_mask, other=0.0)
            term = tl.dot(tl.trans(xt), yt, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
            if HAS_SCALE:
                term = term * tl.load(SCALE + t).to(ACC_DTYPE)
            acc += term
    z_ptrs = Z + tl.program_id(2).to(tl.int64) * s_zs + row.to(tl.int64) * s_zm + offs_a[:, None] * CB + offs_b[None, :]
    tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=a_mask[:, None] & b_mask[None, :])


def outer_sum_launch(x, y, info):
    """z of ``sparse_product_split("outer", x, y, info, out_accumulated=True)`` for batched x [N, M1, C1] and
    y [N, M2, C2] (any strides, one dtype, not fp64): [out_size, C1, C2] in x's dtype. ``info`` as for
    ``sparse_segment.sparse_product_launch``."""
    batch, ca, cb = x.shape[0], x.shape[-1], y.shape[-1]
    x, y = compact_channels(x, 1), compact_channels(y, 1)  # channel offsets are int32 in the kernel
    z = new_output((info.out_size, ca, cb), x.dtype, x.device)
    if z.numel() == 0:
        return z
    if batch == 0 or info.index1.numel() == 0:
        return z.zero_()
    cz = ca * cb
    splits = batch_splits(batch, info.out_size, cz, multiprocessors(z.device), z.device.type,
                           channels_per_program=64 * 64)
    zv = z.view(1, info.out_size, cz)
    if splits > 1:  # partial tiles per batch range, in the accumulator's precision, summed in a fixed order below
        zv = torch.empty((splits, info.out_size, cz), dtype=accumulator_torch_dtype(x.dtype), device=z.device)
    bounds = info.row_bounds
    scale = info.scale if info.scale is not None else bounds  # dummy pointers when absent
    gather = info.gather_index if info.gather_index is not None else bounds
    for row0 in range(0, info.out_size, MAX_GRID_YZ):
        rows = min(MAX_GRID_YZ, info.out_size - row0)

        def grid(meta, rows=rows):
            return (channel_tiles(ca, cb, meta), rows, splits)

        with on_device(z):
            outer_sum_kernel[grid](
                x, y, zv, scale, info.index1, info.index2, gather, bounds, batch, info.out_size, row0, ca, cb,
                x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
                zv.stride(0), zv.stride(1),
                HAS_SCALE=info.scale is not None, HAS_GATHER=info.gather_index is not None,
                DOT_PRECISION=dot_precision(x.dtype), ACC_DTYPE=accumulator_dtype(x.dtype))
    if splits > 1:
        z.copy_(zv.sum(0).view(z.shape))  # torch's reduction over a dim: a fixed order for a shape, no atomics
    return z
