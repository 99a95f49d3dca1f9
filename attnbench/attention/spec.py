"""What attention computes, shared by every variant of flash and jvp_attention: argument checks and the mask.

``causal`` is None (no mask), ``"top_left"`` (query i sees keys j <= i, SDPA's ``is_causal``) or
``"bottom_right"`` (query i sees keys j <= i + Nk - Nq, FlashAttention-2's convention for Nq != Nk).
``True`` means top-left only when Nq == Nk, where the two agree; otherwise it is ambiguous and
rejected, because picking one silently is the classic wrong answer.
"""
import math
import numbers

import torch

from ..checks import (FLOAT_DTYPES, require_float_tensor, require_head_dim, require_head_groups,
                      require_size)

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
SUPPORTED_DTYPES = FLOAT_DTYPES
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# a scale the kernels receive as float32 must neither overflow it nor round to zero (plain
# arithmetic, no numpy: torch.compile traces this check)
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.401298464324817e-45


def causal_offset(causal, seqlen_q: int, seqlen_k: int):
    """The diagonal offset: query row i sees keys j <= i + offset, or None for no mask."""
    if causal is None or causal is False:
        return None
    if causal is True:
        if seqlen_q != seqlen_k:
            raise ValueError(
                f"causal=True is ambiguous when seqlen_q ({seqlen_q}) != seqlen_k ({seqlen_k}): pass "
                "causal='top_left' (SDPA's is_causal) or causal='bottom_right' (FlashAttention-2)")
        return 0
    if causal == "top_left":
        return 0
    if causal == "bottom_right":
        return seqlen_k - seqlen_q
    raise ValueError(f"causal must be None, False, True, 'top_left' or 'bottom_right'; got {causal!r}")


def causal_mask(seqlen_q: int, seqlen_k: int, offset, device):
    """Boolean [Nq, Nk] visibility matrix, or None when nothing is masked."""
    if offset is None:
        return None
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + offset


def check_qkv(q, k, v, *, scale=None, causal=None, name_prefix=""):
    """Validate flash inputs before anything runs; returns (softmax scale, causal offset)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_float_tensor(f"{name_prefix}{name}", t, 4, "[batch, heads, seqlen, head_dim]")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    batch, heads_q, seqlen_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    require_size("k batch", k.shape[0], "q batch", batch)
    require_size("k head_dim", k.shape[3], "q head_dim", head_dim)
    # before the head-group rule, which would read Hq = Hkv = 0 as a bad GQA ratio
    if 0 in (batch, heads_q, seqlen_q, k.shape[1], k.shape[2]):
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; every dimension must be >= 1")
    require_head_groups(heads_q, k.shape[1], "k/v")
    require_head_dim(head_dim, MIN_HEAD_DIM, MAX_HEAD_DIM, "flash")
    return check_scale(scale, head_dim), causal_offset(causal, seqlen_q, k.shape[2])


def softmax_scale(scale, head_dim):
    """``scale``, or the default 1/sqrt(head_dim) where it is None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_scale(scale, head_dim) -> float:
    """The softmax scale (default 1/sqrt(head_dim)): a real number (numpy scalars too, not bool),
    positive and finite once rounded to fp32, the precision kernels receive it in (1e39 would
    silently give NaN outputs, 1e-50 would round to 0)."""
    if scale is None:
        return softmax_scale(scale, head_dim)
    if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
            or not (math.isfinite(float(scale)) and FLOAT32_TINY / 2 < float(scale) <= FLOAT32_MAX)):
        raise ValueError(f"scale must be a positive finite number (in float32), got {scale!r}")
    return float(scale)


def check_like(name, t, like, shape=None, dtype=None):
    """Validate a backward input against the tensor it must match."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want_shape = tuple(like.shape) if shape is None else tuple(shape)
    if tuple(t.shape) != want_shape:
        raise ValueError(f"{name} must have shape {want_shape}; got {tuple(t.shape)}")
    want_dtype = like.dtype if dtype is None else dtype
    if t.dtype != want_dtype:
        raise TypeError(f"{name} must have dtype {want_dtype}; got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}; got {t.device}")
