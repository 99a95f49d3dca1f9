"""Many small matrix products, out[n] = a[n] @ b[n], in one launch: the dense route's per-sample products.

The dense route of the sparse products (dense.py) multiplies, for every sample, a matrix of at most a few
dozen rows and columns (49 x 49 at L 6) by the sample's [rows, channels] block. cuBLAS's batched GEMM runs those
far below the copy bandwidth (docs/measurements/sparse.md), and its 16-bit route pays a second product and a second
pass over the output for the low half of M. Here one program walks ``SAMPLES`` consecutive samples of
one (row tile, column tile) and does each sample's whole product in registers: the operands are read once, the
output written once, and for a 16-bit ``b`` with an fp32 ``a`` both halves of ``a`` (hi + lo, so that M is not
rounded to 16 bits) meet the same loaded ``b`` tile.

Either operand may be shared by every sample (no batch dim: stride 0). Dots run in the operands' accuracy: fp32
without TF32, fp64 in fp64, 16-bit on the tensor cores with fp32 accumulation.
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import INT32_MAX, slice_needs_copy
from ..outputs import new_output
from ..precision import accumulator_dtype, dot_precision
from ..tuning import autotune, cdiv, cfg, config_list, next_pow2, tile_pruner

__all__ = ["small_matmul", "small_matmul_kernel"]

# (warps, stages, samples a program, column tile, inner step). Chosen from a wider candidate set over the dense
# route's products (L 3-6, C 32 and 128, fp32 and bf16; `attnbench tune --kernel small_matmul`): with these, the
# autotuner's best stays close to the best candidate on every product, where configs differ widely
# (docs/measurements/sparse.md). Default (ATTNBENCH_AUTOTUNE=0) first.
_SHAPES = [(4, 1, 4, 32, 16), (4, 1, 1, 64, 16), (8, 2, 1, 128, 16), (4, 1, 1, 64, 64), (4, 1, 4, 32, 32),
           (4, 1, 4, 32, 64), (2, 1, 4, 16, 64), (4, 2, 4, 64, 16), (2, 1, 4, 16, 16)]
_CONFIGS = config_list(
    [cfg(w, st, SAMPLES=sa, BLOCK_Q=q, BLOCK_K=k) for w, st, sa, q, k in _SHAPES],
    cfg(1, 1, SAMPLES=2, BLOCK_Q=16, BLOCK_K=16),  # the interpreter: tiny batches still span several programs
)
# tl.dot wants every dim >= 16; a row tile covers up to 64 rows (49 at L 6), more rows take more programs.
MIN_BLOCK, MAX_ROWS = 16, 64


# Column tiles no wider than the columns and inner steps no deeper than the inner dim. (fp32's FMA dot spills at 64
# deep on a 64 x 64 tile, yet that config is the fastest at L 6 C 128: the autotuner decides.)
_prune = tile_pruner({"BLOCK_Q": "Q", "BLOCK_K": "K"}, MIN_BLOCK)


@autotune(_CONFIGS, key=["P", "K", "Q", "SPLIT_A"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def small_matmul_kernel(A, B, OUT, N, P, K, Q, s_an, s_ap, s_ak, s_bn, s_bk, s_bq, s_on, s_op, s_oq,
                        SPLIT_A: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr,
                        SAMPLES: tl.constexpr):
    """OUT[n] = A[n] @ B[n] for n in this program's SAMPLES samples, one (BLOCK_P, BLOCK_Q) output tile each.
    SPLIT_A: A is fp32 and B 16-bit; A enters as hi + lo, both in B's dtype (two dots into one accumulator)."""
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    q_mask = offs_q < Q
    for s in range(SAMPLES):
        n = (tl.program_id(0) * SAMPLES + s).to(tl.int64)
        # rows of a live sample; none past N (the last program's tail). A row bound, not `p_mask & (n < N)`:
        # the interpreter (triton 3.6-3.9) turns a bool tensor & a bool scalar into int32, which load refuses.
        rows = offs_p < tl.where(n < N, P, 0)
        a_rows = A + n * s_an + offs_p[:, None] * s_ap
        b_cols = B + n * s_bn + offs_q[None, :] * s_bq
        acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=ACC_DTYPE)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_rows + k[None, :] * s_ak, mask=rows[:, None] & (k[None, :] < K), other=0.0)
            b_mask = (k[:, None] < tl.where(n < N, K, 0)) & q_mask[None, :]
            b = tl.load(b_cols + k[:, None] * s_bk, mask=b_mask, other=0.0)
            if SPLIT_A:
                hi = a.to(b.dtype)
                lo = (a - hi.to(a.dtype)).to(b.dtype)
                acc = tl.dot(hi, b, acc, out_dtype=ACC_DTYPE)
                acc = tl.dot(lo, b, acc, out_dtype=ACC_DTYPE)
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=ACC_DTYPE)
        out = OUT + n * s_on + offs_p[:, None] * s_op + offs_q[None, :] * s_oq
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=rows[:, None] & q_mask[None, :])


def _batch_strides(t):
    """(batch size, batch stride, row stride, column stride) of a [N, R, C] operand or a shared [R, C] one."""
    if t.dim() == 2:
        return 1, 0, t.stride(0), t.stride(1)
    return t.shape[0], t.stride(0), t.stride(1), t.stride(2)


def small_matmul(a, b, out_dtype):
    """a @ b over a batch of small matrices, as torch.matmul broadcasts a 2-D operand, in ``out_dtype``.

    a: [N, P, K] or shared [P, K]; b: [N, K, Q] or shared [K, Q] (any strides). The operands share a dtype,
    except that an fp32 ``a`` may meet a 16-bit ``b`` (M in fp32, not rounded to 16 bits: see the module)."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"small_matmul: operands must be [N, R, C] or shared [R, C], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype and not (a.dtype == torch.float32 and b.dtype in (torch.float16, torch.bfloat16)):
        raise ValueError(f"small_matmul: operand dtypes {a.dtype} and {b.dtype} do not pair")
    # in-sample offsets are 32-bit (attnbench/kernels/offsets.py): a wider slice (a batch-innermost layout at large N) is
    # copied compact
    a, b = (t.contiguous() if slice_needs_copy(t, f"small_matmul {name}", "sample") else t
            for name, t in (("a", a), ("b", b)))
    if a.shape[-2] * b.shape[-1] > INT32_MAX:
        raise ValueError(f"small_matmul: the output, {a.shape[-2]} x {b.shape[-1]}, exceeds 2**31 - 1 elements per "
                         f"sample")
    (n_a, s_an, s_ap, s_ak), (n_b, s_bn, s_bk, s_bq) = _batch_strides(a), _batch_strides(b)
    if (n_a != n_b and 1 not in (n_a, n_b)) or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"small_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    batch = None  # both shared: one [P, Q] output
    if a.dim() == 3 or b.dim() == 3:  # torch.matmul's broadcast: a batch of one (or none) meets any batch
        batch = n_b if a.dim() == 2 or (n_a == 1 and b.dim() == 3) else n_a
        s_an, s_bn = (0 if n_a == 1 else s_an), (0 if n_b == 1 else s_bn)
    p, k = a.shape[-2:]
    q = b.shape[-1]
    out = new_output((p, q) if batch is None else (batch, p, q), out_dtype, a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    n = batch or 1
    s_on = out.stride(0) if batch is not None else 0
    block_p = min(MAX_ROWS, max(MIN_BLOCK, next_pow2(p)))
    with on_device(out):
        small_matmul_kernel[lambda meta: (cdiv(n, meta["SAMPLES"]), cdiv(p, block_p), cdiv(q, meta["BLOCK_Q"]))](
            a, b, out, n, p, k, q, s_an, s_ap, s_ak, s_bn, s_bk, s_bq, s_on, out.stride(-2), out.stride(-1),
            SPLIT_A=a.dtype != b.dtype, DOT_PRECISION=dot_precision(b.dtype),
            ACC_DTYPE=accumulator_dtype(b.dtype), BLOCK_P=block_p)
    return out
