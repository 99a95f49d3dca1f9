"""``kernels.small_matmul`` (the dense route's per-sample products) on the Triton interpreter, against float64.

The interpreter's tiles are 16 x 16 with an inner step of 16 and two samples a program, so the shapes below
span several row, column and inner tiles, ragged edges in each, and a batch that leaves the last program with a
sample past the end. Every output element starts as NaN (poisoned outputs): one the kernel misses fails.
"""
import pytest
import torch

from attnbench.kernels.outputs import poisoned_outputs
from attnbench.kernels.offsets import slice_needs_copy
from attnbench.kernels.sparse.small_matmul import small_matmul

pytestmark = pytest.mark.interpreter


def _operand(shape, generator, transpose=False):
    """A float64 operand, optionally laid out column-major (a transposed view: non-unit inner strides)."""
    if transpose:
        flipped = (*shape[:-2], shape[-1], shape[-2])
        return torch.randn(flipped, generator=generator, dtype=torch.float64).transpose(-1, -2)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _bound(a, b, dtype):
    """Elementwise rounding bound of a length-K dot in ``dtype`` (fp64 here: K u |a| |b|, plus one output rounding)."""
    unit = torch.finfo(dtype).eps / 2
    k = a.shape[-1]
    return (k + 1) * unit * (a.abs() @ b.abs()) + 1e-300


@pytest.mark.parametrize("batch_a, batch_b", [(5, 5), (None, 5), (5, None), (None, None), (1, 5), (5, 1)])
@pytest.mark.parametrize("p, k, q", [(3, 5, 7), (17, 33, 18), (70, 20, 40)])
def test_matches_float64_for_every_sharing_and_shape(batch_a, batch_b, p, k, q):
    generator = torch.Generator().manual_seed(p * 1000 + k)
    a = _operand(((batch_a,) if batch_a else ()) + (p, k), generator, transpose=p % 2 == 1)
    b = _operand(((batch_b,) if batch_b else ()) + (k, q), generator, transpose=True)
    with poisoned_outputs():
        out = small_matmul(a, b, torch.float64)
    expected = torch.matmul(a, b)
    assert out.shape == expected.shape
    assert bool(((out - expected).abs() <= _bound(a, b, torch.float64)).all())


def test_fp32_operands_accumulate_in_fp32_without_tf32():
    """fp32 in, fp32 out, within the fp32 bound of a length-K sum (TF32 would miss it by ~1000x)."""
    generator = torch.Generator().manual_seed(3)
    a, b = _operand((4, 20, 49), generator), _operand((4, 49, 33), generator)
    with poisoned_outputs():
        out = small_matmul(a.float(), b.float(), torch.float32)
    exact = a.float().double() @ b.float().double()
    assert out.dtype == torch.float32
    assert bool(((out.double() - exact).abs() <= _bound(a, b, torch.float32)).all())


def test_fp32_a_against_fp16_b_splits_a_into_hi_and_lo():
    """An fp32 ``a`` (the route's M) against fp16 ``b``: a enters as hi + lo, both fp16, missing at most
    2**-22 |a| (normal range) + 2**-25 (fp16's subnormal half-spacing, for |a| < 2**-14), then fp32 sums of K
    products and one fp16 output rounding. Rounding a to fp16 instead (one dot) misses by ~2**-12 |a|: the bound
    fails. Values span 2**-20..2**4 so that the subnormal case occurs."""
    generator = torch.Generator().manual_seed(5)
    scales = 2.0 ** torch.randint(-20, 5, (3, 21, 40), generator=generator)
    a = (_operand((3, 21, 40), generator) * scales).float()
    b = _operand((3, 40, 19), generator).half()
    with poisoned_outputs():
        out = small_matmul(a, b, torch.float16)
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    k = a.shape[-1]
    sums = (k + 1) * 2.0 ** -24 * (a64.abs() @ b64.abs())
    split = (2.0 ** -22 * a64.abs() + 2.0 ** -25) @ b64.abs()
    bound = sums + split + 2.0 ** -11 * exact.abs() + 2.0 ** -25  # the last: fp16's own subnormal output
    assert out.dtype == torch.float16
    assert bool(((out.double() - exact).abs() <= bound).all())
    one_dot = (a.half().double() @ b64).half().double()
    assert not bool(((one_dot - exact).abs() <= sums + 2.0 ** -11 * exact.abs() + 2.0 ** -25).all())


def test_empty_and_degenerate_shapes():
    a = torch.randn(3, 4, 0, dtype=torch.float64)
    b = torch.randn(3, 0, 5, dtype=torch.float64)
    with poisoned_outputs():
        assert torch.equal(small_matmul(a, b, torch.float64), torch.zeros(3, 4, 5, dtype=torch.float64))
        assert small_matmul(torch.randn(0, 4, 2, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64),
                            torch.float64).shape == (0, 4, 5)


def test_refuses_operands_that_do_not_pair():
    with pytest.raises(ValueError, match="do not multiply"):
        small_matmul(torch.randn(3, 4, 5), torch.randn(3, 6, 2), torch.float32)
    with pytest.raises(ValueError, match="do not multiply"):
        small_matmul(torch.randn(3, 4, 5), torch.randn(2, 5, 2), torch.float32)
    with pytest.raises(ValueError, match="do not pair"):
        small_matmul(torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 5, 2), torch.float32)
    with pytest.raises(ValueError, match=r"\[N, R, C\] or shared"):
        small_matmul(torch.randn(2, 3, 4, 5), torch.randn(5, 2), torch.float32)


def test_wide_slices_are_compacted_or_refused_before_any_kernel():
    """The kernel's in-sample offsets are 32-bit: a slice spread wider (a batch-innermost layout at large N) is
    copied compact; matrices too large even then are refused. Meta tensors: no memory, no kernel."""
    wide = torch.empty_strided((2, 49, 128), (1, 128 * 400_000, 400_000), device="meta")
    assert slice_needs_copy(wide, "b", "sample") and not slice_needs_copy(wide.contiguous(), "b", "sample")
    assert not slice_needs_copy(torch.empty(3, 64, 64, device="meta"), "a", "sample")
    with pytest.raises(ValueError, match="a: 70000 x 40000 = .* exceeds 2\\*\\*31 - 1 elements per sample"):
        column_major = torch.empty_strided((1, 70_000, 40_000), (1, 1, 70_000), device="meta")
        small_matmul(column_major, torch.empty(40_000, 1, device="meta"), torch.float32)
    with pytest.raises(ValueError, match="the output, 60000 x 60000, exceeds 2\\*\\*31 - 1 elements per sample"):
        small_matmul(torch.empty(60_000, 1, device="meta"), torch.empty(1, 60_000, device="meta"), torch.float32)
