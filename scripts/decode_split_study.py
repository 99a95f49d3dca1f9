"""The split-KV decode's time against its key-split count: each decode shape of flash's random set (Nq <= 64) whose
K and V take at least 10 us at copy bandwidth, at the split rule's count and at 1, 2, 4, ..., 64 splits. GPU time,
CUDA events with the L2 flushed (kernels/gpu_time.py); the call includes the merge of the splits.

    python scripts/decode_split_study.py OUT.json      (a CUDA GPU; results/<gpu>/flash/decode-splits.json)

Each shape's row is written as soon as it is timed, so a call cut short keeps what finished."""
import json
import sys

import torch

from attnbench.bench.roofline import ceilings
from attnbench.kernels.attention.flash_decode import decode_plan, flash_decode_launch
from attnbench.kernels.tiling import visible_key_count
from attnbench.kernels.gpu_time import gpu_time_median_ms
from attnbench.operators.flash import _random

MIN_COPY_S = 10e-6


def main(out):
    copy_bytes_per_s = ceilings(torch.device("cuda")).copy_gbps * 1e9  # this GPU's measured copy (attnbench calibrate)
    rows = []
    for case in _random():
        if case.seqlen_q > 64:
            continue
        element = torch.finfo(getattr(torch, case.dtype)).bits // 8
        kv_bytes = 2 * case.batch * case.heads_kv * case.seqlen_k * case.head_dim * element
        if kv_bytes / copy_bytes_per_s < MIN_COPY_S:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        dtype = getattr(torch, case.dtype)
        q, k, v = (torch.randn(case.batch, heads, n, case.head_dim, device="cuda", generator=gen).to(dtype)
                   for heads, n in ((case.heads_q, case.seqlen_q), (case.heads_kv, case.seqlen_k),
                                    (case.heads_kv, case.seqlen_k)))
        offset = case.causal_offset
        plan = decode_plan(case.batch, case.heads_q, case.seqlen_q, case.heads_kv,
                           visible_key_count(case.seqlen_q, case.seqlen_k, offset), q.device)
        times = {}
        for splits in sorted({1, 2, 4, 8, 16, 32, 64, plan[2]}):
            times[splits] = gpu_time_median_ms(
                lambda: flash_decode_launch(q, k, v, case.head_dim ** -0.5, offset, num_splits=splits))
        best = min(times, key=times.get)
        rows.append(dict(case=case.label, plan=plan, kv_mb=kv_bytes / 1e6, copy_ms=kv_bytes / copy_bytes_per_s * 1e3,
                         ms=times, rule_ms=times[plan[2]], best=best, best_ms=times[best]))
        print(f"{case.label}: rule {plan[2]} {times[plan[2]]:.4f} ms, best {best} {times[best]:.4f} ms, "
              f"copy {rows[-1]['copy_ms']:.4f} ms", flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
