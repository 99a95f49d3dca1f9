"""GPU gate of the sparse operator's products and SparseScale (skipped without CUDA; scripts/gpu_gate.sh runs it):
every op at real sizes in fp32 and bf16 against the float64 oracle to second order, bitwise determinism, float64
gradcheck and gradgradcheck through the kernels, and bad inputs rejected before any kernel runs. Cases, oracles and
bounds: tests/sparse/gpu_cases.py (whose docstring derives the bounds; ATTNBENCH_GPU_SPARSE_DRYRUN=1 dry-runs this
file on the interpreter).
"""
import dataclasses

import pytest
import torch

from attnbench.bench import verify
from attnbench.sparse import (random_product_infos, random_scale_infos, sparse_product, sparse_scale, triton_ops,
                              use_implementation)

from .gpu_cases import (DEVICE, DRYRUN, DTYPES, GPU_MARKS, OPS, PRODUCT_CASES, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS,
                        SCALE_CASES, SCALE_OUTPUTS, SHARED_CASES, check_against_oracle)
from .helpers import SHARING

pytestmark = GPU_MARKS


# ---------------------------------------------------------------------------------------------------------------------
# every op at real sizes, fp32 and bf16, to second order (the cases: gpu_cases.PRODUCT_CASES, SCALE_CASES)


@pytest.mark.parametrize("case,dtype", [(c, d) for c in PRODUCT_CASES for d in DTYPES],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_product_matches_float64_to_second_order(case, dtype, gpu_triton_only):
    """fp32: f = u32 + gamma_m(u32), m = k + R + 3, e.g. 1.4e-5 of A at k ~ 110 terms, R = 128; bf16: u_bf16 =
    3.9e-3 dominates."""
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)


@pytest.mark.parametrize("case,dtype", [(c, d) for c in SCALE_CASES for d in DTYPES],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_scale_matches_float64_to_second_order(case, dtype, gpu_triton_only):
    """y = S x, grad_x = S^T g, and d<h, grad_x>/dg = S h (grad_x does not depend on x: no second x-derivative)."""
    check_against_oracle(case, dtype, SCALE_OUTPUTS, (1, 1, 1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# determinism

# one real-size case per op (every path of the kernel's OP switch), the batch-summing cases on float data too
DETERMINISM_CASES = ([next(c for c in PRODUCT_CASES if c.op == op) for op in OPS]
                     + [dataclasses.replace(c, integer=False) for c in SHARED_CASES if c.batch_summed()])


@pytest.mark.parametrize("case", DETERMINISM_CASES + SCALE_CASES[:1], ids=lambda c: c.label)
def test_bitwise_deterministic(case, gpu_triton_only):
    """No atomics: the kernels sum in CSR order (and a batch sum inside one program), so three runs of forward,
    backward and double backward are bitwise equal. On float data: integer sums would be equal in any order."""
    inputs = case.make_inputs(seed=1)

    def run():
        return [t for t in case.run(inputs, torch.float32) if t is not None]

    assert verify.bitwise_equal_runs(run, runs=3)


# ---------------------------------------------------------------------------------------------------------------------
# float64 gradcheck and gradgradcheck through the kernels on the GPU


# full checks cost a launch per input element and per cotangent element: small, and smaller in the dry run
GRADCHECK_SIZES = (3, 3, 3, 6) if DRYRUN else (4, 3, 5, 10)  # size1, size2, out_size, terms
GRADCHECK_CHANNELS = {"vecmat": ((2,), (2, 1)), "outer": ((1,), (2,))} if DRYRUN else \
    {"vecmat": ((3,), (3, 2)), "outer": ((2,), (3,))}


@pytest.mark.parametrize("op,sharing,out_accumulated", [("vecmat", "shared_y", False), ("outer", "batched", True)])
def test_float64_gradcheck_and_gradgradcheck(op, sharing, out_accumulated, gpu_triton_only):
    """Full (not fast-mode) checks of the fp64 kernels (fp64 accumulators, fp64 scales) on a random structure with
    empty segments and a repeated term."""
    size1, size2, out_size, terms = GRADCHECK_SIZES
    infos = random_product_infos(size1, size2, out_size, terms, torch.Generator().manual_seed(3), device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    shared_x, shared_y = SHARING[sharing]
    cx, cy = GRADCHECK_CHANNELS[op]
    x = torch.randn((() if shared_x else (2,)) + (size1,) + cx, generator=generator, device=DEVICE,
                    dtype=torch.float64)
    y = torch.randn((() if shared_y else (2,)) + (size2,) + cy, generator=generator, device=DEVICE,
                    dtype=torch.float64)
    args = (x.requires_grad_(), y.requires_grad_())

    def fn(a, b):
        return sparse_product(op, a, b, infos, out_accumulated)

    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_scale_float64_gradcheck_and_gradgradcheck(gpu_triton_only):
    in_size, out_size, terms, channels = (4, 3, 6, 2) if DRYRUN else (5, 7, 12, 3)
    infos = random_scale_infos(in_size, out_size, terms, torch.Generator().manual_seed(1), device=DEVICE)
    x = torch.randn(2, in_size, channels, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: sparse_scale(a, *infos), (x,))
    assert torch.autograd.gradgradcheck(lambda a: sparse_scale(a, *infos), (x,))


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs


OTHER_DEVICE = "meta" if DRYRUN else "cpu"  # a device the infos are not on (the dry run's infos are on the CPU)


def test_bad_inputs_fail_before_any_kernel(monkeypatch):
    """A ValueError/TypeError naming what is wrong, with the launchers made to fail: infos on another device than
    the tensors (both ways on a GPU), a wrong sparse size, mismatched channels or dtypes."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel launched")

    monkeypatch.setattr(triton_ops, "sparse_product_launch", launched)
    monkeypatch.setattr(triton_ops, "sparse_scale_launch", launched)
    infos = random_product_infos(5, 4, 6, 20, torch.Generator().manual_seed(0), device=DEVICE)
    x = torch.randn(3, 5, 8, device=DEVICE)
    y = torch.randn(3, 4, 8, device=DEVICE)
    cases = [
        (ValueError, "device", (x.to(OTHER_DEVICE), y.to(OTHER_DEVICE), infos)),
        (ValueError, "size1", (x[:, :4], y, infos)),
        (ValueError, "channel dims", (x, y[..., :7], infos)),
        (TypeError, "dtype", (x, y.bfloat16(), infos)),
    ]
    if not DRYRUN:  # infos built on the CPU for CUDA tensors
        cpu_infos = random_product_infos(5, 4, 6, 20, torch.Generator().manual_seed(0))
        cases.append((ValueError, "device", (x, y, cpu_infos)))
    scaling = random_scale_infos(5, 7, 12, torch.Generator().manual_seed(1), device=DEVICE)
    with use_implementation("triton"):
        with pytest.raises(AssertionError, match="launched"):
            sparse_product("mul", x, y, infos)  # the guard is armed: valid arguments reach the launch
        for error, match, (a, b, structure) in cases:
            with pytest.raises(error, match=match):
                sparse_product("mul", a, b, structure)
        with pytest.raises(ValueError, match="in_size"):
            sparse_scale(torch.randn(2, 4, 3, device=DEVICE), *scaling)
        with pytest.raises(ValueError, match="device"):
            sparse_scale(torch.randn(2, 5, 3, device=OTHER_DEVICE), *scaling)
