"""Eager attention: the oracle. Plain torch ops, autograd for the gradients, any dtype and device.

It never imports Triton. Run in float64 it is the truth every other variant is measured against;
run in a low dtype it is the "what plain PyTorch gets in this dtype" bar of the 2x rule.
"""
import torch

from ...attention.spec import causal_mask
from ...softmax import softmax_and_lse


def attention(q, k, v, scale: float, causal_offset):
    """O and LSE of softmax(scale Q K^T + mask) V on [B, H, N, D] tensors (GQA by repeating K/V).

    Rows that see no key give O = 0 and LSE = -inf, and their gradients are 0, not NaN
    (softmax.softmax_and_lse, which also says why the softmax subtracts the row max, not LSE).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    visible = causal_mask(q.shape[2], k.shape[2], causal_offset, q.device)
    if visible is None:
        p, lse = softmax_and_lse(s)
        return p @ v, lse
    s = s.masked_fill(~visible, float("-inf"))
    blind_rows = ~visible.any(dim=-1)  # [Nq]: rows that see nothing
    p, lse = softmax_and_lse(s, blind_rows)
    return p @ v, lse


def evaluate(q, k, v, do, scale: float, causal_offset, dtype: torch.dtype, max_scores: int = 1 << 26):
    """Every flash output (o, lse, dq, dk, dv) from the eager reference computed in ``dtype``.

    Works through (batch, KV-head) slices, and through query-row chunks when one KV head's scores
    alone exceed ``max_scores`` (dK and dV then sum the chunks' shares), so that the float64 oracle
    of a long sequence never holds more than ``max_scores`` score entries (plus autograd's copies)
    at once: at N = 32K with 4 query heads a KV head, one head's scores are 32 GB in float64.
    """
    batch, heads_q, n_q, _ = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    kv_per_chunk = max(1, max_scores // max(1, group * n_q * n_k))
    rows_per_chunk = max(1, min(n_q, max_scores // max(1, group * n_k)))
    outs = {name: [] for name in ("o", "lse", "dq", "dk", "dv")}
    for b in range(batch):
        row = {name: [] for name in outs}
        for h0 in range(0, heads_kv, kv_per_chunk):
            h1 = min(heads_kv, h0 + kv_per_chunk)
            ks, vs = (t[b:b + 1, h0:h1].to(dtype) for t in (k, v))
            parts = {name: [] for name in ("o", "lse", "dq")}
            dk, dv = torch.zeros_like(ks), torch.zeros_like(vs)
            for r0 in range(0, n_q, rows_per_chunk):
                # rows [r0, r1) are rows [0, r1 - r0) of a chunk whose row i sees keys j <= i + offset + r0
                r1 = min(n_q, r0 + rows_per_chunk)
                offset = None if causal_offset is None else causal_offset + r0
                qs, dos = (t[b:b + 1, h0 * group:h1 * group, r0:r1].to(dtype) for t in (q, do))
                with torch.enable_grad():
                    qs, kc, vc = (t.detach().requires_grad_() for t in (qs, ks, vs))
                    o, lse = attention(qs, kc, vc, scale, offset)
                    dq, dk_part, dv_part = torch.autograd.grad(o, (qs, kc, vc), dos)
                for name, t in zip(parts, (o, lse, dq)):
                    parts[name].append(t.detach())
                dk += dk_part
                dv += dv_part
            for name, chunks in parts.items():  # query-row chunks side by side
                row[name].append(torch.cat(chunks, dim=2))
            row["dk"].append(dk)
            row["dv"].append(dv)
        for name in outs:
            outs[name].append(torch.cat(row[name], dim=1))
    return {name: torch.cat(parts, dim=0) for name, parts in outs.items()}
