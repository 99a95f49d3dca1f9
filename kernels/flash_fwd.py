"""FlashAttention-2 forward: O = softmax(scale * Q K^T + mask) V and the row logsumexp L.

Layout [B, H, N, D] with the last dimension contiguous. One program owns BLOCK_M query rows of
one (batch, query head) and streams the key/value blocks of its KV head (GQA: query head h reads
KV head h // group), keeping the running max m, sum l and unnormalized accumulator in registers.

Key blocks are visited in two phases: blocks every row of the tile may see in full (no mask
arithmetic at all), then the blocks that touch the causal diagonal or the end of the keys.
Scores are kept in base 2 (scale * log2 e folded into one multiply) so the exponentials are exp2.
A row that sees no key at all (bottom-right causal with Nq > Nk) gets O = 0 and L = -inf; a
non-finite input gives NaN, never that pair (softmax_rows.finish_rows).
"""
import triton
import triton.language as tl

from .outputs import new_output
from .precision import accumulator_dtype, dot_precision, lse_dtype, softmax_scale_log2, split_scale
from .softmax_rows import finish_rows
from .tiling import query_tile, visible_keys
from .tuning import autotune, cdiv, cfg, config_list, next_pow2, pruner, seq_bucket


@triton.jit
def _attend_key_block(acc, l_i, m_i, q, K_head, V_head, stride_kn, stride_vn, n0, offs_m, offs_d,
                      N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    else:
        kv_mask = offs_d[None, :] < HEAD_DIM  # only the head-dim padding
    k = tl.load(K_head + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE) * qk_scale_log2
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
    return acc, l_i, m_new


def _fwd_shared_bytes(config, element_size, block_d):
    kw = config.kwargs
    return (kw["BLOCK_M"] * block_d + config.num_stages * 2 * kw["BLOCK_N"] * block_d) * element_size


_FWD_CONFIGS = config_list(
    [
        cfg(4, 3, BLOCK_M=128, BLOCK_N=64),
        cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
        cfg(8, 3, BLOCK_M=128, BLOCK_N=64),
        cfg(4, 4, BLOCK_M=64, BLOCK_N=64),
        cfg(4, 2, BLOCK_M=64, BLOCK_N=32),
    ],
    cfg(1, 1, BLOCK_M=16, BLOCK_N=16),
)


@autotune(_FWD_CONFIGS, key=["SEQ_BUCKET", "BLOCK_D", "CAUSAL"],
                 prune_configs_by={"early_config_prune": pruner(_fwd_shared_bytes)})
@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                     N_Q, N_K, HEAD_DIM, H_Q, GROUP, causal_offset, scale_hi, scale_lo, SEQ_BUCKET,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, b, h, hk = query_tile(GROUP, CAUSAL)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    K_head = K + b * stride_kb + hk * stride_kh
    V_head = V + b * stride_vb + hk * stride_vh

    qk_scale_log2 = softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC_DTYPE)

    full_hi, hi = visible_keys(m0, N_K, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_key_block(acc, l_i, m_i, q, K_head, V_head, stride_kn, stride_vn, n0,
                                          offs_m, offs_d, N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                                          BLOCK_N, BLOCK_D, False, CAUSAL, ACC_DTYPE, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attend_key_block(acc, l_i, m_i, q, K_head, V_head, stride_kn, stride_vn, n0,
                                          offs_m, offs_d, N_K, HEAD_DIM, causal_offset, qk_scale_log2,
                                          BLOCK_N, BLOCK_D, True, CAUSAL, ACC_DTYPE, DOT_PRECISION)

    o, lse, _ = finish_rows(acc, l_i, m_i, offs_m, causal_offset, CAUSAL, ACC_DTYPE)
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + (b * H_Q + h) * N_Q + offs_m, lse.to(LSE.dtype.element_ty), mask=offs_m < N_Q)


def flash_fwd_launch(q, k, v, sm_scale: float, causal_offset):
    """Run the forward kernel on checked inputs. ``causal_offset`` None means no mask, otherwise
    query row i sees keys j <= i + causal_offset. Returns (o, lse) with lse of shape [B, Hq, Nq]."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    o = new_output(q.shape, q.dtype, q.device)
    lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)

    def grid(meta):
        return (cdiv(n_q, meta["BLOCK_M"]), heads_q, batch)

    flash_fwd_kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        n_q, n_k, head_dim, heads_q, heads_q // heads_kv,
        0 if causal_offset is None else int(causal_offset), *split_scale(sm_scale), seq_bucket(max(n_q, n_k)),
        BLOCK_D=max(16, next_pow2(head_dim)), CAUSAL=causal_offset is not None,
        ACC_DTYPE=accumulator_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
    )
    return o, lse
