"""Launch plans of the attention kernels on the GPU (skipped without CUDA; scripts/gpu_gate.sh runs it).

A repeated call signature launches each compiled kernel from its plan (attnbench/kernels/launch.py): the C
launcher called directly, host tensor descriptors filled from the new pointers. What it computes must be
bitwise what Triton's own launcher computes, on new data, on another stream and inside a CUDA graph replayed
on new inputs, for every route (the Gluon forward and dK/dV pass with their descriptors, the pointer tiles,
split-KV decode, the backward's passes, the JVP and HVP kernels).
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_attention, flash_bwd
from attnbench.kernels import launch
from attnbench.kernels.attention.flash_bwd import dkdv_route
from attnbench.kernels.attention.flash_fwd import forward_route
from attnbench.kernels.attention.flash_fwd_hopper import GLUON

pytestmark = pytest.mark.gpu

# (B, Hq, Hkv, Nq, Nk, D, causal, dtype, forward route, dK/dV route); odd lengths so that tiles are partial
CASES = [
    (2, 4, 2, 300, 300, 64, "top_left", torch.bfloat16, "hopper", "hopper"),
    (3, 2, 2, 77, 190, 128, "bottom_right", torch.float16, "hopper", None),
    (2, 4, 4, 129, 129, 96, None, torch.bfloat16, "tiles", "tiles"),
    (5, 8, 2, 3, 1000, 64, "bottom_right", torch.bfloat16, "decode", None),
    (1, 2, 1, 200, 257, 72, None, torch.float16, "tiles", "split"),
]


def _routes(fwd, dkdv):
    stack = contextlib.ExitStack()
    stack.enter_context(forward_route(fwd))
    stack.enter_context(dkdv_route(dkdv))
    return stack


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    do, tq, tk, tv = (torch.randn(t.shape, device="cuda", dtype=dtype, generator=g) for t in (q, q, k, v))
    return q, k, v, do, tq, tk, tv


def _every_route(q, k, v, do, tq, tk, tv, causal):
    """Outputs of the forward, the backward, the fused JVP and the HVP kernel."""
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = flash_bwd(do, q, k, v, o, lse, causal=causal)
    jvp = attention_jvp(q, k, v, tq, tk, tv, causal=causal)
    hvp = attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, causal=causal)
    return (o, lse, *grads, *jvp, *hvp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]} H{c[1]}/{c[2]} N{c[3]}x{c[4]} D{c[5]} {c[6]} {c[8]}")
def test_planned_launches_are_bitwise_the_usual_launch(case):
    b, hq, hkv, nq, nk, d, causal, dtype, fwd, dkdv = case
    if "hopper" in (fwd, dkdv) and not (GLUON and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6")
    first, second = _inputs(b, hq, hkv, nq, nk, d, dtype, 1), _inputs(b, hq, hkv, nq, nk, d, dtype, 2)
    with _routes(fwd, dkdv):
        launch.forget_plans()
        usual = [_every_route(*first, causal), _every_route(*second, causal)]  # first call of each signature
        assert launch._PLANS, "no launch was planned"
        assert any(p.c_launch is not None for p in launch._PLANS.values() if isinstance(p, launch.LaunchPlan)), \
            "triton 3.6 on CUDA: plans call the C launcher"
        planned = [_every_route(*second, causal), _every_route(*first, causal)]
        for a, b_ in zip(usual[1] + usual[0], planned[0] + planned[1]):
            assert torch.equal(a, b_)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = _every_route(*first, causal)
        torch.cuda.current_stream().wait_stream(side)
        for a, b_ in zip(usual[0], on_side):
            assert torch.equal(a, b_)
        # a CUDA graph captured from the plans, replayed on new inputs copied into the captured ones
        static = [t.clone() for t in first]
        _every_route(*static, causal)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _every_route(*static, causal)
        for s, t in zip(static, second):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        for a, b_ in zip(usual[1], captured):
            assert torch.equal(a, b_)
    # and right: the forward against SDPA's math in float32 (the float64 gates are test_gpu_flash.py's)
    q, k, v = (t.float() for t in first[:3])
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                         attn_mask=None if causal is None else _mask(nq, nk, causal))
    assert (usual[0][0].float() - ref).abs().max() < 2e-2


def _mask(nq, nk, causal):
    offset = 0 if causal == "top_left" else nk - nq
    return torch.arange(nk, device="cuda")[None, :] <= torch.arange(nq, device="cuda")[:, None] + offset


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_func_jvp_gives_the_fused_kernels_tangent():
    """torch.func.jvp alone launches the fused kernel on the unwrapped tensors (attention/__init__.py):
    primal and tangent equal attention_jvp's, bitwise."""
    q, k, v, _, tq, tk, tv = _inputs(2, 4, 2, 150, 150, 64, torch.bfloat16, 3)
    o, o_t = torch.func.jvp(lambda a, b, c: flash_attention(a, b, c, causal=True), (q, k, v), (tq, tk, tv))
    want = attention_jvp(q, k, v, tq, tk, tv, causal=True)
    assert torch.equal(o, want[0]) and torch.equal(o_t, want[2])
