"""Verify and benchmark operators: the loops behind ``attnbench check|bench|run`` and the asv suites.

Every benchmark row also carries the max relative error of the timed call's own outputs against
the float64 oracle, so a fast number from a wrong kernel cannot pass unnoticed.
"""
import gc
import math
import sys
import time
from dataclasses import dataclass

import torch

from . import verify
from .kernels import interpreting
from .registry import Unsupported
from .roofline import achieved, ceilings
from .timing import Timing, measure, peak_memory_bytes


class Progress:
    """One line per step on stderr: long GPU runs show where they are and how long it has taken."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    def step(self, label: str):
        self.done += 1
        if self.enabled:
            width = len(str(self.total))
            print(f"[{self.done:>{width}}/{self.total}] {time.perf_counter() - self.start:7.1f}s  {label}",
                  file=self.stream, flush=True)


def _release(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def select_variants(op, device, names=None):
    available = op.available_variants(device)
    if names is None:
        return list(available)
    unknown = [n for n in names if n not in op.variants]
    if unknown:
        raise ValueError(f"{op.name}: unknown variant(s) {unknown}; known: {list(op.variants)}")
    return [n for n in names if n in available]


def check(op, cases, device, variants=None, modes=None, seed=0, progress=True) -> list:
    """Verify each variant on each case and mode against the float64 oracle."""
    names = select_variants(op, device, variants)
    modes = modes or op.modes
    bar = Progress(len(cases) * len(modes) * len(names), progress)
    results = []
    for case in cases:
        x = op.make_inputs(case, device, seed)
        oracle, lowp = op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype)
        for mode in modes:
            for name in names:
                try:
                    result = verify.check_variant(op, name, case, mode, x, oracle, lowp)
                except torch.OutOfMemoryError:
                    result = verify.CheckResult(op.name, name, case.label, mode, skipped="out of memory")
                results.append(result)
                status = "skip" if result.skipped else ("ok" if result.passed else "FAIL")
                bar.step(f"check {op.name} {name:14s} {mode:7s} {case.label}  {status}")
                _release(device)
        del x, oracle, lowp
        _release(device)
    return results


@dataclass
class BenchRow:
    op: str
    case: str
    mode: str
    variant: str
    timing: Timing | None = None
    tflops: float = math.nan
    gbps: float = math.nan
    roofline_pct: float | None = None
    speedup: float | None = None  # baseline median / this median, same case and mode
    baseline: str | None = None
    max_error: float = math.nan
    peak_mem_bytes: int | None = None
    skipped: str = ""

    def as_dict(self):
        d = {k: v for k, v in self.__dict__.items() if k != "timing"}
        d["timing"] = self.timing.as_dict() if self.timing else None
        return d


def bench(op, cases, device, variants=None, modes=None, seed=0, baseline=None, cuda_graph=False,
          verify_outputs=True, progress=True, rep_ms=100) -> list:
    """Time each variant on each case and mode; rows carry throughput, roofline and error."""
    device = torch.device(device)
    names = select_variants(op, device, variants)
    modes = modes or op.modes
    base = baseline or op.baseline(device, names)
    ceil = ceilings(device)
    bar = Progress(len(cases) * len(modes) * len(names), progress)
    rows = []
    for case in cases:
        x = op.make_inputs(case, device, seed)
        oracle = op.oracle(case, x) if verify_outputs else None
        for mode in modes:
            mode_rows = []
            for name in names:
                row = BenchRow(op.name, case.label, mode, name)
                try:
                    fn = op.variants[name].prepare(case, x, mode)
                    outputs = fn()
                    if oracle is not None:
                        row.max_error = max(verify.relative_error(outputs[k], oracle[k]) for k in outputs)
                    del outputs
                    row.timing = measure(fn, device, cuda_graph=cuda_graph, rep_ms=rep_ms)
                    if device.type == "cpu" and op.variants[name].kind == "triton" and interpreting():
                        row.timing.method = "interpreter"  # a check that it runs, not a speed
                    row.peak_mem_bytes = peak_memory_bytes(fn, device)
                    perf = achieved(op.flops(case, mode), op.bytes(case, mode), row.timing, ceil)
                    row.tflops, row.gbps, row.roofline_pct = perf.tflops, perf.gbps, perf.roofline_pct
                except Unsupported as exc:
                    row.skipped = str(exc)
                except torch.OutOfMemoryError:
                    row.skipped = "out of memory"
                fn = None
                _release(device)
                mode_rows.append(row)
                shown = f"{row.timing.median_ms:.3f} ms" if row.timing else f"skipped: {row.skipped}"
                bar.step(f"bench {op.name} {name:14s} {mode:7s} {case.label}  {shown}")
            reference = next((r for r in mode_rows if r.variant == base and r.timing), None)
            for r in mode_rows:
                if reference and r.timing:
                    r.speedup, r.baseline = reference.timing.median_ms / r.timing.median_ms, base
            rows.extend(mode_rows)
        del x, oracle
        _release(device)
    return rows
