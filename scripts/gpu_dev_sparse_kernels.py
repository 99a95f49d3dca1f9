#!/usr/bin/env python3
"""The sparse Triton kernels side by side with an earlier version of themselves, in one run on one GPU.

    python3 scripts/gpu_dev_sparse_kernels.py --baseline FILE [--json OUT.json] [--quick]
    python3 scripts/gpu_dev_sparse_kernels.py --dense-route [--json OUT.json] [--quick] [--old-every-size]
    python3 scripts/gpu_dev_sparse_kernels.py --dense-baseline FILE [--json OUT.json] [--quick] [--no-peers]
    python3 scripts/gpu_dev_sparse_kernels.py --outer-sum-route [--json OUT.json] [--quick] [--old-every-size]
    python3 scripts/gpu_dev_sparse_kernels.py --fold-route [--json OUT.json] [--quick] [--no-peers]
    python3 scripts/gpu_dev_sparse_kernels.py --fold-split [--json OUT.json] [--quick] [--no-peers]
    python3 scripts/gpu_dev_sparse_kernels.py --bilinear-route [--json OUT.json] [--quick] [--old-every-size]
    python3 scripts/gpu_dev_sparse_kernels.py --bilinear-baseline FILE [--json OUT.json] [--quick]
    python3 scripts/gpu_dev_sparse_kernels.py --fused-dense [--json OUT.json] [--quick]

FILE is an earlier ``attnbench/kernels/sparse/segment.py`` (``git show REV:attnbench/kernels/sparse/segment.py > FILE``). For each
case and mode the operator's own timed callables run three times: the Triton variant on this tree's kernels
(``new``), the same with the launchers swapped for FILE's (``old``), and the split-PyTorch variant; e3nn's
tensor product joins on the vecsca cases where it is installed. ``--dense-route`` instead compares the dense
route of vecsca, scavec and inner (``new``) with the segment kernel on the same tree (``old``: the route off),
over the vecsca anchors (L 2, 3, 4, 6; C 32, 128; N 1e4, 1e5), forward, backward and double backward (the
family is closed, so the derivatives take the route as well); old and the peers on N 1e4 only (the segment
kernel's double backward at L 6 N 1e5 runs for seconds). ``--dense-baseline FILE`` compares the dense route on
this tree (``new``) with the same route on an earlier ``attnbench/kernels/sparse/dense.py`` (``old``), at every size of
those anchors (``--no-peers``: split and e3nn left out). ``--outer-sum-route`` compares the FC layer's
shared-weight vecmat anchors (L 2, 3, 4, 6; C 32, 128; N 1e4, 1e5) with the batch sum of outer products (its weight
gradient, in backward and double backward) on matrix units (``new``: attnbench/kernels/sparse/outer_sum.py) against the
segment kernel on the same tree (``old``: the route off), old and split at N 1e4 only unless
``--old-every-size`` (the segment kernel's weight gradient runs for seconds at N 1e5). ``--fold-route`` compares
the same vecmat anchors with the fold route of the shared-weight products (``new``: attnbench/kernels/sparse/fold.py) against
the route off (``old``), at every size. ``--fold-split`` compares the fold route's 16-bit products on
attnbench/kernels/sparse/split_matmul.py (``new``: the switch on for the run, its size cap lifted) against two cuBLAS GEMMs with
fp32 outputs (``old``), over the vecmat anchors in bf16 (fp32 does not split). ``--bilinear-route`` compares mul on
its bilinear route (``new``: attnbench/kernels/sparse/bilinear.py) with the segment kernel (``old``: the route off, ALL_ROWS as
by default) over mul's anchors (L 2, 3, 4, 6; C 32, 128; N 1e4, 1e5) and L 2-3 C 32 at N 1e6, old where N is 1e4 or
L at most 3 unless ``--old-every-size``, errors against float64 at N 1e4 up to L 4 (L 6's dense float64 einsum
takes tens of GB; tests/sparse/test_gpu_routes.py checks L 6). ``--bilinear-baseline FILE`` compares the bilinear route on
this tree (``new``) with the same route on an earlier ``attnbench/kernels/sparse/bilinear.py`` (``old``; one from before the
scaled fp16 split through baseline_bilinear), over the same cases at every size. ``--fused-dense`` compares vecsca,
scavec and inner with the dense route's two steps in one program (``new``: attnbench/kernels/sparse/fused_dense.py) against its
two launches (``old``: the fused kernels off), at L 2 and 3 (where they apply; ``--fused-max-rows 32``: L 4 too, the
cap raised for the run; ``--fused-fp32``: fp32 through them too), C 32 and 128, N 1e5 and 1e6, fp32 and bf16
(``--quick``: N 1e6 bf16 C 32 alone).
``--match REGEX`` keeps the cases whose label matches (the route against the segment kernel on bf16 L 2 at both
sizes: ``--dense-route --match 'L2 .* bf16' --old-every-size --no-peers``). Each row gives the medians (CUDA events, L2
flushed), new/old and new/split, the new kernels' GB/s on the operator's minimum-bytes model as % of the
measured copy bandwidth, and the new result's error against the old one (the same sums in the same order, so
they should agree to rounding).
"""
import argparse
import contextlib
import importlib.util
import json
import re
import sys

import torch

import attnbench
from attnbench.bench import verify
from attnbench.operators.sparse import SparseCase
from attnbench.bench.roofline import ceilings, machine_info
from attnbench.sparse import triton_ops
from attnbench.bench.timing import measure

OP = attnbench.get("sparse")


def load_baseline(path, name="sparse_segment"):
    spec = importlib.util.spec_from_file_location(f"attnbench.kernels._baseline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def baseline_bilinear(path):
    """FILE's bilinear launcher, taking this tree's (hi, lo, scale) splits: a file from before the scaled fp16 split
    (07b2fe4: it had split_coefficients and took (hi, lo)) gets the halves where the scale is None (bf16) and splits
    fp16 itself, unscaled, as it did."""
    module = load_baseline(path, "sparse_bilinear")
    if not hasattr(module, "split_coefficients"):
        return module.bilinear_launch

    def launch(x, y, matrix, out_size, coefficients=None):
        halves = coefficients[:2] if coefficients is not None and coefficients[2] is None else None
        return module.bilinear_launch(x, y, matrix, out_size, halves)

    return launch


def cases(quick):
    """The FC layer's shared-weight vecmat (its DOT route and its weight gradient's batch splits are what changed),
    two vecsca and one scale case as controls (their kernels did not change), fp32 and bf16."""
    out = []
    for dtype in ("float32", "bfloat16"):
        for l_max, channels, batch in ((2, 32, 100_000), (3, 128, 10_000), (4, 32, 10_000), (2, 128, 100_000)):
            out.append(SparseCase("vecmat", l_max, batch, channels, dtype, "y"))
        for l_max, channels, batch in ((2, 128, 100_000), (4, 32, 10_000)):
            out.append(SparseCase("vecsca", l_max, batch, channels, dtype))
        out.append(SparseCase("scale", 3, 1_000_000, 128, dtype, structure="segment"))
        # the scale anchors' extremes and a random CSR (SparseScale on [M, C]: its channel lines, wip)
        out.append(SparseCase("scale", 2, 100_000, 32, dtype, structure="segment"))
        out.append(SparseCase("scale", 6, 100_000, 128, dtype, structure="segment"))
        out.append(SparseCase("scale", 3, 100_000, 128, dtype, structure="random"))
        out.append(SparseCase("scale", 3, 100_000, 128, dtype, structure="segment"))  # 2048 channels: 32 lines of 64
        for l_max in (3, 4, 6):  # channel counts of 16, 25 and 49 lines of 32
            out.append(SparseCase("scale", l_max, 100_000, 32, dtype, structure="segment"))
        for l_max in (2, 3, 4):  # the sweep's large N, where the backward's gather held at 42-62% of copy
            out.append(SparseCase("scale", l_max, 1_000_000, 32, dtype, structure="segment"))
    if quick:
        out = [c for c in out if c.dtype == "float32"][:4]
    return out


def segment_cases():
    """mul (the channel-wise tensor product: every term reads a channel row of x and of y) where the segment kernel
    runs it: large N first (the bandwidth bar), then N 1e5 and one N 1e4 case (fewer batch blocks)."""
    return [SparseCase("mul", l_max, batch, channels, dtype) for l_max, batch, channels, dtype in [
        (2, 1_000_000, 32, "float32"), (3, 1_000_000, 32, "bfloat16"), (2, 100_000, 32, "float32"),
        (3, 100_000, 32, "float32"), (2, 100_000, 128, "bfloat16"), (4, 100_000, 32, "bfloat16"),
        (3, 10_000, 32, "float32")]]


def anchor_cases(op, quick, shared=""):
    """The anchors of ``op`` (L 2, 3, 4, 6; C 32, 128; N 1e4, 1e5; fp32, bf16); ``quick``: four fp32 N 1e4 ones."""
    out = [SparseCase(op, l_max, batch, channels, dtype, shared)
           for dtype in ("float32", "bfloat16") for l_max in (2, 3, 4, 6) for channels in (32, 128)
           for batch in (10_000, 100_000)]
    return [c for c in out if c.dtype == "float32" and c.batch == 10_000][:4] if quick else out


# the routes an "old" run turns off, by the name it passes as ``launchers``
ROUTES_OFF = {"segment": triton_ops.dense_route, "outer-segment": triton_ops.outer_sum_by_dot,
              "fold-off": triton_ops.fold_route, "split-off": triton_ops.fold_split_matmul,
              "bilinear-off": triton_ops.bilinear_route, "fused-off": triton_ops.fused_dense}


def timed(case, x, mode, variant, launchers=None):
    """Median ms and outputs of a variant; ``launchers``: FILE's segment launchers swapped in, an earlier dense
    route's launcher (a function), ("bilinear", an earlier bilinear launcher), "segment" for the dense route turned
    off, "outer-segment" for the batch sum of outer products on the segment kernel, "fold-off" for the fold route of
    the shared-weight products off, or "split-off" for its 16-bit products on the cuBLAS pair (ROUTES_OFF)."""
    saved = (triton_ops.sparse_product_launch, triton_ops.sparse_scale_launch, triton_ops.dense_product_launch,
             triton_ops.bilinear_launch)
    switched = isinstance(launchers, str) and launchers in ROUTES_OFF
    route = ROUTES_OFF[launchers](False) if switched else contextlib.nullcontext()
    if callable(launchers):
        triton_ops.dense_product_launch = launchers
    elif isinstance(launchers, tuple) and launchers[0] == "bilinear":
        triton_ops.bilinear_launch = launchers[1]
    elif launchers and not switched:
        triton_ops.sparse_product_launch, triton_ops.sparse_scale_launch = launchers
    try:
        with route:
            fn = OP.variants[variant].prepare(case, x, mode)
            outputs = {k: v.detach().clone() for k, v in fn().items()}
            timing = measure(fn, "cuda")
            return timing.median_ms, outputs
    finally:
        (triton_ops.sparse_product_launch, triton_ops.sparse_scale_launch, triton_ops.dense_product_launch,
         triton_ops.bilinear_launch) = saved
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline")
    parser.add_argument("--dense-route", action="store_true")
    parser.add_argument("--dense-baseline")
    parser.add_argument("--outer-sum-route", action="store_true")
    parser.add_argument("--fold-route", action="store_true")
    parser.add_argument("--fold-split", action="store_true")
    parser.add_argument("--bilinear-route", action="store_true")
    parser.add_argument("--bilinear-baseline")
    parser.add_argument("--fused-dense", action="store_true")
    parser.add_argument("--fused-fp32", action="store_true", help="--fused-dense: fp32 through the fused kernels too")
    parser.add_argument("--fused-max-rows", type=int, default=None,
                        help="--fused-dense: the fused kernels' padded row cap for the run (32: L 4 as well)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--segment-ops", action="store_true",
                        help="with --baseline: mul at N 1e4-1e6 (the product kernel's cases), ALL_ROWS at any batch")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modes", default="fwd,bwd,double_bwd")
    parser.add_argument("--match", help="only the cases whose label matches (re.search), e.g. 'L2 .* bf16'")
    parser.add_argument("--old-every-size", action="store_true",
                        help="--dense-route, --outer-sum-route: time the segment kernel at N 1e5 too (slow)")
    args = parser.parse_args()
    comparisons = (args.dense_route, args.outer_sum_route, args.fold_route, args.fold_split, args.baseline,
                   args.dense_baseline, args.bilinear_route, args.bilinear_baseline, args.fused_dense)
    if sum(bool(c) for c in comparisons) != 1:
        parser.error("give one of --baseline FILE, --dense-route, --dense-baseline FILE, --outer-sum-route, "
                     "--fold-route, --fold-split, --bilinear-route, --bilinear-baseline FILE and --fused-dense")
    if args.bilinear_route or args.bilinear_baseline:
        old_launchers = ("bilinear", baseline_bilinear(args.bilinear_baseline)) if args.bilinear_baseline \
            else "bilinear-off"
        case_list = anchor_cases("mul", args.quick) + [SparseCase("mul", l_max, 1_000_000, 32, dtype)
                                                       for dtype in ("float32", "bfloat16") for l_max in (2, 3)]
    elif args.fused_dense:
        from attnbench.kernels.sparse import fused_dense as sparse_fused_dense
        old_launchers = "fused-off"
        levels = (2, 3)
        if args.fused_fp32:
            sparse_fused_dense.FUSED_DTYPES += (torch.float32,)
        if args.fused_max_rows:
            sparse_fused_dense.FUSED_ROWS["max"] = args.fused_max_rows
            levels = (2, 3, 4) if args.fused_max_rows >= 32 else levels
        case_list = [SparseCase(op, l_max, batch, channels, dtype) for dtype in ("bfloat16", "float32")
                     for batch in (1_000_000, 100_000) for op in ("vecsca", "scavec", "inner") for l_max in levels
                     for channels in (32, 128)]
        if args.quick:
            case_list = [c for c in case_list if c.batch == 1_000_000 and c.dtype == "bfloat16" and c.channels == 32]
    elif args.fold_split:
        # new: the split kernel at every size (the default stops at max_entries); old turns it off
        triton_ops.SPLIT_MATMUL.update(enabled=True, max_entries=float("inf"))
        old_launchers = "split-off"
        case_list = [c for c in anchor_cases("vecmat", False, "y") if c.dtype != "float32"]
        case_list = [c for c in case_list if c.batch == 10_000][:4] if args.quick else case_list
    elif args.fold_route:
        old_launchers, case_list = "fold-off", anchor_cases("vecmat", args.quick, "y")
    elif args.outer_sum_route:
        old_launchers, case_list = "outer-segment", anchor_cases("vecmat", args.quick, "y")
    elif args.dense_route:
        old_launchers, case_list = "segment", anchor_cases("vecsca", args.quick)
    elif args.dense_baseline:
        old_launchers = load_baseline(args.dense_baseline, "sparse_dense").dense_product_launch
        case_list = anchor_cases("vecsca", args.quick)
    else:
        old = load_baseline(args.baseline)
        old_launchers, case_list = (old.sparse_product_launch, old.sparse_scale_launch), cases(args.quick)
        if args.segment_ops:
            from attnbench.kernels.sparse import segment as sparse_segment
            sparse_segment.ALL_ROWS["min_batch"] = 0  # new: mul walks the rows at every batch; old: one row a program
            case_list = segment_cases()
    if args.match:
        case_list = [c for c in case_list if re.search(args.match, c.label)]
    ceil = ceilings("cuda")
    info = machine_info("cuda")
    print(f"# {info['device_name']} | torch {info['torch']} | triton {info['triton']} | copy {ceil.copy_gbps:.0f} GB/s")
    print("| case | mode | new ms | old ms | split ms | e3nn ms | new/old | new/split | new/e3nn | GB/s | % copy | "
          "new vs old err | new vs f64 err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for case in case_list:
        x = OP.make_inputs(case, "cuda", 0)
        oracle = None
        # the float64 einsum reference, every mode's outputs
        checked = (args.dense_route or args.dense_baseline or args.outer_sum_route or args.fold_route or args.fold_split
                   or args.bilinear_route or args.bilinear_baseline or args.fused_dense)
        bilinear = args.bilinear_route or args.bilinear_baseline
        if checked and case.batch <= 10_000 and not (bilinear and case.l_max > 4):  # L 6: GPU tests
            try:
                oracle = OP.oracle(case, x)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
        for mode in args.modes.split(","):
            row = {"case": case.label, "mode": mode}
            try:
                row["new_ms"], new_out = timed(case, x, mode, "triton")
                if oracle:
                    row["error"] = max(verify.relative_error(new_out[k], oracle[k]) for k in new_out)
                others = not (args.dense_route or args.outer_sum_route) or case.batch <= 10_000 or args.old_every_size
                if args.bilinear_route:  # the segment kernel at L 4-6 N 1e5 runs for seconds
                    others = case.batch <= 10_000 or case.l_max <= 3 or args.old_every_size
                if others or args.dense_baseline or args.bilinear_baseline:
                    row["old_ms"], old_out = timed(case, x, mode, "triton", old_launchers)
                    try:  # in float64: at N 1e6 C 2048 the outputs' copies may not fit where the kernels did
                        row["error_vs_old"] = max(verify.relative_error(new_out[k], old_out[k]) for k in new_out)
                    except torch.OutOfMemoryError:
                        row["error_vs_old"] = float("nan")
                        torch.cuda.empty_cache()
                    del old_out
                del new_out
                for peer in ("split", "e3nn") if others and not args.no_peers and not bilinear else ():
                    if peer in OP.variants and OP.variants[peer].unavailable_reason(torch.device("cuda")) is None:
                        try:
                            row[f"{peer}_ms"], _ = timed(case, x, mode, peer)
                        except Exception as exc:  # a peer that cannot run this case (out of memory, unsupported)
                            row[f"{peer}_skipped"] = str(exc).splitlines()[0][:80]
                row["gbps"] = OP.bytes(case, mode) / (row["new_ms"] / 1e3) / 1e9
                row["copy_pct"] = 100 * row["gbps"] / ceil.copy_gbps
            except torch.OutOfMemoryError:
                row["skipped"] = "out of memory"
                torch.cuda.empty_cache()
            rows.append(row)

            def ms(key):
                return f"{row[key]:.3f}" if key in row else "-"

            def ratio(key):
                return f"{row[key] / row['new_ms']:.2f}x" if key in row and "new_ms" in row else "-"

            print(f"| {case.label} | {mode} | {ms('new_ms')} | {ms('old_ms')} | {ms('split_ms')} | {ms('e3nn_ms')} | "
                  f"{ratio('old_ms')} | {ratio('split_ms')} | {ratio('e3nn_ms')} | {row.get('gbps', 0):.0f} | "
                  f"{row.get('copy_pct', 0):.1f} | {row.get('error_vs_old', float('nan')):.1e} | "
                  f"{row.get('error', float('nan')):.1e} |", flush=True)
        del x, oracle
        torch.cuda.empty_cache()
    picks = autotuner_picks()
    print("\nautotuner picks:\n" + "\n".join(f"- {k}: {v}" for k, v in picks.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "copy_gbps": ceil.copy_gbps, "rows": rows, "picks": picks}, f, indent=1)


def autotuner_picks():
    """The config each sparse kernel's autotuner chose, per tuning key, in this process (this tree's kernels)."""
    from attnbench.kernels.sparse import small_matmul
    from attnbench.kernels.sparse import bilinear as sparse_bilinear
    from attnbench.kernels.sparse import dense as sparse_dense
    from attnbench.kernels.sparse import fused_dense as sparse_fused_dense
    from attnbench.kernels.sparse import outer_sum as sparse_outer_sum
    from attnbench.kernels.sparse import segment as sparse_segment
    from attnbench.kernels.sparse import split_matmul

    kernels = {"scale": sparse_segment.sparse_scale_kernel, "scale_rows": sparse_segment.sparse_scale_rows_kernel,
               "product": sparse_segment.sparse_product_kernel,
               "outer_sum": sparse_outer_sum.outer_sum_kernel, "gather_rows": sparse_dense.gather_rows_kernel,
               "small_matmul": small_matmul.small_matmul_kernel, "gram_stack": sparse_dense.gram_stack_kernel,
               "split_matmul": split_matmul.split_matmul_kernel, "bilinear": sparse_bilinear.bilinear_kernel,
               "scaled_rows": sparse_fused_dense.scaled_rows_kernel, "gram_rows": sparse_fused_dense.gram_rows_kernel}
    return {f"{name} {key}": str(config) for name, kernel in kernels.items()
            for key, config in getattr(kernel, "cache", {}).items()}


if __name__ == "__main__":
    main()
