"""outer summed over the batch on matrix units (attnbench/kernels/sparse/outer_sum.py), on the interpreter: the fully
connected layer's weight gradient. Against float64 with a priori bounds; the route asserted (a spy on its
launcher) and refused where it does not apply (fp64, a shared input, the switch off); odd channel counts over
several tiles, a batch over several splits, the backward infos' gather_index, strided views (and the compact copy
of channel strides past 32 bits), an empty batch, scale None, a structure without terms, rows launched in chunks,
determinism, the FC layer's first and second derivatives and torch.compile.

The interpreter config uses blocks of 2 (batch, both channel dims), so C1 = 5, C2 = 3 span three and two tiles
with masked tails, and N = 7 four batch blocks over several splits (``batch_splits`` leaves 2 items a split on
the CPU). Outputs are NaN-poisoned, so an element the kernel misses fails.
"""
import dataclasses

import pytest
import torch

from attnbench.kernels import poisoned_outputs
from attnbench.kernels.sparse import outer_sum as sparse_outer_sum
from attnbench.kernels.sparse.segment import compact_channels
from attnbench.sparse import (product_infos, product_terms, random_product_infos, sparse_outer, sparse_product,
                              sparse_product_reference, sparse_vecmat, triton_ops, use_implementation)
from attnbench.bench.verify import gamma

pytestmark = pytest.mark.interpreter

SIZES = (4, 3, 5)  # size1 (x's rows), size2 (y's rows), size3 (z's rows)
U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def infos():
    """Empty output segments, repeated terms, backward infos through gather_index."""
    return random_product_infos(*SIZES, 14, torch.Generator().manual_seed(3))


@pytest.fixture
def launches(monkeypatch):
    """Counts the matrix-unit route's launches (the dtypes they saw: bf16 runs as an fp32 upcast on the
    interpreter)."""
    calls = []
    launcher = triton_ops.outer_sum_launch

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "outer_sum_launch", spy)
    return calls


def _inputs(batch, c1, c2, dtype, seed=0, sizes=SIZES):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, sizes[0], c1, generator=generator, dtype=torch.float64).to(dtype)
    y = torch.randn(batch, sizes[1], c2, generator=generator, dtype=torch.float64).to(dtype)
    return x, y


def _batch_sum(x, y, infos):
    with use_implementation("triton"), poisoned_outputs():
        return sparse_outer(x, y, infos, out_accumulated=True)


def _bound(x, y, info, dtype):
    """|z - z64| <= (u_out + gamma_m(u32)) A, A = sum of |s x y| over each output's terms and the batch: an fp32
    accumulation of at most m = N T + 2 roundings (the batch and the row's terms, the scale's multiply, the
    partials' sum), then one rounding to a 16-bit output."""
    abs_info = dataclasses.replace(info, scale=info.scale.abs())
    a = sparse_product_reference("outer", x.double().abs(), y.double().abs(), abs_info, True)
    longest = int(info.seg_out.diff().max())
    u_out = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    return (u_out + gamma(x.shape[0] * longest + 2, U32)) * a + 1e-300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotation", [0, 1, 2])
def test_batch_sum_within_its_bound(infos, launches, dtype, rotation):
    """Every info of the family (1 and 2: the backward's, with gather_index), odd channels, batch splits."""
    rotated = infos[rotation:] + infos[:rotation]
    info = rotated[0]
    x, y = _inputs(7, 5, 3, dtype, seed=rotation, sizes=(info.size1, info.size2))
    z = _batch_sum(x, y, rotated)
    assert len(launches) == 1
    expected = sparse_product_reference("outer", x.double(), y.double(), info, True)
    assert z.shape == expected.shape == (info.out_size, 5, 3) and z.dtype == dtype
    error = (z.double() - expected).abs()
    bound = _bound(x, y, info, dtype)
    assert (error <= bound).all(), f"max error / bound {(error / bound).max():.3g}"


def test_segment_kernel_where_the_route_does_not_apply(infos, launches):
    """fp64 (no fp64 dot), a shared input, no batch sum, the switch off: the segment kernel, same values."""
    x, y = _inputs(3, 3, 2, torch.float64)
    reference = sparse_product_reference("outer", x, y, infos[0], True)
    torch.testing.assert_close(_batch_sum(x, y, infos), reference, rtol=1e-12, atol=1e-12)
    x32, y32 = x.float(), y.float()
    _batch_sum(x32[0], y32, infos)
    with use_implementation("triton"):
        sparse_outer(x32, y32, infos)
    with triton_ops.outer_sum_by_dot(False):
        off = _batch_sum(x32, y32, infos)
    assert launches == []
    on = _batch_sum(x32, y32, infos)
    assert len(launches) == 1
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)


def test_strided_inputs(infos, launches):
    """Channel-strided and batch-innermost views are read in place."""
    x, y = _inputs(5, 4, 3, torch.float32, seed=9)
    x_t = x.permute(2, 1, 0).contiguous().permute(2, 1, 0)  # batch innermost
    y_s = torch.stack([y, y], -1).flatten(-2)[..., ::2]  # channel stride 2
    assert not x_t.is_contiguous() and not y_s.is_contiguous()
    z = _batch_sum(x_t, y_s, infos)
    assert len(launches) == 1
    torch.testing.assert_close(z, _batch_sum(x, y, infos), rtol=0, atol=0)


def test_without_scales_and_without_terms(infos, launches):
    """scale None (every term 1) and a structure without terms (zeros, every row written)."""
    i1, i2, i3, _ = product_terms(infos[0])
    unscaled = product_infos(i1, i2, i3, None, *SIZES)
    x, y = _inputs(5, 3, 4, torch.float32, seed=6)
    expected = sparse_product_reference("outer", x.double(), y.double(), unscaled[0], True)
    torch.testing.assert_close(_batch_sum(x, y, unscaled).double(), expected, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, dtype=torch.int64)
    z = _batch_sum(x, y, product_infos(empty, empty, empty, None, *SIZES))
    assert len(launches) == 2 and z.shape == (SIZES[2], 3, 4) and not z.any()


@pytest.mark.parametrize("rotation", [0, 1, 2])
def test_rows_launch_in_chunks(infos, launches, monkeypatch, rotation):
    """CUDA caps grid axis 1 (the rows) at 65535 programs: the launcher walks the rows in chunks (two rows here)."""
    monkeypatch.setattr(sparse_outer_sum, "MAX_GRID_YZ", 2)
    rotated = infos[rotation:] + infos[:rotation]
    x, y = _inputs(4, 3, 2, torch.float32, seed=8, sizes=(rotated[0].size1, rotated[0].size2))
    expected = sparse_product_reference("outer", x.double(), y.double(), rotated[0], True)
    torch.testing.assert_close(_batch_sum(x, y, rotated).double(), expected, rtol=1e-5, atol=1e-5)
    assert len(launches) == 1


def test_wide_channel_strides_are_copied_compact():
    """Channel offsets are int32 in the kernels: a batch-innermost x whose channel span passes 2**31 - 1 (N M C >
    2**31) is copied compact before launch (meta tensors: the decision alone, no 10 GB buffer)."""
    wide = torch.empty_strided((4, 1, 160), (1, 4, 2 ** 24), device="meta")
    assert compact_channels(wide, 1).is_contiguous()
    narrow = torch.empty_strided((4, 1, 120), (1, 4, 2 ** 24), device="meta")
    assert compact_channels(narrow, 1) is narrow


def test_deterministic_and_empty(infos, launches):
    x, y = _inputs(7, 3, 3, torch.bfloat16, seed=5)
    assert torch.equal(_batch_sum(x, y, infos), _batch_sum(x, y, infos))
    empty_batch = _batch_sum(x[:0], y[:0], infos)
    assert empty_batch.shape == (SIZES[2], 3, 3) and not empty_batch.any()


def test_fc_layer_derivatives(infos, launches):
    """vecmat with a shared weight (the FC layer) in fp32, to second order: its weight gradient (a batch sum of
    outer products) and the double backward's weight term take the route, and every output matches autograd
    through the float64 reference within the fp32 accumulation bound of the longest chain (batch x terms, the
    contracted channels, a few roundings more), against the same derivatives on absolute values."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(6, SIZES[0], 4, generator=generator, dtype=torch.float64)
    w = torch.randn(SIZES[1], 4, 3, generator=generator, dtype=torch.float64)
    g = torch.randn(6, SIZES[2], 3, generator=generator, dtype=torch.float64)
    hx, hw = torch.randn_like(x), torch.randn_like(w)

    def derivatives(fn, a, b, gz, ha, hb):
        a, b, gz = (t.detach().requires_grad_() for t in (a, b, gz))
        first = torch.autograd.grad(fn(a, b), (a, b), gz, create_graph=True)
        second = torch.autograd.grad(first, (a, b, gz), (ha.to(a.dtype), hb.to(a.dtype)))
        return [t.detach().double() for t in (*first, *second)]

    def reference(info):
        return lambda a, b: sparse_product_reference("vecmat", a, b, info)

    with use_implementation("triton"), poisoned_outputs():  # the backward passes too
        got = derivatives(lambda a, b: sparse_vecmat(a, b, infos), x.float(), w.float(), g.float(), hx, hw)
    assert len(launches) == 2  # grad_w, and the double backward's d<hx, grad_x>/dw
    expected = derivatives(reference(infos[0]), x, w, g, hx, hw)
    abs_info = dataclasses.replace(infos[0], scale=infos[0].scale.abs())
    absolute = derivatives(reference(abs_info), x.abs(), w.abs(), g.abs(), hx.abs(), hw.abs())
    chain = x.shape[0] * int(max(i.seg_out.diff().max() for i in infos)) + x.shape[-1] + 8
    names = ("grad_x", "grad_w", "ggrad_x", "ggrad_w", "ggrad_g")
    for name, out, ref, a in zip(names, got, expected, absolute):
        bound = 2 * gamma(chain, U32) * a + 1e-300
        error = (out - ref).abs()
        assert (error <= bound).all(), f"{name}: max error / bound {(error / bound).max():.3g}"


def test_torch_compile_fullgraph(infos, launches):
    """The route's switch is an argument of the custom op, decided before it: Dynamo traces through."""
    x, y = _inputs(3, 3, 2, torch.float32, seed=2)

    def fn(a, b):
        return sparse_product("outer", a, b, infos, True).square().sum()

    torch._dynamo.reset()
    with use_implementation("triton"):
        eager = fn(x, y)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, y)
    torch._dynamo.reset()
    assert len(launches) == 2  # the eager call and the compiled one
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
