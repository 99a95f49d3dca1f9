"""The packed rows: where each query row of a tile lives, and how a row's softmax state is written.

Row packing. For one KV head the queries of all B samples form R_TOTAL = B * G * Lq rows (G query
heads per KV head under GQA), packed sample-major: row r is sample b = r // (G Lq), query head
hk * G + (r // Lq) % G, query i = r % Lq. A program owns BLOCK_M packed rows of one KV head, so
each context K/V tile it loads serves BLOCK_M rows of many samples (the batch is folded into the
matmul, Hydragen-style): the context is read once per tile of rows, not once per sample.

Scores are kept in base 2 (scale * log2 e folded into one multiply). Rows that see no key get
O = 0 and LSE = -inf.
"""
import triton
import triton.language as tl

from ..precision import LN2


@triton.jit
def _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M: tl.constexpr):
    """(valid, sample, query head within the group, query index) of the tile's packed rows."""
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_r < R_TOTAL
    r = tl.where(valid, offs_r, 0)
    b = r // ROWS_PER_SAMPLE
    rem = r - b * ROWS_PER_SAMPLE
    g = rem // N_Q
    i = rem - g * N_Q
    return valid, b, g, i


@triton.jit
def _rows(b, h, i, stride_b, stride_h, stride_n):
    """Per-row element offsets (int64: batch x stride can pass 2**31 at decode sizes)."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + i.to(tl.int64) * stride_n


@triton.jit
def _normalized(acc, l_i, m_i):
    """(O, LSE natural log, float64: precision.STATE_LSE_DTYPE) of an online-softmax state in base 2; (0, -inf)
    where no key was seen. A NaN sum
    (a NaN input among the keys seen, or in the query) is not "no key": O and LSE stay NaN, so that the merge
    makes the row NaN instead of dropping this state as empty."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i.to(tl.float64) + tl.math.log2(l_safe).to(tl.float64)) * LN2)
    return o, lse


@triton.jit
def _store_state(O, LSE, o, lse, o_rows, lse_rows, mask, offs_d, HEAD_DIM: tl.constexpr):
    tl.store(O + o_rows[:, None] + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=mask[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + lse_rows, lse.to(LSE.dtype.element_ty), mask=mask)


@triton.jit
def _load_q_tile(Q, pid_m, hk, stride_qb, stride_qh, stride_qn, R_TOTAL, ROWS_PER_SAMPLE, N_Q, GROUP,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    valid, b, g, i = _packed_rows(pid_m, R_TOTAL, ROWS_PER_SAMPLE, N_Q, BLOCK_M)
    h = hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + _rows(b, h, i, stride_qb, stride_qh, stride_qn)[:, None] + offs_d[None, :],
                mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return q, valid, b, h, i, offs_d
