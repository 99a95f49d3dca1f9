#!/usr/bin/env python3
"""Where a shared_context variant's error sits: per-row errors against the float64 oracle.

    python3 scripts/gpu_dev_error_rows.py "48,4,4,2,3000,40,32,1,varied" [--dtype bfloat16 ...]

For one case (SharedContextCase fields: B, H, Hkv, Lq, Nctx, Nbuf, D, causal, lengths) and each
dtype, prints the normwise error of the eager reference in that dtype and of our Triton paths at
several split counts, then the worst rows of the fused kernel (sample, head, query row, that
sample's buffer length, row error relative to the RMS row norm). A logic error shows up as a few
rows far off (and in float32, where rounding is ~1e-6); rounding as errors spread over all rows.
"""
import argparse

import torch

import attnbench
from attnbench.bench import verify
from attnbench.operators.shared_context import SharedContextCase
from attnbench.shared_context import shared_context_attention, shared_context_attention_composed

OP = attnbench.get("shared_context")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="B,H,Hkv,Lq,Nctx,Nbuf,D,causal(0/1),lengths(full/varied)")
    parser.add_argument("--dtype", action="append")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    fields = args.case.split(",")
    numbers = [int(f) for f in fields[:7]]
    for dtype in args.dtype or ["bfloat16", "float32"]:
        case = SharedContextCase(*numbers, causal=bool(int(fields[7])), lengths=fields[8], dtype=dtype)
        x = OP.make_inputs(case, args.device)
        oracle = OP.oracle(case, x)["o"]
        reference = OP.oracle(case, x, dtype=case.torch_dtype)["o"]
        inputs = (x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"])
        line = [f"{case.label}: reference {verify.relative_error(reference, oracle):.2e}"]
        for splits in (None, 1, 2, 8):
            o, _ = shared_context_attention(*inputs, causal=case.causal, num_splits=splits)
            c, _ = shared_context_attention_composed(*inputs, causal=case.causal, num_splits=splits)
            line.append(f"splits {splits or 'auto'}: fused {verify.relative_error(o, oracle):.2e} "
                        f"composed {verify.relative_error(c, oracle):.2e}")
        print(" | ".join(line))
        o, _ = shared_context_attention(*inputs, causal=case.causal)
        diff = (o.double() - oracle).norm(dim=-1)
        rms = oracle.norm(dim=-1).pow(2).mean().sqrt()
        flat = (diff / rms).flatten()
        worst = flat.topk(min(8, flat.numel()))
        lens = x["buf_lens"]
        for value, index in zip(worst.values.tolist(), worst.indices.tolist()):
            b, rest = divmod(index, case.heads_q * case.seqlen_q)
            h, i = divmod(rest, case.seqlen_q)
            length = case.n_buf if lens is None else int(lens[b])
            print(f"   worst row b{b} h{h} i{i} (buf_len {length}): {value:.3e} of the RMS row norm; "
                  f"oracle row norm {oracle[b, h, i].norm():.3e}")
        print(f"   rows over 1% of the RMS row norm: {int((flat > 1e-2).sum())} of {flat.numel()}; "
              f"median row error {flat.median():.2e}")


if __name__ == "__main__":
    main()
