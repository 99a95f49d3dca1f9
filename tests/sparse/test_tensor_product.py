"""attnbench.sparse.tensor_product end to end: CG product infos against dense Clebsch-Gordan blocks, the fully
connected tensor-product layer against a dense einsum, equivariance under random rotations (Wigner D from
so3), first and second derivatives (gradcheck, gradgradcheck), and a toy potential's energy -> forces ->
force-loss step, whose force Jacobian (minus the energy's Hessian) is checked by finite differences.
CPU only, float64 unless stated; tiny sizes."""
import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

from attnbench.sparse import dense_coefficients, so3, sparse_vecsca
from attnbench.sparse.tensor_product import (FullyConnectedTensorProduct, ToyPotential, all_pairs, cg_product_infos,
                                             irreps_spherical_harmonics)

F64 = dict(dtype=torch.float64)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def block_wigner_d(l_max, rotation):
    """D [(l_max+1)^2, (l_max+1)^2]: block-diagonal Wigner D over irreps 0..l_max, acting on flat features."""
    return torch.block_diag(*(so3.wigner_d(l, rotation) for l in range(l_max + 1)))


def block(l):
    return slice(l * l, (l + 1) * (l + 1))


def dense_cg_product(l1_max, l2_max, l3_max, parity):
    """W [(L3+1)^2, (L1+1)^2, (L2+1)^2] assembled from so3.clebsch_gordan blocks (the oracle)."""
    n1, n2, n3 = (l1_max + 1) ** 2, (l2_max + 1) ** 2, (l3_max + 1) ** 2
    W = torch.zeros(n3, n1, n2, **F64)
    for l1, l2, l3 in so3.tensor_product_paths(l1_max, l2_max, l3_max, parity=parity):
        W[block(l3), block(l1), block(l2)] = so3.clebsch_gordan(l1, l2, l3).permute(2, 0, 1)
    return W


def dense_layer(layer, x, y):
    """The layer's formula by one einsum per path: z[(l3 m3), o] += a_p C_p[m1, m2, m3] x[(l1 m1), i] y[(l2 m2)]
    W[p, i, o], a_p = sqrt((2 l3 + 1) / (C_in * #paths into l3))."""
    z = x.new_zeros(x.shape[0], (layer.l3_max + 1) ** 2, layer.channels_out)
    for p, (l1, l2, l3) in enumerate(layer.paths):
        paths_into = sum(1 for path in layer.paths if path[2] == l3)
        a_p = math.sqrt((2 * l3 + 1) / (layer.channels_in * paths_into))
        C = so3.clebsch_gordan(l1, l2, l3).to(x.dtype)
        z[:, block(l3)] += a_p * torch.einsum("abc,nai,nb,io->nco", C, x[:, block(l1)], y[:, block(l2)],
                                              layer.weight[p])
    return z


# ---------------------------------------------------------------------------------------------------------------------
# structure


@pytest.mark.parametrize("parity", [False, True])
@pytest.mark.parametrize("l_max", [(1, 1, 2), (2, 3, 1), (3, 3, 3)])
def test_cg_product_infos_match_dense_cg_blocks(l_max, parity):
    infos = cg_product_infos(*l_max, parity=parity)
    paths = so3.tensor_product_paths(*l_max, parity=parity)
    assert infos[0].num_terms == sum(so3.num_nonzero(*path) for path in paths)
    W = dense_cg_product(*l_max, parity)
    assert torch.equal(dense_coefficients(infos[0]), W)  # same float64 values, each stored once
    # and applied: z[n, i3] = sum W[i3, i1, i2] x[n, i1, c] y[n, i2]
    n1, n2, _ = (l + 1 for l in l_max)
    x, y = randn(2, n1 ** 2, 3, seed=1), randn(2, n2 ** 2, seed=2)
    torch.testing.assert_close(sparse_vecsca(x, y, infos), torch.einsum("kij,nic,nj->nkc", W, x, y),
                               rtol=1e-13, atol=1e-13)


def test_cg_product_infos_up_to_l6():
    infos = cg_product_infos(6, 6, 6)
    paths = so3.tensor_product_paths(6, 6, 6)
    assert infos[0].num_terms == sum(so3.num_nonzero(*path) for path in paths)
    assert (infos[0].size1, infos[0].size2, infos[0].out_size) == (49, 49, 49)
    # every output row is reached, and the backward groupings hold the same terms
    assert infos[0].index_out.numel() == 49
    assert infos[1].num_terms == infos[2].num_terms == infos[0].num_terms
    parity_infos = cg_product_infos(6, 6, 6, parity=True, dtype=torch.float32)
    assert parity_infos[0].scale.dtype == torch.float32
    assert parity_infos[0].num_terms < infos[0].num_terms


# ---------------------------------------------------------------------------------------------------------------------
# the layer


@pytest.mark.parametrize("parity", [False, True])
@pytest.mark.parametrize("l_max", [(1, 2, 2), (2, 1, 3), (3, 2, 0)])
def test_layer_matches_dense_reference(l_max, parity):
    layer = FullyConnectedTensorProduct(*l_max, 3, 2, parity=parity, seed=5)
    x, y = randn(4, (l_max[0] + 1) ** 2, 3, seed=1), randn(4, (l_max[1] + 1) ** 2, seed=2)
    torch.testing.assert_close(layer(x, y), dense_layer(layer, x, y), rtol=1e-12, atol=1e-12)


def test_layer_float32_and_shared_inputs():
    layer64 = FullyConnectedTensorProduct(2, 2, 2, 3, 4, seed=1)
    layer32 = FullyConnectedTensorProduct(2, 2, 2, 3, 4, seed=1, dtype=torch.float32)
    x, y = randn(3, 9, 3, seed=1), randn(3, 9, seed=2)
    z32 = layer32(x.float(), y.float())
    assert z32.dtype == torch.float32
    torch.testing.assert_close(z32.double(), layer64(x, y), rtol=1e-5, atol=1e-5)
    # an input without N is shared by the batch
    torch.testing.assert_close(layer64(x, y[0]), layer64(x, y[:1].expand(3, 9)), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(layer64(x[0], y), layer64(x[:1].expand(3, 9, 3), y), rtol=1e-13, atol=1e-13)


def test_layer_seeded_init_and_reset():
    a = FullyConnectedTensorProduct(2, 1, 2, 3, 2, seed=7)
    b = FullyConnectedTensorProduct(2, 1, 2, 3, 2, seed=7)
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, FullyConnectedTensorProduct(2, 1, 2, 3, 2, seed=8).weight)
    before = a.weight.detach().clone()
    with torch.no_grad():
        a.weight.zero_()
    a.reset_parameters()
    assert torch.equal(a.weight, before)
    a.reset_parameters(torch.Generator().manual_seed(123))
    assert not torch.equal(a.weight, before)
    with pytest.raises(ValueError, match="x must be"):
        a(randn(2, 4, 3), randn(2, 4))


def test_layer_unit_variance_at_init():
    """a_p makes unit-variance inputs give unit-variance outputs per irrep (the normalization's purpose)."""
    layer = FullyConnectedTensorProduct(2, 2, 2, 16, 16, seed=3)
    z = layer(randn(2000, 9, 16, seed=1), randn(2000, 9, seed=2)).detach()
    for l in range(3):
        assert abs(z[:, block(l)].var().item() - 1) < 0.15  # a wrong a_p is off by sqrt(2 l3 + 1) or more


# measured max |D z(x, y) - z(D x, D y)| / max |z| over 3 random rotations: 5e-16 at L = 1, 4e-15 at L = 2..6
# (the potential: energy 5e-16, forces 1e-15). The bound leaves two and a half orders of magnitude for other
# BLAS / thread counts, while a wrong sign, phase or basis order gives O(1)
EQUIVARIANCE_TOL = 1e-12


@pytest.mark.parametrize("l_max", [(1, 1, 1), (2, 2, 3), (4, 4, 4), (6, 6, 6)])
def test_layer_equivariance(l_max):
    l1, l2, l3 = l_max
    layer = FullyConnectedTensorProduct(l1, l2, l3, 2, 2, seed=4)
    x, y = randn(3, (l1 + 1) ** 2, 2, seed=1), randn(3, (l2 + 1) ** 2, seed=2)
    z = layer(x, y).detach()
    generator = torch.Generator().manual_seed(9)
    for _ in range(3):
        R = so3.random_rotation(generator)
        D1, D2, D3 = (block_wigner_d(l, R) for l in l_max)
        z_rotated = layer(torch.einsum("ij,njc->nic", D1, x), y @ D2.T).detach()
        error = (z_rotated - torch.einsum("ij,njc->nic", D3, z)).abs().max() / z.abs().max()
        assert error < EQUIVARIANCE_TOL, f"relative equivariance error {error:.2e}"


def test_layer_gradcheck_and_gradgradcheck():
    layer = FullyConnectedTensorProduct(1, 1, 2, 2, 2, seed=2)
    x = randn(2, 4, 2, seed=1).requires_grad_()
    y = randn(2, 4, seed=2).requires_grad_()
    weight = layer.weight.detach().clone().requires_grad_()

    def f(x, y, weight):
        return functional_call(layer, {"weight": weight}, (x, y))

    assert gradcheck(f, (x, y, weight))
    assert gradgradcheck(f, (x, y, weight))


# ---------------------------------------------------------------------------------------------------------------------
# the toy potential: energy -> forces -> force loss


def tiny_system(num_atoms=3, seed=0):
    """Positions well inside the cutoff (4) and away from each other, so every pair is a smooth edge."""
    positions = randn(num_atoms, 3, seed=seed)
    species = torch.arange(num_atoms) % 2
    src, dst = all_pairs(num_atoms)
    return positions, species, src, dst


def tiny_potential():
    return ToyPotential(channels=2, l_hidden=1, l_sh=1, num_radial=3, seed=1)


def test_potential_invariance_and_force_equivariance():
    potential = ToyPotential(channels=3, l_hidden=3, l_sh=3, seed=2)
    positions, species, src, dst = tiny_system(5, seed=3)
    energy, forces = potential.energy_and_forces(positions, species, src, dst, create_graph=False)
    torch.testing.assert_close(forces.sum(0), torch.zeros(3, **F64), rtol=0, atol=1e-13)  # translation invariance
    generator = torch.Generator().manual_seed(11)
    for _ in range(3):
        R = so3.random_rotation(generator)
        shift = randn(3, seed=4)
        energy_r, forces_r = potential.energy_and_forces(positions @ R.T + shift, species, src, dst,
                                                         create_graph=False)
        assert abs(energy_r - energy) / abs(energy) < EQUIVARIANCE_TOL
        assert (forces_r - forces @ R.T).abs().max() / forces.abs().max() < EQUIVARIANCE_TOL


def test_potential_float32_matches_float64():
    potential64 = ToyPotential(channels=3, l_hidden=2, l_sh=2, seed=3)
    potential32 = ToyPotential(channels=3, l_hidden=2, l_sh=2, seed=3, dtype=torch.float32)
    positions, species, src, dst = tiny_system(4, seed=6)
    target = randn(4, 3, seed=8)
    energy64, forces64 = potential64.energy_and_forces(positions, species, src, dst)
    energy32, forces32 = potential32.energy_and_forces(positions.float(), species, src, dst)
    assert forces32.dtype == torch.float32
    torch.testing.assert_close(energy32.double(), energy64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(forces32.double(), forces64, rtol=1e-4, atol=1e-5)
    potential32.force_loss(positions.float(), species, src, dst, target.float()).backward()
    potential64.force_loss(positions, species, src, dst, target).backward()
    for p32, p64 in zip(potential32.parameters(), potential64.parameters()):
        torch.testing.assert_close(p32.grad.double(), p64.grad, rtol=1e-3, atol=1e-4)


def test_potential_harmonics_are_rotated_by_wigner_d():
    """The edge features the potential feeds its layers transform as Y(R r) = D(R) Y(r)."""
    vectors = randn(6, 3, seed=5)
    R = so3.random_rotation(torch.Generator().manual_seed(2))
    torch.testing.assert_close(irreps_spherical_harmonics(3, vectors @ R.T),
                               irreps_spherical_harmonics(3, vectors) @ block_wigner_d(3, R).T, rtol=1e-12,
                               atol=1e-12)


def test_forces_gradcheck_hessian():
    """gradcheck of pos -> F(pos): checks the force Jacobian (minus the Hessian), a double backward through the ops."""
    potential = tiny_potential()
    positions, species, src, dst = tiny_system()

    def forces(positions):
        return potential.energy_and_forces(positions, species, src, dst, create_graph=True)[1]

    assert gradcheck(forces, (positions.clone().requires_grad_(),))


def test_force_loss_gradcheck_weights():
    """gradcheck of the force loss w.r.t. every parameter: the training step of a force-matched potential."""
    potential = tiny_potential()
    positions, species, src, dst = tiny_system()
    target = randn(3, 3, seed=7)
    names = [name for name, _ in potential.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in potential.parameters())

    def loss(*params):
        return _force_loss_with(potential, dict(zip(names, params)), positions, species, src, dst, target)

    assert gradcheck(loss, params)
    # and the usual training step gives the same gradient
    potential.zero_grad()
    potential.force_loss(positions, species, src, dst, target).backward()
    expected = torch.autograd.grad(loss(*params), params)
    for p, g in zip(potential.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-13, atol=1e-13)


def _force_loss_with(potential, params, positions, species, src, dst, target):
    """potential.force_loss with ``params`` swapped in (functional_call calls forward, the loss is a method)."""
    positions = positions.detach().requires_grad_()
    energy = functional_call(potential, params, (positions, species, src, dst))
    (grad,) = torch.autograd.grad(energy, positions, create_graph=True)
    return ((-grad - target) ** 2).sum()


def test_force_jacobian_symmetric_by_finite_differences():
    """J = dF/dpos = -Hessian(E) is symmetric. Central differences of the (analytic, first-order) forces give J
    independently of the double backward; autograd's J (double backward) must match it."""
    potential = tiny_potential()
    positions, species, src, dst = tiny_system()
    n = positions.numel()

    def forces(positions):
        return potential.energy_and_forces(positions, species, src, dst, create_graph=False)[1].detach().reshape(-1)

    step = 1e-5
    J_fd = torch.empty(n, n, **F64)
    for j in range(n):
        e = torch.zeros(n, **F64)
        e[j] = step
        J_fd[:, j] = (forces(positions + e.view_as(positions)) - forces(positions - e.view_as(positions))) / (2 * step)
    # central differences err by O(step^2 |F'''|) + O(eps |F| / step). Measured |J - J^T| / |J| (and |J_fd -
    # J_autograd| / |J|): 8e-7 at step 1e-3, 8e-9 at 1e-4 (the step^2 term), 1e-10 (8e-11) at 1e-5, 6e-10 at 1e-6
    # (rounding takes over). So step 1e-5, and the 1e-8 bound: 100x the measured value, still far below what a
    # wrong double-backward term gives (O(1)).
    asymmetry = torch.linalg.matrix_norm(J_fd - J_fd.T) / torch.linalg.matrix_norm(J_fd)
    assert asymmetry < 1e-8, f"finite-difference force Jacobian asymmetry {asymmetry:.2e}"

    def forces_graph(positions):
        return potential.energy_and_forces(positions, species, src, dst, create_graph=True)[1].reshape(-1)

    J_autograd = torch.autograd.functional.jacobian(forces_graph, positions.clone()).reshape(n, n)
    torch.testing.assert_close(J_autograd, J_autograd.T, rtol=1e-12, atol=1e-12)
    assert torch.linalg.matrix_norm(J_autograd - J_fd) / torch.linalg.matrix_norm(J_fd) < 1e-8


@pytest.mark.interpreter  # TRITON_INTERPRET=1: the CSR segment kernels on the CPU
def test_force_training_step_runs_on_the_triton_kernels():
    """Energy -> forces -> force loss -> weight gradient (a derivative of a gradient) with every sparse op on
    the Triton kernels, forward and both backward levels, equal to the split path in float64."""
    from attnbench.sparse import use_implementation

    positions, species, src, dst = tiny_system()
    target = randn(3, 3, seed=7)
    results = {}
    for implementation in ("split", "triton"):
        potential = tiny_potential()
        with use_implementation(implementation):
            loss = potential.force_loss(positions, species, src, dst, target)
            grads = torch.autograd.grad(loss, list(potential.parameters()))
        results[implementation] = (loss, *grads)
    for got, want in zip(results["triton"], results["split"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_layer_and_potential_edge_cases_get_clear_answers():
    """One atom or no edge is a valid graph (no messages: energy 0, forces 0), no atom and a layer of no channels
    are clear errors, and a dtype mismatch names the layer's weight (each had been a ZeroDivisionError, a reshape
    error or an error about an internal tensor)."""
    potential = ToyPotential()
    positions, species = torch.randn(1, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
    energy, forces = potential.energy_and_forces(positions, species, *all_pairs(1))
    assert energy.item() == 0 and forces.shape == (1, 3) and not forces.any()
    with pytest.raises(ValueError, match="no atom"):
        potential(positions[:0], species[:0], *all_pairs(0))
    for args, name in [((1, 1, 1, 0, 2), "channels_in"), ((1, 1, 1, 2, 0), "channels_out"),
                       ((1, -1, 1, 2, 2), "l2_max")]:
        with pytest.raises(ValueError, match=name):
            FullyConnectedTensorProduct(*args)
    layer = FullyConnectedTensorProduct(1, 1, 1, 2, 2)
    with pytest.raises(TypeError, match="layer's weight"):
        layer(torch.randn(3, 4, 2), torch.randn(3, 4))


def test_forces_under_no_grad_and_infos_under_inference_mode():
    """Found by review: energy_and_forces under torch.no_grad() (molecular dynamics' usual setting) raised 'element 0
    of tensors does not require grad', and a layer's infos could not be built under torch.inference_mode() (no
    version counter on inference tensors). Under no_grad the forces are those of grad mode, without a graph."""
    potential = ToyPotential(channels=3, l_hidden=2, l_sh=2, seed=4)
    positions, species, src, dst = tiny_system(4, seed=5)
    energy, forces = potential.energy_and_forces(positions, species, src, dst, create_graph=False)
    with torch.no_grad():
        energy_ng, forces_ng = potential.energy_and_forces(positions, species, src, dst)
    assert torch.equal(energy_ng, energy.detach()) and torch.equal(forces_ng, forces)
    assert not forces_ng.requires_grad and energy_ng.grad_fn is None
    with torch.inference_mode(), pytest.raises(RuntimeError, match="call it under torch.no_grad"):
        potential.energy_and_forces(positions, species, src, dst)
    x, y = randn(4, 4, 3, seed=6), randn(4, 4, seed=7)
    z = FullyConnectedTensorProduct(1, 1, 1, 3, 2, seed=0)(x, y)
    with torch.inference_mode():
        assert torch.equal(FullyConnectedTensorProduct(1, 1, 1, 3, 2, seed=0)(x, y), z)


def test_a_self_loop_edge_is_refused_by_name():
    """An edge from an atom to itself (r = 0, no direction) gave NaN energy and forces without an error (found by
    review)."""
    potential = ToyPotential(channels=3, l_hidden=2, l_sh=2, seed=4)
    positions, species, src, dst = tiny_system(4, seed=5)
    src, dst = torch.cat([src, torch.tensor([2])]), torch.cat([dst, torch.tensor([2])])
    with pytest.raises(ValueError, match=f"edge {src.numel() - 1} goes from an atom to itself"):
        potential(positions, species, src, dst)
