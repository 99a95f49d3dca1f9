"""torch.profiler over the Triton variant of vecsca at a few anchors (N 1e5), forward and backward: which kernels
take the time (results/gpu/nvidia-h200/profile-vecsca.txt).

    python3 scripts/gpu_dev_profile_vecsca.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import attnbench
from attnbench.operators.sparse import SparseCase

OP = attnbench.get("sparse")
for l_max, c, dtype in [(2, 32, "float32"), (2, 32, "bfloat16"), (3, 128, "float32"), (4, 32, "float32"),
                        (6, 128, "bfloat16"), (6, 32, "float32")]:
    case = SparseCase("vecsca", l_max, 100_000, c, dtype)
    x = OP.make_inputs(case, "cuda", 0)
    for mode in ("fwd", "bwd"):
        fn = OP.variants["triton"].prepare(case, x, mode)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n### {case.label} {mode} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    del x
    torch.cuda.empty_cache()
