"""The fold route of the products with a shared weight: vecmat with a shared y (the fully connected tensor-product
layer, z[n] = x[n] W) and mat_t_vec with a shared x (its input gradient).

With the weight shared by the batch, the term sum can be done once per call instead of once per sample:

    A[(i1, a), (o, b)] = sum_{t: (o, i1)} s[t] W[i2[t], a, b]      (vecmat: the weight folded into the coefficients)
    z[n]               = x[n] (flattened [P1 a]) @ A                (one GEMM over the whole batch)

Per sample that is 2 (P1 a) (P_out b) FLOPs on one large GEMM, against the segment kernels' 2 terms a b: for the
Clebsch-Gordan products of irreps 0..L, terms / (P_out P1) is 1.7 (L 2), 2.4 (L 3), 3.3 (L 4), 5.0 (L 6). The einsum
reference contracts in this order and is faster than the segment kernels at every anchor (docs/measurements/
sparse.md). mat_t_vec with a shared x is the same with the roles of the two
sparse indices swapped. The fold itself is one small GEMM, the info's "pairs" table in its dense matrix form
(``SparseProductInfo.dense_rows``: summed in float64 on the CPU, so a fixed order) times the weight.

The weight's gradient, outer summed over the batch (both inputs batched), is the fold transposed:

    G[(i1, a), (i2, b)] = sum_n x[n, i1, a] y[n, i2, b]              (one GEMM with the batch as contraction dim)
    z[o, a, b]          = sum_{t in o} s[t] G[(i1[t], a), (i2[t], b)]   (the "gram" table's matrix times G)

2 N (P1 a) (P2 b) FLOPs against the tl.dot kernel's 2 N terms a b (attnbench/kernels/sparse/outer_sum.py).

Precision: fp32 and fp64 in their own precision (TF32 off); 16-bit inputs against A kept in fp32 and split into two
16-bit parts (hi + lo; fp16 after a power-of-two scale: ``split_matmul.split_fp32``), both products with fp32 outputs
(``torch.mm(..., out_dtype=torch.float32)``) summed before the one rounding to the output dtype, as the dense route of
vecsca does with its M; where the fold is small enough (``SPLIT_MATMUL``), both halves accumulated in one Triton
program instead (split_matmul.py).
"""
import torch

from ..precision import accumulator_torch_dtype
from .dense import full_precision_matmul
from .split_matmul import split_fp32, split_matmul

__all__ = ["FOLD_OPS", "SPLIT_MATMUL", "fold_outer_sum_launch", "fold_product_launch", "folded_entries"]

# 16-bit inputs against the fp32 fold on split_matmul.py (both halves in one program, one rounding) where the
# fold has at most max_entries entries, else two cuBLAS GEMMs with fp32 outputs, their sum and a cast. The kernel's
# products are slower than cuBLAS's, so it wins only where the pair's fp32 passes cost more than that gap: the FC layer
# gains on folds within max_entries and about ties or loses on wider ones, in forward, backward and double backward
# alike (docs/measurements/sparse.md).
SPLIT_MATMUL = {"enabled": True, "max_entries": 1 << 21}

# the ops of the fold route: the info table whose matrix holds the coefficients, and which operand is the shared
# weight (0: x, 1: y)
FOLD_OPS = {"vecmat": ("pairs1", 1), "mat_t_vec": ("pairs2", 0)}


def _weight_and_vectors(op, x, y):
    """(the shared weight, the batched vectors) of ``op``'s operands."""
    return (y, x) if FOLD_OPS[op][1] == 1 else (x, y)


def folded_entries(op, x, y, out_size):
    """Entries of A for ``op`` on these operands: [P_in channels_in, P_out channels_out]."""
    weight, vectors = _weight_and_vectors(op, x, y)
    return vectors.shape[-2] * weight.shape[-2] * out_size * weight.shape[-1]


def _mm_fp32_out(a, b):
    """a @ b of 16-bit operands with an fp32 output (fp32 accumulation, no rounding of the result). torch has
    ``mm(..., out_dtype)`` on CUDA only; elsewhere (the interpreter's CPU runs) the operands go up to fp32 first,
    which is exact for 16-bit values, so the result is the same sum."""
    if a.device.type != "cuda":
        return full_precision_matmul(a.float(), b.float())
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b, out_dtype=torch.float32)


def fold_product_launch(op, x, y, matrix, out_size):
    """z of vecmat with a shared y ([P2, a, b]; x [N, P1, a]) or of mat_t_vec with a shared x ([P1, a, b]; y
    [N, P2, a]), [N, out_size, b] in x's dtype. ``matrix``: the info's "pairs1" (vecmat) or "pairs2" (mat_t_vec)
    table as a dense [P_weight, out_size * P_in] matrix, float64 or float32."""
    weight, vectors = _weight_and_vectors(op, x, y)
    batch, p_in, ca = vectors.shape
    p_weight, _, cb = weight.shape
    acc = accumulator_torch_dtype(x.dtype)
    folded = full_precision_matmul(matrix.to(acc).t(), weight.reshape(p_weight, ca * cb).to(acc))  # [(o, i), (a, b)]
    folded = folded.view(out_size, p_in, ca, cb).permute(1, 2, 0, 3).reshape(p_in * ca, out_size * cb)
    flat = vectors.reshape(batch, p_in * ca)
    if x.dtype == acc:
        z = full_precision_matmul(flat, folded)
    elif SPLIT_MATMUL["enabled"] and folded.numel() <= SPLIT_MATMUL["max_entries"]:
        return split_matmul(flat, folded).view(batch, out_size, cb)
    else:
        hi, lo, scale = split_fp32(folded, x.dtype)
        z = _mm_fp32_out(flat, hi) + _mm_fp32_out(flat, lo)
        z = z if scale is None else z * scale
    return z.view(batch, out_size, cb).to(x.dtype)


def fold_outer_sum_launch(x, y, matrix, out_size):
    """z of outer summed over the batch, x [N, P1, a] and y [N, P2, b] -> [out_size, a, b] in x's dtype.
    ``matrix``: the info's "gram" table as a dense [P1 * P2, out_size] matrix, float64 or float32."""
    batch, p1, ca = x.shape
    p2, cb = y.shape[1], y.shape[2]
    acc = accumulator_torch_dtype(x.dtype)
    xf, yf = x.reshape(batch, p1 * ca), y.reshape(batch, p2 * cb)
    gram = full_precision_matmul(xf.t(), yf) if x.dtype == acc else _mm_fp32_out(xf.t(), yf)  # [(i1, a), (i2, b)]
    gram = gram.view(p1, ca, p2, cb).permute(0, 2, 1, 3).reshape(p1 * p2, ca * cb)
    z = full_precision_matmul(matrix.to(acc).t(), gram)  # [out, (a, b)]
    return z.view(out_size, ca, cb).to(x.dtype)
