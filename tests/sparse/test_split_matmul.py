"""attnbench/kernels/sparse/split_matmul.py: a 16-bit batch times an fp32 matrix split into hi + lo, one rounding. On the
interpreter in fp16 (numpy has no bf16: bf16 there takes an fp32 matmul), on a GPU in fp16 and bf16 with every
launch config forced in turn. Bounds are a priori, elementwise: the output's rounding (u_out |exact|), fp32 sums of
K products (gamma_{K+1}(2**-24)) and the split (scale (hi + lo) misses b by at most 2**-16 |b| in bf16, 2**-22 in
fp16), each of |a| @ |b|, plus the split's floor for tiny entries (2**-38 max |b|, of |a| summed): tests/sparse/helpers.py's
check_split_matmul. The GPU's side: tests/sparse/test_gpu_split_matmul.py.
"""
import pytest
import torch

from attnbench.kernels.sparse.split_matmul import split_fp32, split_matmul

from .helpers import SPLIT_ERROR, check_split_matmul as check

SHAPES = [(37, 20, 33), (5, 1, 3), (16, 48, 16), (40, 17, 70)]  # (N, K, M): tails in every dim, K of 1


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp16_matches_float64_on_the_interpreter(shape):
    n, k, m = shape
    generator = torch.Generator().manual_seed(n * k + m)
    check(torch.randn(n, k, generator=generator).half(), torch.randn(k, m, generator=generator))


@pytest.mark.interpreter
def test_strided_empty_and_bf16_on_the_interpreter():
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(20, 30, generator=generator).half().t()  # [30, 20], column-major
    check(a, torch.randn(20, 9, generator=generator))
    assert split_matmul(torch.zeros(0, 4).half(), torch.randn(4, 3)).shape == (0, 3)
    assert not split_matmul(torch.randn(3, 0).half(), torch.randn(0, 5)).any()
    check(torch.randn(9, 33, generator=generator).bfloat16(), torch.randn(33, 7, generator=generator))


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 1e3, 1e6])
def test_split_parts(magnitude):
    """scale (hi + lo) is b to the documented bound at any magnitude: fp16's range (65504 at the top, subnormals below
    6e-5) would break an unscaled split at both ends (bf16 needs no scale); entries 2**20 below the largest keep their
    relative bound."""
    b = torch.randn(50, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b[0, :10] *= 2.0 ** -20
    b = (b * magnitude).float()
    for dtype, error in SPLIT_ERROR.items():
        hi, lo, scale = split_fp32(b, dtype)
        assert hi.dtype == lo.dtype == dtype
        if dtype == torch.bfloat16:  # fp32's exponent range: no scale
            assert scale is None
            scale = torch.ones(1)
        assert scale.shape == (1,) and float(scale) == 2.0 ** round(torch.log2(scale).item())
        miss = (float(scale) * (hi.double() + lo.double()) - b.double()).abs()
        assert bool((miss <= error * b.double().abs() + 2.0 ** -38 * float(b.abs().max())).all())


@pytest.mark.interpreter
def test_small_cancelling_and_large_entries_in_fp16():
    """An fp16 batch against small fp32 entries that nearly cancel (an unscaled split left their low parts
    subnormal: 1.4 ulp off) and against entries past fp16's range (an unscaled hi overflowed to inf - inf = NaN)."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        u = 1e-3 + 1e-3 * torch.rand((), generator=generator).item()
        v = u - 1e-5 * (1 + torch.rand((), generator=generator).item())
        check(torch.tensor([[1024.0, 1024.0]]).half(), torch.tensor([[u], [-v]]))
    check(torch.tensor([[1e-3, 2e-3]]).half(), torch.tensor([[7e4], [-3e4]]))


@pytest.mark.interpreter
def test_rows_strided_past_32_bit_offsets():
    """A batch-innermost a (stride N along K) whose in-row offsets pass 2**31 - 1: copied compact, not read past
    int32 (the storage is virtual: only the viewed elements are touched)."""
    k, n, stride = 4, 3, 2 ** 30 + 7
    a = torch.empty((k - 1) * stride + n, dtype=torch.float16).as_strided((n, k), (1, stride))
    generator = torch.Generator().manual_seed(4)
    a.copy_(torch.randn(n, k, generator=generator).half())
    check(a, torch.randn(k, 5, generator=generator))


def test_bad_inputs():
    with pytest.raises(ValueError, match="do not multiply"):
        split_matmul(torch.randn(3, 4).half(), torch.randn(5, 2))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        split_matmul(torch.randn(3, 4), torch.randn(4, 2))
