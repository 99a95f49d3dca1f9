"""The cuEquivariance peer of the sparse products: NVIDIA's cuequivariance (descriptors) and cuequivariance_torch
(execution; its CUDA kernels come from cuequivariance_ops_torch, PyPI cuequivariance-ops-torch-cu12 or -cu13).

What it runs. Each product of a case, on the Clebsch-Gordan structure of irreps 0..L, is one cuEquivariance
SegmentedTensorProduct built as its descriptors build theirs (cuequivariance/group_theory/descriptors/irreps_tp.py:
``from_subscripts``, one segment per irrep, one path per (l1, l2, l3) with ``cue.clebsch_gordan`` as its
coefficient), run by ``cuequivariance_torch.SegmentedPolynomial`` under torch autograd. The channel modes of x, y, z
and the CG modes i, j, k of each op (``SUBSCRIPTS``):

    mul "iu,ju,ku"  outer "iu,jv,kuv"  inner "iu,ju,k"  vecmat "iu,juv,kv"  vecsca "iu,j,ku"  scavec "i,ju,ku"
    mat_t_vec "iuv,ju,kv"   (each + "ijk", the coefficient modes)

Every path of one l3 adds into the same output segment, as our structure (and e3nn's 'uvu') sum them; cuEquivariance's
channelwise_tensor_product descriptor instead gives each path its own output channels, and its
fully_connected_tensor_product is our FullyConnectedTensorProduct layer (vecsca then vecmat with the shared path
weights) in one contraction; tests/sparse/test_cuequivariance_peer.py checks both descriptors against ours.

Conventions (each checked there, in float64):
  basis    cue.SO3's real basis is attnbench.sparse.so3's: components m = -l..l in that order, the same generators
           with the axes named (y, z, x) (cue.SO3(l).X[k] = so3.real_generators(l)[(1, 2, 0)[k]]), and
           cuet.SphericalHarmonics takes the vector in the l = 1 irrep's coordinates: SH(v[..., [1, 2, 0]]) equals
           so3.spherical_harmonics(v) for every l (both "component" normalized, no Condon-Shortley phase left).
           Features need no change of basis.
  CG       cue.clebsch_gordan(SO3(l1), SO3(l2), SO3(l3)) = (-1)^l3 sqrt(2 l3 + 1) so3.clebsch_gordan(l1, l2, l3)
           (one solution per path). Each path's coefficient here is cuEquivariance's times (-1)^l3 / sqrt(2 l3 + 1):
           the STP is our structure exactly.
  norm     the descriptors call normalize_paths_for_operand(-1) (unit-variance outputs); our structure is not
           normalized, so the STP here is left as built. For the FC layer that normalization is ours: its path
           coefficient is (-1)^l3 a_p C_p, a_p = FullyConnectedTensorProduct's path scale, so its weights are ours
           times (-1)^l3.
  layout   cue.ir_mul (per irrep [2l+1, C...]) is our memory layout [N, (L+1)^2, C...], so operands are reshaped to
           [batch, size], never permuted (mul_ir, e3nn's and cuet's default for its layers, would transpose each
           irrep block). A shared operand is a batch of one, which cuEquivariance broadcasts (and sums its gradient).

Methods. CUDA: "uniform_1d" where the STP, coefficient modes flattened, has one uniform channel mode (mul, inner,
vecsca, scavec: cuEquivariance's own choice for channel-wise products), else "fused_tp" (outer, vecmat, mat_t_vec: the
FC layer's method), both kernels of cuequivariance_ops_torch, math in float32 (float64 for fp64 cases); the first that
builds and runs the mode is timed. Without cuequivariance_ops_torch the peer is unavailable on CUDA: cuet would fall
back to "naive" with only a warning. CPU: "naive", cuEquivariance's pure-PyTorch einsum per path (no kernels on CPU),
so that the CPU gate checks the construction against the float64 oracle.

The layer ("fc" cases): cuet.FullyConnectedTensorProduct (cuEquivariance's fully_connected_tensor_product descriptor,
one contraction "uvw,iu,jv,kw+ijk" with the weight first), irreps 0..L x 0..L (one channel: spherical harmonics) ->
0..L, ir_mul, the weight an input shared by the batch (ours times (-1)^l3 per path, as above); "fused_tp" on CUDA
(the layer's own default), naive on CPU.

Declines: SparseScale (a sparse matrix over the batch dim, not a tensor product of irreps).
"""
import functools
import importlib
import importlib.util
import math
import warnings

import torch

from ...bench.registry import Unsupported, first_line
from ...sparse.functional import CHANNEL_RANKS

# (x, y, z) channel modes per op after the CG modes i, j, k; "+ijk": the path coefficient is a [2l1+1, 2l2+1, 2l3+1]
# CG block
SUBSCRIPTS = {
    "mul": "iu,ju,ku+ijk", "outer": "iu,jv,kuv+ijk", "inner": "iu,ju,k+ijk", "vecmat": "iu,juv,kv+ijk",
    "vecsca": "iu,j,ku+ijk", "scavec": "i,ju,ku+ijk", "mat_t_vec": "iuv,ju,kv+ijk",
}
CUDA_METHODS = ("uniform_1d", "fused_tp")  # in order of preference (see the module docstring)


def unavailable_reason(device):
    if importlib.util.find_spec("cuequivariance_torch") is None or importlib.util.find_spec("cuequivariance") is None:
        return "cuequivariance-torch is not installed (pip install cuequivariance-torch)"
    if torch.device(device).type == "cuda" and importlib.util.find_spec("cuequivariance_ops_torch") is None:
        return ("cuequivariance_ops_torch is not installed (pip install cuequivariance-ops-torch-cu13, or -cu12): "
                "without its CUDA kernels cuequivariance_torch falls back to its naive einsum")
    return None


def cg_coefficient(l1, l2, l3):
    """cue.clebsch_gordan(SO3(l1), SO3(l2), SO3(l3)) mapped onto so3.clebsch_gordan: times (-1)^l3 / sqrt(2 l3 + 1).
    float64 numpy [2l1+1, 2l2+1, 2l3+1]."""
    import cuequivariance as cue

    solutions = cue.clebsch_gordan(cue.SO3(l1), cue.SO3(l2), cue.SO3(l3))
    if len(solutions) != 1:
        raise Unsupported(f"cuequivariance: {len(solutions)} CG solutions for path {(l1, l2, l3)}, expected one")
    return solutions[0] * ((-1) ** l3 / math.sqrt(2 * l3 + 1))


@functools.lru_cache(maxsize=None)
def polynomial(op, l_max, channels):
    """The cue.SegmentedPolynomial of ``op`` on the CG structure of irreps 0..l_max with ``channels`` per channel dim:
    inputs x, y and output z flattened as [batch, (L+1)^2 * C^rank] (cue.ir_mul, our layout)."""
    import cuequivariance as cue

    from ...sparse import so3

    stp = cue.SegmentedTensorProduct.from_subscripts(SUBSCRIPTS[op])
    for operand, rank in enumerate(CHANNEL_RANKS[op]):
        for l in range(l_max + 1):  # segment l of an operand is its flat rows l*l .. (l+1)^2 - 1
            stp.add_segment(operand, (2 * l + 1,) + (channels,) * rank)
    for l1, l2, l3 in so3.tensor_product_paths(l_max, l_max, l_max):
        stp.add_path(l1, l2, l3, c=cg_coefficient(l1, l2, l3))
    return cue.SegmentedPolynomial.eval_last_operand(stp)


def _math_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _built(method, build, polynomial_of):
    """``build()``'s module, Unsupported when cuet does not build ``method``: it raises, or its polynomial
    (``polynomial_of(module)``, a cuet.SegmentedPolynomial) falls back to naive with only a warning, which is refused
    here, not timed under the kernel's name."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = build()
        except (AssertionError, RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
            raise Unsupported(f"cuequivariance {method}: {type(exc).__name__}: {first_line(exc, 200)}") from None
    if polynomial_of(module).method != method:
        said = "; ".join(first_line(w.message, 200) for w in caught) or "no reason given"
        raise Unsupported(f"cuequivariance: method {method} fell back to {polynomial_of(module).method} ({said})")
    return module


def _module(op, l_max, channels, method, dtype, device):
    """cuet.SegmentedPolynomial for ``method`` on ``device`` (``_built``'s refusals)."""
    import cuequivariance_torch as cuet

    return _built(method, lambda: cuet.SegmentedPolynomial(polynomial(op, l_max, channels), method=method,
                                                           math_dtype=_math_dtype(dtype)), lambda m: m).to(device)


def _forward(case, module, device):
    """f(x, y) -> z on our tensors: each operand reshaped to [batch or 1, size], z back to the case's shape.

    z's batch is given (``output_shapes``: cuet reads only the first dim of a 2-D tensor) rather than inferred:
    fused_tp (cuequivariance_torch 0.13, segmented_polynomial_fused_tp.py) takes the last input's batch even when
    it is a shared operand's 1, so that a shared y made z one row (measured on the H200: "shape '[100000, 9, 32]'
    is invalid for input of size 288"); its naive method keeps the largest, as meant."""
    z_shape = case.shape("z")
    z_batch = {0: torch.empty(case.batch, 0, device=device)}

    def forward(x, y):
        xs = x.reshape(1 if case.shared == "x" else case.batch, -1)
        ys = y.reshape(1 if case.shared == "y" else case.batch, -1)
        (z,) = module([xs, ys], output_shapes=z_batch)
        return z.reshape(z_shape)

    return forward


def _layer_module(case, method, device):
    """cuet.FullyConnectedTensorProduct of the case's layer (see the module docstring)."""
    import cuequivariance as cue
    import cuequivariance_torch as cuet

    def irreps(channels):
        return cue.Irreps("SO3", [(channels, cue.SO3(l)) for l in range(case.l_max + 1)])

    # the layer keeps its method's name when its polynomial (.f) falls back to naive: the polynomial's is read
    return _built(method, lambda: cuet.FullyConnectedTensorProduct(
        irreps(case.channels), irreps(1), irreps(case.channels), layout=cue.ir_mul, shared_weights=True,
        internal_weights=False, math_dtype=_math_dtype(case.torch_dtype), method=method, device=device),
        lambda m: m.f)


def _layer_forward(case, module, device):
    """f(x, y, w) -> z: w [P, C, C] ours, given to cuEquivariance flat, times (-1)^l3 per path, a batch of one."""
    sparse = importlib.import_module(__package__)
    signs = torch.tensor([(-1.0) ** l3 for _, _, l3 in sparse.layer_paths(case.l_max)], device=device)
    z_shape = case.shape("z")

    def forward(x, y, w):
        weight = (w * signs.to(w.dtype)[:, None, None]).reshape(1, -1)
        return module(x.reshape(case.batch, -1), y, weight=weight).reshape(z_shape)

    return forward


def prepare(case, inputs, mode):
    """The peer's timed call for one case and mode (see the module docstring); Unsupported with the reason for what
    it does not run."""
    sparse = importlib.import_module(__package__)
    device = inputs["x"].device
    reason = unavailable_reason(device)
    if reason:
        raise Unsupported(reason)
    if case.is_scale:
        raise Unsupported("cuequivariance: SparseScale is a sparse matrix over the batch dim, not a tensor product "
                          "of irreps (cuEquivariance's gather/scatter indices apply to a product's operands)")
    methods = ("naive",) if device.type != "cuda" else ("fused_tp",) if case.is_layer else CUDA_METHODS
    declined = []
    for method in methods:
        try:
            if case.is_layer:
                forward = _layer_forward(case, _layer_module(case, method, device), device)
            else:
                forward = _forward(case, _module(case.op, case.l_max, case.channels, method, case.torch_dtype, device),
                                   device)
            fn = sparse._autograd_prepare(case, inputs, mode, forward)
            fn()  # probe: a method can build and still refuse a dtype or a shape when called (fn runs again)
        except Unsupported as exc:
            declined.append(str(exc))
            continue
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, NotImplementedError, AssertionError, TypeError) as exc:
            declined.append(f"cuequivariance {method}: {type(exc).__name__}: {first_line(exc, 200)}")
            continue
        return fn
    raise Unsupported("; ".join(declined))


def description():
    return ("every product as one cuEquivariance SegmentedTensorProduct of the CG structure (cue.SO3 CG times "
            "(-1)^l3/sqrt(2 l3+1), ir_mul layout = ours), cuequivariance_torch.SegmentedPolynomial: uniform_1d "
            "(mul, inner, vecsca, scavec) else fused_tp on CUDA, naive on CPU; the layer (fc) as "
            "cuet.FullyConnectedTensorProduct; torch autograd")
