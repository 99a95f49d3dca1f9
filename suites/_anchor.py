"""What every operator's asv suite shares: one measuring pass and the benchmark bodies.

asv runs every parameter combination in a process of its own (forked from a server that imported the suites,
with ``--launch-method forkserver``; a fresh interpreter each with ``spawn``), so suite modules never import
torch at module level (the server must not hold CUDA, and a combination must not pay torch's import): each
spells out its operator's case labels, variants and modes (tests/bench/test_suites.py fails if they drift from
the operator's own) and builds its measuring passes (``measurement``) and benchmark classes with
``operator_suites``, ``latency_suite`` and ``speedup_suite`` (bottom of this module): subclasses of the
classes below, assigned to module-level names of the suite, since asv collects classes from a module's
namespace and names a benchmark by its class's ``__name__``. The bases' names start with "_", so asv does not
collect them here, only through the suites' subclasses (it finds inherited methods). asv's version of a
benchmark hashes the source of its methods and of its stub, and results of another version drop out of the
dashboard: the bodies below stay as written, and the track_ methods and stubs made by ``_track`` and
``measurement`` give asv the source they had when each was written out (``pretty_source``), so that the
recorded results (results/asv) keep their versions.

``measurement(stub, op)`` makes a suite's stub asv's ``setup_cache``: it verifies and times every (case, variant,
mode) once through attnbench's timing core (CUDA events, L2 flushed, median of many) and the ``track_``
benchmarks read their number from it. asv treats every number as lower-is-better, so latency is
the regression signal; TF/s, GB/s, % of roofline and peak GPU memory are tracked for display.
Without CUDA, or where a variant cannot run a case, setup raises NotImplementedError and asv
records the benchmark as skipped; the error's message says why (no CUDA device, the peer's package
missing, a mode the variant lacks, ...), and ``asv run --show-stderr`` prints it for each skipped point as
"asv: skipped: NotImplementedError('<why>')" (see ``_Points``). asv keeps no output in its result files,
so a run's log is where the reasons are read.

The measuring pass runs against whatever attnbench is installed, so the current suites also time older
commits (scripts/asv_backfill.py, docs/dashboard.md's "History"): where that commit's attnbench lacks an
operator, a variant, a mode or a case label, the point is skipped, saying so. Three variables narrow a
pass (each point left out skips, naming the variable): ATTNBENCH_ASV_VARIANTS and ATTNBENCH_ASV_MODES
(names, space-separated; an operator times those it has) and ATTNBENCH_ASV_CASES (a regular expression
searched in the case labels).
"""
import functools
import math


# Each stub's source when the suite modules wrote it as a decorated def, {name: (the decorator's arguments, what it
# is the cache of)}: asv hashes a stub's source into the version of every benchmark on it, so ``measurement`` gives
# asv this text (pretty_source) and the recorded results keep their versions
_STUB_SOURCES = {
    "measure_flash": ("OP", "flash anchor suites"),
    "measure_flash_sweep": ('OP, "sweep", SWEEP_VARIANTS, SWEEP_MODES', "flash sweep suites: a cache of its own"),
    "measure_jvp_attention": ("OP", "jvp_attention suites"),
    "measure_shared_context": ("OP", "shared_context suites"),
    "measure_sparse": ("OP", "sparse suites"),
}


def measurement(stub, op_name, case_set="anchor", variants=None, modes=None):
    """asv's setup_cache for ``op_name`` on ``case_set`` (``variants`` and ``modes``: those only; default all),
    named measure_<op>[_<set>] (scripts/asv_backfill.py names a measuring pass by it). ``stub`` is a lambda the
    suite module writes in the call, because asv keys a cache by the module and first line of its function:
    closures made here all had the key ``_anchor:<line>``, so one asv run over several suites measured the first
    and handed its results to every other (measured on the H200: all but one suite skipped)."""

    @functools.wraps(stub)  # __wrapped__: inspect.getsourcelines, and so asv's key, see the stub
    def measure(*_bound_instance):
        import os

        import torch

        reports = os.environ.get("ATTNBENCH_ASV_REPORTS")
        if reports:
            return from_report(op_name, reports)
        if not torch.cuda.is_available():
            return _Points(why="no CUDA device here, so nothing was timed")
        return _measure(op_name, case_set, variants, modes)

    measure.__name__ = measure.__qualname__ = f"measure_{op_name}" + ("" if case_set == "anchor" else f"_{case_set}")
    if measure.__name__ in _STUB_SOURCES:
        args, what = _STUB_SOURCES[measure.__name__]
        measure.pretty_source = (f"@measurement({args})\ndef {measure.__name__}():\n"
                                 f'    """asv\'s setup_cache of the {what} (see suites/_anchor.measurement)."""')
    measure.timeout = 3000
    measure.op_name, measure.case_set = op_name, case_set  # what scripts/asv_backfill.py reads
    measure.variants, measure.modes = variants, modes
    return measure


def _chosen(names, variable):
    """``names`` less those the environment variable ``variable`` (names, space-separated) leaves out, and a
    reason for each left out."""
    import os

    wanted = os.environ.get(variable)
    if not wanted:
        return list(names), {}
    keep = set(wanted.split())
    return [n for n in names if n in keep], {n: f"not timed in this run ({variable}={wanted})" for n in names
                                             if n not in keep}


def _measure(op_name, case_set, variants, modes):
    """One pass of attnbench's timing core over the operator's ``case_set`` on CUDA, as _Points: the numbers
    of every row timed and the reason of every other point (a variant this GPU or this install cannot run,
    a mode or case the commit lacks, a row the runner skipped)."""
    import torch

    planned = plan(op_name, case_set, variants, modes, torch.device("cuda"))
    if isinstance(planned, _Points):
        return planned
    bench, op, cases, names, chosen_modes, points = planned
    if names and chosen_modes and cases:
        for r in bench(op, cases, "cuda", variants=names, modes=chosen_modes, progress=True):
            if r.timing:
                points[r.case, r.variant, r.mode] = _entry(r.as_dict())
            else:
                points.skipped[r.case, r.variant, r.mode] = f"{r.variant} skipped {r.mode} on {r.case}: {r.skipped}"
    return points


def plan(op_name, case_set, variants, modes, device):
    """What a pass on ``device`` would time: (the runner's bench, the operator, the cases, the variant names,
    the modes, an empty _Points holding the reason of every point left out), or a _Points that says why the
    installed attnbench cannot measure this set. The operator, its variants and its cases are looked up as
    every commit since the suites began spells them: the runner lived in attnbench/runner.py before the layout
    moves (3539b9c); Operator.variant(name) came with the forced routes (b1919b5), and before it the default
    variants were the dict op.variants. scripts/asv_backfill.py --probe runs this on a CPU against each commit."""
    import os
    import re

    import attnbench

    try:
        try:
            from attnbench.bench.runner import bench
        except ImportError:
            from attnbench.runner import bench
        op = attnbench.get(op_name)
        cases = list(op.cases(case_set))
        variant = op.variant if hasattr(op, "variant") else op.variants.__getitem__
    except (ImportError, AttributeError, KeyError, ValueError) as exc:
        return _Points(why=f"attnbench at this commit cannot measure {op_name}'s {case_set} set: {exc!r}")
    points = _Points(why=f"not among the points {op_name} measured here", op=op_name,
                     variants=[n for n in variants or op.variants if n in op.variants],
                     modes=[m for m in modes or op.modes if m in op.modes], cases=[c.label for c in cases])
    names, points.left_out["variant"] = _chosen(points.variants, "ATTNBENCH_ASV_VARIANTS")
    unavailable = {n: variant(n).unavailable_reason(device) for n in names}
    points.left_out["variant"].update({n: f"{n} cannot run here: {why}" for n, why in unavailable.items() if why})
    names = [n for n in names if not unavailable[n]]
    chosen_modes, points.left_out["mode"] = _chosen(points.modes, "ATTNBENCH_ASV_MODES")
    pattern = os.environ.get("ATTNBENCH_ASV_CASES")
    if pattern:
        points.left_out["case"] = {c.label: f"not timed in this run (ATTNBENCH_ASV_CASES={pattern})" for c in cases
                                   if not re.search(pattern, c.label)}
        cases = [c for c in cases if re.search(pattern, c.label)]
    return bench, op, cases, names, chosen_modes, points


class _Points(dict):
    """A measuring pass's numbers by (case, variant, mode), and why every other point has none.

    A point without numbers reads as present (``in``) and raises NotImplementedError with its reason when
    read (``[]``, ``get``): asv takes an error of that type in a benchmark's setup for a skip and prints
    its message (``--show-stderr``). _Latency.setup and _Speedup.setup thereby raise the reason as written:
    their source is part of every benchmark's version (the module docstring)."""

    def __init__(self, numbers=(), why="not measured", op=None, variants=None, modes=None, cases=None):
        super().__init__(numbers)
        self.why, self.op = why, op
        self.variants, self.modes, self.cases = variants, modes, cases  # what the commit has; None: not looked up
        self.left_out = {"variant": {}, "mode": {}, "case": {}}
        self.skipped = {}

    def reason(self, key):
        case, variant, mode = key
        for kind, name, known in (("variant", variant, self.variants), ("mode", mode, self.modes),
                                  ("case", case, self.cases)):
            if known is not None and name not in known:
                return f"{self.op} at this commit has no {kind} {name!r}"
            if name in self.left_out[kind]:
                return self.left_out[kind][name]
        return self.skipped.get(key, self.why)

    def __contains__(self, key):
        return True

    def __getitem__(self, key):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        raise NotImplementedError(self.reason(key))

    def get(self, key, default=None):
        return self[key]


def _entry(row):
    """A row's numbers: GPU time (latency_ms) and, where the row has it, eager latency (eager_ms: wall time per
    call back to back, host included; NaN for rows timed before the clock existed)."""
    eager = row.get("eager") or {}
    return {"latency_ms": row["timing"]["median_ms"], "iqr_ms": row["timing"]["iqr_ms"], "tflops": row["tflops"],
            "gbps": row["gbps"], "roofline_pct": row["roofline_pct"],
            "peak_mem_mb": (row.get("peak_mem_bytes") or 0) / 2**20,
            "eager_ms": eager.get("median_ms", math.nan)}


def from_report(op_name, directory):
    """The rows of ``attnbench run --json`` files in ``directory`` (the gate's bench stage on this
    commit and machine), so that asv records the very numbers the run printed instead of timing
    everything a second time. Only complete files of this machine's GPU are used (without CUDA: files
    of this machine's CPU, which is how tests/bench/test_asv_backfill.py feeds asv numbers on a CPU)."""
    import glob

    import torch

    try:
        from attnbench.bench import results
        from attnbench.bench.roofline import machine_info
    except ImportError:  # before the layout moves (3539b9c)
        from attnbench import results
        from attnbench.roofline import machine_info

    name = machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"))["device_name"]
    out = {}
    for path in sorted(glob.glob(f"{directory}/{op_name}-*.json")):
        data = results.load(path)
        if data.get("machine", {}).get("device_name") != name or data.get("status", "complete") != "complete":
            continue
        # CUDA events only: a --graphs run of the same rows times something else (GPU time alone)
        out.update({(r["case"], r["variant"], r["mode"]): _entry(r) for r in data.get("bench", [])
                    if r.get("timing") and r["timing"].get("method") == "cuda-events" and r["op"] == op_name})
    if not out:
        raise RuntimeError(f"ATTNBENCH_ASV_REPORTS={directory}: no complete {op_name} run of a {name} there")
    return _Points(out, why=f"no row of it in the {op_name} runs of a {name} in {directory} (ATTNBENCH_ASV_REPORTS)")


def _track(qualname, key, unit, nan_if_missing=False):
    """The track_ method ``qualname`` ("<class>.track_<metric>"): the point's number ``key`` (NaN where the row
    lacks it, with ``nan_if_missing``) in ``unit``. Its ``pretty_source``, which asv hashes into the benchmark's
    version, is the method as it was written out, so that the recorded results keep their versions."""
    name = qualname.rpartition(".")[2]

    def track(self, results, case, variant, mode):
        return self.result.get(key, math.nan) if nan_if_missing else self.result[key]

    track.__name__, track.__qualname__, track.unit = name, qualname, unit
    read = f'.get("{key}", math.nan)' if nan_if_missing else f'["{key}"]'
    track.pretty_source = f"def {name}(self, results, case, variant, mode):\n    return self.result{read}"
    return track


class _Latency:
    """Latency of (case, variant, mode) points: subclasses set ``params`` and ``setup_cache``. For
    large grids (a sweep): asv spent ~0.5 s a point and metric on the H200 machine, so the flash
    sweep's 384 points at the anchors' five metrics would take ~17 minutes, more than a device call."""

    param_names = ["case", "variant", "mode"]
    timeout = 600

    def setup(self, results, case, variant, mode):
        if (case, variant, mode) not in results:
            raise NotImplementedError(f"{variant} did not run {mode} on {case} here (no CUDA, or unsupported)")
        self.result = results[case, variant, mode]

    track_latency_ms = _track("_Latency.track_latency_ms", "latency_ms", "ms")
    track_eager_ms = _track("_Latency.track_eager_ms", "eager_ms", "ms", nan_if_missing=True)


class _Anchor(_Latency):
    """Every variant, mode and anchor case, with throughput, roofline and memory beside latency."""

    track_tflops = _track("_Anchor.track_tflops", "tflops", "TF/s")
    track_gbps = _track("_Anchor.track_gbps", "gbps", "GB/s")
    track_roofline_pct = _track("_Anchor.track_roofline_pct", "roofline_pct", "%")
    track_peak_gpu_memory_mb = _track("_Anchor.track_peak_gpu_memory_mb", "peak_mem_mb", "MiB")


class _Speedup:
    """The subject's speed as a multiple of each peer's (peer latency / subject latency), same run."""

    param_names = ["case", "mode", "peer"]
    timeout = 600
    subject = "triton"

    def setup(self, results, case, mode, peer):
        ours, theirs = results.get((case, self.subject, mode)), results.get((case, peer, mode))
        if not ours or not theirs:
            raise NotImplementedError(f"{self.subject} or {peer} did not run {mode} on {case} here")
        self.ratio = theirs["latency_ms"] / ours["latency_ms"]
        self.ratio_eager = theirs.get("eager_ms", math.nan) / ours.get("eager_ms", math.nan)

    def track_speedup(self, results, case, mode, peer):
        return self.ratio if math.isfinite(self.ratio) else math.nan

    track_speedup.unit = "x"

    def track_speedup_eager(self, results, case, mode, peer):
        """The same ratio in eager latency."""
        return self.ratio_eager if math.isfinite(self.ratio_eager) else math.nan

    track_speedup_eager.unit = "x"


def _suite(name, base, measure, params, doc=None, **attrs):
    """The class ``name`` on ``base`` for the suite module of ``measure`` (its ``measurement``, the setup_cache of
    the class), with asv's ``params``."""
    namespace = {"__module__": measure.__module__, "__qualname__": name, "__doc__": doc, "params": params,
                 "setup_cache": measure, **attrs}
    return type(name, (base,), namespace)


def anchor_suite(name, measure, labels, variants, modes, doc=None):
    """Every variant and mode on every case of ``labels``: latency, TF/s, GB/s, % of roofline, memory."""
    return _suite(name, _Anchor, measure, (labels, variants, modes), doc)


def latency_suite(name, measure, labels, variants, modes, doc=None):
    """Latency alone of every (case, variant, mode) point (large grids: see _Latency)."""
    return _suite(name, _Latency, measure, (labels, variants, modes), doc)


def speedup_suite(name, measure, labels, modes, peers, doc=None, subject=_Speedup.subject):
    """``subject``'s speed as a multiple of each of ``peers``', per case and mode."""
    return _suite(name, _Speedup, measure, (labels, modes, peers), doc, subject=subject)


def operator_suites(stub, op_name, labels, variants, modes, ratio_peers, anchor, speedup, speedup_doc=None):
    """An operator's measuring pass on its anchor set (``measurement(stub, op_name)``) and its two suites on it:
    ``anchor`` (anchor_suite) over (labels, variants, modes), ``speedup`` (speedup_suite, Triton's) over (labels,
    modes, ratio_peers); the pass first, for the suite module to name (scripts/asv_backfill.py looks it up)."""
    measure = measurement(stub, op_name)
    return (measure, anchor_suite(anchor, measure, labels, variants, modes),
            speedup_suite(speedup, measure, labels, modes, ratio_peers, speedup_doc))
