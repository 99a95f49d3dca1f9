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
def attend_key_block(acc, acc2, l_i, m_i, q, q2, K_head, V_head, stride_kn, stride_vn, n0, offs_m, offs_d, offs_d2,
                     N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                     BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr,
                     MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """One step of the online softmax: rows ``offs_m`` (the query index each row is masked by)
    over keys [n0, n0 + BLOCK_N). MASKED applies the key-length and causal masks (row i sees key
    j <= i + causal_offset); unmasked blocks skip that arithmetic."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = key_block_mask(offs_n, offs_d, N_K, HEAD_DIM, MASKED)
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        kv_mask2 = key_block_mask(offs_n, offs_d2, N_K, HEAD_DIM, MASKED)
        k2 = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    s = s * qk_scale_log2
    if MASKED:
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(keep, s, float("-inf"))
    # m starts finite (see the caller), so a row whose keys are all masked so far keeps
    # alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    if BLOCK_D2 > 0:
        v2 = tl.load(V_head + offs_n[:, None] * stride_vn + offs_d2[None, :], mask=kv_mask2, other=0.0)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
    return acc, acc2, l_i, m_new
