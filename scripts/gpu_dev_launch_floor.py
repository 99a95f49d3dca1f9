#!/usr/bin/env python3
"""The least time `attnbench.bench.timing.measure` reads for one kernel launch on this GPU: an empty Triton kernel with
few and with many arguments, timed as every variant is (CUDA events, L2 flushed, median). No operator call that
launches a kernel can read less, so it is a floor beside the bytes' and the exponentials' (shared_context_floors.py
--launch-floor-us).

    python3 scripts/gpu_dev_launch_floor.py [--json OUT.json]
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from attnbench.bench.timing import measure


@triton.jit
def _empty(X, n):
    pass


@triton.jit
def _empty_wide(X, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39,
                a40, a41, a42, a43, a44, a45, a46, B: tl.constexpr):
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    x = torch.randn(1024, device="cuda")
    out = {"device": torch.cuda.get_device_name()}
    for name, fn in (("empty_2_args", lambda: _empty[(1,)](x, 7)),
                     ("empty_48_args", lambda: _empty_wide[(132,)](x, *range(3, 50), B=16)),
                     ("torch_add_4kb", lambda: x.add(1.0))):
        t = measure(fn, "cuda")
        out[name + "_us"] = t.median_ms * 1e3
        print(f"{name}: {t.median_ms * 1e3:.2f} us (IQR {t.iqr_ms * 1e3:.2f})", flush=True)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
