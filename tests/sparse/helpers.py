"""Plain helpers of the sparse tests. The GPU files' cases, oracles and bounds: gpu_cases.py."""
import torch

from attnbench.bench.verify import gamma
from attnbench.kernels.sparse.split_matmul import split_matmul
from attnbench.sparse import sparse_inner, sparse_outer, sparse_product, sparse_product_reference

# (x shared, y shared) of each sharing of a product's inputs: a shared input has no batch dim
SHARING = {"batched": (False, False), "shared_x": (True, False), "shared_y": (False, True), "shared_both": (True, True)}
# channel shapes of (x, y) per op: small, with distinct sizes so that a transposed operand cannot pass
CHANNELS = {
    "mul": ((3,), (3,)), "outer": ((3,), (2,)), "inner": ((3,), (3,)), "vecmat": ((3,), (3, 2)),
    "vecsca": ((3,), ()), "scavec": ((), (3,)), "mat_t_vec": ((3, 2), (3,)),
}

# split_matmul: how far scale (hi + lo) may miss b, relative to |b|, per 16-bit dtype
SPLIT_ERROR = {torch.float16: 2.0 ** -22, torch.bfloat16: 2.0 ** -16}


def check_split_matmul(a, b):
    """split_matmul(a, b) against float64 within the a-priori elementwise bound (see tests/sparse/test_split_matmul.py)."""
    out = split_matmul(a, b)
    exact = a.double() @ b.double()
    floor = 2.0 ** -38 * float(b.abs().max()) * a.double().abs().sum(1, keepdim=True) if b.numel() else 0.0
    bound = (torch.finfo(a.dtype).eps / 2 * exact.abs() + floor
             + (gamma(a.shape[1] + 1, 2.0 ** -24) + SPLIT_ERROR[a.dtype]) * (a.double().abs() @ b.double().abs()))
    assert out.shape == exact.shape and out.dtype == a.dtype
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all()), float((out.double() - exact).abs().max())


def check_compiled_pipeline(infos, x, y, w):
    """Two ops in one graph, compiled whole (Dynamo, fullgraph, aot_eager) against eager, values and gradients to
    1e-12: outer summed over the batch (z [SIZE3, Cx Cy], shared below), then inner of w [N, SIZE2, Cx Cy] with z on
    the rotated infos (bwd1 as the forward: the gather_index path)."""
    def pipeline(x, y, w):
        z = sparse_outer(x, y, infos, out_accumulated=True).flatten(-2)
        return sparse_inner(w, z, infos[1:] + infos[:1]).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(pipeline, backend="aot_eager", fullgraph=True)
    eager_out = pipeline(x, y, w)
    eager_grads = torch.autograd.grad(eager_out, (x, y, w))
    compiled_out = compiled(x, y, w)
    compiled_grads = torch.autograd.grad(compiled_out, (x, y, w))
    torch._dynamo.reset()
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(compiled_grads, eager_grads, rtol=1e-12, atol=1e-12)


def check_product_gradients_match_reference(infos, make_inputs, ops):
    """Exact first derivatives of every op (x batched, y shared: gy sums over the batch) against autograd through
    the einsum reference, to 1e-12 in float64."""
    for op in ops:
        x, y = make_inputs(op, False, True, requires_grad=True)
        weight = torch.randn_like(sparse_product_reference(op, x, y, infos[0]))
        got = torch.autograd.grad((sparse_product(op, x, y, infos) * weight).sum(), (x, y))
        expected = torch.autograd.grad((sparse_product_reference(op, x, y, infos[0]) * weight).sum(), (x, y))
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=op)
