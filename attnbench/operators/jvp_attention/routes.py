"""How each jvp_attention mode is computed from a forward function through PyTorch's own AD: the
routes a user takes, shared by the eager reference, our Triton op and every peer, so that the
implementations are compared on the same route.

With f(q, k, v) -> o, inputs x = (q, k, v), a tangent u = (tq, tk, tv) and a cotangent dO:

- ``fwd_jvp``      torch.func.jvp(f, x, u)                        -> o, o_t (and lse, lse_t when f gives them)
- ``hvp_fwd_rev``  forward-over-reverse: torch.func.jvp of torch.func.grad(<dO, f>)   -> H u
- ``hvp_rev_rev``  reverse-over-reverse: autograd.grad(create_graph=True), then grad along u -> H u
- ``vjp_of_jvp``   the gradient of a tangent output: torch.func.vjp of (x, u) -> o_t with cotangent dO

H is the Hessian of <dO, f(x)>, so both HVP routes compute the same (hq, hk, hv).
"""
import torch
import torch.func as tf

OUTPUTS = {
    "fwd_jvp": ("o", "lse", "o_t", "lse_t"),
    "hvp_fwd_rev": ("hq", "hk", "hv"),
    "hvp_rev_rev": ("hq", "hk", "hv"),
    "vjp_of_jvp": ("gq", "gk", "gv", "gtq", "gtk", "gtv"),
}
MODES = tuple(OUTPUTS)


def _output(out):
    """f may return o or (o, lse)."""
    return out[0] if isinstance(out, tuple) else out


def _loss(f, do):
    def loss(q, k, v):  # its gradient in o is dO exactly, whatever the dtype of the sum
        return (_output(f(q, k, v)) * do).sum()

    return loss


def fwd_jvp(f, x):
    primal, tangent = tf.jvp(f, (x["q"], x["k"], x["v"]), (x["tq"], x["tk"], x["tv"]))
    if isinstance(primal, tuple):
        return {"o": primal[0], "lse": primal[1], "o_t": tangent[0], "lse_t": tangent[1]}
    return {"o": primal, "o_t": tangent}


def hvp_fwd_rev(f, x):
    grad = tf.grad(_loss(f, x["do"]), argnums=(0, 1, 2))
    _, hvp = tf.jvp(grad, (x["q"], x["k"], x["v"]), (x["tq"], x["tk"], x["tv"]))
    return dict(zip(OUTPUTS["hvp_fwd_rev"], hvp))


def hvp_rev_rev(f, x):
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with torch.enable_grad():
        grads = torch.autograd.grad(_output(f(*leaves)), leaves, x["do"], create_graph=True)
        hvp = torch.autograd.grad(grads, leaves, (x["tq"], x["tk"], x["tv"]))
    return dict(zip(OUTPUTS["hvp_rev_rev"], hvp))


def vjp_of_jvp(f, x):
    def tangent_out(q, k, v, tq, tk, tv):
        return _output(tf.jvp(f, (q, k, v), (tq, tk, tv))[1])

    _, pullback = tf.vjp(tangent_out, *(x[n] for n in ("q", "k", "v", "tq", "tk", "tv")))
    return dict(zip(OUTPUTS["vjp_of_jvp"], pullback(x["do"])))


ROUTES = {"fwd_jvp": fwd_jvp, "hvp_fwd_rev": hvp_fwd_rev, "hvp_rev_rev": hvp_rev_rev, "vjp_of_jvp": vjp_of_jvp}


def run(mode, f, x):
    """The outputs of ``mode`` for forward function ``f`` on inputs ``x`` (a dict with q, k, v, do, tq, tk, tv)."""
    return ROUTES[mode](f, x)
