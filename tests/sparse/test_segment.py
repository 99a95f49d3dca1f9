"""The Triton CSR segment kernels of the sparse operator (attnbench/kernels/sparse/segment.py) on the interpreter, against
the float64 dense reference: every product and SparseScale, batched and shared inputs on each side,
out_accumulated on and off, float64/float32/float16/bfloat16, odd channel counts, empty structures; gradcheck and
gradgradcheck through the Functions with the Triton implementation forced (so the backward kernels are Triton
too); determinism; torch.compile and vmap over the custom ops.

The interpreter config uses blocks of 2 (batch, channels, contraction), so BATCH = 3 and C = 3 span two
blocks with a masked tail and C = 17 spans nine. Outputs are NaN-poisoned, so an output element the kernels
forget (the rows outside index_out included) fails. Sizes are tiny: the interpreter costs ~0.05-0.3 s a launch.
"""
import dataclasses

import pytest
import torch

from attnbench.kernels import poisoned_outputs
from attnbench.sparse import (CHANNEL_RANKS, functional, product_infos, random_product_infos, random_scale_infos,
                              scale_infos, sparse_mul, sparse_outer, sparse_product, sparse_product_reference,
                              sparse_scale, sparse_scale_reference, use_implementation)

from .helpers import CHANNELS, SHARING, check_compiled_pipeline, check_product_gradients_match_reference

pytestmark = pytest.mark.interpreter

OPS = list(CHANNEL_RANKS)
SIZE1, SIZE2, SIZE3, TERMS, BATCH = 4, 3, 5, 12, 3
# per op: both inputs batched with and without the batch sum, each side shared, both shared
VALUE_CASES = [("batched", False), ("batched", True), ("shared_x", False), ("shared_y", True), ("shared_both", False)]


@pytest.fixture(scope="module")
def infos():
    """Empty output segments in all three groupings, repeated terms, backward infos through gather_index."""
    return random_product_infos(SIZE1, SIZE2, SIZE3, TERMS, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def scale_info_pair():
    return random_scale_infos(5, 7, 12, torch.Generator().manual_seed(1))


def make_inputs(op, shared_x, shared_y, seed=0, dtype=torch.float64, channels=None, sizes=(SIZE1, SIZE2),
                batch=BATCH, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    cx, cy = channels or CHANNELS[op]

    def tensor(shared, size, chans):
        shape = (() if shared else (batch,)) + (size,) + chans
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    return tensor(shared_x, sizes[0], cx), tensor(shared_y, sizes[1], cy)


def _product(op, x, y, infos, out_accumulated=False):
    with use_implementation("triton"), poisoned_outputs():
        return sparse_product(op, x, y, infos, out_accumulated)


# ---- values against the float64 reference


@pytest.mark.parametrize("op", OPS)
def test_product_matches_reference(infos, op):
    for sharing, out_accumulated in VALUE_CASES:
        x, y = make_inputs(op, *SHARING[sharing])
        z = _product(op, x, y, infos, out_accumulated)
        expected = sparse_product_reference(op, x, y, infos[0], out_accumulated)
        assert z.shape == expected.shape and z.dtype == torch.float64, (sharing, out_accumulated)
        torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12, msg=f"{sharing}, {out_accumulated}")


@pytest.mark.parametrize("rotation", [1, 2])
def test_rotated_infos_with_gather_index(infos, rotation):
    """The backward infos as the forward (gather_index, unsorted term tensors), as every derivative runs them."""
    rotated = infos[rotation:] + infos[:rotation]
    x, y = make_inputs("vecmat", False, True, seed=4, sizes=(rotated[0].size1, rotated[0].size2))
    assert rotated[0].gather_index is not None
    torch.testing.assert_close(_product("vecmat", x, y, rotated), sparse_product_reference("vecmat", x, y, rotated[0]),
                               rtol=1e-12, atol=1e-12)


def _abs_bound(op, x, y, info, out_accumulated):
    """sum of |s x ∘ y| over each output's terms: a bound on |z| and on every partial sum of it."""
    abs_info = dataclasses.replace(info, scale=info.scale.abs())
    return sparse_product_reference(op, x.double().abs(), y.double().abs(), abs_info, out_accumulated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_product_low_precision(infos, op, dtype):
    """Error bound, not a measured tolerance: the kernel accumulates in fp32 (bf16 in the interpreter runs as an
    fp32 upcast) and rounds once to ``dtype``, so |z - z64| <= (eps/2 + T eps32) * sum|terms|; eps * sum|terms|
    covers it (T <= 12 terms a segment here, times N = 3 with the batch sum). The reference is float64 on the
    same (rounded) inputs."""
    eps = torch.finfo(dtype).eps
    # a shared matrix (vecmat's y, mat_t_vec's x) takes the tl.dot route in every precision but fp64
    shared_matrix = {"vecmat": [("shared_y", False)], "mat_t_vec": [("shared_x", False)]}.get(op, [])
    cases = ([("shared_y", False)] if dtype == torch.float32 else []) + shared_matrix + [("batched", True)]
    for sharing, out_accumulated in cases:
        x, y = make_inputs(op, *SHARING[sharing], seed=7, dtype=dtype)
        z = _product(op, x, y, infos, out_accumulated)
        assert z.dtype == dtype
        expected = sparse_product_reference(op, x.double(), y.double(), infos[0], out_accumulated)
        bound = eps * _abs_bound(op, x, y, infos[0], out_accumulated) + 1e-30
        error = (z.double() - expected).abs()
        assert (error <= bound).all(), f"{sharing}: max error / bound {(error / bound).max():.3g}"


@pytest.mark.parametrize("op,channels", [("mul", ((17,), (17,))), ("vecmat", ((17,), (17, 3))),
                                         ("outer", ((1,), (17,))), ("mat_t_vec", ((2, 17), (2,)))])
def test_product_odd_channels(infos, op, channels):
    """17 channels: nine channel tiles (or nine contraction chunks) with a masked tail."""
    x, y = make_inputs(op, False, True, seed=5, channels=channels, batch=1)
    torch.testing.assert_close(_product(op, x, y, infos), sparse_product_reference(op, x, y, infos[0]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_products_walking_every_row(infos, op, monkeypatch, all_rows_launches):
    """ALL_ROWS (a program walks every output row of its batch block: attnbench/kernels/sparse/segment.py; by default mul's
    from 1e4 items) forced for every op at any batch: bitwise the one-row-a-program result (each output's terms
    summed in the same CSR order) and float64's, batched and shared, the backward infos (gather_index) too, 17
    channels in fp32; out_accumulated keeps its batch-split launch. The routes that take some of these products
    elsewhere (dense, fold, outer by dot) off."""
    from attnbench.kernels.sparse import segment as sparse_segment
    from attnbench.sparse import triton_ops

    for switch in (triton_ops.DENSE_ROUTE, triton_ops.FOLD_ROUTE, triton_ops.OUTER_SUM_BY_DOT):
        monkeypatch.setitem(switch, "enabled", False)
    launches = all_rows_launches
    rotated = infos[1:] + infos[:1]  # the first backward info: gather_index, unsorted terms
    runs = [(sharing, infos) for sharing in ("batched", "shared_x", "shared_y")] + [("batched", rotated)]
    for sharing, run_infos in runs:
        x, y = make_inputs(op, *SHARING[sharing], seed=11, sizes=(run_infos[0].size1, run_infos[0].size2))
        results = []
        for enabled in (True, False):
            monkeypatch.setitem(sparse_segment.ALL_ROWS, "enabled", enabled)
            del launches[:]
            results.append(_product(op, x, y, run_infos))
            assert launches and all(k["ALL_ROWS"] == enabled for k in launches), (sharing, enabled, launches)
        assert torch.equal(results[0], results[1]), sharing
        torch.testing.assert_close(results[0], sparse_product_reference(op, x, y, run_infos[0]), rtol=1e-12,
                                   atol=1e-12, msg=sharing)
    channels = {"outer": ((1,), (17,)), "vecmat": ((17,), (17, 3)), "mat_t_vec": ((2, 17), (2,)), "vecsca": ((17,), ()),
                "scavec": ((), (17,))}.get(op, ((17,), (17,)))
    x, y = make_inputs(op, False, False, seed=12, channels=channels, dtype=torch.float32)
    monkeypatch.setitem(sparse_segment.ALL_ROWS, "enabled", True)
    del launches[:]
    z = _product(op, x, y, infos)
    assert [k["ALL_ROWS"] for k in launches] == [True]
    bound = torch.finfo(torch.float32).eps * _abs_bound(op, x, y, infos[0], False) + 1e-30
    assert ((z.double() - sparse_product_reference(op, x.double(), y.double(), infos[0])).abs() <= bound).all()
    del launches[:]
    _product(op, x, y, infos, out_accumulated=True)
    assert [k["ALL_ROWS"] for k in launches] == [False]


def test_all_rows_defaults_to_mul_from_1e4_items():
    """By default only mul walks the rows (the op it was measured on), from 1e4 batch items, and never a batch sum
    or the shared-matrix tl.dot route."""
    from attnbench.kernels.sparse.segment import walks_all_rows

    assert walks_all_rows("mul", 10_000) and walks_all_rows("mul", 10 ** 6)
    assert not walks_all_rows("mul", 9_999)
    assert not any(walks_all_rows(op, 10 ** 6) for op in OPS if op != "mul")
    assert not walks_all_rows("mul", 10 ** 6, accumulate=True) and not walks_all_rows("mul", 10 ** 6, dot=True)


@pytest.mark.parametrize("shape,dtype", [((5, 3), torch.float64), ((3, 5, 3), torch.float64),
                                         ((2, 1, 5, 17), torch.float64), ((3, 5, 3), torch.float32)])
def test_scale_matches_reference(scale_info_pair, shape, dtype):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with use_implementation("triton"), poisoned_outputs():
        y = sparse_scale(x, *scale_info_pair)
    expected = sparse_scale_reference(x.double(), scale_info_pair[0])
    assert y.shape == expected.shape and y.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6  # fp32: <= 12 terms of |s x| < 4 each, eps32 = 1.2e-7
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def long_rows_pair():
    """13 terms into 4 rows (3.25 a row: the batched kernel, channels folded into lines) and the transpose, 13 rows
    of one term on average (the row-tile kernel unless the lines come in a power-of-two count)."""
    return random_scale_infos(13, 4, 13, torch.Generator().manual_seed(7))


def test_scale_folds_wide_channels_of_a_batch_of_one(long_rows_pair, triton_only):
    """SparseScale on [M, C] (no batch) runs as [C / line, M, line] (kernels/sparse_segment.channel_line): values
    against float64 for a few foldable widths (first and second derivatives: the test below)."""
    from attnbench.kernels.sparse.segment import channel_line

    assert channel_line(1, 2048, 1) == 64 and channel_line(1, 96, 1) == 32 and channel_line(1, 48, 1) == 16
    assert channel_line(1, 64, 1) == 32  # two lines at least
    assert channel_line(2, 2048, 1) == 0 and channel_line(1, 2048, 3) == 0 and channel_line(1, 17, 1) == 0
    for shape in [(13, 128), (1, 13, 96), (13, 48)]:
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        with poisoned_outputs():
            y = sparse_scale(x, *long_rows_pair)
        torch.testing.assert_close(y, sparse_scale_reference(x, long_rows_pair[0]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("check", ["gradcheck", "gradgradcheck"])
def test_scale_folds_wide_channels_of_a_batch_of_one_derivatives(long_rows_pair, triton_only, check):
    """The folded [M, C] SparseScale's first and second derivatives through the kernels (the backward's short rows:
    3 lines of 16, so the row-tile kernel); one check a test, as xdist spreads them."""
    x = torch.randn(13, 48, dtype=torch.float64, requires_grad=True)
    assert getattr(torch.autograd, check)(lambda a: sparse_scale(a, *long_rows_pair), (x,), fast_mode=True)


# (info, x's shape, the row-tile kernel?, else the batched kernel's batch: lines of a folded row, or the batch); info
# "short": 1 term a row on average, "long": 3.25
SCALE_ROUTES = [("short", (9, 5), True, None), ("short", (1, 9, 96), True, None), ("long", (13, 96), False, 3),
                ("long", (13, 5), False, 1), ("short", (2, 9, 5), False, 2), ("short", (9, 128), True, None),
                ("short", (9, 1024), False, 16), ("long", (13, 128), False, 2)]


@pytest.mark.parametrize("info_name,shape,rows_kernel,batch", SCALE_ROUTES, ids=str)
def test_scale_routes_of_a_batch_of_one(spy_kernel, triton_only, info_name, shape, rows_kernel, batch):
    """SparseScale on [M, C]: rows of one or two terms on average (a segment sum's backward) take the row-tile
    kernel, also where the channels fold into a power-of-two count of a few lines (128: two of 64), but not of
    LINES_OVER_ROWS or more (1024: 16 of 64); longer rows the batched one with channels folded into lines; both
    against float64, with empty rows and repeated terms, odd and foldable channel counts, and the batched kernel
    for a real batch. One route a test (the 1024 channels' took most of the time of all eight)."""
    from attnbench.kernels.sparse import segment as sparse_segment

    spies = {name: spy_kernel(sparse_segment, name) for name in ("sparse_scale_rows_kernel", "sparse_scale_kernel")}
    short = random_scale_infos(9, 13, 13, torch.Generator().manual_seed(6))[0]  # 1 term a row on average
    long = random_scale_infos(13, 4, 13, torch.Generator().manual_seed(7))[0]  # 3.25
    assert sparse_segment.terms_per_row(13, 13) == 1 and sparse_segment.terms_per_row(13, 4) == 4
    info = {"short": short, "long": long}[info_name]
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with poisoned_outputs():
        y = sparse_segment.sparse_scale_launch(x, info)
    torch.testing.assert_close(y, sparse_scale_reference(x, info), rtol=1e-12, atol=1e-12)
    ran = {name: spy.launches for name, spy in spies.items()}
    assert (ran["sparse_scale_rows_kernel"] > 0) == rows_kernel and (ran["sparse_scale_kernel"] > 0) != rows_kernel
    if not rows_kernel:  # N, the kernel's batch: 3 lines of 32 for 96 folded channels, 2 (16) of 64 for 128 (1024)
        assert spies["sparse_scale_kernel"].args[-1][5] == batch


def test_scale_row_tiles_of_strided_channels_and_no_scale(spy_kernel, long_rows_pair, triton_only):
    """The row-tile kernel on x whose channels are not contiguous (a transposed [M, C], every other channel) and
    on an info without scales (scale None: 1, never the dummy pointer the launcher passes), against float64."""
    from attnbench.kernels.sparse import segment as sparse_segment

    spy = spy_kernel(sparse_segment, "sparse_scale_rows_kernel")
    short = long_rows_pair[1]
    unscaled = dataclasses.replace(short, scale=None)
    generator = torch.Generator().manual_seed(9)
    transposed = torch.randn(5, 4, dtype=torch.float64, generator=generator).t()  # [4, 5], channel stride 4
    every_other = torch.randn(4, 10, dtype=torch.float64, generator=generator)[:, ::2]
    for info in (short, unscaled):
        for x in (transposed, every_other):
            launches = spy.launches
            with poisoned_outputs():
                y = sparse_segment.sparse_scale_launch(x, info)
            assert spy.launches > launches
            torch.testing.assert_close(y, sparse_scale_reference(x, info), rtol=1e-12, atol=1e-12)


def test_scale_of_an_empty_input_size(triton_only):
    """in_size 0 (no term can exist): the output rows are zeros, batched or not, as the split implementation's."""
    empty = torch.zeros(0, dtype=torch.int64)
    infos = scale_infos(empty, empty, None, 0, 3)
    for shape in [(0, 5), (2, 0, 5)]:
        with poisoned_outputs():
            y = sparse_scale(torch.randn(shape, dtype=torch.float64), *infos)
        assert y.shape == (*shape[:-2], 3, 5) and bool((y == 0).all())


def test_batch_splits_of_a_batch_sum():
    """out_accumulated: enough batch ranges to fill the GPU, each of 256 items at least, within the caps."""
    from attnbench.kernels.sparse.segment import MAX_BATCH_SPLITS, PROGRAMS_PER_SM, batch_splits

    assert batch_splits(100_000, rows=9, cz=1024, sms=132) == -(-PROGRAMS_PER_SM * 132 // (9 * 16))
    assert batch_splits(1_000, rows=9, cz=1024, sms=132) == 4  # 256 items a range at least
    assert batch_splits(10**6, rows=1, cz=1, sms=132) == MAX_BATCH_SPLITS
    assert batch_splits(10**6, rows=10_000, cz=64, sms=132) == 1  # the rows alone fill the GPU
    assert batch_splits(3, rows=5, cz=1, sms=4, device_type="cpu") == 2


def test_empty_structure_gives_zeros(triton_only):
    empty = torch.zeros(0, dtype=torch.int64)
    infos = product_infos(empty, empty, empty, None, SIZE1, SIZE2, SIZE3)
    x, y = make_inputs("outer", False, True, requires_grad=True)
    with poisoned_outputs():
        z = sparse_outer(x, y, infos)
        assert z.shape == (BATCH, SIZE3, 3, 2) and not z.any()
        gx, gy = torch.autograd.grad(z.sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape and not gx.any() and not gy.any()
    scaling = random_scale_infos(4, 3, 0, torch.Generator().manual_seed(0))
    with poisoned_outputs():
        assert not sparse_scale(torch.randn(2, 4, 3, dtype=torch.float64), *scaling).any()


# ---- derivatives: float64, the Functions on Triton only (fast gradcheck: random projections of the Jacobian,
# since full gradgradcheck takes hundreds of interpreter launches per op; the split tests run the full checks)


GRAD_CASES = [("batched", False), ("shared_x", True), ("shared_y", False), ("shared_both", False)]
# smaller than CHANNELS (one channel tile each): the exact gradient test below covers the full sizes
GRAD_CHANNELS = {
    "mul": ((2,), (2,)), "outer": ((2,), (1,)), "inner": ((2,), (2,)), "vecmat": ((2,), (2, 1)),
    "vecsca": ((2,), ()), "scavec": ((), (2,)), "mat_t_vec": ((2, 1), (2,)),
}


@pytest.fixture(scope="module")
def small_infos():
    """Three outputs of 3 rows (one empty in each grouping) and 6 terms, one of them repeated."""
    return random_product_infos(3, 3, 3, 6, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("op", OPS)
def test_product_gradcheck_and_gradgradcheck(small_infos, op, triton_only):
    infos = small_infos
    sharing, out_accumulated = GRAD_CASES[OPS.index(op) % len(GRAD_CASES)]  # every case, spread over the ops
    x, y = make_inputs(op, *SHARING[sharing], channels=GRAD_CHANNELS[op], sizes=(3, 3), batch=2,
                       requires_grad=True)

    def fn(a, b):
        return sparse_product(op, a, b, infos, out_accumulated)

    assert torch.autograd.gradcheck(fn, (x, y), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (x, y), fast_mode=True)


def test_product_gradients_match_reference(infos, triton_only):
    """Exact first derivatives of every op (x batched, y shared: gy sums over the batch) against autograd
    through the einsum reference."""
    check_product_gradients_match_reference(infos, make_inputs, OPS)


def test_scale_gradcheck_and_gradgradcheck(scale_info_pair, triton_only):
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sparse_scale(a, *scale_info_pair), (x,), fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda a: sparse_scale(a, *scale_info_pair), (x,), fast_mode=True)


# ---- determinism, dispatch, torch.compile, vmap


@pytest.mark.parametrize("op", ["mul", "outer", "inner", "vecmat"])  # each code path of the kernel's OP switch
def test_deterministic(infos, op):
    """No atomics anywhere: two runs are bitwise equal (the batch-summing path too, by construction: it loops over
    the batch inside the program; checked once, on outer)."""
    cases = [("batched", False)] + ([("shared_x", True)] if op == "outer" else [])
    for sharing, out_accumulated in cases:
        x, y = make_inputs(op, *SHARING[sharing], seed=3)
        assert torch.equal(_product(op, x, y, infos, out_accumulated), _product(op, x, y, infos, out_accumulated))


def test_implementation_choice():
    x = torch.zeros(2)
    assert functional.implementation_for(x) == "split"  # CPU tensors default to split, CUDA ones to Triton
    with use_implementation("triton"):
        assert functional.implementation_for(x) == "triton"
        with use_implementation(None):
            assert functional.implementation_for(x) == "split"
    with pytest.raises(ValueError, match="unknown sparse implementation"):
        with use_implementation("cuda"):
            pass


def test_torch_compile_fullgraph_on_triton(infos, triton_only):
    """The launches are custom ops with fake implementations: Dynamo traces the Functions (forward and the
    backward's sibling Functions) without graph breaks (the graph of tests/sparse/test_ops.py's compile test)."""
    x, y = make_inputs("outer", False, True, requires_grad=True)
    w = torch.randn(BATCH, SIZE2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    check_compiled_pipeline(infos, x, y, w)


def test_vmap_over_the_custom_op(infos, triton_only):
    x, y = make_inputs("mul", False, True)
    xs = torch.randn(2, *x.shape, dtype=torch.float64)
    zs = torch.func.vmap(lambda a: sparse_mul(a, y, infos))(xs)
    torch.testing.assert_close(zs, torch.stack([sparse_product_reference("mul", a, y, infos[0]) for a in xs]))
