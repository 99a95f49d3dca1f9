"""The kernels as PyTorch custom ops: the launch layer and one op per kernel.

Launches (``_launch``) are the only place kernels are called: on the tensors' own GPU, with a
contiguous head dimension. Triton's interpreter computes ``tl.dot`` on bfloat16 wrongly (it
multiplies raw bit patterns), so there bfloat16 runs as a float32 upcast whose results are rounded
back: correct to bfloat16 precision, though not the GPU's arithmetic (which rounds P to bfloat16
for the P V product). This is the "interpreter bf16" label in the README.

Each custom op (``attnbench::attention_*``) has a fake (meta) implementation and a vmap rule that
folds the mapped dimension into the batch. Ops keep every launch opaque to torch.compile:
Inductor never re-types our kernels' arguments, and our autotuner stays ours.
"""
from typing import Optional

import torch
from torch import Tensor

from ..kernels import interpreting
from ..kernels import unavailable_reason as kernels_unavailable_reason
from ..kernels.attention.attention_bwd_jvp import attention_bwd_jvp_launch
from ..kernels.attention.attention_jvp import attention_jvp_launch
from ..kernels.attention.flash_bwd import flash_bwd_launch
from ..kernels.attention.flash_fwd import flash_fwd_launch
from ..kernels.launch import on_device, readable
from ..kernels.offsets import INT32_MAX, slice_needs_copy
from ..kernels.precision import lse_dtype
from ..kernels.replay import replayed
from ..kernels.tuning import autotune_enabled
from ..kernels.attention import copies, flash_bwd, flash_decode, flash_fwd
from ..kernels.attention.routes import forced_routes
from ..kernels.attention.row_dot import row_dot_launch


# ----------------------------------------------------------------------------- device rules

def unavailable_reason(device) -> str | None:
    """Why the Triton attention kernels cannot run on ``device`` in this process, or None."""
    return kernels_unavailable_reason(device, "attention")


def unsupported_on_cuda(dtype, head_dim):
    """Why a CUDA launch of these inputs cannot run, or None. fp64 is the gradcheck path: its tiles
    take 8 bytes a value and past head_dim 128 none of the launch configurations fits in shared
    memory (docs/measurements/flash.md)."""
    if dtype == torch.float64 and head_dim > 128:
        return f"float64 on CUDA supports head_dim <= 128 (got {head_dim}); use float32 or run on CPU"
    return None


def _unit_stride(t):
    """The kernels take any batch/head/sequence strides but need a contiguous head dimension, and
    offsets inside one head (row * row stride) small enough for int32 address arithmetic: a
    [B, N, H, D] view of a long sequence is copied to [B, H, N, D] rather than overflowing."""
    if t is None:
        return t
    if t.stride(3) == 1 and (t.shape[2] - 1) * abs(t.stride(2)) + t.shape[3] - 1 <= INT32_MAX:
        return t  # the usual case, decided without the general rule's work
    return t.contiguous() if slice_needs_copy(t, "seqlen x head_dim", "head", unit_last=True) else t


def interpreter_upcasts(dtype) -> bool:
    """True when kernels on ``dtype`` inputs run as a float32 upcast (bfloat16 in the interpreter)."""
    return dtype == torch.bfloat16 and interpreting()


# CUDA caps a grid's third axis, which the kernels give to the batch, at 65535 programs; a larger
# batch (vmap, jacrev and hessian fold their mapped dimension into it) launches in chunks.
MAX_GRID_BATCH = 65535


def _launch(launcher, *args):
    """Call a launcher on the tensors' GPU with unit-stride views; bfloat16 in the interpreter runs
    as float32 and its [B, H, N, D] results are rounded back (row statistics stay float32). Every
    tensor argument and output has the batch first, so a batch past MAX_GRID_BATCH is chunked."""
    batch = next(a for a in args if isinstance(a, Tensor)).shape[0]
    if batch > MAX_GRID_BATCH:
        parts = [_launch(launcher, *(a[b0:b0 + MAX_GRID_BATCH] if isinstance(a, Tensor) else a for a in args))
                 for b0 in range(0, batch, MAX_GRID_BATCH)]
        return tuple(None if outs[0] is None else torch.cat(outs) for outs in zip(*parts))
    first = next(a for a in args if isinstance(a, Tensor))
    upcast = interpreter_upcasts(first.dtype)
    args = [a if not isinstance(a, Tensor) else _unit_stride(readable(a)) if a.dim() == 4 else readable(a)
            for a in args]
    if upcast:
        args = [a.float() if isinstance(a, Tensor) else a for a in args]
    with on_device(first):
        out = launcher(*args)
    if upcast:
        out = tuple(t.to(torch.bfloat16) if t is not None and t.dim() == 4 else t for t in out)
    return out


def _check_device(q):
    if reason := unavailable_reason(q.device):
        raise ValueError(reason)
    if q.device.type == "cuda" and (reason := unsupported_on_cuda(q.dtype, q.shape[-1])):
        raise ValueError(reason)


# ----------------------------------------------------------------------------- custom ops

def _bwd_jvp_launch(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset):
    """Kernel 3 with its row statistics: the forward's tangents (o_t, lse_t) when not given, then
    delta and delta_t, then the dK_t/dV_t and dQ_t passes."""
    has_x_tangent = tq is not None or tk is not None or tv is not None
    if o_t is None or lse_t is None:
        if has_x_tangent:
            o_t, lse_t = attention_jvp_launch(q, k, v, tq, tk, tv, scale, offset, o=o, lse=lse)
        else:
            o_t, lse_t = None, torch.zeros_like(lse)
    delta = row_dot_launch(q.shape, q.device, q.dtype, first=(do, o), minus=dlse)
    delta_t = row_dot_launch(q.shape, q.device, q.dtype, first=None if o_t is None else (do, o_t),
                             second=None if tdo is None else (tdo, o), minus=tdlse)
    return attention_bwd_jvp_launch(q, k, v, o, lse, do, tq, tk, tv, tdo, lse_t.contiguous(), delta, delta_t,
                                    scale, offset)


def _like(t, shape=None, dtype=None):
    return t.new_empty(t.shape if shape is None else shape, dtype=t.dtype if dtype is None else dtype)


def _rows_like(q):
    return _like(q, q.shape[:3], lse_dtype(q.dtype))


def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: Optional[int]) -> tuple[Tensor, Tensor]:
    return _launch(flash_fwd_launch, q, k, v, scale, offset)


attention_fwd_op = torch.library.custom_op("attnbench::attention_fwd", _attention_fwd, mutates_args=())


@attention_fwd_op.register_fake
def _(q, k, v, scale, offset):
    return _like(q), _rows_like(q)


def _attention_fwd_jvp(q: Tensor, k: Tensor, v: Tensor, tq: Optional[Tensor], tk: Optional[Tensor],
                       tv: Optional[Tensor], scale: float, offset: Optional[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _launch(attention_jvp_launch, q, k, v, tq, tk, tv, scale, offset)


attention_fwd_jvp_op = torch.library.custom_op("attnbench::attention_fwd_jvp", _attention_fwd_jvp, mutates_args=())


@attention_fwd_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, scale, offset):
    return _like(q), _rows_like(q), _like(q), _rows_like(q)


def _attention_jvp(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, tq: Optional[Tensor],
                   tk: Optional[Tensor], tv: Optional[Tensor], scale: float, offset: Optional[int]) -> tuple[Tensor, Tensor]:
    if tq is None and tk is None and tv is None:
        return torch.zeros_like(o), torch.zeros_like(lse)
    return _launch(lambda q, k, v, o, lse, tq, tk, tv, s, off: attention_jvp_launch(q, k, v, tq, tk, tv, s, off, o, lse),
                   q, k, v, o, lse.contiguous(), tq, tk, tv, scale, offset)


attention_jvp_op = torch.library.custom_op("attnbench::attention_jvp", _attention_jvp, mutates_args=())


@attention_jvp_op.register_fake
def _(q, k, v, o, lse, tq, tk, tv, scale, offset):
    return _like(q), _rows_like(q)


def _attention_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Optional[Tensor],
                   scale: float, offset: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    return _launch(lambda q, k, v, o, lse, do, dlse, s, off: flash_bwd_launch(do, q, k, v, o, lse, s, off, dlse),
                   q, k, v, o, lse.contiguous(), do, dlse, scale, offset)


attention_bwd_op = torch.library.custom_op("attnbench::attention_bwd", _attention_bwd, mutates_args=())


@attention_bwd_op.register_fake
def _(q, k, v, o, lse, do, dlse, scale, offset):
    return _like(q), _like(k), _like(v)


def _attention_bwd_jvp(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Optional[Tensor],
                       tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor], o_t: Optional[Tensor],
                       lse_t: Optional[Tensor], tdo: Optional[Tensor], tdlse: Optional[Tensor], scale: float,
                       offset: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    return _launch(_bwd_jvp_launch, q, k, v, o, lse.contiguous(), do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse,
                   scale, offset)


attention_bwd_jvp_op = torch.library.custom_op("attnbench::attention_bwd_jvp", _attention_bwd_jvp, mutates_args=())


@attention_bwd_jvp_op.register_fake
def _(q, k, v, o, lse, do, dlse, tq, tk, tv, o_t, lse_t, tdo, tdlse, scale, offset):
    return _like(q), _like(k), _like(v)


def _fold(t, dim, size):
    """Move a vmapped dimension into the batch dimension (broadcasting an unmapped tensor)."""
    if t is None:
        return None
    t = t.unsqueeze(0).expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _vmap_rule(op, n_tensors):
    def rule(info, in_dims, *args):
        size = info.batch_size
        tensors = [_fold(a, d, size) for a, d in zip(args[:n_tensors], in_dims[:n_tensors])]
        outs = op(*tensors, *args[n_tensors:])
        return tuple(o.unflatten(0, (size, -1)) for o in outs), tuple(0 for _ in outs)

    return rule


for _op, _n in ((attention_fwd_op, 3), (attention_fwd_jvp_op, 6), (attention_jvp_op, 8), (attention_bwd_op, 7),
                (attention_bwd_jvp_op, 14)):
    torch.library.register_vmap(_op, _vmap_rule(_op, _n))


def _plain(args) -> bool:
    """Whether a launch may take ``args`` as they are: no torch.func transform, no dispatch mode
    (torch.compile's fake tensors and tracing), only plain tensors. Then the launch runs without the
    custom op's dispatch, which costs host time on every eager call; otherwise the op handles them."""
    if torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack():
        return False
    wrapped, legacy = torch._C._functorch.is_functorch_wrapped_tensor, torch._C._functorch.is_legacy_batchedtensor
    # legacy batched tensors (gradcheck's batched gradients) have no storage and no transform on the stack
    return all(type(a) is Tensor and not wrapped(a) and not legacy(a) for a in args if isinstance(a, Tensor))


def _launch_state():
    """What the launchers read besides their arguments: the forced routes, the autotune switch, the determinism flag,
    and the module switches that pick a route by default (a test or a study sets them; kernels/replay.py keys its
    replays by all of these)."""
    return (forced_routes(), autotune_enabled(), torch.are_deterministic_algorithms_enabled(),
            flash_fwd.HOPPER_BY_DEFAULT, flash_fwd.TMA_BY_DEFAULT, flash_bwd.HOPPER_DKDV_BY_DEFAULT,
            flash_bwd.GROUP_PER_HEAD_BY_DEFAULT, flash_bwd.GROUP_RULE_FILL, flash_bwd.GROUP_RULE_MIN_ROWS,
            flash_bwd.DQ_SPLIT_BY_DEFAULT, flash_decode.DECODE_MAX_NQ,
            MAX_GRID_BATCH, copies.TRITON_COPIES_BY_DEFAULT, copies.GROUPED_COPIES_BY_DEFAULT)


def _eager(body):
    """The op body on plain tensors, with host replays (kernels/replay.py): a signature's third call on skips the
    launchers' Python."""
    return replayed(body.__name__.lstrip("_"), body, _launch_state)


def _eager_or_op(body, op):
    eager = _eager(body)

    def call(*args):
        return eager(*args) if _plain(args) else op(*args)

    call.__name__ = body.__name__.lstrip("_")
    return call


# What the Functions call: the launch itself on plain eager tensors, the custom op anywhere else.
attention_fwd = _eager_or_op(_attention_fwd, attention_fwd_op)
attention_fwd_jvp = _eager_or_op(_attention_fwd_jvp, attention_fwd_jvp_op)
attention_jvp = _eager_or_op(_attention_jvp, attention_jvp_op)
attention_bwd = _eager_or_op(_attention_bwd, attention_bwd_op)
attention_bwd_jvp = _eager_or_op(_attention_bwd_jvp, attention_bwd_jvp_op)
# the fused forward and tangent on tensors the caller has unwrapped (torch.func.jvp's fast path)
eager_fwd_jvp = _eager(_attention_fwd_jvp)
