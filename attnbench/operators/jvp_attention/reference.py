"""Eager attention with every derivative through PyTorch's own AD: the oracle of jvp_attention.

The function is flash's eager reference (O and LSE, rows that see no key give O = 0 and
LSE = -inf), differentiated along the routes of routes.py. It never imports Triton. ``evaluate``
runs it in any dtype (float64: the truth) through (batch, KV-head) slices so that the oracle of a
long sequence stays within memory.
"""
import torch

from ..flash.reference import attention
from . import routes

Q_INPUTS = ("q", "do", "tq")
KV_INPUTS = ("k", "v", "tk", "tv")


def forward(scale, offset):
    """f(q, k, v) -> (o, lse) of the eager reference."""
    return lambda q, k, v: attention(q, k, v, scale, offset)


def evaluate(mode, x, scale, offset, dtype, max_scores: int = 1 << 25):
    """Every output of ``mode`` from the eager reference computed in ``dtype``, slice by slice:
    at most ``max_scores`` score entries (times AD's copies) are alive at once."""
    batch, heads_q, n_q, _ = x["q"].shape
    heads_kv, n_k = x["k"].shape[1], x["k"].shape[2]
    group = heads_q // heads_kv
    kv_per_chunk = max(1, max_scores // max(1, group * n_q * n_k))
    f = forward(scale, offset)
    rows = []
    for b in range(batch):
        parts = []
        for h0 in range(0, heads_kv, kv_per_chunk):
            h1 = min(heads_kv, h0 + kv_per_chunk)
            xs = {n: x[n][b:b + 1, h0 * group:h1 * group].to(dtype) for n in Q_INPUTS}
            xs.update({n: x[n][b:b + 1, h0:h1].to(dtype) for n in KV_INPUTS})
            parts.append({n: t.detach() for n, t in routes.run(mode, f, xs).items()})
        rows.append({n: torch.cat([p[n] for p in parts], dim=1) for n in parts[0]})
    return {n: torch.cat([r[n] for r in rows], dim=0) for n in rows[0]}
