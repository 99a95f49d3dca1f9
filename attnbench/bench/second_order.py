"""Second-order consistency (seed 003): does forward-over-reverse agree with reverse-over-reverse
and with finite differences, for attention and for PyTorch's own normalizations?

PyTorch computes the jvp of layer_norm's and batch_norm's backward through decompositions that
recompute the mean and variance (they are not part of any graph when saved), so the two Hessian
routes are different code and may disagree; group norm has an explicit rule. For each function f
and dtype, with L(x) = <w, f(x)> and a direction u:
    fwd-over-rev  torch.func.jvp(torch.func.grad(L), x, u)
    rev-over-rev  autograd.grad(<grad(L, create_graph=True), u>)
    truth         central differences of grad(L) along u in float64, Richardson-extrapolated over
                  steps 1e-4 and 5e-5 (O(h^4) truncation: the float64 routes agree with it to
                  4e-12 .. 1e-11, measured on every function here)
Each route is held to the dtype's bound (verify.BOUNDS; float64: TRUTH_ACCURACY, the truth's own),
and, in float32 and float64, the two routes to the same bound against each other (there they agree
to ~1e-7 and 1e-16, far inside it; in bf16 each route's own rounding, ~5e-3, is as large as the
bound, so that comparison would say nothing the two checks against the truth do not).
"""
import torch
import torch.func as tf
import torch.nn.functional as F

from . import verify

FD_STEP = 1e-4
# how well the extrapolated finite differences know the truth: 100x the float64 routes' measured gap
TRUTH_ACCURACY = 1e-9


def _attention(device, dtype):
    from ..attention import flash_attention

    return lambda x: flash_attention(x, x.flip(-2), x.roll(1, -1), causal="bottom_right")


FUNCTIONS = {
    # name: (input shape, f(device, dtype) -> x -> output)
    "attention (ours)": ((1, 2, 12, 16), _attention),
    "layer_norm": ((6, 24), lambda device, dtype: lambda x: F.layer_norm(x, (24,))),
    "batch_norm (training)": ((12, 6), lambda device, dtype: lambda x: F.batch_norm(x, None, None, training=True)),
    "rms_norm": ((6, 24), lambda device, dtype: lambda x: F.rms_norm(x, (24,))),
}


def hvp_routes(f, x, w, u):
    """(fwd-over-rev, rev-over-rev) Hessian-vector products of <w, f(x)> along u."""
    def loss(a):
        return (f(a) * w).sum()

    fwd_rev = tf.jvp(tf.grad(loss), (x,), (u,))[1]
    leaf = x.detach().requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
        (rev_rev,) = torch.autograd.grad(g, leaf, u)
    return fwd_rev, rev_rev


def finite_difference_hvp(f, x, w, u, step=FD_STEP):
    """Central differences of the gradient along u, Richardson-extrapolated (steps h and h/2)."""
    x, w, u = (t.double() for t in (x, w, u))
    grad = tf.grad(lambda a: (f(a) * w).sum())

    def central(h):
        return (grad(x + h * u) - grad(x - h * u)) / (2 * h)

    return (4 * central(step / 2) - central(step)) / 3


def _compare(name, out, want, dtype):
    bound = max(verify.BOUNDS[dtype], TRUTH_ACCURACY)
    err = verify.relative_error(out, want)
    passed = err <= bound
    detail = "" if passed else str(verify.mismatch_report(out, want, rtol=bound))
    return verify.OutputCheck(name, err, float("nan"), bound, passed, detail)


def consistency_checks(device, dtypes=None, seed=0, op_name="jvp_attention", functions=None) -> list:
    """CheckResult rows: per function and dtype, each route against the float64 truth and the two
    routes against each other. Functions that cannot run here (ours without Triton) are skipped
    with the reason."""
    from ..attention import unavailable_reason

    device = torch.device(device)
    dtypes = dtypes or ([torch.float64, torch.float32] + ([torch.bfloat16] if device.type == "cuda" else []))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name, (shape, make) in (functions or FUNCTIONS).items():
        x64, w64, u64 = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
        truth = None
        for dtype in dtypes:
            label = f"{name} {tuple(shape)} {str(dtype).removeprefix('torch.')}"
            result = verify.CheckResult(op_name, "second_order", label, "hvp")
            if name.startswith("attention") and (reason := unavailable_reason(device)):
                result.skipped = reason
                rows.append(result)
                continue
            if truth is None:
                truth = finite_difference_hvp(make(device, torch.float64), x64.to(device), w64.to(device), u64.to(device))
            x, w, u = (t.to(device=device, dtype=dtype) for t in (x64, w64, u64))
            fwd_rev, rev_rev = hvp_routes(make(device, dtype), x, w, u)
            result.outputs += [_compare(f"{n} vs truth", h, truth, dtype) for n, h in (("fwd-over-rev", fwd_rev),
                                                                                      ("rev-over-rev", rev_rev))]
            if dtype in (torch.float32, torch.float64):
                result.outputs.append(_compare("fwd-over-rev vs rev-over-rev", fwd_rev, rev_rev, dtype))
            rows.append(result)
    return rows
