"""FlashAttention-2 written out in PyTorch: the algorithm, step by step, with no autograd inside.

The forward streams key blocks with the online softmax (running max m, sum l, unnormalized
accumulator) and returns (O, LSE); the backward is Algorithm 4: delta = rowsum(dO * O), P
recomputed from the saved LSE, then dV, dP, dS, dQ, dK per key block. Low-precision inputs are
computed in float32 per tile, float64 in float64. GQA is a broadcast over a group axis
([B, Hkv, G, N, D]) rather than a copy of K and V.
"""
import torch

from ...attention.spec import causal_mask

BLOCK_N = 256


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped(t, heads_kv):
    """[B, Hq, N, X...] -> [B, Hkv, G, N, X...] view."""
    return t.unflatten(1, (heads_kv, t.shape[1] // heads_kv))


def key_blocks(seqlen_q, seqlen_k, offset, block_n):
    """Key block starts that any query row can see (blocks wholly above the diagonal are skipped)."""
    last_visible = seqlen_k if offset is None else min(seqlen_k, seqlen_q + offset)
    return range(0, max(0, last_visible), block_n)


def visible_blocks(seqlen_q, seqlen_k, offset, block_n, device):
    """(n0, n1, visible) per key block [n0, n1) that any query row can see: ``visible`` the block's
    [Nq, n1 - n0] columns of the causal mask, None when nothing is masked."""
    mask = causal_mask(seqlen_q, seqlen_k, offset, device)
    for n0 in key_blocks(seqlen_q, seqlen_k, offset, block_n):
        n1 = min(seqlen_k, n0 + block_n)
        yield n0, n1, None if mask is None else mask[:, n0:n1]


def key_block(t, n0, n1, cdt):
    """Keys n0..n1 of a [B, Hkv, Nk, X] tensor as [B, Hkv, 1, n1 - n0, X] in ``cdt`` (a broadcast over the
    group axis); None stays None (an absent tangent)."""
    return None if t is None else t[:, :, n0:n1].to(cdt).unsqueeze(2)


def masked_scores(qg, kb, scale, visible):
    s = scale * (qg @ kb.transpose(-1, -2))
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def online_softmax_step(m, s):
    """One key block of the online softmax: the new running max, the block's unnormalized P and the factor
    alpha that rescales what was accumulated under the old max."""
    m_new = torch.maximum(m, s.amax(dim=-1))
    return m_new, torch.exp(s - m_new.unsqueeze(-1)), torch.exp(m - m_new)


def saved_lse(lse, heads_kv, cdt):
    """The forward's LSE as [B, Hkv, G, Nq, 1] in ``cdt``. A row that saw no key has LSE = -inf; read it as
    +inf so that its P = exp(S - LSE) is 0, not NaN."""
    lse_g = grouped(lse.to(cdt), heads_kv).unsqueeze(-1)
    return torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)


def gradient_buffers(qg, k, v, cdt):
    """Zeroed accumulators for the gradients (or their tangents) of q (grouped, like ``qg``), k and v."""
    return (torch.zeros_like(qg), torch.zeros(k.shape, dtype=cdt, device=k.device),
            torch.zeros(v.shape, dtype=cdt, device=v.device))


def flash_fwd(q, k, v, scale: float, offset, block_n: int = BLOCK_N):
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    cdt = compute_dtype(q.dtype)
    qg = grouped(q.to(cdt), heads_kv)
    shape = qg.shape[:-1]
    # Finite start: a row whose keys are all masked so far keeps alpha = 1 and p = 0, not NaN.
    m = torch.full(shape, torch.finfo(cdt).min, dtype=cdt, device=q.device)
    l = torch.zeros(shape, dtype=cdt, device=q.device)
    acc = torch.zeros(qg.shape, dtype=cdt, device=q.device)
    for n0, n1, visible in visible_blocks(seqlen_q, seqlen_k, offset, block_n, q.device):
        kb, vb = (key_block(t, n0, n1, cdt) for t in (k, v))
        m_new, p, alpha = online_softmax_step(m, masked_scores(qg, kb, scale, visible))
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + p @ vb
        m = m_new
    o, lse, _ = finish_rows(acc, l, m, offset)
    return o.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(lse_dtype(q.dtype))


def lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def finish_rows(acc, l, m, offset):
    """(O, LSE, 1/l) of online-softmax rows ([..., Nq, D] acc, [..., Nq] l and m), by the kernels'
    rule (attnbench/kernels/attention/softmax_rows.py): rows the mask leaves without keys give (0, -inf, 0); a zero or
    NaN sum on any other row (a non-finite input) gives NaN, never that pair."""
    rows = torch.arange(l.shape[-1], device=l.device)
    blind = rows + offset < 0 if offset is not None else torch.zeros_like(rows, dtype=torch.bool)
    l_safe = torch.where(blind, torch.ones_like(l), l)
    inv_l = torch.where(blind, torch.zeros_like(l), 1.0 / l_safe)
    lse = torch.where(blind, torch.full_like(l, float("-inf")),
                      torch.where(l > 0, m + torch.log(l_safe), torch.full_like(l, float("nan"))))
    inv_l = torch.where(blind | (l > 0), inv_l, torch.full_like(l, float("nan")))
    return acc * inv_l.unsqueeze(-1), lse, inv_l


def flash_bwd(do, q, k, v, o, lse, scale: float, offset, block_n: int = BLOCK_N):
    heads_kv, seqlen_q, seqlen_k = k.shape[1], q.shape[2], k.shape[2]
    cdt = compute_dtype(q.dtype)
    qg = grouped(q.to(cdt), heads_kv)
    dog = grouped(do.to(cdt), heads_kv)
    delta = (dog * grouped(o.to(cdt), heads_kv)).sum(dim=-1, keepdim=True)
    lse_g = saved_lse(lse, heads_kv, cdt)
    dq, dk, dv = gradient_buffers(qg, k, v, cdt)
    for n0, n1, visible in visible_blocks(seqlen_q, seqlen_k, offset, block_n, q.device):
        kb, vb = (key_block(t, n0, n1, cdt) for t in (k, v))
        p = torch.exp(masked_scores(qg, kb, scale, visible) - lse_g)
        dv[:, :, n0:n1] = (p.transpose(-1, -2) @ dog).sum(dim=2)
        dp = dog @ vb.transpose(-1, -2)
        ds = p * (dp - delta)
        dq += scale * (ds @ kb)
        dk[:, :, n0:n1] = scale * (ds.transpose(-1, -2) @ qg).sum(dim=2)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
