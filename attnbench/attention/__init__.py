"""The Triton attention as one PyTorch op that differentiates every way.

    o = flash_attention(q, k, v, causal=True)       # any AD mode, torch.func, torch.compile

``spec`` says what attention computes (argument checks, the mask); ``ops`` wraps each kernel as a
custom op; ``autograd`` wires them into Functions for every derivative; this module holds the
public functions: arguments checked before anything runs, then one Function.

Calls go through ``torch.compiler.allow_in_graph``: Dynamo puts each into the graph as one node
and AOTAutograd runs the Functions themselves, so ``torch.compile(fullgraph=True)`` works for
forward and backward, and torch.func transforms inside a compiled region work too. (Dynamo on its
own refuses Functions that define ``jvp``, and inside torch.func.jvp it drops the tangent without
an error: torch 2.13.)
"""
import torch
import torch.autograd.forward_ad as fwAD
from torch._C import _functorch
from torch._C._functorch import TransformType, get_interpreter_stack

from ..autocast import autocast_inputs
from ..kernels import interpreting
from ..kernels.precision import lse_dtype
from .autograd import Attention, AttentionBackward, AttentionBackwardJvp, AttentionWithTangent, matched
from .ops import (_check_device, attention_fwd, attention_fwd_jvp, eager_fwd_jvp, unavailable_reason,
                  unsupported_on_cuda)
from .spec import check_like, check_qkv

__all__ = ["attention_bwd_jvp", "attention_jvp", "flash_attention", "flash_bwd", "flash_fwd", "unavailable_reason",
           "unsupported_on_cuda"]


@torch.compiler.allow_in_graph
def _attention(q, k, v, scale, offset):
    return Attention.apply(q, k, v, scale, offset)


@torch.compiler.allow_in_graph
def _attention_with_tangent(q, k, v, tq, tk, tv, scale, offset):
    return AttentionWithTangent.apply(q, k, v, tq, tk, tv, scale, offset)


def _forward_mode_only(q, k, v):
    """(primals, tangents) of q, k, v when forward mode is all that is asked of this call (plain
    dual tensors, or torch.func.jvp / jacfwd as the innermost transform, nothing requiring grad),
    else None. Then one fused kernel gives O and its tangent, instead of autograd running the
    forward and then the Function's jvp (two kernels, 7 matmul units instead of 6, and a second
    trip through functorch). Anything else (reverse mode in play, a grad transform inside) takes
    the general wiring, which handles every composition."""
    if fwAD._current_level < 0 or any(t.requires_grad for t in (q, k, v)):
        return None
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is not None and interpreter.key() != TransformType.Jvp:
        return None
    primals, tangents = zip(*(fwAD.unpack_dual(t) for t in (q, k, v)))
    tangents = matched(*tangents, like=(q, k, v))
    # gradcheck's batched forward-grad test maps tangents with the legacy vmap, which cannot
    # unpack a dual tensor (no batching rule for aten::alias): the general wiring handles it
    legacy = torch._C._functorch.is_legacy_batchedtensor
    if any(t is not None and legacy(t) for t in (q, k, v, *tangents)):
        return None
    return None if all(t is None for t in tangents) else (primals, tangents)


def _base(t):
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _transforms():
    """The functorch transforms on the stack, outermost first (the C stack's keys: the Python
    interpreter objects cost host time on every call)."""
    stack = get_interpreter_stack()
    return [] if stack is None else [i.key() for i in stack]


def _only_forward_transforms(transforms, *tensors):
    """Nothing can ask for a gradient of this call, nor for a second tangent: the functorch
    ``transforms`` on the stack are vmaps and at most one jvp, and none of ``tensors`` (the
    primals and their tangents: the gradient of a tangent output reaches the tangents) requires
    grad from core autograd underneath."""
    # two jvp levels: the unpacked primals still carry the outer tangent, which the op alone would
    # drop; the Function raises for forward-over-forward instead
    if any(k not in (TransformType.Jvp, TransformType.Vmap) for k in transforms) \
            or transforms.count(TransformType.Jvp) > 1:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and _base(t).requires_grad for t in tensors))


def _plain_below(*tensors) -> bool:
    """No dispatch mode is on (make_fx, fake tensors, a FLOP counter: they must see the custom op) and the
    transform's wrappers hold plain tensors."""
    return not torch._C._len_torch_dispatch_stack() and all(t is None or type(_base(t)) is torch.Tensor
                                                             for t in tensors)


def _attention_dual(primals, tangents, scale, offset):
    q, k, v = primals
    transforms = _transforms()
    if _only_forward_transforms(transforms, q, k, v, *tangents):
        # no reverse mode can reach this call: the kernel alone, without the Function around it, whose
        # trip through functorch (custom_function_call) costs host time on every call
        if transforms == [TransformType.Jvp] and _plain_below(*primals, *tangents):
            # torch.func.jvp alone: its wrappers hold plain tensors, which the kernel takes as they are,
            # with the transform's layer off the stack (else it would wrap the outputs the launch
            # allocates); the custom op's trip through functorch is host time too. make_dual below
            # lifts the results into the transform
            layer = _functorch.pop_dynamic_layer_stack()
            try:
                o, lse, o_t, lse_t = eager_fwd_jvp(*(None if t is None else _base(t) for t in (*primals, *tangents)),
                                                   scale, offset)
            finally:
                _functorch.push_dynamic_layer_stack(layer)
        else:
            o, lse, o_t, lse_t = attention_fwd_jvp(q, k, v, *tangents, scale, offset)
    else:
        o, lse, o_t, lse_t = _attention_with_tangent(q, k, v, *tangents, scale, offset)
    return fwAD.make_dual(o, o_t), fwAD.make_dual(lse, lse_t)


def _forward(q, k, v, scale, offset):
    if not torch.compiler.is_compiling():
        if fwAD._current_level >= 0:
            if (dual := _forward_mode_only(q, k, v)) is not None:
                return _attention_dual(*dual, scale, offset)
        elif not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) \
                and not torch._C._are_functorch_transforms_active():
            # no derivative can be asked of this call (no grad, no tangent, no transform): the
            # kernel alone, without the Function and its autograd node
            return attention_fwd(q, k, v, scale, offset)
    return _attention(q, k, v, scale, offset)


@torch.compiler.allow_in_graph
def _attention_backward(q, k, v, o, lse, do, dlse, scale, offset):
    return AttentionBackward.apply(q, k, v, o, lse, do, dlse, scale, offset, False)


@torch.compiler.allow_in_graph
def _attention_backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset):
    return AttentionBackwardJvp.apply(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset)


_CHECKED = {}  # call signature -> (scale, offset): see _checked
MAX_REMEMBERED = 4096  # signatures; past this the memo starts over (a sweep of shapes, not a loop of calls)


def _checked(q, k, v, scale, causal):
    """(softmax scale, causal offset) of a call, after every check. The checks read only shapes,
    dtypes, devices and the two arguments, so a signature that passed once (a training or decode
    loop repeats one) is not checked again: host time is what a small call pays for."""
    key = None
    # (a sparse layout is refused by the full check, never remembered as its dense signature)
    if type(q) is type(k) is type(v) is torch.Tensor and q.layout is k.layout is v.layout is torch.strided \
            and not (q.is_nested or k.is_nested or v.is_nested) and not torch.compiler.is_compiling() \
            and isinstance(causal, (type(None), bool, str)) and isinstance(scale, (type(None), float, int)):
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               type(scale), scale, causal, interpreting())
        if (known := _CHECKED.get(key)) is not None:
            return known
    scale, offset = check_qkv(q, k, v, scale=scale, causal=causal)
    _check_device(q)
    if key is not None:
        if len(_CHECKED) >= MAX_REMEMBERED:
            _CHECKED.clear()
        _CHECKED[key] = scale, offset
    return scale, offset


def _check_tangents(tq, tk, tv, q, k, v, prefix="t"):
    for name, t, like in ((f"{prefix}q", tq, q), (f"{prefix}k", tk, k), (f"{prefix}v", tv, v)):
        if t is not None:
            check_like(name, t, like)


def _check_saved(o, lse, q):
    check_like("o", o, q)
    check_like("lse", lse, q, shape=q.shape[:3], dtype=lse_dtype(q.dtype))


def flash_attention(q, k, v, *, scale=None, causal=None, return_lse=False):
    """softmax(scale Q K^T + causal mask) V on [B, H, N, D] tensors, differentiable every way:
    backward, double backward, forward-mode AD, torch.func (grad, vjp, jvp, jacrev, jacfwd,
    hessian, vmap) and torch.compile. With ``return_lse`` also the row logsumexp [B, Hq, Nq]
    (float32; float64 for float64 inputs), itself differentiable. Inside torch.autocast it computes
    in the region's dtype, as SDPA does."""
    q, k, v = autocast_inputs(q, k, v)
    scale, offset = _checked(q, k, v, scale, causal)
    o, lse = _forward(q, k, v, scale, offset)
    return (o, lse) if return_lse else o


def flash_fwd(q, k, v, *, scale=None, causal=None):
    """(o, lse): the forward alone. Differentiable like ``flash_attention``, autocast like it."""
    q, k, v = autocast_inputs(q, k, v)
    scale, offset = _checked(q, k, v, scale, causal)
    return _forward(q, k, v, scale, offset)


def flash_bwd(do, q, k, v, o, lse, *, scale=None, causal=None, dlse=None):
    """(dq, dk, dv) of <do, o> + <dlse, lse> given the forward's o and lse at (q, k, v) (FA2's
    Algorithm 4). Differentiable: its tangents and gradients are the second-order kernels. o and
    lse count as the forward's outputs at (q, k, v): the derivatives are those of
    x -> B(x, f(x)), their tangents follow q's, k's and v's and their share of a gradient goes to
    q, k and v; a tangent or a gradient asked of o or lse alone is refused, not dropped. Inside
    torch.autocast do, q, k, v and o are cast as ``flash_fwd``'s inputs are (lse and dlse stay float32)."""
    q, k, v, o, do = autocast_inputs(q, k, v, o, do)
    scale, offset = _checked(q, k, v, scale, causal)
    check_like("do", do, q)
    _check_saved(o, lse, q)
    if dlse is not None:
        check_like("dlse", dlse, lse)
    if torch.is_grad_enabled() and (o.requires_grad or lse.requires_grad) \
            and not (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("flash_bwd's gradient goes to q, k and v (o and lse count as the forward's "
                                  "outputs there); o or lse requires grad while q, k and v do not: that gradient "
                                  "would be dropped")
    return _attention_backward(q, k, v, o, lse, do, dlse, scale, offset)


def attention_jvp(q, k, v, tq=None, tk=None, tv=None, *, scale=None, causal=None):
    """(o, lse, o_t, lse_t): the forward and its tangent along (tq, tk, tv) in one fused pass
    (None: a zero tangent). Differentiable in reverse mode (the gradient of a tangent output). Inside
    torch.autocast the primals and tangents are cast as ``flash_attention``'s inputs are."""
    q, k, v, tq, tk, tv = autocast_inputs(q, k, v, tq, tk, tv)
    scale, offset = _checked(q, k, v, scale, causal)
    _check_tangents(tq, tk, tv, q, k, v)
    return _attention_with_tangent(q, k, v, tq, tk, tv, scale, offset)


def attention_bwd_jvp(do, q, k, v, o, lse, tq=None, tk=None, tv=None, tdo=None, *, scale=None, causal=None,
                      dlse=None, tdlse=None, o_t=None, lse_t=None):
    """The tangent of ``flash_bwd(do, q, k, v, o, lse)`` along (tq, tk, tv, tdo, tdlse): with
    tdo = None it is the Hessian of <do, o> applied to (tq, tk, tv). ``o_t``/``lse_t``: the
    forward's tangents along (tq, tk, tv) when already at hand (``attention_jvp`` returns them),
    else computed here. Differentiable in its tangents (it is linear in them: the gradient is the
    same Hessian, symmetric, applied to the cotangent), not in anything else (third order). Inside
    torch.autocast the tensors shaped like q are cast as ``attention_jvp``'s are (the row statistics stay float32)."""
    q, k, v, o, do, tq, tk, tv, tdo, o_t = autocast_inputs(q, k, v, o, do, tq, tk, tv, tdo, o_t)
    scale, offset = _checked(q, k, v, scale, causal)
    check_like("do", do, q)
    _check_saved(o, lse, q)
    _check_tangents(tq, tk, tv, q, k, v)
    if tdo is not None:
        check_like("tdo", tdo, q)
    for name, t in (("dlse", dlse), ("tdlse", tdlse), ("lse_t", lse_t)):
        if t is not None:
            check_like(name, t, lse)
    if o_t is not None:
        check_like("o_t", o_t, q)
    if (o_t is None) != (lse_t is None):
        raise ValueError("o_t and lse_t come together (the forward's tangents), or neither")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (o_t, lse_t)):
        raise NotImplementedError("o_t and lse_t stand for the forward's tangents along (tq, tk, tv): the gradient "
                                  "goes to the tangents, none to them; pass them detached, or leave them out")
    return _attention_backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset)
