"""Dense reference of the sparse ops, the oracle of the tests: the structure as a dense coefficient tensor and
one einsum, in any dtype (float64 included). It shares nothing with the split implementation but the infos.
A scale matrix too large to hold dense (``DENSE_SCALE_ENTRIES``) is the same coefficients as a sparse COO tensor
and torch's sparse matmul instead.

    product:  W[i3, i1, i2] = sum of s over the terms (i1, i2, i3),  z[n, k] = sum_ij W[k, i, j] x[n, i] ∘ y[n, j]
    scale:    S[m, i]       = sum of s over the terms (i, m),        y[n, m] = sum_i S[m, i] x[n, i]
"""
import torch

from .info import SparseProductInfo, SparseScaleInfo, product_terms, scale_terms

__all__ = ["DENSE_SCALE_ENTRIES", "dense_coefficients", "dense_scale_matrix", "sparse_scale_matrix",
           "sparse_product_reference", "sparse_scale_reference"]

# channel subscripts of (x, y, z) per op, for the einsum
_CHANNELS = {
    "mul": ("c", "c", "c"), "outer": ("a", "b", "ab"), "inner": ("c", "c", ""), "vecmat": ("a", "ab", "b"),
    "vecsca": ("c", "", "c"), "scavec": ("", "c", "c"), "mat_t_vec": ("ab", "a", "b"),
}


def dense_coefficients(info: SparseProductInfo, dtype=torch.float64):
    """W [out_size, size1, size2] with W[i3, i1, i2] the summed scale of the terms (i1, i2, i3)."""
    i1, i2, i3, scale = product_terms(info)
    coefficients = torch.zeros(info.out_size, info.size1, info.size2, dtype=dtype, device=info.device)
    return coefficients.index_put_((i3, i1, i2), scale.to(dtype), accumulate=True)  # repeated terms add up


def dense_scale_matrix(info: SparseScaleInfo, dtype=torch.float64):
    """S [out_size, in_size] with S[m, i] the summed scale of the terms (i, m)."""
    index, rows, scale = scale_terms(info)
    matrix = torch.zeros(info.out_size, info.in_size, dtype=dtype, device=info.device)
    return matrix.index_put_((rows, index), scale.to(dtype), accumulate=True)


def sparse_scale_matrix(info: SparseScaleInfo, dtype=torch.float64, scale_dtype=None):
    """S [out_size, in_size] as a coalesced sparse COO tensor: the dense matrix's entries (repeated terms summed)
    without its zeros; ``scale_dtype``: each term's scale rounded to it first."""
    index, rows, scale = scale_terms(info)
    scale = scale.to(scale_dtype or dtype).to(dtype)
    return torch.sparse_coo_tensor(torch.stack((rows, index)), scale, (info.out_size, info.in_size),
                                   check_invariants=True).coalesce()


# Past 2**28 entries (2 GiB in float64) the dense scale matrix goes sparse: the sweep's N 1e6 segment sum is
# 62500 x 1e6 (465 GiB dense, out of memory on an 80 GB GPU; that ended a whole `attnbench run`), and at N 1e5
# (6250 x 1e5) the dense einsum spends 2 * out * in * width FLOPs on a matrix that is 99.98% zeros.
DENSE_SCALE_ENTRIES = 2 ** 28


def sparse_product_reference(op, x, y, info: SparseProductInfo, out_accumulated=False):
    """z = W ·(x ∘ y) by einsum in x's dtype; x, y batched [N, M, C...] or shared [M, C...]."""
    cx, cy, cz = _CHANNELS[op]
    nx = "n" if x.dim() == len(cx) + 2 else ""
    ny = "n" if y.dim() == len(cy) + 2 else ""
    nz = "" if out_accumulated else (nx or ny)
    coefficients = dense_coefficients(info, x.dtype)
    return torch.einsum(f"kij,{nx}i{cx},{ny}j{cy}->{nz}k{cz}", coefficients, x, y)


def sparse_scale_reference(x, info: SparseScaleInfo):
    """y = S x over x's second-to-last dim, in x's dtype: one einsum with the dense S, or torch's sparse matmul
    where S would pass ``DENSE_SCALE_ENTRIES``. 16-bit x there: the scales rounded to x's dtype as the dense S's
    are, the sums in float32 and rounded once at the end, as cuBLAS does the dense einsum's 16-bit GEMM (repeated
    terms are summed in float32, where the dense S sums them in x's dtype). torch.func transforms take the dense
    route only: torch's sparse matmul has no functorch rule (an error, not a wrong result)."""
    if info.out_size * info.in_size <= DENSE_SCALE_ENTRIES:
        return torch.einsum("mi,...ic->...mc", dense_scale_matrix(info, x.dtype), x)
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    columns = x.to(work).movedim(-2, 0)  # [in, ..., C]: the matmul's rows are S's columns
    z = torch.sparse.mm(sparse_scale_matrix(info, work, x.dtype), columns.reshape(info.in_size, -1))
    return z.reshape(info.out_size, *columns.shape[1:]).movedim(0, -2).to(x.dtype)
