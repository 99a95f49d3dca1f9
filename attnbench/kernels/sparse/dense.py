"""The dense route of the sparse products whose channel dims do not meet in every term: vecsca, scavec, inner.

In vecsca, z[n, o, c] = sum_t s[t] x[n, i1[t], c] y[n, i2[t]], the sum over i2 does not depend on the channel c.
Grouping the terms by (o, i1) first,

    M[n, o, i1] = sum_{t: (o, i1)} s[t] y[n, i2[t]]        (once per sample: no channel)
    z[n]        = M[n] @ x[n]                              (a batched matrix product: small_matmul.py)

does the i2 sum once per sample instead of once per channel: at L 6 (Clebsch-Gordan terms of 0..6 x 0..6 -> 0..6) the
per-channel work falls from 11896 multiply-adds to 49 x 49 = 2401, on matrix units instead of one gathered x row per
term from L2 (the segment kernel's bound: docs/measurements/sparse.md). scavec is the same with x and y swapped, and
inner, z[n, o] = sum_t s[t] <x[n, i1[t]], y[n, i2[t]]>, is the Gram matrix G[n] = x[n] @ y[n]^T followed by the same
per-sample gather: z[n, o] = sum_t s[t] G[n, i1[t], i2[t]]. The three are closed under differentiation (vecsca's gx
is a scavec, its gy an inner), so forward, backward and double backward all take this route.

The per-sample sums (a sparse matrix applied to every sample's row of scalars, the info's ``dense_rows`` tables) are
one GEMM on the table's dense matrix form where it has one (cuBLAS, TF32 off: the Clebsch-Gordan tables hold ~10
entries a term, and the GEMM's zeros add nothing), else ``gather_rows_kernel`` (CSR, every row looped to the longest
one's length, a gathered load a term, fixed order: deterministic). At L 6 the kernel is over half of the bf16
forward, and the GEMM makes forward and backward faster (docs/measurements/sparse.md). The matrix products
(``small_matmul``: one launch, each sample's product in registers) run in fp32 for fp32 inputs (never TF32), fp64 for
fp64, and for 16-bit inputs on the tensor cores with fp32 accumulation, M kept in fp32 and split into two
half-precision parts (hi + lo) so that it is not rounded to 16 bits. The fp32 and fp64 Gram matrices (a deep channel
inner dim) go to cuBLAS instead, but for the fp32 ones of L 2 and 3 (``gram_stack_kernel``: a batch of samples in one
3-D dot) and small, shallow fp64 ones (small_matmul): ``_gram``, measured faster there.
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import slice_needs_copy
from ..outputs import new_output
from ..precision import accumulator_dtype, accumulator_torch_dtype
from .small_matmul import small_matmul
from .fused_dense import fused_dense_fits, fused_dense_launch
from ..tuning import autotune, cdiv, cfg, config_list, next_pow2

__all__ = ["DENSE_OPS", "dense_product_launch", "gather_rows_launch", "gather_rows_kernel", "gram_stack",
           "gram_stack_kernel"]

# the ops of the dense route, and the info table each reads
DENSE_OPS = {"vecsca": "pairs1", "scavec": "pairs2", "inner": "gram"}
# Both steps in one program (fused_dense.py) where the table has its matrix form and the sparse sizes are
# small; tests turn it off to check the two-launch route on the same cases.
FUSED = {"enabled": True}

_CONFIGS = config_list(
    [cfg(4, 1, BLOCK_N=32, BLOCK_R=64), cfg(4, 1, BLOCK_N=16, BLOCK_R=128), cfg(8, 1, BLOCK_N=64, BLOCK_R=64)],
    cfg(1, 1, BLOCK_N=2, BLOCK_R=4),  # the interpreter: tiny test shapes span several blocks
)


@autotune(_CONFIGS, key=["ROWS", "MAX_LEN"])
@triton.jit
def gather_rows_kernel(IN, OUT, BOUNDS, INDEX, SCALE, N, ROWS, MAX_LEN, s_in_n, s_in_m, s_out_n,
                       ACC_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """OUT[n, r] = sum_{k in BOUNDS[0, r]:BOUNDS[1, r]} SCALE[k] IN[n, INDEX[k]], in CSR order."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    r_mask = offs_r < ROWS
    start = tl.load(BOUNDS + offs_r, mask=r_mask, other=0)
    end = tl.load(BOUNDS + ROWS + offs_r, mask=r_mask, other=0)
    # The value loads' mask from [BLOCK_N, BLOCK_R] row bounds made before the loop: triton 3.6 fails to compile
    # (TritonGPURemoveLayoutConversions) a 2-D mask built inside the loop from the 1-D ones.
    zero = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int64)
    start_2d = start[None, :] + zero
    end_2d = tl.where(n_mask[:, None], end[None, :] + zero, start_2d)  # samples past N: no terms
    in_rows = IN + offs_n.to(tl.int64)[:, None] * s_in_n
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=ACC_DTYPE)
    for j in range(0, MAX_LEN):
        k = start + j
        live = k < end
        index = tl.load(INDEX + k, mask=live, other=0)
        scale = tl.load(SCALE + k, mask=live, other=0.0).to(ACC_DTYPE)
        value = tl.load(in_rows + index[None, :] * s_in_m, mask=start_2d + j < end_2d, other=0.0)
        acc += scale[None, :] * value.to(ACC_DTYPE)
    out = OUT + offs_n.to(tl.int64)[:, None] * s_out_n + offs_r[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=n_mask[:, None] & r_mask[None, :])


def gather_rows_launch(values, table, out_dtype):
    """[B, M] -> [B, table.rows]: every row of ``values`` through the table's sparse matrix (B may be 1): one GEMM
    on its matrix form where the table has one (``table.matrix``, [M, rows]), else the CSR gather kernel."""
    matrix = getattr(table, "matrix", None)
    if matrix is not None:
        acc = accumulator_torch_dtype(values.dtype)
        return full_precision_matmul(values.to(acc), matrix.to(acc)).to(out_dtype)
    batch = values.shape[0]
    out = new_output((batch, table.rows), out_dtype, values.device)
    if out.numel() == 0:
        return out
    if table.max_len == 0:
        return out.zero_()
    with on_device(out):
        gather_rows_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]), cdiv(table.rows, meta["BLOCK_R"]))](
            values, out, table.bounds, table.index, table.scale, batch, table.rows, table.max_len,
            values.stride(0), values.stride(1), out.stride(0), ACC_DTYPE=accumulator_dtype(values.dtype))
    return out


def full_precision_matmul(a, b):
    """torch.matmul in the operands' own precision whatever the process set: TF32 off for fp32 (through
    ``fp32_precision`` where torch has it: setting the legacy ``allow_tf32`` would pin the new API's "none" to
    "ieee" and, read back, raises once a user set the new one) and autocast off (it would run fp32 GEMMs in 16
    bits, and round the fp32 coefficient matrix of the per-sample sums)."""
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    before = getattr(matmul, name)
    try:
        setattr(matmul, name, value)
        with torch.autocast(a.device.type, enabled=False):
            return torch.matmul(a, b)
    finally:
        setattr(matmul, name, before)


# fp32 Gram matrices of at most GRAM_STACK_ROWS rows and columns (L 2 and 3: 9 x 9, 16 x 16) go to gram_stack_kernel,
# BLOCK_N samples in one 3-D dot: there it is faster than small_matmul and cuBLAS, while from 25 x 25 (L 4) cuBLAS is
# the faster (docs/measurements/sparse.md). Its one config, 8 samples a program at 4 warps, is the only fast one of
# those tried (fp32's FMA-dot layout). bf16 stays on small_matmul (tensor cores, near copy bandwidth there). Channels
# measured: 32 and 128 (the kernel streams them in steps of 32). fp64 Gram matrices with fewer rows and columns than
# GRAM_ON_CUBLAS_ROWS and an inner dim of at most SMALL_MATMUL_GRAM_DEPTH go to small_matmul, which is faster there
# (docs/measurements/sparse.md), the rest to cuBLAS.
GRAM_STACK_ROWS = 16
GRAM_ON_CUBLAS_ROWS = 16
SMALL_MATMUL_GRAM_DEPTH = 32

_GRAM_STACK_CONFIGS = config_list(
    [cfg(4, 1, BLOCK_N=8, BLOCK_C=32)],
    cfg(1, 1, BLOCK_N=2, BLOCK_C=16),  # the interpreter: tiny batches still span several programs and channel steps
)


@autotune(_GRAM_STACK_CONFIGS, key=["P", "Q", "C"])
@triton.jit
def gram_stack_kernel(X, Y, G, N, P, Q, C, s_xn, s_xp, s_xc, s_yn, s_yc, s_yq, s_gn, s_gp, s_gq,
                      ACC_DTYPE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """G[n] = X[n] @ Y[n] ([P, C] @ [C, Q], Y a strided view) for BLOCK_N consecutive samples as one 3-D dot: the
    samples' rows load as one tile (contiguous where X is), where small_matmul walks samples one at a time."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_c = tl.arange(0, BLOCK_C)
    n = offs_n.to(tl.int64)
    n_mask = offs_n < N
    x_rows = X + n[:, None, None] * s_xn + offs_p[None, :, None] * s_xp
    y_cols = Y + n[:, None, None] * s_yn + offs_q[None, None, :] * s_yq
    x_mask = n_mask[:, None, None] & (offs_p < P)[None, :, None]
    y_mask = n_mask[:, None, None] & (offs_q < Q)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_P, BLOCK_Q], dtype=ACC_DTYPE)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        x = tl.load(x_rows + c[None, None, :] * s_xc, mask=x_mask & (c < C)[None, None, :], other=0.0)
        y = tl.load(y_cols + c[None, :, None] * s_yc, mask=y_mask & (c < C)[None, :, None], other=0.0)
        acc = tl.dot(x, y, acc, input_precision="ieee", out_dtype=ACC_DTYPE)
    out = G + n[:, None, None] * s_gn + offs_p[None, :, None] * s_gp + offs_q[None, None, :] * s_gq
    tl.store(out, acc.to(G.dtype.element_ty), mask=x_mask & (offs_q < Q)[None, None, :])


def gram_stack(x, y_t):
    """x @ y_t for fp32 x [N, P, C] and y_t [N, C, Q] (either may be shared, [P, C] or [C, Q]; not both), P and Q at
    most GRAM_STACK_ROWS, on gram_stack_kernel: fp32 out, FMA (no TF32)."""
    if x.dtype != torch.float32 or y_t.dtype != torch.float32:
        raise ValueError(f"gram_stack: fp32 operands only, got {x.dtype} and {y_t.dtype}")
    if 3 not in (x.dim(), y_t.dim()) or {x.dim(), y_t.dim()} - {2, 3} or x.shape[-1] != y_t.shape[-2] or (
            x.dim() == y_t.dim() == 3 and x.shape[0] != y_t.shape[0]):
        raise ValueError(f"gram_stack: shapes {tuple(x.shape)} and {tuple(y_t.shape)} are not [N, P, C] and [N, C, Q] "
                         f"(one of them may be shared: [P, C] or [C, Q])")
    x, y_t = (t.contiguous() if slice_needs_copy(t, f"gram {name}", "sample") else t
              for name, t in (("x", x), ("y", y_t)))
    batch = x.shape[0] if x.dim() == 3 else y_t.shape[0]
    p, c = x.shape[-2:]
    q = y_t.shape[-1]
    out = new_output((batch, p, q), torch.float32, x.device)
    if out.numel() == 0:
        return out
    if c == 0:
        return out.zero_()
    s_xn = x.stride(0) if x.dim() == 3 else 0
    s_yn = y_t.stride(0) if y_t.dim() == 3 else 0
    with on_device(out):
        gram_stack_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]),)](
            x, y_t, out, batch, p, q, c, s_xn, x.stride(-2), x.stride(-1), s_yn, y_t.stride(-2), y_t.stride(-1),
            *out.stride(), ACC_DTYPE=tl.float32, BLOCK_P=max(16, next_pow2(p)), BLOCK_Q=max(16, next_pow2(q)))
    return out


def _gram(x, y_t, acc):
    """x @ y_t, the inner product's Gram matrices: a few rows, a deep (channel) inner dim. 16-bit inputs on
    small_matmul (tensor cores, closer to the copy bandwidth than cuBLAS); fp32 ones of at most GRAM_STACK_ROWS rows
    and columns on gram_stack_kernel (one operand at most shared); the other fp32 and fp64 ones on cuBLAS (TF32 off)
    but for small and shallow fp64 ones (see GRAM_ON_CUBLAS_ROWS): small_matmul's FMA dot holds each thread's rows
    over the whole inner step, which makes it slower than cuBLAS on 16-49-row ones (docs/measurements/sparse.md)."""
    rows = max(x.shape[-2], y_t.shape[-1])
    if acc != x.dtype:
        return small_matmul(x, y_t, acc)
    if x.dtype == torch.float32 and rows <= GRAM_STACK_ROWS and 3 in (x.dim(), y_t.dim()):
        return gram_stack(x, y_t)
    if rows < GRAM_ON_CUBLAS_ROWS and x.shape[-1] <= SMALL_MATMUL_GRAM_DEPTH:
        return small_matmul(x, y_t, acc)
    return full_precision_matmul(x, y_t)


def _rows(t, shared):
    """A scalar-channel operand as [B, M] (B = 1 when shared)."""
    return t.unsqueeze(0) if shared else t


def dense_product_launch(op, x, y, table, out_size, x_shared, y_shared):
    """z of vecsca, scavec or inner (not accumulated over the batch) by the dense route, in x's dtype.
    x, y: [N, M, C...] or shared [M, C...]; ``table`` is the info's ``dense_rows[DENSE_OPS[op]]``."""
    dtype = x.dtype
    acc = accumulator_torch_dtype(dtype)
    matrix = getattr(table, "matrix", None)
    if FUSED["enabled"] and fused_dense_fits(op, x, y, matrix, out_size, x_shared, y_shared):
        return fused_dense_launch(op, x, y, matrix, out_size, x_shared, y_shared)
    with on_device(x):
        if op == "inner":  # G[n] = x[n] @ y[n]^T, then z[n, o] = sum s G[n, i1, i2]
            gram = _gram(x, y.transpose(-1, -2), acc)
            lead = gram.shape[:-2]
            flat = gram.reshape(-1, gram.shape[-2] * gram.shape[-1])
            z = gather_rows_launch(flat, table, dtype)
            return z.reshape(*lead, out_size)
        if op == "vecsca":  # M[n, o, i1] = sum s y[n, i2]; z[n] = M[n] @ x[n]
            scalars, vectors, scalars_shared = y, x, y_shared
        else:  # scavec: M[n, o, i2] = sum s x[n, i1]; z[n] = M[n] @ y[n]
            scalars, vectors, scalars_shared = x, y, x_shared
        m = gather_rows_launch(_rows(scalars, scalars_shared), table, acc)
        m = m.view(m.shape[0], out_size, vectors.shape[-2])
        if scalars_shared:
            m = m[0]
        return small_matmul(m, vectors, dtype)
