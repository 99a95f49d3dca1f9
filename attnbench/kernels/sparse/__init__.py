"""Triton kernels of the sparse products and SparseScale: CSR segment sums, the bilinear route of mul, the dense
and fused dense routes, the fold route and their matmul helpers."""
