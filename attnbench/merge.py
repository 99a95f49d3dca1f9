"""``merge_states``: combine partial attention results over disjoint key sets, exactly.

A *state* is what attention over one subset of the keys returns: the normalized output O and the
row logsumexp LSE of the scaled scores (natural log). For disjoint key sets A and B,

    LSE = log(exp(LSE_a) + exp(LSE_b)),   O = exp(LSE_a - LSE) O_a + exp(LSE_b - LSE) O_b,

which is attention over A and B together: the online-softmax combine of FlashAttention,
flash-decoding's split-K reduction and cascade / shared-prefix attention (context + buffer).

A row that saw no key has LSE = -inf. Such a state contributes nothing, whatever its O holds
(SDPA leaves NaN there); when every state of a row is -inf the result is O = 0, LSE = -inf. A
state with a NaN LSE makes its row NaN.

This module is plain PyTorch (the split variants use it; it never imports Triton). The Triton
kernels live in ``attnbench.kernels.merge_states``; ``merge_states_triton`` below is their
checked entry point.
"""
import torch

from .checks import FLOAT_DTYPES, refuse_derivatives, require_dtype, require_float_dtype

SUPPORTED_DTYPES = FLOAT_DTYPES
NO_DERIVATIVES = "merge_states / merge_many (plain PyTorch) differentiate every way"


def _compute_dtype(*dtypes):
    return torch.float64 if torch.float64 in dtypes else torch.float32


def check_state(o, lse, name="state"):
    """A state is O [..., D] (floating) and LSE [...] (float32 or float64) on one device."""
    if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(f"{name}: O and LSE must be torch.Tensors, got {type(o).__name__} and {type(lse).__name__}")
    require_float_dtype(f"{name}: O", o.dtype)
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: LSE has dtype {lse.dtype}; it must be float32 or float64")
    if o.dim() < 1 or tuple(o.shape[:-1]) != tuple(lse.shape):
        raise ValueError(f"{name}: O {tuple(o.shape)} must be LSE's shape {tuple(lse.shape)} plus a head dimension")
    if o.device != lse.device:
        raise ValueError(f"{name}: O and LSE must be on one device; got {o.device} and {lse.device}")


def _check_pair(o_a, lse_a, o_b, lse_b):
    check_state(o_a, lse_a, "state a")
    check_state(o_b, lse_b, "state b")
    if o_a.shape != o_b.shape:
        raise ValueError(f"states must have one shape; got O_a {tuple(o_a.shape)} and O_b {tuple(o_b.shape)}")
    if o_a.device != o_b.device:
        raise ValueError(f"states must be on one device; got {o_a.device} and {o_b.device}")


def merge_many(o, lse, dim: int = 0, out_dtype=None):
    """Merge the states stacked along ``dim``: O [..., S, ..., D], LSE [..., S, ...] -> (O, LSE).

    Exact for any number of states, -inf states included; an empty stack (S = 0) is a row that
    saw no key. O comes back in ``out_dtype`` (default: O's dtype), LSE in LSE's dtype.
    """
    check_state(o, lse, "stacked states")
    require_dtype("out_dtype", out_dtype)
    if not -lse.dim() <= dim < max(lse.dim(), 1):
        raise ValueError(f"dim {dim} is out of range for LSE of shape {tuple(lse.shape)}")
    dim = dim % lse.dim()
    cdt = _compute_dtype(o.dtype, lse.dtype)
    lse_c = lse.to(cdt)
    top = lse_c.amax(dim=dim, keepdim=True) if lse_c.shape[dim] else lse_c.sum(dim=dim, keepdim=True) - torch.inf
    seen = torch.isfinite(top)
    top_safe = torch.where(seen, top, torch.zeros_like(top))  # no (-inf) - (-inf)
    weight = torch.exp(lse_c - top_safe)  # 0 for -inf states
    total = weight.sum(dim=dim, keepdim=True)
    # A state that saw no key adds nothing even if its O is NaN (0 * NaN would not).
    contrib = torch.where((weight > 0).unsqueeze(-1), weight.unsqueeze(-1) * o.to(cdt), torch.zeros((), dtype=cdt,
                                                                                                     device=o.device))
    # a NaN state (a non-finite input) makes the total NaN, and its row comes out NaN, never as
    # the (0, -inf) of a row that saw no key
    total_safe = torch.where(total == 0, torch.ones_like(total), total)
    merged_o = contrib.sum(dim=dim, keepdim=True) / total_safe.unsqueeze(-1)
    merged_lse = torch.where(total == 0, torch.full_like(total, -torch.inf), top_safe + torch.log(total_safe))
    merged_lse = torch.where(torch.isposinf(top), torch.full_like(total, torch.nan), merged_lse)  # as the kernels
    return merged_o.squeeze(dim).to(out_dtype or o.dtype), merged_lse.squeeze(dim).to(lse.dtype)


def merge_states(o_a, lse_a, o_b, lse_b, out_dtype=None):
    """Merge two states over disjoint key sets; see the module docstring. Returns (O, LSE)."""
    _check_pair(o_a, lse_a, o_b, lse_b)
    require_dtype("out_dtype", out_dtype)
    lse_dtype = torch.promote_types(lse_a.dtype, lse_b.dtype)
    o_dtype = out_dtype or torch.promote_types(o_a.dtype, o_b.dtype)
    cdt = _compute_dtype(o_a.dtype, o_b.dtype, lse_dtype)
    o = torch.stack([o_a.to(cdt), o_b.to(cdt)])
    lse = torch.stack([lse_a.to(lse_dtype), lse_b.to(lse_dtype)])
    return merge_many(o, lse, dim=0, out_dtype=o_dtype)


def merge_states_triton(o_a, lse_a, o_b, lse_b, out_dtype=None):
    """``merge_states`` by one Triton launch (CUDA, or the CPU interpreter): same contract, any
    strides with a unit last dimension. Arguments are checked before the kernel runs."""
    _check_pair(o_a, lse_a, o_b, lse_b)
    if lse_a.dtype != lse_b.dtype:
        raise TypeError(f"LSE dtypes differ: {lse_a.dtype} and {lse_b.dtype}")
    require_dtype("out_dtype", out_dtype)
    refuse_derivatives("merge_states_triton", (o_a, lse_a, o_b, lse_b), NO_DERIVATIVES)
    from .kernels.merge_states import merge_two_launch

    return merge_two_launch(o_a, lse_a, o_b, lse_b, out_dtype or torch.promote_types(o_a.dtype, o_b.dtype))


def merge_many_triton(o, lse, out_dtype=None):
    """``merge_many`` over dim 0 by one Triton launch (the split-K reduction)."""
    check_state(o, lse, "stacked states")
    if lse.dim() < 1:
        raise ValueError("stacked states need a leading split dimension")
    require_dtype("out_dtype", out_dtype)
    refuse_derivatives("merge_many_triton", (o, lse), NO_DERIVATIVES)
    from .kernels.merge_states import merge_stack_launch

    return merge_stack_launch(o, lse, out_dtype or o.dtype)
