#!/usr/bin/env python3
"""sparse against its copy-bandwidth bar (>= 60% at large N): per case of the sweep at its largest N and per mode, the
most of the copy bandwidth any kernel could show, and the most the issue's design of the derivatives allows.

    python scripts/sparse_floors.py [--markdown X.md] [--copy-gbps 3020] [--fma-tflops 67] [--bf16-matmul-tflops 989]
        [--fp32-matmul-tflops 495] [--bar 60] [--ops mul,vecmat]

A model, no GPU. Per case and mode, the least time each resource allows:
- bytes: the operator's minimum bytes (every operand read once, every output written once: the cost model of
  attnbench/operators/sparse) at the copy bandwidth (default: 3020 GB/s, measured on the H100);
- compute, the faster of two formulations, each at a datasheet peak and generous to the kernel:
  - the terms as written (the cost model's FLOPs: nonzero terms, or a shared weight's folded pairs) on the FMA units
    (--fma-tflops, 67: the H100 SXM's fp32; 16-bit inputs accumulate in fp32 there too);
  - the fewest multiply-adds of a dense form on the tensor cores (--bf16-matmul-tflops 989; fp32 at
    --fp32-matmul-tflops 495, TF32's one pass, though fp32's accuracy needs three): mul's Clebsch-Gordan blocks dense
    and unpadded ((2 l1 + 1)(2 l2 + 1)(2 l3 + 1) a path a (sample, channel) column); vecsca and scavec as M[n] @ x[n]
    over the (output, vector row) pairs; inner as the Gram matrix x[n] @ y[n]^T; the others at their own FLOPs.
  A derivative's products count as the forward's (the cost model's rule: 2 for bwd, 4 for double bwd).
attainable % = the bytes' time over the longest floor (attnbench.bench.roofline.attainable_copy_pct).

design cap % (bwd, double bwd): the issue asks for backward as sibling products (seed section 2.3: each gradient one
Function's .apply with the infos rotated), so each product reads its two operands and writes its output: backward
2 (X + Y + Z) where the minimum is 2X + 2Y + Z (g is read twice); double backward four products plus autograd's sum
of the two contributions to d/dg (read both, write one), 4 (X + Y) + 7Z, against 3X + 3Y + 2Z; the structure once per
product. The cap is the minimum bytes over those bytes: a kernel per product at the full copy bandwidth shows no more.
at most % = the smaller of the two. Rows below --bar are marked.
"""
import argparse
import sys

import attnbench
from attnbench.operators.sparse import CASE_SETS, PRODUCTS, PRODUCTS_PER_MODE, _cg_pairs
from attnbench.bench.roofline import attainable_copy_pct

OP = attnbench.get("sparse")
MODES = ("fwd", "bwd", "double_bwd")


def largest_n_cases(ops=None):
    """The sweep's cases at the largest N each (op, L, C, dtype, sharing, structure) has."""
    largest = {}
    for case in CASE_SETS["sweep"]():
        if ops and case.op not in ops:
            continue
        key = (case.op, case.l_max, case.channels, case.dtype, case.shared, case.structure)
        if key not in largest or case.batch > largest[key].batch:
            largest[key] = case
    return list(largest.values())


def cg_block_macs(l_max):
    """Multiply-adds a (sample, channel) column of mul with every Clebsch-Gordan path's block dense, unpadded."""
    return sum((2 * a + 1) * (2 * b + 1) * (2 * c + 1) for a in range(l_max + 1) for b in range(l_max + 1)
               for c in range(abs(a - b), min(a + b, l_max) + 1))


def matrix_unit_flops(case):
    """The forward's FLOPs in the dense form on the tensor cores (see the module), or None for scale."""
    if case.is_scale:
        return None
    size = (case.l_max + 1) ** 2
    per_column = {"mul": cg_block_macs(case.l_max), "vecsca": _cg_pairs(case.l_max, "i1"),
                  "scavec": _cg_pairs(case.l_max, "i2"), "inner": size * size}.get(case.op)
    if per_column is None:  # outer, vecmat, mat_t_vec: their own FLOPs (a shared weight's already folded)
        return OP.flops(case, "fwd")
    return 2.0 * per_column * case.channels * case.batch


def design_cap_pct(case, mode):
    """100 x the minimum bytes over the bytes the sibling products of ``mode`` move (see the module)."""
    item = case.torch_dtype.itemsize
    x, y, z = (case.numel(o) * item for o in "xyz")
    structure = OP.bytes(case, "fwd") - (x + y + z)  # one product's read of the terms
    moved = {"fwd": x + y + z, "bwd": 2 * (x + y + z), "double_bwd": 4 * (x + y) + 7 * z}[mode]
    return 100.0 * OP.bytes(case, mode) / (moved + PRODUCTS_PER_MODE[mode] * structure)


def floors(case, mode, args):
    nbytes = OP.bytes(case, mode)
    products = PRODUCTS_PER_MODE[mode]
    fma_s = OP.flops(case, mode) / (args.fma_tflops * 1e12)
    matmul_tflops = args.bf16_matmul_tflops if case.torch_dtype.itemsize == 2 else args.fp32_matmul_tflops
    matrix_s = products * matrix_unit_flops(case) / (matmul_tflops * 1e12)
    compute_s = min(fma_s, matrix_s)
    attainable = attainable_copy_pct(nbytes, args.copy_gbps, compute_s)
    cap = design_cap_pct(case, mode)
    return {"case": case.label, "mode": mode, "bytes": nbytes, "copy_us": nbytes / (args.copy_gbps * 1e9) * 1e6,
            "fma_us": fma_s * 1e6, "matrix_us": matrix_s * 1e6, "attainable_pct": attainable, "design_cap_pct": cap,
            "at_most_pct": min(attainable, cap)}


def table(args):
    ops = set(args.ops.split(",")) if args.ops else None
    unknown = (ops or set()) - set(PRODUCTS)
    if unknown:
        sys.exit(f"sparse_floors: unknown ops {sorted(unknown)}; known: {', '.join(PRODUCTS)}")
    return [floors(case, mode, args) for case in largest_n_cases(ops) if not case.is_scale for mode in MODES]


def markdown(rows, args):
    below = [r for r in rows if r["at_most_pct"] < args.bar]
    physical = [r for r in rows if r["attainable_pct"] < args.bar]
    lines = [f"# sparse products against the {args.bar:g}% copy-bandwidth bar (a model)", "",
             f"Copy {args.copy_gbps:g} GB/s; FMA units {args.fma_tflops:g} TF/s; tensor cores "
             f"{args.bf16_matmul_tflops:g} (16-bit) and {args.fp32_matmul_tflops:g} (fp32) TF/s. "
             "Each case at the sweep's largest N. "
             f"{len(below)} of {len(rows)} (case, mode) points cannot reach the bar: {len(physical)} by the card's "
             "peaks alone (attainable), the rest under the sibling-product design of the derivatives (design cap).", "",
             "| case | mode | MB | bytes us | FMA us | tensor-core us | attainable % | design cap % | at most % |",
             "|" + " --- |" * 9]
    for r in rows:
        bold = "**" if r["at_most_pct"] < args.bar else ""
        lines.append(f"| {r['case']} | {r['mode']} | {r['bytes'] / 1e6:.0f} | {r['copy_us']:.0f} | {r['fma_us']:.0f} | "
                     f"{r['matrix_us']:.0f} | {r['attainable_pct']:.1f} | {r['design_cap_pct']:.1f} | "
                     f"{bold}{r['at_most_pct']:.1f}{bold} |")
    return "\n".join(lines) + "\n"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown")
    parser.add_argument("--copy-gbps", type=float, default=3020.0)
    parser.add_argument("--fma-tflops", type=float, default=67.0)
    parser.add_argument("--bf16-matmul-tflops", type=float, default=989.0)
    parser.add_argument("--fp32-matmul-tflops", type=float, default=495.0)
    parser.add_argument("--bar", type=float, default=60.0)
    parser.add_argument("--ops", help="comma-separated products (default: all seven)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    text = markdown(table(args), args)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text.split("\n\n")[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
