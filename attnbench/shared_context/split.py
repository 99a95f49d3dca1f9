"""The seed's split-PyTorch shared-context attention: two partial attentions and an exact merge.

1. Context: one einsum against the shared [Hkv, Nctx, D] keys, never expanded to the batch
   (torch folds the batch, query heads of a GQA group and query rows into the rows of one
   batched matmul per KV head, which is what makes it cheap).
2. Buffer: a batched matmul per sample against its own keys, masked by its valid length (and
   causally inside the buffer).
3. Combine: each part becomes a state (O, LSE) and ``attnbench.merge.merge_states`` merges them:
   the seed's online-softmax combine, with rows that see no key giving O = 0 and LSE = -inf
   rather than the seed's clamps.

Low-precision inputs are computed in float32 (scores rounded to bf16 would cost ~1e-2 of
accuracy), float64 in float64. No autograd inside, no Triton.
"""
import torch

from ..merge import merge_states
from .spec import buffer_visibility, check_inputs


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _state(s, v_like_einsum):
    """(O, LSE in float64) from masked scores s [..., N] and a function p -> p @ V; -inf rows give (0, -inf). A NaN score
    makes the sum NaN, and O and LSE stay NaN (never the (0, -inf) of a row that saw no key, which the merge
    would drop)."""
    top = s.amax(dim=-1, keepdim=True)
    seen = torch.isfinite(top)
    top = torch.where(seen, top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(dim=-1, keepdim=True)
    empty = total == 0
    total_safe = torch.where(empty, torch.ones_like(total), total)
    o = v_like_einsum(p) / total_safe
    # the LSE in float64, as the kernels' states (kernels/precision.STATE_LSE_DTYPE says why): the merge then runs
    # in float64
    lse = torch.where(empty, -torch.inf, top.double() + torch.log(total_safe).double())
    return o, lse.squeeze(-1)


def shared_context_fwd(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal: bool, scale: float):
    """(O, LSE) of shared-context attention; shapes as in spec.py."""
    check_inputs(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal=causal, scale=scale, check_lengths=False)
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    cdt = _compute_dtype(q.dtype)
    qg = q.to(cdt).unflatten(1, (heads_kv, heads_q // heads_kv))  # [B, Hkv, G, Lq, D]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    empty = (torch.zeros(qg.shape, dtype=cdt, device=q.device),
             torch.full(qg.shape[:-1], -torch.inf, dtype=cdt, device=q.device))

    if n_ctx:
        kc, vc = k_ctx.to(cdt), v_ctx.to(cdt)
        s_ctx = torch.einsum("bkgld,knd->bkgln", qg, kc) * scale
        ctx = _state(s_ctx, lambda p: torch.einsum("bkgln,knd->bkgld", p, vc))
    else:
        ctx = empty

    if n_buf:
        kb, vb = k_buf.to(cdt).unsqueeze(2), v_buf.to(cdt).unsqueeze(2)  # [B, Hkv, 1, Nbuf, D]
        visible = buffer_visibility(buf_lens, batch, n_buf, seqlen_q, causal, q.device)  # [B, Lq, Nbuf]
        visible = visible.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, Lq, Nbuf]
        # unused slots may hold anything: kept out of p @ V, and of dQ = dS K (0 * NaN there)
        used = visible.any(dim=3).unsqueeze(-1)
        kb, vb = kb.masked_fill(~used, 0.0), vb.masked_fill(~used, 0.0)
        s_buf = (qg @ kb.transpose(-1, -2)) * scale
        s_buf = s_buf.masked_fill(~visible, float("-inf"))
        buf = _state(s_buf, lambda p: p @ vb)
    else:
        buf = empty

    o, lse = merge_states(ctx[0], ctx[1], buf[0], buf[1])
    return o.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(lse_dtype)
