"""Verify and benchmark operators: the loops behind ``attnbench check|bench|run`` and the asv suites.

Every benchmark row also carries the max relative error of the timed call's own outputs against
the float64 oracle, so a fast number from a wrong kernel cannot pass unnoticed.
"""
import gc
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from . import floors, verify
from ..kernels import interpreting
from .registry import Unsupported
from .roofline import achieved, ceilings
from .timing import Timing, comparable, measure, measure_eager, measure_host, peak_memory_bytes


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
            try:
                print(f"[{self.done:>{width}}/{self.total}] {time.perf_counter() - self.start:7.1f}s  {label}",
                      file=self.stream, flush=True)
            except BrokenPipeError:  # `attnbench ... 2>&1 | head`: the reader left; the run goes on
                self.enabled = False
                detach(self.stream)


def detach(stream):
    """Point a stream whose reader has gone (a closed pipe) at /dev/null, so that neither later
    writes nor the flush at exit raise BrokenPipeError."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):  # not backed by a file descriptor (a test's StringIO)
        pass


def _release(device):
    """Give a GPU's cached blocks back between rows. Not on a CPU: there reference counting frees
    the tensors, and a full collection cost 0.15 s per row (80% of a tiny-set check run)."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# torch's OutOfMemoryError, and the AcceleratorError cudaMalloc raises when torch's caching allocator is off (as under
# compute-sanitizer): either ends a case or a row as "out of memory", and the run goes on (the device errors that
# verify.check_variant lets through to here)
OUT_OF_MEMORY = verify.DEVICE_ERRORS


def is_out_of_memory(error) -> bool:
    """torch's OutOfMemoryError, or an AcceleratorError that says it is one (other accelerator errors are not)."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, torch.AcceleratorError)
                                                         and "out of memory" in str(error))


def _raise_unless_out_of_memory(error):
    if not is_out_of_memory(error):
        raise error


def _case_inputs(op, case, device, seed, oracles):
    """(x, oracles(x), "") for a case, or where memory ran out: (None, None, "inputs") or (x, None, "oracle"). The
    case's rows are then kept (skipped, or timed unverified) and the run goes on."""
    x, stage = None, "inputs"
    try:
        x = op.make_inputs(case, device, seed)
        stage = "oracle"
        return x, oracles(x), ""
    except OUT_OF_MEMORY as error:
        _raise_unless_out_of_memory(error)
    _release(device)  # outside the except: its traceback holds the failed call's tensors until the block ends
    return x, None, stage


def select_variants(op, device, names=None):
    """The variants to run: ``names`` (default set or forced routes) that can run on ``device``, or
    without names the default set's that can."""
    if names is None:
        return list(op.available_variants(device))
    unknown = [n for n in names if not op.knows(n)]
    if unknown:
        raise ValueError(f"{op.name}: unknown variant(s) {unknown}; known: {op.variant_names()}")
    return [n for n in names if op.variant(n).unavailable_reason(torch.device(device)) is None]


def _no_mode(name, mode):
    return f"{name} does not implement mode {mode}"


def _cost(op, case, mode):
    """(FLOPs, bytes) of the operator's cost model; NaN (no TF/s, GB/s) where it has none."""
    try:
        return op.flops(case, mode), op.bytes(case, mode)
    except NotImplementedError:
        return math.nan, math.nan


def check(op, cases, device, variants=None, modes=None, seed=0, progress=True, on_result=None,
          extra_checks=None) -> list:
    """Verify each variant on each case and mode against the float64 oracle. ``on_result(result)``
    is called as each result is final (the CLI writes it to the result file there). The operator's
    ``extra_checks`` follow when ``extra_checks`` is true (default: when neither variants nor
    modes were chosen)."""
    names = select_variants(op, device, variants)
    modes_asked, modes = modes, modes or op.modes
    bar = Progress(len(cases) * len(modes) * len(names), progress)
    results = []
    for case in cases:
        x, oracles, short = _case_inputs(op, case, device, seed,
                                         lambda x: (op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype)))
        oracle, lowp = oracles or (None, None)
        unchecked = "inputs or oracle out of memory" if short else ""
        for mode in modes:
            for name in names:
                try:
                    if unchecked:
                        result = verify.CheckResult(op.name, name, case.label, mode, skipped=unchecked)
                    elif mode not in op.variant(name).modes:
                        result = verify.CheckResult(op.name, name, case.label, mode, skipped=_no_mode(name, mode))
                    else:
                        result = verify.check_variant(op, name, case, mode, x, oracle, lowp)
                except OUT_OF_MEMORY as error:
                    _raise_unless_out_of_memory(error)
                    result = verify.CheckResult(op.name, name, case.label, mode, skipped="out of memory")
                results.append(result)
                if on_result is not None:
                    on_result(result)
                status = "skip" if result.skipped else ("ok" if result.passed else "FAIL")
                bar.step(f"check {op.name} {name:14s} {mode:7s} {case.label}  {status}")
                _release(device)
        del x, oracle, lowp
        _release(device)
    if extra_checks if extra_checks is not None else (variants is None and modes_asked is None):
        extras = op.extra_checks(device, seed)
        bar.total += len(extras)
        for result in extras:
            results.append(result)
            if on_result is not None:
                on_result(result)
            bar.step(f"check {op.name} {result.variant} {result.mode} {result.case}  "
                     f"{'skip' if result.skipped else 'ok' if result.passed else 'FAIL'}")
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
    floor_ms: float | None = None  # the attainable floor (bench/floors.py): the least time any kernel can take
    floor_binding: str | None = None  # the resource whose floor binds: bytes, compute, exps or launch
    floor_pct: float | None = None  # floor_ms over this row's GPU time, in %: how close to what is reachable
    speedup: float | None = None  # baseline median / this median, same case and mode (GPU time)
    baseline: str | None = None
    eager: Timing | None = None  # eager latency (CUDA): wall ms per call back to back, host included
    speedup_eager: float | None = None  # the same ratio in eager latency
    host: Timing | None = None  # host ms to issue one call (bench --host-time)
    max_error: float = math.nan
    peak_mem_bytes: int | None = None
    skipped: str = ""
    unverified: str = ""  # timed, but its outputs were not compared with the oracle: why
    failed: str = ""  # the variant raised (or gave outputs of the wrong shape): the error; skipped says so too

    def as_dict(self):
        d = {k: v for k, v in self.__dict__.items() if k not in CLOCKS}
        for clock in CLOCKS:
            value = getattr(self, clock)
            d[clock] = value.as_dict() if value else None
        return d


CLOCKS = ("timing", "eager", "host")  # BenchRow's Timing fields


def _set_speedup(row, base_row):
    if row.timing and comparable(row.timing, base_row.timing):
        row.speedup, row.baseline = base_row.timing.median_ms / row.timing.median_ms, base_row.variant
    if row.eager and base_row.eager:
        row.speedup_eager = base_row.eager.median_ms / row.eager.median_ms


def _floor_rates(device, ceil, cuda_graph):
    """The rates the floors of a GPU run use (bench/floors.py): this GPU's measured ceilings; the launch floor only
    for CUDA-event timings (a graph replay does not pay it). None on a CPU (nothing there is a GPU clock)."""
    if device.type != "cuda" or ceil is None:
        return None
    return floors.Rates(copy_gbps=ceil.copy_gbps, matmul_tflops=ceil.matmul_tflops,
                        multiprocessors=torch.cuda.get_device_properties(device).multi_processor_count,
                        launch_floor_us=0.0 if cuda_graph else ceil.launch_floor_us or 0.0)


def _set_floor(row, op, case, mode, rates):
    """A GPU-clock row's attainable floor and its share of it (operators without a cost model: none)."""
    if rates is None or row.timing is None or row.timing.method not in floors.GPU_CLOCKS:
        return
    try:
        f = floors.floor(op, case, mode, rates)
    except NotImplementedError:
        return
    if math.isfinite(f.floor_s) and f.floor_s > 0:
        row.floor_ms, row.floor_binding = f.floor_s * 1e3, f.binding
        row.floor_pct = 100.0 * row.floor_ms / row.timing.median_ms


def bench(op, cases, device, variants=None, modes=None, seed=0, baseline=None, cuda_graph=False,
          verify_outputs=True, progress=True, rep_ms=100, on_row=None, eager=True, host_time=False) -> list:
    """Time each variant on each case and mode; rows carry throughput, roofline and error.

    On a GPU each row carries two clocks: GPU time (``timing``: the kernels' cost) and, with
    ``eager``, eager latency (``eager``: wall time per call back to back, what a Python caller
    pays); ``host_time`` adds the host's time to issue a call (``host``). On a CPU the one clock is
    wall time, the eager latency there. ``on_row(row)`` is called as each row finishes; the row
    object may still change afterwards (its speedups, once the baseline of its case and mode has
    run), so keep the object, not a copy. A speedup is set only between comparable clocks."""
    device = torch.device(device)
    names = select_variants(op, device, variants)
    modes = modes or op.modes
    base = baseline or op.baseline(device, names)
    ceil = ceilings(device)
    rates = _floor_rates(device, ceil, cuda_graph)
    bar = Progress(len(cases) * len(modes) * len(names), progress)
    rows = []
    for case in cases:
        x, oracle, short = _case_inputs(op, case, device, seed,
                                        lambda x: op.oracle(case, x) if verify_outputs else None)
        untimed = "inputs out of memory" if short == "inputs" else ""
        # an oracle short of memory: timed all the same, marked unverified (no error figure)
        unverified = "not verified: the float64 oracle ran out of memory" if short == "oracle" else ""
        for mode in modes:
            mode_rows, base_row = [], None
            for name in names:
                row = BenchRow(op.name, case.label, mode, name, unverified=unverified)
                try:
                    if untimed:
                        raise Unsupported(untimed)
                    if mode not in op.variant(name).modes:
                        raise Unsupported(_no_mode(name, mode))
                    fn = op.variant(name).prepare(case, x, mode)
                    outputs = fn()
                    if oracle is not None:
                        row.max_error = max(verify.relative_error(outputs[k], oracle[k]) for k in outputs)
                    del outputs
                    if device.type == "cpu" and op.variant(name).kind == "triton" and interpreting():
                        # a check that it runs, not a speed: one sample, never compared (``comparable``)
                        row.timing = measure(fn, device, warmup_ms=0, rep_ms=0, cpu_reps=1)
                        row.timing.method = "interpreter"
                    else:
                        row.timing = measure(fn, device, cuda_graph=cuda_graph, rep_ms=rep_ms)
                    if device.type == "cuda" and eager:
                        row.eager = measure_eager(fn, device, rep_ms=rep_ms / 2)
                    if device.type == "cuda" and host_time:
                        row.host = measure_host(fn, device, rep_ms=rep_ms / 2)
                    row.peak_mem_bytes = peak_memory_bytes(fn, device)
                    perf = achieved(*_cost(op, case, mode), row.timing, ceil)
                    row.tflops, row.gbps, row.roofline_pct = perf.tflops, perf.gbps, perf.roofline_pct
                    _set_floor(row, op, case, mode, rates)
                except Unsupported as exc:
                    row.skipped = str(exc)
                except OUT_OF_MEMORY as error:
                    _raise_unless_out_of_memory(error)
                    row.skipped = "out of memory"
                except Exception as exc:  # recorded, not fatal: the other variants and cases still run
                    row.failed = verify.raised(exc)
                    row.skipped, row.timing, row.eager, row.host = f"failed: {row.failed}", None, None, None
                fn = None
                _release(device)
                mode_rows.append(row)
                if name == base and row.timing:
                    base_row = row
                    for r in mode_rows:
                        _set_speedup(r, base_row)
                elif base_row is not None:
                    _set_speedup(row, base_row)
                if on_row is not None:
                    on_row(row)
                shown = f"{row.timing.median_ms:.3f} ms" if row.timing else \
                    f"FAILED: {row.failed}" if row.failed else f"skipped: {row.skipped}"
                if row.eager:
                    shown += f", eager {row.eager.median_ms:.3f} ms"
                bar.step(f"bench {op.name} {name:14s} {mode:7s} {case.label}  {shown}")
            rows.extend(mode_rows)
        del x, oracle
        _release(device)
    return rows
