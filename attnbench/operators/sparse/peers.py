"""Peers of the sparse operator: torch's sparse CSR matmul for SparseScale, e3nn's tensor product for the CG
coupling (vecsca) when e3nn is installed. Each declines, with registry.Unsupported and its reason, what it cannot
compute; they run through torch autograd like the reference."""
import functools
import importlib
import importlib.util
import warnings

import torch

from ...bench.registry import Unsupported, first_line


def _module():
    """The operator package (for ``evaluate``), imported at call time: it imports this module."""
    return importlib.import_module(__package__)


# ---- torch sparse CSR

def torch_csr_matrix(info, dtype):
    """S [out_size, in_size] of a SparseScaleInfo as a torch sparse CSR tensor (values in ``dtype``)."""
    if info.scale is not None:
        values = info.scale.to(dtype)
    else:
        values = torch.ones(info.index.numel(), dtype=dtype, device=info.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state", invariant-check notes
        return torch.sparse_csr_tensor(info.seg_out, info.index, values, size=(info.out_size, info.in_size))


def torch_csr_prepare(case, inputs, mode):
    sparse = _module()
    if not case.is_scale:
        raise Unsupported("torch_csr: only SparseScale is a sparse matrix product (the products are trilinear)")
    matrix = torch_csr_matrix(inputs["infos"][0], case.torch_dtype)

    def forward(x, y):
        return matrix @ x

    try:  # probe once: CSR kernels are missing for some dtypes and devices (CPU bf16: addmm_out_sparse_csr_impl_mkl)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = sparse.evaluate(case, inputs, forward, mode)
            probe()
    except (RuntimeError, NotImplementedError) as exc:
        raise Unsupported(f"torch_csr: {first_line(exc)}") from None
    fn = sparse.evaluate(case, inputs, forward, mode)
    fn.graph_capturable = mode == "fwd"
    return fn


# ---- e3nn

def e3nn_unavailable(device):
    if importlib.util.find_spec("e3nn") is None:
        return "e3nn is not installed (pip install e3nn)"
    return None


@functools.lru_cache(maxsize=None)
def _e3nn_tensor_product(l_max, channels, device, dtype):
    """(e3nn module, output signs): x: C x l (l = 0..L, all even parity, so that every triangle path is allowed,
    as in the CG structure), y: 1 x l, z: C x l; one 'uvu' instruction per path (l1, l2, l3), no weights, no
    normalization: each path is e3nn's wigner_3j (Frobenius norm 1, like so3.clebsch_gordan). e3nn 0.6's
    wigner_3j is so3.clebsch_gordan times (-1)^l3 (checked here path by path): the signs, in e3nn's output
    layout, map its output onto ours (e3nn takes square roots of path weights, so they cannot carry a sign). A
    path that differs by more than a sign depending on l3 alone (another real basis) makes the peer decline.
    One module per device and dtype."""
    from e3nn import o3

    from ...sparse import so3

    irreps_x = o3.Irreps([(channels, (l, 1)) for l in range(l_max + 1)])
    irreps_y = o3.Irreps([(1, (l, 1)) for l in range(l_max + 1)])
    paths = so3.tensor_product_paths(l_max, l_max, l_max)
    signs = {}
    for l1, l2, l3 in paths:
        sign = _path_sign(o3.wigner_3j(l1, l2, l3, dtype=torch.float64), so3.clebsch_gordan(l1, l2, l3))
        if signs.setdefault(l3, sign) != sign:
            raise Unsupported(f"e3nn: the sign between its wigner_3j and so3.clebsch_gordan varies within l3 = {l3}")
    tp = o3.TensorProduct(irreps_x, irreps_y, irreps_x, [(l1, l2, l3, "uvu", False) for l1, l2, l3 in paths],
                          irrep_normalization="none", path_normalization="none").to(device=device, dtype=dtype)
    out_signs = torch.cat([torch.full((channels * (2 * l + 1),), signs.get(l, 1.0)) for l in range(l_max + 1)])
    return tp, out_signs.to(device=device, dtype=dtype)


def _path_sign(theirs, ours):
    """+1.0 or -1.0 with theirs == sign * ours; else Unsupported."""
    theirs, ours = torch.as_tensor(theirs, dtype=torch.float64), torch.as_tensor(ours, dtype=torch.float64)
    for sign in (1.0, -1.0):
        if torch.allclose(theirs, sign * ours, rtol=0, atol=1e-12):
            return sign
    raise Unsupported("e3nn: its wigner_3j differs from so3.clebsch_gordan by more than a sign (another real basis)")


def _to_e3nn(t, l_max):
    """[..., (L+1)^2, C] -> e3nn's layout [..., sum_l C (2l+1)], each irrep block multiplicity-major."""
    blocks = [t[..., l * l:(l + 1) ** 2, :].transpose(-1, -2).flatten(-2) for l in range(l_max + 1)]
    return torch.cat(blocks, dim=-1)


def _from_e3nn(t, l_max, channels):
    blocks, start = [], 0
    for l in range(l_max + 1):
        size = channels * (2 * l + 1)
        blocks.append(t[..., start:start + size].unflatten(-1, (channels, 2 * l + 1)).transpose(-1, -2))
        start += size
    return torch.cat(blocks, dim=-2)


def e3nn_prepare(case, inputs, mode):
    """vecsca of the CG structure, batched x and y: the coupling of the fully connected layer (each path weighted
    by the sign that maps e3nn's wigner_3j onto so3.clebsch_gordan)."""
    sparse = _module()
    reason = e3nn_unavailable(None)
    if reason:
        raise Unsupported(reason)
    if case.op != "vecsca" or case.shared:
        raise Unsupported("e3nn: only vecsca (x with C channels per irrep, y one channel, both batched) is one "
                          "e3nn TensorProduct of the CG structure; the other products have no e3nn equivalent")
    try:
        tp, out_signs = _e3nn_tensor_product(case.l_max, case.channels, inputs["x"].device, case.torch_dtype)
    except Exception as exc:  # noqa: BLE001  any failure to build is a reason to report, not a crash
        raise Unsupported(f"e3nn: {type(exc).__name__}: {first_line(exc)}") from None
    l_max, channels = case.l_max, case.channels
    # the inputs in e3nn's layout, as an e3nn model would hold them (converted here, untimed); the output is
    # converted back to [N, (L+1)^2, C] inside the timed call so that it can be checked
    converted = dict(inputs, x=_to_e3nn(inputs["x"], l_max), h_x=_to_e3nn(inputs["h_x"], l_max),
                     g=_to_e3nn(inputs["g"], l_max))

    def forward(x, y):
        return tp(x, y) * out_signs  # e3nn's output in our sign convention (one elementwise pass on z)

    fn = sparse.evaluate(case, converted, forward, mode)

    def run():
        out = fn()
        in_e3nn_layout = ("z", "grad_x", "ggrad_x", "ggrad_g")  # x-shaped: back to [N, (L+1)^2, C]
        return {k: _from_e3nn(v, l_max, channels) if k in in_e3nn_layout else v for k, v in out.items()}

    run.graph_capturable = mode == "fwd"
    return run
