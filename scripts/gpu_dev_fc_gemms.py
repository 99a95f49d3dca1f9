"""(scripts/gpu_dev_fc_gemms.py; results/gpu/nvidia-h200/fc-bf16-gemms.txt)
The FC layer's bf16 GEMMs on cuBLAS, one process: the weight gradient's G = X^T GZ (contraction over the batch)
with an fp32 output against a bf16 output and against fp32 operands; and x @ folded in bf16 (one GEMM) against the
split pair with fp32 outputs + sum + cast, and split_matmul."""
import torch
from attnbench.bench.timing import measure
from attnbench.kernels.sparse.split_matmul import split_matmul, split_fp32

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = [(100_000, 288, 288), (100_000, 800, 800), (10_000, 3200, 3200), (100_000, 1568, 1568), (100_000, 2048, 2048)]


def compare(n, k, m):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    gz = torch.randn(n, m, device="cuda", generator=g).bfloat16()
    w = torch.randn(k, m, device="cuda", generator=g) / k ** 0.5
    exact = x.double().t() @ gz.double()
    rows = {
        "G mm out fp32": lambda: torch.mm(x.t(), gz, out_dtype=torch.float32),
        "G mm bf16": lambda: torch.mm(x.t(), gz),
        "G mm fp32 operands": lambda: torch.mm(x.t().float(), gz.float()),
    }
    for name, fn in rows.items():
        t = measure(fn, "cuda").median_ms
        err = ((fn().double() - exact).norm() / exact.norm()).item()
        print(f"{n} {k} {m} | {name:24s} | {t:.4f} ms | err {err:.1e}", flush=True)
    exact = x.double() @ w.double()
    hi, lo, _ = split_fp32(w, torch.bfloat16)
    wb = w.bfloat16()
    rows = {
        "Z one bf16 GEMM": lambda: x @ wb,
        "Z cuBLAS pair": lambda: (torch.mm(x, hi, out_dtype=torch.float32)
                                  + torch.mm(x, lo, out_dtype=torch.float32)).bfloat16(),
        "Z split_matmul": lambda: split_matmul(x, w),
    }
    for name, fn in rows.items():
        t = measure(fn, "cuda").median_ms
        err = ((fn().double() - exact).norm() / exact.norm()).item()
        print(f"{n} {k} {m} | {name:24s} | {t:.4f} ms | err {err:.1e}", flush=True)


for n, k, m in SHAPES:
    compare(n, k, m)
    torch.cuda.empty_cache()
