"""mul's bilinear route (attnbench/kernels/sparse/bilinear.py: dense coefficient blocks on the matrix units) on the
interpreter: values against the float64 reference and the segment kernel it replaces, every sharing, both held
operands, output rows past one row tile, odd sizes and strides; first and second derivatives (mul is closed under
differentiation, so the backward takes the route too); where the route does not apply the segment kernel runs;
bad arguments fail with clear errors. A counting spy on the route's launcher says which ran. Tiny sizes:
interpreter launches cost ~0.05 s.
"""
import dataclasses
import math

import pytest
import torch

from attnbench.kernels.sparse import bilinear as sparse_bilinear
from attnbench.sparse import (product_infos, random_product_infos, sparse_product, sparse_product_reference,
                              triton_ops, use_implementation)
from attnbench.sparse.tensor_product import cg_product_infos

from .helpers import SHARING

pytestmark = pytest.mark.interpreter


@pytest.fixture(params=["rows_m", "columns_m"])
def orientation(request, monkeypatch):
    """Both orientations of the kernel's dots on fp64 (the GPU takes A's rows as M for fp32 and fp64, the columns
    as M for 16-bit inputs: ROWS_M_DTYPES), so that each is checked on every sharing, size and derivative."""
    if request.param == "columns_m":
        monkeypatch.setattr(sparse_bilinear, "ROWS_M_DTYPES", ())
    return request.param


@pytest.fixture
def routed(spy_kernel):
    """The route's kernel launches (conftest's LaunchSpy): each launch's positional arguments, P_HELD at 9."""
    return spy_kernel(sparse_bilinear, "bilinear_kernel").args


def structures():
    """(name, infos): Clebsch-Gordan L 1 x 2 -> 2 (x the smaller: x held), L 2 x 1 -> 2 (y held); random CSR with
    rows without terms, repeated terms and gather_index backward infos, 70 output rows (two row tiles of 64), ~29
    terms a row (fp32 takes the route from FP32_MIN_TERMS_PER_ROW)."""
    return [("cg_1x2", cg_product_infos(1, 2, 2)), ("cg_2x1", cg_product_infos(2, 1, 2)),
            ("random_70_out", random_product_infos(5, 7, 70, 2000, torch.Generator().manual_seed(5)))]


STRUCTURES = dict(structures())


def inputs(infos, sharing, batch=3, channels=5, dtype=torch.float64, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    shared_x, shared_y = SHARING[sharing]

    def tensor(shared, size):
        shape = (() if shared else (batch,)) + (size, channels)
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    return tensor(shared_x, infos[0].size1), tensor(shared_y, infos[0].size2)


def _triton(x, y, infos, out_accumulated=False):
    with use_implementation("triton"):
        return sparse_product("mul", x, y, infos, out_accumulated)


@pytest.mark.parametrize("sharing", list(SHARING))
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_matches_reference_and_segment_kernel(name, sharing, routed, orientation):
    infos = STRUCTURES[name]
    x, y = inputs(infos, sharing)
    z = _triton(x, y, infos)
    assert [args[9] for args in routed] == [min(infos[0].size1, infos[0].size2)]  # the held operand: the fewer rows
    expected = sparse_product_reference("mul", x, y, infos[0])
    assert z.shape == expected.shape and z.dtype == torch.float64
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
    if orientation == "rows_m":  # the segment kernel does not depend on the orientation (and is the slow part here)
        with triton_ops.bilinear_route(False):
            segment = _triton(x, y, infos)
        assert len(routed) == 1
        torch.testing.assert_close(z, segment, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch,channels", [(1, 1), (5, 17), (2, 33)])
def test_odd_sizes_and_strides(batch, channels, routed, orientation):
    """Batches and channels that are no block's multiple (the interpreter's blocks: 2 samples x 16 channels), and
    operands that are strided views (channels not innermost, a sliced batch)."""
    infos = STRUCTURES["random_70_out"]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(channels, 2 * batch, infos[0].size1, generator=generator, dtype=torch.float64)
    x = x.permute(1, 2, 0)[::2]  # [batch, size1, channels], channel stride size1 * 2 * batch
    y = torch.randn(batch, infos[0].size2, channels + 3, generator=generator, dtype=torch.float64)[..., 3:]
    z = _triton(x, y, infos)
    assert routed
    torch.testing.assert_close(z, sparse_product_reference("mul", x, y, infos[0]), rtol=1e-12, atol=1e-12)


def test_empty_batch_and_channels(routed):
    infos = STRUCTURES["cg_1x2"]
    for batch, channels in ((0, 4), (3, 0)):
        x, y = inputs(infos, "batched", batch=batch, channels=channels)
        z = _triton(x, y, infos)
        assert z.shape == (batch, infos[0].out_size, channels)


def error_and_bound(z, x, y, info):
    """|z - the float64 result| and its bound (see test_low_precision): the output's rounding to z's dtype and the fp32
    chain of at most P2 + P1 + 2 roundings, of sum|terms|, plus fp16's split halves' 2**-16 of each coefficient."""
    expected = sparse_product_reference("mul", x.double(), y.double(), info)
    magnitude = sparse_product_reference("mul", x.double().abs(), y.double().abs(),
                                         dataclasses.replace(info, scale=info.scale.abs()))
    chain = info.size1 + info.size2 + 2
    split = sparse_bilinear.SPLIT_ACCURACY if z.dtype == torch.float16 else 0.0
    bound = (torch.finfo(z.dtype).eps / 2 + chain * torch.finfo(torch.float32).eps + split) * magnitude
    return (z.double() - expected).abs(), bound


def one_odd_coefficient(odd):
    """24 distinct terms of 3 x 2 -> 4 (dense enough for the route), scales in [-2, 2] but one ``odd``."""
    i = torch.arange(24)
    scale = torch.linspace(-2.0, 2.0, 24, dtype=torch.float64)
    scale[5] = odd
    return product_infos(i % 3, i // 12, i % 4, scale, 3, 2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision(dtype, routed):
    """Error bound, not a measured tolerance: the output rounds once to ``dtype`` (eps/2 of sum|terms|) after fp32
    sums along a chain of at most P2 (the dot) + P1 (the rows of x) + 2 roundings, each at most eps32 of
    sum|terms|, plus for fp16 the coefficients' two scaled fp16 halves (the kernel's split path: fp16 is not upcast on
    the interpreter), which miss at most 2**-16 of each. bf16 runs as an fp32 upcast on the interpreter
    and tf32x3 as fp32: tests/sparse/gpu_cases.py bounds the tensor cores' products (matrix_unit_chain)."""
    infos = STRUCTURES["random_70_out"]
    info = infos[0]
    x, y = inputs(infos, "batched", dtype=dtype, seed=2)
    z = _triton(x, y, infos)
    assert z.dtype == dtype and routed
    error, bound = error_and_bound(z, x, y, info)
    assert (error <= bound + 1e-30).all()


def test_gradcheck_and_gradgradcheck(routed, triton_only, orientation):
    """First and second derivatives through the route (gx is a mul of (gz, y), gy one of (gz, x)): every launch of
    the derivatives' forwards takes it. Triton stays forced while autograd runs the backward (``triton_only``)."""
    infos = random_product_infos(3, 4, 5, 30, torch.Generator().manual_seed(3))
    x, y = inputs(infos, "batched", batch=2, channels=2, requires_grad=True)
    z = _triton(x, y, infos)
    assert len(routed) == 1
    torch.autograd.grad(z.sum(), (x, y))
    assert len(routed) == 3  # the forward, gx and gy
    assert torch.autograd.gradcheck(lambda a, b: sparse_product("mul", a, b, infos), (x, y), fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda a, b: sparse_product("mul", a, b, infos), (x, y), fast_mode=True)


def test_shared_input_gradient_keeps_the_segment_kernel(routed):
    """A shared x's gradient is summed over the batch (out_accumulated): the segment kernel's batch split runs it,
    the forward and the batched y's gradient take the route."""
    infos = STRUCTURES["cg_1x2"]
    x, y = inputs(infos, "shared_x", requires_grad=True)
    with use_implementation("triton"):
        z = sparse_product("mul", x, y, infos)
        gx, gy = torch.autograd.grad(z, (x, y), torch.ones_like(z))
    assert len(routed) == 2
    with use_implementation("split"):
        z_ref = sparse_product("mul", x, y, infos)
        ex, ey = torch.autograd.grad(z_ref, (x, y), torch.ones_like(z_ref))
    torch.testing.assert_close(gx, ex, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gy, ey, rtol=1e-12, atol=1e-12)


def test_batch_sum_keeps_the_segment_kernel(routed):
    infos = STRUCTURES["cg_1x2"]
    x, y = inputs(infos, "batched")
    z = _triton(x, y, infos, out_accumulated=True)
    assert not routed
    torch.testing.assert_close(z, sparse_product_reference("mul", x, y, infos[0], True), rtol=1e-12, atol=1e-12)


def test_fp16_takes_the_route_with_coefficients_out_of_its_range(routed):
    """Coefficients that fp16 cannot hold as they are (1e-6 in its subnormals, 1e5 past 65504) among +-2: the split
    scales them by a power of two into range (kernels/split_matmul.split_fp32), fp16 mul takes the route, and the
    result is the float64 one to within an fp16 rounding of the output, the fp32 chain and the split's 2**-16."""
    for odd, inputs_scale in ((1e-6, 1.0), (1e5, 2.0 ** -6)):  # (the inputs scaled down so that z fits fp16)
        infos = one_odd_coefficient(odd)
        _, _, split_scale = infos[0].dense_rows["gram"].splits[torch.float16]
        assert float(split_scale) == 2.0 ** (int(torch.frexp(infos[0].scale.abs().max())[1]) - 15)
        x, y = (t * inputs_scale for t in inputs(infos, "batched", dtype=torch.float16, seed=6))
        routed.clear()
        z = _triton(x, y, infos)
        assert len(routed) == 1 and z.dtype == torch.float16
        error, bound = error_and_bound(z, x, y, infos[0])
        subnormal = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps / 2  # small outputs
        assert (error <= bound + subnormal).all(), odd


def test_fp16_keeps_the_segment_kernel_where_its_halves_lose_precision(routed):
    """Coefficients spanning more than fp16's scaled halves can hold (1.2e-9 among +-2: the low half of the smallest
    falls below fp16's subnormals): no fp16 split, so fp16 mul runs on the segment kernel (fp32 scales), correctly;
    bf16 and fp64 take the route."""
    infos = one_odd_coefficient(1.2345678e-9)
    assert set(infos[0].dense_rows["gram"].splits) == {torch.bfloat16}
    x, y = inputs(infos, "batched", dtype=torch.float16, seed=6)
    z = _triton(x, y, infos)
    assert not routed
    expected = sparse_product_reference("mul", x.double(), y.double(), infos[0])
    torch.testing.assert_close(z.double(), expected, rtol=2e-3, atol=0)  # one fp16 rounding of the output
    _triton(x.double(), y.double(), infos)
    assert routed


def test_route_rules():
    """The route needs the gram table's matrix form, one operand of at most MAX_HELD rows and terms at least
    MIN_BILINEAR_DENSITY of its multiply-adds, and for fp32 FP32_MIN_TERMS_PER_ROW terms an output row; mul only,
    and not summed over the batch."""
    x3, y3 = torch.zeros(2, 5, 3), torch.zeros(2, 7, 3)
    infos = STRUCTURES["random_70_out"]
    assert triton_ops._bilinear_table("mul", x3, y3, infos[0], False) is infos[0].dense_rows["gram"]
    assert triton_ops._bilinear_table("mul", x3, y3, infos[0], True) is None
    assert triton_ops._bilinear_table("mul", x3[0], y3[0], infos[0], True) is not None  # both shared: no batch sum
    with triton_ops.bilinear_route(False):
        assert triton_ops._bilinear_table("mul", x3, y3, infos[0], False) is None
    # 5 terms of a 1 x 100 -> 1 structure: 16 x 100 x 16 multiply-adds as tl.dot pads it, 1/5120 of them terms
    zero = torch.zeros(5, dtype=torch.int64)
    thin = product_infos(zero, torch.arange(5) * 20, zero, None, 1, 100, 1)
    assert thin[0].dense_rows["gram"].matrix is not None
    assert triton_ops._bilinear_table("mul", torch.zeros(2, 1, 3), torch.zeros(2, 100, 3), thin[0], False) is None
    # fp32 from FP32_MIN_TERMS_PER_ROW terms a row (CG L 2: 15; L 3: 38); bf16 and fp64 at any count
    for l_max, fp32 in ((2, False), (3, True)):
        cg_info = cg_product_infos(l_max, l_max, l_max)[0]
        size_l = (l_max + 1) ** 2
        for dtype, routed in ((torch.float32, fp32), (torch.bfloat16, True), (torch.float64, True)):
            a = torch.zeros(2, size_l, 3, dtype=dtype)
            assert (triton_ops._bilinear_table("mul", a, a, cg_info, False) is not None) == routed, (l_max, dtype)
    size = sparse_bilinear.MAX_HELD + 1
    wide = random_product_infos(size, size, 4, 1100, torch.Generator().manual_seed(1))  # no operand fits the held tile
    assert wide[0].dense_rows["gram"].matrix is not None
    x, y = torch.zeros(2, size, 3), torch.zeros(2, size, 3)
    assert triton_ops._bilinear_table("mul", x, y, wide[0], False) is None


def test_bad_arguments_fail_clearly():
    matrix = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="coefficients"):
        sparse_bilinear.bilinear_launch(torch.zeros(2, 2, 3), torch.zeros(2, 4, 3), matrix, 4)
    with pytest.raises(ValueError, match="batches 2 and 3"):
        sparse_bilinear.bilinear_launch(torch.zeros(2, 2, 3), torch.zeros(3, 3, 3), matrix, 4)
    with pytest.raises(ValueError, match="one C"):
        sparse_bilinear.bilinear_launch(torch.zeros(2, 2, 3), torch.zeros(2, 3, 4), matrix, 4)
    with pytest.raises(ValueError, match="float32 coefficients"):
        sparse_bilinear.bilinear_launch(torch.zeros(2, 2, 3), torch.zeros(2, 3, 3), matrix.double(), 4)
    with pytest.raises(ValueError, match="one input dtype"):
        sparse_bilinear.bilinear_launch(torch.zeros(2, 2, 3), torch.zeros(2, 3, 3, dtype=torch.float64), matrix, 4)
    big = sparse_bilinear.MAX_HELD + 1
    with pytest.raises(ValueError, match="at most"):
        sparse_bilinear.bilinear_launch(torch.zeros(1, big, 1), torch.zeros(1, big, 1), torch.zeros(big * big, 1), 1)


def test_coefficient_splits():
    """16-bit inputs' coefficients as scale (hi + lo) in their dtype (kernels/split_matmul.split_fp32), missing at most
    2**-16 of each (fp16 scaled into its range by a power of two, bf16 unscaled), made once per gram table; where
    fp16's halves would miss more (coefficients spanning more than 2**22) or a coefficient is not finite, no split."""
    generator = torch.Generator().manual_seed(0)
    for low, high, dtypes in ((-1, 6, {torch.bfloat16, torch.float16}), (-7, 7, {torch.bfloat16})):
        magnitudes = 10.0 ** torch.arange(low, high).repeat(100)  # [0.05, 1e5) past fp16's 65504; then [5e-8, 1e6)
        signs = torch.randint(0, 2, (magnitudes.numel(),), generator=generator) * 2 - 1
        values = (signs * (0.5 + 0.5 * torch.rand(magnitudes.numel(), generator=generator)) * magnitudes).float()
        splits = sparse_bilinear.coefficient_splits(values)
        assert set(splits) == dtypes
        for dtype, (hi, lo, scale) in splits.items():
            assert hi.dtype == lo.dtype == dtype and (scale is None) == (dtype == torch.bfloat16)
            factor = 1.0 if scale is None else float(scale)
            assert factor == 2.0 ** round(math.log2(factor))  # a power of two: exact
            error = ((hi.double() + lo.double()) * factor - values.double()).abs()
            assert (error <= 2.0 ** -16 * values.double().abs()).all(), dtype
    assert values.abs().max() > 65504
    for bad in (float("inf"), float("nan")):
        assert sparse_bilinear.coefficient_splits(torch.tensor([1.0, bad])) == {}
    with pytest.raises(ValueError, match="would miss more than"):  # a direct call checks too
        ones = torch.ones(1, 1, 1, dtype=torch.float16)
        sparse_bilinear.bilinear_launch(ones, ones.expand(1, 2, 1), torch.tensor([[1.0], [1e-9]]), 1)
    table = STRUCTURES["cg_1x2"][0].dense_rows["gram"]
    assert set(table.splits) == {torch.bfloat16, torch.float16}
    assert all(torch.equal(h, sparse_bilinear.coefficient_splits(table.matrix32)[d][0])
               for d, (h, _, _) in table.splits.items())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's 0 x inf, the point here
def test_non_finite_inputs_stay_non_finite(routed):
    """An inf in y[n, j, c]: on the route the outputs of column (n, c) that its coefficient block reaches are NaN
    (0 x inf: see the module), never finite where a term reads it; every other column is the segment kernel's."""
    infos = STRUCTURES["cg_1x2"]
    x, y = inputs(infos, "batched", seed=8)
    y[1, 5, 2] = float("inf")
    z = _triton(x, y, infos)
    assert routed
    with triton_ops.bilinear_route(False):
        segment = _triton(x, y, infos)
    reads = ~torch.isfinite(segment[1, :, 2])  # the outputs whose terms read the inf
    assert reads.any() and not torch.isfinite(z[1, :, 2][reads]).any()
    others = torch.ones_like(z, dtype=torch.bool)
    others[1, :, 2] = False
    torch.testing.assert_close(z[others], segment[others], rtol=1e-12, atol=1e-12)


def test_bitwise_deterministic(routed):
    infos = STRUCTURES["random_70_out"]
    x, y = inputs(infos, "batched", dtype=torch.float32, seed=4)
    assert torch.equal(_triton(x, y, infos), _triton(x, y, infos))
    assert len(routed) == 2
