#!/usr/bin/env python3
"""Where the host time of one shared_context decode call goes, piece by piece (a GPU study).

    python3 scripts/gpu_dev_launch_cost.py [--case-index 4 ...]

The decode step's kernels run for microseconds, so at small sizes the call is bounded by Python
and Triton's launcher, not by the GPU. For the operator's anchor cases this prints the host
submission time (wall time of back-to-back calls without a sync, per call) of: the public API,
the launcher alone (no argument checks), the compiled kernel launched through Triton with the
remembered config (no attnbench code at all), an empty Triton kernel with as many arguments (the
launcher's per-argument cost), and the peers (SDPA FLASH over the context, the Hydragen-style fold).
"""
import argparse
import time

import torch
import triton

import attnbench
from attnbench.kernels import shared_context as sc
from attnbench.shared_context import shared_context_attention
from attnbench.bench.timing import measure

OP = attnbench.get("shared_context")


def host_us(fn, calls=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@triton.jit
def _empty(P, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18, n19,
           n20, n21, n22, n23, n24, n25, n26, n27, n28, n29, n30, n31, n32, n33, n34, n35, n36, n37, n38, n39,
           n40, n41, n42, n43, n44, n45):
    pass


@triton.jit
def _empty_small(P, n0, n1, n2, n3):
    pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="anchor")
    parser.add_argument("--case-index", type=int, action="append")
    args = parser.parse_args()
    cases = OP.cases(args.cases)
    p = torch.empty(16, device="cuda")
    print(f"empty kernel, 47 args: {host_us(lambda: _empty[(1,)](p, *range(1, 47))):.1f} us; "
          f"5 args: {host_us(lambda: _empty_small[(1,)](p, 17, 33, 65, 129)):.1f} us; "
          f"torch.empty x1: {host_us(lambda: torch.empty(1024, device='cuda')):.1f} us")
    for index in args.case_index or range(len(cases)):
        case = cases[index]
        x = OP.make_inputs(case, "cuda")
        q, kc, vc, kb, vb, lens = (x[k] for k in ("q", "k_ctx", "v_ctx", "k_buf", "v_buf", "buf_lens"))
        scale = case.softmax_scale
        api = lambda: shared_context_attention(q, kc, vc, kb, vb, lens, causal=case.causal,  # noqa: E731
                                               check_lengths=False)
        launcher = lambda: sc.fused_launch(q, kc, vc, kb, vb, lens, case.causal, scale)  # noqa: E731
        api()
        row = {"api": host_us(api), "launcher": host_us(launcher)}
        for name in ("fold_flash", "split", "per_batch_flash"):
            variant = OP.variants.get(name)
            try:
                fn = variant.prepare(case, x, "fwd")
            except Exception as exc:  # noqa: BLE001  (a peer that declines this case)
                row[name] = f"declined ({type(exc).__name__})"
                continue
            row[name] = host_us(fn)
        gpu = {name: measure(OP.variants[name].prepare(case, x, "fwd"), "cuda", cuda_graph=True).median_ms * 1e3
               for name in ("triton", "fold_flash")}
        events = {name: measure(OP.variants[name].prepare(case, x, "fwd"), "cuda").median_ms * 1e3
                  for name in ("triton", "fold_flash")}
        print(f"{case.label}: host us/call " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            + " | graph us " + ", ".join(f"{k} {v:.1f}" for k, v in gpu.items())
            + " | events us " + ", ".join(f"{k} {v:.1f}" for k, v in events.items()), flush=True)


if __name__ == "__main__":
    main()
