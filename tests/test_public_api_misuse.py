"""What a user may get wrong, across the public API: an argument of the wrong type is a TypeError
naming it before anything reads it; a derivative a function cannot give is refused, never dropped;
a second-order route is computed, a third-order one refused; and no object keeps vouching for
data a caller can change under it. Each case failed before its fix (noted per test)."""
import dataclasses

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from attnbench.attention import attention_bwd_jvp, attention_jvp, flash_attention, flash_bwd, flash_fwd
from attnbench.cli import main
from attnbench.merge import merge_many, merge_many_triton, merge_states, merge_states_triton
from attnbench.models.tabpfn import Mixture, TabPFNConfig, TabPFNLike
from attnbench.shared_context import shared_context_attention
from attnbench.sparse import FullyConnectedTensorProduct, ToyPotential, product_infos, so3, sparse_mul

pytestmark = pytest.mark.interpreter


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- attention's derivatives

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


# ---------------------------------------------------------------- functions without derivatives

def test_triton_merges_refuse_derivatives():
    """merge_states_triton and merge_many_triton have no derivatives: a gradient came back None and
    a tangent vanished (no error); torch.func failed inside the interpreter."""
    oa, ob = randn(1, 2, 8, 16), randn(1, 2, 8, 16, seed=1)
    la, lb = randn(1, 2, 8, seed=2), randn(1, 2, 8, seed=3)
    with pytest.raises(RuntimeError, match="no backward"):
        merge_states_triton(oa.requires_grad_(), la, ob, lb)
    oa = oa.detach()
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="no forward-mode derivative"):
        merge_states_triton(fwAD.make_dual(oa, torch.ones_like(oa)), la, ob, lb)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda a: merge_many_triton(torch.stack([a, ob]), torch.stack([la, lb]))[0].sum())(oa)
    # the plain PyTorch merges differentiate
    assert torch.func.grad(lambda a: merge_states(a, la, ob, lb)[0].sum())(oa).abs().sum() > 0


@pytest.mark.parametrize("bad", ["x", 5, torch.tensor(0.25)], ids=["str", "int", "tensor"])
def test_out_dtype_must_be_a_dtype(bad):
    o, lse = randn(2, 1, 4, 16), randn(2, 1, 4)
    for call in (lambda: merge_many(o, lse, out_dtype=bad), lambda: merge_states(o[0], lse[0], o[1], lse[1], out_dtype=bad),
                 lambda: merge_many_triton(o, lse, out_dtype=bad)):
        with pytest.raises(TypeError, match="out_dtype must be a torch.dtype"):
            call()


@pytest.mark.parametrize("config,words", [("x", "must be a dict"), ({"BLOCK_MM": 16}, "unknown key 'BLOCK_MM'"),
                                          ({"BLOCK_M": 0}, "positive int")])
def test_a_forced_launch_config_is_checked(config, words):
    q, kc = randn(1, 2, 1, 16).float(), randn(2, 8, 16).float()
    with torch.no_grad(), pytest.raises((TypeError, ValueError), match=words):
        shared_context_attention(q, kc, kc, config=config)


# ---------------------------------------------------------------- wrong types, named

def test_the_tabpfn_model_names_a_bad_argument():
    """Each public method had read .dim() or .shape of a list (AttributeError); a config of zero
    heads had divided by zero."""
    model = TabPFNLike(num_features=3, d_model=16, n_heads=2, n_layers=1, d_ff=16, n_components=2)
    x_ctx, y_ctx, x_test = torch.randn(5, 3), torch.randn(5), torch.randn(2, 3)
    for call, name in [(lambda: model.predict([1.0], y_ctx, x_test), "x_ctx"),
                       (lambda: model.predict(x_ctx, [1.0], x_test), "y_ctx"),
                       (lambda: model.predict(x_ctx, y_ctx, [1.0]), "x_test"),
                       (lambda: model.sample_sequence(x_ctx, y_ctx, [1.0], 2), "x_tgt"),
                       (lambda: model.evaluate_joint_density(x_ctx, y_ctx, x_test, [1.0]), "y_tgt"),
                       (lambda: model.decode_step(model.prefill_context(x_ctx, y_ctx, 2, 1), [1.0]), "x_query"),
                       (lambda: model.decode_step("cache", x_test), "cache"),
                       (lambda: Mixture(*torch.randn(3, 2, 2)).log_density([0.0]), "y")]:
        with pytest.raises(TypeError, match=f"^{name} must be a"):
            call()
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        TabPFNConfig(n_heads=0)
    with pytest.raises(TypeError, match="config must be a TabPFNConfig"):
        TabPFNLike({"d_model": 32})
    with pytest.raises(ValueError, match="num_samples"):
        model.sample_sequence(x_ctx, y_ctx, x_test, 0)


def test_the_equivariant_layers_name_a_bad_argument():
    layer = FullyConnectedTensorProduct(1, 1, 1, 2, 2)
    with pytest.raises(TypeError, match="^x must be a torch.Tensor"):
        layer([1.0], torch.randn(3, 4, dtype=torch.float64))
    potential = ToyPotential()
    positions, species = randn(3, 3), torch.tensor([0, 1, 0])
    src, dst = torch.tensor([0, 1]), torch.tensor([1, 2])
    for args, name in [((None, species, src, dst), "positions"), ((positions, [0, 1, 0], src, dst), "species"),
                       ((positions, species, [0, 1], dst), "src"), ((positions, species, src, 3), "dst")]:
        with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
            potential(*args)
        with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
            potential.energy_and_forces(*args)
    with pytest.raises(ValueError, match="src and dst must have one length"):
        potential(positions, species, src, dst[:1])


@pytest.mark.parametrize("argv", [5, "list", [1, 2], ["list", 3], b"list"], ids=repr)
def test_main_takes_a_list_of_strings(argv):
    """main("list") had been split into characters ("invalid choice: 'l'"); main(5) raised inside argparse."""
    with pytest.raises(TypeError, match="argv must be a list of str"):
        main(argv)


# ---------------------------------------------------------------- data a caller can change

def test_infos_own_their_terms():
    """product_infos had put the caller's scale and index tensors into the backward infos: a caller
    reusing its buffer changed the gradient (off by 71) and not the forward."""
    i1, i2, i3 = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 0, 2, 2]), torch.tensor([2, 0, 1, 2])
    s = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    infos = product_infos(i1, i2, i3, s, 3, 3, 3)
    x, y = randn(2, 3, 4).requires_grad_(), randn(2, 3, 4, seed=1).requires_grad_()
    before = torch.autograd.grad(sparse_mul(x, y, infos).sum(), (x, y))
    for t in (s, i1, i2, i3):
        t.mul_(0)  # the caller reuses its buffers
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(sparse_mul(x, y, infos).sum(), (x, y)), before))
    assert torch.autograd.gradcheck(lambda u, w: sparse_mul(u, w, infos), (x, y))


def test_cached_tables_come_back_as_copies():
    """so3.real_generators handed out its cached tensor: a caller's in-place change altered every
    later Wigner matrix (by 1.66), still orthogonal, so nothing noticed."""
    rotation = so3.wigner_d(1, torch.linalg.matrix_exp(torch.tensor([[0, -0.3, 0.2], [0.3, 0, -0.1], [-0.2, 0.1, 0]],
                                                                       dtype=torch.float64)))
    so3.real_generators(1).mul_(2)
    again = so3.wigner_d(1, torch.linalg.matrix_exp(torch.tensor([[0, -0.3, 0.2], [0.3, 0, -0.1], [-0.2, 0.1, 0]],
                                                                    dtype=torch.float64)))
    assert torch.equal(rotation, again)
