"""The channel-wise kernels of vecsca, scavec and inner (attnbench/kernels/sparse/channelwise.py) on the interpreter:
the unrolled programs against the tables they come from, the Clebsch-Gordan structures they are for (L 2-3) against
the float64 reference in every mode, strided and odd-sized operands, where a non-finite entry reaches, and the
cases that keep the other dense kernels. The random small structures of test_dense_route.py run through the route
too (its ``gather_route`` fixture)."""
import pytest
import torch

from attnbench.kernels.sparse import channelwise as cw
from attnbench.sparse import CHANNEL_RANKS, sparse_product, sparse_product_reference, use_implementation
from attnbench.sparse import triton_ops
from attnbench.sparse.info import product_terms
from attnbench.sparse.tensor_product import cg_product_infos
from attnbench.sparse.triton_ops import channelwise

pytestmark = pytest.mark.interpreter

OPS = ("vecsca", "scavec", "inner")


@pytest.fixture(scope="module")
def cg2():
    return cg_product_infos(2, 2, 2)


@pytest.fixture
def launches(monkeypatch):
    calls = []
    launch = triton_ops.channelwise_launch
    monkeypatch.setattr(triton_ops, "channelwise_launch", lambda *a: calls.append(a[0]) or launch(*a))
    return calls


def _inputs(op, info, batch, channels, dtype=torch.float64, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    x = torch.randn((batch, info.size1) + (channels,) * rank_x, generator=generator, dtype=torch.float64)
    y = torch.randn((batch, info.size2) + (channels,) * rank_y, generator=generator, dtype=torch.float64)
    return x.to(dtype).requires_grad_(requires_grad), y.to(dtype).requires_grad_(requires_grad)


def _run(op, x, y, infos):
    with channelwise(True), use_implementation("triton"):
        return sparse_product(op, x, y, infos)


def test_programs_hold_every_coefficient_once(cg2):
    """Each program, read back as a matrix, is its table's float64 matrix form, every entry once; the flags mark
    each row's and pair's first and last entries, and a pairs row with no terms is a zero row of its own."""
    for info in cg2:
        for name in ("pairs1", "pairs2"):
            table = info.dense_rows[name]
            vector_rows = info.size1 if name == "pairs1" else info.size2
            program = table.unrolled.program
            got = torch.zeros_like(table.matrix)
            for o, v, a, k, row_first, pair_first, pair_last, row_last in program:
                if v < 0:
                    assert (row_first, row_last) == (1, 1)
                    continue
                got[a, o * vector_rows + v] += table.unrolled.coef64[k]
            torch.testing.assert_close(got, table.matrix, rtol=0, atol=0)
            assert sorted(e[3] for e in program if e[1] >= 0) == list(range(table.unrolled.coef64.numel()))
            assert [e[0] for e in program if e[4]] == list(range(info.out_size))  # each row opens once, in order
            assert [e[0] for e in program if e[7]] == list(range(info.out_size))
            for first, last in zip((e for e in program if e[5] and e[1] >= 0), (e for e in program if e[6])):
                assert first[:2] == last[:2]
        table = info.dense_rows["gram"]
        program = table.unrolled.program
        got = torch.zeros_like(table.matrix)
        for o, a, b, k, _, _ in program:
            got[a * info.size2 + b, o] += table.unrolled.coef64[k]
        torch.testing.assert_close(got, table.matrix, rtol=0, atol=0)
        outs = [e[0] for e in program]
        assert outs == sorted(outs)  # each output's entries together, so first/last open and close it once
        assert [e[0] for e in program if e[4]] == [e[0] for e in program if e[5]] == sorted(set(outs))


def test_large_structures_are_not_unrolled():
    """L 4 (25 rows a sparse size) is past UNROLL's 16 rows: no program, and the route keeps the other kernels."""
    info = cg_product_infos(4, 4, 4)[0]
    assert all(table.unrolled is None for table in info.dense_rows.values())
    dense = torch.zeros(4, 4, dtype=torch.float64)
    dense[0, 1] = 1.0
    assert cw.unrolled_pairs(dense, 2, 2, "cpu") is not None
    many = torch.ones(16, 16 * 16, dtype=torch.float64)  # 4096 coefficients
    assert cw.unrolled_pairs(many, 16, 16, "cpu") is None
    assert cw.unrolled_gram(many.reshape(256, 16), 16, 16, "cpu") is None


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("L", [2, 3])
def test_clebsch_gordan_matches_reference(op, L, launches):
    """The structures the route is for, at odd batch and channel counts (programs with ragged sample and channel
    tiles), in fp64 (exact to rounding) and fp32."""
    infos = cg_product_infos(L, L, L)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        x, y = _inputs(op, infos[0], batch=5, channels=7, dtype=dtype)
        z = _run(op, x, y, infos)
        expected = sparse_product_reference(op, x.double(), y.double(), infos[0])
        assert z.dtype == dtype and z.shape == expected.shape
        torch.testing.assert_close(z.double(), expected, rtol=tol, atol=tol)
    assert launches == [op, op]


@pytest.mark.parametrize("op", OPS)
def test_strided_and_shared_operands(op, cg2, launches):
    """Non-contiguous views (a channel slice, a transposed batch) and a shared operand (no batch dim) read through
    their strides."""
    x, y = _inputs(op, cg2[0], batch=4, channels=6)
    x_view = x[..., ::2] if CHANNEL_RANKS[op][0] else x.T.contiguous().T
    y_view = y[..., 1::2] if CHANNEL_RANKS[op][1] else y.T.contiguous().T
    torch.testing.assert_close(_run(op, x_view, y_view, cg2), sparse_product_reference(op, x_view, y_view, cg2[0]),
                               rtol=1e-12, atol=1e-12)
    x_shared, y_shared = x[0], y[0]
    torch.testing.assert_close(_run(op, x_shared, y, cg2), sparse_product_reference(op, x_shared, y, cg2[0]),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_run(op, x, y_shared, cg2), sparse_product_reference(op, x, y_shared, cg2[0]),
                               rtol=1e-12, atol=1e-12)
    assert launches == [op, op, op]


def test_second_order_on_the_route(cg2, launches, triton_only):
    """gradcheck and gradgradcheck of vecsca through the route at L 2: its derivatives are scavec and inner, and
    theirs vecsca again, all on the channel-wise kernels (the other ops' first derivatives on random structures:
    test_dense_route.py). One op: each gradgradcheck costs ~6 s of the CPU gate."""
    op = "vecsca"
    x, y = _inputs(op, cg2[0], batch=2, channels=2, requires_grad=True)

    def f(a, b):
        return sparse_product(op, a, b, cg2)

    with channelwise(True):
        assert torch.autograd.gradcheck(f, (x, y), fast_mode=True)
        assert torch.autograd.gradgradcheck(f, (x, y), fast_mode=True)
    assert set(launches) == set(OPS)


def test_non_finite_entry_reaches_only_the_outputs_that_read_it():
    """A NaN in one scalar row of one sample reaches the outputs whose terms read that row, in that sample only
    (as split computes; the dense route's matrix product spreads it to the whole sample). A random structure: in the
    Clebsch-Gordan ones every scalar row reaches every output."""
    from attnbench.sparse import random_product_infos

    infos = random_product_infos(4, 3, 5, 48, torch.Generator().manual_seed(11))
    info = infos[0]
    x, y = _inputs("vecsca", info, batch=3, channels=4)
    y[1, 1] = float("nan")
    z = _run("vecsca", x, y, infos)
    i1, i2, out, _ = product_terms(info)
    reached = sorted(set(out[i2 == 1].tolist()))
    unreached = sorted(set(range(info.out_size)) - set(reached))
    assert reached and unreached  # the structure leaves both kinds
    assert torch.isnan(z[1, reached]).all()
    assert not torch.isnan(z[1, unreached]).any() and not torch.isnan(z[[0, 2]]).any()


def test_deterministic(cg2, launches):
    x, y = _inputs("inner", cg2[0], batch=5, channels=5, seed=3)
    assert torch.equal(_run("inner", x, y, cg2), _run("inner", x, y, cg2))
    assert launches == ["inner", "inner"]


def test_default_takes_it_in_fp32_and_small_16bit_tables(launches, monkeypatch):
    """The default rule (triton_ops.CHANNELWISE, measured on an H200): fp32 and fp64 wherever the table unrolls;
    16-bit inputs up to 128 entries of the table's grid (L 2: 81), not at L 3 (256), where the fused dense kernel's
    tiles are full; ``channelwise(False)`` (the forced route triton@matrix-units) never."""
    calls = []
    fused = triton_ops.dense_product_launch
    monkeypatch.setattr(triton_ops, "dense_product_launch", lambda *a: calls.append(a[0]) or fused(*a))
    for L, dtype, route in [(2, torch.float32, "channelwise"), (3, torch.float32, "channelwise"),
                            (3, torch.float64, "channelwise"), (2, torch.float16, "channelwise"),
                            (3, torch.float16, "dense"), (3, torch.bfloat16, "dense")]:
        infos = cg_product_infos(L, L, L)
        x, y = _inputs("vecsca", infos[0], batch=2, channels=3, dtype=dtype)
        launches.clear(), calls.clear()
        with use_implementation("triton"):
            sparse_product("vecsca", x, y, infos)
        assert (launches, calls) == ((["vecsca"], []) if route == "channelwise" else ([], ["vecsca"])), (L, dtype)
    launches.clear()
    with channelwise(False), use_implementation("triton"):
        sparse_product("vecsca", *_inputs("vecsca", infos[0], batch=2, channels=3), infos)
    assert not launches


def test_inner_past_one_channel_tile_keeps_the_other_kernels(cg2, launches):
    """inner holds all channels in one tile: past UNROLL's max_channels the dense route's other kernels run."""
    channels = cw.UNROLL["max_channels"] + 1
    x, y = _inputs("inner", cg2[0], batch=2, channels=channels)
    z = _run("inner", x, y, cg2)
    assert not launches
    torch.testing.assert_close(z, sparse_product_reference("inner", x, y, cg2[0]), rtol=1e-12, atol=1e-12)


def test_forced_routes_take_their_own_kernels(launches):
    """The forced routes that name another dense-route path turn the channel-wise kernels off (at L 2 fp32 they
    would be taken by default), and ``triton@channelwise`` takes them where the default would not (L 3 in 16
    bits); each passes its float64 check."""
    import attnbench
    from attnbench.bench import runner
    from attnbench.operators.sparse import SparseCase

    op = attnbench.get("sparse")
    for route, case, expected in [("triton@two-launch", SparseCase("vecsca", 2, 3, 2, "float32"), False),
                                  ("triton@fused-dense", SparseCase("vecsca", 2, 3, 2, "float32"), False),
                                  ("triton@gather-kernel", SparseCase("vecsca", 2, 3, 2, "float32"), False),
                                  ("triton@matrix-units", SparseCase("vecsca", 2, 3, 2, "float32"), False),
                                  ("triton", SparseCase("vecsca", 2, 3, 2, "float32"), True),
                                  ("triton@channelwise", SparseCase("vecsca", 3, 3, 2, "float16"), True)]:
        launches.clear()
        results = runner.check(op, [case], "cpu", variants=[route], modes=["fwd"], progress=False)
        assert results and all(r.passed and not r.skipped for r in results), (route, results)
        assert bool(launches) == expected, (route, launches)


def test_program_tensor_reads_back_without_its_tuple(cg2):
    """The custom op takes the structure as a CPU int64 tensor: one loaded from an exported or pickled graph has
    lost the tuple kept on it, and reads the same program back from its values."""
    unrolled = cg2[0].dense_rows["pairs1"].unrolled
    copy = unrolled.program_tensor.clone()  # a clone carries no Python attribute
    assert not hasattr(copy, "_attnbench_program")
    assert cw.program_of(copy) == unrolled.program and cw.program_of(unrolled.program_tensor) is unrolled.program


def test_compiled_backward_outlives_the_callers_infos(triton_only):
    """A compiled graph holds the structure (the program tensor and coefficients are its constants), not a name for
    it: its backward runs after the caller dropped the infos (a key into a registry of live infos raised KeyError
    here; found by review)."""
    import gc

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, i: sparse_product("vecsca", a, b, i), backend="aot_eager")
    x, y = _inputs("vecsca", cg_product_infos(1, 1, 1)[0], batch=2, channels=3, requires_grad=True)
    with channelwise(True):
        z = compiled(x, y, cg_product_infos(1, 1, 1))
        gc.collect()
        z.sum().backward()
    infos = cg_product_infos(1, 1, 1)
    gx, gy = torch.autograd.grad(sparse_product_reference("vecsca", x, y, infos[0]).sum(), (x, y))
    torch.testing.assert_close(x.grad, gx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.grad, gy, rtol=1e-12, atol=1e-12)


def test_exported_program_keeps_its_structure(tmp_path, triton_only):
    """torch.export saves the structure with the program: loaded beside another structure of the same sizes, the
    exported one still computes its own (a process-local key had named whichever table held it at load time)."""
    from attnbench.sparse import random_product_infos

    class Product(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.infos = random_product_infos(3, 3, 3, 40, torch.Generator().manual_seed(seed))

        def forward(self, x, y):
            return sparse_product("vecsca", x, y, self.infos)

    x, y = _inputs("vecsca", Product(1).infos[0], batch=2, channels=4)
    with channelwise(True):
        exported = Product(1)
        torch.export.save(torch.export.export(exported, (x, y)), tmp_path / "product.pt2")
        expected = sparse_product_reference("vecsca", x, y, exported.infos[0])
        del exported
        other = Product(2)
        loaded = torch.export.load(tmp_path / "product.pt2")
        torch.testing.assert_close(loaded.module()(x, y), expected, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(other(x, y), expected)


def test_op_refuses_coefficients_shorter_than_its_program(cg2):
    """The custom op's channel-wise arguments come from one table; given apart (the op is public through
    torch.ops), fewer coefficients than the program indexes are refused before a kernel reads past them."""
    info = cg2[0]
    unrolled = info.dense_rows["pairs1"].unrolled
    x, y = _inputs("vecsca", info, batch=2, channels=3)
    with pytest.raises(ValueError, match="indexes 137 coefficients, 3 given"):
        triton_ops.sparse_product_op(x, y, info.scale, info.index1, info.index2, info.row_bounds, info.gather_index,
                                     info.out_size, "vecsca", False, channelwise_program=unrolled.program_tensor,
                                     channelwise_coefficients=unrolled.coef64[:3])
