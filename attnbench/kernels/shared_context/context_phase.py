"""The context phase: a tile's rows over one split's chunk of the shared context K/V.

It continues an online softmax from whatever state the rows start with (a buffer state, or
nothing): the merge of buffer and context is the online softmax itself. Full key blocks load
without a length mask; only the context's ragged end is masked.
"""
import triton
import triton.language as tl


@triton.jit
def _load_context_block(ptrs, offs_n, offs_d, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=(offs_n[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)  # a full block and no head-dim padding: no mask at all
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d, N_CTX,
                          qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                          MASKED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_context_block(KC_head + offs_n[:, None] * stride_kcn + offs_d[None, :], offs_n, offs_d, N_CTX,
                            HEAD_DIM, BLOCK_D, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if MASKED:
        s = tl.where(offs_n[None, :] < N_CTX, s, float("-inf"))
    # the scale is applied inside the exponent's FMA (and to the row max, which it commutes with:
    # it is positive), not as a multiply of its own per score: one instruction less per element
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_context_block(VC_head + offs_n[:, None] * stride_vcn + offs_d[None, :], offs_n, offs_d, N_CTX,
                            HEAD_DIM, BLOCK_D, MASKED)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, l_i, m_new


@triton.jit
def _context_phase(acc, l_i, m_i, q, KC, VC, split, hk, stride_kch, stride_kcn, stride_vch, stride_vcn,
                   N_CTX, NUM_SPLITS, qk_scale_log2, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Continue the online softmax of the tile's rows over this split's chunk of the context."""
    per_split = tl.cdiv(tl.cdiv(N_CTX, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, N_CTX)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # blocks that need no length mask
    KC_head = KC + hk.to(tl.int64) * stride_kch
    VC_head = VC + hk.to(tl.int64) * stride_vch
    for n0 in range(lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d,
                                              N_CTX, qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, False, ACC_DTYPE,
                                              DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):  # at most one: the context's ragged end
        acc, l_i, m_i = _attend_context_block(acc, l_i, m_i, q, KC_head, VC_head, stride_kcn, stride_vcn, n0, offs_d,
                                              N_CTX, qk_scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, True, ACC_DTYPE,
                                              DOT_PRECISION)
    return acc, l_i, m_i
