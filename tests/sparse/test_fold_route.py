"""The fold route of vecmat with a shared y and mat_t_vec with a shared x (attnbench/kernels/sparse/fold.py) on the CPU: its
values against the float64 reference and the segment kernel it replaces, its derivatives (the backward's mat_t_vec
takes it too), the cases that keep the other kernels, and that it runs where it should (a counting spy on its
launcher). It is GEMMs only: no Triton launch, so these are cheap. bf16 runs as an fp32 upcast on the interpreter, so
its 16-bit path (fp32-output GEMMs) is checked in tests/sparse/test_gpu_routes.py; fp16 takes that path here too.
"""
import dataclasses

import pytest
import torch

from attnbench.sparse import (cg_product_infos, random_product_infos, sparse_product, sparse_product_reference,
                              use_implementation)
from attnbench.kernels.sparse import fold as sparse_fold
from attnbench.sparse import triton_ops
from attnbench.sparse.triton_ops import fold_route

pytestmark = pytest.mark.interpreter

SHARED = {"vecmat": 1, "mat_t_vec": 0}  # which operand is the shared weight


@pytest.fixture
def folds(monkeypatch):
    """The ops the fold launchers ran, in call order ("outer" for the batch-summed outer product)."""
    calls = []
    launch, launch_outer = triton_ops.fold_product_launch, triton_ops.fold_outer_sum_launch
    monkeypatch.setattr(triton_ops, "fold_product_launch", lambda op, *a: calls.append(op) or launch(op, *a))
    monkeypatch.setattr(triton_ops, "fold_outer_sum_launch", lambda *a: calls.append("outer") or launch_outer(*a))
    return calls


def operands(op, info, batch=8, a=3, b=5, dtype=torch.float64, seed=0, requires_grad=False, shared=True):
    """vecmat: x [N, size1, a], y [size2, a, b]; mat_t_vec: x [size1, a, b], y [N, size2, a]; ``shared`` False:
    the weight batched too."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    lead = () if shared else (batch,)
    if op == "vecmat":
        return tensor(batch, info.size1, a), tensor(*lead, info.size2, a, b)
    return tensor(*lead, info.size1, a, b), tensor(batch, info.size2, a)


def _triton(op, x, y, infos, out_accumulated=False):
    with use_implementation("triton"):
        return sparse_product(op, x, y, infos, out_accumulated)


# CG L 1: 16 terms on a 16-entry folded grid (the segment kernel's interpreter launches made L 2 cost ~25 s a test
# here; L 3-4 run in tests/sparse/test_gpu_routes.py)
STRUCTURES = {"random": lambda: random_product_infos(4, 3, 5, 48, torch.Generator().manual_seed(11)),
              "cg_l1": lambda: cg_product_infos(1, 1, 1)}


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("op", list(SHARED))
def test_matches_reference_and_segment_kernel(op, structure, folds):
    """Random terms (empty rows, repeated terms) and the Clebsch-Gordan product of irreps 0..1, odd channel counts:
    the fold equals the float64 einsum and the segment kernel (route off) to rounding."""
    infos = STRUCTURES[structure]()
    x, y = operands(op, infos[0])
    expected = sparse_product_reference(op, x, y, infos[0])
    z = _triton(op, x, y, infos)
    assert folds == [op]
    torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
    with fold_route(False):
        segment = _triton(op, x, y, infos)
    assert folds == [op]
    torch.testing.assert_close(z, segment, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", list(SHARED))
def test_fp32_against_float64(op, folds):
    infos = cg_product_infos(2, 2, 2)
    x, y = operands(op, infos[0], dtype=torch.float32, seed=1)
    z = _triton(op, x, y, infos)
    assert folds == [op] and z.dtype == torch.float32
    torch.testing.assert_close(z.double(), sparse_product_reference(op, x.double(), y.double(), infos[0]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split,cap", [(False, None), (True, None), (True, 0)], ids=["mm", "split_matmul", "capped"])
def test_fp16_values_and_weight_gradient(folds, split, cap, monkeypatch):
    """fp16 inputs take the 16-bit path on the CPU too (torch's fp32-output mm is CUDA-only: the operands go up to
    fp32 there, exact for 16-bit values): z of both ops and the weight gradient (outer summed over the batch) within
    an a-priori bound of float64: the output's rounding (u16 of |exact|), fp32 sums of at most ``chain`` products
    and the fold's hi + lo split (2**-21), each of the sum of |terms| (the same computation on |inputs|).
    ``split``: the products against the fold on attnbench/kernels/sparse/split_matmul.py (the weight gradient has no fold to split);
    ``cap``: a fold with more entries than ``max_entries`` takes the cuBLAS pair with the kernel on (the default
    cap is measured on the H200: sparse_fold.py)."""
    monkeypatch.setitem(sparse_fold.SPLIT_MATMUL, "enabled", split)
    if cap is not None:
        monkeypatch.setitem(sparse_fold.SPLIT_MATMUL, "max_entries", cap)
    splits = []
    launcher = sparse_fold.split_matmul
    monkeypatch.setattr(sparse_fold, "split_matmul", lambda *a: splits.append(1) or launcher(*a))
    infos = STRUCTURES["random"]()
    u16, u32 = torch.finfo(torch.float16).eps / 2, torch.finfo(torch.float32).eps / 2
    info = infos[0]
    abs_info = dataclasses.replace(info, scale=info.scale.abs())
    runs = [(op, *operands(op, info, dtype=torch.float16, seed=6), False) for op in SHARED]
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8, info.size1, 3, generator=generator, dtype=torch.float64).half()
    y = torch.randn(8, info.size2, 5, generator=generator, dtype=torch.float64).half()
    runs.append(("outer", x, y, True))  # a weight gradient: both batched, summed over the batch
    for op, x, y, summed in runs:
        folds.clear()
        z = _triton(op, x, y, infos, summed)
        assert folds == [op] and z.dtype == torch.float16, (op, folds)
        exact = sparse_product_reference(op, x.double(), y.double(), info, summed)
        magnitude = sparse_product_reference(op, x.double().abs(), y.double().abs(), abs_info, summed)
        chain = x.shape[0] * info.num_terms + x.shape[-1] + 4
        bound = u16 * exact.abs() + (chain * u32 + 2.0 ** -21) * magnitude
        assert ((z.double() - exact).abs() <= bound + 1e-30).all(), op
    assert len(splits) == (2 if split and cap is None else 0)


@pytest.mark.parametrize("op", list(SHARED))
def test_gradcheck_and_gradgradcheck(op, folds):
    """First and second derivatives with the route on: the gradient of the batched vectors is the other op of the
    pair against the shared weight transposed (the fold again), the weight's an outer product summed over the batch
    (the fold transposed)."""
    infos = random_product_infos(3, 3, 3, 24, torch.Generator().manual_seed(3))
    x, y = operands(op, infos[0], batch=3, a=2, b=3, requires_grad=True, seed=2)

    def fn(p, q):
        return sparse_product(op, p, q, infos)

    with use_implementation("triton"):  # the backward too: it picks its implementation when it runs
        assert torch.autograd.gradcheck(fn, (x, y), fast_mode=True)
        assert torch.autograd.gradgradcheck(fn, (x, y), fast_mode=True)
        folds.clear()
        z = fn(x, y)
        torch.autograd.grad(z, (x, y), torch.ones_like(z))
    # the forward, then the vectors' gradient (the other op of the pair against the weight transposed) and the
    # weight's (outer summed over the batch), folded too
    assert sorted(folds) == sorted([op, "mat_t_vec" if op == "vecmat" else "vecmat", "outer"])


@pytest.mark.parametrize("op", list(SHARED))
def test_cases_that_keep_the_other_kernels(op, folds):
    """No fold: the weight batched too, the route off, a batch too small to repay the fold (its FLOPs over the
    segment kernel's), terms too sparse for the folded grid (fewer than one a folded entry); each still equal to
    the reference."""
    dense = cg_product_infos(1, 1, 1)
    sparse = random_product_infos(4, 3, 5, 6, torch.Generator().manual_seed(5))
    table = dense[0].dense_rows["pairs1" if op == "vecmat" else "pairs2"]
    too_small = table.matrix.numel() // table.index.numel() - 1  # batch * terms < the fold's matrix entries
    assert too_small >= 1
    cases = [(dense, operands(op, dense[0], a=2, b=3, shared=False)), (sparse, operands(op, sparse[0], a=2, b=3)),
             (dense, operands(op, dense[0], batch=too_small, a=2, b=3))]
    for infos, (x, y) in cases:
        torch.testing.assert_close(_triton(op, x, y, infos), sparse_product_reference(op, x, y, infos[0]),
                                   rtol=1e-12, atol=1e-12)
    with fold_route(False):
        x, y = operands(op, dense[0])
        _triton(op, x, y, dense)
    assert folds == []


def test_outer_summed_over_the_batch(folds):
    """The weight gradient's fold (G = X^T Y over the batch, then the gram table's matrix): equal to the float64
    einsum and to the segment kernel (route off); with one input shared, or not summed, it keeps the other kernels,
    and where the fold does not pay (CG L 1: one term a folded entry, so (N + out) P1 P2 > N terms)."""
    infos = STRUCTURES["random"]()
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(9, infos[0].size1, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(9, infos[0].size2, 2, dtype=torch.float64, generator=generator)
    z = _triton("outer", x, y, infos, out_accumulated=True)
    assert folds == ["outer"]
    torch.testing.assert_close(z, sparse_product_reference("outer", x, y, infos[0], out_accumulated=True),
                               rtol=1e-12, atol=1e-12)
    with fold_route(False):
        torch.testing.assert_close(z, _triton("outer", x, y, infos, out_accumulated=True), rtol=1e-12, atol=1e-12)
    _triton("outer", x, y[0], infos, out_accumulated=True)
    _triton("outer", x[:2], y[:2], infos)
    l1 = STRUCTURES["cg_l1"]()
    _triton("outer", torch.randn(9, l1[0].size1, 2, dtype=torch.float64), torch.randn(9, l1[0].size2, 2,
                                                                                    dtype=torch.float64),
            l1, out_accumulated=True)
    assert folds == ["outer"]


def test_fold_keeps_out_accumulated_off_the_route(folds):
    """vecmat summed over the batch (x batched, y shared) is not a per-sample product: no fold."""
    infos = cg_product_infos(1, 1, 1)
    x, y = operands("vecmat", infos[0], a=2, b=3)
    z = _triton("vecmat", x, y, infos, out_accumulated=True)
    torch.testing.assert_close(z, sparse_product_reference("vecmat", x, y, infos[0], out_accumulated=True),
                               rtol=1e-12, atol=1e-12)
    assert folds == []
