"""GPU gate of the sparse products' routes off the segment kernel (skipped without CUDA; scripts/gpu_gate.sh runs
it): the fold route of the shared-weight products (cuBLAS or split_matmul), mul's bilinear route on the tensor cores
(and its int64 row offsets), and the fused dense route of vecsca, scavec and inner, each held to the float64 bound.
Cases, oracles and bounds: tests/sparse/gpu_cases.py (ATTNBENCH_GPU_SPARSE_DRYRUN=1 dry-runs this file).
"""
import dataclasses

import pytest
import torch

from attnbench.bench.verify import gamma
from attnbench.kernels.sparse import bilinear as sparse_bilinear
from attnbench.kernels.sparse import channelwise as sparse_channelwise
from attnbench.kernels.sparse import fused_dense as sparse_fused_dense
from attnbench.kernels.sparse.dense import DENSE_OPS as sparse_dense_ops
from attnbench.sparse import CHANNEL_RANKS, sparse_product, sparse_product_reference, triton_ops
from attnbench.sparse.tensor_product import cg_product_infos

from .gpu_cases import (DEVICE, DRYRUN, DTYPES, GPU_MARKS, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS, ProductCase, U32, cg,
                        check_against_oracle, rand, sized)

pytestmark = GPU_MARKS


@pytest.mark.parametrize("split", [False, True], ids=["cublas", "split_matmul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,l_max", [("vecmat", 4), ("mat_t_vec", 3)])
def test_fold_route_matches_float64(op, l_max, dtype, split, gpu_triton_only, monkeypatch):
    """The fold route of the shared-weight products (attnbench/kernels/sparse/fold.py: the weight folded into the
    coefficients, one GEMM over the batch) at a real size: z, the batched vectors' gradient (the other op of the
    pair against the weight transposed: folded too) and the weight's (outer summed over the batch: one GEMM over the
    batch, the fold transposed) against float64. Normwise a-priori bound, A = the same of |x|, |y|, |scale|, |gz|:
    a per-sample output sums m = P C + P products (the GEMM over (i, a), the fold over i2), the weight's gradient
    N + P^2, so (u_out + gamma_m) A with u_out the output's rounding (bf16: 2^-8; fp32: none beyond gamma) and
    2^-16 for the hi + lo split in 16 bits. ``split``: the 16-bit products on attnbench/kernels/sparse/split_matmul.py (both halves
    in one program) instead of cuBLAS."""
    import dataclasses

    from attnbench.kernels.sparse import fold as sparse_fold
    from attnbench.sparse import cg_product_infos, sparse_product, sparse_product_reference, use_implementation
    from attnbench.sparse.triton_ops import FOLD_ROUTE

    assert FOLD_ROUTE["enabled"]
    monkeypatch.setitem(sparse_fold.SPLIT_MATMUL, "enabled", split)
    calls = []
    launcher = sparse_fold.split_matmul
    monkeypatch.setattr(sparse_fold, "split_matmul", lambda *a: calls.append(1) or launcher(*a))
    infos = cg_product_infos(l_max, l_max, l_max, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    batch, channels = 2000, 32
    size = (l_max + 1) ** 2
    vectors = torch.randn(batch, size, channels, device=DEVICE, generator=generator).to(dtype)
    weight = (torch.randn(size, channels, channels, device=DEVICE, generator=generator) / channels ** 0.5).to(dtype)
    x, y = (vectors, weight) if op == "vecmat" else (weight, vectors)
    x64, y64 = x.double().requires_grad_(), y.double().requires_grad_()
    batched = 0 if op == "vecmat" else 1  # which operand has the batch
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    with use_implementation("triton"):
        z = sparse_product(op, xr, yr, infos)
        gz = torch.randn(z.shape, device=DEVICE, generator=generator).to(dtype)
        grads = torch.autograd.grad(z, (xr, yr), gz)
    z64 = sparse_product_reference(op, x64, y64, infos[0])
    grads64 = torch.autograd.grad(z64, (x64, y64), gz.double())
    absolute = dataclasses.replace(infos[0], scale=infos[0].scale.abs())
    xa, ya = x64.detach().abs().requires_grad_(), y64.detach().abs().requires_grad_()
    za = sparse_product_reference(op, xa, ya, absolute)
    grads_a = torch.autograd.grad(za, (xa, ya), gz.double().abs())
    u = 2.0 ** -24
    half = 2.0 ** -8 + 2.0 ** -16 if dtype == torch.bfloat16 else 0.0
    for index, (got, exact, scale) in enumerate(zip((z, *grads), (z64, *grads64), (za, *grads_a))):
        # products summed: size * channels + size a per-sample output, batch + size^2 the weight's gradient
        m = batch + size * size if index == 1 + (1 - batched) else size * channels + size
        rel = m * u / (1 - m * u) + half
        err = (got.double() - exact.detach()).abs().max().item()
        assert err <= rel * scale.max().item(), (index, err, rel * scale.max().item())
    # z and the vectors' gradient take split_matmul in 16 bits when it is on (not in the dry run: bf16 runs upcast)
    assert len(calls) == (2 if split and dtype != torch.float32 and not DRYRUN else 0), calls

# mul on its bilinear route (attnbench/kernels/sparse/bilinear.py) where it pads differently: CG L 2 (9 rows a 16 tile; bf16
# only: fp32 keeps the segment kernel there), L 4 (25: 32), L 6 (49: 64), and a random structure of 24 x 70 -> 80
# (held x of 24 rows, 80 output rows: two row tiles).
BILINEAR_CASES = sized([
    ProductCase("mul", cg(2), 100_000, (32,), (32,)),
    ProductCase("mul", cg(4), 10_000, (32,), (32,)),
    ProductCase("mul", cg(6), 2_000, (32,), (32,)),
    ProductCase("mul", rand(24, 70, 80, 9000), 10_000, (32,), (32,)),
])


@pytest.mark.parametrize("case,dtype", [(c, d) for c in BILINEAR_CASES for d in DTYPES + (torch.float16,)],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_bilinear_route_matches_float64_to_second_order(case, dtype, gpu_triton_only, spy_kernel):
    """Every derivative of mul is a mul: forward, backward and double backward all take the route (a spy counts
    its launches), each held to the float64 bound (fp32: with the tensor cores' terms, matrix_unit_chain)."""
    routed = case.bilinear(dtype)
    # fp32 CG L 2 (15 terms a row) stays on the segment kernel (triton_ops.FP32_MIN_TERMS_PER_ROW), and fp16 where its
    # scaled halves would miss more than 2^-16 of a coefficient (coefficients spanning more than 2^22: no fp16 split);
    # the dry run's tiny random structure is too thin for the route
    expected = not (dtype == torch.float32 and case.structure == cg(2))
    if dtype == torch.float16:
        expected = expected and all(torch.float16 in info.dense_rows["gram"].splits for info in case.infos())
    assert routed == expected or DRYRUN, case.label
    launches = spy_kernel(sparse_bilinear, "bilinear_kernel")
    check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    assert launches.launches >= 5 if routed else not launches.launches  # z, gx, gy, and the double backward's

# vecsca, scavec and inner with both steps of the dense route in one program (attnbench/kernels/sparse/fused_dense.py): CG L 2
# and 3 (9 and 16 rows: one padded tile), batches not a multiple of a program's samples, channels not a multiple of
# the channel tile (37, 33) or below it (5). inner at L 2 (a 9 x 9 Gram grid) and fp32 keep the two launches. The
# channel-wise kernels (the default at L 2 and in fp32) are off in the fused tests and forced on in their own.
FUSED_CASES = sized([
    ProductCase("vecsca", cg(3), 30_001, (37,), ()),
    ProductCase("scavec", cg(3), 30_001, (), (128,)),
    ProductCase("inner", cg(3), 30_001, (33,), (33,)),
    ProductCase("vecsca", cg(2), 10_007, (5,), ()),
    ProductCase("scavec", cg(2), 10_007, (), (32,)),
])


@pytest.mark.parametrize("case,dtype", [(c, d) for c in FUSED_CASES for d in DTYPES + (torch.float16,)],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_fused_dense_route_matches_float64_to_second_order(case, dtype, gpu_triton_only, spy_kernel):
    """vecsca's derivatives are a scavec and an inner (and theirs the same family): in 16 bits every mode takes the
    fused kernels (spies count their launches: at least the forward's, one a backward, two a double backward, where
    L 2's inner products keep two launches), M entering as hi + lo; fp32 keeps the two launches. Each output is held
    to the float64 bound."""
    scaled = spy_kernel(sparse_fused_dense, "scaled_rows_kernel")
    gram = spy_kernel(sparse_fused_dense, "gram_rows_kernel")
    with triton_ops.channelwise(False):
        check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    fused = scaled.launches + gram.launches
    if dtype == torch.float32:
        assert fused == 0 or DRYRUN  # (the dry run's interpreter upcasts bf16, and its fp32 does not fuse either)
    else:
        assert fused >= 4 or DRYRUN


@pytest.mark.parametrize("case,dtype", [(c, d) for c in FUSED_CASES for d in DTYPES + (torch.float16,)],
                         ids=lambda v: v.label if hasattr(v, "label") else str(v)[6:])
def test_channelwise_route_matches_float64_to_second_order(case, dtype, gpu_triton_only, spy_kernel):
    """The same cases on the channel-wise kernels (attnbench/kernels/sparse/channelwise.py), forced on in every dtype:
    every mode takes them (the forward's launch, one a backward, two a double backward at least), each output held to
    the float64 bound."""
    rows = spy_kernel(sparse_channelwise, "channelwise_rows_kernel")
    gram = spy_kernel(sparse_channelwise, "channelwise_gram_kernel")
    with triton_ops.channelwise(True, max_16bit_entries=float("inf")):
        check_against_oracle(case, dtype, PRODUCT_OUTPUTS, PRODUCT_ROUNDINGS)
    assert rows.launches + gram.launches >= 4 or DRYRUN


@pytest.mark.parametrize("op", ["vecsca", "scavec", "inner"])
def test_fused_dense_route_in_float64_and_against_two_launches(op, gpu_triton_only, spy_kernel):
    """fp64 through the fused kernels (3-D fp64 dots) within 1e-12 of the reference on a batch-innermost x (strides,
    not a compact copy's); fp32, on the two launches, and the fused kernels forced on for it, within fp32's bound."""
    infos = cg_product_infos(3, 3, 3, device=DEVICE)
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    generator = torch.Generator(device=DEVICE).manual_seed(7)
    n, c = (5, 3) if DRYRUN else (3001, 19)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float64)

    x = randn(16, *(c,) * rank_x, n).movedim(-1, 0)  # [N, 16, C...] with the batch innermost in memory
    y = randn(n, 16, *(c,) * rank_y)
    launches = spy_kernel(sparse_fused_dense, "gram_rows_kernel" if op == "inner" else "scaled_rows_kernel")
    unrolled = spy_kernel(sparse_channelwise, "channelwise_gram_kernel" if op == "inner" else "channelwise_rows_kernel")
    expected = sparse_product_reference(op, x, y, infos[0])
    with triton_ops.channelwise(False):  # the matrix-unit kernels (fp64 and fp32 take the channel-wise ones by default)
        z = sparse_product(op, x, y, infos)
        torch.testing.assert_close(z, expected, rtol=1e-12, atol=1e-12)
        z32 = sparse_product(op, x.float(), y.float(), infos)
        assert launches.launches == 1  # fp32: two launches
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sparse_fused_dense, "FUSED_DTYPES", sparse_fused_dense.FUSED_DTYPES + (torch.float32,))
            forced = sparse_product(op, x.float(), y.float(), infos)
        assert launches.launches == 2
    # the default: the channel-wise kernels in fp64 and fp32, on the same strided x
    torch.testing.assert_close(sparse_product(op, x, y, infos), expected, rtol=1e-12, atol=1e-12)
    channelwise32 = sparse_product(op, x.float(), y.float(), infos)
    assert unrolled.launches == 2 and launches.launches == 2
    # fp32 sums along a path of at most (a table row, 16 terms; the contraction, 16 rows or C channels) + 3
    # roundings, the output's one: gamma_m(u32) of the absolute values' result
    info = infos[0]
    magnitude = sparse_product_reference(op, x.abs(), y.abs(), dataclasses.replace(info, scale=info.scale.abs()))
    bound = (gamma(16 + max(16, c) + 3, U32) + U32) * magnitude
    for name, got in (("two launches", z32), ("fused", forced)):
        assert ((got.double() - expected).abs() <= bound).all(), name
    # channel-wise: a table row's terms (max_len) then the pairs (16 at most) or, for inner, the channels
    chain = info.dense_rows[sparse_dense_ops[op]].max_len + max(16, c) + 3
    assert ((channelwise32.double() - expected).abs() <= (gamma(chain, U32) + U32) * magnitude).all()

def test_bilinear_route_row_offsets_past_int32(gpu_triton_only):
    """Operands seen as [N, M, C] but stored [M, N, C] (row stride N C = 1.5e8 at N 1.2e6, C 128: row 15's offset
    passes 2**31): the route's row offsets are int64, so the result equals the same call on compact copies,
    bitwise (the same arithmetic in the same order), held and looped operand alike. The dry run: tiny, no overflow."""
    batch, channels = (3, 3) if DRYRUN else (1_200_000, 128)
    infos = cg_product_infos(2 if DRYRUN else 3, 2 if DRYRUN else 3, 2 if DRYRUN else 3, device=DEVICE)
    size = infos[0].size1
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(size, batch, channels, device=DEVICE, generator=generator).to(torch.bfloat16).transpose(0, 1)
    y = torch.randn(size, batch, channels, device=DEVICE, generator=generator).to(torch.bfloat16).transpose(0, 1)
    assert triton_ops._bilinear_table("mul", x, y, infos[0], False) is not None
    for strided in ((x, y.contiguous()), (x.contiguous(), y)):
        z = sparse_product("mul", *strided, infos)
        assert torch.equal(z, sparse_product("mul", x.contiguous(), y.contiguous(), infos))
        del z
