"""Forward-mode attention: the tangent of O = softmax(s Q K^T + mask) V (and of its logsumexp)
in one pass over the keys, with O(N) memory.

Per query row, with S = s Q K^T, P = softmax(S), and the score tangent S_t = s (Q_t K^T + Q K_t^T):
    P_t   = P * (S_t - mu),  mu = rowsum(P * S_t)         (the softmax JVP identity)
    O_t   = P_t V + P V_t  = sum_j P_ij S_t,ij V_j - mu O + P V_t
    LSE_t = mu
Two launch forms of one kernel:
- fused (``LSE_GIVEN`` off): the online softmax keeps, beside m, l and acc = sum p V, the
  unnormalized acc_t = sum p (S_t V + V_t) and mu~ = sum p S_t, all rescaled by the same alpha;
  at the end O = acc / l, mu = mu~ / l and O_t = acc_t / l - mu O. Six matmul units per key block
  (S, the two halves of S_t, P V, (P * S_t) V, P V_t): 3x the forward's FLOPs.
- tangent only (``LSE_GIVEN`` on): O and the LSE come from a forward that already ran (autograd
  runs a Function's forward, then its jvp), so P = exp(S - LSE) directly: no running max, no
  rescaling and no P V product, five units. O_t = acc_t - mu O with the given O.
Absent tangents (Q_t, K_t or V_t None) drop their matmuls at compile time.
"""
import triton
import triton.language as tl

from ..outputs import new_output
from ..precision import (ROW_MAX_START, accumulator_dtype, dot_precision, lse_dtype, softmax_scale, softmax_scale_log2,
                         split_scale)
from .key_block import key_block_mask
from .softmax_rows import blind_rows, finish_rows, load_lse_log2
from ..tiling import aligned, aligned_rows, query_tile, row_strides, stride_align, visible_keys
from ..launch import planned
from ..tuning import autotune, cdiv, cfg, configs, config_list, next_pow2, pruner, seq_bucket


@triton.jit
def _jvp_key_block(acc, acc_t, l_i, m_i, mu_i, mu_o, q, tq, lse_log2, K_head, V_head, TK_head, TV_head,
                   stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
                   causal_offset, qk_scale_log2, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   LSE_GIVEN: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                   ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED)
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
    # Keys past N_K load as zeros, so their score tangent is 0: only S needs the mask.
    st = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    if HAS_TQ:
        st += tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TK:
        tk = tl.load(TK_head + offs_n[:, None] * stride_tkn + offs_d[None, :], mask=kv_mask, other=0.0)
        st += tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if MASKED:
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(keep, s, float("-inf"))
    if LSE_GIVEN:
        p = tl.math.exp2(s - lse_log2[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))  # m starts finite: fully masked rows keep alpha = 1, p = 0
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    v = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if not LSE_GIVEN:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        mu_i = mu_i * alpha
        mu_o = mu_o * alpha
        acc_t = acc_t * alpha[:, None]
    if HAS_TQ or HAS_TK:
        pst = p * (st * scale)
        pst_rounded = pst.to(v.dtype)  # what the tensor cores multiply (bf16/fp16; exact otherwise)
        mu_i += tl.sum(pst, 1)  # the LSE tangent: from the exact values
        # O_t = sum P S_t V - mu O must cancel exactly where it should (a row with one key has
        # O_t = V_t): its shift uses the same rounded P * S_t as the matmul, not the exact sum
        mu_o += tl.sum(pst_rounded.to(ACC_DTYPE), 1)
        acc_t += tl.dot(pst_rounded, v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TV:
        tv = tl.load(TV_head + offs_n[:, None] * stride_tvn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc_t += tl.dot(p.to(tv.dtype), tv, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, acc_t, l_i, m_i, mu_i, mu_o


def _jvp_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (2 * kw["BLOCK_M"] * block_d + config.num_stages * 4 * kw["BLOCK_N"] * block_d) * element_size


_JVP_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (8, 3, 128, 64),
            # D = 128: three stages of K, K_t, V, V_t do not fit
            (8, 2, 128, 64), (4, 3, 64, 64), (4, 2, 64, 128),
            (8, 2, 128, 32), (4, 3, 128, 64), (4, 2, 64, 32),
            (4, 1, 32, 32)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))


@autotune(_JVP_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "CAUSAL", "LSE_GIVEN", "HAS_TQ", "HAS_TK", "HAS_TV", "ALIGN"],
                 prune_configs_by={"early_config_prune": pruner(_jvp_shared_bytes)})
@triton.jit
def attention_jvp_kernel(Q, K, V, TQ, TK, TV, O, LSE, OT, LSET,
                         stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_tqb, stride_tqh, stride_tqn,
                         stride_tkb, stride_tkh, stride_tkn, stride_tvb, stride_tvh, stride_tvn,
                         stride_ob, stride_oh, stride_on, stride_otb, stride_oth, stride_otn,
                         N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                         BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, LSE_GIVEN: tl.constexpr,
                         HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                         ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # every stride and the head dim are multiples of ALIGN (tiling.aligned: 16-byte loads at D 40 or 72)
    stride_qb, stride_qh, stride_qn = aligned_rows(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_rows(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_rows(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_tqb, stride_tqh, stride_tqn = aligned_rows(stride_tqb, stride_tqh, stride_tqn, ALIGN)
    stride_tkb, stride_tkh, stride_tkn = aligned_rows(stride_tkb, stride_tkh, stride_tkn, ALIGN)
    stride_tvb, stride_tvh, stride_tvn = aligned_rows(stride_tvb, stride_tvh, stride_tvn, ALIGN)
    stride_ob, stride_oh, stride_on = aligned_rows(stride_ob, stride_oh, stride_on, ALIGN)
    stride_otb, stride_oth, stride_otn = aligned_rows(stride_otb, stride_oth, stride_otn, ALIGN)
    HEAD_DIM = aligned(HEAD_DIM, ALIGN)
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_mask, other=0.0)
    tq = q  # placeholder: read only when HAS_TQ
    if HAS_TQ:
        tq = tl.load(TQ + b * stride_tqb + h * stride_tqh + offs_m[:, None] * stride_tqn + offs_d[None, :],
                     mask=row_mask, other=0.0)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh
    TK_head = TK + b * stride_tkb + hk * stride_tkh
    TV_head = TV + b * stride_tvb + hk * stride_tvh
    LSE_head = LSE + (b * H_Q + h) * N_Q
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    scale = softmax_scale(scale_hi, scale_lo, ACC_DTYPE)

    lse_log2 = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    if LSE_GIVEN:
        lse_log2 = load_lse_log2(LSE_head, offs_m, N_Q)
    m_i = tl.full([BLOCK_M], ROW_MAX_START, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    mu_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    mu_o = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)
    acc_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_hi, BLOCK_N):
        acc, acc_t, l_i, m_i, mu_i, mu_o = _jvp_key_block(
            acc, acc_t, l_i, m_i, mu_i, mu_o, q, tq, lse_log2, K_head, V_head, TK_head, TV_head,
            stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
            causal_offset, qk_scale_log2, scale, BLOCK_M, BLOCK_N, False, CAUSAL, LSE_GIVEN,
            HAS_TQ, HAS_TK, HAS_TV, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, acc_t, l_i, m_i, mu_i, mu_o = _jvp_key_block(
            acc, acc_t, l_i, m_i, mu_i, mu_o, q, tq, lse_log2, K_head, V_head, TK_head, TV_head,
            stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
            causal_offset, qk_scale_log2, scale, BLOCK_M, BLOCK_N, True, CAUSAL, LSE_GIVEN,
            HAS_TQ, HAS_TK, HAS_TV, ACC_DTYPE, DOT_PRECISION)

    o_ptrs = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    row = (b * H_Q + h) * N_Q + offs_m
    if LSE_GIVEN:
        # Blind rows read LSE = +inf, so p = 0 there: mu = 0 and acc_t = 0, and O = 0 is given.
        o = tl.load(O + o_ptrs, mask=row_mask, other=0.0).to(ACC_DTYPE)
        mu = mu_i
        o_t = acc_t - mu_o[:, None] * o
    else:
        o, lse, inv_l = finish_rows(acc, l_i, m_i, offs_m, causal_offset, CAUSAL, ACC_DTYPE)
        mu = mu_i * inv_l
        o_t = acc_t * inv_l[:, None] - (mu_o * inv_l)[:, None] * o
        tl.store(O + o_ptrs, o.to(O.dtype.element_ty), mask=row_mask)
        tl.store(LSE + row, lse.to(LSE.dtype.element_ty), mask=offs_m < N_Q)
    # rows the mask leaves without keys have zero tangents, whatever their query or tangent holds
    # (p = 0 there, but 0 * NaN would not be)
    blind = blind_rows(offs_m, causal_offset, CAUSAL)
    mu = tl.where(blind, 0.0, mu)
    o_t = tl.where(blind[:, None], 0.0, o_t)
    ot_ptrs = OT + b * stride_otb + h * stride_oth + offs_m[:, None] * stride_otn + offs_d[None, :]
    tl.store(ot_ptrs, o_t.to(OT.dtype.element_ty), mask=row_mask)
    tl.store(LSET + row, mu.to(LSET.dtype.element_ty), mask=offs_m < N_Q)



def attention_jvp_launch(q, k, v, tq, tk, tv, sm_scale: float, causal_offset, o=None, lse=None):
    """Tangents of attention on checked inputs (tangents may be None: zero). Without ``o`` and
    ``lse`` runs the fused form and returns (o, lse, o_t, lse_t); given the forward's ``o`` and
    ``lse`` runs the tangent-only form and returns (o_t, lse_t)."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    lse_given = o is not None
    if not lse_given:
        o = new_output(q.shape, q.dtype, q.device)
        lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    o_t = new_output(q.shape, q.dtype, q.device)
    lse_t = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    # an absent tangent is replaced by its primal, never read (its HAS_ flag is off)
    tq_, tk_, tv_ = (t if t is not None else p for t, p in ((tq, q), (tk, k), (tv, v)))

    def grid(meta):
        return (cdiv(n_q, meta["BLOCK_M"]), heads_q, batch)

    strides = [s for t in (q, k, v, tq_, tk_, tv_, o, o_t) for s in row_strides(t)]
    planned(attention_jvp_kernel)[grid](
        q, k, v, tq_, tk_, tv_, o, lse, o_t, lse_t, *strides, n_q, n_k, head_dim, heads_q, heads_q // heads_kv,
        0 if causal_offset is None else int(causal_offset), *split_scale(sm_scale), seq_bucket(max(n_q, n_k)),
        BLOCK_D=max(16, next_pow2(head_dim)), CAUSAL=causal_offset is not None, LSE_GIVEN=lse_given,
        HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
        ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        ALIGN=stride_align(head_dim, *strides),
    )
    return (o_t, lse_t) if lse_given else (o, lse, o_t, lse_t)
