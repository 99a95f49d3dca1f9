"""Autograd Functions over the custom ops, wired as DESIGN.md's differentiation contract says,
with f(x) = (O, LSE), x = (q, k, v), B(x, dO, dLSE) its backward and F(x, x_t) its tangent:

    Attention             f       backward: AttentionBackward (the   jvp: AttentionJvp
                                  kernels alone when first order)
    AttentionBackward     B       backward: kernel 3 and AttentionJvp jvp: AttentionBackwardJvp
    AttentionJvp          F       backward: kernel 3 and B            jvp: raises (fwd-over-fwd)
    AttentionWithTangent  (f, F) in one fused kernel: the manual forward-mode API
    AttentionBackwardJvp  kernel 3, the tangent of B        backward and jvp: raise (third order)

Kernels run only inside a Function's forward, so a backward called under torch.func.grad never
hands a functorch wrapper to a launch. ``generate_vmap_rule`` composes with the ops' vmap rules,
which gives vmap, jacrev, jacfwd and hessian.

The forward's O and LSE travel into AttentionBackward and AttentionJvp as inputs, so that
forward-over-reverse reuses the tangents the forward already computed instead of recomputing
them. They are always the forward's outputs at x, so those Functions return their total
derivative in the x slots and None for O and LSE.
"""
import inspect

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd import Function
from torch._functorch.utils import unwrap_dead_wrappers
from torch.autograd.graph import get_gradient_edge

from .ops import attention_bwd, attention_bwd_jvp, attention_fwd, attention_fwd_jvp, attention_jvp

class DirectApply(Function):
    """A Function whose ``apply`` skips what Function.apply spends on every call outside torch.func
    (binding the arguments to ``forward``'s signature, defaults included): every caller here passes
    all arguments positionally. Under functorch transforms it is Function.apply."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(Function, cls).apply(*unwrap_dead_wrappers(args))


def matched(*tangents, like):
    """Tangents in their primals' dtypes: forward AD accepts a float64 tangent on a float32 primal,
    the kernels take one dtype."""
    return tuple(t if t is None or t.dtype == p.dtype else t.to(p.dtype) for t, p in zip(tangents, like))


THIRD_ORDER = ("third-order derivatives of attention are not supported: the Triton kernels cover the forward, "
               "its backward, forward-mode tangents and every second-order composition of them")
# Reached as well by a second-order request: torch.autograd.grad of a tangent output (reverse over forward)
# called while its fwAD.dual_level is open, where the engine also carries the level's tangents through the
# backward pass: the tangent of that gradient is the third-order part
THIRD_ORDER_TANGENT = (THIRD_ORDER + ". A gradient taken inside forward AD's dual_level is itself differentiated "
                       "along the level's tangents (third order): for the gradient of a tangent output (second order), "
                       "call torch.autograd.grad after the dual_level closes, or use torch.func.grad over torch.func.jvp")


class Attention(DirectApply):
    """(q, k, v) -> (o, lse)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, scale, offset):
        return attention_fwd(q, k, v, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, scale, offset = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.save_for_forward(q, k, v, o, lse)
        ctx.scale, ctx.offset = scale, offset
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse):
        do, dlse = _real(do, dlse)
        if do is None and dlse is None:  # reached with no cotangent (a second grad through B's o, lse)
            return (None,) * 5
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        if _undifferentiated():  # a first-order backward: the kernels alone (host time on every training step)
            return (*attention_bwd(q, k, v, o, lse, do, dlse, ctx.scale, ctx.offset), None, None)
        return (*AttentionBackward.apply(q, k, v, o, lse, do, dlse, ctx.scale, ctx.offset, True), None, None)

    @staticmethod
    def jvp(ctx, tq, tk, tv, _scale, _offset):
        q, k, v, o, lse = ctx.saved_tensors
        return AttentionJvp.apply(q, k, v, o, lse, *matched(tq, tk, tv, like=(q, k, v)), ctx.scale, ctx.offset)


class AttentionJvp(DirectApply):
    """(q, k, v, o, lse, q_t, k_t, v_t) -> (o_t, lse_t), given the forward's o and lse at (q, k, v)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, lse, tq, tk, tv, scale, offset):
        return attention_jvp(q, k, v, o, lse, tq, tk, tv, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, tq, tk, tv, scale, offset = inputs
        o_t, lse_t = output
        ctx.save_for_backward(q, k, v, o, lse, tq, tk, tv, o_t, lse_t)
        # saved for jvp too, though jvp only raises: torch's generated vmap rule pairs the saved
        # tensors with their batch dims, and under vmap inside an outer jvp (jacfwd(jacfwd(f)))
        # an empty forward set failed with "flat_bdims must not be None" before reaching it
        ctx.save_for_forward(q, k, v, o, lse, tq, tk, tv, o_t, lse_t)
        ctx.scale, ctx.offset = scale, offset
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, c_o, c_lse):
        c_o, c_lse = _real(c_o, c_lse)
        q, k, v, o, lse, tq, tk, tv, o_t, lse_t = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = _tangent_vjp(ctx, q, k, v, o, lse, tq, tk, tv, o_t, lse_t, c_o, c_lse, needs[:3], needs[5:8])
        return (*grads[:3], None, None, *grads[3:], None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("forward-over-forward (the jvp of a jvp) of attention is not supported; "
                                  "for second derivatives use forward-over-reverse: torch.func.jvp(torch.func.grad(f))")


def _real(*cotangents):
    """The cotangents with PyTorch's storage-less zero tensors (``_is_zerotensor``: what the engine hands a backward
    for an output whose gradient is known to be zero, e.g. o's in the tangent of o * w under torch.func.vjp over
    torch.func.jvp) as None, which every backward here reads as zero: a launch cannot read a tensor without storage."""
    return tuple(None if c is not None and c._is_zerotensor() else c for c in cotangents)


def _undifferentiated() -> bool:
    """Whether nothing can differentiate what a backward computes now: no create_graph, no dual level, no functorch
    transform. A Function's backward then calls the kernels alone, without the next Function's apply (its host time:
    the apply, setup_context, the saved tensors). Under a dual level a backward without create_graph still carries
    tangents, which only the Functions' jvp gives."""
    return not torch.is_grad_enabled() and fwAD._current_level < 0 and not torch._C._are_functorch_transforms_active()


def _only_needed(grads, needs):
    return tuple(g if n else None for g, n in zip(grads, needs))


def _tangent_vjp(ctx, q, k, v, o, lse, tq, tk, tv, o_t, lse_t, c_o, c_lse, x_needs, t_needs):
    """The vjp of (x, x_t) -> F(x, x_t) with cotangent (c_o, c_lse), as 6 gradients (x then x_t):
    in x, the jvp of B(x, c) along x_t (kernel 3 at dO_t = 0, reusing the forward's tangents
    o_t, lse_t); in x_t, B(x, c), F being linear in x_t."""
    if c_o is None and c_lse is None:
        return (None,) * 6
    c_o = torch.zeros_like(o) if c_o is None else c_o
    gx = gt = (None,) * 3
    plain = _undifferentiated()
    if any(x_needs):
        args = (q, k, v, o, lse, c_o, c_lse, tq, tk, tv, o_t, lse_t, None, None, ctx.scale, ctx.offset)
        gx = attention_bwd_jvp(*args) if plain else AttentionBackwardJvp.apply(*args)
    if any(t_needs):
        args = (q, k, v, o, lse, c_o, c_lse, ctx.scale, ctx.offset)
        gt = attention_bwd(*args) if plain else AttentionBackward.apply(*args, True)
    return (*_only_needed(gx, x_needs), *_only_needed(gt, t_needs))


class AttentionWithTangent(DirectApply):
    """(q, k, v, q_t, k_t, v_t) -> (o, lse, o_t, lse_t) in one fused kernel: the manual forward-mode API."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, tq, tk, tv, scale, offset):
        return attention_fwd_jvp(q, k, v, tq, tk, tv, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, tq, tk, tv, scale, offset = inputs
        o, lse, o_t, lse_t = output
        ctx.save_for_backward(q, k, v, tq, tk, tv, o, lse, o_t, lse_t)
        # saved for jvp too, though jvp only raises: torch's generated vmap rule pairs the saved
        # tensors with their batch dims, and under vmap inside an outer jvp (jacfwd(jacfwd(f)))
        # an empty forward set failed with "flat_bdims must not be None" before reaching it
        ctx.save_for_forward(q, k, v, tq, tk, tv, o, lse, o_t, lse_t)
        ctx.scale, ctx.offset = scale, offset
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, c_o, c_lse, c_ot, c_lset):
        """Cotangents of the tangent outputs as in AttentionJvp; those of (o, lse) add B(x, c) in x."""
        c_o, c_lse, c_ot, c_lset = _real(c_o, c_lse, c_ot, c_lset)
        q, k, v, tq, tk, tv, o, lse, o_t, lse_t = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = list(_tangent_vjp(ctx, q, k, v, o, lse, tq, tk, tv, o_t, lse_t, c_ot, c_lset, needs[:3], needs[3:6]))
        if (c_o is not None or c_lse is not None) and any(needs[:3]):
            c_o = torch.zeros_like(o) if c_o is None else c_o
            primal = AttentionBackward.apply(q, k, v, o, lse, c_o, c_lse, ctx.scale, ctx.offset, True)
            grads[:3] = [p if g is None else g + p for g, p in zip(grads[:3], _only_needed(primal, needs[:3]))]
        return (*grads, None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("forward-over-forward (the jvp of attention_jvp) is not supported; "
                                  "use torch.func.jvp(torch.func.grad(f)) for second derivatives")


class AttentionBackward(DirectApply):
    """(q, k, v, o, lse, dO, dLSE) -> (dq, dk, dv), given the forward's o and lse at (q, k, v):
    its derivatives are those of x -> B(x, f(x), dO, dLSE), o and lse counting as the forward's
    outputs (their gradient goes to x). ``reuse_forward_tangents``: o and lse come from Attention
    itself, so their tangents are the forward's and kernel 3 may reuse them (Attention.backward);
    a caller of the manual API may hand in an o whose tangent is not (computed from a detached
    input, say), so there kernel 3 recomputes them from x's."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, lse, do, dlse, scale, offset, reuse_forward_tangents):
        return attention_bwd(q, k, v, o, lse, do, dlse, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, do, dlse, scale, offset, reuse = inputs
        ctx.save_for_backward(q, k, v, o, lse, do, dlse)
        ctx.save_for_forward(q, k, v, o, lse, do, dlse)
        ctx.scale, ctx.offset, ctx.reuse = scale, offset, reuse
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, tq, tk, tv, to, tlse, tdo, tdlse, _scale, _offset, _reuse):
        q, k, v, o, lse, do, dlse = ctx.saved_tensors
        if tq is None and tk is None and tv is None and (to is not None or tlse is not None):
            raise NotImplementedError("flash_bwd's o and lse count as the forward's outputs at (q, k, v): their "
                                      "tangents follow q's, k's and v's, and a tangent on o or lse alone would be "
                                      "dropped")
        if not ctx.reuse or to is None or tlse is None:  # no forward tangents to reuse: kernel 3 computes them
            to = tlse = None
        tq, tk, tv, to, tdo = matched(tq, tk, tv, to, tdo, like=(q, k, v, o, do))
        return AttentionBackwardJvp.apply(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse,
                                          ctx.scale, ctx.offset)

    @staticmethod
    def backward(ctx, uq, uk, uv):
        """The vjp of B: in x, the Hessian of <dO, o> + <dLSE, lse> along u (symmetric, so kernel 3
        at x_t = u, dO_t = 0); in dO and dLSE, the forward's tangent along u."""
        uq, uk, uv = _real(uq, uk, uv)
        if uq is None and uk is None and uv is None:
            return (None,) * 10
        q, k, v, o, lse, do, dlse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        plain = _undifferentiated()  # a Hessian-vector product's second pass, say: the kernels alone
        o_t = lse_t = None
        if needs[5] or needs[6]:
            args = (q, k, v, o, lse, uq, uk, uv, ctx.scale, ctx.offset)
            o_t, lse_t = attention_jvp(*args) if plain else AttentionJvp.apply(*args)
        gx = (None,) * 3
        if any(needs[:3]):
            args = (q, k, v, o, lse, do, dlse, uq, uk, uv, o_t, lse_t, None, None, ctx.scale, ctx.offset)
            gx = _only_needed(attention_bwd_jvp(*args) if plain else AttentionBackwardJvp.apply(*args), needs[:3])
        return (*gx, None, None, o_t if needs[5] else None, lse_t if needs[6] else None, None, None, None)


class AttentionBackwardJvp(DirectApply):
    """Kernel 3: the tangent of (dq, dk, dv) = B(x, dO, dLSE) along (x_t, dO_t, dLSE_t); o_t and
    lse_t, when given, are the forward's tangents along x_t (else computed here)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset):
        return attention_bwd_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset = inputs
        # The output is linear in the tangents (tq, tk, tv, tdo, tdlse): its gradient there is second
        # order, which torch.autograd.functional.hvp asks for (it differentiates a vjp by its
        # cotangent); a gradient in x, o, lse, dO or dLSE is third order. Kept: where those inputs
        # lead, to tell whether the engine will run them. o_t and lse_t, when given, are the
        # forward's tangents along (tq, tk, tv), a cache of them: the gradient in the tangents is
        # the total one, and none goes to o_t and lse_t.
        ctx.save_for_backward(q, k, v, o, lse, do, dlse)
        ctx.scale, ctx.offset = scale, offset
        ctx.third_order_edges = [get_gradient_edge(t) for t in (q, k, v, o, lse, do, dlse)
                                 if t is not None and t.requires_grad]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        """In the tangents: the Hessian is symmetric, so (tq, tk, tv) get kernel 3 at tangent g
        (dO's tangent zero), and (tdo, tdlse) the forward's tangent along g (B is J^T dO)."""
        gq, gk, gv = _real(gq, gk, gv)
        if _will_run(ctx.third_order_edges):
            raise NotImplementedError(THIRD_ORDER)
        if gq is None and gk is None and gv is None:
            return (None,) * 16
        q, k, v, o, lse, do, dlse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        gt = (None,) * 3
        if any(needs[7:10]):
            gt = _only_needed(AttentionBackwardJvp.apply(q, k, v, o, lse, do, dlse, gq, gk, gv, None, None, None, None,
                                                         ctx.scale, ctx.offset), needs[7:10])
        o_t = lse_t = None
        if needs[12] or needs[13]:
            o_t, lse_t = AttentionJvp.apply(q, k, v, o, lse, gq, gk, gv, ctx.scale, ctx.offset)
        return ((None,) * 7 + gt + (None, None, o_t if needs[12] else None, lse_t if needs[13] else None, None, None))

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(THIRD_ORDER_TANGENT)




def _will_run(edges) -> bool:
    """Whether the backward pass under way computes a gradient along any of ``edges``. Outside a
    pass the engine can run (a functorch transform's), assume it does."""
    try:
        return any(torch._C._will_engine_execute_node(edge.node) for edge in edges)
    except RuntimeError:
        return bool(edges)


def _cache_signatures(*functions):
    """Function.apply binds its arguments with inspect.signature(forward) on every call (torch
    2.11-2.13), host time paid on every apply (docs/measurements/jvp_attention.md); a signature
    stored on the function is returned at once. A Hessian-vector product applies five or six of
    these Functions."""
    for function in functions:
        function.forward.__signature__ = inspect.signature(function.forward)


_cache_signatures(Attention, AttentionJvp, AttentionWithTangent, AttentionBackward, AttentionBackwardJvp)
