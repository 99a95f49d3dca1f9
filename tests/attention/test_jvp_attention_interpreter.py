"""CPU gate for jvp_attention: every mode of every variant against the float64 oracle, and every
AD route through the Triton kernels (interpreter) in float64: gradcheck and gradgradcheck with
forward and batched AD, finite-difference Hessian-vector products, Hessian symmetry, torch.func,
forward_ad dual tensors, double backward, torch.compile, and the errors of third order."""
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf

from attnbench.bench import verify
from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_attention, flash_bwd, flash_fwd
from attnbench.operators.flash import FlashCase
from attnbench.operators.flash.reference import attention as reference_attention
from attnbench.operators.jvp_attention import TINY_SHAPES

from ..helpers import oracle_cache
from .helpers import sdpa

pytestmark = pytest.mark.interpreter

CASES = [FlashCase(*s, dtype="float32") for s in TINY_SHAPES]
# other dtypes through the Triton route (bf16: the interpreter's labelled fp32 upcast)
DTYPE_CASES = [FlashCase(*TINY_SHAPES[2], dtype="float16"), FlashCase(*TINY_SHAPES[1], dtype="float64"),
               FlashCase(*TINY_SHAPES[0], dtype="bfloat16")]


@pytest.fixture(scope="module")
def jvp_op():
    import attnbench

    return attnbench.get("jvp_attention")


@pytest.fixture(scope="module")
def oracles(jvp_op):
    """The attention conftest's ``oracles`` for jvp_attention (on the CPU: every case kept)."""
    return oracle_cache(jvp_op, "cpu")


MODES = ["fwd_jvp", "hvp_fwd_rev", "hvp_rev_rev", "vjp_of_jvp", "hvp_func"]


@pytest.mark.parametrize("case,mode,variant", [(c, m, v) for c in CASES for m in MODES for v in ("split", "triton", "triton_fused")]
                         + [(c, m, "triton") for c in DTYPE_CASES for m in MODES],
                         ids=lambda p: getattr(p, "label", p))
def test_variant_matches_float64_oracle(jvp_op, oracles, case, mode, variant):
    x, oracle, lowp = oracles(case)
    result = verify.check_variant(jvp_op, variant, case, mode, x, oracle, lowp)
    assert not result.skipped, result.skipped
    assert result.passed, [o for o in result.outputs if not o.passed]
    assert [o.name for o in result.outputs] == list(jvp_op.outputs(mode))


@pytest.mark.parametrize("mode", MODES)
def test_other_seed_and_scale(jvp_op, oracles, mode):
    from dataclasses import replace

    assert set(MODES) == set(jvp_op.modes)
    case = replace(FlashCase(2, 4, 2, 18, 13, 40, "bottom_right", "float32"), scale=0.37)
    x, oracle, lowp = oracles(case, 3)
    for variant in ("split", "triton"):
        assert verify.check_variant(jvp_op, variant, case, mode, x, oracle, lowp).passed, (mode, variant)


# ----------------------------------------------------------------------------- AD through the kernels, fp64

def fp64(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def qkv(b, hq, hk, nq, nk, d, seed=0):
    return fp64(b, hq, nq, d, seed=seed), fp64(b, hk, nk, d, seed=seed + 1), fp64(b, hk, nk, d, seed=seed + 2)


def offset_of(causal, nq, nk):
    return {None: None, "top_left": 0, "bottom_right": nk - nq}[causal]


def ref(causal):
    def f(q, k, v):
        return reference_attention(q, k, v, q.shape[-1] ** -0.5, offset_of(causal, q.shape[2], k.shape[2]))
    return f


def ours(causal):
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, return_lse=True)


def o_only(f):
    return lambda q, k, v: f(q, k, v)[0]


def max_diff(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# (shape, causal): GQA with lengths off the 16-blocks; rows that see no key (their LSE is -inf,
# which finite differences cannot handle, so those cases check O alone).
GRAD_CASES = [((1, 2, 1, 9, 13, 16), None), ((1, 2, 2, 12, 12, 16), "top_left"), ((1, 2, 1, 11, 6, 16), "bottom_right")]


@pytest.mark.parametrize("shape,causal", GRAD_CASES)
def test_gradcheck_every_mode(shape, causal):
    x = tuple(t.requires_grad_() for t in qkv(*shape))
    f = ours(causal) if causal != "bottom_right" else o_only(ours(causal))
    assert torch.autograd.gradcheck(f, x, check_forward_ad=True, check_backward_ad=True, check_batched_grad=True,
                                    check_batched_forward_grad=True, fast_mode=True)


# one gradgradcheck call with both orders checks each in turn: here one order a test (xdist spreads them), the
# batched gradient and the undefined-gradient check with reverse over reverse, which they belong to
SECOND_ORDERS = {"fwd_over_rev": dict(check_fwd_over_rev=True, check_rev_over_rev=False, check_undefined_grad=False),
                 "rev_over_rev": dict(check_fwd_over_rev=False, check_rev_over_rev=True, check_batched_grad=True)}


@pytest.mark.parametrize("order", list(SECOND_ORDERS))
@pytest.mark.parametrize("shape,causal", [((1, 2, 1, 6, 7, 16), None), ((1, 1, 1, 7, 7, 16), "top_left")])
def test_gradgradcheck_fwd_over_rev_and_rev_over_rev(shape, causal, order):
    x = tuple(t.requires_grad_() for t in qkv(*shape))
    assert torch.autograd.gradgradcheck(ours(causal), x, fast_mode=True, **SECOND_ORDERS[order])


@pytest.mark.parametrize("shape,causal", GRAD_CASES)
def test_torch_func_matches_reference(shape, causal):
    x = qkv(*shape)
    u = qkv(*shape, seed=10)
    w = fp64(*x[0].shape, seed=20)
    f, r = o_only(ours(causal)), o_only(ref(causal))

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * w).sum()

    argnums = (0, 1, 2)
    assert max_diff(tf.grad(loss(f), argnums)(*x), tf.grad(loss(r), argnums)(*x)) < 1e-12
    assert max_diff(tf.vjp(f, *x)[1](w), tf.vjp(r, *x)[1](w)) < 1e-12
    assert max_diff(tf.jvp(f, x, u), tf.jvp(r, x, u)) < 1e-12
    xb = tuple(torch.stack([t, 2 * t]) for t in x)
    assert max_diff(tf.vmap(f)(*xb), tf.vmap(r)(*xb)) < 1e-12


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_jacobians_and_hessian_match_reference(transform):
    """jacrev, jacfwd and hessian (each vmaps over a basis, which the Functions fold into the batch),
    on a small GQA case with blind rows: Jacobians in k and v of two projections of O."""
    x, w = qkv(1, 2, 1, 4, 3, 16), fp64(2, 1, 2, 4, 16, seed=20)
    f, r = o_only(ours("bottom_right")), o_only(ref("bottom_right"))

    def proj(f):
        return lambda k, v: (f(x[0], k, v) * w).sum(dim=(1, 2, 3, 4))

    if transform == "jacrev":
        assert max_diff(tf.jacrev(proj(f), (0, 1))(*x[1:]), tf.jacrev(proj(r), (0, 1))(*x[1:])) < 1e-12
    elif transform == "jacfwd":
        assert max_diff(tf.jacfwd(proj(f), (0, 1))(*x[1:]), tf.jacfwd(proj(r), (0, 1))(*x[1:])) < 1e-12
    else:
        hessian = tf.hessian(lambda k: proj(f)(k, x[2])[0])(x[1])
        assert (hessian - tf.hessian(lambda k: proj(r)(k, x[2])[0])(x[1])).abs().max() < 1e-12


def hvp_fwd_rev(f, x, w, u):
    return tf.jvp(lambda *a: tf.grad(lambda *b: (f(*b) * w).sum(), argnums=(0, 1, 2))(*a), x, u)[1]


def hvp_rev_rev(f, x, w, u):
    leaves = [t.detach().requires_grad_() for t in x]
    grads = torch.autograd.grad(f(*leaves), leaves, w, create_graph=True)
    return torch.autograd.grad(grads, leaves, u)


def hvp_dual(f, x, w, u):
    """forward-over-reverse with PyTorch's core forward AD instead of functorch."""
    leaves = [t.detach().requires_grad_() for t in x]
    with fwAD.dual_level():
        grads = torch.autograd.grad(f(*[fwAD.make_dual(a, b) for a, b in zip(leaves, u)]), leaves, w, create_graph=True)
        return [fwAD.unpack_dual(g).tangent for g in grads]


@pytest.mark.parametrize("shape,causal", GRAD_CASES)
def test_hvp_routes_agree_with_finite_differences(shape, causal):
    """H u from forward-over-reverse (torch.func and forward_ad), reverse-over-reverse and the
    direct kernel against central differences of the gradient: O(eps^2) = 1e-10 truncation at
    eps = 1e-5, plus rounding of ~1e-16 / eps."""
    x, u, w = qkv(*shape), qkv(*shape, seed=10), fp64(*qkv(*shape)[0].shape, seed=20)
    f = o_only(ours(causal))
    eps = 1e-5

    def grad_at(t):
        return tf.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2))(*(a + t * b for a, b in zip(x, u)))

    fd = [(p - m) / (2 * eps) for p, m in zip(grad_at(eps), grad_at(-eps))]
    o, lse = flash_fwd(*x, causal=causal)
    routes = {"fwd_rev": hvp_fwd_rev(f, x, w, u), "rev_rev": hvp_rev_rev(f, x, w, u), "dual": hvp_dual(f, x, w, u),
              "kernel": attention_bwd_jvp(w, *x, o, lse, *u, causal=causal)}
    scale = max(t.abs().max().item() for t in fd)
    for name, h in routes.items():
        assert max_diff(h, fd) < 1e-7 * max(1.0, scale), name
    assert max_diff(routes["fwd_rev"], routes["rev_rev"]) < 1e-12


def test_first_order_backward_skips_the_backward_function_but_never_a_dual_tangent(monkeypatch):
    """A first-order backward (no create_graph, no transform) runs the backward kernels without AttentionBackward's
    apply (host time); a dual level is not first order even without create_graph: forward-over-reverse through
    torch.autograd.grad(create_graph=False) must still carry H u (dropped, it would come back None)."""
    from attnbench.attention import autograd as ag

    shape = (1, 2, 1, 7, 9, 16)
    x, u, w = qkv(*shape), qkv(*shape, seed=10), fp64(1, 2, 7, 16, seed=20)
    f = o_only(ours("bottom_right"))
    applied = []
    real = ag.AttentionBackward.apply
    monkeypatch.setattr(ag.AttentionBackward, "apply", lambda *a: applied.append(1) or real(*a))
    leaves = [a.detach().requires_grad_() for a in x]
    first = torch.autograd.grad(f(*leaves), leaves, w)
    assert applied == []
    assert max_diff(first, torch.autograd.grad(o_only(ref("bottom_right"))(*leaves), leaves, w)) < 1e-12
    with fwAD.dual_level():
        grads = torch.autograd.grad(f(*[fwAD.make_dual(a, b) for a, b in zip(leaves, u)]), leaves, w)
        hu = [fwAD.unpack_dual(g).tangent for g in grads]
    assert applied and all(h is not None for h in hu)
    assert max_diff(hu, hvp_dual(f, x, w, u)) < 1e-12


def test_a_second_pass_nothing_differentiates_skips_the_functions_and_keeps_the_values(monkeypatch):
    """The second pass of a reverse-over-reverse HVP (torch.autograd.grad without create_graph) and the vjp of a
    tangent output run kernel 3 (and B) without AttentionBackwardJvp's, AttentionJvp's and AttentionBackward's apply
    (host time, as the first-order backward); their values are those of the Functions' path, and a second pass
    with create_graph still goes through the Functions (a third order must still be refused there)."""
    from attnbench.attention import autograd as ag

    shape = (1, 2, 1, 7, 9, 16)
    x, u, w = qkv(*shape), qkv(*shape, seed=10), fp64(1, 2, 7, 16, seed=20)
    f = o_only(ours("bottom_right"))
    applied = []
    for function in (ag.AttentionBackwardJvp, ag.AttentionJvp, ag.AttentionBackward):
        real = function.apply
        monkeypatch.setattr(function, "apply", lambda *a, real=real, name=function.__name__: applied.append(name)
                            or real(*a))

    def rev_rev():
        leaves = [a.detach().requires_grad_() for a in x]
        grads = torch.autograd.grad(f(*leaves), leaves, w, create_graph=True)
        return torch.autograd.grad(grads, leaves, u)

    def vjp_of_tangent():  # the gradient of a tangent output, taken after its dual level closed
        leaves = [a.detach().requires_grad_() for a in (*x, *u)]
        with fwAD.dual_level():
            o_t = fwAD.unpack_dual(f(*[fwAD.make_dual(a, b) for a, b in zip(leaves[:3], leaves[3:])])).tangent
        return torch.autograd.grad(o_t, leaves, w)

    fast = rev_rev()
    assert applied == ["AttentionBackward"]  # the first pass's, with create_graph: B must be differentiable
    applied.clear()
    fast_tangent = vjp_of_tangent()
    assert applied == ["AttentionJvp"]  # the forward's tangent; its vjp runs the kernels alone
    applied.clear()
    monkeypatch.setattr(ag, "_undifferentiated", lambda: False)  # every pass through the Functions
    slow, slow_tangent = rev_rev(), vjp_of_tangent()
    assert "AttentionBackwardJvp" in applied and "AttentionBackward" in applied
    assert max_diff(fast, slow) == 0 and max_diff(fast_tangent, slow_tangent) == 0
    assert max_diff(fast, hvp_rev_rev(o_only(ref("bottom_right")), x, w, u)) < 1e-10


def test_a_zero_tensor_cotangent_reads_as_zero():
    """torch.func.vjp over torch.func.jvp of (o * w).sum(): the engine hands o's backward one of PyTorch's storage-less
    zero tensors (the tangent's o * w_t term, w_t known zero). Found by review: it reached a launch ("invalid python
    storage"); now it reads as zero and the gradient is the reference's."""
    x, u, w = qkv(1, 2, 1, 5, 7, 16), qkv(1, 2, 1, 5, 7, 16, seed=10), fp64(1, 2, 5, 16, seed=20)

    def grad_of_tangent(att):
        def tangent(q):
            return tf.jvp(lambda y: (att(y, *x[1:]) * w).sum(), (q,), (u[0],))[1]

        out, pull = tf.vjp(tangent, x[0])
        return pull(torch.ones_like(out))

    assert max_diff(grad_of_tangent(o_only(ours(None))), grad_of_tangent(o_only(ref(None)))) < 1e-12


def test_hessian_is_symmetric():
    """<w, H u> = <u, H w> for the Hessian of <dO, O> (both sides from our kernels)."""
    shape = (1, 2, 1, 10, 14, 16)
    x, u, w2 = qkv(*shape), qkv(*shape, seed=10), qkv(*shape, seed=30)
    do = fp64(*x[0].shape, seed=20)
    f = o_only(ours("bottom_right"))
    hu, hw = hvp_fwd_rev(f, x, do, u), hvp_fwd_rev(f, x, do, w2)
    left = sum((a * b).sum() for a, b in zip(w2, hu))
    right = sum((a * b).sum() for a, b in zip(u, hw))
    assert abs(left - right) < 1e-12 * max(1.0, abs(left))


def test_gradient_of_a_tangent_output_and_dual_tensors():
    shape = (2, 2, 1, 9, 11, 24)
    x, t, c = qkv(*shape), qkv(*shape, seed=10), fp64(2, 2, 9, 24, seed=20)
    f, r = o_only(ours("bottom_right")), o_only(ref("bottom_right"))

    def grad_of_tangent(f):
        return tf.grad(lambda *a: (tf.jvp(f, a[:3], a[3:])[1] * c).sum(), argnums=tuple(range(6)))(*x, *t)

    assert max_diff(grad_of_tangent(f), grad_of_tangent(r)) < 1e-12
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(f(*[fwAD.make_dual(a, b) for a, b in zip(x, t)])).tangent
    assert max_diff(tangent, tf.jvp(r, x, t)[1]) < 1e-12
    # the manual fused API agrees with autograd's tangent, and is differentiable itself
    o, lse, o_t, lse_t = attention_jvp(*x, *t, causal="bottom_right")
    assert max_diff((o, o_t), tf.jvp(r, x, t)) < 1e-12
    leaves = [a.clone().requires_grad_() for a in (*x, *t)]
    grads = torch.autograd.grad(attention_jvp(*leaves, causal="bottom_right")[2], leaves, c)
    assert max_diff(grads, grad_of_tangent(r)) < 1e-12


def test_forward_mode_shortcut_never_drops_a_gradient(monkeypatch):
    """torch.func.jvp under forward-only transforms runs the fused op without its autograd Function
    (host time); wherever reverse mode can reach the call (a grad transform around it, or an input
    that requires grad from core autograd) the Function must be there, and gradients must match."""
    import attnbench.attention as api

    shape = (1, 2, 1, 7, 9, 16)
    x, t, c = qkv(*shape), qkv(*shape, seed=10), fp64(1, 2, 7, 16, seed=20)
    f, r = o_only(ours(None)), o_only(ref(None))
    shortcuts = []
    real = api._only_forward_transforms
    monkeypatch.setattr(api, "_only_forward_transforms", lambda *a: shortcuts.append(real(*a)) or shortcuts[-1])
    assert max_diff(tf.jvp(f, x, t), tf.jvp(r, x, t)) < 1e-12
    xb, tb = (tuple(torch.stack([a, 2 * a]) for a in z) for z in (x, t))
    assert max_diff(tf.vmap(lambda *a: tf.jvp(f, a[:3], a[3:]))(*xb, *tb),
                    tf.vmap(lambda *a: tf.jvp(r, a[:3], a[3:]))(*xb, *tb)) < 1e-12
    assert shortcuts == [True, True]
    leaves = [a.clone().requires_grad_() for a in x]  # core autograd around torch.func.jvp
    (tf.jvp(f, tuple(leaves), t)[1] * c).sum().backward()
    expected = tf.grad(lambda *a: (tf.jvp(r, a, t)[1] * c).sum(), argnums=(0, 1, 2))(*x)
    assert max_diff([a.grad for a in leaves], expected) < 1e-12
    assert shortcuts[-1] is False


def test_lse_is_differentiable():
    """The LSE output carries gradients and tangents (its derivative is P): against the reference."""
    x, u = qkv(1, 2, 1, 9, 13, 16), qkv(1, 2, 1, 9, 13, 16, seed=10)
    w = fp64(1, 2, 9, seed=5)

    def loss(f):
        return lambda *a: (f(*a)[1] * w).sum() + f(*a)[0].square().sum()

    assert max_diff(tf.grad(loss(ours(None)), (0, 1, 2))(*x), tf.grad(loss(ref(None)), (0, 1, 2))(*x)) < 1e-12
    assert max_diff(hvp_fwd_rev(lambda *a: ours(None)(*a)[1], x, w, u),
                    hvp_fwd_rev(lambda *a: ref(None)(*a)[1], x, w, u)) < 1e-12


def test_torch_compile_fullgraph_forward_backward_and_func():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16, dtype=torch.float64)

    def model(q, k, v):
        return lin(flash_attention(lin(q), k, v, causal="bottom_right", scale=0.3)).square().sum()

    x = [t.requires_grad_() for t in qkv(2, 4, 2, 11, 15, 16)]
    eager = model(*x)
    eager_grads = torch.autograd.grad(eager, x)
    compiled = torch.compile(model, fullgraph=True)(*x)
    compiled_grads = torch.autograd.grad(compiled, x)
    assert abs(compiled.item() - eager.item()) < 1e-12
    assert max_diff(compiled_grads, eager_grads) < 1e-12
    xd, u = [t.detach() for t in x], qkv(2, 4, 2, 11, 15, 16, seed=10)
    f = o_only(ours("bottom_right"))
    jvp = torch.compile(lambda *a: tf.jvp(f, a[:3], a[3:])[1], fullgraph=True)(*xd, *u)
    assert max_diff(jvp, tf.jvp(o_only(ref("bottom_right")), tuple(xd), u)[1]) < 1e-12
    grad = torch.compile(lambda *a: tf.grad(lambda *b: f(*b).sum(), argnums=(0, 1, 2))(*a), fullgraph=True)(*xd)
    assert max_diff(grad, tf.grad(lambda *b: o_only(ref("bottom_right"))(*b).sum(), argnums=(0, 1, 2))(*xd)) < 1e-12


def test_third_order_and_forward_over_forward_raise_clearly():
    x = qkv(1, 2, 2, 8, 8, 16)
    f = o_only(ours(None))

    def loss(q):
        return f(q, *x[1:]).sum()

    with pytest.raises(NotImplementedError, match="third-order"):
        tf.grad(lambda q: tf.grad(lambda q: tf.grad(loss)(q).sum())(q).sum())(x[0])
    with pytest.raises(NotImplementedError, match="forward-over-forward"):
        tf.jvp(lambda q: tf.jvp(lambda p: f(p, *x[1:]), (q,), (x[1],))[1], (x[0],), (x[2],))
    small = qkv(1, 1, 1, 3, 3, 16)
    with pytest.raises(NotImplementedError, match="forward-over-forward"):  # a vmap between the two jvps
        tf.jacfwd(tf.jacfwd(lambda q: f(q, *small[1:]).sum()))(small[0])


def test_large_tangents_and_near_one_hot_rows_stay_finite_and_exact():
    """Scores up to ~1e3 make softmax rows one-hot to double precision; tangents of size 1e6."""
    q, k, v = qkv(1, 2, 2, 10, 12, 16)
    q = q * 40.0
    t = tuple(a * 1e6 for a in qkv(1, 2, 2, 10, 12, 16, seed=7))
    o, lse, o_t, lse_t = attention_jvp(q, k, v, *t)
    want = tf.jvp(lambda *a: ref(None)(*a), (q, k, v), t)
    for out in (o, lse, o_t, lse_t):
        assert torch.isfinite(out).all()
    assert verify.relative_error(o_t, want[1][0]) < 1e-12 and verify.relative_error(lse_t, want[1][1]) < 1e-12
    do = fp64(1, 2, 10, 16, seed=3)
    h = attention_bwd_jvp(do, q, k, v, o, lse, *t)
    want_h = hvp_fwd_rev(o_only(ref(None)), (q, k, v), do, t)
    assert all(torch.isfinite(a).all() for a in h)
    assert max(verify.relative_error(a, b) for a, b in zip(h, want_h)) < 1e-11


def test_backward_tangent_is_deterministic():
    x, t = qkv(1, 4, 2, 33, 29, 16), qkv(1, 4, 2, 33, 29, 16, seed=4)
    do = fp64(1, 4, 33, 16, seed=9)
    o, lse = flash_fwd(*x, causal="bottom_right")
    assert verify.bitwise_equal_runs(lambda: attention_bwd_jvp(do, *x, o, lse, *t, causal="bottom_right"), runs=2)
    assert verify.bitwise_equal_runs(lambda: flash_bwd(do, *x, o, lse, causal="bottom_right"), runs=2)


# ----------------------------------------------------------------------------- the boundary, CPU side

def test_cpu_fused_sdpa_passes_first_order():
    """SDPA's fused CPU kernel (the FLASH backend on CPU) gives the forward and the gradient..."""
    x = tuple(t.float() for t in qkv(1, 2, 2, 16, 16, 16))
    f, r = sdpa("FLASH_ATTENTION"), o_only(ref("top_left"))
    assert max_diff(f(*x), r(*x)) < 1e-5
    assert max_diff(tf.grad(lambda *a: f(*a).sum(), (0, 1, 2))(*x), tf.grad(lambda *a: r(*a).sum(), (0, 1, 2))(*x)) < 1e-5


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="SDPA's fused CPU kernel has no forward-mode AD (torch 2.13)")
def test_cpu_fused_sdpa_forward_mode():
    x = tuple(t.float() for t in qkv(1, 2, 2, 16, 16, 16))
    tf.jvp(sdpa("FLASH_ATTENTION"), x, x)


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="SDPA's fused CPU kernel has no double backward (torch 2.13)")
def test_cpu_fused_sdpa_grad_of_grad():
    x = tuple(t.float() for t in qkv(1, 2, 2, 16, 16, 16))
    f = sdpa("FLASH_ATTENTION")
    tf.grad(lambda q: tf.grad(lambda q: f(q, *x[1:]).sum())(q).sum())(x[0])


def test_cpu_sdpa_math_differentiates_every_way():
    x, u = tuple(t.float() for t in qkv(1, 2, 2, 16, 16, 16)), tuple(t.float() for t in qkv(1, 2, 2, 16, 16, 16, seed=5))
    w = torch.randn(1, 2, 16, 16)
    # fp32 math against the fp64 reference, absolute: HVP entries are O(1) here, fp32 rounding ~1e-6
    assert max_diff(hvp_fwd_rev(sdpa("MATH"), x, w, u), hvp_fwd_rev(o_only(ref("top_left")), x, w, u)) < 1e-4
    assert math.isfinite(tf.jvp(sdpa("MATH"), x, u)[1].sum().item())


def test_one_key_rows_cancel_exactly_in_low_precision():
    """Row 0 of a top-left causal mask sees one key: P = 1, P_t = 0, so O_t = V_t and its Hessian
    row is 0. The P_t V matmul multiplies P * S_t rounded to fp16/bf16; the shift mu O must use the
    same rounded values or the row keeps (round(S_t) - S_t) V, which second derivatives amplify
    (measured on an H200 at bf16, D = 80: 8% of a typical row)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, tq, tk, tv, do = (torch.randn(1, 2, 24, 32, generator=g).half() for _ in range(7))
    tq, tk = 8 * tq, 8 * tk  # large score tangents make fp16's rounding of P * S_t visible
    o, lse, o_t, lse_t = attention_jvp(q, k, v, tq, tk, tv, causal="top_left")
    assert torch.equal(o_t[:, :, 0], tv[:, :, 0])  # without the matched shift: not equal
    hq, hk, hv = attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, causal="top_left")
    typical = hq[:, :, 1:].float().norm(dim=-1).mean()
    # measured: 4e-8 of a typical row with the matched shift, 3.9e-4 without it
    assert hq[:, :, 0].float().norm(dim=-1).max() < 1e-5 * typical


def test_very_negative_lse_keeps_gradients_finite():
    """Keys past N_K load as zeros: their score is 0 and exp(0 - LSE) overflows when a row's LSE is
    below -88 (fp32) or -709 (fp64). The dQ passes must mask them, or inf * 0 = NaN (found in
    review: flash's dq and kernel 3's hq came out NaN where eager is finite)."""
    g = torch.Generator().manual_seed(0)
    q = (3.5 + 0.1 * torch.randn(1, 1, 17, 64, generator=g)).requires_grad_()
    k = -3.5 + 0.1 * torch.randn(1, 1, 17, 64, generator=g)
    v = torch.randn(1, 1, 17, 64, generator=g)
    o, lse = flash_attention(q, k, v, return_lse=True)
    assert lse.max() < -88
    (dq,) = torch.autograd.grad(o.sum(), q)
    want = torch.autograd.grad(ref(None)(q.double(), k.double(), v.double())[0].sum(), q)[0]
    # finite is the point; the value to fp32 accuracy at scores near -95 (measured 1.2e-5)
    assert torch.isfinite(dq).all() and verify.relative_error(dq, want) < 1e-4
    x = (20 + 0.1 * fp64(1, 1, 17, 16, seed=1), -20 + 0.1 * fp64(1, 1, 17, 16, seed=2), fp64(1, 1, 17, 16, seed=3))
    u, do = qkv(1, 1, 1, 17, 17, 16, seed=4), fp64(1, 1, 17, 16, seed=5)
    o, lse = flash_fwd(*x)
    assert lse.max() < -709
    h = attention_bwd_jvp(do, *x, o, lse, *u)
    want = hvp_fwd_rev(o_only(ref(None)), x, do, u)
    assert all(torch.isfinite(t).all() for t in h) and max_diff(h, want) < 1e-8 * max(t.abs().max() for t in want)


def test_blind_rows_have_zero_tangents_whatever_their_query_holds():
    from attnbench.attention.ops import attention_jvp_op

    q, k, v = qkv(1, 2, 1, 12, 5, 16)
    tq, tk, tv = qkv(1, 2, 1, 12, 5, 16, seed=6)
    q[0, 0, 2] = float("nan")  # row 2 is blind (rows 0..6 see no key)
    tq[0, 1, 3] = float("nan")
    o, lse, o_t, lse_t = attention_jvp(q, k, v, tq, tk, tv, causal="bottom_right")
    o_t2, lse_t2 = attention_jvp_op(q, k, v, o, lse, tq, tk, tv, 0.25, -7)  # the tangent-only launch
    for ot, lt in ((o_t, lse_t), (o_t2, lse_t2)):
        assert torch.all(ot[0, :, :7] == 0) and torch.all(lt[0, :, :7] == 0)
        assert torch.isfinite(ot[0, :, 7:]).all()


def test_split_rescales_across_many_key_blocks():
    """The tiny cases fit one split key block (256 keys): force several, so the online rescaling of
    the tangent accumulators is exercised."""
    from attnbench.operators.jvp_attention import split

    x, t = qkv(1, 2, 1, 13, 19, 16), qkv(1, 2, 1, 13, 19, 16, seed=3)
    do = fp64(1, 2, 13, 16, seed=9)
    o, lse, o_t, lse_t = split.attention_jvp(*x, *t, 0.25, 6, block_n=4)  # bottom-right: Nk - Nq
    want = tf.jvp(ref("bottom_right"), x, t)
    assert max_diff((o, o_t), (want[0][0], want[1][0])) < 1e-12
    finite = torch.isfinite(want[1][1])
    assert (lse_t[finite] - want[1][1][finite]).abs().max() < 1e-12
    h = split.bwd_jvp(do, *x, o, lse, *t, None, o_t, lse_t, 0.25, 6, block_n=4)
    assert max_diff(h, hvp_fwd_rev(o_only(ref("bottom_right")), x, do, t)) < 1e-12


def test_a_tangent_of_another_dtype_is_cast_to_its_primal():
    """forward AD accepts a float64 tangent on a float32 primal; the kernels take one dtype."""
    x = tuple(t.float() for t in qkv(1, 2, 2, 9, 11, 16))
    t = qkv(1, 2, 2, 9, 11, 16, seed=2)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(flash_attention(*[fwAD.make_dual(a, b) for a, b in zip(x, t)])).tangent
    want = tf.jvp(o_only(ref(None)), tuple(a.double() for a in x), t)[1]
    assert tangent.dtype == torch.float32 and verify.relative_error(tangent, want) < 1e-5


def test_manual_backward_recomputes_the_forward_tangents():
    """flash_bwd's o may carry a tangent that is not the forward's (here o is computed from a
    detached v): forward mode through flash_bwd must still give the Hessian along the tangent."""
    x, t, do = qkv(1, 2, 2, 9, 11, 16), qkv(1, 2, 2, 9, 11, 16, seed=2), fp64(1, 2, 9, 16, seed=4)
    got = tf.jvp(lambda a, b, c: flash_bwd(do, a, b, c, *flash_fwd(a, b, c.detach())), x, t)[1]
    assert max_diff(got, hvp_fwd_rev(o_only(ref(None)), x, do, t)) < 1e-12


def test_batches_past_the_grid_limit_launch_in_chunks(monkeypatch):
    """CUDA caps the batch's grid axis at 65535 and vmap/jacrev fold into the batch: the launch
    layer chunks it. With the limit lowered to 2, a batch of 5 gives the same bits."""
    import attnbench.attention.ops as ops

    x, t, do = qkv(5, 2, 1, 9, 11, 16), qkv(5, 2, 1, 9, 11, 16, seed=2), fp64(5, 2, 9, 16, seed=4)

    def everything():
        o, lse, o_t, lse_t = attention_jvp(*x, *t, causal="bottom_right")
        return (o, lse, o_t, lse_t, *flash_bwd(do, *x, o, lse, causal="bottom_right"),
                *attention_bwd_jvp(do, *x, o, lse, *t, causal="bottom_right"))

    whole = everything()
    monkeypatch.setattr(ops, "MAX_GRID_BATCH", 2)
    chunked = everything()
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("mode,launches", [
    # the forward, its tangent (given O, LSE), the backward, kernel 3 with its two row dots
    ("hvp_fwd_rev", {"fwd": 1, "jvp": 1, "bwd": 1, "row_dot": 2, "bwd_jvp": 1}),
    # the same work: kernel 3 recomputes the tangent. A second grad reaches Attention's node with no
    # cotangent; it used to run the whole backward on zeros (0.15 ms of 0.78 on an H200)
    ("hvp_rev_rev", {"fwd": 1, "jvp": 1, "bwd": 1, "row_dot": 2, "bwd_jvp": 1}),
    ("fwd_jvp", {"jvp": 1}),  # one fused kernel
    ("vjp_of_jvp", {"jvp": 1, "bwd": 1, "row_dot": 2, "bwd_jvp": 1}),
])
def test_each_route_launches_each_kernel_once(monkeypatch, mode, launches):
    from collections import Counter

    import attnbench.attention.ops as ops
    from attnbench.operators.jvp_attention import routes

    counts = Counter()
    for short, name in (("fwd", "flash_fwd_launch"), ("bwd", "flash_bwd_launch"), ("jvp", "attention_jvp_launch"),
                        ("row_dot", "row_dot_launch"), ("bwd_jvp", "attention_bwd_jvp_launch")):
        def counted(*args, _launch=getattr(ops, name), _short=short, **kwargs):
            counts[_short] += 1
            return _launch(*args, **kwargs)
        monkeypatch.setattr(ops, name, counted)
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, 2, 9, 16, generator=g) for n in ("q", "k", "v", "do", "tq", "tk", "tv")}
    routes.run(mode, lambda q, k, v: flash_attention(q, k, v), x)
    assert dict(counts) == launches


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_gradient_of_a_tangent_that_requires_grad(which):
    """The gradient of a tangent output with respect to the tangent itself, under torch.func.jvp
    and with forward_ad dual tensors: the forward-mode shortcut (the fused op without its
    Function) had checked only the primals for requires_grad and raised "no autograd formula"."""
    shape = (1, 2, 1, 7, 9, 16)
    x, t, c = qkv(*shape), qkv(*shape, seed=10), fp64(1, 2, 7, 16, seed=20)
    i = "qkv".index(which)
    f, r = o_only(ours("bottom_right")), o_only(ref("bottom_right"))
    expected = torch.autograd.grad((tf.jvp(r, x, tuple(a.requires_grad_(j == i) for j, a in enumerate(t)))[1]
                                    * c).sum(), t[i])[0]
    tangents = tuple(a.detach().requires_grad_(j == i) for j, a in enumerate(t))
    got = torch.autograd.grad((tf.jvp(f, x, tangents)[1] * c).sum(), tangents[i])[0]
    assert max_diff(got, expected) < 1e-12
    with fwAD.dual_level():
        o = f(*(fwAD.make_dual(a, b) for a, b in zip(x, tangents)))
        got = torch.autograd.grad((fwAD.unpack_dual(o).tangent * c).sum(), tangents[i])[0]
    assert max_diff(got, expected) < 1e-12


TRANSFORMS = {
    "grad": lambda f: lambda q: tf.grad(lambda p: f(p).sin().sum())(q),
    "jvp": lambda f: lambda q: tf.jvp(f, (q,), (q.flip(-1),))[1],
    "vmap": lambda f: lambda q: tf.vmap(f)(torch.stack([q, 0.5 * q])).sum(0),
}


@pytest.mark.parametrize("chain", [(a,) for a in TRANSFORMS] + [(a, b) for a in TRANSFORMS for b in TRANSFORMS]
                         + [(a, b, c) for a in TRANSFORMS for b in TRANSFORMS for c in TRANSFORMS],
                         ids="-".join)
def test_every_composition_of_transforms_is_right_or_refused(chain):
    """Each composition of grad, jvp and vmap up to three deep (outermost first): at most second
    order and no jvp of a jvp matches the eager reference; anything else raises
    NotImplementedError (jacfwd(jacfwd(f)) and jvp(vmap(jvp(f))) had raised PyTorch's internal
    "flat_bdims must not be None")."""
    k, v = qkv(1, 1, 1, 3, 4, 16, seed=3)[1:]
    q = fp64(1, 1, 3, 16, seed=4)

    def build(attention):
        f = lambda q: attention(q, k, v)  # noqa: E731
        for name in reversed(chain):
            f = TRANSFORMS[name](f)
        return f

    order = sum(name != "vmap" for name in chain)
    jvps = [i for i, name in enumerate(chain) if name == "jvp"]
    if order <= 2 and len(jvps) < 2:
        assert max_diff(build(o_only(ours("bottom_right")))(q), build(o_only(ref("bottom_right")))(q)) < 1e-11
    else:
        with pytest.raises(NotImplementedError):
            build(o_only(ours("bottom_right")))(q)


def test_traced_and_fake_torch_func_jvp_see_the_custom_op():
    """torch.func.jvp alone launches the fused kernel directly on eager tensors, but under a dispatch mode
    (make_fx's tracing, fake tensors) the custom op must run, or the trace records only the outputs'
    allocations: a traced jvp replayed on new inputs matches the float64 reference, and a fake one has the
    right shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    shape = (1, 2, 1, 7, 9, 16)
    f, r = o_only(ours("bottom_right")), o_only(ref("bottom_right"))

    def jvp_of(g):
        return lambda q, k, v, tq, tk, tv: tf.jvp(g, (q, k, v), (tq, tk, tv))

    traced = make_fx(jvp_of(f))(*qkv(*shape), *qkv(*shape, seed=10))
    assert any("attention_fwd_jvp" in str(n.target) for n in traced.graph.nodes)
    x, t = qkv(*shape, seed=3), qkv(*shape, seed=4)
    assert max_diff(traced(*x, *t), jvp_of(r)(*x, *t)) < 1e-12
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in (*x, *t)]
        o, o_t = jvp_of(f)(*fake)
    assert o.shape == o_t.shape == x[0].shape


@pytest.mark.parametrize("width", [41, 44, 48])
def test_row_strides_off_the_vector_width_match_contiguous(width):
    """Head dim 40 read from rows of ``width`` elements (primals and tangents): the JVP and backward-JVP kernels claim
    only the alignment the strides have (tiling.stride_align: 1, 4 and 8 here; test_vector_loads.py shows the claim's
    16-byte loads on sm_90), and a claim too large would move every row of the interpreter's reads as it would the
    GPU's."""
    g = torch.Generator().manual_seed(11)
    tensors = [torch.randn(2, 2, 5, 40, generator=g) for _ in range(6)]
    views = []
    for t in tensors:
        wide = torch.zeros(*t.shape[:3], width)
        wide[..., :40] = t
        views.append(wide[..., :40])
    for causal in (None, "bottom_right"):
        a = attention_jvp(*views, causal=causal)
        b = attention_jvp(*tensors, causal=causal)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (width, causal)
        # the backward's tangent (the HVP kernels) over the same rows: do, q, k, v, o and four tangents
        do, tdo = views[0], views[3]
        o, lse = flash_fwd(*tensors[:3], causal=causal)
        wide_o = torch.zeros(*o.shape[:3], width)
        wide_o[..., :40] = o
        a = attention_bwd_jvp(do, *views[:3], wide_o[..., :40], lse, *views[3:], tdo, causal=causal)
        b = attention_bwd_jvp(tensors[0], *tensors[:3], o, lse, *tensors[3:], tensors[3], causal=causal)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), ("bwd_jvp", width, causal)
