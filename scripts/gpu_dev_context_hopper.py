#!/usr/bin/env python3
"""Would a Gluon context loop pay for shared_context? The context-only cases (no buffer) timed three ways.

    python3 scripts/gpu_dev_context_hopper.py [--json OUT.json]

A shared context with an empty buffer is plain attention over the batch-folded query rows. Per case:
shared_context's Triton kernel as shipped and the fold_flash peer (their `prepare`, q folding included
in the peer), then flash's Gluon forward (attnbench/kernels/attention/flash_fwd_hopper.py, sm_90) and its pointer tiles on
the same rows folded beforehand ([1, Hq, B * Lq, D], not timed), at several Gluon tile configs. The
Gluon figures are what a Gluon context kernel could reach before its packed-row loads and splits.
Each output is compared with the shipped kernel's. Medians of CUDA events, L2 flushed.
"""
import argparse
import json

import torch

import attnbench
from attnbench.kernels.attention.flash_fwd import flash_fwd_launch, forward_route
from attnbench.kernels.attention.flash_fwd_hopper import flash_fwd_hopper_launch
from attnbench.operators.shared_context import SharedContextCase
from attnbench.bench.roofline import machine_info
from attnbench.bench.timing import measure

OP = attnbench.get("shared_context")
CASES = [(b, 4, 4, 2, n_ctx, 0, 32) for b in (256, 1024, 4096) for n_ctx in (512, 2048, 10000)]
CASES += [(256, 32, 8, 1, 8192, 0, 128), (1024, 32, 8, 1, 4096, 0, 128)]
_PAIR = (True, 168, "pair", 240)
TILES = {32: [(64, 128, 2, 4, False), (64, 64, 3, 4, False), (64, 128, 2, 4, True), (64, 128, 3, 4, False),
              (64, 128, 2, 4, False, True, 232), (128, 128, 2, 4, True) + _PAIR, (128, 256, 2, 4, True) + _PAIR],
         128: [(128, 128, 2, 4, True) + _PAIR, (64, 128, 2, 4, True)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    doc = {"machine": machine_info(device), "cases": []}
    for row in CASES:
        case = SharedContextCase(*row)
        x = OP.make_inputs(case, device, 0)
        entry = {"case": case.label, "ms": {}, "diff": {}}
        shipped = OP.variants["triton"].prepare(case, x, "fwd")
        o_ref = shipped()["o"].float()
        for name in ("triton", "fold_flash"):
            entry["ms"][name] = measure(OP.variants[name].prepare(case, x, "fwd"), device).median_ms
        q = x["q"]
        b, hq, lq, d = q.shape
        q_fold = q.permute(1, 0, 2, 3).reshape(1, hq, b * lq, d).contiguous()
        k, v = x["k_ctx"].unsqueeze(0), x["v_ctx"].unsqueeze(0)
        o = torch.empty_like(q_fold)
        lse = torch.empty(1, hq, b * lq, device=device, dtype=torch.float32)

        def unfold(t):
            return t.reshape(hq, b, lq, d).permute(1, 0, 2, 3).float()

        with forward_route("tiles"):
            entry["ms"]["flash tiles"] = measure(lambda: flash_fwd_launch(q_fold, k, v, case.softmax_scale, None),
                                                 device).median_ms
        for tiles in TILES[d]:
            name = f"gluon {tiles}"
            try:
                def run():
                    flash_fwd_hopper_launch(q_fold, k, v, o, lse, case.softmax_scale, None, tiles=tiles)
                entry["ms"][name] = measure(run, device).median_ms
                entry["diff"][name] = (unfold(o) - o_ref).abs().max().item()
            except Exception as exc:  # a config the compiler cannot fit: part of the answer
                entry["ms"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        ours = entry["ms"]["triton"]
        print(case.label, flush=True)
        for name, t in entry["ms"].items():
            if isinstance(t, float):
                print(f"  {name:48s} {t * 1e3:9.1f} us  {ours / t:5.2f}x ours  "
                      f"{entry['ms']['fold_flash'] / t:5.2f}x fold_flash  diff {entry['diff'].get(name, 0):.1e}",
                      flush=True)
            else:
                print(f"  {name:48s} {t}", flush=True)
        doc["cases"].append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
