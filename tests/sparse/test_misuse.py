"""The equivariant layers name a bad argument; infos and cached tables hold their own data, so a caller
changing its tensors afterwards changes nothing. Each failed before its fix."""
import torch
import pytest

from attnbench.sparse import FullyConnectedTensorProduct, ToyPotential, product_infos, so3, sparse_mul


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


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



@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_coefficient_that_is_not_finite_is_refused_by_name(bad):
    """A NaN or infinite scale was accepted and every output it reached came back NaN or inf, with no word of
    where from (left alone in an earlier review)."""
    i1, i2, i3 = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 0, 2, 2]), torch.tensor([2, 0, 1, 2])
    s = torch.tensor([1.0, 2.0, bad, 4.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=f"^scale must be finite: a term's coefficient is {bad}"):
        product_infos(i1, i2, i3, s, 3, 3, 3)
    product_infos(i1, i2, i3, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), 3, 3, 3)  # finite: built
