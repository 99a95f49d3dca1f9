"""The forward's key-block step, shared by the query-tile forward (flash_fwd.py) and the
split-KV forward (flash_decode.py). Scores are kept in base 2 (scale * log2 e folded into one
multiply) so the exponentials are exp2.

The head dimension may be tiled in two power-of-two column blocks (tuning.head_dim_blocks:
96 = 64 + 32): ``q``/``acc`` hold columns ``offs_d`` and, when BLOCK_D2 > 0, ``q2``/``acc2`` the
columns ``offs_d2``; the scores sum both blocks' products. With one block the second-block
arguments are placeholders (the first block's), returned untouched."""
import triton
import triton.language as tl


@triton.jit
def head_columns(offs_d, HEAD_DIM):
    """The columns of a head-dim block inside the head (the padding of the last block is not)."""
    return offs_d < HEAD_DIM


@triton.jit
def key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED: tl.constexpr):
    """The load mask of a [keys, head-dim block] tile: past N_K only in MASKED (the last) blocks."""
    if MASKED:
        return (offs_n[:, None] < N_K) & head_columns(offs_d, HEAD_DIM)[None, :]
    else:
        return head_columns(offs_d, HEAD_DIM)[None, :]


@triton.jit
def key_weights(s, m_i, l_i, offs_n, offs_m, N_K, causal_offset, qk_scale_log2,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax's update for one block of raw scores ``s`` [rows, keys]: (p, alpha, l, m)
    with p = exp2(scale * s - m_new) in log2 units, alpha the rescale of what was accumulated before.
    MASKED applies the key-length and causal masks (row i sees key j <= i + causal_offset). The row
    max is taken on the raw scores and scaled (the scale is positive: spec.check_scale), so each
    score costs one fused multiply-add before its exponential instead of a multiply and an add
    (docs/measurements/flash.md)."""
    if MASKED:
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(keep, s, float("-inf"))
    # m starts finite (see the callers), so a row whose keys are all masked so far keeps
    # alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn, n0, offs_m, offs_d, offs_d2,
                     N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                     BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr,
                     MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """One step of the online softmax: rows ``offs_m`` (the query index each row is masked by)
    over keys [n0, n0 + BLOCK_N), loaded through pointers. MASKED applies the key-length and causal
    masks; unmasked blocks skip that arithmetic."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED)
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        kv_mask2 = key_block_mask(offs_n, offs_d2, N_K, HEAD_DIM, MASKED)
        k2 = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    p, alpha, l_i, m_new = key_weights(s, m_i, l_i, offs_n, offs_m, N_K, causal_offset, qk_scale_log2, MASKED, CAUSAL)
    v = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        v2 = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, acc2, l_i, m_new


@triton.jit
def attend_key_block_tma(acc, acc2, l_i, m_i, q, q2, k_desc, v_desc, k_desc2, v_desc2, n0, offs_m,
                         N_K, causal_offset, qk_scale_log2,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """``attend_key_block`` with K and V read through tensor descriptors of one head's [N_K, D]
    (TMA on Hopper): the copy engine zero-fills keys past N_K and columns past D, so only the
    scores need masks. ``k_desc2``/``v_desc2`` give the second column block (placeholders without)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = k_desc.load([n0, 0])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        k2 = k_desc2.load([n0, BLOCK_D])
        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    p, alpha, l_i, m_new = key_weights(s, m_i, l_i, offs_n, offs_m, N_K, causal_offset, qk_scale_log2, MASKED, CAUSAL)
    v = v_desc.load([n0, 0])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        v2 = v_desc2.load([n0, BLOCK_D])
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, acc2, l_i, m_new
