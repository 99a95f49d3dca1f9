"""The Triton flash operator's public API: manual-gradient calls and an autograd Function.

``flash_fwd(q, k, v) -> (o, lse)`` and ``flash_bwd(do, q, k, v, o, lse) -> (dq, dk, dv)`` let a
training loop stitch gradients by hand; ``flash_attention(q, k, v)`` plugs the same kernels into
autograd. Every argument is checked here, before any kernel launches.
"""
import contextlib

import torch
from torch.autograd.function import once_differentiable

from ...kernels import interpreting
from ...kernels.flash_bwd import flash_bwd_launch
from ...kernels.flash_fwd import flash_fwd_launch
from ...kernels.precision import lse_dtype
from .spec import check_like, check_qkv


def unavailable_reason(device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` in this process, or None: they run on CUDA,
    or on the CPU through the interpreter, never both at once."""
    device = torch.device(device)
    if device.type == "cuda":
        return "TRITON_INTERPRET=1 runs kernels on the CPU; move q, k, v to the CPU or unset it" if interpreting() else None
    if device.type == "cpu" and interpreting():
        return None
    return f"the Triton flash kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); got tensors on {device}"


INT32_MAX = 2**31 - 1


def _unit_stride(t):
    """The kernels take any batch/head/sequence strides but need a contiguous head dimension, and
    offsets inside one head (row * row stride) small enough for int32 address arithmetic: a
    [B, N, H, D] view of a long sequence is copied to [B, H, N, D] rather than overflowing."""
    seqlen, head_dim = t.shape[-2], t.shape[-1]
    if t.stride(-1) == 1 and (seqlen - 1) * t.stride(-2) + head_dim <= INT32_MAX:
        return t
    if seqlen * head_dim > INT32_MAX:
        raise ValueError(f"seqlen x head_dim = {seqlen} x {head_dim} exceeds 2**31 - 1 elements per head")
    return t.contiguous()


def unsupported_on_cuda(dtype, head_dim):
    """Why a CUDA launch of these inputs cannot run, or None. fp64 is the gradcheck path: its tiles
    take 8 bytes a value and past head_dim 128 none of the launch configurations fits in shared
    memory (measured on an H200: 280 KB wanted for D = 256)."""
    if dtype == torch.float64 and head_dim > 128:
        return f"float64 on CUDA supports head_dim <= 128 (got {head_dim}); use float32 or run on CPU"
    return None


def _checked(q, k, v, scale, causal):
    scale, offset = check_qkv(q, k, v, scale=scale, causal=causal)
    if reason := unavailable_reason(q.device):
        raise ValueError(reason)
    if q.device.type == "cuda" and (reason := unsupported_on_cuda(q.dtype, q.shape[-1])):
        raise ValueError(reason)
    return scale, offset


def _on_device(t):
    """Launch on the tensors' GPU, not whichever one is current."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _launch_fwd(q, k, v, scale, offset):
    with _on_device(q):
        return flash_fwd_launch(_unit_stride(q), _unit_stride(k), _unit_stride(v), scale, offset)


def _launch_bwd(do, q, k, v, o, lse, scale, offset):
    with _on_device(q):
        return flash_bwd_launch(*(_unit_stride(t) for t in (do, q, k, v, o)), lse.contiguous(), scale, offset)


def flash_fwd(q, k, v, *, scale=None, causal=None):
    """Attention forward on [B, H, N, D] tensors. Returns (o, lse); lse is [B, Hq, Nq] float32
    (float64 for float64 inputs), natural log, -inf for rows that see no key."""
    scale, offset = _checked(q, k, v, scale, causal)
    return _launch_fwd(q, k, v, scale, offset)


def flash_bwd(do, q, k, v, o, lse, *, scale=None, causal=None):
    """Gradients (dq, dk, dv) of <do, o> given the forward's saved o and lse (Algorithm 4)."""
    scale, offset = _checked(q, k, v, scale, causal)
    check_like("do", do, q)
    check_like("o", o, q)
    check_like("lse", lse, q, shape=q.shape[:3], dtype=lse_dtype(q.dtype))
    return _launch_bwd(do, q, k, v, o, lse, scale, offset)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wiring of the kernels; lse is returned but not differentiable."""

    @staticmethod
    def forward(q, k, v, scale, offset):
        return _launch_fwd(q, k, v, scale, offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, scale, offset = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.offset = scale, offset
        ctx.mark_non_differentiable(lse)

    @staticmethod
    @once_differentiable  # second order is the jvp_attention operator's job
    def backward(ctx, do, _unused_dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_launch_bwd(do, q, k, v, o, lse, ctx.scale, ctx.offset), None, None)


def flash_attention(q, k, v, *, scale=None, causal=None, return_lse=False):
    """softmax(scale Q K^T + causal mask) V with gradients through autograd."""
    scale, offset = _checked(q, k, v, scale, causal)
    o, lse = FlashAttentionFunction.apply(q, k, v, scale, offset)
    return (o, lse) if return_lse else o
