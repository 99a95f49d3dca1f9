"""Equivariant layers built only from the sparse ops: the Clebsch-Gordan tensor product of irreps 0..L, a fully
connected tensor-product layer with per-path channel mixing, and a toy interatomic potential whose forces and
force loss exercise the ops' first and second derivatives.

Features of irreps 0..L are [N, (L+1)^2, C]: flat index l*l + m + l (so3.flat_index), C channels per irrep.
"""
import functools
import math

import torch
from torch import nn

from ..checks import require_tensor
from . import so3
from .functional import sparse_scale, sparse_vecmat, sparse_vecsca
from .info import product_infos, scale_infos

__all__ = ["cg_product_infos", "FullyConnectedTensorProduct", "ToyPotential", "edge_infos", "all_pairs",
           "irreps_spherical_harmonics"]


def cg_product_infos(l1_max, l2_max, l3_max, *, parity=False, dtype=torch.float64, device="cpu"):
    """(info_fwd, info_bwd1, info_bwd2) of the CG tensor product of irreps 0..l1_max and 0..l2_max into 0..l3_max:

        z[n, (l3 m3)] += C_{l1 l2 l3}[m1, m2, m3] * x[n, (l1 m1)] ∘ y[n, (l2 m2)]

    summed over every allowed path (so3.tensor_product_coo; only l1+l2+l3 even with ``parity``). C has Frobenius
    norm 1 per path. ``dtype`` is the dtype of the stored scales (the ops cast them to the operands' dtype).
    """
    coo = so3.tensor_product_coo(l1_max, l2_max, l3_max, parity=parity)
    size1, size2, size3 = coo["dims"]
    to = dict(device=device)
    return product_infos(coo["i1"].to(**to), coo["i2"].to(**to), coo["i3"].to(**to),
                         coo["value"].to(dtype=dtype, **to), size1, size2, size3)


@functools.lru_cache(maxsize=None)
def layer_structure(l1_max, l2_max, l3_max, parity, channels_in):
    """Terms (CPU, float64) of the layer's two sparse products; see FullyConnectedTensorProduct."""
    paths = so3.tensor_product_paths(l1_max, l2_max, l3_max, parity=parity)
    if not paths:
        raise ValueError(f"no tensor-product path from irreps 0..{l1_max} x 0..{l2_max} into 0..{l3_max}")
    paths_into = [sum(1 for p in paths if p[2] == l3) for l3 in range(l3_max + 1)]
    coupling = {"i1": [], "i2": [], "i3": [], "value": []}
    mixing = {"i1": [], "i2": [], "i3": [], "value": []}
    offset = 0  # start of path p's block of 2 l3 + 1 rows in the path-expanded (coupled) features u
    for p, (l1, l2, l3) in enumerate(paths):
        C = so3.clebsch_gordan(l1, l2, l3)
        a, b, c = torch.nonzero(C.abs() > so3.NONZERO_TOL, as_tuple=True)
        coupling["i1"].append(a + l1 * l1)
        coupling["i2"].append(b + l2 * l2)
        coupling["i3"].append(c + offset)
        coupling["value"].append(C[a, b, c])
        # sqrt(2 l3 + 1) C maps unit-variance components to unit-variance ones (its columns are orthonormal);
        # the sum over C_in channels and the paths into l3 then has variance C_in * paths_into[l3] with N(0, 1) weights
        path_scale = math.sqrt((2 * l3 + 1) / (channels_in * paths_into[l3]))
        rows = torch.arange(2 * l3 + 1)
        mixing["i1"].append(rows + offset)
        mixing["i2"].append(torch.full_like(rows, p))
        mixing["i3"].append(rows + l3 * l3)
        mixing["value"].append(torch.full((2 * l3 + 1,), path_scale, dtype=torch.float64))
        offset += 2 * l3 + 1
    coupling = {k: torch.cat(v) for k, v in coupling.items()}
    mixing = {k: torch.cat(v) for k, v in mixing.items()}
    return paths, offset, coupling, mixing


class FullyConnectedTensorProduct(nn.Module):
    """Fully connected CG tensor product with learnable channel mixing per path p = (l1, l2, l3):

        z[n, (l3 m3), o] = sum_{p -> l3} a_p sum_{m1 m2 i} C_p[m1, m2, m3] x[n, (l1 m1), i] y[n, (l2 m2)] W[p, i, o]
        a_p = sqrt((2 l3 + 1) / (C_in * #paths into l3))   (unit-variance outputs for unit-variance inputs/weights)

    x [N, (L1+1)^2, C_in] (or shared [(L1+1)^2, C_in]), y [N, (L2+1)^2] (one channel, e.g. spherical harmonics),
    z [N, (L3+1)^2, C_out]; W [P, C_in, C_out] is ``weight``. Two sparse products, no dense CG tensor:

        u = SparseVecSca(x, y):  u[n, (p m3), i] += C_p[m1, m2, m3] x[n, (l1 m1), i] y[n, (l2 m2)]
        z = SparseVecMat(u, W):  z[n, (l3 m3), :] += a_p u[n, (p m3), :] @ W[p]       (W shared by the batch)

    u holds the CG-coupled features of every path (sum_p (2 l3 + 1) rows); the second product's "sparse" dims are
    the path-expanded rows, the path index of W and the output irreps. Both are autograd Functions to any order.
    """

    def __init__(self, l1_max, l2_max, l3_max, channels_in, channels_out, *, parity=False, seed=0,
                 dtype=torch.float64, device="cpu"):
        super().__init__()
        for name, value, low in (("l1_max", l1_max, 0), ("l2_max", l2_max, 0), ("l3_max", l3_max, 0),
                                 ("channels_in", channels_in, 1), ("channels_out", channels_out, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"FullyConnectedTensorProduct: {name} must be an int >= {low}, got {value!r}")
        self.l1_max, self.l2_max, self.l3_max = l1_max, l2_max, l3_max
        self.channels_in, self.channels_out, self.parity, self.seed = channels_in, channels_out, parity, seed
        self.paths, self.coupled_size, self._coupling_terms, self._mixing_terms = layer_structure(
            l1_max, l2_max, l3_max, parity, channels_in)
        self.weight = nn.Parameter(torch.empty(len(self.paths), channels_in, channels_out, dtype=dtype,
                                               device=device))
        self._infos_by_device = {}  # the infos are not buffers (frozen dataclasses), so built per device on use
        self.reset_parameters()

    @property
    def sizes(self):
        """Sparse sizes ((L1+1)^2, (L2+1)^2, (L3+1)^2)."""
        return (self.l1_max + 1) ** 2, (self.l2_max + 1) ** 2, (self.l3_max + 1) ** 2

    def reset_parameters(self, generator=None):
        """W ~ N(0, 1) from ``generator`` (default: a fresh one seeded with ``self.seed``, so reproducible)."""
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            values = torch.randn(self.weight.shape, generator=generator, dtype=torch.float64)
            self.weight.copy_(values.to(self.weight.dtype))

    def infos(self, device):
        """(coupling infos, mixing infos) on ``device``, each the (fwd, bwd1, bwd2) triple of product_infos."""
        device = torch.device(device)
        if device not in self._infos_by_device:
            size1, size2, size3 = self.sizes
            c, m = self._coupling_terms, self._mixing_terms
            coupling = product_infos(*(c[k].to(device) for k in ("i1", "i2", "i3", "value")), size1, size2,
                                     self.coupled_size)
            mixing = product_infos(*(m[k].to(device) for k in ("i1", "i2", "i3", "value")), self.coupled_size,
                                   len(self.paths), size3)
            self._infos_by_device[device] = (coupling, mixing)
        return self._infos_by_device[device]

    def forward(self, x, y):
        require_tensor("x", x)
        require_tensor("y", y)
        size1, size2, _ = self.sizes
        if x.shape[-2:] != (size1, self.channels_in):
            raise ValueError(f"x must be [N, {size1}, {self.channels_in}], got {tuple(x.shape)}")
        if y.shape[-1] != size2 or y.dim() not in (1, 2):
            raise ValueError(f"y must be [N, {size2}] or shared [{size2}], got {tuple(y.shape)}")
        if not (x.dtype == y.dtype == self.weight.dtype):
            raise TypeError(f"x ({x.dtype}), y ({y.dtype}) and the layer's weight ({self.weight.dtype}) must have one "
                            "dtype (layer.to(dtype) converts the weight)")
        coupling, mixing = self.infos(x.device)
        coupled = sparse_vecsca(x, y, coupling)  # the checked wrappers of SparseVecSca / SparseVecMat
        return sparse_vecmat(coupled, self.weight, mixing)

    def extra_repr(self):
        return (f"l_max=({self.l1_max}, {self.l2_max}, {self.l3_max}), channels={self.channels_in}->"
                f"{self.channels_out}, paths={len(self.paths)}, parity={self.parity}")


# ---------------------------------------------------------------------------------------------------------------------
# a toy potential: energy -> forces -> force loss


def all_pairs(num_atoms, device="cpu"):
    """(src, dst) int64 of every ordered pair src != dst: the neighbor list of a tiny system."""
    src, dst = torch.meshgrid(torch.arange(num_atoms, device=device), torch.arange(num_atoms, device=device),
                              indexing="ij")
    keep = src != dst
    return src[keep], dst[keep]


def edge_infos(src, dst, num_atoms, *, aggregate_scale=1.0):
    """(gather, scatter) SparseScale info pairs of a neighbor list with E edges:
    gather  h_edge[e] = h[src[e]]                 (atoms -> edges)
    scatter h[a] = aggregate_scale * sum_{dst[e] = a} m[e]   (edges -> atoms, the segment sum)."""
    edges = torch.arange(src.numel(), device=src.device)
    gather = scale_infos(src, edges, None, num_atoms, src.numel())
    scale = torch.full((src.numel(),), float(aggregate_scale), dtype=torch.float64, device=src.device)
    scatter = scale_infos(edges, dst, scale, src.numel(), num_atoms)
    return gather, scatter


def irreps_spherical_harmonics(l_max, vectors):
    """[..., (l_max+1)^2] the real spherical harmonics of irreps 0..l_max of ``vectors`` [..., 3], in their dtype."""
    return torch.cat([so3.spherical_harmonics(l, vectors) for l in range(l_max + 1)], dim=-1).to(vectors.dtype)


def _sparse_scale_rows(h, infos):
    """SparseScale over the first dim of h [M, ...]: reshaped to [M, prod(...)] so the sparse dim is dim -2."""
    flat = sparse_scale(h.reshape(h.shape[0], math.prod(h.shape[1:])), *infos)  # not -1: M may be 0 (no edge)
    return flat.reshape(flat.shape[0], *h.shape[1:])


def _check_atoms(positions, species, src, dst):
    """positions [A, 3] floating, species [A] and the edge lists src, dst [E] int64, before anything reads them."""
    for name, t in (("positions", positions), ("species", species), ("src", src), ("dst", dst)):
        require_tensor(name, t)
    if positions.dim() != 2 or positions.shape[1] != 3 or not positions.is_floating_point():
        raise ValueError(f"positions must be a floating [A, 3] tensor, got {positions.dtype} {tuple(positions.shape)}")
    if species.shape != positions.shape[:1] or species.dtype != torch.int64:
        raise ValueError(f"species must be int64 [A = {positions.shape[0]}], got {species.dtype} {tuple(species.shape)}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be a 1-D int64 edge list, got {t.dtype} {tuple(t.shape)}")
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must have one length, got {src.numel()} and {dst.numel()}")


class ToyPotential(nn.Module):
    """A two-layer equivariant message-passing energy built from the sparse ops:

        y_e  = R_k(|r_e|) Y(r_e),  r_e = pos[src_e] - pos[dst_e],  R_k(r) = sum_j c[k, j] exp(-((r - mu_j)/w)^2) f(r)
        h0   = embedding[species]                                 (irreps 0 only, [A, 1, C])
        h1   = gate(scatter(TP1(gather(h0), y_e)))                (irreps 0..l_hidden, [A, (l_hidden+1)^2, C])
        E    = sum_a scatter(TP2(gather(h1), y_e))[a, 0, 0]        (irreps 0, one channel)

    with f(r) = max(1 - (r/cutoff)^2, 0)^3 a C^2 cutoff envelope, gather/scatter SparseScale (edge_infos, the
    scatter scaled by 1/sqrt(mean neighbors)), TP FullyConnectedTensorProduct and gate the equivariant
    nonlinearity (scalars s -> silu(s), irreps l > 0 v -> v * sigmoid(s)). forces = -dE/dpos by autograd with
    create_graph, so a loss on the forces differentiates through the ops' double backward.
    """

    def __init__(self, *, num_species=2, channels=4, l_hidden=2, l_sh=2, num_radial=4, cutoff=4.0, seed=0,
                 dtype=torch.float64):
        super().__init__()
        self.l_sh, self.cutoff, self.seed = l_sh, cutoff, seed
        self.layer1 = FullyConnectedTensorProduct(0, l_sh, l_hidden, channels, channels, parity=True, seed=seed + 1,
                                                  dtype=dtype)
        self.layer2 = FullyConnectedTensorProduct(l_hidden, l_sh, 0, channels, 1, parity=True, seed=seed + 2,
                                                  dtype=dtype)
        self.embedding = nn.Parameter(torch.empty(num_species, channels, dtype=dtype))
        self.radial_weight = nn.Parameter(torch.empty(2, num_radial, dtype=dtype))  # one radial function per layer
        self.register_buffer("radial_centers", torch.linspace(0.0, cutoff, num_radial, dtype=dtype))
        self.radial_width = cutoff / num_radial
        self.reset_parameters()

    def reset_parameters(self):
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            self.embedding.copy_(torch.randn(self.embedding.shape, generator=generator, dtype=torch.float64))
            self.radial_weight.copy_(torch.randn(self.radial_weight.shape, generator=generator, dtype=torch.float64))
        self.layer1.reset_parameters()
        self.layer2.reset_parameters()

    def radial(self, distances):
        """[E, 2]: R_k(r) for both layers."""
        envelope = torch.clamp(1 - (distances / self.cutoff) ** 2, min=0) ** 3
        basis = torch.exp(-(((distances[:, None] - self.radial_centers) / self.radial_width) ** 2))
        return (basis @ self.radial_weight.T) * envelope[:, None]

    def forward(self, positions, species, src, dst):
        """Energy (a 0-dim tensor) of atoms at ``positions`` [A, 3] with ``species`` [A] and edges src -> dst."""
        _check_atoms(positions, species, src, dst)
        num_atoms = positions.shape[0]
        if num_atoms == 0:
            raise ValueError("ToyPotential: positions hold no atom")
        # an edge from an atom to itself has r = 0, whose direction (the spherical harmonics) is 0/0: NaN energy and
        # forces with no error (found by review); the edge infos read the indices' values anyway
        if src.numel() and bool((src == dst).any()):
            raise ValueError(f"ToyPotential: edge {int((src == dst).nonzero()[0, 0])} goes from an atom to itself "
                             "(r = 0 has no direction); leave self-loops out of the neighbor list")
        neighbors = src.numel() / num_atoms  # messages are scaled by 1/sqrt(mean neighbors); no edge: no messages
        scale = 1 / math.sqrt(neighbors) if neighbors else 1.0
        gather, scatter = edge_infos(src, dst, num_atoms, aggregate_scale=scale)
        vectors = positions.index_select(0, src) - positions.index_select(0, dst)
        harmonics = irreps_spherical_harmonics(self.l_sh, vectors)
        radial = self.radial(torch.linalg.vector_norm(vectors, dim=-1))
        h = self.embedding.index_select(0, species).unsqueeze(1)  # [A, 1, C]
        h = _sparse_scale_rows(self.layer1(_sparse_scale_rows(h, gather), radial[:, :1] * harmonics), scatter)
        scalars = h[:, :1]
        h = torch.cat([nn.functional.silu(scalars), h[:, 1:] * torch.sigmoid(scalars)], dim=1)
        out = _sparse_scale_rows(self.layer2(_sparse_scale_rows(h, gather), radial[:, 1:] * harmonics), scatter)
        return out.sum()

    def energy_and_forces(self, positions, species, src, dst, *, create_graph=True):
        """(E, F = -dE/dpos [A, 3]); with ``create_graph`` F is differentiable (a force loss can be trained). The
        forces are a gradient, so they are formed with grad mode on even inside torch.no_grad() (molecular
        dynamics' usual setting, where this had raised "element 0 of tensors does not require grad"); there
        the results carry no graph."""
        _check_atoms(positions, species, src, dst)
        if torch.is_inference_mode_enabled():
            raise RuntimeError("energy_and_forces: the forces are a gradient, which torch.inference_mode() cannot "
                               "form; call it under torch.no_grad() instead")
        outer_grad = torch.is_grad_enabled()
        with torch.enable_grad():
            if not positions.requires_grad:
                positions = positions.detach().requires_grad_()  # a fresh leaf: the caller's tensor is left alone
            energy = self(positions, species, src, dst)
            (grad,) = torch.autograd.grad(energy, positions, create_graph=create_graph and outer_grad)
        return (energy, -grad) if outer_grad else (energy.detach(), -grad.detach())

    def force_loss(self, positions, species, src, dst, target_forces):
        """sum (F - target)^2: its gradient w.r.t. the parameters is a derivative of a gradient."""
        _, forces = self.energy_and_forces(positions, species, src, dst, create_graph=True)
        return ((forces - target_forces) ** 2).sum()
