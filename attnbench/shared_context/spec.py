"""What the shared_context operator computes, shared by every variant: argument checks and masks.

    q      [B, H, Lq, D]        queries of B samples (H query heads)
    k_ctx  [Hkv, Nctx, D]       context keys/values, one copy shared by every sample
    v_ctx  [Hkv, Nctx, D]
    k_buf  [B, Hkv, Nbuf, D]    per-sample buffer keys/values (capacity Nbuf)
    v_buf  [B, Hkv, Nbuf, D]
    buf_lens [B] (int32/int64)  valid buffer entries per sample (None: all Nbuf)

Row i of sample b sees every context key, and buffer key j when j < buf_lens[b] and, with
``causal=True``, j <= buf_lens[b] - Lq + i: the Lq queries are the last Lq valid buffer entries
(the usual multi-token decode / teacher-forcing alignment). The output is
softmax(scale * q [k_ctx; k_buf]^T + mask) [v_ctx; v_buf] and the row logsumexp; a row that sees
no key at all gets O = 0 and LSE = -inf. GQA: query head h reads KV head h // (H / Hkv).
"""
from dataclasses import dataclass

import torch

from ..attention.spec import check_scale
from ..checks import FLOAT_DTYPES, require_float_tensor, require_head_dim, require_head_groups, require_size
from ..kernels.offsets import INT32_MAX

SUPPORTED_DTYPES = FLOAT_DTYPES
LENGTH_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@dataclass(frozen=True)
class Shapes:
    """The checked sizes of one call."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    n_ctx: int
    n_buf: int
    head_dim: int
    scale: float
    causal: bool
    dtype: torch.dtype  # the inputs' (the interpreter may run bfloat16 as float32: outputs come back in this)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def check_inputs(q, k_ctx, v_ctx, k_buf=None, v_buf=None, buf_lens=None, *, causal=False, scale=None,
                 check_lengths=True) -> Shapes:
    """Validate one call before anything runs; returns its sizes. ``k_buf = v_buf = None`` means
    no buffer. ``check_lengths`` reads buf_lens' values to check their range, which waits for the
    GPU: a decode loop that maintains the lengths itself passes False (the kernels clamp them)."""
    require_float_tensor("q", q, 4, "[batch, heads, seqlen_q, head_dim]")
    require_float_tensor("k_ctx", k_ctx, 3, "[heads_kv, n_ctx, head_dim]")
    require_float_tensor("v_ctx", v_ctx, 3, "[heads_kv, n_ctx, head_dim]")
    if (k_buf is None) != (v_buf is None):
        raise ValueError("k_buf and v_buf must both be tensors or both be None (no buffer)")
    tensors = {"q": q, "k_ctx": k_ctx, "v_ctx": v_ctx}
    if k_buf is not None:
        require_float_tensor("k_buf", k_buf, 4, "[batch, heads_kv, n_buf, head_dim]")
        require_float_tensor("v_buf", v_buf, 4, "[batch, heads_kv, n_buf, head_dim]")
        tensors.update(k_buf=k_buf, v_buf=v_buf)
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError("q, k_ctx, v_ctx, k_buf, v_buf must share a dtype; got "
                        + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError("q, k_ctx, v_ctx, k_buf, v_buf must be on one device; got "
                         + ", ".join(f"{n} {d}" for n, d in devices.items()))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False (a mask inside the buffer), got {causal!r}")
    if not isinstance(check_lengths, bool):
        raise TypeError(f"check_lengths must be True or False, got {check_lengths!r}")

    batch, heads_q, seqlen_q, head_dim = q.shape
    if k_ctx.shape != v_ctx.shape:
        raise ValueError(f"k_ctx and v_ctx must have the same shape; got {tuple(k_ctx.shape)} and {tuple(v_ctx.shape)}")
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    require_size("k_ctx head_dim", k_ctx.shape[2], "q head_dim", head_dim)
    n_buf = 0
    if k_buf is not None:
        if k_buf.shape != v_buf.shape:
            raise ValueError(f"k_buf and v_buf must have the same shape; got {tuple(k_buf.shape)} and "
                             f"{tuple(v_buf.shape)}")
        require_size("k_buf batch", k_buf.shape[0], "q batch", batch)
        require_size("k_buf heads", k_buf.shape[1], "k_ctx heads", heads_kv)
        require_size("k_buf head_dim", k_buf.shape[3], "q head_dim", head_dim)
        n_buf = k_buf.shape[2]
    require_head_groups(heads_q, heads_kv, "k_ctx")
    require_head_dim(head_dim, MIN_HEAD_DIM, MAX_HEAD_DIM, "shared_context")
    if batch == 0 or heads_q == 0 or seqlen_q == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}; batch, heads and seqlen_q must be >= 1")
    if n_ctx + n_buf == 0:
        raise ValueError("no keys: k_ctx has n_ctx = 0 and there is no buffer (n_buf = 0)")
    if batch * heads_q * seqlen_q > INT32_MAX:
        raise ValueError(f"batch x heads x seqlen_q = {batch * heads_q * seqlen_q} query rows exceeds 2**31 - 1")
    if buf_lens is not None:
        if not isinstance(buf_lens, torch.Tensor):
            raise TypeError(f"buf_lens must be a torch.Tensor of int32/int64 or None, got {type(buf_lens).__name__}")
        if buf_lens.dtype not in LENGTH_DTYPES:
            raise TypeError(f"buf_lens has dtype {buf_lens.dtype}; it must be torch.int32 or torch.int64")
        if tuple(buf_lens.shape) != (batch,):
            raise ValueError(f"buf_lens must have shape ({batch},) (one length per sample); "
                             f"got {tuple(buf_lens.shape)}")
        if buf_lens.device != q.device:
            raise ValueError(f"buf_lens must be on {q.device}; got {buf_lens.device}")
        if check_lengths and batch:
            low, high = int(buf_lens.min()), int(buf_lens.max())
            if low < 0 or high > n_buf:
                raise ValueError(f"buf_lens must lie in [0, n_buf = {n_buf}]; got values in [{low}, {high}]")
    return Shapes(batch, heads_q, heads_kv, seqlen_q, n_ctx, n_buf, head_dim, check_scale(scale, head_dim), causal,
                  q.dtype)


def full_lengths(batch, n_buf, device):
    return torch.full((batch,), n_buf, dtype=torch.int32, device=device)


def buffer_visibility(buf_lens, batch: int, n_buf: int, seqlen_q: int, causal: bool, device):
    """Boolean [B, Lq, Nbuf]: which buffer keys each query row of each sample sees."""
    lens = full_lengths(batch, n_buf, device) if buf_lens is None else buf_lens.to(device)
    lens = lens.to(torch.int64).clamp(0, n_buf).view(batch, 1, 1)
    cols = torch.arange(n_buf, device=device).view(1, 1, n_buf)
    visible = cols < lens
    if causal:
        rows = torch.arange(seqlen_q, device=device).view(1, seqlen_q, 1)
        visible = visible & (cols <= lens - seqlen_q + rows)
    else:
        visible = visible.expand(batch, seqlen_q, n_buf)
    return visible


def visible_buffer_keys(buf_lens, batch: int, n_buf: int, seqlen_q: int, causal: bool) -> int:
    """Visible (query row, buffer key) pairs summed over samples, per head (for the FLOP model)."""
    return int(buffer_visibility(buf_lens, batch, n_buf, seqlen_q, causal, "cpu").sum())
