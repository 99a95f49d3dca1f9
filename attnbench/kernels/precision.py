"""Dtype rules shared by the kernels: accumulators, dot precision, and an fp64-exact scale.

Triton passes Python floats to kernels as fp32, which would cap the fp64 gradcheck path at
~1e-8. The softmax scale therefore travels as two fp32 halves (hi + lo) that an fp64 kernel adds
back together, and the kernels' own constants are built in the accumulator dtype.
"""
import functools

import numpy as np
import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# The online softmax's running max before any key (log2 units): the most negative finite float32. Finite, so
# that a row with no visible key yet keeps alpha = exp2(m - m) = 1 and p = 0 (-inf - -inf would be NaN); and
# this low, since a round -1e30 read rows whose scores all lie below it (finite inputs near 1e15) as seeing
# no key: NaN rows in flash, a dropped "empty" state in shared_context's merge (found by review).
ROW_MAX_START: tl.constexpr = tl.constexpr(-3.4028234663852886e38)


# The LSE of a softmax state that is merged later (split-KV partials, shared_context's buffer and context halves, and
# the merge's own running max): float64, whatever the inputs. A state's weight in a merge is exp(its LSE - the largest),
# and an LSE rounded to float32 is off by up to |LSE| * 2^-24: states of near-tied rows at |LSE| ~ 1e3 already weigh
# 3e-5 wrong (the fp32 bar is 1e-5), and at 1e10 log(ties) is lost whole. In float64 the distance is exact to float32's
# relative precision. Per row, not per element: the extra bytes and float64 operations are a few per row.
STATE_LSE_DTYPE = torch.float64


@functools.lru_cache(maxsize=1024)  # host time: two numpy scalar round trips on every launch
def split_scale(scale: float) -> tuple[float, float]:
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


@triton.jit
def softmax_scale_log2(scale_hi, scale_lo, ACC_DTYPE: tl.constexpr):
    """scale * log2(e) in the accumulator dtype (fp64-exact when ACC_DTYPE is fp64)."""
    if ACC_DTYPE == tl.float64:
        return (tl.cast(scale_hi, tl.float64) + tl.cast(scale_lo, tl.float64)) * tl.full([], LOG2E, tl.float64)
    else:
        return scale_hi * LOG2E


@triton.jit
def softmax_scale(scale_hi, scale_lo, ACC_DTYPE: tl.constexpr):
    """The softmax scale itself in the accumulator dtype (for tangents, which are not in log2 units)."""
    if ACC_DTYPE == tl.float64:
        return tl.cast(scale_hi, tl.float64) + tl.cast(scale_lo, tl.float64)
    else:
        return scale_hi


def accumulator_dtype(dtype: torch.dtype):
    """fp64 inputs accumulate in fp64 (the gradcheck path); everything else in fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use full-precision dots, not TF32: fp32 here is a precision mode, not a speed mode."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def accumulator_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """``accumulator_dtype`` as a torch dtype: what partial sums and softmax states kept in memory are stored in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


lse_dtype = accumulator_torch_dtype
