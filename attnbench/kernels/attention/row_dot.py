"""Row reductions of the backward passes: out = rowsum(A1 * B1) [+ rowsum(A2 * B2)] [- C].

The FA2 backward needs delta = rowsum(dO * O) - dLSE per query row (dLSE: the cotangent of the
logsumexp output, when it is used); its tangent needs rowsum(dO * O_t + dO_t * O) - dLSE_t.
Both are this one kernel: A*, B* are [B, H, N, D] tensors with a contiguous last dimension,
C is [B, H, N] contiguous, and out is [B, H, N] in the accumulator dtype.
"""
import triton
import triton.language as tl

from ..outputs import new_output
from ..precision import accumulator_dtype, lse_dtype
from ..tiling import row_strides
from ..launch import planned
from ..tuning import cdiv, next_pow2


@triton.jit
def _row_product(A, B, sa_b, sa_h, sa_n, sb_b, sb_h, sb_n, b, h, offs_m, offs_d, mask, ACC_DTYPE: tl.constexpr):
    a = tl.load(A + b * sa_b + h * sa_h + offs_m[:, None] * sa_n + offs_d[None, :], mask=mask, other=0.0)
    x = tl.load(B + b * sb_b + h * sb_h + offs_m[:, None] * sb_n + offs_d[None, :], mask=mask, other=0.0)
    return tl.sum(a.to(ACC_DTYPE) * x.to(ACC_DTYPE), axis=1)


@triton.jit
def row_dot_kernel(A1, B1, A2, B2, C, OUT,
                   sa1_b, sa1_h, sa1_n, sb1_b, sb1_h, sb1_n, sa2_b, sa2_h, sa2_n, sb2_b, sb2_h, sb2_n,
                   N, HEAD_DIM, H, HAS_FIRST: tl.constexpr, HAS_SECOND: tl.constexpr, HAS_C: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < N) & (offs_d[None, :] < HEAD_DIM)
    out = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)
    if HAS_FIRST:
        out += _row_product(A1, B1, sa1_b, sa1_h, sa1_n, sb1_b, sb1_h, sb1_n, b, h, offs_m, offs_d, mask, ACC_DTYPE)
    if HAS_SECOND:
        out += _row_product(A2, B2, sa2_b, sa2_h, sa2_n, sb2_b, sb2_h, sb2_n, b, h, offs_m, offs_d, mask, ACC_DTYPE)
    row = (b * H + h) * N + offs_m
    if HAS_C:
        out -= tl.load(C + row, mask=offs_m < N, other=0.0).to(ACC_DTYPE)
    tl.store(OUT + row, out, mask=offs_m < N)



def row_dot_launch(shape, device, dtype, first=None, second=None, minus=None):
    """rowsum(first[0] * first[1]) + rowsum(second[0] * second[1]) - minus for [B, H, N, D] pairs
    of ``dtype`` (a pair or ``minus`` may be None: left out). Returns [B, H, N] in the accumulator
    dtype (fp64 for fp64, else fp32), the dtype of the LSE and its statistics."""
    batch, heads, n, head_dim = shape
    out = new_output((batch, heads, n), lse_dtype(dtype), device)
    # an absent operand is replaced by ``out`` itself: the kernel never reads it (its flag is off)
    a1, b1 = first if first is not None else (out.unsqueeze(-1), out.unsqueeze(-1))
    a2, b2 = second if second is not None else (out.unsqueeze(-1), out.unsqueeze(-1))
    block_m = 16 if device.type == "cpu" else 64
    planned(row_dot_kernel)[(cdiv(n, block_m), heads, batch)](
        a1, b1, a2, b2, out if minus is None else minus.contiguous(), out,
        *row_strides(a1), *row_strides(b1), *row_strides(a2), *row_strides(b2),
        n, head_dim, heads, HAS_FIRST=first is not None, HAS_SECOND=second is not None, HAS_C=minus is not None,
        BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(head_dim)), ACC_DTYPE=accumulator_dtype(dtype))
    return out
