"""GPU gate of the sparse kernels' batch sums and edges (skipped without CUDA; scripts/gpu_gate.sh runs it): shared
inputs and batch-summed outputs on exact integer data, sizes that are no block's multiple and output rows without
terms, and the ALL_ROWS walk (every output row of a batch block in one program) against one row a program. Cases,
oracles and bounds: tests/sparse/gpu_cases.py (ATTNBENCH_GPU_SPARSE_DRYRUN=1 dry-runs this file).
"""
import pytest
import torch

from attnbench.kernels.sparse import segment as sparse_segment

from .gpu_cases import (DENSER_RANDOM, GPU_MARKS, PRODUCT_CASES, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS, ProductCase,
                        SCALE_OUTPUTS, SHARED_CASES, SMALL_RANDOM, ScaleCase, cg, check_against_oracle, sized)

pytestmark = GPU_MARKS


# ---------------------------------------------------------------------------------------------------------------------
# shared inputs and batch-summed outputs (exact integer arithmetic; the cases: gpu_cases.SHARED_CASES)


@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in SHARED_CASES]
                         + [(c, torch.bfloat16) for c in SHARED_CASES if c.op == "vecmat"
                            or (c.op == "outer" and c.sharing == "batched")],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_shared_inputs_and_batch_sums(case, dtype, gpu_triton_only):
    """fp32: equal to float64 bitwise (every partial sum is an integer below 2**24, checked); bf16: the one
    rounding of an exact fp32 value to bf16 (two for d/dg), u_bf16 A each. A shared input's gradient and an
    out_accumulated output are the kernel's in-program batch loop, which a dropped or doubled block fails."""
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)


# ---------------------------------------------------------------------------------------------------------------------
# odd sizes and output rows without terms

ODD_CASES = sized([
    ProductCase("mul", SMALL_RANDOM, 1009, (48,), (48,), integer=True),  # N prime: a masked batch block
    ProductCase("mul", DENSER_RANDOM, 1009, (48,), (48,), integer=True),  # the same on the bilinear route
    ProductCase("outer", SMALL_RANDOM, 37, (1,), (80,), integer=True),  # C1 = 1: z's c = a C2 + b with one a
    ProductCase("outer", SMALL_RANDOM, 1009, (37,), (5,), out_accumulated=True, integer=True),  # masked tiles
    ProductCase("inner", SMALL_RANDOM, 1009, (37,), (37,), integer=True),  # R = 37: a masked contraction chunk
    ProductCase("vecmat", SMALL_RANDOM, 1, (37,), (37, 1), integer=True),  # N = 1, Cout = 1
    ProductCase("vecsca", cg(1, 1, 3), 1009, (80,), ()),  # CG: the l = 3 rows 9..15 have no terms
    ProductCase("scavec", SMALL_RANDOM, 1009, (), (1,), integer=True),  # C = 1
    ProductCase("mat_t_vec", SMALL_RANDOM, 101, (48, 3), (48,), integer=True),
])
ODD_SCALE_CASES = sized([
    ScaleCase("random", 1009, 333, 3000, (), 1, integer=True),
    ScaleCase("random", 1009, 333, 3000, (3,), 80, integer=True),
])


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: c.label)
def test_odd_sizes_and_rows_without_terms(case, gpu_triton_only):
    """Sizes that are no block's multiple, and output rows that no segment writes (the random structures leave
    about a third of every grouping's rows empty, the last always): fp32 exact on integers (the CG case: the
    float bound), NaN-poisoned, and the empty rows exactly zero."""
    info = case.infos()[0]
    empty = sorted(set(range(info.out_size)) - set(info.index_out.tolist()))
    assert empty, "the structure should leave an output row without terms"
    z = check_against_oracle(case, torch.float32, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)[0]
    rows = z.index_select(0 if case.out_accumulated else 1, torch.tensor(empty, device=z.device))  # [(N,) M, C...]
    assert not rows.any(), "an output row without terms must be zero"


@pytest.mark.parametrize("case", ODD_CASES, ids=lambda c: c.label)
def test_odd_sizes_walking_every_row(case, gpu_triton_only, all_rows_launches):
    """The odd cases with ALL_ROWS allowed for every op at every batch (attnbench/kernels/sparse/segment.py: a program walks
    every output row of its batch block; by default mul's from 1e4 items): to second order against the oracle,
    NaN-poisoned. Every launch of the segment kernel that may walk the rows does (the others: batch sums, the
    shared-matrix tl.dot route); the forwards the dense, fold and outer-by-dot routes take do not launch it."""
    check_against_oracle(case, torch.float32, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    assert all(k["ALL_ROWS"] == (not k["ACCUMULATE"] and not k["DOT"]) for k in all_rows_launches)
    if case.op == "mul":
        assert any(k["ALL_ROWS"] for k in all_rows_launches)


@pytest.mark.parametrize("case", [c for c in PRODUCT_CASES if c.op in ("mul", "outer")], ids=lambda c: c.label)
def test_walking_every_row_is_bitwise_one_row_a_program(case, gpu_triton_only, all_rows_launches, monkeypatch):
    """Forward, backward and double backward with ALL_ROWS on and off (every op, every batch): each output's terms
    are summed in the same CSR order either way, so the results are bitwise equal."""
    inputs = case.make_inputs(seed=2)
    runs = []
    for enabled in (True, False):
        monkeypatch.setitem(sparse_segment.ALL_ROWS, "enabled", enabled)
        del all_rows_launches[:]
        runs.append([t for t in case.run(inputs, torch.float32) if t is not None])
        assert any(k["ALL_ROWS"] for k in all_rows_launches) == enabled
    assert len(runs[0]) == len(runs[1]) > 0
    for on, off in zip(*runs):
        assert torch.equal(on, off)


@pytest.mark.parametrize("case", ODD_SCALE_CASES, ids=lambda c: c.label)
def test_scale_odd_sizes_and_rows_without_terms(case, gpu_triton_only):
    assert (case.infos()[0].seg_out.diff() == 0).any(), "some output row should have no terms"
    check_against_oracle(case, torch.float32, SCALE_OUTPUTS, (1, 1, 1, 1))
