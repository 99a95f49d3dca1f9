"""SO(3) irreps in the real spherical-harmonic basis: Clebsch-Gordan coefficients, Wigner D matrices,
spherical harmonics and the sparse (COO) structure of a tensor product of irreps 0..L.

Conventions (all float64, all computed here from first principles, no tables):
  basis     irrep l has components m = -l..l in that order; the flat index of (l, m) within irreps 0..L
            is l*l + (m + l), so a feature of irreps 0..L has (L+1)^2 components.
  real SH   Y_{l,m} = sqrt(2) N_{l|m|} P~_l^{|m|}(z) * cos(m phi)  for m > 0, sin(|m| phi) for m < 0,
            N_{l0} P_l(z) for m = 0, with N_{lm} = sqrt((2l+1) (l-m)! / (l+m)!) and P~ the associated
            Legendre function WITHOUT the Condon-Shortley phase. In terms of the complex Y_l^m (with that
            phase): Y_{l,m>0} = sqrt2 (-1)^m Re Y_l^m, Y_{l,m<0} = sqrt2 (-1)^m Im Y_l^{|m|}, i.e. Y_real = U Y_complex
            with U unitary. For l = 1, m = -1, 0, 1 are sqrt(3) * (y, z, x). Normalization "component":
            sum_m Y_{l,m}(x)^2 = 2l+1 on the unit sphere (sqrt(4 pi) times the orthonormal harmonics).
  Wigner D  D_l(R) is real orthogonal and Y_l(R x) = D_l(R) Y_l(x); D_1(R) = P R P^T with P the
            permutation (x, y, z) -> (y, z, x).
  CG        C = clebsch_gordan(l1, l2, l3) [2l1+1, 2l2+1, 2l3+1] is the equivariant coupling
            sum_{ab} C[a,b,c] D_l1[a,i] D_l2[b,j] = sum_k D_l3[c,k] C[i,j,k], with Frobenius norm 1:
            C = (-i)^(l1+l2+l3) (conj U1 x conj U2 x U3) C_cs / sqrt(2 l3 + 1), where C_cs[m1,m2,m3] is the
            Condon-Shortley CG <l1 m1 l2 m2|l3 m3> (Racah's formula; its Frobenius norm is sqrt(2 l3 + 1)),
            U_l the complex-to-real change of basis above, and the global phase (-i)^(l1+l2+l3) the one
            that makes the result real (odd l1+l2+l3 comes out imaginary without it). Hence, for fixed
            (l1, l2), the matrix [(m1, m2), (l3, m3)] = sqrt(2 l3 + 1) C(l1, l2, l3)[m1, m2, m3] over all
            allowed l3 is orthogonal. Zero unless |l1-l2| <= l3 <= l1+l2 (zeros are returned there).
Tested for l <= 6 (tests/test_sparse_so3.py); the construction is exact-integer based and holds beyond.
"""
import functools
import math
from fractions import Fraction

import numpy as np
import torch

NONZERO_TOL = 1e-12


def _check_l(*ls):
    for l in ls:
        if not (isinstance(l, int) and l >= 0):
            raise ValueError(f"irrep degree must be a non-negative int, got {l!r}")


def _triangle(l1, l2, l3):
    return abs(l1 - l2) <= l3 <= l1 + l2


# ---------------------------------------------------------------------------------------------------------------------
# complex -> real change of basis and angular-momentum generators

@functools.lru_cache(maxsize=None)
def _complex_to_real(l):
    """U [2l+1, 2l+1] complex128, unitary: Y_real = U Y_complex (functions stacked as a column, m = -l..l)."""
    n = 2 * l + 1
    U = torch.zeros(n, n, dtype=torch.complex128)
    s = 1 / math.sqrt(2)
    U[l, l] = 1
    for m in range(1, l + 1):
        # m > 0: sqrt2 (-1)^m Re Y^m = (Y^{-m} + (-1)^m Y^m) / sqrt2   (using Y^{-m} = (-1)^m conj Y^m)
        U[l + m, l - m] = s
        U[l + m, l + m] = (-1) ** m * s
        # m < 0: sqrt2 (-1)^m Im Y^{|m|} = i (Y^{-|m|} - (-1)^m Y^{|m|}) / sqrt2
        U[l - m, l - m] = 1j * s
        U[l - m, l + m] = -1j * (-1) ** m * s
    return U


@functools.lru_cache(maxsize=None)
def _complex_generators(l):
    """J_x, J_y, J_z in the complex |l m> basis (m = -l..l), hbar = 1, standard ladder phases."""
    n = 2 * l + 1
    J_plus = torch.zeros(n, n, dtype=torch.complex128)
    for m in range(-l, l):
        J_plus[m + 1 + l, m + l] = math.sqrt((l - m) * (l + m + 1))
    J_minus = J_plus.T.clone()
    J_x = (J_plus + J_minus) / 2
    J_y = (J_plus - J_minus) / 2j
    J_z = torch.diag(torch.arange(-l, l + 1, dtype=torch.float64)).to(torch.complex128)
    return J_x, J_y, J_z


def real_generators(l):
    """A [3, 2l+1, 2l+1] float64, real antisymmetric: D_l(rotation by angle t about unit axis n) = expm(t n.A).
    A fresh copy each call: the cached one stays the caller's to change."""
    return _real_generators_cached(l).clone()


@functools.lru_cache(maxsize=None)
def _real_generators_cached(l):
    """real_generators, computed once per l.

    Y(R x) = U Y_c(R x) = U conj(D_c(R)) Y_c(x), with D_c(R) = exp(-i t n.J) the standard Wigner matrix
    (Y_l^m(R^-1 x) = sum_m' Y_l^m'(x) D_c[m', m]); so the real generator is A_k = i U conj(J_k) U^H.
    """
    U = _complex_to_real(l)
    A = torch.stack([1j * U @ J.conj() @ U.conj().T for J in _complex_generators(l)])
    if A.imag.abs().max() > 1e-12:
        raise RuntimeError(f"real-basis generators for l={l} are not real: phase convention broken")
    return A.real.contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# Clebsch-Gordan coefficients

def _complex_cg(j1, m1, j2, m2, J, M):
    """<j1 m1 j2 m2 | J M> (Condon-Shortley) by Racah's formula: exact rationals, one float sqrt at the end."""
    if M != m1 + m2 or not _triangle(j1, j2, J) or abs(m1) > j1 or abs(m2) > j2 or abs(M) > J:
        return 0.0
    f = math.factorial
    prefactor_sq = Fraction((2 * J + 1) * f(J + j1 - j2) * f(J - j1 + j2) * f(j1 + j2 - J), f(j1 + j2 + J + 1))
    prefactor_sq *= f(J + M) * f(J - M) * f(j1 - m1) * f(j1 + m1) * f(j2 - m2) * f(j2 + m2)
    total = Fraction(0)
    for k in range(0, j1 + j2 - J + 1):  # every factorial argument below must be >= 0
        args = (k, j1 + j2 - J - k, j1 - m1 - k, j2 + m2 - k, J - j2 + m1 + k, J - j1 - m2 + k)
        if min(args) < 0:
            continue
        denominator = 1
        for a in args:
            denominator *= f(a)
        total += Fraction((-1) ** k, denominator)
    # value = total * sqrt(prefactor_sq); square exactly so the only rounding is in the sqrt
    value_sq = total * total * prefactor_sq
    return math.copysign(math.sqrt(value_sq), total)


@functools.lru_cache(maxsize=None)
def _clebsch_gordan_cached(l1, l2, l3):
    n1, n2, n3 = 2 * l1 + 1, 2 * l2 + 1, 2 * l3 + 1
    if not _triangle(l1, l2, l3):
        return torch.zeros(n1, n2, n3, dtype=torch.float64)
    C = np.zeros((n1, n2, n3))
    for m1 in range(-l1, l1 + 1):
        for m2 in range(-l2, l2 + 1):
            if abs(m1 + m2) <= l3:
                C[m1 + l1, m2 + l2, m1 + m2 + l3] = _complex_cg(l1, m1, l2, m2, l3, m1 + m2)
    # F_c = sum C[m1,m2,c] Y1^m1 Y2^m2 transforms like Y3^c, and Y_c = U^H Y_real, so in the real basis
    # C_real[a,b,c] = sum conj(U1[a,m1]) conj(U2[b,m2]) U3[c,m3] C[m1,m2,m3]
    # (numpy: torch's multithreaded complex matmul on tiny tensors is far slower on a busy CPU:
    # docs/measurements/sparse.md)
    U1, U2, U3 = (_complex_to_real(l).numpy() for l in (l1, l2, l3))
    C = np.einsum("am,bn,cp,mnp->abc", U1.conj(), U2.conj(), U3, C, optimize=True)
    C = C * (-1j) ** (l1 + l2 + l3)  # the global phase (unique up to sign) that leaves it real
    if np.abs(C.imag).max() > 1e-12:
        raise RuntimeError(f"real-basis CG for ({l1},{l2},{l3}) has an imaginary part: phase convention broken")
    C = torch.from_numpy(np.ascontiguousarray(C.real))
    return (C / torch.linalg.vector_norm(C)).contiguous()


def clebsch_gordan(l1, l2, l3):
    """Real-basis CG tensor [2l1+1, 2l2+1, 2l3+1] float64, Frobenius norm 1 (zeros outside the triangle).

    Equivariance: einsum("abc,ai,bj->ijc", C, D_l1, D_l2) == einsum("ijk,ck->ijc", C, D_l3).
    Equals the Condon-Shortley CG <l1 m1 l2 m2|l3 m3> in the real basis times (-i)^(l1+l2+l3), divided by
    sqrt(2 l3 + 1). Returns a fresh copy of a cached tensor (callers may modify it).
    """
    _check_l(l1, l2, l3)
    return _clebsch_gordan_cached(l1, l2, l3).clone()


def num_nonzero(l1, l2, l3):
    """Entries of clebsch_gordan(l1, l2, l3) with |value| > 1e-12 (0 outside the triangle)."""
    _check_l(l1, l2, l3)
    return int((_clebsch_gordan_cached(l1, l2, l3).abs() > NONZERO_TOL).sum())


# ---------------------------------------------------------------------------------------------------------------------
# rotations and Wigner D

def random_rotation(generator=None):
    """A Haar-uniform rotation [3, 3] float64: QR of a Gaussian with the signs of R's diagonal moved into Q
    (uniform on O(3)), then one column negated when det = -1 (a measure-preserving map onto SO(3))."""
    Q, Rq = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=generator))
    Q = Q * torch.sign(torch.diagonal(Rq)).unsqueeze(0)
    if torch.linalg.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return Q


def _axis_angle(R):
    """(unit axis [3], angle) of a rotation matrix, via the unit quaternion (Shepperd's choice of the largest
    of w, x, y, z as pivot keeps it accurate at every angle, including pi where R - R^T vanishes)."""
    t = torch.trace(R)
    d = torch.diagonal(R)
    pivot = int(torch.argmax(torch.stack([t, d[0], d[1], d[2]])))
    if pivot == 0:
        w = torch.sqrt(1 + t) / 2
        v = torch.stack([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]]) / (4 * w)
        q = torch.cat([w[None], v])
    else:
        i = pivot - 1
        j, k = (i + 1) % 3, (i + 2) % 3
        v_i = torch.sqrt(1 + 2 * d[i] - t) / 2
        v = [None] * 3
        v[i] = v_i
        v[j] = (R[j, i] + R[i, j]) / (4 * v_i)
        v[k] = (R[k, i] + R[i, k]) / (4 * v_i)
        w = (R[k, j] - R[j, k]) / (4 * v_i)
        q = torch.stack([w, *v])
    vector_norm = torch.linalg.vector_norm(q[1:])
    angle = 2 * torch.atan2(vector_norm, q[0])
    if vector_norm == 0:
        return torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), angle * 0
    return q[1:] / vector_norm, angle


def wigner_d(l, rotation):
    """Real Wigner D matrix [2l+1, 2l+1] float64 of a rotation matrix [3, 3]: Y_l(R x) = D_l(R) Y_l(x).

    Built as expm(angle * axis . A) from the real-basis generators (real_generators). Orthogonal, det 1,
    a homomorphism D(R1 R2) = D(R1) D(R2), and D_1(R) = P R P^T with P: (x, y, z) -> (y, z, x).
    Raises ValueError when `rotation` is not a proper rotation (to 1e-6).
    """
    _check_l(l)
    R = torch.as_tensor(rotation, dtype=torch.float64)
    if R.shape != (3, 3):
        raise ValueError(f"rotation must be [3, 3], got {tuple(R.shape)}")
    identity = torch.eye(3, dtype=torch.float64)
    if (R @ R.T - identity).abs().max() > 1e-6 or torch.linalg.det(R) < 0:
        raise ValueError("rotation must be orthogonal with det +1")
    axis, angle = _axis_angle(R)
    A = _real_generators_cached(l)
    return torch.linalg.matrix_exp(angle * torch.einsum("k,kab->ab", axis, A))


# ---------------------------------------------------------------------------------------------------------------------
# real spherical harmonics

@functools.lru_cache(maxsize=None)
def _legendre_derivative_coefficients(l, m):
    """Coefficients (low to high power of z) of d^m/dz^m P_l(z), exact then float.
    P_l(z) = 2^-l sum_k (-1)^k binom(l, k) binom(2l-2k, l) z^(l-2k)."""
    coefficients = [Fraction(0)] * (l + 1)
    for k in range(l // 2 + 1):
        coefficients[l - 2 * k] = Fraction((-1) ** k * math.comb(l, k) * math.comb(2 * l - 2 * k, l), 2 ** l)
    for _ in range(m):
        coefficients = [p * c for p, c in enumerate(coefficients)][1:] or [Fraction(0)]
    return tuple(float(c) for c in coefficients)


def _polynomial(coefficients, z):
    out = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = out * z + c
    return out


def spherical_harmonics(l, xyz):
    """Real spherical harmonics Y_l [..., 2l+1] float64 of directions xyz [..., 3] (normalized here, so any
    non-zero vector works). Component normalization: sum_m Y_{l,m}(x)^2 = 2l+1. Order m = -l..l; l = 1 gives
    sqrt(3) * (y, z, x). Uses sin^m(theta) e^{i m phi} = (x + i y)^m, so no angles (and no pole singularity)."""
    _check_l(l)
    xyz = torch.as_tensor(xyz, dtype=torch.float64)
    xyz = xyz / torch.linalg.vector_norm(xyz, dim=-1, keepdim=True)
    x, y, z = xyz.unbind(-1)
    out = [None] * (2 * l + 1)
    cos_part, sin_part = torch.ones_like(x), torch.zeros_like(x)  # Re, Im of (x + iy)^m
    for m in range(l + 1):
        norm = math.sqrt((2 * l + 1) * math.factorial(l - m) / math.factorial(l + m))
        radial = norm * _polynomial(_legendre_derivative_coefficients(l, m), z)
        if m == 0:
            out[l] = radial
        else:
            cos_part, sin_part = cos_part * x - sin_part * y, cos_part * y + sin_part * x
            out[l + m] = math.sqrt(2) * radial * cos_part
            out[l - m] = math.sqrt(2) * radial * sin_part
    return torch.stack(out, dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# sparse structure of a tensor product

def flat_index(l, m):
    """Position of component (l, m) in a feature of irreps 0..L: l*l + (m + l)."""
    return l * l + m + l


def tensor_product_paths(l1_max, l2_max, l3_max, *, parity=False):
    """All (l1, l2, l3) with l_i <= l_i_max and |l1-l2| <= l3 <= l1+l2 (and l1+l2+l3 even when parity),
    in lexicographic order."""
    _check_l(l1_max, l2_max, l3_max)
    return [(l1, l2, l3) for l1 in range(l1_max + 1) for l2 in range(l2_max + 1) for l3 in range(l3_max + 1)
            if _triangle(l1, l2, l3) and not (parity and (l1 + l2 + l3) % 2)]


def tensor_product_coo(l1_max, l2_max, l3_max, *, parity=False):
    """The nonzero CG entries (|value| > 1e-12) of the tensor product of irreps 0..l1_max and 0..l2_max into
    irreps 0..l3_max, as flat COO over the features' flat indices (flat_index):
        out[i3] += value * in1[i1] * in2[i2]
    Returns {"i1", "i2", "i3": int64 [nnz], "value": float64 [nnz], "paths": list of (l1, l2, l3),
    "dims": ((l1_max+1)^2, (l2_max+1)^2, (l3_max+1)^2)}, sorted by i3, then i1, then i2 (CSR-ready over i3).
    Each path contributes its own clebsch_gordan block (Frobenius norm 1); with parity=True only paths with
    l1+l2+l3 even are kept (those allowed between irreps of parity (-1)^l, the spherical harmonics' parity).
    """
    paths = tensor_product_paths(l1_max, l2_max, l3_max, parity=parity)
    indices, values = [torch.zeros(3, 0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.float64)]
    for l1, l2, l3 in paths:
        C = _clebsch_gordan_cached(l1, l2, l3)
        a, b, c = torch.nonzero(C.abs() > NONZERO_TOL, as_tuple=True)
        indices.append(torch.stack([c + l3 * l3, a + l1 * l1, b + l2 * l2]))  # rows: i3, i1, i2
        values.append(C[a, b, c])
    index, value = torch.cat(indices, dim=1), torch.cat(values)
    # different paths never share an (i1, i2, i3) triple (each flat index names one l), so the order is total
    n1, n2 = (l1_max + 1) ** 2, (l2_max + 1) ** 2
    key = (index[0] * n1 + index[1]) * n2 + index[2]
    order = torch.argsort(key)
    i3, i1, i2 = index[:, order]
    return {"i1": i1.contiguous(), "i2": i2.contiguous(), "i3": i3.contiguous(), "value": value[order],
            "paths": paths, "dims": (n1, n2, (l3_max + 1) ** 2)}
