"""jvp_attention written out in PyTorch: the explicit formulas, no autograd inside.

Per head, S = s Q K^T (+ mask), P = softmax(S), the score tangent S_t = s (Q_t K^T + Q K_t^T):

- the softmax JVP identity: P_t = P * (S_t - mu), mu = rowsum(P * S_t) = LSE_t;
- the output tangent O_t = P_t V + P V_t, streamed over key blocks beside flash's online softmax:
  acc_t = sum p (S_t V + V_t) and mu~ = sum p S_t rescale with the same alpha as acc and l;
- the tangent of the FA2 backward (dP = dO V^T, delta = rowsum(dO * O) - dLSE):
      dP_t = dO_t V^T + dO V_t^T,  delta_t = rowsum(dO_t * O + dO * O_t) - dLSE_t
      dS   = P * (dP - delta),     dS_t    = P_t * (dP - delta) + P * (dP_t - delta_t)
      dQ_t = s (dS_t K + dS K_t),  dK_t    = s (dS_t^T Q + dS^T Q_t),  dV_t = P_t^T dO + P^T dO_t;
- HVP_Q, HVP_K, HVP_V: the Hessian of <dO, O> applied to u = (u_q, u_k, u_v) is that tangent
  along u with dO_t = 0 (the Hessian is symmetric, so both HVP routes are this one formula);
- the gradient of a tangent output <c, O_t>: in x the backward's tangent at dO = c, in x_t the
  backward itself at dO = c (O_t is linear in x_t).
Recomputed per key block from the saved LSE and mu, as the kernels do; GQA broadcasts over a
group axis. Low precision computes in float32, float64 in float64.
"""
import torch

from ..flash.split import (BLOCK_N, compute_dtype, finish_rows, flash_bwd, flash_fwd, gradient_buffers, grouped,
                           key_block, lse_dtype, masked_scores, online_softmax_step, saved_lse, visible_blocks)


def _as(t, cdt):
    return None if t is None else t.to(cdt)


def _score_tangent(qg, tqg, kb, tkb, scale):
    """S_t = s (Q_t K^T + Q K_t^T) for one key block (absent tangents contribute nothing)."""
    st = torch.zeros(qg.shape[:-1] + (kb.shape[-2],), dtype=qg.dtype, device=qg.device)
    if tqg is not None:
        st = st + tqg @ kb.transpose(-1, -2)
    if tkb is not None:
        st = st + qg @ tkb.transpose(-1, -2)
    return scale * st


def attention_jvp(q, k, v, tq, tk, tv, scale: float, offset, block_n: int = BLOCK_N):
    """(o, lse, o_t, lse_t): the forward and its tangent along (tq, tk, tv) (None: zero), online."""
    heads_kv, seqlen_q, seqlen_k = k.shape[1], q.shape[2], k.shape[2]
    cdt = compute_dtype(q.dtype)
    qg, tqg = grouped(q.to(cdt), heads_kv), None if tq is None else grouped(tq.to(cdt), heads_kv)
    shape = qg.shape[:-1]
    m = torch.full(shape, torch.finfo(cdt).min, dtype=cdt, device=q.device)  # finite: fully masked rows keep p = 0
    l, mu = torch.zeros(shape, dtype=cdt, device=q.device), torch.zeros(shape, dtype=cdt, device=q.device)
    acc, acc_t = torch.zeros_like(qg), torch.zeros_like(qg)
    for n0, n1, visible in visible_blocks(seqlen_q, seqlen_k, offset, block_n, q.device):
        kb, vb, tkb = (key_block(t, n0, n1, cdt) for t in (k, v, tk))
        m_new, p, alpha = online_softmax_step(m, masked_scores(qg, kb, scale, visible))
        pst = p * _score_tangent(qg, tqg, kb, tkb, scale)
        l = l * alpha + p.sum(dim=-1)
        mu = mu * alpha + pst.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + p @ vb
        acc_t = acc_t * alpha.unsqueeze(-1) + pst @ vb
        if tv is not None:
            acc_t = acc_t + p @ key_block(tv, n0, n1, cdt)
        m = m_new
    o, lse, inv_l = finish_rows(acc, l, m, offset)
    mu = mu * inv_l
    o_t = acc_t * inv_l.unsqueeze(-1) - mu.unsqueeze(-1) * o
    rows = lse_dtype(q.dtype)
    return (o.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(rows), o_t.flatten(1, 2).to(q.dtype),
            mu.flatten(1, 2).to(rows))


def bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, tdo, o_t, lse_t, scale: float, offset, dlse=None, tdlse=None,
            block_n: int = BLOCK_N):
    """(dq_t, dk_t, dv_t): the tangent of flash_bwd(do, q, k, v, o, lse) along (tq, tk, tv, tdo, tdlse),
    given the forward's tangents (o_t, lse_t) along (tq, tk, tv)."""
    heads_kv, seqlen_q, seqlen_k = k.shape[1], q.shape[2], k.shape[2]
    cdt = compute_dtype(q.dtype)
    qg, dog, og, otg = (grouped(t.to(cdt), heads_kv) for t in (q, do, o, o_t))
    tqg = None if tq is None else grouped(tq.to(cdt), heads_kv)
    tdog = None if tdo is None else grouped(tdo.to(cdt), heads_kv)
    delta = (dog * og).sum(dim=-1, keepdim=True)
    delta_t = (dog * otg).sum(dim=-1, keepdim=True)
    if tdog is not None:
        delta_t = delta_t + (tdog * og).sum(dim=-1, keepdim=True)
    if dlse is not None:
        delta = delta - grouped(dlse.to(cdt), heads_kv).unsqueeze(-1)
    if tdlse is not None:
        delta_t = delta_t - grouped(tdlse.to(cdt), heads_kv).unsqueeze(-1)
    mu = grouped(lse_t.to(cdt), heads_kv).unsqueeze(-1)
    lse_g = saved_lse(lse, heads_kv, cdt)
    dq_t, dk_t, dv_t = gradient_buffers(qg, k, v, cdt)
    for n0, n1, visible in visible_blocks(seqlen_q, seqlen_k, offset, block_n, q.device):
        kb, vb, tkb, tvb = (key_block(t, n0, n1, cdt) for t in (k, v, tk, tv))
        p = torch.exp(masked_scores(qg, kb, scale, visible) - lse_g)
        p_t = p * (_score_tangent(qg, tqg, kb, tkb, scale) - mu)
        dp = dog @ vb.transpose(-1, -2)
        dp_t = torch.zeros_like(dp)
        if tdog is not None:
            dp_t = dp_t + tdog @ vb.transpose(-1, -2)
        if tvb is not None:
            dp_t = dp_t + dog @ tvb.transpose(-1, -2)
        ds = p * (dp - delta)
        ds_t = p_t * (dp - delta) + p * (dp_t - delta_t)
        dv_block = p_t.transpose(-1, -2) @ dog
        if tdog is not None:
            dv_block = dv_block + p.transpose(-1, -2) @ tdog
        dv_t[:, :, n0:n1] = dv_block.sum(dim=2)
        dq_t += scale * (ds_t @ kb + (0 if tkb is None else ds @ tkb))
        dk_block = ds_t.transpose(-1, -2) @ qg
        if tqg is not None:
            dk_block = dk_block + ds.transpose(-1, -2) @ tqg
        dk_t[:, :, n0:n1] = scale * dk_block.sum(dim=2)
    return dq_t.flatten(1, 2).to(q.dtype), dk_t.to(k.dtype), dv_t.to(v.dtype)


def hvp(do, q, k, v, uq, uk, uv, scale: float, offset):
    """(HVP_Q, HVP_K, HVP_V): the Hessian of <dO, attention(q, k, v)> applied to (uq, uk, uv)."""
    o, lse, o_t, lse_t = attention_jvp(q, k, v, uq, uk, uv, scale, offset)
    return bwd_jvp(do, q, k, v, o, lse, uq, uk, uv, None, o_t, lse_t, scale, offset)


def vjp_of_jvp(c, q, k, v, tq, tk, tv, scale: float, offset):
    """Gradients of <c, O_t(x, x_t)> in (q, k, v) and in (tq, tk, tv)."""
    o, lse, o_t, lse_t = attention_jvp(q, k, v, tq, tk, tv, scale, offset)
    gx = bwd_jvp(c, q, k, v, o, lse, tq, tk, tv, None, o_t, lse_t, scale, offset)
    return (*gx, *flash_bwd(c, q, k, v, o, lse, scale, offset))


__all__ = ["attention_jvp", "bwd_jvp", "flash_fwd", "hvp", "vjp_of_jvp"]
