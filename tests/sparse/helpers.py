"""Plain helpers of the sparse tests. The GPU files' cases, oracles and bounds: gpu_cases.py."""
import torch

from attnbench.bench.verify import gamma
from attnbench.kernels.sparse.split_matmul import split_matmul

# split_matmul: how far scale (hi + lo) may miss b, relative to |b|, per 16-bit dtype
SPLIT_ERROR = {torch.float16: 2.0 ** -22, torch.bfloat16: 2.0 ** -16}


def check_split_matmul(a, b):
    """split_matmul(a, b) against float64 within the a-priori elementwise bound (see tests/sparse/test_split_matmul.py)."""
    out = split_matmul(a, b)
    exact = a.double() @ b.double()
    floor = 2.0 ** -38 * float(b.abs().max()) * a.double().abs().sum(1, keepdim=True) if b.numel() else 0.0
    bound = (torch.finfo(a.dtype).eps / 2 * exact.abs() + floor
             + (gamma(a.shape[1] + 1, 2.0 ** -24) + SPLIT_ERROR[a.dtype]) * (a.double().abs() @ b.double().abs()))
    assert out.shape == exact.shape and out.dtype == a.dtype
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all()), float((out.double() - exact).abs().max())
