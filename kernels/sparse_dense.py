"""The dense route of the sparse products whose channel dims do not meet in every term: vecsca, scavec, inner.

In vecsca, z[n, o, c] = sum_t s[t] x[n, i1[t], c] y[n, i2[t]], the sum over i2 does not depend on the channel c.
Grouping the terms by (o, i1) first,

    M[n, o, i1] = sum_{t: (o, i1)} s[t] y[n, i2[t]]        (once per sample: no channel)
    z[n]        = M[n] @ x[n]                              (a batched matrix product: small_matmul.py)

does the i2 sum once per sample instead of once per channel: at L 6 (Clebsch-Gordan terms of 0..6 x 0..6 -> 0..6)
the per-channel work falls from 11896 multiply-adds to 49 x 49 = 2401, on matrix units instead of one gathered
x row per term from L2 (the segment kernel's bound: sparse-notes.md). scavec is the same with x and y swapped,
and inner, z[n, o] = sum_t s[t] <x[n, i1[t]], y[n, i2[t]]>, is the Gram matrix G[n] = x[n] @ y[n]^T followed by
the same per-sample gather: z[n, o] = sum_t s[t] G[n, i1[t], i2[t]]. The three are closed under differentiation
(vecsca's gx is a scavec, its gy an inner), so forward, backward and double backward all take this route.

The per-sample sums (a sparse matrix applied to every sample's row of scalars, the info's ``dense_rows`` tables)
are one GEMM on the table's dense matrix form where it has one (cuBLAS, TF32 off: the Clebsch-Gordan tables hold
~10 entries a term, and the GEMM's zeros add nothing), else ``gather_rows_kernel`` (CSR, every row looped to the
longest one's length, a gathered load a term, fixed order: deterministic). At L 6 the kernel took ~1.9 ms of the
3.5 ms bf16 forward at N 1e5 on the H100, the GEMM route's forward 3.0 ms and backward 2x faster (results/gpu/
nvidia-h100/sparse-gather-gemm-*). The matrix products (``small_matmul``: one launch, each
sample's product in registers) run in fp32 for fp32 inputs (never TF32), fp64 for fp64, and for 16-bit inputs on
the tensor cores with fp32 accumulation, M kept in fp32 and split into two half-precision parts (hi + lo) so that
it is not rounded to 16 bits. The fp32 and fp64 Gram matrices (a deep channel inner dim) go to cuBLAS instead, but
for small and shallow ones (``_gram``: measured faster there).
"""
import torch
import triton
import triton.language as tl

from .launch import on_device
from .outputs import new_output
from .precision import accumulator_dtype, accumulator_torch_dtype
from .small_matmul import small_matmul
from .tuning import autotune, cdiv, cfg, config_list

__all__ = ["DENSE_OPS", "dense_product_launch", "gather_rows_launch", "gather_rows_kernel"]

# the ops of the dense route, and the info table each reads
DENSE_OPS = {"vecsca": "pairs1", "scavec": "pairs2", "inner": "gram"}

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


# fp32 and fp64 Gram matrices with fewer rows and columns than GRAM_ON_CUBLAS_ROWS and an inner (channel) dim of at
# most SMALL_MATMUL_GRAM_DEPTH go to small_matmul, the rest to cuBLAS. On the H200 (results/gpu/nvidia-h200/
# small-matmul-gram-fp32-l23.md, batch 1e5): 9 x 9 outputs over 32 channels, cuBLAS (its small-N batched kernel,
# gemmSN_TN) 0.709 ms, small_matmul 0.521 ms (vecsca L 2 C 32 fp32: backward 1.26x, double backward 1.17x); over 128
# channels cuBLAS 0.836 ms, small_matmul 1.91 ms; 16 x 16 (L 3): cuBLAS 1.5x-1.9x faster. Both stay at 9-41% of
# copy: a Gram kernel for these shapes is still to be written.
GRAM_ON_CUBLAS_ROWS = 16
SMALL_MATMUL_GRAM_DEPTH = 32


def _gram(x, y_t, acc):
    """x @ y_t, the inner product's Gram matrices: a few rows, a deep (channel) inner dim. 16-bit inputs on
    small_matmul (tensor cores: 76-99% of the copy bandwidth on the H100, cuBLAS 50-86%); fp32 and fp64 on cuBLAS
    (TF32 off) but for small and shallow ones (see GRAM_ON_CUBLAS_ROWS): small_matmul's FMA dot holds each thread's
    rows over the whole inner step and ran 16-49-row ones at 24-54% against cuBLAS's 49-84% (results/gpu/
    nvidia-h100/small-matmul-configs-*.md)."""
    small = max(x.shape[-2], y_t.shape[-1]) < GRAM_ON_CUBLAS_ROWS and x.shape[-1] <= SMALL_MATMUL_GRAM_DEPTH
    if acc != x.dtype or small:
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
