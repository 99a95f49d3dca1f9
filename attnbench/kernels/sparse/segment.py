"""CSR segment kernels of the ``sparse`` operator: SparseScale and the seven sparse products.

    scale:    z[n, m, c] = sum_{t in seg_out[m]:seg_out[m+1]} scale[t] x[n, index[t], c]
    product:  z[n, index_out[j]] = sum_{k in seg_out[j]:seg_out[j+1]} s[t] x[n, index1[t]] ∘ y[n, index2[t]],
              t = gather_index[k] (k without it), s = scale (1 without it)

Both are memory-bound gathers (1-20 FLOP per byte), so the layout is chosen for bandwidth. (vecsca, scavec and
inner take the dense route of ``dense.py`` instead where their structure is dense enough; this kernel keeps
them for batch sums and thin structures; outer summed over the batch with both inputs batched, the FC layer's
weight gradient, runs on matrix units in ``outer_sum.py``.)

* Grid (batch block, output row, channel tile). A program owns one output row (every row of the output, not only
  the rows of index_out), BLOCK_N batch items and BLOCK_C output channels; it walks the row's terms in CSR
  order, accumulates in registers (fp32, fp64 for fp64 inputs) and stores its tile exactly once. Rows without
  a segment store zeros, so outputs need no zero fill and no element is written twice: no atomics, and the
  result is bitwise deterministic (the sum order is the CSR order, fixed by the info). With ``ALL_ROWS`` (mul from
  1e4 batch items) the grid is (batch block, 1, channel tile) and a program walks every output row in turn, each
  as above: the same sums in the same order, so the same bits.
* ``out_accumulated`` (z summed over the batch): grid axis 0 splits the batch into NUM_SPLITS contiguous ranges
  of batch blocks; each program reduces its [BLOCK_N, BLOCK_C] accumulator over its range and stores a partial
  row, and the partials are summed in split order afterwards (``batch_splits`` picks the count: with one
  program per row and channel tile, the FC layer's weight gradient would have ~150 programs walking 1e5 batch
  items each). Deterministic as well; the issue allows atomics here, none are used.
* SparseScale with a batch of one ([M, C], the message-passing segment sum) would leave the tile's batch rows
  empty: its contiguous channels fold into the batch axis as lines ([C / line, M, line], ``channel_line``), and
  where rows are short (its backward, a gather of one term a row) a row-tile kernel takes BLOCK_M rows a program
  (``sparse_scale_rows_kernel``, ``rows_tile``, channel tiles fastest), which takes that backward from a small
  fraction of the copy bandwidth to most of it (docs/measurements/sparse.md).
* Channel loads are along the contiguous channel dim, so a warp reads consecutive addresses of one gathered
  row; a shared operand (no batch dim) has batch stride 0 and is read once per term per program, then
  broadcast over the batch block in registers.
* The product kernel is one kernel with a constexpr ``OP`` switch. Output channels are flattened (outer's
  (C1, C2) is c = a * C2 + b); ops that contract (inner, vecmat, mat_t_vec) loop over the contracted dim R in
  BLOCK_R chunks inside each term. Channel strides are arguments, so the transposed views the backward passes
  (vecmat's y^T, outer's gz^T) are read in place without a copy.
* ``DOT``: vecmat with a shared y and mat_t_vec with a shared x (the FC layer's weight and its transposed use in
  the backward) are, per term, a [BLOCK_N, R] x [R, BLOCK_C] matrix product: ``tl.dot`` (tensor cores for half
  precision, full-precision fp32 FMAs for fp32, never TF32) instead of a broadcast multiply and sum (many times
  faster at the anchors' forward: docs/measurements/sparse.md).

Walking all the rows of a batch block in one program gains for mul and is kept for mul alone (``ALL_ROWS``; for
vecsca it is no steady gain, nor is taking several terms of a segment at a time for loads in flight:
docs/measurements/sparse.md), where mul does not take its bilinear route (attnbench/kernels/sparse/bilinear.py;
triton_ops._bilinear_table says where it does not: batch sums, structures without a dense matrix form or too thin for
it, both operands past 64 rows, fp32 with few terms a row, 16-bit coefficients whose split would lose precision).
Grid axes 1 and 2 are capped at 65535 programs by CUDA: one row a program launches rows in chunks (ROW0, ROWS),
channel tiles never come close for the channel sizes this operator sees (the launcher checks).
"""
import math

import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import INT32_MAX, offset_span
from ..outputs import new_output
from ..precision import accumulator_dtype, accumulator_torch_dtype, dot_precision
from ..tuning import autotune, autotune_enabled, cdiv, cfg, configs, config_list, multiprocessors, next_pow2

__all__ = ["ALL_ROWS", "walks_all_rows", "PRODUCT_OPS", "CHANNEL_RANKS", "product_out_shape", "scale_out_shape",
           "sparse_product_launch", "sparse_scale_launch", "sparse_product_kernel", "sparse_scale_kernel",
           "sparse_scale_rows_kernel", "batch_splits", "compact_channels", "channel_line"]

# op codes of the product kernel's constexpr switch
MUL: tl.constexpr = tl.constexpr(0)
OUTER: tl.constexpr = tl.constexpr(1)
INNER: tl.constexpr = tl.constexpr(2)
VECMAT: tl.constexpr = tl.constexpr(3)
VECSCA: tl.constexpr = tl.constexpr(4)
SCAVEC: tl.constexpr = tl.constexpr(5)
MAT_T_VEC: tl.constexpr = tl.constexpr(6)
PRODUCT_OPS = {"mul": 0, "outer": 1, "inner": 2, "vecmat": 3, "vecsca": 4, "scavec": 5, "mat_t_vec": 6}
# (channel rank of x, of y, of z) per op, as in attnbench.sparse.functional
CHANNEL_RANKS = {
    "mul": (1, 1, 1), "outer": (1, 1, 2), "inner": (1, 1, 0), "vecmat": (1, 2, 1),
    "vecsca": (1, 0, 1), "scavec": (0, 1, 1), "mat_t_vec": (2, 1, 1),
}
MAX_GRID_YZ = 65535
# For the ops in "ops", from min_batch batch items: a program of the product kernel walks every output row of its
# batch block and channel tile instead of one row a program. Every row's terms read the block's x and y rows; one
# row a program fetches them once per row that reads them, one program walking the rows can find them in its own
# L1 (an inference from the speedups, not profiled). For mul it is never slower than one row a program over N 1e4-1e6,
# with bitwise the same results; min_batch is the smallest batch where it is seen to gain: below it the rows are the
# parallelism (not measured). The other ops are not measured with it (an earlier version of the idea was no steady
# gain for vecsca): one row a program (docs/measurements/sparse.md).
ALL_ROWS = {"enabled": True, "min_batch": 10_000, "ops": frozenset({"mul"})}


def walks_all_rows(op, batch, accumulate=False, dot=False) -> bool:
    """Whether a product launch walks every output row in one program (``ALL_ROWS``): not for batch sums (their
    programs split the batch) nor the shared-matrix tl.dot route."""
    return (ALL_ROWS["enabled"] and op in ALL_ROWS["ops"] and not accumulate and not dot
            and batch >= ALL_ROWS["min_batch"])


def _prune(configs, named_args, **constexprs):
    """Channel tiles wider than the (power-of-two) output channel count only idle lanes: drop them, keeping at
    least the narrowest config; the DOT route keeps its own configs (tl.dot wants 16-wide tiles), the others
    theirs. ATTNBENCH_AUTOTUNE=0 keeps the first survivor only."""
    dot = bool(constexprs.get("DOT", named_args.get("DOT", False)))
    route = [c for c in configs if (id(c) in _DOT_ROUTE) == dot] or configs  # the interpreter has one config
    width = max(16, next_pow2(max(1, int(named_args["CZ"]))))
    fitting = [c for c in route if c.kwargs["BLOCK_C"] <= width]
    fitting = fitting or [min(route, key=lambda c: c.kwargs["BLOCK_C"])]
    return fitting if autotune_enabled() else fitting[:1]


# GPU: channel tiles 32-128 wide, a few batch rows per program (a shared operand is then read once for them
# all), contraction chunks of 8-16; the DOT route's own list below. Defaults, not tuned yet (the autotuner picks
# among them on the GPU); default first. Interpreter: tiny blocks, so tiny test shapes span several batch blocks,
# channel tiles and R chunks.
_DOT_CONFIGS = [  # 32-128 batch rows (tl.dot's M), R chunks of 16-32
    cfg(4, 2, BLOCK_N=64, BLOCK_C=64, BLOCK_R=32),
    cfg(4, 2, BLOCK_N=32, BLOCK_C=64, BLOCK_R=32),
    cfg(8, 2, BLOCK_N=64, BLOCK_C=128, BLOCK_R=32),
    cfg(4, 2, BLOCK_N=128, BLOCK_C=32, BLOCK_R=32),
    cfg(4, 2, BLOCK_N=32, BLOCK_C=32, BLOCK_R=16),
]
_DOT_ROUTE = {id(c) for c in _DOT_CONFIGS}
_PRODUCT_CONFIGS = config_list(
    [
        cfg(4, 1, BLOCK_N=2, BLOCK_C=64, BLOCK_R=16),
        cfg(4, 1, BLOCK_N=2, BLOCK_C=128, BLOCK_R=16),
        cfg(4, 1, BLOCK_N=4, BLOCK_C=32, BLOCK_R=16),
        cfg(4, 1, BLOCK_N=8, BLOCK_C=32, BLOCK_R=8),
        cfg(8, 1, BLOCK_N=4, BLOCK_C=128, BLOCK_R=8),
        cfg(4, 1, BLOCK_N=16, BLOCK_C=16, BLOCK_R=8),
        *_DOT_CONFIGS,
    ],
    cfg(1, 1, BLOCK_N=2, BLOCK_C=2, BLOCK_R=2),
)
_SCALE_CONFIGS = config_list(
    configs("BLOCK_N BLOCK_C",
            (4, 1, 4, 64), (4, 1, 2, 128), (4, 1, 8, 32),
            (8, 1, 8, 128), (4, 1, 16, 16),
            # larger tiles for rows of one term (the gather of a segment sum's backward): a program's index chain
            # (row bounds, then the term's index, then x) is paid once per tile, so a tile must move kilobytes
            (4, 1, 16, 64), (8, 1, 32, 64), (8, 1, 64, 32),
            (8, 1, 16, 128)),
    cfg(1, 1, BLOCK_N=2, BLOCK_C=2))


# BATCH_DECADE (floor(log10 N), unused by the body) keys the tuning: with ALL_ROWS the batch blocks are the whole
# grid, so the best BLOCK_N depends on N
@autotune(_PRODUCT_CONFIGS, key=["OP", "CZ", "R", "ACCUMULATE", "HAS_GATHER", "DOT", "ALL_ROWS", "BATCH_DECADE"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["ROW0", "ROWS", "BATCH_DECADE"])
def sparse_product_kernel(X, Y, Z, SCALE, INDEX1, INDEX2, GATHER, BOUNDS,
                          N, OUT_SIZE, ROW0, ROWS, BATCH_DECADE, CZ, C2, R,
                          s_xn, s_xm, s_xa, s_xb, s_yn, s_ym, s_ya, s_yb, s_zn, s_zm,
                          OP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_GATHER: tl.constexpr,
                          ACCUMULATE: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          ACC_DTYPE: tl.constexpr, ALL_ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    # The op's body is written inline (no helper calls): the interpreter pays milliseconds per nested call.
    # Output rows: one a program (ROW0 + program_id(1)), or with ALL_ROWS the ROWS rows from ROW0 in turn, so that
    # the batch block's x and y rows, read by many rows' terms, come from this SM's L1 instead of L2 (rows without
    # a segment have start == end and store zeros).
    if ALL_ROWS:
        row_lo = ROW0
        row_hi = ROW0 + ROWS
    else:
        row_lo = ROW0 + tl.program_id(1)
        row_hi = row_lo + 1
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < CZ
    # channel offsets of x and y on the output tile, per op (z channels are flattened: outer's c = a * C2 + b)
    if OP == OUTER:
        a = offs_c // C2
        x_c = a * s_xa
        y_c = (offs_c - a * C2) * s_ya
    else:
        x_c = offs_c * s_xa  # mul, vecsca; mat_t_vec's column offset uses s_xb below
        y_c = offs_c * s_ya  # mul, scavec; vecmat's column offset uses s_yb below
    # values used after the loop are defined before it (a compiled Triton loop scopes its body's names)
    offs_n0 = tl.arange(0, BLOCK_N)
    if ACCUMULATE:  # z summed over the batch: this program walks its split's range of batch blocks
        per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), tl.num_programs(0))
        offs_n0 += tl.program_id(0) * per_split * BLOCK_N
        num_blocks = tl.minimum(per_split, tl.cdiv(N, BLOCK_N) - tl.program_id(0) * per_split)
        Z += tl.program_id(0).to(tl.int64) * s_zn  # this split's partial row (s_zn unused otherwise)
    else:
        offs_n0 += tl.program_id(0) * BLOCK_N
        num_blocks = 1
    for row in range(row_lo, row_hi):
        row64 = row + tl.zeros([], dtype=tl.int64)  # (the interpreter's loop index is a Python int)
        start = tl.load(BOUNDS + row)
        end = tl.load(BOUNDS + OUT_SIZE + row)
        acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
        for nb in range(0, num_blocks):
            offs_n = offs_n0 + nb * BLOCK_N
            n_mask = offs_n[:, None] < N
            m2 = n_mask & c_mask[None, :]
            x_n = X + offs_n.to(tl.int64)[:, None] * s_xn  # [BLOCK_N, 1] row pointers (batch stride 0: shared)
            y_n = Y + offs_n.to(tl.int64)[:, None] * s_yn
            for k in range(start, end):  # the segment's terms in CSR order: a fixed summation order
                if HAS_GATHER:
                    t = tl.load(GATHER + k)
                else:
                    t = k
                i1 = tl.load(INDEX1 + t)
                i2 = tl.load(INDEX2 + t)
                x_row = x_n + i1 * s_xm
                y_row = y_n + i2 * s_ym
                if OP == MUL or OP == OUTER:
                    term = (tl.load(x_row + x_c[None, :], mask=m2, other=0.0).to(ACC_DTYPE)
                            * tl.load(y_row + y_c[None, :], mask=m2, other=0.0).to(ACC_DTYPE))
                elif OP == VECSCA:
                    term = (tl.load(x_row + x_c[None, :], mask=m2, other=0.0).to(ACC_DTYPE)
                            * tl.load(y_row, mask=n_mask, other=0.0).to(ACC_DTYPE))
                elif OP == SCAVEC:
                    term = (tl.load(x_row, mask=n_mask, other=0.0).to(ACC_DTYPE)
                            * tl.load(y_row + y_c[None, :], mask=m2, other=0.0).to(ACC_DTYPE))
                elif OP == INNER:  # z[] = sum_r x[r] y[r]: one value per batch row, broadcast over the tile
                    total = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
                    for r0 in range(0, R, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        mr = n_mask & (offs_r[None, :] < R)
                        xr = tl.load(x_row + offs_r[None, :] * s_xa, mask=mr, other=0.0).to(ACC_DTYPE)
                        yr = tl.load(y_row + offs_r[None, :] * s_ya, mask=mr, other=0.0).to(ACC_DTYPE)
                        total += tl.sum(xr * yr, 1)
                    term = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE) + total[:, None]
                elif DOT:  # the shared matrix's [R, BLOCK_C] slice times the batch block's [BLOCK_N, R] vectors
                    term = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
                    for r0 in range(0, R, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        mr = n_mask & (offs_r[None, :] < R)
                        mrc = (offs_r[:, None] < R) & c_mask[None, :]
                        if OP == VECMAT:  # y shared: y[i2] is [R, C]
                            vec = tl.load(x_row + offs_r[None, :] * s_xa, mask=mr, other=0.0)
                            mat = tl.load(Y + i2 * s_ym + offs_r[:, None] * s_ya + offs_c[None, :] * s_yb,
                                          mask=mrc, other=0.0)
                        else:  # MAT_T_VEC, x shared: x[i1] is [R, C]
                            vec = tl.load(y_row + offs_r[None, :] * s_ya, mask=mr, other=0.0)
                            mat = tl.load(X + i1 * s_xm + offs_r[:, None] * s_xa + offs_c[None, :] * s_xb,
                                          mask=mrc, other=0.0)
                        term = tl.dot(vec, mat, term, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
                else:  # VECMAT z[c] = sum_r x[r] y[r, c];  MAT_T_VEC z[c] = sum_r x[r, c] y[r]: [N, R, C] tiles
                    term = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
                    for r0 in range(0, R, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        mr = n_mask[:, :, None] & (offs_r < R)[None, :, None]
                        m3 = mr & c_mask[None, None, :]
                        if OP == VECMAT:
                            vec = tl.load(x_row[:, :, None] + offs_r[None, :, None] * s_xa, mask=mr, other=0.0)
                            mat = tl.load(y_row[:, :, None] + offs_r[None, :, None] * s_ya
                                          + offs_c[None, None, :] * s_yb, mask=m3, other=0.0)
                        else:
                            mat = tl.load(x_row[:, :, None] + offs_r[None, :, None] * s_xa
                                          + offs_c[None, None, :] * s_xb, mask=m3, other=0.0)
                            vec = tl.load(y_row[:, :, None] + offs_r[None, :, None] * s_ya, mask=mr, other=0.0)
                        term += tl.sum(vec.to(ACC_DTYPE) * mat.to(ACC_DTYPE), 1)
                if HAS_SCALE:
                    term = term * tl.load(SCALE + t).to(ACC_DTYPE)
                acc += term
        if ACCUMULATE:
            tl.store(Z + row64 * s_zm + offs_c, tl.sum(acc, 0).to(Z.dtype.element_ty), mask=c_mask)
        else:
            z_ptrs = Z + offs_n0.to(tl.int64)[:, None] * s_zn + row64 * s_zm + offs_c[None, :]
            tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=(offs_n0[:, None] < N) & c_mask[None, :])


@autotune(_SCALE_CONFIGS, key=["C", "HAS_SCALE", "ROW_TERMS"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def sparse_scale_kernel(X, Z, SCALE, INDEX, SEG_OUT, N, ROW0, C, CZ, ROW_TERMS,
                        s_xn, s_xm, s_xc, s_zn, s_zm,
                        HAS_SCALE: tl.constexpr, ACC_DTYPE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    row = ROW0 + tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_n[:, None] < N) & (offs_c[None, :] < C)
    offs_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
    x_cols = X + offs_n[:, None] * s_xn + offs_c[None, :] * s_xc
    for t in range(tl.load(SEG_OUT + row), tl.load(SEG_OUT + row + 1)):  # row's terms, CSR order
        xv = tl.load(x_cols + tl.load(INDEX + t) * s_xm, mask=mask, other=0.0).to(ACC_DTYPE)
        if HAS_SCALE:
            xv = xv * tl.load(SCALE + t).to(ACC_DTYPE)
        acc += xv
    z_ptrs = Z + offs_n[:, None] * s_zn + row.to(tl.int64) * s_zm + offs_c[None, :]
    tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=mask)


_SCALE_ROWS_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_C",
            (4, 1, 16, 64), (8, 1, 32, 64), (4, 1, 32, 32),
            (8, 1, 16, 128), (4, 1, 8, 128), (8, 1, 64, 32),
            # wider row pieces, for wide channel counts (6272 bf16 channels: docs/measurements/sparse.md)
            (8, 1, 32, 128), (8, 1, 64, 64), (4, 1, 16, 256),
            # more bytes a thread (the configs above move 16-32): a gather's index chain needs more in flight per SM
            (4, 1, 64, 32), (4, 1, 128, 32), (8, 1, 256, 32),
            (4, 1, 64, 64),
            # whole rows of 512 channels (L 3 C 32, 8 lines of 64: this kernel, see LINES_OVER_ROWS) in a program: the
            # autotuner's pick there in bf16 (docs/measurements/sparse.md)
            (8, 1, 8, 512)),
    cfg(1, 1, BLOCK_M=2, BLOCK_C=2))


@autotune(_SCALE_ROWS_CONFIGS, key=["C", "HAS_SCALE"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def sparse_scale_rows_kernel(X, Z, SCALE, INDEX, SEG_OUT, M, C, CZ, s_xm, s_xc, s_zm,
                             HAS_SCALE: tl.constexpr, ACC_DTYPE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """sparse_scale_kernel for a batch of one with short rows (a segment sum's backward: one term a row): a tile
    of BLOCK_M output rows x BLOCK_C channels, each row's terms in CSR order up to the tile's longest row, so a
    program moves BLOCK_M rows where the batched kernel moves one row's slice. A 1-D grid (a 2-D one would cap the
    channel tiles at 65535), channel tiles fastest: the programs that write one row tile's pieces of a line then
    run together and L2 gets whole lines to write back. Row tiles fastest would write each row's 64-byte pieces
    (32 bf16 channels) far apart in time, and run slower (docs/measurements/sparse.md)."""
    tiles_c = tl.cdiv(C, BLOCK_C)
    offs_m = (tl.program_id(0) // tiles_c) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = (tl.program_id(0) % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_mask = offs_m < M
    c_mask = offs_c < C
    start = tl.load(SEG_OUT + offs_m, mask=m_mask, other=0)
    end = tl.load(SEG_OUT + offs_m + 1, mask=m_mask, other=0)
    # the 2-D mask from [BLOCK_M, BLOCK_C] bounds made before the loop (a mask built inside it from the 1-D ones:
    # triton 3.6 fails to compile, as in sparse_dense.gather_rows_kernel)
    zero = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.int64)
    start_2d = start[:, None] + zero
    end_2d = tl.where(c_mask[None, :], end[:, None] + zero, start_2d)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC_DTYPE)
    for j in range(0, tl.max(end - start, axis=0)):
        k = start + j
        live = k < end
        index = tl.load(INDEX + k, mask=live, other=0)
        xv = tl.load(X + index[:, None] * s_xm + offs_c[None, :] * s_xc, mask=start_2d + j < end_2d,
                     other=0.0).to(ACC_DTYPE)
        if HAS_SCALE:
            xv = xv * tl.load(SCALE + k, mask=live, other=0.0).to(ACC_DTYPE)[:, None]
        acc += xv
    z_ptrs = Z + offs_m.to(tl.int64)[:, None] * s_zm + offs_c[None, :]
    tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=m_mask[:, None] & c_mask[None, :])


# ---------------------------------------------------------------------------------------------- launchers


def _is_shared(t, rank):
    return t.dim() == rank + 1


def product_out_shape(op, x_shape, y_shape, out_size, out_accumulated):
    """Shape of z for x, y of these shapes: [N, out_size, Cz...], without N when both inputs are shared or
    ``out_accumulated`` (as ``sparse_product_split``)."""
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    cx, cy = tuple(x_shape[len(x_shape) - rank_x:]), tuple(y_shape[len(y_shape) - rank_y:])
    cz = {"mul": cx, "outer": cx + cy, "inner": (), "vecmat": cy[1:], "vecsca": cx, "scavec": cy,
          "mat_t_vec": cx[1:]}[op]
    batch = x_shape[0] if len(x_shape) == rank_x + 2 else (y_shape[0] if len(y_shape) == rank_y + 2 else None)
    if batch is None or out_accumulated:
        return (out_size, *cz)
    return (batch, out_size, *cz)


def scale_out_shape(x_shape, out_size):
    return (*x_shape[:-2], out_size, x_shape[-1])


def grid_channel_tiles(channels, block, what):
    """Channel tiles of a launch whose grid axis 2 holds them, refused past CUDA's 65535 with a clear error."""
    tiles = cdiv(channels, block)
    if tiles > MAX_GRID_YZ:
        raise ValueError(f"{what} need {tiles} channel tiles, over {MAX_GRID_YZ}")
    return tiles


def compact_channels(t, channel_rank):
    """``t``, or a compact copy where its channel offsets would pass 2**31 - 1 (a batch-innermost layout at large
    N): the kernels compute batch and row offsets in int64 (row indices are int64 loads) but channel offsets, and
    the output's, in int32."""
    return t.contiguous() if offset_span(t, channel_rank) > INT32_MAX else t


def _operand(t, rank):
    """(tensor, s_n, s_m, s_a, s_b): batch stride 0 for a shared operand; channel strides 0 where absent."""
    shared = _is_shared(t, rank)
    s_n = 0 if shared else t.stride(0)
    lead = 0 if shared else 1
    s_m = t.stride(lead)
    chans = [t.stride(lead + 1 + i) for i in range(rank)] + [0] * (2 - rank)
    return t, s_n, s_m, chans[0], chans[1]


def sparse_product_launch(op, x, y, info, out_accumulated=False):
    """z of ``sparse_product_split(op, x, y, info, out_accumulated)`` from the product kernel, in x's dtype.

    ``info`` needs scale, index1, index2, gather_index, out_size and row_bounds (a SparseProductInfo or any
    object with those). x and y have one dtype; any strides (no copy)."""
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    out_shape = product_out_shape(op, x.shape, y.shape, info.out_size, out_accumulated)
    z = new_output(out_shape, x.dtype, x.device)
    shared = _is_shared(x, rank_x) and _is_shared(y, rank_y)
    batch = 1 if shared else (y.shape[0] if _is_shared(x, rank_x) else x.shape[0])
    accumulate = bool(out_accumulated) and not shared
    cx = x.shape[x.dim() - rank_x:]
    cy = y.shape[y.dim() - rank_y:]
    cz = torch.Size(out_shape[len(out_shape) - CHANNEL_RANKS[op][2]:]).numel()  # output channels, flattened
    if z.numel() == 0:
        return z
    if batch == 0 or info.index1.numel() == 0:
        return z.zero_()
    c2 = cy[0] if op == "outer" else 1
    r = cx[0] if op in ("inner", "vecmat", "mat_t_vec") else 1  # the contracted channel dim
    # the shared matrix of the FC layer (and of its backward) through tl.dot; fp64 keeps the FMA route
    dot = ((op == "vecmat" and _is_shared(y, rank_y)) or (op == "mat_t_vec" and _is_shared(x, rank_x))) \
        and not shared and not accumulate and x.dtype != torch.float64
    if dot:  # the backward's transposed view of the weight: a compact copy (tiny: no batch dim), unit stride along
        # the output channels as in the forward; on the strided view fp32's FMA dot runs the FC layer's backward much
        # slower (docs/measurements/sparse.md; bf16 is unaffected)
        if op == "vecmat" and y.stride(-1) != 1:
            y = y.contiguous()
        elif op == "mat_t_vec" and x.stride(-1) != 1:
            x = x.contiguous()
    x, s_xn, s_xm, s_xa, s_xb = _operand(compact_channels(x, rank_x), rank_x)
    y, s_yn, s_ym, s_ya, s_yb = _operand(compact_channels(y, rank_y), rank_y)
    zv = z.reshape(1 if shared or accumulate else batch, info.out_size, cz)
    splits = batch_splits(batch, info.out_size, cz, multiprocessors(z.device), z.device.type) if accumulate else 1
    if splits > 1:  # partial sums per batch range, in the accumulator's precision, summed in split order below
        zv = torch.empty((splits, info.out_size, cz), dtype=accumulator_torch_dtype(x.dtype), device=z.device)
    bounds = info.row_bounds  # [2, out_size]: each output row's segment (start, end); (0, 0) if none
    scale = info.scale if info.scale is not None else bounds  # a dummy pointer when HAS_SCALE is False
    gather = info.gather_index if info.gather_index is not None else bounds
    all_rows = walks_all_rows(op, batch, accumulate, dot)
    chunk = info.out_size if all_rows else MAX_GRID_YZ  # ALL_ROWS: one launch, each program walks every row
    for row0 in range(0, info.out_size, chunk):
        rows = min(chunk, info.out_size - row0)

        def grid(meta, rows=rows):
            c_tiles = grid_channel_tiles(cz, meta["BLOCK_C"], f"sparse {op}: {cz} output channels")
            return (splits if accumulate else cdiv(batch, meta["BLOCK_N"]), 1 if all_rows else rows, c_tiles)

        with on_device(z):
            sparse_product_kernel[grid](
                x, y, zv, scale, info.index1, info.index2, gather, bounds,
                batch, info.out_size, row0, rows, len(str(batch)) - 1, cz, c2, r,
                s_xn, s_xm, s_xa, s_xb, s_yn, s_ym, s_ya, s_yb, zv.stride(0), zv.stride(1),
                OP=PRODUCT_OPS[op], HAS_SCALE=info.scale is not None, HAS_GATHER=info.gather_index is not None,
                ACCUMULATE=accumulate, DOT=dot, DOT_PRECISION=dot_precision(x.dtype),
                ACC_DTYPE=accumulator_dtype(x.dtype), ALL_ROWS=all_rows)
    if splits > 1:
        z.copy_(zv.sum(0).view(z.shape))  # torch's reduction over a dim: a fixed order, no atomics
    return z


# Programs per SM the batch splits aim at, the most splits, and the most bytes of partial sums.
PROGRAMS_PER_SM = 8
MAX_BATCH_SPLITS = 64
MAX_PARTIAL_BYTES = 1 << 28


def batch_splits(batch, rows, cz, sms, device_type="cuda", channels_per_program=64):
    """Batch ranges of an out_accumulated product: enough (rows x channel tiles x splits) programs for
    PROGRAMS_PER_SM per SM, each range at least 256 batch items (2 under the interpreter, so that tiny CPU-gate
    shapes split too), within MAX_BATCH_SPLITS and MAX_PARTIAL_BYTES (fp64 partials counted). A program covers
    ``channels_per_program`` output channels (64 here; a 64 x 64 tile in outer_sum.py)."""
    programs = rows * cdiv(cz, channels_per_program)
    wanted = cdiv(PROGRAMS_PER_SM * sms, programs)
    room = MAX_PARTIAL_BYTES // max(1, rows * cz * 8)
    least = 256 if device_type == "cuda" else 2
    return max(1, min(wanted, cdiv(batch, least), MAX_BATCH_SPLITS, room))


# Channel lines the scale kernel folds a thin batch's wide rows into (largest first).
CHANNEL_LINES = (64, 32, 16)


def channel_line(batch, channels, channel_stride):
    """The line width that folds the channels of a batch of one into the kernel's batch axis, or 0: SparseScale on
    [M, C] (the message-passing segment sum: C = (L+1)^2 channels, 2048 at L 3 C 128) leaves the [BLOCK_N, BLOCK_C]
    tile's batch rows empty and gives each program one BLOCK_C slice of one row; as [C / line, M, line] a program
    takes BLOCK_N consecutive lines of its row. Contiguous channels only, two lines at least."""
    if batch != 1 or channel_stride != 1:
        return 0
    return next((line for line in CHANNEL_LINES if channels % line == 0 and channels >= 2 * line), 0)


# A batch of one whose rows hold at most this many terms on average may take the row-tile kernel.
ROWS_TILE_TERMS = 2
# ... unless its channels fold into a power-of-two count of at least this many lines, which the batched kernel's
# line tiles fill without a masked lane: at 32 lines of 64 (2048 channels) the lines are slightly ahead of the row
# tiles, at 8 lines of 64 (512) the row tiles are well ahead; 16 lines (1024 channels), between the two, is not
# measured (docs/measurements/sparse.md).
LINES_OVER_ROWS = 16


def rows_tile(batch, channels, line, row_terms):
    """Whether SparseScale takes the row-tile kernel: a batch of one with short rows (the backward of a segment
    sum), unless its channels fold into a power-of-two count of LINES_OVER_ROWS lines or more: the row tiles are well
    ahead of the lines at 9-49 lines of 32 and even with them at 98 lines of 64 (docs/measurements/sparse.md)."""
    if batch != 1 or row_terms > ROWS_TILE_TERMS:
        return False
    lines = channels // line if line else 0
    return not (lines >= LINES_OVER_ROWS and next_pow2(lines) == lines)


def terms_per_row(terms, rows):
    """Terms an output row has on average, as a power of two up to 64: a tuning key of the scale kernel, whose best
    tile differs between a segment sum (many terms a row) and its backward's gather (one term a row)."""
    return min(64, next_pow2(max(1, cdiv(terms, max(1, rows)))))


def sparse_scale_launch(x, info):
    """y of ``sparse_scale_split(x, info)``: x [..., in_size, C] -> [..., out_size, C] in x's dtype."""
    z = new_output(scale_out_shape(x.shape, info.out_size), x.dtype, x.device)
    if z.numel() == 0:
        return z
    if info.index.numel() == 0:  # no terms (in_size 0 among them): every row is empty
        return z.zero_()
    # leading dims as one batch (a view if it can)
    xv = compact_channels(x, 1).reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    zv = z.view(-1, info.out_size, x.shape[-1])
    scale = info.scale if info.scale is not None else info.index  # dummy pointer when HAS_SCALE is False
    row_terms = terms_per_row(info.index.numel(), info.out_size)
    line = channel_line(xv.shape[0], xv.shape[-1], xv.stride(-1))
    if rows_tile(xv.shape[0], xv.shape[-1], line, row_terms):
        grid = (lambda meta: (cdiv(info.out_size, meta["BLOCK_M"]) * cdiv(xv.shape[-1], meta["BLOCK_C"]),))
        with on_device(z):
            sparse_scale_rows_kernel[grid](
                xv, zv, scale, info.index, info.seg_out, info.out_size, xv.shape[-1], xv.shape[-1],
                xv.stride(1), xv.stride(2), zv.stride(1),
                HAS_SCALE=info.scale is not None, ACC_DTYPE=accumulator_dtype(x.dtype))
        return z
    if line:  # [1, M, C] as [C / line, M, line]: the batch axis of the program's tile takes the lines of a row
        xv = xv[0].unflatten(-1, (-1, line)).transpose(0, 1)
        zv = zv[0].unflatten(-1, (-1, line)).transpose(0, 1)
    batch, channels = xv.shape[0], xv.shape[-1]
    for row0 in range(0, info.out_size, MAX_GRID_YZ):
        rows = min(MAX_GRID_YZ, info.out_size - row0)

        def grid(meta, rows=rows):
            c_tiles = grid_channel_tiles(channels, meta["BLOCK_C"], f"sparse scale: {channels} channels")
            return (cdiv(batch, meta["BLOCK_N"]), rows, c_tiles)

        with on_device(z):
            sparse_scale_kernel[grid](
                xv, zv, scale, info.index, info.seg_out, batch, row0, channels, channels, row_terms,
                xv.stride(0), xv.stride(1), xv.stride(2), zv.stride(0), zv.stride(1),
                HAS_SCALE=info.scale is not None, ACC_DTYPE=accumulator_dtype(x.dtype))
    return z
