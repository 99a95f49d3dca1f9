"""The tangent of the FA2 backward: how (dQ, dK, dV) move when (Q, K, V) move by (Q_t, K_t, V_t)
and the output cotangents (dO, dLSE) by (dO_t, dLSE_t). It is the kernel behind every
second-order route: forward-over-reverse (the jvp of the backward), reverse-over-reverse (the
vjp of the backward is this tangent at dO_t = 0, the Hessian being symmetric) and the gradient
of a tangent output.

Per head, with P = exp(S - LSE), P_t = P * (S_t - mu) (mu = LSE_t, from the forward's tangent),
dP = dO V^T, delta = rowsum(dO * O) - dLSE and its tangent delta_t = rowsum(dO_t * O + dO * O_t) - dLSE_t
(both from row_dot.py):
    dS    = P * (dP - delta)
    dP_t  = dO_t V^T + dO V_t^T
    dS_t  = P_t * (dP - delta) + P * (dP_t - delta_t)
    dV_t  = P_t^T dO + P^T dO_t
    dQ_t  = s (dS_t K + dS K_t)
    dK_t  = s (dS_t^T Q + dS^T Q_t)
Two launches like the FA2 backward, no atomics, bitwise deterministic: a dK_t/dV_t pass (one
program per key block, walking the query blocks of its GQA group: 10 matmul units when every
tangent is present) and a dQ_t pass (one program per query block: 8 units). Absent tangents drop
their matmuls at compile time (a Hessian-vector product has dO_t = 0: 8 + 7 units).
Masking follows flash_bwd.py: query rows past N_Q read LSE = +inf (P = 0); keys past N_K load as
zeros, and the dQ_t pass masks their P in its last key block (exp2(0 - LSE) overflows for rows
whose LSE is below -88).
"""
import triton
import triton.language as tl

from ..outputs import new_output
from ..precision import accumulator_dtype, dot_precision, softmax_scale, softmax_scale_log2, split_scale
from .key_block import key_block_mask
from .softmax_rows import blind_rows, load_lse_log2
from ..launch import planned
from ..tuning import autotune, cdiv, cfg, configs, config_list, next_pow2, pruner, seq_bucket
from ..tiling import aligned, aligned_rows, query_tile, row_strides, stride_align, visible_keys


@triton.jit
def _dkdv_t_query_block(dk_t, dv_t, k, v, tk, tv, Q_head, DO_head, TQ_head, TDO_head, LSE_head, MU_head,
                        DELTA_head, TDELTA_head, stride_qn, stride_don, stride_tqn, stride_tdon,
                        m0, offs_n, offs_d, N_Q, HEAD_DIM, causal_offset, qk_scale_log2, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                        HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TDO: tl.constexpr,
                        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    # a row that sees no key (MASKED blocks only) adds nothing, but its query and query tangent, whatever they hold,
    # would reach dK_t and dV_t through the score tangent and dS^T Q (0 * NaN = NaN): they are read as 0
    sighted = row_mask & ~blind_rows(offs_m, causal_offset, MASKED)[:, None]
    q = tl.load(Q_head + offs_m[:, None] * stride_qn + offs_d[None, :], mask=sighted, other=0.0)
    do = tl.load(DO_head + offs_m[:, None] * stride_don + offs_d[None, :], mask=row_mask, other=0.0)
    lse_log2 = load_lse_log2(LSE_head, offs_m, N_Q)
    mu = tl.load(MU_head + offs_m, mask=offs_m < N_Q, other=0.0).to(ACC_DTYPE)
    delta = tl.load(DELTA_head + offs_m, mask=offs_m < N_Q, other=0.0)
    delta_t = tl.load(TDELTA_head + offs_m, mask=offs_m < N_Q, other=0.0)
    # Transposed tiles ([keys, queries]) so dK_t and dV_t come out of the dots without a transpose.
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
    p_t = tl.math.exp2(s_t - lse_log2[None, :])
    if MASKED:
        p_t = tl.where(offs_m[None, :] + causal_offset >= offs_n[:, None], p_t, 0.0)
    st_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC_DTYPE)  # the score tangent, transposed
    if HAS_TK:
        st_t += tl.dot(tk, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TQ:
        tq = tl.load(TQ_head + offs_m[:, None] * stride_tqn + offs_d[None, :], mask=sighted, other=0.0)
        st_t += tl.dot(k, tl.trans(tq), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    pdot_t = p_t * (st_t * scale - mu[None, :])  # P_t, transposed
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    dpdot_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC_DTYPE)  # dP_t, transposed
    if HAS_TV:
        dpdot_t += tl.dot(tv, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TDO:
        tdo = tl.load(TDO_head + offs_m[:, None] * stride_tdon + offs_d[None, :], mask=row_mask, other=0.0)
        dpdot_t += tl.dot(v, tl.trans(tdo), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    dp_minus = dp_t - delta[None, :]
    dsdot_t = pdot_t * dp_minus + p_t * (dpdot_t - delta_t[None, :])
    dv_t += tl.dot(pdot_t.to(do.dtype), do, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TDO:
        dv_t += tl.dot(p_t.to(tdo.dtype), tdo, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    dk_t += tl.dot(dsdot_t.to(q.dtype), q, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TQ:
        ds_t = p_t * dp_minus
        dk_t += tl.dot(ds_t.to(tq.dtype), tq, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dk_t, dv_t


def _dkdv_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (4 * kw["BLOCK_N"] * block_d + config.num_stages * 4 * kw["BLOCK_M"] * block_d) * element_size


_DKDV_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (4, 2, 32, 64), (8, 2, 64, 128), (4, 3, 64, 64),
            (8, 2, 64, 64), (4, 2, 32, 128), (8, 2, 32, 128),
            (4, 2, 32, 32), (2, 1, 16, 32)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))

_FLAGS = ["SEQ_BUCKET", "BLOCK_D", "CAUSAL", "HAS_TQ", "HAS_TK", "HAS_TV", "HAS_TDO", "ALIGN"]


@autotune(_DKDV_CONFIGS, key=_FLAGS + ["GROUP"], prune_configs_by={"early_config_prune": pruner(_dkdv_shared_bytes)})
@triton.jit
def bwd_jvp_dkdv_kernel(Q, K, V, DO, TQ, TK, TV, TDO, LSE, MU, DELTA, TDELTA, DKT, DVT,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                        stride_tqb, stride_tqh, stride_tqn, stride_tkb, stride_tkh, stride_tkn,
                        stride_tvb, stride_tvh, stride_tvn, stride_tdob, stride_tdoh, stride_tdon,
                        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                        N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                        BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr,
                        HAS_TV: tl.constexpr, HAS_TDO: tl.constexpr, ACC_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    # every stride and the head dim are multiples of ALIGN (tiling.aligned: 16-byte loads at D 40 or 72)
    stride_qb, stride_qh, stride_qn = aligned_rows(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_rows(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_rows(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_rows(stride_dob, stride_doh, stride_don, ALIGN)
    stride_tqb, stride_tqh, stride_tqn = aligned_rows(stride_tqb, stride_tqh, stride_tqn, ALIGN)
    stride_tkb, stride_tkh, stride_tkn = aligned_rows(stride_tkb, stride_tkh, stride_tkn, ALIGN)
    stride_tvb, stride_tvh, stride_tvn = aligned_rows(stride_tvb, stride_tvh, stride_tvn, ALIGN)
    stride_tdob, stride_tdoh, stride_tdon = aligned_rows(stride_tdob, stride_tdoh, stride_tdon, ALIGN)
    HEAD_DIM = aligned(HEAD_DIM, ALIGN)
    stride_dkb, stride_dkh, stride_dkn = aligned_rows(stride_dkb, stride_dkh, stride_dkn, ALIGN)
    stride_dvb, stride_dvh, stride_dvn = aligned_rows(stride_dvb, stride_dvh, stride_dvn, ALIGN)
    n0 = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    kv_rows = offs_n[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + kv_rows, mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    tk = k  # placeholders: read only under their HAS_ flags
    tv = v
    if HAS_TK:
        tk = tl.load(TK + b * stride_tkb + hk * stride_tkh + offs_n[:, None] * stride_tkn + offs_d[None, :],
                     mask=kv_mask, other=0.0)
    if HAS_TV:
        tv = tl.load(TV + b * stride_tvb + hk * stride_tvh + offs_n[:, None] * stride_tvn + offs_d[None, :],
                     mask=kv_mask, other=0.0)
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    scale = softmax_scale(scale_hi, scale_lo, ACC_DTYPE)
    dk_t = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)
    dv_t = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC_DTYPE)

    # Query rows that see any of these keys start at i = n0 - causal_offset (see flash_bwd.py).
    if CAUSAL:
        lo = tl.maximum(n0 - causal_offset, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.maximum(tl.cdiv(n0 + BLOCK_N - 1 - causal_offset, BLOCK_M) * BLOCK_M, lo), N_Q)
    else:
        lo = 0
        full_lo = 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        Q_head = Q + b * stride_qb + h * stride_qh
        DO_head = DO + b * stride_dob + h * stride_doh
        TQ_head = TQ + b * stride_tqb + h * stride_tqh
        TDO_head = TDO + b * stride_tdob + h * stride_tdoh
        row0 = (b * H_Q + h) * N_Q
        for m0 in range(lo, full_lo, BLOCK_M):
            dk_t, dv_t = _dkdv_t_query_block(
                dk_t, dv_t, k, v, tk, tv, Q_head, DO_head, TQ_head, TDO_head, LSE + row0, MU + row0,
                DELTA + row0, TDELTA + row0, stride_qn, stride_don, stride_tqn, stride_tdon,
                m0, offs_n, offs_d, N_Q, HEAD_DIM, causal_offset, qk_scale_log2, scale,
                BLOCK_M, BLOCK_N, True, HAS_TQ, HAS_TK, HAS_TV, HAS_TDO, ACC_DTYPE, DOT_PRECISION)
        for m0 in range(full_lo, N_Q, BLOCK_M):
            dk_t, dv_t = _dkdv_t_query_block(
                dk_t, dv_t, k, v, tk, tv, Q_head, DO_head, TQ_head, TDO_head, LSE + row0, MU + row0,
                DELTA + row0, TDELTA + row0, stride_qn, stride_don, stride_tqn, stride_tdon,
                m0, offs_n, offs_d, N_Q, HEAD_DIM, causal_offset, qk_scale_log2, scale,
                BLOCK_M, BLOCK_N, False, HAS_TQ, HAS_TK, HAS_TV, HAS_TDO, ACC_DTYPE, DOT_PRECISION)

    dk_t = dk_t * scale
    tl.store(DKT + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk_t.to(DKT.dtype.element_ty), mask=kv_mask)
    tl.store(DVT + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv_t.to(DVT.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_t_key_block(dq_t, q, do, tq, tdo, lse_log2, mu, delta, delta_t, K_head, V_head, TK_head, TV_head,
                    stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
                    causal_offset, qk_scale_log2, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TDO: tl.constexpr,
                    ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED)
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
    p = tl.math.exp2(s - lse_log2[:, None])
    if MASKED:  # keys past N_K load K = 0, so s = 0 there and exp2(-lse) overflows for LSE < -88
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        p = tl.where(keep, p, 0.0)
    st = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    if HAS_TQ:
        st += tl.dot(tq, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TK:
        tk = tl.load(TK_head + offs_n[:, None] * stride_tkn + offs_d[None, :], mask=kv_mask, other=0.0)
        st += tl.dot(q, tl.trans(tk), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    pdot = p * (st * scale - mu[:, None])
    dp_minus = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) - delta[:, None]
    dpdot = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    if HAS_TDO:
        dpdot += tl.dot(tdo, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TV:
        tv = tl.load(TV_head + offs_n[:, None] * stride_tvn + offs_d[None, :], mask=kv_mask, other=0.0)
        dpdot += tl.dot(do, tl.trans(tv), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    dsdot = pdot * dp_minus + p * (dpdot - delta_t[:, None])
    dq_t += tl.dot(dsdot.to(k.dtype), k, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if HAS_TK:
        ds = p * dp_minus
        dq_t += tl.dot(ds.to(tk.dtype), tk, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return dq_t


def _dq_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (4 * kw["BLOCK_M"] * block_d + config.num_stages * 4 * kw["BLOCK_N"] * block_d) * element_size


_DQ_CONFIGS = config_list(
    configs("BLOCK_M BLOCK_N",
            (4, 2, 64, 32), (8, 2, 128, 64), (4, 3, 64, 64),
            (8, 2, 64, 64), (4, 2, 128, 32), (8, 2, 128, 32),
            (4, 2, 32, 32), (2, 1, 32, 16)),
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16))


@autotune(_DQ_CONFIGS, key=_FLAGS, prune_configs_by={"early_config_prune": pruner(_dq_shared_bytes)})
@triton.jit
def bwd_jvp_dq_kernel(Q, K, V, DO, TQ, TK, TV, TDO, LSE, MU, DELTA, TDELTA, DQT,
                      stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                      stride_tqb, stride_tqh, stride_tqn, stride_tkb, stride_tkh, stride_tkn,
                      stride_tvb, stride_tvh, stride_tvn, stride_tdob, stride_tdoh, stride_tdon,
                      stride_dqb, stride_dqh, stride_dqn,
                      N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                      BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr,
                      HAS_TV: tl.constexpr, HAS_TDO: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # every stride and the head dim are multiples of ALIGN (tiling.aligned: 16-byte loads at D 40 or 72)
    stride_qb, stride_qh, stride_qn = aligned_rows(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_rows(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_rows(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_rows(stride_dob, stride_doh, stride_don, ALIGN)
    stride_tqb, stride_tqh, stride_tqn = aligned_rows(stride_tqb, stride_tqh, stride_tqn, ALIGN)
    stride_tkb, stride_tkh, stride_tkn = aligned_rows(stride_tkb, stride_tkh, stride_tkn, ALIGN)
    stride_tvb, stride_tvh, stride_tvn = aligned_rows(stride_tvb, stride_tvh, stride_tvn, ALIGN)
    stride_tdob, stride_tdoh, stride_tdon = aligned_rows(stride_tdob, stride_tdoh, stride_tdon, ALIGN)
    HEAD_DIM = aligned(HEAD_DIM, ALIGN)
    stride_dqb, stride_dqh, stride_dqn = aligned_rows(stride_dqb, stride_dqh, stride_dqn, ALIGN)
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None]
    sighted = row_mask & ~blind_rows(offs_m, causal_offset, CAUSAL)[:, None]  # as in _dkdv_t_query_block
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qn + offs_d[None, :], mask=sighted, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_don + offs_d[None, :], mask=row_mask, other=0.0)
    tq = q  # placeholders: read only under their HAS_ flags
    tdo = do
    if HAS_TQ:
        tq = tl.load(TQ + b * stride_tqb + h * stride_tqh + rows * stride_tqn + offs_d[None, :], mask=sighted, other=0.0)
    if HAS_TDO:
        tdo = tl.load(TDO + b * stride_tdob + h * stride_tdoh + rows * stride_tdon + offs_d[None, :],
                      mask=row_mask, other=0.0)
    row0 = (b * H_Q + h) * N_Q
    lse_log2 = load_lse_log2(LSE + row0, offs_m, N_Q)
    mu = tl.load(MU + row0 + offs_m, mask=offs_m < N_Q, other=0.0).to(ACC_DTYPE)
    delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < N_Q, other=0.0)
    delta_t = tl.load(TDELTA + row0 + offs_m, mask=offs_m < N_Q, other=0.0)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh
    TK_head = TK + b * stride_tkb + hk * stride_tkh
    TV_head = TV + b * stride_tvb + hk * stride_tvh
    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    scale = softmax_scale(scale_hi, scale_lo, ACC_DTYPE)
    dq_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_hi, BLOCK_N):
        dq_t = _dq_t_key_block(dq_t, q, do, tq, tdo, lse_log2, mu, delta, delta_t, K_head, V_head, TK_head, TV_head,
                               stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
                               causal_offset, qk_scale_log2, scale, BLOCK_M, BLOCK_N, False, CAUSAL,
                               HAS_TQ, HAS_TK, HAS_TV, HAS_TDO, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        dq_t = _dq_t_key_block(dq_t, q, do, tq, tdo, lse_log2, mu, delta, delta_t, K_head, V_head, TK_head, TV_head,
                               stride_kn, stride_vn, stride_tkn, stride_tvn, n0, offs_m, offs_d, N_K, HEAD_DIM,
                               causal_offset, qk_scale_log2, scale, BLOCK_M, BLOCK_N, True, CAUSAL,
                               HAS_TQ, HAS_TK, HAS_TV, HAS_TDO, ACC_DTYPE, DOT_PRECISION)

    dq_t = dq_t * scale
    tl.store(DQT + b * stride_dqb + h * stride_dqh + rows * stride_dqn + offs_d[None, :],
             dq_t.to(DQT.dtype.element_ty), mask=row_mask)



def attention_bwd_jvp_launch(q, k, v, o, lse, do, tq, tk, tv, tdo, lse_t, delta, delta_t, sm_scale: float,
                             causal_offset):
    """(dQ_t, dK_t, dV_t) on checked inputs. ``lse_t`` is the forward's LSE tangent (mu), and
    ``delta``/``delta_t`` the row reductions of row_dot.py; absent tangents are None."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    dq_t = new_output(q.shape, q.dtype, q.device)
    dk_t = new_output(k.shape, k.dtype, k.device)
    dv_t = new_output(v.shape, v.dtype, v.device)
    # an absent tangent is replaced by its primal, never read (its HAS_ flag is off)
    tq_, tk_, tv_, tdo_ = (t if t is not None else p for t, p in ((tq, q), (tk, k), (tv, v), (tdo, do)))
    tensors = (q, k, v, do, tq_, tk_, tv_, tdo_, lse, lse_t, delta, delta_t)
    strides = [s for t in (q, k, v, do, tq_, tk_, tv_, tdo_) for s in row_strides(t)]
    causal = causal_offset is not None
    scalars = (n_q, n_k, head_dim, heads_q, group, int(causal_offset) if causal else 0,
               *split_scale(sm_scale), seq_bucket(max(n_q, n_k)))
    flags = dict(BLOCK_D=max(16, next_pow2(head_dim)), CAUSAL=causal, HAS_TQ=tq is not None,
                 HAS_TK=tk is not None, HAS_TV=tv is not None, HAS_TDO=tdo is not None,
                 ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
                 ALIGN=stride_align(head_dim, *strides, *(s for t in (dq_t, dk_t, dv_t) for s in row_strides(t))))
    planned(bwd_jvp_dkdv_kernel)[lambda meta: (cdiv(n_k, meta["BLOCK_N"]), heads_kv, batch)](
        *tensors, dk_t, dv_t, *strides, *row_strides(dk_t), *row_strides(dv_t), *scalars, **flags)
    planned(bwd_jvp_dq_kernel)[lambda meta: (cdiv(n_q, meta["BLOCK_M"]), heads_q, batch)](
        *tensors, dq_t, *strides, *row_strides(dq_t), *scalars, **flags)
    return dq_t, dk_t, dv_t
