"""kernels/split_matmul.py: a 16-bit batch times an fp32 matrix split into hi + lo, one rounding. On the
interpreter in fp16 (numpy has no bf16: bf16 there takes an fp32 matmul), on a GPU in fp16 and bf16 with every
launch config forced in turn. Bounds are a priori, elementwise: the output's rounding (u_out |exact|), fp32 sums of
K products (gamma_{K+1}(2**-24)) and the split (hi + lo misses b by at most 2**-16 |b| in bf16, 2**-22 in fp16), each
of |a| @ |b|.
"""
import pytest
import torch

from attnbench.kernels import outputs as kernel_outputs
from attnbench.kernels.split_matmul import split_fp32, split_matmul, split_matmul_kernel
from attnbench.verify import gamma

SPLIT_ERROR = {torch.float16: 2.0 ** -22, torch.bfloat16: 2.0 ** -16}


def check(a, b):
    out = split_matmul(a, b)
    exact = a.double() @ b.double()
    bound = (torch.finfo(a.dtype).eps / 2 * exact.abs()
             + (gamma(a.shape[1] + 1, 2.0 ** -24) + SPLIT_ERROR[a.dtype]) * (a.double().abs() @ b.double().abs()))
    assert out.shape == exact.shape and out.dtype == a.dtype
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all()), float((out.double() - exact).abs().max())


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


def test_split_parts_and_bad_inputs():
    b = torch.randn(50, 50) * 1e3
    for dtype, error in SPLIT_ERROR.items():
        hi, lo = split_fp32(b, dtype)
        assert hi.dtype == lo.dtype == dtype
        assert bool(((hi.double() + lo.double() - b.double()).abs() <= error * b.double().abs()).all())
    with pytest.raises(ValueError, match="do not multiply"):
        split_matmul(torch.randn(3, 4).half(), torch.randn(5, 2))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        split_matmul(torch.randn(3, 4), torch.randn(4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(len(split_matmul_kernel.configs)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_config_on_the_gpu(config, dtype, monkeypatch):
    """Each config forced in turn, NaN-poisoned output: the fold's widths (288: L 2 C 32; 1568: L 6 C 32) and a
    ragged shape, batches that leave the last tile short."""
    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    monkeypatch.setattr(split_matmul_kernel, "configs", [split_matmul_kernel.configs[config]])
    monkeypatch.setattr(split_matmul_kernel, "cache", {})
    generator = torch.Generator(device="cuda").manual_seed(config)
    for n, k, m in [(4001, 288, 288), (1003, 1568, 1568), (777, 37, 201)]:
        a = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
        check(a, torch.randn(k, m, device="cuda", generator=generator) / k ** 0.5)

