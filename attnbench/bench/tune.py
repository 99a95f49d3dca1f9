"""``attnbench tune``: every candidate launch configuration of one kernel, timed on an operator's cases.

    attnbench tune --op flash --kernel dkdv --cases anchor [--match ' D128 '] [--json tune.json]

A kernel's autotuner picks one configuration per shape bucket from its list. Here, per case, the
operator's variant that reaches the kernel runs once as shipped (the ``autotuned`` row, naming the
config the autotuner picked), then once per candidate of that list with the autotuner held to that
one candidate (its remembered picks, the launchers' launch plans and split picks forgotten before
each), each timed by the timing core every benchmark uses (``attnbench.bench.timing.measure``: GPU
time, L2 flushed) and each output checked against the float64 oracle. A candidate the compiler cannot
fit (shared memory, registers) is a row with that reason, as the GPU studies recorded it. The list
is the kernel's own (the module's candidates, before the shared-memory pruner: a forced config is
not pruned); a study of other candidates edits that list.

Operators declare what can be tuned (``Operator.tunables``, written as a ``tunable_table``): a name, the
autotuners the kernel is compiled into (shared_context's fused kernel has one per head-dim class; the
one a case reaches is found by running it), the mode and variant whose call launches it, and what to
forget between configs. Timings on a CPU would time the interpreter, so the command needs CUDA; the function runs
anywhere (the CPU gate drives it through the interpreter).
"""
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import verify
from .registry import Unsupported
from .timing import Timing, measure


@dataclass(frozen=True)
class Tunable:
    """One kernel of an operator that ``attnbench tune`` can time config by config."""

    name: str
    description: str
    autotuners: Callable  # () -> the Triton Autotuners the kernel is compiled into (one is reached per case)
    mode: str  # the operator mode whose call launches it
    variant: str = "triton"  # the variant (or forced route) whose call reaches it
    forget: Callable = field(default=lambda: None)  # () -> None: launch plans, split picks to drop between configs


def _lookup(package, path):
    """``path`` under the package ``package``: "module.attribute", or "attribute" of the package itself."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(f"{package}.{module}" if module else package), attr)


def tunable_table(package, rows, forget=None) -> dict:
    """An operator's ``tunables()``: {name: Tunable} of ``rows`` (name, description, kernel, mode[, variant]).

    ``kernel`` names an autotuner, or a dict of them (one per head-dim class), as "module.attribute" under
    ``package`` (a family of attnbench.kernels); ``forget`` names a function of ``package`` itself, called
    between configs. Both are looked up only when the tuner runs, so that listing the tunables imports no
    kernel module."""

    def autotuners(kernel):
        def found():
            tuners = _lookup(package, kernel)
            return list(tuners.values()) if isinstance(tuners, Mapping) else [tuners]
        return found

    drop = {"forget": lambda: _lookup(package, forget)()} if forget else {}
    return {name: Tunable(name, description, autotuners(kernel), mode, *variant, **drop)
            for name, description, kernel, mode, *variant in rows}


@dataclass
class TuneRow:
    case: str
    config: str  # "autotuned: <its pick>", or the candidate (config_text)
    index: int | None = None  # the candidate's place in the kernel's list (0: the default)
    timing: Timing | None = None
    max_error: float = math.nan
    passed: bool | None = None  # every output within the operator's error bound for the case dtype
    speedup: float | None = None  # the autotuned row's time over this one
    skipped: str = ""

    def as_dict(self):
        d = {k: v for k, v in self.__dict__.items() if k != "timing"}
        d["timing"] = self.timing.as_dict() if self.timing else None
        return d


class _Held:
    """The autotuners of a kernel held to given config lists for a block, then restored as they were."""

    def __init__(self, tuners):
        self.tuners = tuners
        self.saved = [(t.configs, dict(t.cache), getattr(t, "best_config", None)) for t in tuners]

    def hold(self, tuner=None, config=None):
        """All autotuners as shipped (no config given), or ``tuner`` held to ``config``; picks forgotten."""
        for t, (configs, _, _) in zip(self.tuners, self.saved):
            t.configs = [config] if t is tuner and config is not None else configs
            t.cache = {}
            t.best_config = None

    def reached(self):
        """The autotuner the last call went through, or None."""
        return next((t for t in self.tuners if t.best_config is not None), None)

    def restore(self):
        for t, (configs, cache, best) in zip(self.tuners, self.saved):
            t.configs, t.cache, t.best_config = configs, cache, best


def config_text(config) -> str:
    """A Triton config in one short line: its constexprs, then warps and stages (and maxnreg when set)."""
    blocks = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    extra = f" maxnreg {config.maxnreg}" if getattr(config, "maxnreg", None) else ""
    return f"{blocks} warps {config.num_warps} stages {config.num_stages}{extra}".strip()


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def tune(op, tunable: Tunable, cases, device, *, mode=None, variant=None, seed=0, rep_ms=100, on_row=None,
         progress=None) -> list:
    """Rows for every case: the autotuned call, then each candidate of the kernel's list forced alone."""
    device = torch.device(device)
    mode = mode or tunable.mode
    name = variant or tunable.variant
    chosen = op.variant(name)
    if mode not in chosen.modes:
        raise ValueError(f"{op.name}: variant {name} does not run mode {mode}")
    held = _Held(list(tunable.autotuners()))
    rows = []

    def keep(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if progress is not None:
            shown = f"{row.timing.median_ms:.4f} ms" if row.timing else f"skipped: {row.skipped}"
            progress(f"tune {op.name} {tunable.name} {row.case}  {row.config}  {shown}")

    try:
        for case in cases:
            x = op.make_inputs(case, device, seed)
            oracle = op.oracle(case, x)
            bound = verify.BOUNDS.get(getattr(case, "torch_dtype", None), math.inf)

            def run(tuner=None, config=None, index=None):
                held.hold(tuner, config)
                tunable.forget()
                row = TuneRow(case.label, "autotuned" if config is None else config_text(config), index)
                try:
                    fn = chosen.prepare(case, x, mode)
                    outputs = fn()
                    reached = held.reached()
                    if reached is None:
                        raise Unsupported(f"{tunable.name} does not run on this case ({name}, {mode})")
                    row.max_error = max(verify.relative_error(outputs[k], oracle[k]) for k in outputs)
                    row.passed = row.max_error <= bound
                    del outputs
                    row.timing = measure(fn, device, rep_ms=rep_ms)
                    if config is None:
                        row.config = f"autotuned: {config_text(reached.best_config)}"
                    return row, reached
                except Unsupported as exc:
                    row.skipped = str(exc)
                except torch.OutOfMemoryError:
                    row.skipped = "out of memory"
                except Exception as exc:  # a candidate the compiler cannot fit: that is the answer for it
                    row.skipped = _first_line(exc)
                return row, None

            auto, tuner = run()
            keep(auto)
            if tuner is None:
                continue
            for index, config in enumerate(held.saved[held.tuners.index(tuner)][0]):
                row, _ = run(tuner, config, index)
                if row.timing and auto.timing:
                    row.speedup = auto.timing.median_ms / row.timing.median_ms
                keep(row)
            del x, oracle
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        held.restore()
        tunable.forget()
    return rows


def table(rows) -> str:
    """The rows as a markdown table, each case's fastest candidate marked."""
    best = {}
    for r in rows:
        if r.timing and r.index is not None and (r.case not in best or r.timing.median_ms < best[r.case]):
            best[r.case] = r.timing.median_ms
    lines = ["| case | # | config | ms | IQR % | autotuned / this | max error | |", "|" + " --- |" * 8]
    for r in rows:
        if not r.timing:
            lines.append(f"| {r.case} | {'' if r.index is None else r.index} | {r.config} | skipped: {r.skipped} "
                         "| | | | |")
            continue
        iqr = 100 * r.timing.iqr_ms / r.timing.median_ms if r.timing.median_ms else math.nan
        marks = ["fastest"] if r.index is not None and r.timing.median_ms == best.get(r.case) else []
        mark = "; ".join(marks + (["OVER BOUND"] if r.passed is False else []))
        lines.append(f"| {r.case} | {'' if r.index is None else r.index} | {r.config} | {r.timing.median_ms:.4f} | "
                     f"{iqr:.1f} | {'' if r.speedup is None else f'{r.speedup:.2f}x'} | {r.max_error:.1e} | {mark} |")
    return "\n".join(lines)
