"""Eager shared-context attention: the oracle, written as today's per-batch KV cache.

The context is expanded to the batch and concatenated with each sample's buffer (a materialized
[B, Hkv, Nctx + Nbuf, D] cache), then one masked softmax. Plain torch ops, any dtype and device;
run in float64 it is the truth every other variant is measured against, run in a low dtype it is
the "what plain PyTorch gets in this dtype" bar of the 2x rule. It never imports Triton.
"""
import torch

from ..softmax import softmax_and_lse
from .spec import buffer_visibility, check_inputs


def per_batch_cache(k_ctx, v_ctx, k_buf, v_buf, batch):
    """The per-batch layout: [B, Hkv, Nctx + Nbuf, D] keys and values (context copied B times)."""
    k = k_ctx.unsqueeze(0).expand(batch, *k_ctx.shape)
    v = v_ctx.unsqueeze(0).expand(batch, *v_ctx.shape)
    if k_buf is not None and k_buf.shape[2]:
        k, v = torch.cat([k, k_buf], dim=2), torch.cat([v, v_buf], dim=2)
    return k.contiguous(), v.contiguous()


def visibility(batch, seqlen_q, n_ctx, n_buf, buf_lens, causal, device):
    """Boolean [B, Lq, Nctx + Nbuf]: the context is always visible, the buffer as in spec."""
    ctx = torch.ones(batch, seqlen_q, n_ctx, dtype=torch.bool, device=device)
    if not n_buf:
        return ctx
    return torch.cat([ctx, buffer_visibility(buf_lens, batch, n_buf, seqlen_q, causal, device)], dim=2)


def attention(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal: bool, scale: float):
    """(O, LSE) on the materialized per-batch cache. GQA broadcasts each KV head over its group of
    query heads (no repeated copy of the cache)."""
    check_inputs(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal=causal, scale=scale, check_lengths=False)
    batch, heads_q, seqlen_q, head_dim = q.shape
    n_ctx = k_ctx.shape[1]
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    k, v = per_batch_cache(k_ctx, v_ctx, k_buf, v_buf, batch)  # [B, Hkv, N, D]
    heads_kv = k.shape[1]
    qg = q.unflatten(1, (heads_kv, heads_q // heads_kv))  # [B, Hkv, G, Lq, D]
    visible = visibility(batch, seqlen_q, n_ctx, n_buf, buf_lens, causal, q.device)[:, None, None]  # [B, 1, 1, Lq, N]
    # Keys no row of a sample sees (unused buffer slots) add nothing even if they hold inf or NaN, where
    # 0 * inf would not: zeroed in V for the output, and in K for the gradient (dQ = dS K, dS = 0 there)
    used = visible.any(dim=3).unsqueeze(-1)  # [B, 1, 1, N, 1]
    k, v = k.unsqueeze(2).masked_fill(~used, 0.0), v.unsqueeze(2).masked_fill(~used, 0.0)  # [B, Hkv, 1, N, D]
    s = scale * (qg @ k.transpose(-1, -2))  # [B, Hkv, G, Lq, N]
    s = s.masked_fill(~visible, float("-inf"))
    blind = ~visible.any(dim=-1)  # rows that see no key
    p, lse = softmax_and_lse(s, blind)  # P = 0 on masked keys and blind rows
    o = p @ v
    o = o.masked_fill(blind.unsqueeze(-1), 0.0)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o.flatten(1, 2), lse.flatten(1, 2).to(lse_dtype)


def evaluate(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, dtype, max_elements: int = 1 << 26):
    """(o, lse) from the reference computed in ``dtype``, over chunks of samples so that the
    float64 oracle at real sizes never holds more than ~``max_elements`` scores, nor a chunk's
    materialized cache of more than ~``max_elements`` keys and values, at once."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv = k_ctx.shape[0]
    n_keys = k_ctx.shape[1] + (0 if k_buf is None else k_buf.shape[2])
    per_sample = max(1, heads_q * seqlen_q * n_keys, 2 * heads_kv * n_keys * head_dim)
    chunk = max(1, max_elements // per_sample)
    k_ctx, v_ctx = k_ctx.to(dtype), v_ctx.to(dtype)  # once, not per chunk
    outs, lses = [], []
    for b0 in range(0, batch, chunk):
        b1 = min(batch, b0 + chunk)
        kb = None if k_buf is None else k_buf[b0:b1].to(dtype)
        vb = None if v_buf is None else v_buf[b0:b1].to(dtype)
        lens = None if buf_lens is None else buf_lens[b0:b1]
        o, lse = attention(q[b0:b1].to(dtype), k_ctx, v_ctx, kb, vb, lens, causal, scale)
        outs.append(o)
        lses.append(lse)
    return {"o": torch.cat(outs), "lse": torch.cat(lses)}
