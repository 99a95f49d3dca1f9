"""The cuEquivariance peer (attnbench/operators/sparse/cuequivariance.py) on the CPU, through cuequivariance_torch's
"naive" method (its pure-PyTorch path; the CUDA kernels are checked by the GPU gate through the same machinery):

- the conventions its docstring states: cue.SO3's basis is so3's (generators up to the axes' names, spherical
  harmonics up to the vector's coordinate order), and cue.clebsch_gordan = (-1)^l3 sqrt(2 l3 + 1) so3.clebsch_gordan;
- the peer through the check machinery against the float64 oracle, every product and the fully connected layer
  (cuet.FullyConnectedTensorProduct with the weight an input), shared operands, every mode, fp32 and fp64, and
  SparseScale declined with its reason; the same peer with cuEquivariance's CG unmapped is reported as
  failing, not passed;
- cuEquivariance's own descriptors on the same structure: channelwise_tensor_product (weights (-1)^l3 / sqrt(2 l3 + 1),
  its per-path output blocks summed) is our vecsca, and cuet.FullyConnectedTensorProduct (weights ours times (-1)^l3)
  is our FullyConnectedTensorProduct layer, forward, gradients and a double backward;
- which CUDA method each product would take (uniform_1d or fused_tp), from cuEquivariance's own dispatch.
"""
import math

import pytest
import torch

cue = pytest.importorskip("cuequivariance", reason="the cuEquivariance peer needs cuequivariance "
                          "(pip install cuequivariance-torch, in the peers extra)")
cuet = pytest.importorskip("cuequivariance_torch", reason="the cuEquivariance peer needs cuequivariance-torch "
                           "(pip install cuequivariance-torch, in the peers extra)")

import attnbench  # noqa: E402
from attnbench.bench import runner  # noqa: E402
from attnbench.bench.registry import Unsupported  # noqa: E402
from attnbench.operators.sparse import PRODUCTS, SparseCase  # noqa: E402
from attnbench.operators.sparse import cuequivariance as peer  # noqa: E402
from attnbench.sparse import so3  # noqa: E402
from attnbench.sparse.functional import sparse_vecsca  # noqa: E402
from attnbench.sparse.tensor_product import FullyConnectedTensorProduct, cg_product_infos  # noqa: E402

OP = attnbench.get("sparse")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _irreps(l_max, channels):
    return cue.Irreps("SO3", [(channels, cue.SO3(l)) for l in range(l_max + 1)])


# ---- conventions

@pytest.mark.parametrize("l", range(5))
def test_cue_so3_basis_is_ours(l):
    """Same real basis: cue's generators are so3's with the axes named (y, z, x), and cuet's spherical harmonics of
    the vector in l = 1 irrep coordinates (y, z, x) are so3's of (x, y, z), component-normalized, for every l."""
    generators = torch.as_tensor(cue.SO3(l).X, dtype=torch.float64)
    assert torch.allclose(generators, so3.real_generators(l)[[1, 2, 0]], rtol=0, atol=1e-12)
    vectors = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(l))
    theirs = cuet.SphericalHarmonics([l], normalize=True)(vectors[:, [1, 2, 0]])
    assert torch.allclose(theirs, so3.spherical_harmonics(l, vectors), rtol=0, atol=1e-12)


def test_cue_clebsch_gordan_is_ours_times_sign_and_norm():
    """cue.clebsch_gordan(SO3 l1, l2, l3) = (-1)^l3 sqrt(2 l3 + 1) so3.clebsch_gordan(l1, l2, l3) on every path of
    irreps 0..4, so that peer.cg_coefficient is so3's exactly."""
    for l1, l2, l3 in so3.tensor_product_paths(4, 4, 4):
        (theirs,) = cue.clebsch_gordan(cue.SO3(l1), cue.SO3(l2), cue.SO3(l3))
        ours = so3.clebsch_gordan(l1, l2, l3)
        expected = (-1) ** l3 * math.sqrt(2 * l3 + 1) * ours
        assert torch.allclose(torch.as_tensor(theirs), expected, rtol=0, atol=1e-12), (l1, l2, l3)
        assert torch.allclose(torch.as_tensor(peer.cg_coefficient(l1, l2, l3)), ours, rtol=0, atol=1e-13)


# ---- the peer through the check machinery

# the tiny set's products plus each operand shared where the tiny set has it batched
EXTRA = [SparseCase(op, 1, 3, 3, dtype, shared) for dtype in ("float32", "float64")
         for op, shared in (("mul", "x"), ("outer", "y"), ("inner", "y"), ("vecsca", "y"), ("scavec", "x"),
                            ("vecmat", "x"), ("mat_t_vec", "y"), ("mat_t_vec", ""))]


def _outcomes(results):
    failed = [(r.case, r.mode, [o.detail for o in r.outputs if not o.passed]) for r in results
              if not r.skipped and not r.passed]
    return failed, {(r.case, r.mode) for r in results if r.passed}, {r.case: r.skipped for r in results if r.skipped}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_peer_passes_the_oracle_check_on_every_product_and_mode(dtype):
    cases = [c for c in OP.cases("tiny") + EXTRA if c.dtype == dtype]
    results = runner.check(OP, cases, "cpu", variants=["cuequivariance"], progress=False)
    failed, passed, skipped = _outcomes(results)
    assert not failed
    products = [c for c in cases if not c.is_scale]  # the fully connected layer ("fc") among them
    assert {c.op for c in products} == set(PRODUCTS) | {"fc"} and any(c.shared for c in products)
    assert passed == {(c.label, mode) for c in products for mode in OP.modes}
    assert set(skipped) == {c.label for c in cases if c.is_scale}
    assert all("SparseScale is a sparse matrix" in s for s in skipped.values())


def test_a_peer_with_cues_clebsch_gordan_unmapped_is_reported_failing(monkeypatch):
    """Without the (-1)^l3 / sqrt(2 l3 + 1) per path the peer computes another product: the check fails it (not a
    skip), as it would a wrong peer on the GPU before timing it."""
    def unmapped(l1, l2, l3):
        (cg,) = cue.clebsch_gordan(cue.SO3(l1), cue.SO3(l2), cue.SO3(l3))
        return cg

    peer.polynomial.cache_clear()
    monkeypatch.setattr(peer, "cg_coefficient", unmapped)
    try:
        case = SparseCase("vecsca", 2, 3, 4, "float64")
        results = runner.check(OP, [case], "cpu", variants=["cuequivariance"], progress=False)
    finally:
        peer.polynomial.cache_clear()
    assert results and all(not r.skipped and not r.passed for r in results)


def test_peer_declines_scale_and_a_missing_kernel_with_the_reason():
    scale = SparseCase("scale", 1, 5, 4)
    with pytest.raises(Unsupported, match="SparseScale"):
        peer.prepare(scale, OP.make_inputs(scale, "cpu"), "fwd")
    if cuet.primitives.segmented_polynomial.HAS_CUE_OPS:
        pytest.skip("cuequivariance_ops_torch is installed: its kernels build")
    assert "cuequivariance_ops_torch is not installed" in peer.unavailable_reason(torch.device("cuda"))
    with pytest.raises(Unsupported, match="fell back to naive"):  # cuet's silent fallback is refused
        peer._module("vecsca", 1, 3, "uniform_1d", torch.float32, torch.device("cpu"))


# ---- cuEquivariance's descriptors on the same structure

def test_channelwise_descriptor_is_vecsca():
    """cuet.ChannelWiseTensorProduct (cue.descriptors.channelwise_tensor_product, ir_mul layout, no normalization to
    undo: its paths keep cue's CG) gives each path its own output block; with weight (-1)^l3 / sqrt(2 l3 + 1) on a
    path into l3 and the blocks of each l3 summed it is our vecsca over cg_product_infos."""
    l_max, channels, batch = 2, 3, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, (l_max + 1) ** 2, channels, dtype=torch.float64, generator=gen)
    y = torch.randn(batch, (l_max + 1) ** 2, dtype=torch.float64, generator=gen)
    tp = cuet.ChannelWiseTensorProduct(_irreps(l_max, channels), _irreps(l_max, 1), [cue.SO3(l) for l in
                                       range(l_max + 1)], layout=cue.ir_mul, shared_weights=True,
                                       internal_weights=False, dtype=torch.float64, method="naive")
    blocks = list(tp.irreps_out)  # (C, l3) per path, ordered by l3; the weights have one (C, 1) block per path
    weight = torch.cat([torch.full((mul,), (-1) ** ir.l / math.sqrt(2 * ir.l + 1), dtype=torch.float64)
                        for mul, ir in blocks])
    assert weight.numel() == tp.weight_numel
    out = tp(x.reshape(batch, -1), y, weight=weight[None])
    z, start = torch.zeros_like(x), 0
    for mul, ir in blocks:
        size = (2 * ir.l + 1) * mul
        z[:, ir.l ** 2:(ir.l + 1) ** 2] += out[:, start:start + size].reshape(batch, 2 * ir.l + 1, mul)
        start += size
    assert start == out.shape[1]
    assert torch.allclose(z, sparse_vecsca(x, y, cg_product_infos(l_max, l_max, l_max)), rtol=0, atol=1e-12)


def test_fully_connected_descriptor_is_our_layer():
    """cuet.FullyConnectedTensorProduct (cue.descriptors.fully_connected_tensor_product, ir_mul layout) with weights
    (-1)^l3 W[p] per path is our FullyConnectedTensorProduct layer: its path normalization (normalize_paths_for_operand)
    times cue's CG equals our path scale a_p times so3's CG up to that sign. Forward, the gradients w.r.t. x, y and
    the weight, and the gradients of a gradient's norm (double backward), in fp64."""
    l1, l2, l3, c_in, c_out, batch = 2, 2, 1, 3, 4, 5
    ours = FullyConnectedTensorProduct(l1, l2, l3, c_in, c_out, seed=3)
    theirs = cuet.FullyConnectedTensorProduct(_irreps(l1, c_in), _irreps(l2, 1), _irreps(l3, c_out),
                                              layout=cue.ir_mul, shared_weights=True, internal_weights=False,
                                              dtype=torch.float64, method="naive")
    signs = torch.tensor([(-1.0) ** p[2] for p in ours.paths], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, (l1 + 1) ** 2, c_in, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(batch, (l2 + 1) ** 2, dtype=torch.float64, generator=gen, requires_grad=True)

    def both():
        z_ours = ours(x, y)
        weight = (ours.weight * signs[:, None, None]).reshape(-1)
        assert weight.numel() == theirs.weight_numel
        return z_ours, theirs(x.reshape(batch, -1), y, weight=weight[None]).reshape(z_ours.shape)  # shared: [1, numel]

    z_ours, z_theirs = both()
    assert torch.allclose(z_theirs, z_ours, rtol=0, atol=1e-12)
    g = torch.randn(z_ours.shape, dtype=torch.float64, generator=gen)
    leaves = (x, y, ours.weight)
    first = [torch.autograd.grad(z, leaves, g, create_graph=True) for z in (z_ours, z_theirs)]
    for a, b in zip(*first):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    second = [torch.autograd.grad(sum((t ** 2).sum() for t in grads[:2]), leaves) for grads in first]
    for a, b in zip(*second):
        assert torch.allclose(a, b, rtol=0, atol=1e-11)


# ---- the CUDA methods the peer would take

@pytest.mark.parametrize("op", PRODUCTS)
def test_cuda_method_of_each_product(op):
    """uniform_1d needs one uniform channel mode once the CG modes are flattened (mul, inner, vecsca, scavec: the
    peer's first choice there); fused_tp's dispatch (cuEquivariance's own) takes every product, so outer, vecmat and
    mat_t_vec (two channel modes) run on fused_tp. Without cuequivariance_ops_torch fused_tp stops at its import,
    after the dispatch."""
    from cuequivariance_torch.primitives.segmented_polynomial_fused_tp import SegmentedPolynomialFusedTP

    poly = peer.polynomial(op, 2, 4)
    flat = poly.flatten_coefficient_modes().squeeze_modes()
    extents = {o.segment_shape for o in flat.operands if o.ndim == 1 and o.all_same_segment_shape()}
    uniform = all(o.ndim <= 1 and o.all_same_segment_shape() for o in flat.operands) and len(extents) == 1
    assert uniform == (op in ("mul", "inner", "vecsca", "scavec"))
    try:
        SegmentedPolynomialFusedTP(poly, torch.float32)
    except ImportError:
        pass  # dispatched; the kernel module is what is missing here


def test_the_output_batch_is_given_not_left_to_the_method(monkeypatch):
    """cuequivariance_torch 0.13's fused_tp takes z's batch from the last input, 1 for a shared y (measured on the
    H200: every shared-y vecmat case refused with "shape '[100000, 9, 32]' is invalid for input of size 288"). The peer
    gives z's batch (output_shapes), so that rule cannot reach it: here the naive method wrapped in that rule."""
    class LastInputsBatch(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.method = inner, inner.method

        def forward(self, inputs, output_shapes=None):
            batch = output_shapes[0].shape[0] if output_shapes else inputs[-1].shape[0]
            (z,) = self.inner(inputs)
            return [z if z.shape[0] == batch else z[:batch]]

    make = peer._module
    monkeypatch.setattr(peer, "_module", lambda *args: LastInputsBatch(make(*args)))
    case = SparseCase("vecmat", 2, 6, 3, "float64", shared="y")
    results = runner.check(OP, [case], "cpu", variants=["cuequivariance"], progress=False)
    assert results and all(r.passed for r in results), [(r.mode, r.skipped, r.detail) for r in results]
