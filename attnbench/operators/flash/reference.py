"""Eager attention: the oracle. Plain torch ops, autograd for the gradients, any dtype and device.

It never imports Triton. Run in float64 it is the truth every other variant is measured against;
run in a low dtype it is the "what plain PyTorch gets in this dtype" bar of the 2x rule.
"""
import torch

from ...attention.spec import causal_mask


def attention(q, k, v, scale: float, causal_offset):
    """O and LSE of softmax(scale Q K^T + mask) V on [B, H, N, D] tensors (GQA by repeating K/V).

    Rows that see no key give O = 0 and LSE = -inf, and their gradients are 0, not NaN: the
    logsumexp of such a row is taken over zeros and then overwritten, so no inf - inf is formed.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    visible = causal_mask(q.shape[2], k.shape[2], causal_offset, q.device)
    if visible is None:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        return p @ v, lse
    s = s.masked_fill(~visible, float("-inf"))
    blind_rows = ~visible.any(dim=-1)  # [Nq]: rows that see nothing
    lse = torch.logsumexp(s.masked_fill(blind_rows[:, None], 0.0), dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))  # exp(-inf - finite) = 0 on masked entries
    lse = lse.masked_fill(blind_rows, float("-inf"))
    return p @ v, lse


def evaluate(q, k, v, do, scale: float, causal_offset, dtype: torch.dtype, max_scores: int = 1 << 26):
    """Every flash output (o, lse, dq, dk, dv) from the eager reference computed in ``dtype``.

    Works through (batch, KV-head) slices so that the float64 oracle of a long sequence never
    holds more than ``max_scores`` score entries (plus autograd's copies) at once.
    """
    batch, heads_q, n_q, _ = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    kv_per_chunk = max(1, max_scores // max(1, group * n_q * n_k))
    outs = {name: [] for name in ("o", "lse", "dq", "dk", "dv")}
    for b in range(batch):
        row = {name: [] for name in outs}
        for h0 in range(0, heads_kv, kv_per_chunk):
            h1 = min(heads_kv, h0 + kv_per_chunk)
            qs, dos = (t[b:b + 1, h0 * group:h1 * group].to(dtype) for t in (q, do))
            ks, vs = (t[b:b + 1, h0:h1].to(dtype) for t in (k, v))
            with torch.enable_grad():
                qs, ks, vs = (t.detach().requires_grad_() for t in (qs, ks, vs))
                o, lse = attention(qs, ks, vs, scale, causal_offset)
                dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), dos)
            for name, t in zip(outs, (o, lse, dq, dk, dv)):
                row[name].append(t.detach())
        for name in outs:
            outs[name].append(torch.cat(row[name], dim=1))
    return {name: torch.cat(parts, dim=0) for name, parts in outs.items()}
