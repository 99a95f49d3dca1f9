"""attnbench.sparse.so3: real-basis Clebsch-Gordan coefficients, Wigner D matrices and spherical harmonics,
checked against each other (equivariance), against an independent construction (the CG tensor as the null
space of D1 x D2 x D3 - I) and, where e3nn is installed, against e3nn up to its fixed per-l basis change.
CPU only, float64, no Triton: unmarked, so both gates run it."""
import math

import numpy as np
import pytest
import torch

from attnbench.sparse import so3

TOL = 1e-12
P_YZX = torch.tensor([[0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=torch.float64)  # (x, y, z) -> (y, z, x)


def triangles(l_max):
    return [(l1, l2, l3) for l1 in range(l_max + 1) for l2 in range(l_max + 1) for l3 in range(l_max + 1)
            if abs(l1 - l2) <= l3 <= l1 + l2]


def rotations(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [so3.random_rotation(generator) for _ in range(count)]


def unit_vectors(count, seed=0):
    x = torch.randn(count, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def invariant_space(representations):
    """Orthonormal basis (columns) of the vectors fixed by every (orthogonal) matrix in `representations`: the
    brute-force equivariant maps, independent of Racah. Null space of sum_R (M_R - I)^T (M_R - I), which for
    orthogonal M_R is sum_R (2I - M_R - M_R^T): one symmetric eigendecomposition instead of a tall SVD."""
    n = representations[0].shape[0]
    gram = sum(2 * torch.eye(n, dtype=torch.float64) - M - M.T for M in representations)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    return eigenvectors[:, eigenvalues < 1e-9]


def kron3(A, B, C):
    return torch.kron(A, torch.kron(B, C))  # row-major flattening of [i, j, k], as C.reshape(-1)


# ---------------------------------------------------------------------------------------------------------------------
# Clebsch-Gordan


def test_complex_cg_textbook_values():
    cg = so3._complex_cg
    assert cg(1, 1, 1, -1, 0, 0) == pytest.approx(1 / math.sqrt(3), abs=TOL)
    assert cg(1, 0, 1, 0, 0, 0) == pytest.approx(-1 / math.sqrt(3), abs=TOL)
    assert cg(1, 1, 1, -1, 1, 0) == pytest.approx(1 / math.sqrt(2), abs=TOL)
    assert cg(1, 0, 1, 0, 2, 0) == pytest.approx(math.sqrt(2 / 3), abs=TOL)
    assert cg(2, 2, 1, -1, 2, 1) == pytest.approx(math.sqrt(1 / 3), abs=TOL)  # the PDG table's 2 x 1, M = 1 column
    assert cg(2, 0, 1, 1, 2, 1) == pytest.approx(-math.sqrt(1 / 2), abs=TOL)
    assert cg(1, 1, 1, 0, 1, 0) == 0.0  # M != m1 + m2
    assert cg(1, 0, 1, 0, 1, 0) == pytest.approx(0.0, abs=TOL)  # parity-odd path at m = 0


def test_nonzero_counts():
    assert so3.num_nonzero(1, 1, 2) == 11  # the count
    assert so3.num_nonzero(1, 1, 0) == 3  # delta_ij
    assert so3.num_nonzero(1, 1, 1) == 6  # epsilon_ijk
    for l in range(7):
        assert so3.num_nonzero(0, l, l) == 2 * l + 1
        assert so3.num_nonzero(l, 0, l) == 2 * l + 1
    assert so3.num_nonzero(1, 1, 3) == 0 and so3.num_nonzero(2, 0, 1) == 0  # outside the triangle
    assert not so3.clebsch_gordan(1, 1, 3).any()


def test_small_cg_closed_forms():
    """(1,1,0) is the dot product and (1,1,1) the cross product, in the (y, z, x) order of the real basis."""
    dot = so3.clebsch_gordan(1, 1, 0)[:, :, 0]
    assert torch.allclose(dot, torch.sign(dot[0, 0]) * torch.eye(3, dtype=torch.float64) / math.sqrt(3), atol=TOL)
    epsilon = torch.zeros(3, 3, 3, dtype=torch.float64)
    for i, j, k in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):  # cyclic in (y, z, x) is cyclic in (x, y, z)
        epsilon[i, j, k], epsilon[j, i, k] = 1, -1
    cross = so3.clebsch_gordan(1, 1, 1)
    sign = torch.sign((cross * epsilon).sum())
    assert torch.allclose(cross, sign * epsilon / math.sqrt(6), atol=TOL)


@pytest.mark.parametrize("l_max", [6])
def test_cg_real_normalized_and_cached(l_max):
    for path in triangles(l_max):
        C = so3.clebsch_gordan(*path)
        assert C.dtype == torch.float64 and C.shape == tuple(2 * l + 1 for l in path)
        assert torch.linalg.vector_norm(C).item() == pytest.approx(1.0, abs=TOL)
    C = so3.clebsch_gordan(2, 2, 2)
    C.zero_()  # a copy: the cache stays intact
    assert torch.linalg.vector_norm(so3.clebsch_gordan(2, 2, 2)).item() == pytest.approx(1.0, abs=TOL)


def test_cg_orthogonality():
    """With C of Frobenius norm 1, B[(m1, m2), (l3, m3)] = sqrt(2 l3 + 1) C(l1, l2, l3)[m1, m2, m3] over all
    allowed l3 is a square orthogonal matrix: B^T B = B B^T = I (the standard CG unitarity, in the real basis)."""
    for l1 in range(7):
        for l2 in range(7):
            n = (2 * l1 + 1) * (2 * l2 + 1)
            B = torch.cat([math.sqrt(2 * l3 + 1) * so3.clebsch_gordan(l1, l2, l3).reshape(n, -1)
                           for l3 in range(abs(l1 - l2), l1 + l2 + 1)], dim=1)
            assert B.shape == (n, n)
            identity = torch.eye(n, dtype=torch.float64)
            assert torch.allclose(B.T @ B, identity, atol=TOL) and torch.allclose(B @ B.T, identity, atol=TOL)


def test_cg_equivariance():
    paths = triangles(4) + [(5, 1, 4), (5, 1, 6), (3, 3, 6), (6, 6, 0), (6, 6, 6), (6, 5, 3), (4, 6, 5)]
    for R in rotations(2, seed=1):
        D = [so3.wigner_d(l, R) for l in range(7)]
        for l1, l2, l3 in paths:
            C = so3.clebsch_gordan(l1, l2, l3)
            rotated_inputs = torch.einsum("abc,ai,bj->ijc", C, D[l1], D[l2])
            rotated_output = torch.einsum("ijk,ck->ijc", C, D[l3])
            assert (rotated_inputs - rotated_output).abs().max() < TOL, (l1, l2, l3)


def test_cg_matches_null_space_construction():
    """Independent of Racah and of the change of basis: the equivariant (l1, l2, l3) maps are the vectors
    fixed by D1 x D2 x D3 for two random rotations (which generate a dense subgroup). That space must be
    1-dimensional and spanned by the CG tensor; its nonzero pattern then confirms num_nonzero."""
    R1, R2 = rotations(2, seed=2)
    D1, D2 = [so3.wigner_d(l, R1) for l in range(4)], [so3.wigner_d(l, R2) for l in range(4)]
    for l1, l2, l3 in triangles(3):
        basis = invariant_space([kron3(D[l1], D[l2], D[l3]) for D in (D1, D2)])
        assert basis.shape[1] == 1, (l1, l2, l3)
        C = so3.clebsch_gordan(l1, l2, l3).reshape(-1)
        assert abs(torch.dot(C, basis[:, 0])).item() == pytest.approx(1.0, abs=1e-10), (l1, l2, l3)
        assert int((basis[:, 0].abs() > 1e-9).sum()) == so3.num_nonzero(l1, l2, l3), (l1, l2, l3)
    # and outside the triangle nothing is equivariant
    basis = invariant_space([kron3(D[1], D[1], D[3]) for D in (D1, D2)])
    assert basis.shape[1] == 0


# ---------------------------------------------------------------------------------------------------------------------
# Wigner D and spherical harmonics


def special_rotations():
    """Every branch of the axis-angle extraction: identity, half turns about x, y, z and a skew axis, small angles."""
    out = [torch.eye(3, dtype=torch.float64)]
    out += [torch.diag(torch.tensor(d, dtype=torch.float64)) for d in ((1, -1, -1), (-1, 1, -1), (-1, -1, 1))]
    n = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64) / 3
    out.append(2 * torch.outer(n, n) - torch.eye(3, dtype=torch.float64))  # half turn about n
    K = torch.tensor([[0, -n[2], n[1]], [n[2], 0, -n[0]], [-n[1], n[0], 0]], dtype=torch.float64)
    out += [torch.linalg.matrix_exp(t * K) for t in (1e-9, 0.3, math.pi - 1e-7)]
    return out


def test_wigner_d_l1_is_the_rotation_in_yzx_order():
    for R in rotations(5, seed=3) + special_rotations():
        assert torch.allclose(so3.wigner_d(1, R), P_YZX @ R @ P_YZX.T, atol=TOL)
    assert torch.equal(so3.wigner_d(0, rotations(1)[0]), torch.ones(1, 1, dtype=torch.float64))


def test_spherical_harmonics_rotate_with_wigner_d():
    x = unit_vectors(20, seed=4)
    for R in rotations(3, seed=5) + special_rotations():
        for l in range(7):
            D = so3.wigner_d(l, R)
            assert (so3.spherical_harmonics(l, x @ R.T) - so3.spherical_harmonics(l, x) @ D.T).abs().max() < 1e-11


def test_spherical_harmonics_conventions():
    x = unit_vectors(50, seed=6)
    for l in range(7):
        Y = so3.spherical_harmonics(l, x)
        assert Y.shape == (50, 2 * l + 1) and Y.dtype == torch.float64
        assert torch.allclose(Y.pow(2).sum(-1), torch.full((50,), 2.0 * l + 1, dtype=torch.float64), atol=1e-11)
    assert torch.allclose(so3.spherical_harmonics(1, x), math.sqrt(3) * x @ P_YZX.T, atol=TOL)
    assert torch.allclose(so3.spherical_harmonics(0, x), torch.ones(50, 1, dtype=torch.float64), atol=TOL)
    assert torch.allclose(so3.spherical_harmonics(3, 2.5 * x), so3.spherical_harmonics(3, x), atol=TOL)
    # orthogonality over the sphere, exactly: Gauss-Legendre in z (10 nodes: exact to degree 19) times a uniform
    # grid of 16 in phi (exact for trigonometric degree < 16) integrates every Y_lm Y_l'm' with l, l' <= 6
    z, weights = (torch.from_numpy(a) for a in np.polynomial.legendre.leggauss(10))
    phi = torch.arange(16, dtype=torch.float64) * (2 * math.pi / 16)
    rho = torch.sqrt(1 - z * z)[:, None]
    points = torch.stack([rho * torch.cos(phi), rho * torch.sin(phi), z[:, None].expand(-1, 16)], dim=-1).reshape(-1, 3)
    quadrature = (weights[:, None] / 2 / 16).expand(-1, 16).reshape(-1)  # sums to 1: the mean over the sphere
    Y = torch.cat([so3.spherical_harmonics(l, points) for l in range(7)], dim=-1)
    assert torch.allclose(Y.T @ (quadrature[:, None] * Y), torch.eye(49, dtype=torch.float64), atol=TOL)


def test_wigner_d_is_an_orthogonal_representation():
    R1, R2 = rotations(2, seed=8)
    for l in range(7):
        D = so3.wigner_d(l, R1)
        identity = torch.eye(2 * l + 1, dtype=torch.float64)
        assert torch.allclose(D @ D.T, identity, atol=TOL)
        assert torch.linalg.det(D).item() == pytest.approx(1.0, abs=1e-11)
        assert torch.allclose(so3.wigner_d(l, R1 @ R2), D @ so3.wigner_d(l, R2), atol=TOL)
        assert torch.allclose(so3.wigner_d(l, R1.T), D.T, atol=TOL)
        assert torch.allclose(so3.wigner_d(l, torch.eye(3, dtype=torch.float64)), identity, atol=TOL)


def test_random_rotation_and_input_checks():
    generator = torch.Generator().manual_seed(9)
    Rs = torch.stack([so3.random_rotation(generator) for _ in range(500)])
    assert torch.allclose(Rs @ Rs.transpose(1, 2), torch.eye(3, dtype=torch.float64).expand(500, 3, 3), atol=TOL)
    assert torch.allclose(torch.linalg.det(Rs), torch.ones(500, dtype=torch.float64), atol=TOL)
    # Haar: E[R_ij] = 0 and E[R_ij^2] = 1/3 (bounds ~4 standard errors: sd 0.026 and 0.013 over 500 samples)
    assert Rs.mean(0).abs().max() < 0.11 and (Rs.pow(2).mean(0) - 1 / 3).abs().max() < 0.055
    with pytest.raises(ValueError):
        so3.wigner_d(1, -torch.eye(3, dtype=torch.float64))  # improper
    with pytest.raises(ValueError):
        so3.wigner_d(1, 2 * torch.eye(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        so3.clebsch_gordan(-1, 1, 1)


# ---------------------------------------------------------------------------------------------------------------------
# tensor product structure


@pytest.mark.parametrize("l_max, parity", [((2, 2, 2), False), ((3, 2, 4), False), ((3, 3, 3), True),
                                           ((6, 6, 6), False), ((0, 0, 0), False)])
def test_tensor_product_coo(l_max, parity):
    coo = so3.tensor_product_coo(*l_max, parity=parity)
    n1, n2, n3 = ((l + 1) ** 2 for l in l_max)
    assert coo["dims"] == (n1, n2, n3)
    i1, i2, i3, value = coo["i1"], coo["i2"], coo["i3"], coo["value"]
    assert all(t.dtype == torch.int64 for t in (i1, i2, i3)) and value.dtype == torch.float64
    assert 0 <= i1.min() and i1.max() < n1 and 0 <= i2.min() and i2.max() < n2 and 0 <= i3.min() and i3.max() < n3
    key = (i3 * n1 + i1) * n2 + i2
    assert bool((key[1:] > key[:-1]).all())  # sorted by (i3, i1, i2), no duplicates
    assert bool((value.abs() > 1e-12).all())

    paths = coo["paths"]
    assert paths == sorted(set(paths))
    assert paths == [p for p in triangles(max(l_max)) if all(l <= m for l, m in zip(p, l_max))
                     and not (parity and sum(p) % 2)]
    assert len(value) == sum(so3.num_nonzero(*p) for p in paths)

    dense = torch.zeros(n1, n2, n3, dtype=torch.float64)
    dense[i1, i2, i3] = value
    expected = torch.zeros(n1, n2, n3, dtype=torch.float64)
    for l1, l2, l3 in paths:
        expected[l1 * l1:(l1 + 1) ** 2, l2 * l2:(l2 + 1) ** 2, l3 * l3:(l3 + 1) ** 2] = so3.clebsch_gordan(l1, l2, l3)
    assert torch.equal(dense, expected)


def test_tensor_product_coo_is_equivariant_and_csr_ready():
    """The COO product of features of irreps 0..2 commutes with the block-diagonal D, and its i3 segments
    (torch.searchsorted) give the CSR row pointers."""
    coo = so3.tensor_product_coo(2, 2, 2)
    n = 9
    R = rotations(1, seed=10)[0]
    D = torch.block_diag(*[so3.wigner_d(l, R) for l in range(3)])
    x, y = torch.randn(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(11))

    def product(a, b):
        return torch.zeros(n, dtype=torch.float64).index_add_(0, coo["i3"], coo["value"] * a[coo["i1"]] * b[coo["i2"]])

    assert torch.allclose(product(D @ x, D @ y), D @ product(x, y), atol=TOL)
    row_pointers = torch.searchsorted(coo["i3"], torch.arange(n + 1))
    assert row_pointers[0] == 0 and row_pointers[-1] == len(coo["value"])
    assert bool((torch.diff(row_pointers) > 0).all())


# ---------------------------------------------------------------------------------------------------------------------
# e3nn (skipped where it is not installed; the GPU machine has it). The comparison is convention-free, and is itself
# tested here on a synthetic "other library" whose basis is a random orthogonal change of ours.


def intertwiner(ours, theirs):
    """The orthogonal Q with theirs(R) = Q ours(R) Q^T for every R, as the null space of
    Q ours(R) - theirs(R) Q for two rotations (row-major vec: vec(Q A) = (I x A^T) vec Q, vec(B Q) = (B x I) vec Q).
    It exists, and is unique up to sign (Schur), exactly when both are the same irrep in two bases."""
    n = ours[0].shape[0]
    identity = torch.eye(n, dtype=torch.float64)
    # contiguous: torch.kron rejects some transposed views
    stacked = torch.cat([torch.kron(identity, A.T.contiguous()) - torch.kron(B.contiguous(), identity)
                         for A, B in zip(ours, theirs)])
    _, singular_values, Vh = torch.linalg.svd(stacked, full_matrices=False)
    assert singular_values[-1] < 1e-9 and (n == 1 or singular_values[-2] > 1e-4), singular_values[-2:]
    return Vh[-1].reshape(n, n) * math.sqrt(n)


def assert_same_up_to_basis(their_d, their_sh, their_3j, l_max, atol=1e-9):
    """their_d(l, R), their_sh(l, x) (component normalization) and their_3j(l1, l2, l3) from another library
    equal ours up to one orthogonal change of basis Q_l per l (found from D alone), one sign per l for the
    harmonics and one sign and scale per path for the 3j. Returns the Q_l."""
    R1, R2, R3 = rotations(3, seed=12)
    Q = []
    for l in range(l_max + 1):
        Q.append(intertwiner([so3.wigner_d(l, R) for R in (R1, R2)], [their_d(l, R) for R in (R1, R2)]))
        assert torch.allclose(Q[l] @ Q[l].T, torch.eye(2 * l + 1, dtype=torch.float64), atol=atol)
        assert torch.allclose(their_d(l, R3), Q[l] @ so3.wigner_d(l, R3) @ Q[l].T, atol=atol), l

    x = unit_vectors(30, seed=13)
    for l in range(l_max + 1):
        theirs, ours_mapped = their_sh(l, x), so3.spherical_harmonics(l, x) @ Q[l].T
        sign = torch.sign((theirs * ours_mapped).sum())
        assert torch.allclose(theirs, sign * ours_mapped, atol=atol), l

    for l1, l2, l3 in triangles(l_max):
        theirs = their_3j(l1, l2, l3)
        ours_mapped = torch.einsum("ai,bj,ck,ijk->abc", Q[l1], Q[l2], Q[l3], so3.clebsch_gordan(l1, l2, l3))
        norms = torch.linalg.vector_norm(theirs) * torch.linalg.vector_norm(ours_mapped)
        cosine = (theirs * ours_mapped).sum() / norms
        assert abs(cosine.item()) == pytest.approx(1.0, abs=atol), (l1, l2, l3)
    return Q


def test_basis_comparison_on_a_synthetic_convention():
    generator = torch.Generator().manual_seed(14)
    change = [torch.linalg.qr(torch.randn(2 * l + 1, 2 * l + 1, dtype=torch.float64, generator=generator))[0]
              for l in range(4)]
    signs = [(-1) ** (l1 * l2 + l3) * (1 + l1) for l1, l2, l3 in triangles(3)]  # arbitrary sign and scale per path
    scale = dict(zip(triangles(3), signs))
    Q = assert_same_up_to_basis(
        lambda l, R: change[l] @ so3.wigner_d(l, R) @ change[l].T,
        lambda l, x: (-1) ** l * so3.spherical_harmonics(l, x) @ change[l].T,
        lambda l1, l2, l3: scale[l1, l2, l3] * torch.einsum("ai,bj,ck,ijk->abc", change[l1], change[l2], change[l3],
                                                            so3.clebsch_gordan(l1, l2, l3)),
        l_max=3)
    for l in range(4):  # the change of basis is recovered up to its sign
        assert torch.allclose(Q[l].abs(), change[l].abs(), atol=1e-9) and abs((Q[l] * change[l]).sum()) > 2 * l


def test_against_e3nn():
    """e3nn orders and signs its real basis its own way (for l = 1 a signed permutation of our (y, z, x)), so
    compare through the per-l change of basis Q_l that maps our D_l onto e3nn's Irrep(l, 1).D_from_matrix: then
    e3nn's spherical harmonics and wigner_3j must equal ours mapped by Q (up to a sign per l and per path)."""
    pytest.importorskip("e3nn")
    from e3nn import o3

    Q = assert_same_up_to_basis(
        lambda l, R: o3.Irrep(l, 1).D_from_matrix(R).to(torch.float64),
        lambda l, x: o3.spherical_harmonics(l, x, normalize=True, normalization="component").to(torch.float64),
        lambda l1, l2, l3: o3.wigner_3j(l1, l2, l3, dtype=torch.float64),
        l_max=4, atol=1e-8)
    assert torch.allclose(Q[1].abs(), Q[1].abs().round(), atol=1e-8)  # l = 1: a signed permutation
