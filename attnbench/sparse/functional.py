"""Differentiable sparse ops: ``SparseScale`` and the seven sparse products, split-PyTorch implementation, and
the choice between it and the Triton kernels (``use_implementation``, ``implementation_for``).

    sparse product:  z[n, i3] += s * x[n, i1] ∘ y[n, i2]   over the terms of a SparseProductInfo
    sparse scale:    y[n, m]  += s * x[n, index]           over the terms of a SparseScaleInfo (y = S x)

Tensors are [N, M, C...]: batch N, sparse dim M, channel dims of the dense op ∘ last. An input without N is
*shared* by every batch item; ``out_accumulated`` sums the output over N (it then has no N).

The split implementation gathers with index_select, scales, applies ∘ and sums segments with index_add. Each
Function's backward calls a sibling Function's ``apply`` with the infos rotated (seed §2.3):

    gx = OpBx.apply(y, gz, info_bwd1, info_bwd2, info_fwd, out_accumulated=x shared)
    gy = OpBy.apply(gz, x, info_bwd2, info_fwd, info_bwd1, out_accumulated=y shared)

so every derivative is again one of these Functions and double backward works by construction.
The forward runs the split implementation or the Triton CSR segment kernels (``triton_ops``): Triton on CUDA
tensors, split elsewhere, unless ``use_implementation`` says otherwise; the backward needs no choice of its own,
since it is made of the same Functions. ``generate_vmap_rule`` gives vmap from the torch ops of the forward.
There is no ``jvp`` staticmethod on purpose: Dynamo refuses to trace a Function that defines one (torch 2.13,
"Unsupported custom jvp"), and torch.compile(fullgraph=True) matters more here than forward-mode AD (jacfwd,
hessian).

Non-finite inputs: on Triton, vecsca, scavec and inner over dense enough structures (Clebsch-Gordan ones) take the
dense route, whose contraction with the table's zeros makes a sample's outputs NaN when one of its entries is inf
or NaN (0 x inf, as a dense matmul); split and the segment kernels keep it to the outputs whose terms read it.
"""
import contextlib

import torch
from torch import Tensor
from torch.autograd import Function

from .info import SparseProductInfo, SparseScaleInfo, check_same_terms, verify_structure
from .triton_ops import sparse_product_triton, sparse_scale_triton

__all__ = [
    "DENSE_OPS", "CHANNEL_RANKS", "sparse_product_split", "sparse_scale_split",
    "SparseScale", "SparseMul", "SparseOuter", "SparseInner", "SparseVecMat", "SparseVecSca", "SparseScaVec",
    "SparseMatTVec", "PRODUCT_FUNCTIONS",
    "sparse_scale", "sparse_mul", "sparse_outer", "sparse_inner", "sparse_vecmat", "sparse_vecsca",
    "sparse_scavec", "sparse_mat_t_vec", "sparse_product", "IMPLEMENTATIONS", "use_implementation",
    "implementation_for",
]


def _t(a):
    return a.transpose(-1, -2)


# The dense ops ∘ on the channel dims, broadcasting over the leading (batch, term) dims.
DENSE_OPS = {
    "mul": lambda x, y: x * y,                                              # (C) x (C) -> (C)
    "outer": lambda x, y: x.unsqueeze(-1) * y.unsqueeze(-2),                # (C1) x (C2) -> (C1, C2)
    "inner": lambda x, y: (x * y).sum(-1),                                  # (C) x (C) -> ()
    "vecmat": lambda x, y: (x.unsqueeze(-2) @ y).squeeze(-2),               # (Cin) x (Cin, Cout) -> (Cout)
    "vecsca": lambda x, y: x * y.unsqueeze(-1),                             # (C) x () -> (C)
    "scavec": lambda x, y: x.unsqueeze(-1) * y,                             # () x (C) -> (C)
    "mat_t_vec": lambda x, y: (y.unsqueeze(-2) @ x).squeeze(-2),            # (Cin, Cout) x (Cin) -> (Cout)
}

# (channel rank of x, of y, of z) per op
CHANNEL_RANKS = {
    "mul": (1, 1, 1), "outer": (1, 1, 2), "inner": (1, 1, 0), "vecmat": (1, 2, 1),
    "vecsca": (1, 0, 1), "scavec": (0, 1, 1), "mat_t_vec": (2, 1, 1),
}


def _is_shared(tensor, channel_rank):
    return tensor.dim() == channel_rank + 1


def sparse_product_split(op: str, x: Tensor, y: Tensor, info: SparseProductInfo, out_accumulated: bool = False):
    """z[n, index_out[j]] = sum over segment j of s[t] x[n, index1[t]] ∘ y[n, index2[t]]; summed over n when
    ``out_accumulated``. x and y are [N, M, C...] or shared [M, C...]; z is [N, out_size, C...] unless both
    inputs are shared or ``out_accumulated``."""
    rank_x, rank_y, rank_z = CHANNEL_RANKS[op]
    dtype, acc = x.dtype, _accumulation_dtype(x.dtype)
    index1, index2, scale = info.index1, info.index2, info.scale
    if info.gather_index is not None:
        index1, index2 = index1.index_select(0, info.gather_index), index2.index_select(0, info.gather_index)
        scale = None if scale is None else scale.index_select(0, info.gather_index)
    x_terms = x.index_select(x.dim() - rank_x - 1, index1).to(acc)
    y_terms = y.index_select(y.dim() - rank_y - 1, index2).to(acc)
    terms = _dense_broadcast(op, x_terms, y_terms, rank_x, rank_y)
    if scale is not None:
        terms = terms * scale.to(terms.dtype).view(-1, *(1,) * rank_z)
    batched = terms.dim() == rank_z + 2
    if out_accumulated and batched:
        terms = terms.sum(0)  # before the segment sum: one index_add over the terms instead of N of them
        batched = False
    term_dim = 1 if batched else 0
    out_shape = list(terms.shape)
    out_shape[term_dim] = info.out_size
    # out of place, so vmap (generate_vmap_rule) can batch it. Deterministic on CPU; on CUDA index_add uses
    # atomics, so the deterministic CSR-segment sum is the Triton kernel's job.
    return terms.new_zeros(out_shape).index_add(term_dim, info.term_out, terms).to(dtype)


def _accumulation_dtype(dtype):
    """Half-precision inputs are multiplied and summed in float32 and rounded once, as the Triton kernels do
    (summed in bf16, a product lands above the bf16 bound against float64: docs/measurements/sparse.md)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dense_broadcast(op, x_terms, y_terms, rank_x, rank_y):
    """∘ of x_terms [(N,) T, Cx...] and y_terms [(N,) T, Cy...] where one side may lack N."""
    x_batched = x_terms.dim() == rank_x + 2
    y_batched = y_terms.dim() == rank_y + 2
    if x_batched and not y_batched:
        y_terms = y_terms.unsqueeze(0)
    elif y_batched and not x_batched:
        x_terms = x_terms.unsqueeze(0)
    return DENSE_OPS[op](x_terms, y_terms)


def sparse_scale_split(x: Tensor, info: SparseScaleInfo):
    """y[..., m, c] = sum_{t in row m} scale[t] x[..., index[t], c]: x [..., in_size, C] -> [..., out_size, C]."""
    terms = x.index_select(x.dim() - 2, info.index).to(_accumulation_dtype(x.dtype))
    if info.scale is not None:
        terms = terms * info.scale.to(terms.dtype).unsqueeze(-1)
    out_shape = list(terms.shape)
    out_shape[-2] = info.out_size
    return terms.new_zeros(out_shape).index_add(x.dim() - 2, info.term_out, terms).to(x.dtype)


# ---- which implementation the Functions' forward runs

IMPLEMENTATIONS = ("split", "triton")
_implementation = None  # None: by device (Triton on CUDA, split elsewhere); else one of IMPLEMENTATIONS


@contextlib.contextmanager
def use_implementation(name):
    """Within this block every Function's forward (hence every derivative, since backward calls sibling
    Functions) runs ``name``: "triton" (the CSR segment kernels; on CPU through TRITON_INTERPRET=1),
    "split" (PyTorch ops), or None (by device, the default). A module global, not thread-local, so that
    torch.compile guards on it and recompiles when it changes."""
    global _implementation
    if name is not None and name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown sparse implementation {name!r}; known: {', '.join(IMPLEMENTATIONS)}")
    before = _implementation
    _implementation = name
    try:
        yield
    finally:
        _implementation = before


def implementation_for(x: Tensor) -> str:
    """The implementation a forward on ``x`` runs: the override, else Triton on CUDA and split elsewhere."""
    if _implementation is not None:
        return _implementation
    return "triton" if x.is_cuda else "split"


def _scale_forward(x, info):
    if implementation_for(x) == "triton":
        return sparse_scale_triton(x, info)
    return sparse_scale_split(x, info)


def _product_forward(op, x, y, info, out_accumulated):
    if implementation_for(x) == "triton":
        return sparse_product_triton(op, x, y, info, out_accumulated)
    return sparse_product_split(op, x, y, info, out_accumulated)


class SparseScale(Function):
    """y = S x (``sparse_scale_split`` or the Triton kernel: ``use_implementation``); backward
    gx = S^T gy = SparseScale.apply(gy, info_bwd, info_fwd)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, info_fwd, info_bwd, trusted=False):
        if not trusted:  # here, so that `.apply` called directly is checked too; the backward's own calls skip it
            _check_scale_call(x, info_fwd, info_bwd)
        return _scale_forward(x, info_fwd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.infos = inputs[1:3]

    @staticmethod
    def backward(ctx, grad):
        info_fwd, info_bwd = ctx.infos
        return SparseScale.apply(grad, info_bwd, info_fwd, True), None, None, None


def _apply(op, *args):
    # looked up at call time (the classes are defined below); trusted: the backward's operands were checked once,
    # and the checks cost microseconds of host time a call (6.6 on the CI CPU), a backward making 2-4 such calls
    return PRODUCT_FUNCTIONS[op].apply(*args, True)


# The seed's backward table: gx = op_bx(y, gz), gy = op_by(gz, x), each a sibling Function with the transposes
# the table asks for; ``a`` is (infos rotated, out_accumulated).
_GRAD_RULES = {
    "mul": (lambda y, gz, *a: _apply("mul", y, gz, *a), lambda gz, x, *a: _apply("mul", gz, x, *a)),
    "outer": (lambda y, gz, *a: _apply("vecmat", y, _t(gz), *a), lambda gz, x, *a: _apply("mat_t_vec", gz, x, *a)),
    "inner": (lambda y, gz, *a: _apply("vecsca", y, gz, *a), lambda gz, x, *a: _apply("scavec", gz, x, *a)),
    "vecmat": (lambda y, gz, *a: _apply("mat_t_vec", _t(y), gz, *a), lambda gz, x, *a: _t(_apply("outer", gz, x, *a))),
    "vecsca": (lambda y, gz, *a: _apply("scavec", y, gz, *a), lambda gz, x, *a: _apply("inner", gz, x, *a)),
    "scavec": (lambda y, gz, *a: _apply("inner", y, gz, *a), lambda gz, x, *a: _apply("vecsca", gz, x, *a)),
    "mat_t_vec": (lambda y, gz, *a: _apply("outer", y, gz, *a), lambda gz, x, *a: _apply("vecmat", gz, _t(x), *a)),
}


def _batched_like(grad, like_shape, batched):
    """A gradient computed without N (both of its operands were shared) for an input that had N: every batch
    item received the same gradient."""
    if batched and grad.dim() == len(like_shape) - 1:
        return grad.expand(like_shape)
    return grad


def _make_product_function(op):
    rank_x, rank_y, _ = CHANNEL_RANKS[op]

    class SparseProduct(Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x, y, info_fwd, info_bwd1, info_bwd2, out_accumulated=False, trusted=False):
            if not trusted:  # here, so that `.apply` called directly gets the wrappers' errors before any kernel
                _check_product_call(op, x, y, (info_fwd, info_bwd1, info_bwd2))
            return _product_forward(op, x, y, info_fwd, out_accumulated)

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, y, info_fwd, info_bwd1, info_bwd2 = inputs[:5]
            ctx.save_for_backward(x, y)
            ctx.infos = (info_fwd, info_bwd1, info_bwd2)
            ctx.shared = (_is_shared(x, rank_x), _is_shared(y, rank_y))
            ctx.shapes = (x.shape, y.shape)

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            info_fwd, info_bwd1, info_bwd2 = ctx.infos
            shared_x, shared_y = ctx.shared
            rule_x, rule_y = _GRAD_RULES[op]
            grad_x = grad_y = None
            if ctx.needs_input_grad[0]:
                grad_x = rule_x(y, grad, info_bwd1, info_bwd2, info_fwd, shared_x)
                grad_x = _batched_like(grad_x, ctx.shapes[0], not shared_x)
            if ctx.needs_input_grad[1]:
                grad_y = rule_y(grad, x, info_bwd2, info_fwd, info_bwd1, shared_y)
                grad_y = _batched_like(grad_y, ctx.shapes[1], not shared_y)
            return grad_x, grad_y, None, None, None, None, None

    return SparseProduct


def _named(cls, name, doc):
    cls.__name__ = cls.__qualname__ = name
    cls.__doc__ = doc
    return cls


SparseMul = _named(_make_product_function("mul"), "SparseMul", "z[i3] += s x[i1] * y[i2]: (C) x (C) -> (C).")
SparseOuter = _named(_make_product_function("outer"), "SparseOuter",
                     "z[i3] += s x[i1] ⊗ y[i2]: (C1) x (C2) -> (C1, C2).")
SparseInner = _named(_make_product_function("inner"), "SparseInner", "z[i3] += s <x[i1], y[i2]>: (C) x (C) -> ().")
SparseVecMat = _named(_make_product_function("vecmat"), "SparseVecMat",
                      "z[i3] += s x[i1] @ y[i2]: (Cin) x (Cin, Cout) -> (Cout).")
SparseVecSca = _named(_make_product_function("vecsca"), "SparseVecSca", "z[i3] += s x[i1] y[i2]: (C) x () -> (C).")
SparseScaVec = _named(_make_product_function("scavec"), "SparseScaVec", "z[i3] += s x[i1] y[i2]: () x (C) -> (C).")
SparseMatTVec = _named(_make_product_function("mat_t_vec"), "SparseMatTVec",
                       "z[i3] += s x[i1]^T @ y[i2]: (Cin, Cout) x (Cin) -> (Cout).")

PRODUCT_FUNCTIONS = {
    "mul": SparseMul, "outer": SparseOuter, "inner": SparseInner, "vecmat": SparseVecMat, "vecsca": SparseVecSca,
    "scavec": SparseScaVec, "mat_t_vec": SparseMatTVec,
}


# ---- public wrappers: argument checks (shapes only: the infos were validated when built), then the Function


def _check_tensor(name, tensor, device):
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on device {tensor.device}, the info on device {device}")


def _check_one_structure(fwd, others):
    """``others``: name -> info, each the next role after fwd's in the cycle of the builder's infos (the backward
    passes its siblings the infos rotated, so a call may start at any role). Builders' infos carry a tag and are
    checked by it; untagged ones (built by hand, or copied with other terms) by their terms, once, after which
    they carry a tag too. Under torch.compile only the tags can be read: untagged infos are refused there."""
    infos = {"info_fwd": fwd, **others}
    if not torch.compiler.is_compiling():  # Dynamo cannot guard on version counters
        for name, info in infos.items():
            if (changed := info.changed_in_place()) is not None:
                raise ValueError(f"{name}.{changed} was modified in place after the info was built: its derived "
                                 "tables and its sibling infos no longer agree with it; build the infos again")
    if any(info.structure is None for info in infos.values()):
        if torch.compiler.is_compiling():
            raise ValueError("untagged sparse infos (built by hand, or copied with dataclasses.replace) under "
                             "torch.compile: call sparse.verify_structure(*infos) on them before compiling")
        if all(info.structure is None for info in infos.values()):
            verify_structure(*infos.values())  # tags them
            return
        # a mixture: compare the terms each call (tagging would retag a builder's info away from its siblings)
        check_same_terms(infos)
        return
    roles = len(others) + 1
    for step, (name, info) in enumerate(others.items(), start=1):
        if info.structure[0] != fwd.structure[0]:
            raise ValueError(f"{name} was not built with info_fwd (the builders make them together: product_infos, "
                             "scale_infos): the backward infos of another structure give wrong gradients")
        if info.structure[1] != (fwd.structure[1] + step) % roles:
            raise ValueError(f"{name} is another role's info of this structure (the builders return them in "
                             "order: (info_fwd, info_bwd1, info_bwd2), (info_fwd, info_bwd)): wrong gradients")


def _check_product_infos(infos):
    if not (isinstance(infos, (tuple, list)) and len(infos) == 3
            and all(isinstance(info, SparseProductInfo) for info in infos)):
        raise TypeError("infos must be (info_fwd, info_bwd1, info_bwd2), three SparseProductInfo (product_infos)")
    fwd, bwd1, bwd2 = infos
    # the rotation of seed §2.3: bwd1 maps (y, gz) -> gx, bwd2 maps (gz, x) -> gy
    expected = {
        "info_bwd1": (bwd1, (fwd.size2, fwd.out_size, fwd.size1)),
        "info_bwd2": (bwd2, (fwd.out_size, fwd.size1, fwd.size2)),
    }
    for name, (info, (size1, size2, out_size)) in expected.items():
        got = (info.size1, info.size2, info.out_size)
        if got != (size1, size2, out_size):
            raise ValueError(f"{name} has (size1, size2, out_size) = {got}, but the rotation of info_fwd needs "
                             f"{(size1, size2, out_size)}")
        if info.num_terms != fwd.num_terms:
            raise ValueError(f"{name} has {info.num_terms} terms, info_fwd {fwd.num_terms}: not the same terms")
        if info.device != fwd.device:
            raise ValueError(f"{name} is on {info.device}, info_fwd on {fwd.device}")
    _check_one_structure(fwd, {"info_bwd1": bwd1, "info_bwd2": bwd2})


def _check_operand(op, name, tensor, channel_rank, size, field):
    """[N, size, C...] or shared [size, C...]; returns N or None."""
    if tensor.dim() not in (channel_rank + 1, channel_rank + 2):
        raise ValueError(f"sparse {op}: {name} must be [N, M{', C' * channel_rank}] or shared "
                         f"[M{', C' * channel_rank}] ({channel_rank} channel dims), got shape {tuple(tensor.shape)}")
    m = tensor.shape[tensor.dim() - channel_rank - 1]
    if m != size:
        raise ValueError(f"sparse {op}: {name} has sparse size {m}, info_fwd.{field} = {size}")
    return None if tensor.dim() == channel_rank + 1 else tensor.shape[0]


def _check_channels(op, x, y):
    cx = x.shape[x.dim() - CHANNEL_RANKS[op][0]:]
    cy = y.shape[y.dim() - CHANNEL_RANKS[op][1]:]
    pairs = {"mul": (cx, cy), "inner": (cx, cy), "vecmat": (cx[:1], cy[:1]), "mat_t_vec": (cx[:1], cy[:1])}
    if op in pairs and pairs[op][0] != pairs[op][1]:
        raise ValueError(f"sparse {op}: channel dims of x {tuple(cx)} and y {tuple(cy)} do not match")


def _check_product_call(op, x, y, infos):
    _check_product_infos(infos)
    fwd = infos[0]
    _check_tensor("x", x, fwd.device)
    _check_tensor("y", y, fwd.device)
    if x.dtype != y.dtype:
        raise TypeError(f"sparse {op}: x and y must have one dtype, got {x.dtype} and {y.dtype}")
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    n_x = _check_operand(op, "x", x, rank_x, fwd.size1, "size1")
    n_y = _check_operand(op, "y", y, rank_y, fwd.size2, "size2")
    if n_x is not None and n_y is not None and n_x != n_y:
        raise ValueError(f"sparse {op}: x and y have batch sizes {n_x} and {n_y}")
    _check_channels(op, x, y)


def sparse_product(op: str, x: Tensor, y: Tensor, infos, out_accumulated: bool = False) -> Tensor:
    """z[n, i3] += s x[n, i1] ∘ y[n, i2] for the op named ``op`` (a key of DENSE_OPS), differentiable to any
    order; ``infos`` = product_infos(...)."""
    if op not in PRODUCT_FUNCTIONS:
        raise ValueError(f"unknown sparse product {op!r}; known: {', '.join(PRODUCT_FUNCTIONS)}")
    _check_product_call(op, x, y, infos)
    return PRODUCT_FUNCTIONS[op].apply(x, y, *infos, bool(out_accumulated), True)  # checked: see sparse_scale


def _product_function(op, doc):
    """``sparse_<op>(x, y, infos, out_accumulated=False)``: sparse_product of the op named ``op``."""

    def product(x, y, infos, out_accumulated=False):
        return sparse_product(op, x, y, infos, out_accumulated)

    product.__name__ = product.__qualname__ = f"sparse_{op}"
    product.__doc__ = doc
    return product


sparse_mul = _product_function("mul", "z[i3] += s x[i1] * y[i2], x [N, M1, C], y [N, M2, C] -> z [N, M3, C].")
sparse_outer = _product_function(
    "outer", "z[i3] += s x[i1] ⊗ y[i2], x [N, M1, C1], y [N, M2, C2] -> z [N, M3, C1, C2].")
sparse_inner = _product_function("inner", "z[i3] += s <x[i1], y[i2]>, x [N, M1, C], y [N, M2, C] -> z [N, M3].")
sparse_vecmat = _product_function(
    "vecmat", "z[i3] += s x[i1] @ y[i2], x [N, M1, Cin], y [N, M2, Cin, Cout] -> z [N, M3, Cout].")
sparse_vecsca = _product_function("vecsca", "z[i3] += s x[i1] y[i2], x [N, M1, C], y [N, M2] -> z [N, M3, C].")
sparse_scavec = _product_function("scavec", "z[i3] += s x[i1] y[i2], x [N, M1], y [N, M2, C] -> z [N, M3, C].")
sparse_mat_t_vec = _product_function(
    "mat_t_vec", "z[i3] += s x[i1]^T @ y[i2], x [N, M1, Cin, Cout], y [N, M2, Cin] -> z [N, M3, Cout].")


def _check_scale_call(x, info_fwd, info_bwd):
    for name, info in (("info_fwd", info_fwd), ("info_bwd", info_bwd)):
        if not isinstance(info, SparseScaleInfo):
            raise TypeError(f"{name} must be a SparseScaleInfo, got {type(info).__name__}")
    if (info_bwd.out_size, info_bwd.in_size) != (info_fwd.in_size, info_fwd.out_size):
        raise ValueError(f"info_bwd has (out_size, in_size) = {(info_bwd.out_size, info_bwd.in_size)}, the "
                         f"transpose of info_fwd needs {(info_fwd.in_size, info_fwd.out_size)}")
    if info_bwd.index.numel() != info_fwd.index.numel():
        raise ValueError(f"info_bwd has {info_bwd.index.numel()} terms, info_fwd {info_fwd.index.numel()}")
    if info_bwd.device != info_fwd.device:
        raise ValueError(f"info_bwd is on {info_bwd.device}, info_fwd on {info_fwd.device}")
    _check_one_structure(info_fwd, {"info_bwd": info_bwd})
    _check_tensor("x", x, info_fwd.device)
    if x.dim() < 2 or x.shape[-2] != info_fwd.in_size:
        raise ValueError(f"sparse scale: x must be [..., in_size={info_fwd.in_size}, C], got {tuple(x.shape)}")


def sparse_scale(x: Tensor, info_fwd: SparseScaleInfo, info_bwd: SparseScaleInfo) -> Tensor:
    """y[..., m, :] = sum_{t in row m} scale[t] x[..., index[t], :]: x [..., in_size, C] -> [..., out_size, C],
    differentiable to any order; (info_fwd, info_bwd) = scale_infos(...)."""
    _check_scale_call(x, info_fwd, info_bwd)
    # checked here once, so trusted (the flag spelled out: Dynamo binds a Function's defaults wrongly, and the
    # compile tests failed without it)
    return SparseScale.apply(x, info_fwd, info_bwd, True)
