"""The dense route of vecsca, scavec and inner (attnbench/kernels/sparse/dense.py) on the interpreter: its tables
(``SparseProductInfo.dense_rows``) against a loop over the terms, its values and derivatives against the float64
reference and the segment kernel it replaces, the cases that keep the segment kernel, and that the route is taken
where it should be (a counting spy on its gather launcher). The per-sample sums run both ways: as a GEMM on the
tables' matrix form (the default where a table has one) and on the CSR gather kernel. Tiny sizes: interpreter
launches cost ~0.1 s.
"""
import dataclasses

import pytest
import torch

from attnbench.kernels.sparse import dense as sparse_dense
from attnbench.kernels.sparse import fused_dense as sparse_fused_dense
from attnbench.kernels import tuning
from attnbench.sparse import (CHANNEL_RANKS, product_infos, random_product_infos, sparse_product,
                              sparse_product_reference, use_implementation)
from attnbench.sparse.info import DENSE_GRID_PER_TERM, GATHER_MATRIX_PER_TERM, product_terms
from attnbench.sparse import triton_ops
from attnbench.sparse.triton_ops import channelwise, dense_route, fused_dense, gather_by_matmul

from .helpers import SHARING

pytestmark = pytest.mark.interpreter

OPS = ("vecsca", "scavec", "inner")
SIZES = (4, 3, 5)  # size1, size2, out_size


@pytest.fixture(scope="module")
def infos():
    """Rows without terms in every grouping, repeated terms, backward infos through gather_index; 48 terms, so
    that every table is dense enough for the route (triton_ops.MIN_DENSITY: >= 1 term a dense entry; the grids
    are 20, 15 and 12 entries)."""
    return random_product_infos(*SIZES, 48, torch.Generator().manual_seed(11))


@pytest.fixture
def gathers(monkeypatch):
    """The dense route's launches, one entry each: "fused" for both steps in one program (sparse_fused_dense.py),
    "channelwise" for the structure compiled into the kernel (sparse/channelwise.py), else its per-sample sums:
    "gemm" where they ran as a GEMM on the table's matrix form, "gather_kernel" where on the CSR gather kernel."""
    calls = []
    launch, fused = sparse_dense.gather_rows_launch, sparse_dense.fused_dense_launch
    unrolled = triton_ops.channelwise_launch
    monkeypatch.setattr(sparse_dense, "gather_rows_launch", lambda *a: calls.append(
        "gemm" if getattr(a[1], "matrix", None) is not None else "gather_kernel") or launch(*a))
    monkeypatch.setattr(sparse_dense, "fused_dense_launch", lambda *a: calls.append("fused") or fused(*a))
    monkeypatch.setattr(triton_ops, "channelwise_launch", lambda *a: calls.append("channelwise") or unrolled(*a))
    return calls


def inputs(op, shared_x, shared_y, info, batch=3, channels=3, dtype=torch.float64, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    rank_x, rank_y, _ = CHANNEL_RANKS[op]

    def tensor(shared, size, rank):
        shape = (() if shared else (batch,)) + (size,) + (channels,) * rank
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    return tensor(shared_x, info.size1, rank_x), tensor(shared_y, info.size2, rank_y)


@pytest.fixture(params=["fused", "gemm", "gather_kernel", "channelwise"])
def gather_route(request, monkeypatch):
    """Both steps in one program (the default for fp64 at these sizes; inner's thin Gram grids let in too), two
    launches with the per-sample sums as a GEMM on the tables' matrix form or on the CSR gather kernel, or the
    structure compiled into the kernel (channel-wise; both operands shared go to "fused" there)."""
    monkeypatch.setitem(sparse_fused_dense.FUSED_ROWS, "inner_fill", 0.0)
    with gather_by_matmul(request.param != "gather_kernel"), \
            fused_dense(request.param in ("fused", "channelwise")), channelwise(request.param == "channelwise"):
        yield request.param


def _triton(op, x, y, infos, out_accumulated=False):
    with use_implementation("triton"):
        return sparse_product(op, x, y, infos, out_accumulated)


def test_tables_regroup_every_term(infos):
    """Each table, applied as a dense matrix, is the terms' sum grouped by its rows: every term once, rows
    without terms empty, max_len the longest row."""
    for info in infos:
        i1, i2, out, scale = product_terms(info)
        wanted = {"pairs1": (out * info.size1 + i1, i2, info.out_size * info.size1, info.size2),
                  "pairs2": (out * info.size2 + i2, i1, info.out_size * info.size2, info.size1),
                  "gram": (out, i1 * info.size2 + i2, info.out_size, info.size1 * info.size2)}
        for name, (rows, cols, num_rows, num_cols) in wanted.items():
            table = info.dense_rows[name]
            expected = torch.zeros(num_rows, num_cols, dtype=torch.float64)
            expected.index_put_((rows, cols), scale, accumulate=True)
            lengths = table.bounds[1] - table.bounds[0]
            got = torch.zeros_like(expected)
            for r in range(table.rows):
                for k in range(int(table.bounds[0, r]), int(table.bounds[1, r])):
                    got[r, table.index[k]] += table.scale[k]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-15, msg=name)
            # the matrix form: the same sparse matrix, transposed, its repeated terms summed in float64
            assert table.matrix is not None and table.matrix.dtype == torch.float64, name
            torch.testing.assert_close(table.matrix.T, expected, rtol=0, atol=1e-15, msg=name)
            assert torch.equal(table.matrix32, table.matrix.float()), name
            assert table.rows == num_rows and table.max_len == int(lengths.max())
            assert int(lengths.sum()) == out.numel() and bool((lengths == 0).any()), name  # empty rows present


@pytest.mark.parametrize("sharing", list(SHARING))
@pytest.mark.parametrize("op", OPS)
def test_matches_reference_and_segment_kernel(infos, op, sharing, gathers, gather_route):
    x, y = inputs(op, *SHARING[sharing], infos[0])
    z = _triton(op, x, y, infos)
    # both operands shared: one output matrix, no batch for the fused or channel-wise kernels' programs
    expected_route = "gemm" if gather_route in ("fused", "channelwise") and sharing == "shared_both" else gather_route
    assert gathers and all(g == expected_route for g in gathers), gathers
    with dense_route(False):
        segment = _triton(op, x, y, infos)
    expected = sparse_product_reference(op, x, y, infos[0])
    assert z.shape == expected.shape == segment.shape and z.dtype == torch.float64
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, segment, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", OPS)
def test_low_precision(infos, op, dtype, gather_route):
    """Error bound, not a measured tolerance: the output rounds once to ``dtype`` (eps/2 of sum|terms|) after fp32
    sums of at most ``chain`` terms (a row of the table, then the matrix product's contraction), each adding at
    most eps32 of sum|terms|. bf16 runs as an fp32 upcast on the interpreter; fp16 does not, so under "fused" it
    runs the fused kernels' hi + lo split of M (the GPU tests check bf16's)."""
    x, y = inputs(op, False, False, infos[0], dtype=dtype, seed=2)
    z = _triton(op, x, y, infos)
    assert z.dtype == dtype
    info = infos[0]
    expected = sparse_product_reference(op, x.double(), y.double(), info)
    abs_info = dataclasses.replace(info, scale=info.scale.abs())
    magnitude = sparse_product_reference(op, x.double().abs(), y.double().abs(), abs_info)
    table = info.dense_rows[sparse_dense.DENSE_OPS[op]]
    chain = table.max_len + {"vecsca": info.size1, "scavec": info.size2, "inner": x.shape[-1]}[op] + 2
    bound = (torch.finfo(dtype).eps / 2 + chain * torch.finfo(torch.float32).eps) * magnitude
    assert ((z.double() - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_and_gradgradcheck(op, gathers, gather_route, triton_only):
    """First and second derivatives through the dense route: the family is closed (vecsca's gx is a scavec, its
    gy an inner), so every derivative takes the route too. Triton stays forced while autograd runs the backward
    (``triton_only``: the split implementation fails), or the derivatives would run on split. Second derivatives
    on the default sums (the GEMM) only: the CSR gather kernel is linear in its input, so its second-order launches
    are the first-order ones again, and on the interpreter they cost ~45 s of the CPU gate."""
    infos = random_product_infos(3, 3, 3, 24, torch.Generator().manual_seed(3))
    x, y = inputs(op, False, False, infos[0], batch=2, channels=2, requires_grad=True)
    forward = _triton(op, x, y, infos)
    forward_launches = len(gathers)
    assert torch.autograd.gradcheck(lambda a, b: sparse_product(op, a, b, infos), (x, y), fast_mode=True)
    if gather_route != "gather_kernel":
        assert torch.autograd.gradgradcheck(lambda a, b: sparse_product(op, a, b, infos), (x, y), fast_mode=True)
    assert forward_launches and all(g == gather_route for g in gathers)
    # the first derivatives on the route too: a backward makes at least as many route launches as a forward
    gathers.clear()
    torch.autograd.grad(forward.sum(), (x, y))
    assert len(gathers) >= forward_launches and all(g == gather_route for g in gathers), gathers


def test_segment_kernel_gradgradcheck_with_the_route_off(triton_only):
    """The segment kernel still serves these ops (route off, out_accumulated, large grids): its derivatives."""
    infos = random_product_infos(3, 3, 3, 6, torch.Generator().manual_seed(4))
    x, y = inputs("vecsca", False, False, infos[0], batch=2, channels=2, requires_grad=True)
    with dense_route(False):
        assert torch.autograd.gradgradcheck(lambda a, b: sparse_product("vecsca", a, b, infos), (x, y),
                                            fast_mode=True)


def test_batch_sum_keeps_the_segment_kernel(infos, gathers):
    x, y = inputs("vecsca", False, False, infos[0])
    z = _triton("vecsca", x, y, infos, out_accumulated=True)
    assert not gathers
    torch.testing.assert_close(z, sparse_product_reference("vecsca", x, y, infos[0], True), rtol=1e-12, atol=1e-12)


def test_sparse_route_needs_enough_terms_per_dense_entry(gathers):
    """A table too thin for the route (14 terms on 20 entries: below 1 term an entry) keeps the segment kernel."""
    infos = random_product_infos(*SIZES, 14, torch.Generator().manual_seed(11))
    assert "pairs1" in infos[0].dense_rows
    x, y = inputs("vecsca", False, False, infos[0])
    z = _triton("vecsca", x, y, infos)
    assert not gathers
    torch.testing.assert_close(z, sparse_product_reference("vecsca", x, y, infos[0]), rtol=1e-12, atol=1e-12)


def test_sparse_grid_has_no_table_and_keeps_the_segment_kernel(gathers):
    """A structure whose dense grid is far larger than its terms: no tables, the segment kernel runs."""
    size = 40
    i = torch.arange(6)
    infos = product_infos(i * 7, i * 5, i * 3, None, size, size, size)
    assert size * size > DENSE_GRID_PER_TERM * 6 and infos[0].dense_rows == {}
    x, y = inputs("vecsca", False, False, infos[0], batch=2, channels=2)
    z = _triton("vecsca", x, y, infos)
    assert not gathers
    torch.testing.assert_close(z, sparse_product_reference("vecsca", x, y, infos[0]), rtol=1e-12, atol=1e-12)


def test_deterministic(infos, gather_route):
    for op in OPS:
        x, y = inputs(op, False, False, infos[0], seed=5)
        assert torch.equal(_triton(op, x, y, infos), _triton(op, x, y, infos)), op


def test_thin_table_has_no_matrix_form(gathers):
    """A table whose dense matrix would hold more than GATHER_MATRIX_PER_TERM entries a term (and more than the
    small-grid allowance) keeps only its CSR form: the gather kernel serves it."""
    size = 20
    i = torch.arange(20)
    infos = product_infos(i % 4, i % 19, i % 5, None, 4, size, 5)  # pairs1: a 20 x 20 matrix for 20 terms
    table = infos[0].dense_rows["pairs1"]
    assert size * table.rows > GATHER_MATRIX_PER_TERM * 20 and table.matrix is None and table.matrix32 is None
    x, y = inputs("vecsca", False, False, infos[0], batch=2, channels=2)
    torch.testing.assert_close(_triton("vecsca", x, y, infos), sparse_product_reference("vecsca", x, y, infos[0]),
                               rtol=1e-12, atol=1e-12)
    assert gathers and all(g == "gather_kernel" for g in gathers), gathers


@pytest.mark.parametrize("rows", [SIZES[0], sparse_dense.GRAM_STACK_ROWS + 1])
@pytest.mark.parametrize("op", OPS)
def test_full_precision_under_autocast_and_tf32_settings(infos, op, gather_route, rows):
    """The route's cuBLAS products (the GEMM sums; fp32 Gram matrices of more than GRAM_STACK_ROWS rows) keep fp32
    inside autocast (which would run them in bf16: ~4e-3 off) and whatever TF32 setting the process made, through
    torch's new API, which a legacy ``allow_tf32`` toggle would break (reading it raises once the new one is set)
    and leave pinned."""
    if rows != SIZES[0]:  # x with more rows than the stack kernel takes: inner's Gram matrices on cuBLAS
        infos = random_product_infos(rows, *SIZES[1:], 200, torch.Generator().manual_seed(12))
    channels = 3
    x, y = inputs(op, False, False, infos[0], channels=channels, dtype=torch.float32, seed=4)
    expected = sparse_product_reference(op, x.double(), y.double(), infos[0])
    settings = (torch.backends, "fp32_precision")
    before = getattr(*settings)
    try:
        setattr(*settings, "tf32")  # reaches cuda.matmul's own setting, which the call must leave as it was
        cuda_matmul = torch.backends.cuda.matmul.fp32_precision
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = _triton(op, x, y, infos)
        assert getattr(*settings) == "tf32" and torch.backends.cuda.matmul.fp32_precision == cuda_matmul
    finally:
        setattr(*settings, before)
    assert z.dtype == torch.float32
    torch.testing.assert_close(z.double(), expected, rtol=1e-5, atol=1e-5)


def test_gram_matrices_route_by_dtype_size_and_depth(monkeypatch):
    """inner's Gram matrices: 16-bit inputs on small_matmul (tensor cores, fp32 out); fp32 ones of at most
    GRAM_STACK_ROWS rows and columns on gram_stack (unless both operands are shared); fp64 ones on small_matmul only
    while small (fewer than GRAM_ON_CUBLAS_ROWS rows and columns) and shallow (at most SMALL_MATMUL_GRAM_DEPTH
    channels); the rest on cuBLAS (measured on the H200: results/gpu/nvidia-h200/gram-stack-configs.log and
    small-matmul-gram-fp32-l23.md)."""
    ran = []
    monkeypatch.setattr(sparse_dense, "small_matmul", lambda a, b, out: ran.append("small") or (a.to(out) @ b.to(out)))
    monkeypatch.setattr(sparse_dense, "full_precision_matmul", lambda a, b: ran.append("cublas") or a @ b)
    monkeypatch.setattr(sparse_dense, "gram_stack", lambda a, b: ran.append("stack") or a @ b)
    rows, depth = sparse_dense.GRAM_ON_CUBLAS_ROWS, sparse_dense.SMALL_MATMUL_GRAM_DEPTH
    stack = sparse_dense.GRAM_STACK_ROWS
    for dtype, p, q, channels, route in [(torch.float32, 9, 9, depth, "stack"),
                                         (torch.float32, stack, stack, 4 * depth, "stack"),
                                         (torch.float32, stack + 1, 9, 8, "cublas"),
                                         (torch.float32, 9, stack + 1, 8, "cublas"),
                                         (torch.float64, rows - 1, 4, 8, "small"),
                                         (torch.float64, 9, 9, depth + 1, "cublas"),
                                         (torch.float64, rows, 9, 8, "cublas"), (torch.float64, 9, rows, 8, "cublas"),
                                         (torch.bfloat16, 49, 49, 128, "small"), (torch.bfloat16, 9, 9, 32, "small")]:
        x = torch.randn(2, p, channels, dtype=torch.float64).to(dtype)
        y = torch.randn(2, q, channels, dtype=torch.float64).to(dtype)
        gram = sparse_dense._gram(x, y.transpose(-1, -2), sparse_dense.accumulator_torch_dtype(dtype))
        assert ran.pop() == route and gram.shape == (2, p, q), (dtype, p, q, channels)
    # one shared operand stays on the stack, both shared (one matrix) do not
    x, y = torch.randn(9, 8), torch.randn(2, 9, 8)
    sparse_dense._gram(x, y.transpose(-1, -2), torch.float32)
    sparse_dense._gram(x, y[0].T, torch.float32)
    assert ran == ["stack", "small"], ran


@pytest.mark.parametrize("batch,p,q,channels,shared", [(5, 9, 9, 37, None), (3, 16, 3, 16, None), (4, 1, 16, 5, "x"),
                                                       (3, 7, 11, 33, "y"), (1, 16, 16, 1, None), (0, 9, 9, 4, None),
                                                       (3, 9, 9, 0, None)])
def test_gram_stack_matches_float64(batch, p, q, channels, shared):
    """gram_stack on odd batches (a program's samples partly past N), rows, columns and channels (a last channel step
    partly past C), one operand shared, empty batch and no channels: fp32 against float64 within the dot's bound
    (C fp32 multiply-adds: gamma_C(2**-24) of sum |x y|, under (C + 1) 2**-23)."""
    generator = torch.Generator().manual_seed(batch * 100 + p)
    x = torch.randn(*(() if shared == "x" else (batch,)), p, channels, generator=generator)
    y = torch.randn(*(() if shared == "y" else (batch,)), q, channels, generator=generator)
    gram = sparse_dense.gram_stack(x, y.transpose(-1, -2))
    expected = x.double() @ y.double().transpose(-1, -2)
    bound = (channels + 1) * torch.finfo(torch.float32).eps * (x.double().abs() @ y.double().abs().transpose(-1, -2))
    assert gram.shape == (batch, p, q) and gram.dtype == torch.float32
    assert ((gram.double() - expected).abs() <= bound).all()


def test_gram_stack_refuses_what_it_cannot_multiply():
    with pytest.raises(ValueError, match="fp32 operands only"):
        sparse_dense.gram_stack(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64))
    for x, y_t in [(torch.randn(9, 8), torch.randn(8, 9)), (torch.randn(5, 9, 8), torch.randn(2, 8, 9)),
                   (torch.randn(2, 9, 8), torch.randn(2, 7, 9))]:
        with pytest.raises(ValueError, match="are not"):
            sparse_dense.gram_stack(x, y_t)


def test_gram_stack_reads_strided_operands():
    """A batch-innermost x (a permuted view) and y's transposed view: the strides, not a copy's layout."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(9, 32, 6, generator=generator).permute(2, 0, 1)
    y = torch.randn(6, 9, 32, generator=generator)
    torch.testing.assert_close(sparse_dense.gram_stack(x, y.transpose(-1, -2)).double(),
                               x.double() @ y.double().transpose(-1, -2), rtol=0, atol=1e-5)


def test_fused_kernels_take_small_grids_in_16_bit_and_fp64():
    """The fused kernels' rule (kernels/sparse_fused_dense.fused_dense_fits): a matrix form, a batched operand, sizes
    padding to at most 16 rows, bf16, fp16 or fp64 (fp32 measured behind in backward), and for inner a Gram grid
    filling half its padded tile (CG L 2's 9 x 9 ran 0.83x)."""
    fits = sparse_fused_dense.fused_dense_fits
    matrix = torch.ones(1)

    def meta(shape, dtype):
        return torch.empty(shape, device="meta", dtype=dtype)

    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert fits("vecsca", meta((8, 9, 32), dtype), meta((8, 9), dtype), matrix, 9, False, False)
        assert fits("scavec", meta((9,), dtype), meta((8, 16, 32), dtype), matrix, 16, True, False)
        assert fits("inner", meta((8, 16, 32), dtype), meta((8, 12, 32), dtype), matrix, 16, False, False)
        assert not fits("inner", meta((8, 9, 32), dtype), meta((8, 9, 32), dtype), matrix, 9, False, False)
        assert not fits("vecsca", meta((8, 17, 32), dtype), meta((8, 9), dtype), matrix, 9, False, False)
        assert not fits("vecsca", meta((8, 9, 32), dtype), meta((8, 9), dtype), matrix, 17, False, False)
        assert not fits("vecsca", meta((9, 32), dtype), meta((9,), dtype), matrix, 9, True, True)
        assert not fits("vecsca", meta((8, 9, 32), dtype), meta((8, 9), dtype), None, 9, False, False)
    assert not fits("vecsca", meta((8, 9, 32), torch.float32), meta((8, 9), torch.float32), matrix, 9, False, False)


def test_fused_pruner_keeps_configs_by_the_programs_matrix(monkeypatch):
    """The register rule counts the matrix each kernel holds (M: BLOCK_O x BLOCK_V; G: BLOCK_1 x BLOCK_2, not
    times the output's BLOCK_O) and the channel tile no wider than the channels; ATTNBENCH_AUTOTUNE=0 the first."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    configs = [sparse_fused_dense.cfg(w, st, BLOCK_N=n, BLOCK_C=c) for w, st, n, c in sparse_fused_dense._SHAPES]
    prune = sparse_fused_dense._prune
    for grid in ({"BLOCK_S": 16, "BLOCK_V": 16, "BLOCK_O": 16}, {"BLOCK_1": 16, "BLOCK_2": 16, "BLOCK_O": 16}):
        kept = prune(configs, {"C": 128}, **grid)
        assert len(kept) == len(configs)  # 16 x 256 / 128 threads = 32 registers at most
        assert [c.kwargs["BLOCK_C"] for c in prune(configs, {"C": 5}, **grid)] == [16]
    wide = prune(configs, {"C": 128}, BLOCK_1=32, BLOCK_2=32, BLOCK_O=16)  # L 4: 1024 a sample
    assert wide and all(c.kwargs["BLOCK_N"] * 1024 / (32 * c.num_warps) <= 64 for c in wide)
    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "0")
    assert prune(configs, {"C": 128}, BLOCK_1=16, BLOCK_2=16, BLOCK_O=16) == configs[:1]
