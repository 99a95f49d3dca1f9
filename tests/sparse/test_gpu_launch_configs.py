"""GPU gate of the sparse kernels' launch configs (skipped without CUDA; scripts/gpu_gate.sh runs it): the gate runs
one config per kernel key, but the autotuner may pick any on a user's shapes, so every config of both SparseScale
kernels and of the batch sum on matrix units is forced in turn. Cases, oracles and bounds: tests/sparse/gpu_cases.py
(ATTNBENCH_GPU_SPARSE_DRYRUN=1 dry-runs this file).
"""
import dataclasses

import pytest
import torch

from attnbench.kernels.sparse import segment as sparse_segment
from attnbench.kernels.sparse.outer_sum import outer_sum_kernel
from attnbench.sparse import sparse_product, sparse_product_reference, triton_ops

from .gpu_cases import (DTYPES, EXACT_LIMIT, GPU_MARKS, ProductCase, SCALE_OUTPUTS, SMALL_RANDOM, ScaleCase,
                        assert_within, check_against_oracle, sized, unit_roundoff)

pytestmark = GPU_MARKS


# ---------------------------------------------------------------------------------------------------------------------
# SparseScale on [M, C] (a batch of one), every launch config of both scale kernels

SCALE_CONFIG_CASES = sized([
    ScaleCase("segment", 16_001, 1_001, 16_001, (), 96, integer=True),  # forward: 3 lines; backward: row tiles
    ScaleCase("random", 3_001, 2_999, 3_001, (), 800, integer=True),  # ~1 term a row both ways: row tiles (25 lines)
    ScaleCase("segment", 16_001, 1_001, 16_001, (), 128, integer=True),  # 2 lines of 64 both ways
])


@pytest.mark.parametrize("kernel,config", [(name, i) for name in ("sparse_scale_kernel", "sparse_scale_rows_kernel")
                                           for i in range(len(getattr(sparse_segment, name).configs))],
                         ids=lambda v: str(v))
def test_scale_every_launch_config(kernel, config, monkeypatch, gpu_triton_only):
    """Each config of the batched scale kernel (channels folded into lines) and of the row-tile kernel (short rows)
    forced in turn on odd M and odd line counts: fp32 exact on integers, to second order, NaN-poisoned."""
    tuned = getattr(sparse_segment, kernel)
    monkeypatch.setattr(tuned, "configs", [tuned.configs[config]])
    monkeypatch.setattr(tuned, "cache", {})
    for case in SCALE_CONFIG_CASES:
        check_against_oracle(case, torch.float32, SCALE_OUTPUTS, (1, 1, 1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# every launch config of the batch sum on matrix units

OUTER_SUM_CASES = sized([
    ProductCase("outer", SMALL_RANDOM, 1009, (37,), (80,), out_accumulated=True, integer=True),
    ProductCase("outer", SMALL_RANDOM, 2048, (128,), (128,), out_accumulated=True, integer=True),
    ProductCase("outer", SMALL_RANDOM, 700, (32,), (32,), out_accumulated=True, integer=True),
])


@pytest.mark.parametrize("config", range(len(outer_sum_kernel.configs)))
def test_outer_sum_every_launch_config(config, monkeypatch, gpu_triton_only):
    """The correctness gate runs one config per key, but the autotuner may pick any of them on a user's shapes: each
    is forced in turn (the route asserted) on masked and full tiles, the batch sum on integers, so fp32 equals
    float64 bitwise and bf16 and fp16 are its one rounding."""
    calls = []
    launcher = triton_ops.outer_sum_launch
    monkeypatch.setattr(triton_ops, "outer_sum_launch", lambda *a: calls.append(1) or launcher(*a))
    monkeypatch.setitem(triton_ops.FOLD_ROUTE, "enabled", False)  # the kernel, not the fold route's GEMMs
    monkeypatch.setattr(outer_sum_kernel, "configs", [outer_sum_kernel.configs[config]])
    monkeypatch.setattr(outer_sum_kernel, "cache", {})
    for case in OUTER_SUM_CASES:
        inputs, infos = case.make_inputs(), case.infos()
        x, y = inputs["x"].double(), inputs["y"].double()
        abs_info = dataclasses.replace(infos[0], scale=infos[0].scale.abs())

        def batch_sum(a, b, info):  # float64, 8 batch rows an einsum ([8, T, C1, C2] intermediates)
            return sum(sparse_product_reference("outer", a[i:i + 8], b[i:i + 8], info, True)
                       for i in range(0, case.batch, 8))

        exact = batch_sum(x, y, infos[0])
        # every partial sum is bounded by the sum of |terms|: below 2**24, fp32 sums of these integers are exact
        assert float(batch_sum(x.abs(), y.abs(), abs_info).max()) < EXACT_LIMIT
        for dtype in DTYPES + (torch.float16,):
            calls.clear()
            z = sparse_product("outer", x.to(dtype), y.to(dtype), infos, True)
            assert calls, "the matrix-unit route did not run"
            assert_within(f"{case.label} {str(dtype)[6:]} config {config}", z, exact,
                          unit_roundoff(dtype) * exact.abs() if dtype != torch.float32 else 0.0 * exact)
