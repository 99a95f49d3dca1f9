"""How each jvp_attention mode is computed from a forward function through PyTorch's own AD: the
routes a user takes, shared by the eager reference, our Triton op and every peer, so that the
implementations are compared on the same route.

With f(q, k, v) -> o, inputs x = (q, k, v), a tangent u = (tq, tk, tv) and a cotangent dO:

- ``fwd_jvp``      torch.func.jvp(f, x, u)                        -> o, o_t (and lse, lse_t when f gives them)
- ``hvp_fwd_rev``  forward-over-reverse: dual inputs (forward_ad), the gradient of <dO, f> with
                   create_graph, and its tangent                                       -> H u
- ``hvp_rev_rev``  reverse-over-reverse: autograd.grad(create_graph=True), then grad along u -> H u
- ``vjp_of_jvp``   the gradient of a tangent output: torch.func.vjp of (x, u) -> o_t with cotangent dO
- ``hvp_func``     forward-over-reverse the torch.func way: torch.func.jvp(torch.func.grad(<dO, f>))

H is the Hessian of <dO, f(x)>, so the three HVP routes compute the same (hq, hk, hv). The first two
run on PyTorch's core autograd, like for like; ``hvp_func`` is what a torch.func user writes, and
functorch's dispatch of custom autograd Functions costs host time on every call, which its eager
latency shows (its GPU time does not).
"""
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf

from ..flash import forward_output


class DroppedDerivative(RuntimeError):
    """An implementation returned no derivative at all (a None tangent) without raising."""


OUTPUTS = {
    "fwd_jvp": ("o", "lse", "o_t", "lse_t"),
    "hvp_fwd_rev": ("hq", "hk", "hv"),
    "hvp_rev_rev": ("hq", "hk", "hv"),
    "vjp_of_jvp": ("gq", "gk", "gv", "gtq", "gtk", "gtv"),
    "hvp_func": ("hq", "hk", "hv"),
}
MODES = tuple(OUTPUTS)


def fwd_jvp(f, x):
    primal, tangent = tf.jvp(f, (x["q"], x["k"], x["v"]), (x["tq"], x["tk"], x["tv"]))
    if isinstance(primal, tuple):
        return {"o": primal[0], "lse": primal[1], "o_t": tangent[0], "lse_t": tangent[1]}
    return {"o": primal, "o_t": tangent}


def hvp_fwd_rev(f, x):
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with torch.enable_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(a, x[t]) for a, t in zip(leaves, ("tq", "tk", "tv"))]
        grads = torch.autograd.grad(forward_output(f(*duals)), leaves, x["do"], create_graph=True)
        hvp = [fwAD.unpack_dual(g).tangent for g in grads]
    if any(t is None for t in hvp):
        raise DroppedDerivative("the gradient came back without a tangent: forward mode was dropped without an error")
    return dict(zip(OUTPUTS["hvp_fwd_rev"], hvp))


def hvp_rev_rev(f, x):
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with torch.enable_grad():
        grads = torch.autograd.grad(forward_output(f(*leaves)), leaves, x["do"], create_graph=True)
        hvp = torch.autograd.grad(grads, leaves, (x["tq"], x["tk"], x["tv"]))
    return dict(zip(OUTPUTS["hvp_rev_rev"], hvp))


def vjp_of_jvp(f, x):
    def tangent_out(q, k, v, tq, tk, tv):
        return forward_output(tf.jvp(f, (q, k, v), (tq, tk, tv))[1])

    _, pullback = tf.vjp(tangent_out, *(x[n] for n in ("q", "k", "v", "tq", "tk", "tv")))
    return dict(zip(OUTPUTS["vjp_of_jvp"], pullback(x["do"])))


def hvp_func(f, x):
    def loss(q, k, v):
        return (forward_output(f(q, k, v)) * x["do"]).sum()

    primals, tangents = tuple(x[n] for n in ("q", "k", "v")), tuple(x[n] for n in ("tq", "tk", "tv"))
    _, hvp = tf.jvp(tf.grad(loss, argnums=(0, 1, 2)), primals, tangents)
    return dict(zip(OUTPUTS["hvp_func"], hvp))


ROUTES = {"fwd_jvp": fwd_jvp, "hvp_fwd_rev": hvp_fwd_rev, "hvp_rev_rev": hvp_rev_rev, "vjp_of_jvp": vjp_of_jvp,
          "hvp_func": hvp_func}


def run(mode, f, x):
    """The outputs of ``mode`` for forward function ``f`` on inputs ``x`` (a dict with q, k, v, do, tq, tk, tv)."""
    return ROUTES[mode](f, x)
