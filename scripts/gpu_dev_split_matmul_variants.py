"""(scripts/gpu_dev_split_matmul_variants.py; results/gpu/nvidia-h200/split-matmul-variants.txt)
split_matmul variants, one process (bf16 a [N, K] @ fp32 b [K, M] kept to fp32, bf16 out):
v0 today's kernel (two dots a step into one accumulator), v1 two accumulators, v2 one dot a step over a doubled
loop (hi then lo: [2, K, M] stacked), v3 one dot of depth 2 BLOCK_K (a joined with itself, hi/lo interleaved rows);
cuBLAS one bf16 GEMM (b rounded: a lower bound on time) and the cuBLAS pair for scale."""
import torch
import triton
import triton.language as tl

from attnbench.kernels.sparse.split_matmul import split_fp32, split_matmul
from attnbench.kernels.tuning import autotune, cfg
from attnbench.bench.timing import measure

SHAPES = [(8, 3, 128, 128, 64), (4, 4, 128, 64, 64), (4, 4, 64, 128, 64), (4, 4, 64, 64, 64), (4, 3, 128, 32, 64),
          (4, 4, 64, 32, 32), (8, 4, 128, 128, 32), (4, 5, 128, 64, 32), (8, 3, 128, 256, 32), (4, 4, 128, 128, 32)]
CONFIGS = [cfg(w, s, BLOCK_N=n, BLOCK_M=m, BLOCK_K=k) for w, s, n, m, k in SHAPES]


@autotune(CONFIGS, key=["K", "M"])
@triton.jit
def v1_kernel(A, HI, LO, OUT, N, K, M, s_an, s_bk, s_on,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc_h = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_l = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_n.to(tl.int64)[:, None] * s_an + k[None, :],
                    mask=(offs_n < N)[:, None] & (k < K)[None, :], other=0.0)
        bo = k[:, None] * s_bk + offs_m[None, :]
        bm = (k < K)[:, None] & (offs_m < M)[None, :]
        acc_h = tl.dot(a, tl.load(HI + bo, mask=bm, other=0.0), acc_h)
        acc_l = tl.dot(a, tl.load(LO + bo, mask=bm, other=0.0), acc_l)
    acc = acc_h + acc_l
    tl.store(OUT + offs_n.to(tl.int64)[:, None] * s_on + offs_m[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@autotune(CONFIGS, key=["K", "M"])
@triton.jit
def v2_kernel(A, HL, OUT, N, K, M, s_an, s_bk, s_on,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    for step in range(0, 2 * steps):
        half = step // steps
        k = (step - half * steps) * BLOCK_K + offs_k
        a = tl.load(A + offs_n.to(tl.int64)[:, None] * s_an + k[None, :],
                    mask=(offs_n < N)[:, None] & (k < K)[None, :], other=0.0)
        bo = half * K * s_bk + k[:, None] * s_bk + offs_m[None, :]
        b = tl.load(HL + bo, mask=(k < K)[:, None] & (offs_m < M)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(OUT + offs_n.to(tl.int64)[:, None] * s_on + offs_m[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@autotune(CONFIGS, key=["K", "M"])
@triton.jit
def v3_kernel(A, HLI, OUT, N, K, M, s_an, s_bk, s_on,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """HLI [2K, M]: rows (k, h) interleaved, h = 0 hi, 1 lo; a joined with itself: columns (k, h)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_k2 = tl.arange(0, 2 * BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_n.to(tl.int64)[:, None] * s_an + k[None, :],
                    mask=(offs_n < N)[:, None] & (k < K)[None, :], other=0.0)
        a2 = tl.reshape(tl.join(a, a), [BLOCK_N, 2 * BLOCK_K])
        k2 = 2 * k0 + offs_k2
        b = tl.load(HLI + k2[:, None] * s_bk + offs_m[None, :], mask=(k2 < 2 * K)[:, None] & (offs_m < M)[None, :],
                    other=0.0)
        acc = tl.dot(a2, b, acc)
    tl.store(OUT + offs_n.to(tl.int64)[:, None] * s_on + offs_m[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


def grid(n, m):
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))


def v1(a, hi, lo):
    n, k = a.shape
    m = hi.shape[1]
    out = torch.empty(n, m, dtype=a.dtype, device=a.device)
    v1_kernel[grid(n, m)](a, hi, lo, out, n, k, m, a.stride(0), hi.stride(0), out.stride(0))
    return out


def v2(a, hl):
    n, k = a.shape
    m = hl.shape[2]
    out = torch.empty(n, m, dtype=a.dtype, device=a.device)
    v2_kernel[grid(n, m)](a, hl, out, n, k, m, a.stride(0), hl.stride(1), out.stride(0))
    return out


def v3(a, hli):
    n, k = a.shape
    m = hli.shape[1]
    out = torch.empty(n, m, dtype=a.dtype, device=a.device)
    v3_kernel[grid(n, m)](a, hli, out, n, k, m, a.stride(0), hli.stride(0), out.stride(0))
    return out


SIZES = [(100_000, 288), (100_000, 512), (100_000, 800), (100_000, 1152), (100_000, 1568), (100_000, 2048),
         (10_000, 3200), (100_000, 3200), (10_000, 6272)]


def compare(n, k):
    m = k
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, m, device="cuda", generator=g) / k ** 0.5
    hi, lo, _ = split_fp32(b, torch.bfloat16)
    hl = torch.stack([hi, lo])
    hli = torch.stack([hi, lo], dim=1).reshape(2 * k, m)
    bb = b.bfloat16()
    exact = a.double() @ b.double()
    rows = {"cublas one bf16 GEMM": lambda: a @ bb,
            "cublas pair": lambda: (torch.mm(a, hi, out_dtype=torch.float32)
                                    + torch.mm(a, lo, out_dtype=torch.float32)).bfloat16(),
            "v0 split_matmul (with split)": lambda: split_matmul(a, b),
            "v1 two accumulators": lambda: v1(a, hi, lo),
            "v2 doubled loop": lambda: v2(a, hl),
            "v3 joined depth": lambda: v3(a, hli)}
    for name, fn in rows.items():
        try:
            t = measure(fn, "cuda").median_ms
            err = ((fn().double() - exact).norm() / exact.norm()).item()
            tf = 2 * n * k * m / t / 1e9
            print(f"N{n} K{k} M{m} | {name:30s} | {t:.4f} ms | {tf:6.0f} TF/s (one product) | err {err:.2e}",
                  flush=True)
        except Exception as exc:
            print(f"N{n} K{k} M{m} | {name:30s} | failed: {str(exc).splitlines()[0][:150]}", flush=True)
    for kern in (v1_kernel, v2_kernel, v3_kernel):
        print("   pick", kern.fn.__name__, {str(kk[:2]): str(v) for kk, v in kern.cache.items()}.get(str((k, m))),
              flush=True)


for n, k in SIZES:
    compare(n, k)
    torch.cuda.empty_cache()
