"""Dense reference of the sparse ops, the oracle of the tests: the structure as a dense coefficient tensor and
one einsum, in any dtype (float64 included). It shares nothing with the split implementation but the infos.

    product:  W[i3, i1, i2] = sum of s over the terms (i1, i2, i3),  z[n, k] = sum_ij W[k, i, j] x[n, i] ∘ y[n, j]
    scale:    S[m, i]       = sum of s over the terms (i, m),        y[n, m] = sum_i S[m, i] x[n, i]
"""
import torch

from .info import SparseProductInfo, SparseScaleInfo, product_terms, scale_terms

__all__ = ["dense_coefficients", "dense_scale_matrix", "sparse_product_reference", "sparse_scale_reference"]

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


def sparse_product_reference(op, x, y, info: SparseProductInfo, out_accumulated=False):
    """z = W ·(x ∘ y) by einsum in x's dtype; x, y batched [N, M, C...] or shared [M, C...]."""
    cx, cy, cz = _CHANNELS[op]
    nx = "n" if x.dim() == len(cx) + 2 else ""
    ny = "n" if y.dim() == len(cy) + 2 else ""
    nz = "" if out_accumulated else (nx or ny)
    coefficients = dense_coefficients(info, x.dtype)
    return torch.einsum(f"kij,{nx}i{cx},{ny}j{cy}->{nz}k{cz}", coefficients, x, y)


def sparse_scale_reference(x, info: SparseScaleInfo):
    """y = S x over x's second-to-last dim, in x's dtype."""
    return torch.einsum("mi,...ic->...mc", dense_scale_matrix(info, x.dtype), x)
