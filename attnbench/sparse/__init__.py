"""The ``sparse`` operator: SparseScale and seven sparse tensor products, differentiable to any order.

    sparse product:  z[n, i3[t]] += s[t] * x[n, i1[t]] ∘ y[n, i2[t]]   (∘: mul, outer, inner, vecmat, vecsca,
                                                                         scavec, mat_t_vec on the channel dims)
    sparse scale:    y[n, m]     += s[t] * x[n, index[t]]                (y = S x, S sparse)

``info`` holds the structures (SparseProductInfo, SparseScaleInfo) and their builders, ``functional`` the
split-PyTorch implementation with its autograd Functions and checked wrappers (Triton kernels on CUDA, through
``triton_ops``; ``use_implementation`` overrides), ``reference`` the dense einsum
oracle, ``so3`` the real-basis Clebsch-Gordan coefficients and Wigner D matrices that give tensor products of
irreps their sparse structure. Tensors are [N, M, C...]; an input without N is shared by the batch.
"""
from .functional import (CHANNEL_RANKS, DENSE_OPS, IMPLEMENTATIONS, PRODUCT_FUNCTIONS, SparseInner, SparseMatTVec, SparseMul,
                         SparseOuter, SparseScale, SparseScaVec, SparseVecMat, SparseVecSca, sparse_inner,
                         sparse_mat_t_vec, sparse_mul, sparse_outer, sparse_product, sparse_product_split,
                         sparse_scale, sparse_scale_split, sparse_scavec, sparse_vecmat, sparse_vecsca,
                         use_implementation)
from .info import (SparseProductInfo, SparseScaleInfo, product_infos, product_terms, random_product_infos,
                   random_scale_infos, scale_infos, scale_terms, verify_structure)
from .reference import (dense_coefficients, dense_scale_matrix, sparse_product_reference, sparse_scale_matrix,
                        sparse_scale_reference)

__all__ = [
    "SparseProductInfo", "SparseScaleInfo", "product_infos", "scale_infos", "product_terms", "scale_terms",
    "random_product_infos", "random_scale_infos", "verify_structure",
    "SparseScale", "SparseMul", "SparseOuter", "SparseInner", "SparseVecMat", "SparseVecSca", "SparseScaVec",
    "SparseMatTVec", "PRODUCT_FUNCTIONS", "DENSE_OPS", "CHANNEL_RANKS",
    "sparse_scale", "sparse_mul", "sparse_outer", "sparse_inner", "sparse_vecmat", "sparse_vecsca",
    "sparse_scavec", "sparse_mat_t_vec", "sparse_product", "sparse_product_split", "sparse_scale_split",
    "dense_coefficients", "dense_scale_matrix", "sparse_scale_matrix", "sparse_product_reference",
    "sparse_scale_reference",
    "IMPLEMENTATIONS", "use_implementation",
]

# the end-to-end equivariant layer and toy potential (tensor_product), built only from the ops above
from .tensor_product import FullyConnectedTensorProduct, ToyPotential, cg_product_infos  # noqa: E402

__all__ += ["cg_product_infos", "FullyConnectedTensorProduct", "ToyPotential"]
