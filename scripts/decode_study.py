"""Where the split-KV decode's time goes at the random set's decode shapes, and what its kernel can reach there.

Issue 37 asks decode (Nq <= 16) for >= 80% of copy bandwidth; the random set's decode shapes read 25-76% (the big
`decode` set reads 90-102%). For each decode shape of flash's random set whose visible K and V take at least
MIN_COPY_US at copy bandwidth this times, GPU time by CUDA events with the L2 flushed (kernels/gpu_time.py):
- the default call (the rule's split count, the autotuner's pick) and the pick itself;
- the merge of the splits alone (merge_states' stack kernel on states of the same shape);
- every launch config (the kernel's list and EXTRA_CONFIGS) at split counts around the rule's,
so that the gap splits into what a better choice of splits or config would win and what the kernel cannot reach.

    python scripts/decode_study.py OUT.json [--match RE] [--warm N] [--no-grid]     (a CUDA GPU)
    ncu --profile-from-start off ... python scripts/decode_study.py --ncu [--match RE]
                          (the default call of each shape once between cudaProfilerStart and Stop, after warming)

--warm N compiles every launch the study makes in N processes first (Triton's disk cache is shared), so that the
timing pass loads kernels instead of compiling them one after another. Each shape's row is written as soon as it
is timed: a call cut short keeps what finished.
"""
import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

MIN_COPY_US = 10.0
MAX_NQ = 16  # the decode
# launch configs the kernel's list lacks, tried here only: wider key blocks and 8 warps (more bytes and work in
# flight in each program where one or two fit an SM), and fewer warps (more programs an SM)
EXTRA_CONFIGS = ((8, 2, 128), (8, 3, 64), (8, 2, 256), (4, 2, 256), (2, 3, 64), (2, 4, 32), (8, 4, 32))


def decode_cases(pattern):
    from attnbench.operators.flash import _random
    from attnbench.kernels.tiling import visible_key_count

    copy = _copy_bytes_per_us()
    for case in _random():
        if case.seqlen_q > MAX_NQ or not re.search(pattern, case.label):
            continue
        visible = visible_key_count(case.seqlen_q, case.seqlen_k, case.causal_offset)
        kv_bytes = 2 * case.batch * case.heads_kv * visible * case.head_dim * _element_bytes(case)
        if kv_bytes / copy >= MIN_COPY_US:
            yield case, visible, kv_bytes, kv_bytes / copy / 1e3


def _element_bytes(case):
    return case.torch_dtype.itemsize


def _copy_bytes_per_us():
    from attnbench.bench.roofline import ceilings

    return ceilings(torch.device("cuda")).copy_gbps * 1e3


def inputs(case):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = case.torch_dtype
    return tuple(torch.randn(case.batch, heads, n, case.head_dim, device="cuda", generator=gen).to(dtype)
                 for heads, n in ((case.heads_q, case.seqlen_q), (case.heads_kv, case.seqlen_k),
                                  (case.heads_kv, case.seqlen_k)))


def all_configs():
    from attnbench.kernels.attention import flash_decode
    from attnbench.kernels.tuning import cfg

    listed = list(flash_decode.flash_decode_kernel.configs)
    have = {(c.num_warps, c.num_stages, c.kwargs["BLOCK_N"]) for c in listed}
    return listed + [cfg(w, s, BLOCK_N=n) for w, s, n in EXTRA_CONFIGS if (w, s, n) not in have]


def config_name(c):
    return f"w{c.num_warps} s{c.num_stages} n{c.kwargs['BLOCK_N']}"


def fits(config, case):
    """The kernel's own pruning rules (shared memory, accumulator registers) for this case's tile."""
    from attnbench.kernels.attention import flash_decode as fd
    from attnbench.kernels.tuning import shared_memory_budget

    block_m, _, _ = fd.decode_plan(case.batch, case.heads_q, case.seqlen_q, case.heads_kv, case.seqlen_k, "cuda")
    block_d, block_d2 = fd.decode_head_blocks(case.head_dim)
    shared = fd._decode_shared_bytes(config, _element_bytes(case), block_d + block_d2)
    return (shared <= shared_memory_budget(torch.device("cuda"))
            and fd._accumulator_fits(config, dict(BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_D2=block_d2)))


class forced:
    """The decode kernel restricted to one config (None: its own list, autotuned), plans forgotten around it."""

    def __init__(self, config):
        self.config = config

    def __enter__(self):
        from attnbench.kernels.attention.flash_decode import flash_decode_kernel
        from attnbench.kernels.launch import forget_plans

        self.saved = flash_decode_kernel.configs
        if self.config is not None:
            flash_decode_kernel.configs = [self.config]
            flash_decode_kernel.cache.clear()
        forget_plans()

    def __exit__(self, *exc):
        from attnbench.kernels.attention.flash_decode import flash_decode_kernel
        from attnbench.kernels.launch import forget_plans

        if self.config is not None:
            flash_decode_kernel.configs = self.saved
            flash_decode_kernel.cache.clear()
        forget_plans()


def split_counts(rule, visible):
    from attnbench.kernels.attention.flash_decode import MAX_SPLITS

    return sorted({s for s in (1, max(1, rule // 2), rule, rule * 2) if s <= min(MAX_SPLITS, max(1, visible // 64))})


def plan_of(case, visible):
    from attnbench.kernels.attention.flash_decode import decode_plan

    return decode_plan(case.batch, case.heads_q, case.seqlen_q, case.heads_kv, visible, torch.device("cuda"))


def launches(case, visible, grid=True):
    """(config or None, splits) of every launch the study times at this case (the default's alone without ``grid``)."""
    rule = plan_of(case, visible)[2]
    yield None, rule
    for config in all_configs() if grid else ():
        if fits(config, case):
            for splits in split_counts(rule, visible):
                yield config, splits


def _warm_one(job):
    """Compile (and, for the default, autotune) one case's launches in a worker; returns how many ran."""
    index, grid = job
    from attnbench.kernels.attention.flash_decode import flash_decode_launch

    case, visible, _, _ = next(c for i, c in enumerate(decode_cases(".")) if i == index)
    q, k, v = inputs(case)
    done = 0
    for config, splits in launches(case, visible, grid):
        with forced(config):
            flash_decode_launch(q, k, v, case.head_dim ** -0.5, case.causal_offset, num_splits=splits)
        done += 1
    torch.cuda.synchronize()
    return done


def merge_ms(case, splits):
    """The merge of ``splits`` fp32 states of this case's output alone (what a split launch adds after the kernel)."""
    from attnbench.kernels.gpu_time import gpu_time_median_ms
    from attnbench.kernels.merge_states import merge_stack_launch
    from attnbench.kernels.precision import STATE_LSE_DTYPE, lse_dtype

    if splits == 1:
        return 0.0
    dtype = case.torch_dtype
    shape = (splits, case.batch, case.heads_q, case.seqlen_q)
    o = torch.randn(*shape, case.head_dim, device="cuda")
    lse = torch.randn(*shape, device="cuda", dtype=STATE_LSE_DTYPE)
    see_from = 0 if case.causal_offset is None else max(0, -int(case.causal_offset))
    run = lambda: merge_stack_launch(o, lse, dtype, see_from=see_from, out_lse_dtype=lse_dtype(dtype), state_lse=True)
    run()
    return gpu_time_median_ms(run)


def study(case, visible, kv_bytes, copy_ms, grid=True):
    from attnbench.kernels.attention.flash_decode import flash_decode_kernel, flash_decode_launch
    from attnbench.kernels.gpu_time import gpu_time_median_ms

    q, k, v = inputs(case)
    scale, offset = case.head_dim ** -0.5, case.causal_offset
    block_m, tiles, rule = plan_of(case, visible)
    row = dict(case=case.label, visible=visible, block_m=block_m, row_tiles=tiles, rule_splits=rule,
               kv_mb=kv_bytes / 1e6, copy_ms=copy_ms, grid={})
    for config, splits in launches(case, visible, grid):
        with forced(config):
            run = lambda: flash_decode_launch(q, k, v, scale, offset, num_splits=splits)
            run()
            ms = gpu_time_median_ms(run)
            if config is None:
                row.update(rule_ms=ms, rule_config=config_name(flash_decode_kernel.best_config))
            else:
                row["grid"][f"{config_name(config)} x{splits}"] = ms
    best = min(row["grid"], key=row["grid"].get) if row["grid"] else None
    row.update(best=best, best_ms=row["grid"].get(best, row["rule_ms"]),
               merge_ms={s: merge_ms(case, s) for s in sorted({rule, *split_counts(rule, visible)})})
    return row


def profile_defaults(pattern):
    """Each shape's default call once inside cudaProfilerStart/Stop (after a warm call: compiled and tuned)."""
    from attnbench.kernels.attention.flash_decode import flash_decode_launch

    for case, visible, _, _ in decode_cases(pattern):
        q, k, v = inputs(case)
        run = lambda: flash_decode_launch(q, k, v, case.head_dim ** -0.5, case.causal_offset)
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {case.label}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--match", default=".")
    parser.add_argument("--warm", type=int, default=0, help="compile every launch first in this many processes")
    parser.add_argument("--ncu", action="store_true", help="profile each shape's default call once (under ncu)")
    parser.add_argument("--no-grid", dest="grid", action="store_false",
                        help="time the default call and the merges alone, not every config and split count")
    args = parser.parse_args()
    if args.ncu:
        profile_defaults(args.match)
        return
    cases = list(decode_cases(args.match))
    print(f"{len(cases)} decode shapes", flush=True)
    if args.warm:
        indices = [i for i, c in enumerate(decode_cases(".")) if re.search(args.match, c[0].label)]
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.warm, mp_context=ctx) as pool:
            print(f"warmed {sum(pool.map(_warm_one, [(i, args.grid) for i in indices]))} launches", flush=True)
    rows = []
    for case, visible, kv_bytes, copy_ms in cases:
        rows.append(study(case, visible, kv_bytes, copy_ms, args.grid))
        r = rows[-1]
        print(f"{r['case']}: rule x{r['rule_splits']} {r['rule_config']} {r['rule_ms']:.4f} ms "
              f"({100 * copy_ms / r['rule_ms']:.0f}% of copy), best {r['best']} {r['best_ms']:.4f} ms "
              f"({100 * copy_ms / r['best_ms']:.0f}%), copy {copy_ms:.4f}, merge {r['merge_ms']}", flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
