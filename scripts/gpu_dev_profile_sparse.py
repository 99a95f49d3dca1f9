"""torch.profiler over sparse cases (N 1e5 unless given): which kernels take the time, per variant and mode
(results/gpu/nvidia-h200/profile-vecsca.txt was the first run, vecsca's default cases).

    python3 scripts/gpu_dev_profile_sparse.py [--op vecsca] [--shared ''] [--cases 2:32:float32,...]
        [--batch 100000] [--modes fwd,bwd] [--variants triton]

``--cases`` lists L:C:dtype triples; ``--variants`` may add ``reference`` (the einsum) to see what a peer launches.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import attnbench
from attnbench.operators.sparse import SparseCase

OP = attnbench.get("sparse")
VECSCA_CASES = "2:32:float32,2:32:bfloat16,3:128:float32,4:32:float32,6:128:bfloat16,6:32:float32"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="vecsca")
    parser.add_argument("--shared", default="", help="the shared operand: '', 'x' or 'y'")
    parser.add_argument("--cases", default=VECSCA_CASES)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--variants", default="triton")
    args = parser.parse_args()
    for spec in args.cases.split(","):
        l_max, channels, dtype = spec.split(":")
        case = SparseCase(args.op, int(l_max), args.batch, int(channels), dtype, args.shared)
        x = OP.make_inputs(case, "cuda", 0)
        for variant in args.variants.split(","):
            for mode in args.modes.split(","):
                fn = OP.variants[variant].prepare(case, x, mode)
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                print(f"\n### {case.label} {variant} {mode} (5 calls)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
                del fn
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
