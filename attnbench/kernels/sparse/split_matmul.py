"""A 16-bit batch times an fp32 matrix kept to fp32: out = a @ (hi + lo), fp32 accumulation, one rounding.

The fold route (fold.py) multiplies a 16-bit batch [N, K] by a folded weight that stays in fp32 (rounding it
to 16 bits would add an error of the output's own size). On cuBLAS that is two GEMMs, a @ hi and a @ lo with fp32
outputs, their sum and a cast: at N 1e5 and 288 columns (L 2, 32 channels) three extra passes over a [N, M] fp32
array, more time in memory traffic than the products take on the tensor cores (a byte and FLOP count, not a
measurement: docs/measurements/sparse.md). Here one program holds an output tile's fp32 accumulator across both
products and writes it once in the output dtype.

``hi`` and ``lo`` are the fp32 matrix split once per call (``split_fp32``: for fp16 scaled by a power of two first,
so that its range neither overflows hi nor leaves lo subnormal), so that a program loads two 16-bit tiles instead of
converting an fp32 one; the accumulator is scaled back before the one rounding. The batch N is the streaming
dim: the autotuner keys on K and M only, so a new batch size does not tune again.
"""
import torch
import triton
import triton.language as tl

from .. import interpreting
from ..launch import on_device
from ..offsets import INT32_MAX
from ..outputs import new_output
from ..tuning import autotune, cdiv, cfg, config_list, tile_pruner

__all__ = ["split_matmul", "split_matmul_kernel", "split_fp32"]

# (warps, stages, rows, columns, inner step): Hopper bf16 GEMM tiles of Triton's matmul tutorial family, not
# measured on this kernel yet: the first is the default.
# Two B tiles (hi and lo) a stage: 128 x 256 x 64 at 3 stages would stage 240 KiB, past Hopper's 227.
_SHAPES = [(8, 3, 128, 128, 64), (4, 4, 128, 64, 64), (4, 4, 64, 128, 64), (4, 4, 64, 64, 64), (4, 3, 128, 32, 64),
           (4, 4, 64, 32, 32)]
_CONFIGS = config_list(
    [cfg(w, st, BLOCK_N=n, BLOCK_M=m, BLOCK_K=k) for w, st, n, m, k in _SHAPES],
    cfg(1, 1, BLOCK_N=16, BLOCK_M=16, BLOCK_K=16),  # the interpreter: tiny shapes still span several tiles
)


_prune = tile_pruner({"BLOCK_M": "M", "BLOCK_K": "K"})  # tiles no larger than the columns and the depth


@autotune(_CONFIGS, key=["K", "M"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def split_matmul_kernel(A, HI, LO, SCALE, OUT, N, K, M, s_an, s_ak, s_bk, s_bm, s_on, s_om,
                        SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[n, m] = SCALE sum_k A[n, k] (HI[k, m] + LO[k, m]) for one [BLOCK_N, BLOCK_M] tile: both dots into one
    fp32 accumulator, times the split's power of two where it has one (SCALED; SCALE: a one-element fp32 tensor).
    HI and LO share strides."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    a_rows = A + offs_n.to(tl.int64)[:, None] * s_an
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(a_rows + k[None, :] * s_ak, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        b_offsets = k[:, None] * s_bk + offs_m[None, :] * s_bm
        b_mask = k_mask[:, None] & m_mask[None, :]
        acc = tl.dot(a, tl.load(HI + b_offsets, mask=b_mask, other=0.0), acc, out_dtype=tl.float32)
        acc = tl.dot(a, tl.load(LO + b_offsets, mask=b_mask, other=0.0), acc, out_dtype=tl.float32)
    if SCALED:
        acc = acc * tl.load(SCALE)
    out = OUT + offs_n.to(tl.int64)[:, None] * s_on + offs_m[None, :] * s_om
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def split_fp32(b, dtype):
    """(hi, lo, scale): b = scale (hi + lo) to within 2**-16 |b| for bf16 (2**-22 for fp16, plus 2**-38 max |b| for
    entries whose low part falls below fp16's normal range). bf16 has fp32's exponent range, so its parts need no
    scale (None: no pass over b, nor over the products' output). For fp16, scale is a power of two (a one-element fp32
    tensor: no host sync) that puts max |b| / scale in [2**14, 2**15): hi cannot overflow (65504) and lo stays normal
    down to 2**-24 max |b|; exact, so it changes nothing else."""
    if dtype == torch.bfloat16:
        hi = b.to(dtype)
        return hi, (b - hi.float()).to(dtype), None
    peak = b.abs().amax() if b.numel() else b.new_zeros(())
    exponent = torch.frexp(peak)[1]  # peak = m 2**exponent, m in [0.5, 1) (0 and non-finite: exponent 0)
    scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=b.device), exponent - 15)
    scaled = b / scale
    hi = scaled.to(dtype)
    return hi, (scaled - hi.float()).to(dtype), scale.reshape(1)


def split_matmul(a, b):
    """a @ b for a 16-bit a [N, K] and an fp32 b [K, M], in a's dtype: b split into scale (hi + lo) (``split_fp32``),
    both products accumulated in fp32 in one program, the result rounded once."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"split_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != torch.float32:
        raise ValueError(f"split_matmul: a must be fp16 or bf16 and b fp32, got {a.dtype} and {b.dtype}")
    (n, k), m = a.shape, b.shape[1]
    out = new_output((n, m), a.dtype, a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    if a.dtype == torch.bfloat16 and interpreting():  # numpy has no bf16: the sum in fp32, b unsplit, one rounding
        return torch.matmul(a.float(), b).to(a.dtype)
    if k * m > INT32_MAX:
        raise ValueError(f"split_matmul: b, {k} x {m}, exceeds 2**31 - 1 elements")
    if a.stride(1) * (k - 1) > INT32_MAX:  # in-row offsets are 32-bit (a batch-innermost view at large N)
        a = a.contiguous()
    hi, lo, scale = split_fp32(b.contiguous(), a.dtype)
    with on_device(out):
        split_matmul_kernel[lambda meta: (cdiv(n, meta["BLOCK_N"]), cdiv(m, meta["BLOCK_M"]))](
            a, hi, lo, hi if scale is None else scale, out, n, k, m, a.stride(0), a.stride(1), hi.stride(0),
            hi.stride(1), out.stride(0), out.stride(1), SCALED=scale is not None)
    return out
