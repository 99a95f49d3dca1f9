#!/usr/bin/env python3
"""Where the fused shared_context kernel spends its time, one case at a time (a GPU dev script).

    python3 scripts/gpu_dev_shared_context_phases.py                      # the default cases
    python3 scripts/gpu_dev_shared_context_phases.py --case 4096,4,4,2,512,32,32 --configs
    python3 scripts/gpu_dev_shared_context_phases.py --baseline FILE       # + an earlier kernels file
    ncu --profile-from-start off ... python3 scripts/gpu_dev_shared_context_phases.py --profile

Per case (B, H, Hkv, Lq, Nctx, Nbuf, D; bf16, full buffers): the autotuned fused kernel (its pick
of tile config and split count), the phases alone (``buffer_launch``, ``context_launch``), the
fused kernel under CUDA-graph replay (L2 warm, no host) and under triton's do_bench (the timing
core before attnbench/kernels/gpu_time.py), and with ``--configs`` explicit tile
configs and split counts. Times are medians of CUDA events with L2 flushed and host time kept out
(attnbench.bench.timing);
GB/s counts the operator's minimum bytes. ``--baseline FILE`` loads another version of
attnbench/kernels/shared_context/__init__.py (``git show REV:attnbench/kernels/shared_context/__init__.py``) and times it as "old" beside
this tree's "new", in the same run.
``--profile`` runs each fused kernel once more inside cudaProfilerStart/Stop, after the timing, for
``ncu --profile-from-start off``.
"""
import argparse
import importlib.util
import json
import os

import torch
import triton.testing

import attnbench
from attnbench.bench import verify
from attnbench.kernels import shared_context as current
from attnbench.kernels.launch import forget_plans
from attnbench.operators.shared_context import SharedContextCase
from attnbench.bench.timing import measure

OP = attnbench.get("shared_context")
DEFAULT_CASES = ["256,4,4,1,512,0,32", "4096,4,4,2,2048,0,32", "4096,4,4,2,512,32,32", "1024,4,4,2,2048,32,32",
                 "256,4,4,2,10000,32,32", "512,32,8,1,8192,256,128"]
CONFIGS = [dict(BLOCK_M=128, BLOCK_N=64, BLOCK_NB=128, num_warps=8, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=64, BLOCK_NB=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=256, BLOCK_N=64, BLOCK_NB=256, num_warps=8, num_stages=2),
           dict(BLOCK_M=128, BLOCK_N=64, BLOCK_NB=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_NB=128, num_warps=8, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_NB=128, num_warps=8, num_stages=2),
           dict(BLOCK_M=64, BLOCK_N=128, BLOCK_NB=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=128, BLOCK_NB=128, num_warps=4, num_stages=2),
           dict(BLOCK_M=64, BLOCK_N=32, BLOCK_NB=128, num_warps=4, num_stages=4),
           dict(BLOCK_M=32, BLOCK_N=64, BLOCK_NB=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=16, BLOCK_N=64, BLOCK_NB=128, num_warps=2, num_stages=3)]
SPLITS = (1, 2, 4, 8)
PEERS = ("fold_flash", "fold_cudnn")


def load_kernels(path):
    spec = importlib.util.spec_from_file_location("attnbench.kernels._baseline_shared_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_case(text):
    b, h, hkv, lq, ctx, buf, d = (int(v) for v in text.split(","))
    return SharedContextCase(b, h, hkv, lq, ctx, buf, d)


def run_case(case, modules, with_configs, profile, overlap=False):
    x = OP.make_inputs(case, "cuda", 0)
    args = (x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"])
    oracle = OP.oracle(case, x)
    nbytes = OP.bytes(case, "fwd")
    rows = []

    def record(label, fn, graph=False):
        try:
            out = fn()
            err = max(verify.relative_error(o, oracle[k]) for o, k in zip(out, ("o", "lse"))) \
                if isinstance(out, tuple) and isinstance(out[0], torch.Tensor) else None
            ms = measure(fn, "cuda", rep_ms=60).median_ms
            g = measure(fn, "cuda", rep_ms=60, cuda_graph=True).median_ms if graph else None
            # the timing core before gpu_time.py, for comparison: do_bench's events read host time
            db = triton.testing.do_bench(fn, warmup=25, rep=60, return_mode="median") if graph else None
        except Exception as exc:  # a config that does not fit: report it, go on
            print(f"   {label:44s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
            return
        gb = nbytes / (ms * 1e-3) / 1e9
        extra = f"  graph {g * 1e3:7.1f} us ({nbytes / (g * 1e-3) / 1e9:5.0f} GB/s), do_bench {db * 1e3:7.1f} us" \
            if g else ""
        print(f"   {label:44s} {ms * 1e3:8.1f} us {gb:6.0f} GB/s  err {err if err is None else f'{err:.1e}'}{extra}",
              flush=True)
        rows.append(dict(label=label, us=ms * 1e3, gbps=gb, graph_us=None if g is None else g * 1e3,
                         do_bench_us=None if db is None else db * 1e3, error=err))

    print(f"## {case.label}: min bytes {nbytes / 1e6:.2f} MB", flush=True)
    variants = OP.available_variants("cuda")
    for peer in PEERS:  # the same three timings of the peers that the gate compares against
        if peer in variants:
            record(peer, variants[peer].prepare(case, x, "fwd"), graph=True)
    for name, mod in modules.items():
        forget_plans()  # launch plans are keyed by the call, not the module: the other version's would run
        fused = lambda mod=mod: mod.fused_launch(*args, case.causal, case.softmax_scale)  # noqa: E731
        record(f"{name} fused (autotuned)", fused, graph=True)
        cls = mod._head_dim_class(case.head_dim)
        best = getattr(mod.FUSED[cls], "best_config", None)
        picks = {k: v for k, v in mod._SPLIT_PICKS.items() if k[0] == "fused"}
        print(f"      pick: {best}; splits {list(picks.values())[-1:] or '-'}", flush=True)
        if with_configs:
            if case.n_buf:
                record(f"{name} buffer alone", lambda mod=mod: mod.buffer_launch(
                    x["q"], x["k_buf"], x["v_buf"], x["buf_lens"], case.causal, case.softmax_scale))
            if case.n_ctx:
                record(f"{name} context alone", lambda mod=mod: mod.context_launch(
                    x["q"], x["k_ctx"], x["v_ctx"], case.softmax_scale))
            for cfg in CONFIGS:
                label = "M{BLOCK_M} N{BLOCK_N} NB{BLOCK_NB} w{num_warps} s{num_stages}".format(**cfg)
                record(f"{name} fused [{label}]", lambda cfg=cfg, mod=mod: mod.fused_launch(
                    *args, case.causal, case.softmax_scale, config=cfg))
            for s in SPLITS:
                record(f"{name} fused [splits={s}]", lambda s=s, mod=mod: mod.fused_launch(
                    *args, case.causal, case.softmax_scale, num_splits=s))
    if overlap and case.n_ctx and case.n_buf:
        # Would buffer and context overlap if they ran in programs of their own? The two kernels
        # alone, one after the other on one stream, then forked onto two streams (same launches).
        side = torch.cuda.Stream()

        def buffer_part():
            return current.buffer_launch(x["q"], x["k_buf"], x["v_buf"], x["buf_lens"], case.causal,
                                         case.softmax_scale, out_dtype=torch.float32)

        def context_part():
            return current.context_launch(x["q"], x["k_ctx"], x["v_ctx"], case.softmax_scale, out_dtype=torch.float32)

        def serial():
            return buffer_part(), context_part()

        def forked():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                b = buffer_part()
            c = context_part()
            main.wait_stream(side)
            return b, c

        record("buffer then context, one stream", serial)
        record("buffer | context, two streams", forked)
    if profile:
        for name, mod in modules.items():
            forget_plans()
            mod.fused_launch(*args, case.causal, case.softmax_scale)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            mod.fused_launch(*args, case.causal, case.softmax_scale)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    torch.cuda.empty_cache()
    return dict(case=case.label, min_bytes=nbytes, rows=rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="B,H,Hkv,Lq,Nctx,Nbuf,D (repeatable)")
    parser.add_argument("--baseline", help="an earlier attnbench/kernels/shared_context/__init__.py to time beside this tree's")
    parser.add_argument("--configs", action="store_true", help="also the phases alone, tile configs, split counts")
    parser.add_argument("--profile", action="store_true", help="one fused launch per case inside cudaProfilerStart")
    parser.add_argument("--overlap", action="store_true", help="buffer and context kernels serial vs on two streams")
    parser.add_argument("--json", help="write the rows here")
    a = parser.parse_args()
    modules = {"new": current}
    if a.baseline:
        modules["old"] = load_kernels(a.baseline)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    out = [run_case(parse_case(c), modules, a.configs, a.profile, a.overlap) for c in (a.case or DEFAULT_CASES)]
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
