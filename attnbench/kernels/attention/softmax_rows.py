"""Per-row softmax statistics shared by every attention kernel: how a finished row is normalized,
and how the logsumexp saved by a forward is read back.

Two rows end with a zero softmax sum, and they mean different things:
- a row that the causal mask leaves without any key (bottom-right alignment with Nq > Nk): by
  definition O = 0 and LSE = -inf ("sees no key"), with zero gradients;
- a row that has visible keys but whose scores were all -inf, which only an infinite input can
  cause: that is not "sees no key" but a non-finite input, and it must come out as NaN.
A NaN anywhere in a row's scores makes its sum NaN, which also comes out as NaN (never as the
(0, -inf) pair), so a bad input can never be disguised as a blind row.
"""
import triton
import triton.language as tl

from ..precision import LN2, LOG2E


@triton.jit
def blind_rows(offs_m, causal_offset, CAUSAL: tl.constexpr):
    """True for query rows the mask leaves without any key (row i sees keys j <= i + offset)."""
    if CAUSAL:
        return offs_m + causal_offset < 0
    else:
        return offs_m < 0  # all False, with the right shape


@triton.jit
def finish_rows(acc, l_i, m_i, offs_m, causal_offset, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """(O, LSE, 1/l) of rows accumulated by the online softmax in base 2 (m_i in log2 units).
    Blind rows give O = 0, LSE = -inf and 1/l = 0; a zero or NaN sum on a row with visible keys
    gives NaN for all three."""
    return finish_rows_where(acc, l_i, m_i, blind_rows(offs_m, causal_offset, CAUSAL), ACC_DTYPE, ACC_DTYPE)


@triton.jit
def finish_rows_where(acc, l_i, m_i, blind, ACC_DTYPE: tl.constexpr, LSE_DTYPE: tl.constexpr):
    """``finish_rows`` with the rows that see no key given as a mask (a split of the keys can
    leave a row without any key of its own), the LSE computed in LSE_DTYPE (a split's partial state:
    precision.STATE_LSE_DTYPE)."""
    l_safe = tl.where(blind, 1.0, l_i)  # blind rows are overwritten below: keep them out of 1/l, log
    inv_l = tl.where(blind, 0.0, 1.0 / l_safe)  # a zero sum elsewhere: 1/0 = inf, inf * acc(=0) = NaN
    o = acc * inv_l[:, None]
    lse_valid = (m_i.to(LSE_DTYPE) + tl.math.log2(l_safe).to(LSE_DTYPE)) * tl.full([], LN2, LSE_DTYPE)
    lse = tl.where(blind, float("-inf"), tl.where(l_i > 0.0, lse_valid, float("nan")))
    inv_l = tl.where(blind | (l_i > 0.0), inv_l, float("nan"))
    return o, lse, inv_l


@triton.jit
def load_lse_log2(LSE_head, offs_m, N_Q):
    """A saved natural-log LSE in log2 units. Rows past N_Q and blind rows (-inf) read as +inf so
    that exp2(s - lse) = 0 there instead of NaN; a NaN LSE stays NaN and poisons its row."""
    lse = tl.load(LSE_head + offs_m, mask=offs_m < N_Q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
