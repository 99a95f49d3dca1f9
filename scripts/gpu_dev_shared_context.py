#!/usr/bin/env python3
"""shared_context on a GPU in one call: correctness, timings, predictions, decisions, curve, model.

    python scripts/gpu_dev_shared_context.py                      # anchor cases (default)
    python scripts/gpu_dev_shared_context.py --sweep --model      # + speedup curve and TabPFN throughput
    OUT=/some/dir python scripts/gpu_dev_shared_context.py        # also write JSON (and a PNG) there

Per anchor case: every variant's error against the float64 oracle (bf16 inputs), then its time
(attnbench.bench.timing.measure: CUDA events, L2 flushed, median), GB/s on the operator's minimum bytes,
% of the machine's measured copy bandwidth and speed over the fastest peer; the fused Triton
kernel is also timed at several explicit tile configurations and split counts. Beside each
measurement stands the prediction made before any GPU run: the minimum bytes (context K/V once,
valid buffer entries, q, o, lse) at ~3.75 TB/s, and the compute floors (tensor-core FLOPs at the
measured matmul ceiling, exponentials at the SFU rate) that bind instead in the context-heavy cases.
Decision verdicts (attnbench.bench.decisions) close the run. On a CPU it runs the tiny cases through the
interpreter (a check that the script works, not timings).
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import attnbench
from attnbench.bench import decisions
from attnbench.bench import verify
from attnbench.kernels import shared_context as kernels
from attnbench.operators.shared_context import memory_traffic
from attnbench.bench.roofline import ceilings, exp_floor_s, machine_info
from attnbench.bench.timing import measure

OP = attnbench.get("shared_context")
PREDICTED_TBPS = 3.75  # assumed achievable bandwidth: ~88% of the H200's measured 4.27 TB/s copy
# Explicit launch configurations of the fused kernel to time beside the autotuned pick.
FUSED_CONFIGS = [  # BLOCK_NB: buffer keys per step over the step's samples
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_NB=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_NB=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_NB=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=256, BLOCK_N=64, BLOCK_NB=256, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_NB=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_NB=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_NB=32, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_NB=32, num_warps=4, num_stages=2),
]
SPLITS = (1, 2, 4, 8, 16, 32)


def predict(case, sms=132, matmul_tflops=700.0) -> dict:
    """What the fused kernel should take, from the cost model alone."""
    nbytes = OP.bytes(case, "fwd")
    flops = OP.flops(case, "fwd")
    exps = OP.exponentials(case, "fwd")
    ms = {"bytes": nbytes / (PREDICTED_TBPS * 1e12) * 1e3, "flops": flops / (matmul_tflops * 1e12) * 1e3,
          "exp": exp_floor_s(exps, sms) * 1e3}
    binding = max(ms, key=ms.get)
    return {"min_bytes": nbytes, "flops": flops, "exps": exps, "floor_ms": ms, "predicted_ms": ms[binding],
            "binding": binding, "bytes_ms": ms["bytes"]}


def _args(x):
    return x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"]


def timed(fn, device, rep_ms):
    try:
        return measure(fn, device, rep_ms=rep_ms), None
    except Exception as exc:  # a config that does not fit, a peer without the feature: report, go on
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def error_of(out, oracle):
    if isinstance(out, dict):
        return max(verify.relative_error(out[k], oracle[k]) for k in out)
    return max(verify.relative_error(t, oracle[k]) for t, k in zip(out, ("o", "lse")))


def run_case(case, device, rep_ms, ceil, with_configs, only=None):
    x = OP.make_inputs(case, device, 0)
    oracle = OP.oracle(case, x)
    entries = []

    def record(name, kind, fn, note=""):
        try:
            out = fn()
            err = error_of(out, oracle)
            del out
        except attnbench.Unsupported as exc:
            entries.append(dict(variant=name, kind=kind, skipped=str(exc)))
            return
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            entries.append(dict(variant=name, kind=kind, skipped=reason))
            return
        timing, failure = timed(fn, device, rep_ms)
        if timing is None:
            entries.append(dict(variant=name, kind=kind, skipped=failure))
            return
        gbps = OP.bytes(case, "fwd") / (timing.median_ms * 1e-3) / 1e9
        entries.append(dict(variant=name, kind=kind, note=note, error=err, median_ms=timing.median_ms,
                            iqr_ms=timing.iqr_ms, gbps=gbps, copy_pct=100 * gbps / ceil.copy_gbps if ceil else None))

    for name, variant in OP.variants.items():
        if variant.unavailable_reason(torch.device(device)) is not None or (only and name not in only):
            continue
        try:
            fn = variant.prepare(case, x, "fwd")
        except attnbench.Unsupported as exc:
            entries.append(dict(variant=name, kind=variant.kind, skipped=str(exc)))
            continue
        except torch.OutOfMemoryError:
            entries.append(dict(variant=name, kind=variant.kind, skipped="out of memory"))
            continue
        record(name, variant.kind, fn)
        fn = None
        torch.cuda.empty_cache() if device == "cuda" else None
    if with_configs:
        args = _args(x)
        if device == "cpu":
            configs, splits = [None], (3,)
        else:
            configs, splits = FUSED_CONFIGS, SPLITS
        for cfg in configs:
            label = ("autotuned" if cfg is None
                     else "M{BLOCK_M} N{BLOCK_N} NB{BLOCK_NB} w{num_warps} s{num_stages}".format(**cfg))
            record(f"fused[{label}]", "config",
                   lambda cfg=cfg: kernels.fused_launch(*args, case.causal, case.softmax_scale, config=cfg))
        for s in splits:
            record(f"fused[splits={s}]", "config",
                   lambda s=s: kernels.fused_launch(*args, case.causal, case.softmax_scale, num_splits=s))
    del x, oracle
    return entries


def fmt(v, spec, empty="-"):
    return empty if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def print_case(case, entries, pred, traffic):
    peers = [e for e in entries if e.get("kind") == "peer" and "median_ms" in e]
    best_peer = min(peers, key=lambda e: e["median_ms"]) if peers else None
    print(f"\n## {case.label}")
    print(f"   min bytes {pred['min_bytes'] / 1e6:.2f} MB (per-batch layout {traffic['per_batch_total'] / 1e6:.1f} MB, "
          f"{traffic['per_batch_over_shared']:.1f}x); predicted {pred['predicted_ms'] * 1e3:.1f} us "
          f"({pred['binding']}-bound; bytes {pred['floor_ms']['bytes'] * 1e3:.1f} us at {PREDICTED_TBPS} TB/s, "
          f"matmul {pred['floor_ms']['flops'] * 1e3:.1f} us, exp {pred['floor_ms']['exp'] * 1e3:.1f} us)")
    print(f"   {'variant':34s} {'ms':>9s} {'GB/s':>8s} {'%copy':>6s} {'vs best peer':>12s} {'vs predicted':>12s} "
          f"{'rel err':>8s}")
    for e in entries:
        if "median_ms" not in e:
            print(f"   {e['variant']:34s} skipped: {e['skipped']}")
            continue
        speed = best_peer["median_ms"] / e["median_ms"] if best_peer else None
        print(f"   {e['variant']:34s} {e['median_ms']:9.4f} {e['gbps']:8.0f} {fmt(e['copy_pct'], '6.0f'):>6s} "
              f"{fmt(speed, '11.2f') + 'x' if speed else '-':>12s} "
              f"{e['median_ms'] / pred['predicted_ms']:11.2f}x {e['error']:8.1e}")
    if best_peer:
        print(f"   best peer: {best_peer['variant']} {best_peer['median_ms']:.4f} ms")


def sweep(device, rep_ms):
    """Speedup of the fused kernel over the fastest gate baseline across (B, Nctx, Nbuf)."""
    points = []
    for case in OP.cases("sweep"):
        x = OP.make_inputs(case, device, 0)
        times = {}
        for name in ("triton", *OP.gate_baselines):
            variant = OP.variants[name]
            if variant.unavailable_reason(torch.device(device)) is not None:
                continue
            try:
                timing, _ = timed(variant.prepare(case, x, "fwd"), device, rep_ms)
            except (attnbench.Unsupported, torch.OutOfMemoryError):
                continue
            if timing:
                times[name] = timing.median_ms
        del x
        torch.cuda.empty_cache()
        base = min((n for n in times if n != "triton"), key=times.get, default=None)
        if "triton" in times and base:
            points.append(dict(case=case.label, batch=case.batch, n_ctx=case.n_ctx, n_buf=case.n_buf,
                               triton_ms=times["triton"], baseline=base, baseline_ms=times[base],
                               speedup=times[base] / times["triton"]))
            print(f"   sweep {case.label:40s} triton {times['triton']:.4f} ms, {base} {times[base]:.4f} ms: "
                  f"{points[-1]['speedup']:.2f}x", flush=True)
    return points


def plot_sweep(points, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("   (no matplotlib: no plot)")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, n_buf in zip(axes, sorted({p["n_buf"] for p in points})):
        for n_ctx in sorted({p["n_ctx"] for p in points}):
            sel = sorted((p for p in points if p["n_buf"] == n_buf and p["n_ctx"] == n_ctx), key=lambda p: p["batch"])
            ax.plot([p["batch"] for p in sel], [p["speedup"] for p in sel], marker="o", label=f"Nctx {n_ctx}")
        ax.axhline(1.3, color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"Nbuf {n_buf}")
        ax.set_xlabel("batch B")
    axes[0].set_ylabel("fused Triton speed / fastest baseline")
    axes[0].legend()
    fig.suptitle("shared_context (H4 D32 Lq2 bf16): speedup over the best of per-batch SDPA, split, expand, fold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def model_throughput(device, rep_ms, batch=1024, n_ctx=2048, steps=16):
    """Full 12-layer decode step and sample_sequence throughput of the default TabPFN-like model."""
    from attnbench.models.tabpfn import BACKENDS, TabPFNLike

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    filled = 32
    if device == "cpu":  # the interpreter: prove the code path only
        batch, n_ctx, steps, filled = 2, 20, 2, 2
    gen = torch.Generator().manual_seed(0)
    x_ctx = torch.randn(n_ctx, 8, generator=gen).to(device, dtype)
    y_ctx = torch.randn(n_ctx, generator=gen).to(device, dtype)
    x_tgt = torch.randn(steps, 8, generator=gen).to(device, dtype)
    results = {}
    for backend in BACKENDS:
        model = TabPFNLike(seed=0, backend=backend).to(device, dtype)
        try:
            cache = model.prefill_context(x_ctx, y_ctx, batch, filled + 1)
            xq = x_tgt[:1].expand(batch, -1)
            yp = torch.zeros(batch, device=device, dtype=dtype)
            for _ in range(filled):  # fill the buffers
                model.decode_step(cache, xq, xq, yp)
            length = cache.length

            def step():
                cache.length = length  # re-run the 33rd step in place: timing only
                return model.decode_step(cache, xq, xq, yp)

            step_t, failure = timed(step, device, rep_ms)
            # untimed first: autotuning happens once per buffer-length bucket
            model.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=batch, seed=0)
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            model.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=batch, seed=0)
            torch.cuda.synchronize() if device == "cuda" else None
            seq_s = time.perf_counter() - t0
            results[backend] = dict(decode_step_ms=step_t.median_ms if step_t else None, step_failure=failure,
                                    sample_sequence_s=seq_s, samples_per_s=batch / seq_s,
                                    rows_per_s=batch * steps / seq_s)
            print(f"   model {backend:16s} decode step (12 layers, B{batch} ctx{n_ctx} buf{filled} Lq2) "
                  f"{fmt(step_t and step_t.median_ms, '.3f')} ms; sample_sequence T{steps}: {seq_s:.3f} s = "
                  f"{batch / seq_s:.0f} joint samples/s", flush=True)
        except Exception as exc:
            results[backend] = dict(failure=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            print(f"   model {backend:16s} failed: {results[backend]['failure']}")
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="case set (default: anchor on CUDA, tiny on CPU)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N cases")
    parser.add_argument("--case-index", type=int, action="append", help="only these cases (repeatable)")
    parser.add_argument("--variant", action="append", help="only these variants (repeatable; default: all)")
    parser.add_argument("--no-configs", action="store_true", help="skip the explicit fused-kernel configurations")
    parser.add_argument("--sweep", action="store_true", help="also the B x Nctx x Nbuf speedup curve (+ plot)")
    parser.add_argument("--model", action="store_true", help="also the TabPFN-like model's decode throughput")
    parser.add_argument("--rep-ms", type=float, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON/PNG (default: $OUT)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = machine_info(device)
    ceil = ceilings(device)
    sms = info.get("multiprocessors", 132)
    matmul = ceil.matmul_tflops if ceil else 700.0
    print(f"# {info['device_name']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']}")
    if ceil:
        print(f"# measured ceilings: bf16 matmul {ceil.matmul_tflops:.0f} TF/s, copy {ceil.copy_gbps:.0f} GB/s")
    else:
        print("# CPU: Triton runs in the interpreter; times check that the script works, nothing more")
    cases = OP.cases(args.cases or ("anchor" if device == "cuda" else "tiny"))[:args.limit]
    if args.case_index:
        cases = [cases[i] for i in args.case_index]
    report = {"machine": info, "ceilings": ceil.__dict__ if ceil else None, "predicted_tbps": PREDICTED_TBPS,
              "cases": []}
    bench_rows = []
    for case in cases:
        t0 = time.perf_counter()
        pred = predict(case, sms, matmul)
        entries = run_case(case, device, args.rep_ms, ceil, not args.no_configs, args.variant)
        traffic = memory_traffic(case)
        print_case(case, entries, pred, traffic)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
        report["cases"].append(dict(case=case.label, prediction=pred, traffic=traffic, entries=entries))
        bench_rows += [dict(op=OP.name, case=case.label, mode="fwd", variant=e["variant"],
                            timing={"median_ms": e["median_ms"]}) for e in entries
                       if "median_ms" in e and e["kind"] != "config"]
    verdicts = decisions.decide(bench_rows)
    print("\n" + decisions.markdown(verdicts, "shared_context decision points"))
    report["decisions"] = [v.__dict__ for v in verdicts]
    if args.sweep:
        print("\n## speedup curve (sweep)")
        report["sweep"] = sweep(device, args.rep_ms)
    if args.model:
        print("\n## TabPFN-like model, 12 layers")
        report["model"] = model_throughput(device, args.rep_ms)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "shared_context_dev.json").write_text(json.dumps(report, indent=1, default=str))
        decisions.write(verdicts, out, "shared_context_decisions", info)
        if report.get("sweep"):
            plot_sweep(report["sweep"], out / "shared_context_speedup.png")
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
