#!/usr/bin/env python3
"""``gram_stack_kernel``'s launch configs against small_matmul and cuBLAS on the Gram matrices of inner (vecsca's
backward gy), one GPU, one process (results/gpu/nvidia-h200/gram-stack-configs.log).

    python3 scripts/gpu_dev_gram_stack.py [--batch N] [--json OUT.json]

For L 2, 3, 4, 6 ((L + 1)^2 rows), C 32 and 128, fp32 and bf16: x [N, P, C] @ y[N]^T, each candidate's median GPU
time (L2 flushed), % of the copy bandwidth on x, y and G once each, and its max error against float64 relative to
max |G|. The candidates are (samples a program, channel step, warps); the module keeps the one that won.
"""
import argparse
import json

import torch
import triton

import attnbench  # noqa: F401  first: the interpreter switch
from attnbench.kernels.sparse import dense as sparse_dense
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.kernels.sparse.small_matmul import small_matmul
from attnbench.kernels.tuning import cfg
from attnbench.bench.roofline import ceilings, machine_info

CANDIDATES = [(4, 32, 4), (8, 32, 4), (16, 32, 4), (8, 16, 4), (16, 16, 8), (2, 32, 4), (1, 32, 4), (4, 64, 4),
              (8, 32, 8), (32, 16, 8)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    copy = ceilings("cuda").copy_gbps
    generator = torch.Generator(device="cuda").manual_seed(0)
    kernel = sparse_dense.gram_stack_kernel
    shipped = kernel.configs
    rows = []
    for l_max in (2, 3, 4, 6):
        p = (l_max + 1) ** 2
        for channels in (32, 128):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(args.batch, p, channels, device="cuda", generator=generator).to(dtype)
                y = torch.randn(args.batch, p, channels, device="cuda", generator=generator).to(dtype)
                exact = x.double() @ y.double().transpose(-1, -2)
                runs = {"small_matmul": lambda: small_matmul(x, y.transpose(-1, -2), torch.float32)}
                if dtype == torch.float32:
                    runs["cublas"] = lambda: sparse_dense.full_precision_matmul(x, y.transpose(-1, -2))
                    if p <= sparse_dense.GRAM_STACK_ROWS or l_max in (4, 6):
                        for samples, step, warps in CANDIDATES:
                            config = cfg(warps, 1, BLOCK_N=samples, BLOCK_C=step)

                            def run(config=config):
                                kernel.configs, kernel.cache = [config], {}
                                try:
                                    return sparse_dense.gram_stack(x, y.transpose(-1, -2))
                                finally:
                                    kernel.configs = shipped
                            runs[f"gram_stack n{samples} c{step} w{warps}"] = run
                gram_bytes = args.batch * (2 * p * channels * x.element_size() + p * p * 4)
                for name, fn in runs.items():
                    row = {"l": l_max, "c": channels, "dtype": str(dtype)[6:], "name": name}
                    try:
                        out = fn()
                    except triton.runtime.errors.OutOfResources as exc:  # a candidate too large for this GPU
                        row["error"] = str(exc).splitlines()[0][:120]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                    row["err"] = float((out.double() - exact).abs().max() / exact.abs().max())
                    row["ms"] = gpu_time_median_ms(fn)
                    row["pct_copy"] = 100 * gram_bytes / (row["ms"] / 1e3) / 1e9 / copy
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info("cuda"), "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
