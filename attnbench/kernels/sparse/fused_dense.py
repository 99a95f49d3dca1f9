"""The dense route's two steps in one program where the sparse sizes are small: vecsca, scavec and inner.

dense.py runs the route as two launches with the per-sample matrices in memory between them: M for vecsca
and scavec (M[n, o, i] = sum s S[n, k], then z[n] = M[n] @ V[n]), the Gram matrices for inner (G[n] = x[n] @ y[n]^T,
then z[n, o] = sum s G[n, i1, i2]). M is fp32 and as wide as the output's rows times the vectors' rows: at
Clebsch-Gordan L 3 and N 1e6 it is 1 GB written and read again, as much as x, y and z of a bf16 C 32 forward
together (the route's forward runs far below copy bandwidth there: docs/measurements/sparse.md).
Where every sparse size pads to at most 16 rows (L <= 3: ``FUSED_ROWS``), a program keeps BLOCK_N samples' M (or G) in
registers instead:

    vecsca, scavec   M = S @ W          [BLOCK_N, MS] @ [MS, OUT x MV]   (W: the pairs table's matrix form)
                     z[n] = M[n] @ V[n]  a 3-D dot over the samples, one channel tile at a time
    inner            G[n] = X[n] @ Y[n]^T, a 3-D dot accumulated over the channel tiles
                     z = G @ W          [BLOCK_N, P1 x P2] @ [P1 x P2, OUT]   (W: the gram table's matrix form)

so every operand is read once and z written once. Precision as the two-launch route: M and G in fp32 (fp64 for
fp64), their products with W in full fp32 (no TF32), 16-bit products on the tensor cores with fp32 accumulation and
M entering as hi + lo in the vectors' dtype so that it is not rounded to 16 bits.
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import sample_int32, sample_strides
from ..outputs import new_output
from ..precision import accumulator_dtype, dot_precision
from ..tuning import autotune, cdiv, cfg, config_list, next_pow2, registers_per_thread, tile_pruner

__all__ = ["FUSED_ROWS", "fused_dense_launch", "fused_dense_fits", "scaled_rows_kernel", "gram_rows_kernel"]

# Sparse sizes (after padding to a power of two, 16 at least for tl.dot) a program holds whole: M is
# [BLOCK_N, 16 x 16] fp32 at L 3, 32 registers a thread at 16 samples and 4 warps. L 4's 32 x 32 (8 warps for 64
# registers) is no steady gain over the two launches in bf16 (docs/measurements/sparse.md).
FUSED_ROWS = {"max": 16, "inner_fill": 0.5}
# Against the two launches (N 1e6, CG L 2-3, C 32 and 128; docs/measurements/sparse.md): bf16 vecsca and scavec gain in
# every mode, and inner at L 3; inner's forward at L 2 loses, its 9 x 9 Gram grid filling 32% of the 16 x 16 tile (hence
# "inner_fill"). fp32 is not measured across the board with the Gram kernel's full config list (the one fp32 case that
# is gains): fp32 keeps the two launches until it is. fp64 takes the fused kernels (exact: the gradcheck path; not
# timed); fp16 runs bf16's code.
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float64)
# fp32 registers a thread for the program's M (or G): configs over this are dropped (the rest of the state spills)
MATRIX_REGISTERS = 64

# (warps, stages, samples a program, channel tile). The samples are the first dot's M dim: 16 at least on a GPU.
_SHAPES = [(4, 1, 16, 32), (4, 2, 16, 64), (4, 1, 32, 32), (8, 2, 32, 32), (8, 1, 32, 64), (4, 1, 16, 16),
           (8, 1, 16, 32)]
_CONFIGS = config_list(
    [cfg(w, st, BLOCK_N=n, BLOCK_C=c) for w, st, n, c in _SHAPES],
    cfg(1, 1, BLOCK_N=2, BLOCK_C=2),  # the interpreter: tiny batches and channels still span several steps
)


def _matrix_fits(config, constexprs):
    """The program's matrix (M: BLOCK_O x BLOCK_V a sample; G: BLOCK_1 x BLOCK_2) at most MATRIX_REGISTERS a thread."""
    if "BLOCK_V" in constexprs:
        grid = constexprs["BLOCK_O"] * constexprs["BLOCK_V"]
    else:
        grid = constexprs["BLOCK_1"] * constexprs["BLOCK_2"]
    return registers_per_thread(config.kwargs["BLOCK_N"] * grid, config.num_warps) <= MATRIX_REGISTERS


# channel tiles no wider than the channels (16 at least: tl.dot's smallest dim), and the matrix within its registers
_prune = tile_pruner({"BLOCK_C": "C"}, 16, fits=_matrix_fits)


@autotune(_CONFIGS, key=["MS", "MV", "OUT", "C"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def scaled_rows_kernel(S, V, W, Z, N, MS, MV, OUT, C, s_sn, s_sm, s_vn, s_vm, s_vc, s_zn, s_zo, s_zc,
                       SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_O: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Z[n] = M[n] @ V[n] with M[n, o, i] = sum_k W[k, o MV + i] S[n, k], for BLOCK_N samples (vecsca: S = y,
    V = x; scavec: S = x, V = y). SPLIT: V is 16-bit and M enters its dots as hi + lo in V's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_n.to(tl.int64)
    n_mask = offs_n < N
    offs_s = tl.arange(0, BLOCK_S)
    s = tl.load(S + n[:, None] * s_sn + offs_s[None, :] * s_sm, mask=n_mask[:, None] & (offs_s < MS)[None, :],
                other=0.0)
    # W's columns laid out as the padded [BLOCK_O, BLOCK_V] grid of M, so that M reshapes to one matrix a sample
    cols = tl.arange(0, BLOCK_O * BLOCK_V)
    col_o, col_i = cols // BLOCK_V, cols % BLOCK_V
    w = tl.load(W + offs_s[:, None] * (OUT * MV) + (col_o * MV + col_i)[None, :],
                mask=(offs_s < MS)[:, None] & ((col_o < OUT) & (col_i < MV))[None, :], other=0.0)
    m = tl.dot(s.to(ACC_DTYPE), w.to(ACC_DTYPE), input_precision="ieee", out_dtype=ACC_DTYPE)
    m = tl.reshape(m, (BLOCK_N, BLOCK_O, BLOCK_V))
    if SPLIT:
        hi = m.to(V.dtype.element_ty)
        lo = (m - hi.to(ACC_DTYPE)).to(V.dtype.element_ty)
    offs_v = tl.arange(0, BLOCK_V)
    offs_o = tl.arange(0, BLOCK_O)
    offs_c = tl.arange(0, BLOCK_C)
    v_rows = V + n[:, None, None] * s_vn + offs_v[None, :, None] * s_vm
    v_mask = n_mask[:, None, None] & (offs_v < MV)[None, :, None]
    z_rows = Z + n[:, None, None] * s_zn + offs_o[None, :, None] * s_zo
    z_mask = n_mask[:, None, None] & (offs_o < OUT)[None, :, None]
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        v = tl.load(v_rows + c[None, None, :] * s_vc, mask=v_mask & (c < C)[None, None, :], other=0.0)
        if SPLIT:
            acc = tl.dot(hi, v, out_dtype=ACC_DTYPE)
            acc = tl.dot(lo, v, acc, out_dtype=ACC_DTYPE)
        else:
            acc = tl.dot(m, v.to(ACC_DTYPE), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        tl.store(z_rows + c[None, None, :] * s_zc, acc.to(Z.dtype.element_ty), mask=z_mask & (c < C)[None, None, :])


@autotune(_CONFIGS, key=["P1", "P2", "OUT", "C"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def gram_rows_kernel(X, Y, W, Z, N, P1, P2, OUT, C, s_xn, s_xp, s_xc, s_yn, s_yq, s_yc, s_zn, s_zo,
                     DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr, BLOCK_1: tl.constexpr,
                     BLOCK_2: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Z[n, o] = sum_{i1, i2} W[i1 P2 + i2, o] G[n, i1, i2], G[n] = X[n] @ Y[n]^T, for BLOCK_N samples."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_n.to(tl.int64)
    n_mask = offs_n < N
    offs_1 = tl.arange(0, BLOCK_1)
    offs_2 = tl.arange(0, BLOCK_2)
    offs_c = tl.arange(0, BLOCK_C)
    x_rows = X + n[:, None, None] * s_xn + offs_1[None, :, None] * s_xp
    y_cols = Y + n[:, None, None] * s_yn + offs_2[None, None, :] * s_yq
    x_mask = n_mask[:, None, None] & (offs_1 < P1)[None, :, None]
    y_mask = n_mask[:, None, None] & (offs_2 < P2)[None, None, :]
    gram = tl.zeros([BLOCK_N, BLOCK_1, BLOCK_2], dtype=ACC_DTYPE)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        x = tl.load(x_rows + c[None, None, :] * s_xc, mask=x_mask & (c < C)[None, None, :], other=0.0)
        y = tl.load(y_cols + c[None, :, None] * s_yc, mask=y_mask & (c < C)[None, :, None], other=0.0)
        gram = tl.dot(x, y, gram, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    gram = tl.reshape(gram, (BLOCK_N, BLOCK_1 * BLOCK_2))
    # W's rows laid out as the padded [BLOCK_1, BLOCK_2] grid of G
    rows = tl.arange(0, BLOCK_1 * BLOCK_2)
    row_1, row_2 = rows // BLOCK_2, rows % BLOCK_2
    offs_o = tl.arange(0, BLOCK_O)
    w = tl.load(W + (row_1 * P2 + row_2)[:, None] * OUT + offs_o[None, :],
                mask=((row_1 < P1) & (row_2 < P2))[:, None] & (offs_o < OUT)[None, :], other=0.0)
    z = tl.dot(gram, w.to(ACC_DTYPE), input_precision="ieee", out_dtype=ACC_DTYPE)
    tl.store(Z + n[:, None] * s_zn + offs_o[None, :] * s_zo, z.to(Z.dtype.element_ty),
             mask=n_mask[:, None] & (offs_o < OUT)[None, :])


def _padded(size):
    return max(16, next_pow2(size))


def fused_dense_fits(op, x, y, matrix, out_size, x_shared, y_shared):
    """Whether the fused kernels take these operands: a matrix form, at least one batched operand, every sparse size
    (x's rows, y's rows, the output's) padding to at most ``FUSED_ROWS["max"]``, a dtype of FUSED_DTYPES, and for
    inner a Gram grid filling at least ``FUSED_ROWS["inner_fill"]`` of its padded tile."""
    sizes = (x.shape[0 if x_shared else 1], y.shape[0 if y_shared else 1], out_size)
    if matrix is None or (x_shared and y_shared) or x.dtype not in FUSED_DTYPES or \
            max(map(_padded, sizes)) > FUSED_ROWS["max"]:
        return False
    return op != "inner" or sizes[0] * sizes[1] >= FUSED_ROWS["inner_fill"] * _padded(sizes[0]) * _padded(sizes[1])


def fused_dense_launch(op, x, y, matrix, out_size, x_shared, y_shared):
    """z of vecsca, scavec or inner (not accumulated over the batch) in one launch, in x's dtype; the caller
    checked ``fused_dense_fits``. ``matrix``: the table's matrix form (its fp32 copy for fp32 and 16-bit inputs)."""
    x, y = sample_int32(x, x_shared), sample_int32(y, y_shared)
    batch = y.shape[0] if x_shared else x.shape[0]
    acc = accumulator_dtype(x.dtype)
    if op == "inner":  # x [N, P1, C], y [N, P2, C] -> z [N, OUT]
        p1, p2, channels = x.shape[-2], y.shape[-2], x.shape[-1]
        out = new_output((batch, out_size), x.dtype, x.device)
        if out.numel() == 0:
            return out
        with on_device(out):
            gram_rows_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]),)](
                x, y, matrix, out, batch, p1, p2, out_size, channels, *sample_strides(x, x_shared),
                *sample_strides(y, y_shared), *out.stride(), DOT_PRECISION=dot_precision(x.dtype), ACC_DTYPE=acc,
                BLOCK_1=_padded(p1), BLOCK_2=_padded(p2), BLOCK_O=_padded(out_size))
        return out
    # vecsca: M from y's scalars times x's vectors; scavec: from x's scalars times y's vectors
    scalars, vectors, s_shared, v_shared = (y, x, y_shared, x_shared) if op == "vecsca" else (x, y, x_shared, y_shared)
    ms, (mv, channels) = scalars.shape[-1], vectors.shape[-2:]
    out = new_output((batch, out_size, channels), x.dtype, x.device)
    if out.numel() == 0:
        return out
    with on_device(out):
        scaled_rows_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]),)](
            scalars, vectors, matrix, out, batch, ms, mv, out_size, channels, *sample_strides(scalars, s_shared),
            *sample_strides(vectors, v_shared), *out.stride(), SPLIT=x.dtype in (torch.float16, torch.bfloat16),
            DOT_PRECISION=dot_precision(x.dtype), ACC_DTYPE=acc, BLOCK_S=_padded(ms), BLOCK_V=_padded(mv),
            BLOCK_O=_padded(out_size))
    return out
