"""What a user may get wrong with attention's derivatives: a second-order route is computed, a third-order one
refused, and a derivative flash_bwd cannot give is refused rather than dropped. Each failed before its fix."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

from attnbench.attention import attention_bwd_jvp, flash_attention, flash_bwd, flash_fwd

pytestmark = pytest.mark.interpreter


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_hvp_by_double_backward_is_computed_and_third_order_refused():
    """torch.autograd.functional.hvp differentiates a vjp by its cotangent, which reaches the
    backward's tangent kernel in its (linear) tangent inputs: second order, computed now (it had
    raised "third-order derivatives ... not supported"); a gradient of that in x still raises."""
    q, k, v, u = (randn(1, 2, 8, 16, seed=s) for s in range(4))

    def f(a):
        o, lse = flash_attention(a, k, v, causal="bottom_right", return_lse=True)
        return lse.sum() + o.square().sum()

    _, hvp = torch.autograd.functional.hvp(f, q, u)
    _, vhp = torch.autograd.functional.vhp(f, q, u)  # the Hessian is symmetric: the same vector
    assert (hvp - vhp).abs().max() < 1e-12 and hvp.abs().max() > 0.1
    x = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (hv,) = torch.autograd.grad(g, x, u, create_graph=True)
    with pytest.raises(NotImplementedError, match="third-order"):
        torch.autograd.grad(hv.square().sum(), x)


def test_flash_bwd_refuses_derivatives_in_o_or_lse_alone():
    """o and lse count as the forward's outputs at (q, k, v): a tangent or gradient on them alone
    had come back as zero, silently (finite differences in o read 1.38)."""
    q, k, v, do = (randn(1, 2, 8, 16, seed=s) for s in range(4))
    o, lse = flash_fwd(q, k, v)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="alone would be dropped"):
        flash_bwd(do, q, k, v, fwAD.make_dual(o, torch.randn_like(o)), fwAD.make_dual(lse, torch.randn_like(lse)))
    with pytest.raises(NotImplementedError, match="would be dropped"):
        torch.func.grad(lambda o_: flash_bwd(do, q, k, v, o_, lse)[0].sum())(o)
    with pytest.raises(NotImplementedError, match="none to them"):
        attention_bwd_jvp(do, q, k, v, o, lse, q, o_t=o.clone().requires_grad_(), lse_t=lse)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_the_regions_dtype_as_sdpa_does(dtype):
    """Inside torch.autocast SDPA casts float32 inputs to the region's dtype (float64 stays); the
    kernels had run in float32 and returned float32 there. Gradients come back in the caller's float32."""
    from attnbench.attention import attention_jvp

    q, k, v, t = (randn(1, 2, 8, 16, seed=s).float() for s in range(4))
    x = q.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        o = flash_attention(x, k, v, causal=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o_fwd, lse = flash_fwd(q, k, v)
        _, _, o_t, _ = attention_jvp(q, k, v, t)
        o64 = flash_attention(q.double(), k.double(), v.double())
    assert o.dtype == sdpa.dtype == o_fwd.dtype == o_t.dtype == dtype and lse.dtype == torch.float32
    assert o64.dtype == torch.float64
    assert torch.equal(o, flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True))
    o.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().max() > 0


def test_gradient_of_a_tangent_inside_the_dual_level_says_how_to_get_it():
    """torch.autograd.grad of a tangent output while its dual_level is open also differentiates that gradient
    along the level's tangents (third order) and is refused; the message said only 'third-order' for what the
    user asked as a second derivative. Taken after the level closes it is computed, equal to torch.func's
    grad over jvp (reverse over forward)."""
    q, k, v, t = (randn(1, 2, 8, 16, seed=s) for s in range(4))
    x = q.clone().requires_grad_()
    with fwAD.dual_level():
        o = flash_attention(fwAD.make_dual(x, t), k, v, causal=True)
        o_t = fwAD.unpack_dual(o).tangent
        with pytest.raises(NotImplementedError, match="after the dual_level closes"):
            torch.autograd.grad(o_t.square().sum(), x, retain_graph=True)
    (g,) = torch.autograd.grad(o_t.square().sum(), x)
    f = lambda a: flash_attention(a, k, v, causal=True)  # noqa: E731
    expected = torch.func.grad(lambda a: torch.func.jvp(f, (a,), (t,))[1].square().sum())(q)
    assert (g - expected).abs().max() < 1e-12 and g.abs().max() > 0.1


def test_negative_bit_views_are_read_with_their_sign():
    """A tensor whose negative bit is set (torch._neg_view; the imaginary part of a conjugate) has its sign in a
    flag, not in its storage: the eager launch, which skips the custom op's dispatch (that resolves it), read the
    storage and computed attention of +x for q = -x, with no error (found by review). Every tensor a launch
    takes goes through kernels.launch.readable now: forward, backward and the second-order kernel."""
    from attnbench.attention import attention_jvp

    q, k, v, t, do = (randn(1, 2, 8, 16, seed=s) for s in range(5))
    neg = torch._neg_view
    assert torch.equal(flash_attention(neg(q), k, neg(v), causal=True), flash_attention(-q, k, -v, causal=True))
    o, lse = flash_fwd(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(flash_bwd(neg(do), q, neg(k), v, o, lse),
                                                  flash_bwd(-do, q, -k, v, o, lse)))
    assert all(torch.equal(a, b) for a, b in zip(attention_jvp(q, k, v, neg(t)), attention_jvp(q, k, v, -t)))
    assert all(torch.equal(a, b) for a, b in zip(attention_bwd_jvp(do, q, k, v, o, lse, neg(t)),
                                                  attention_bwd_jvp(do, q, k, v, o, lse, -t)))


@pytest.mark.parametrize("n_q", [4, 70])  # the split-KV route (Nq <= 64) and the tiles
def test_the_output_may_be_edited_in_place(n_q):
    """With one split the split-KV route returned views of a one-split stack, and autograd refuses an in-place
    edit of a view a Function returns: `o[:, :, 0] = 0` raised at Nq <= 64 and worked above (found by review).
    Now both edit; a backward through the edited o is refused alike (the backward reads the forward's o, as
    SDPA's FLASH backward does), while o's clone may be edited freely."""
    q = randn(1, 2, n_q, 16).requires_grad_()
    o = flash_attention(q, q, q)
    o[:, :, 0] = 0.0
    assert not o._is_view()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    o = flash_attention(q, q, q).clone()
    o[:, :, 0] = 0.0
    o.sum().backward()
    assert q.grad.abs().max() > 0


def test_autocast_reaches_the_manual_backward_and_its_tangent():
    """flash_fwd and attention_jvp cast their inputs inside torch.autocast; flash_bwd and attention_bwd_jvp did
    not, so the manual pipeline raised 'o must have dtype torch.float32' there (found by review)."""
    from attnbench.attention import attention_jvp

    q, k, v, t, do = (randn(1, 2, 8, 16, seed=s).float() for s in range(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, lse = flash_fwd(q, k, v)
        grads = flash_bwd(do, q, k, v, o, lse)
        _, _, o_t, lse_t = attention_jvp(q, k, v, t)
        hvp = attention_bwd_jvp(do, q, k, v, o, lse, t, o_t=o_t, lse_t=lse_t)
    bf = [x.bfloat16() for x in (q, k, v, t, do)]
    o16, lse16 = flash_fwd(*bf[:3])
    assert all(torch.equal(a, b) for a, b in zip(grads, flash_bwd(bf[4], *bf[:3], o16, lse16)))
    assert all(g.dtype == torch.bfloat16 for g in (*grads, *hvp))
