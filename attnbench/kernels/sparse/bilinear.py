"""mul as dense bilinear forms on the matrix units: z[n, o, c] = x[n, :, c]^T A_o y[n, :, c].

SparseMul (the channel-wise tensor product, e3nn's "uvu" paths) sums, for every sample n and channel c,

    z[n, o, c] = sum_{t in o's segment} s[t] x[n, i1[t], c] y[n, i2[t], c]

and the segment kernel does one multiply-add per term with two gathered loads and an index load: at L 3-4 it
issues ~T (P1 + P2) / P_out loads for the minimum bytes' one, and runs far below the copy bandwidth
(docs/measurements/sparse.md, tenth session). Written with the terms' dense coefficient tensor
A[o, i, j] (the info's "gram" table stored dense: ``matrix[i * size2 + j, o]``),

    V_i = A[:, i, :] @ Y        [P_out, P2] @ [P2, columns]     (a tensor-core product)
    z  += x_i * V_i             x_i = x[n, i, c] along the columns, i = 0 .. P1 - 1

where a column is one (sample, channel) pair: a program holds Y for BLOCK_N samples x BLOCK_C channels (in
registers, or in shared memory as the transposed products' operand), walks the rows i of x once, and writes its
[P_out, columns] tile of z once. Every input byte is read once (once per 64 output rows past 64; A from L2: P1 P2
P_out coefficients a program), at the price of P_out P1 P2 multiply-adds a column on the matrix units (4096 at L 3,
against 611 terms) and P_out P1 on the FMA units. mul is closed under differentiation (gx is a mul of (gz, y), gy
of (gz, x)), so the derivatives take this route too.
16-bit inputs run the products transposed (Y^T A_i^T: the columns as the dots' M, so that Hopper's warpgroup
products apply whatever P_out, with Y in shared memory), fp32 and fp64 as written (ROWS_M_DTYPES says why).

Precision: fp32 inputs run as three TF32 products (Triton's tf32x3: hi * hi + hi * lo + lo * hi); each misses at
most about 5 x 2**-22 of itself (the low parts cut to TF32 by the tensor cores, the dropped lo * lo), 20 fp32 unit
roundoffs, which tests/sparse/test_gpu_products.py's fp32 bound counts. (Splitting A on the host and the held tile once a
program into TF32 parts rounded to nearest is slower than tf32x3: docs/measurements/sparse.md.) 16-bit inputs meet A
as two 16-bit halves (hi + lo, split once per table on the host) on the tensor cores, as small_matmul does, so that
the coefficients are not rounded to 16 bits (fp16's scaled by a power of two into its range:
kernels/split_matmul.split_fp32, the result scaled back exactly); fp64 (the gradcheck path) in fp64.
Accumulation in fp32 (fp64 for fp64). No atomics, one summation order: deterministic.

Either operand may be shared by every sample (no batch dim). The operand with fewer rows is held (Y above):
at most MAX_HELD rows, the route's limit; A's rows P_out span several programs past BLOCK_O's 64.

Non-finite inputs: every x row and held y row meets its whole coefficient block, zeros included, so an inf or NaN in
one entry (n, i, c) makes NaN of the outputs of its column (n, c) that the block reaches (0 x inf), where the segment
kernel keeps it to the outputs whose terms read it; as on the dense route (dense.py), a non-finite entry an
output reads never yields a finite value.
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import INT32_MAX
from ..outputs import new_output
from ..precision import accumulator_dtype
from .segment import compact_channels, grid_channel_tiles
from .split_matmul import split_fp32
from ..tuning import autotune, cdiv, cfg, config_list, next_pow2, tile_pruner

__all__ = ["MAX_HELD", "bilinear_launch", "bilinear_kernel", "coefficient_splits"]

# rows of the held operand (the dot's inner dim, one tile): 49 at L 6
MAX_HELD = 64
# A's row tile (P_out): up to 64 rows a program, more rows take more programs
MAX_BLOCK_O = 64

# (warps, stages, samples, channels) a program; columns = samples x channels. Chosen from a wider candidate set
# (a former study, now `attnbench tune --kernel bilinear`: CG L 3, 4, 6, C 32 and 128, N 1e5, fp32 and bf16; docs/measurements/sparse.md):
# each is the fastest at some of those shapes or close to it, but the 16-channel tile (for channel counts of 16, not
# measured). Both warp counts stay, 8 warps alone being slow at L 6 and 4 warps alone at L 4, and deeper pipelines
# serve L 3 bf16 and L 4 fp32. Default (ATTNBENCH_AUTOTUNE=0) first: 128 columns at 4 warps, the fastest at L 6 and
# never far behind elsewhere.
_SHAPES = [(4, 1, 4, 32), (4, 3, 4, 32), (8, 3, 8, 32), (8, 1, 8, 32), (8, 2, 8, 32), (4, 1, 8, 16), (8, 1, 4, 64)]
_CONFIGS = config_list(
    [cfg(w, st, BLOCK_N=n, BLOCK_C=c) for w, st, n, c in _SHAPES],
    cfg(1, 1, BLOCK_N=2, BLOCK_C=16),  # the interpreter: tiny batches still span several programs
)
# channel tiles no wider than the channels' power of two (at least 16)
_prune = tile_pruner({"BLOCK_C": "C"}, 16)


@triton.jit
def _rows_as_m(LOOPED, HELD, A_HI, A_LO, SCALE, Z, n64, c, live, offs_o, P_LOOP, P_HELD, P_OUT,
               s_ln, s_lm, s_lc, s_hn, s_hm, s_hc, s_zn, s_zm, s_zc, s_ai, s_aj,
               SPLIT_A: tl.constexpr, SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
               BLOCK_O: tl.constexpr, BLOCK_J: tl.constexpr, COLS: tl.constexpr):
    """The tile with A's rows as the dots' M: acc [BLOCK_O, COLS] += x_i * (A_i [BLOCK_O, P_held] @ held)."""
    offs_j = tl.arange(0, BLOCK_J)
    # row offsets in int64 (a [M, N, C] tensor seen as [N, M, C] has a row stride of N C); channel offsets in int32
    # (compact_channels copies where they would not fit)
    held = tl.load(HELD + n64[None, :] * s_hn + offs_j.to(tl.int64)[:, None] * s_hm + c[None, :] * s_hc,
                   mask=(offs_j[:, None] < P_HELD) & live[None, :], other=0.0)
    a_offsets = offs_j[None, :] * s_aj + offs_o[:, None]
    a_mask = (offs_o[:, None] < P_OUT) & (offs_j[None, :] < P_HELD)
    looped = LOOPED + n64 * s_ln + c * s_lc
    acc = tl.zeros([BLOCK_O, COLS], dtype=ACC_DTYPE)
    for i in range(0, P_LOOP):
        a_hi = tl.load(A_HI + a_offsets + i * s_ai, mask=a_mask, other=0.0)
        if SPLIT_A:
            a_lo = tl.load(A_LO + a_offsets + i * s_ai, mask=a_mask, other=0.0)
            v = tl.dot(a_hi, held, out_dtype=ACC_DTYPE)
            v = tl.dot(a_lo, held, v, out_dtype=ACC_DTYPE)
        else:
            v = tl.dot(a_hi, held, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        row = i + tl.zeros([], dtype=tl.int64)  # int64 row offset (the interpreter's loop index is a Python int)
        x_i = tl.load(looped + row * s_lm, mask=live, other=0.0).to(ACC_DTYPE)
        acc += x_i[None, :] * v
    if SCALED:  # A = SCALE (A_HI + A_LO), a power of two: exact
        acc = acc * tl.load(SCALE)
    out = Z + n64[None, :] * s_zn + offs_o[:, None] * s_zm + c[None, :] * s_zc
    tl.store(out, acc.to(Z.dtype.element_ty), mask=(offs_o[:, None] < P_OUT) & live[None, :])


@triton.jit
def _columns_as_m(LOOPED, HELD, A_HI, A_LO, SCALE, Z, n64, c, live, offs_o, P_LOOP, P_HELD, P_OUT,
                  s_ln, s_lm, s_lc, s_hn, s_hm, s_hc, s_zn, s_zm, s_zc, s_ai, s_aj,
                  SPLIT_A: tl.constexpr, SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                  BLOCK_O: tl.constexpr, BLOCK_J: tl.constexpr, COLS: tl.constexpr):
    """_rows_as_m transposed, the columns as the dots' M: acc [COLS, BLOCK_O] += x_i * (held^T @ A_i^T)."""
    offs_j = tl.arange(0, BLOCK_J)
    held = tl.load(HELD + n64[:, None] * s_hn + offs_j.to(tl.int64)[None, :] * s_hm + c[:, None] * s_hc,
                   mask=live[:, None] & (offs_j[None, :] < P_HELD), other=0.0)
    a_offsets = offs_j[:, None] * s_aj + offs_o[None, :]
    a_mask = (offs_j[:, None] < P_HELD) & (offs_o[None, :] < P_OUT)
    looped = LOOPED + n64 * s_ln + c * s_lc
    acc = tl.zeros([COLS, BLOCK_O], dtype=ACC_DTYPE)
    for i in range(0, P_LOOP):
        a_hi = tl.load(A_HI + a_offsets + i * s_ai, mask=a_mask, other=0.0)
        if SPLIT_A:
            a_lo = tl.load(A_LO + a_offsets + i * s_ai, mask=a_mask, other=0.0)
            v = tl.dot(held, a_hi, out_dtype=ACC_DTYPE)
            v = tl.dot(held, a_lo, v, out_dtype=ACC_DTYPE)
        else:
            v = tl.dot(held, a_hi, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        row = i + tl.zeros([], dtype=tl.int64)
        x_i = tl.load(looped + row * s_lm, mask=live, other=0.0).to(ACC_DTYPE)
        acc += x_i[:, None] * v
    if SCALED:
        acc = acc * tl.load(SCALE)
    out = Z + n64[:, None] * s_zn + offs_o[None, :] * s_zm + c[:, None] * s_zc
    tl.store(out, acc.to(Z.dtype.element_ty), mask=live[:, None] & (offs_o[None, :] < P_OUT))


@autotune(_CONFIGS, key=["P_LOOP", "P_HELD", "P_OUT", "C", "BATCH_DECADE"],
          prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["BATCH_DECADE"])
def bilinear_kernel(LOOPED, HELD, A_HI, A_LO, SCALE, Z, N, C, P_LOOP, P_HELD, P_OUT, BATCH_DECADE,
                    s_ln, s_lm, s_lc, s_hn, s_hm, s_hc, s_zn, s_zm, s_zc, s_ai, s_aj,
                    SPLIT_A: tl.constexpr, SCALED: tl.constexpr, COLUMNS_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    ACC_DTYPE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """Z[n, o, c] = sum_i LOOPED[n, i, c] sum_j A[i * s_ai + j * s_aj + o] HELD[n, j, c] for this program's
    BLOCK_N samples x BLOCK_C channels (the columns) and BLOCK_O rows o. SPLIT_A: A = A_HI + A_LO, two halves in
    HELD's 16-bit dtype (split on the host), two dots, times SCALE[0] where SCALED (fp16); else A = A_HI in HELD's
    dtype, one dot of DOT_PRECISION. COLUMNS_M: the columns are the dots' M ([COLS, P_held] @ [P_held, P_out]), so
    that M is 128-256 whatever P_out and Hopper's warpgroup products apply (they need M >= 64; P_out is 16 at L 3);
    else A's rows are M ([P_out, P_held] @ [P_held, COLS]), which tf32x3 runs faster (ROWS_M_DTYPES)."""
    COLS: tl.constexpr = BLOCK_N * BLOCK_C
    cols = tl.arange(0, COLS)
    n = tl.program_id(0) * BLOCK_N + cols // BLOCK_C
    c = tl.program_id(1) * BLOCK_C + cols % BLOCK_C
    live = (n < N) & (c < C)
    offs_o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    if COLUMNS_M:
        _columns_as_m(LOOPED, HELD, A_HI, A_LO, SCALE, Z, n.to(tl.int64), c, live, offs_o, P_LOOP, P_HELD, P_OUT,
                      s_ln, s_lm, s_lc, s_hn, s_hm, s_hc, s_zn, s_zm, s_zc, s_ai, s_aj,
                      SPLIT_A, SCALED, DOT_PRECISION, ACC_DTYPE, BLOCK_O, BLOCK_J, COLS)
    else:
        _rows_as_m(LOOPED, HELD, A_HI, A_LO, SCALE, Z, n.to(tl.int64), c, live, offs_o, P_LOOP, P_HELD, P_OUT,
                   s_ln, s_lm, s_lc, s_hn, s_hm, s_hc, s_zn, s_zm, s_zc, s_ai, s_aj,
                   SPLIT_A, SCALED, DOT_PRECISION, ACC_DTYPE, BLOCK_O, BLOCK_J, COLS)


# How much of each coefficient its two 16-bit halves may miss: 2**-16 (bf16's two 8-bit mantissas), which fp16's
# halves, scaled into fp16's range by a power of two (split_fp32), are sure to meet where the coefficients span at
# most 2**22 (past that a low half may fall below fp16's normal range: the check per coefficient decides).
SPLIT_ACCURACY = 2.0 ** -16


def coefficient_splits(matrix32):
    """{dtype: (hi, lo, scale)} for bf16 and fp16 (``split_matmul.split_fp32``: matrix32 = scale (hi + lo); scale None
    for bf16, a one-element power of two for fp16) where the split holds every coefficient to SPLIT_ACCURACY (a dtype
    left out, as for non-finite coefficients, keeps mul off the route: no silent loss of precision)."""
    splits = {}
    exact = matrix32.double()
    for dtype in (torch.bfloat16, torch.float16):
        hi, lo, scale = split_fp32(matrix32, dtype)
        error = ((hi.double() + lo.double()) * (1.0 if scale is None else scale.double()) - exact).abs()
        if bool((error <= SPLIT_ACCURACY * exact.abs()).all()):
            splits[dtype] = (hi, lo, scale)
    return splits


# The dtypes whose dots take A's rows as M; the others take the columns as M. With the columns as M, bf16 gains at
# L 4-6 and about breaks even at L 2-3, while fp32 loses at L 3 and L 6 on tf32x3, on TF32 parts split by hand and
# through tl.trans in one body alike (docs/measurements/sparse.md). fp64 (the interpreter's gradcheck) keeps the
# kernel it is checked on.
ROWS_M_DTYPES = (torch.float32, torch.float64)


def bilinear_dot_precision(dtype: torch.dtype) -> str:
    """fp32: three TF32 products (tf32x3: see the module); fp64: fp64."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


def _strides(t):
    """(batch size or None when shared, batch stride, row stride, channel stride) of [N, M, C] or shared [M, C]."""
    if t.dim() == 2:
        return None, 0, t.stride(0), t.stride(1)
    return t.shape[0], t.stride(0), t.stride(1), t.stride(2)


def bilinear_launch(x, y, matrix, out_size, coefficients=None):
    """z of mul (not accumulated over the batch) from the dense coefficients ``matrix`` [size1 * size2, out_size]
    (row i1 * size2 + i2; the info's gram table: fp64 for fp64 inputs, else fp32), in x's dtype; ``coefficients``:
    16-bit inputs' (hi, lo, scale) of ``coefficient_splits`` where the caller keeps them (else split here). x:
    [N, size1, C] or shared [size1, C]; y the same with size2; one of them at most MAX_HELD rows. Output
    [N, out_size, C], or [out_size, C] when both are shared."""
    if x.dim() not in (2, 3) or y.dim() not in (2, 3) or x.shape[-1] != y.shape[-1]:
        raise ValueError(f"sparse mul (bilinear): x {tuple(x.shape)} and y {tuple(y.shape)} are not [N, M, C] or "
                         f"shared [M, C] with one C")
    size1, size2 = x.shape[-2], y.shape[-2]
    if matrix.shape != (size1 * size2, out_size):
        raise ValueError(f"sparse mul (bilinear): coefficients {tuple(matrix.shape)}, expected "
                         f"({size1 * size2}, {out_size})")
    if min(size1, size2) > MAX_HELD:
        raise ValueError(f"sparse mul (bilinear): operands of {size1} and {size2} rows; one must have at most "
                         f"{MAX_HELD}")
    if matrix.numel() > INT32_MAX:
        raise ValueError(f"sparse mul (bilinear): {matrix.numel()} coefficients, over 2**31 - 1")
    wanted = torch.float64 if x.dtype == torch.float64 else torch.float32
    if matrix.dtype != wanted or matrix.device != x.device or y.device != x.device or y.dtype != x.dtype:
        raise ValueError(f"sparse mul (bilinear): x {x.dtype} on {x.device}, y {y.dtype} on {y.device}, coefficients "
                         f"{matrix.dtype} on {matrix.device}; wanted one device, one input dtype and {wanted} "
                         f"coefficients")
    x, y = compact_channels(x, 1), compact_channels(y, 1)
    (n_x, s_xn, s_xm, s_xc), (n_y, s_yn, s_ym, s_yc) = _strides(x), _strides(y)
    if None not in (n_x, n_y) and n_x != n_y:
        raise ValueError(f"sparse mul (bilinear): batches {n_x} and {n_y} differ")
    batch = n_x if n_x is not None else n_y
    channels = x.shape[-1]
    z = new_output((out_size, channels) if batch is None else (batch, out_size, channels), x.dtype, x.device)
    if z.numel() == 0:
        return z
    if size1 == 0 or size2 == 0:
        return z.zero_()
    zv = z.unsqueeze(0) if batch is None else z
    # hold the operand with fewer rows; A's index for (looped row i, held row j) follows
    if size2 <= size1:
        looped, held = (x, s_xn, s_xm, s_xc), (y, s_yn, s_ym, s_yc)
        s_ai, s_aj = size2 * out_size, out_size
    else:
        looped, held = (y, s_yn, s_ym, s_yc), (x, s_xn, s_xm, s_xc)
        s_ai, s_aj = out_size, size2 * out_size
    p_loop, p_held = looped[0].shape[-2], held[0].shape[-2]
    n = batch or 1
    block_o = min(MAX_BLOCK_O, max(16, next_pow2(out_size)))
    if x.dtype in (torch.float16, torch.bfloat16):
        if coefficients is None:  # a direct call: the same precision check as the route's
            coefficients = coefficient_splits(matrix).get(x.dtype)
            if coefficients is None:
                raise ValueError(f"sparse mul (bilinear): {x.dtype} halves of these coefficients would miss more than "
                                 f"2**-16 of one (or one is not finite); use the segment kernel")
        a_hi, a_lo, scale = coefficients
    else:
        a_hi = a_lo = matrix
        scale = None
    def grid(meta):
        tiles = grid_channel_tiles(channels, meta["BLOCK_C"], f"sparse mul (bilinear): {channels} channels")
        return cdiv(n, meta["BLOCK_N"]), tiles, cdiv(out_size, block_o)

    with on_device(z):
        bilinear_kernel[grid](
            looped[0], held[0], a_hi, a_lo, a_hi if scale is None else scale, zv, n, channels, p_loop, p_held,
            out_size, len(str(n)) - 1, *looped[1:], *held[1:], zv.stride(0), zv.stride(1), zv.stride(2), s_ai, s_aj,
            SPLIT_A=x.dtype in (torch.float16, torch.bfloat16), SCALED=scale is not None,
            COLUMNS_M=x.dtype not in ROWS_M_DTYPES, DOT_PRECISION=bilinear_dot_precision(x.dtype),
            ACC_DTYPE=accumulator_dtype(x.dtype), BLOCK_O=block_o, BLOCK_J=max(16, next_pow2(p_held)))
    return z
