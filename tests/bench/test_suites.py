"""The asv suites spell out their parameters (so asv's process per combination skips importing
torch): they must stay equal to the operators' own, or the dashboard would silently lose variants."""
import importlib
import inspect
import pkgutil

import pytest

import attnbench
import suites

SUITES = [importlib.import_module(f"suites.{m.name}") for m in pkgutil.iter_modules(suites.__path__)
          if not m.name.startswith("_")]
SHARED = [s for s in SUITES if hasattr(s, "OP")]  # the suites built on suites/_anchor.py


def test_every_operator_has_a_suite():
    assert {s.OP for s in SHARED} | {"shared_context"} >= set(attnbench.all_operators())


@pytest.mark.parametrize("suite", SHARED, ids=lambda s: s.__name__)
def test_suite_parameters_match_the_operator(suite):
    op = attnbench.get(suite.OP)
    assert suite.LABELS == [c.label for c in op.cases("anchor")]
    assert suite.VARIANTS == list(op.variants)
    assert suite.MODES == list(op.modes)
    assert suite.RATIO_PEERS == list(op.ratio_peers)  # the dashboard states the CLI's claim


def test_flash_sweep_suite_matches_the_sweep_set():
    from suites import flash as suite

    op = attnbench.get("flash")
    assert suite.SWEEP_LABELS == [c.label for c in op.cases("sweep")]
    assert set(suite.SWEEP_VARIANTS) <= set(op.variants) and set(suite.SWEEP_MODES) <= set(op.modes)
    assert set(suite.SWEEP_PEERS) <= set(op.ratio_peers) and "triton" in suite.SWEEP_VARIANTS


def _asv_cache_key(func):
    """asv_runner's get_setup_cache_key (asv_runner 0.3): the function's module less its package, and the first
    line of its source (asv is not a test dependency)."""
    try:
        from asv_runner.benchmarks._base import get_setup_cache_key
    except ImportError:
        return f"{inspect.getmodule(func).__name__.split('.', 1)[1]}:{inspect.getsourcelines(func)[1]}"
    return get_setup_cache_key(func)


def test_each_measuring_pass_has_its_own_asv_cache():
    """asv runs a setup_cache once per key and hands its result to every benchmark of that key: two operators (or
    flash's anchor and sweep sets) under one key would time the first and skip the rest. The classes that share
    a measuring pass share its key."""
    caches = {c.setup_cache for s in SHARED for c in vars(s).values() if isinstance(c, type)
              and getattr(c, "setup_cache", None) is not None}
    assert len(caches) == len(SHARED) + 1  # flash has two sets
    assert len({_asv_cache_key(f) for f in caches}) == len(caches)
    assert all(_asv_cache_key(f).split(":")[0] != "_anchor" for f in caches)


def test_asv_collects_the_suites_not_their_shared_bases():
    """asv collects public classes with benchmark methods (inherited ones too) from every module."""
    from suites import _anchor

    for suite in SHARED:
        classes = [v for k, v in vars(suite).items() if isinstance(v, type) and not k.startswith("_")]
        assert classes and all(hasattr(c, "track_latency_ms") or hasattr(c, "track_speedup") for c in classes)
    assert not [k for k, v in vars(_anchor).items() if isinstance(v, type) and not k.startswith("_")]


def test_suite_classes_carry_the_names_asv_reports():
    """asv names a benchmark <suite module>.<class __name__>.<method>, and the recorded results/asv history is keyed
    by that name: a class the suite builds through suites/_anchor.py carries the name it is assigned to in its
    suite module, that module, and that module's own measuring stub."""
    for suite in SHARED:
        for name, cls in vars(suite).items():
            if isinstance(cls, type) and not name.startswith("_"):
                assert (cls.__name__, cls.__qualname__, cls.__module__) == (name, name, suite.__name__)
                assert cls.setup_cache.__module__ == suite.__name__


@pytest.mark.interpreter  # the CPU gate: no CUDA there
@pytest.mark.parametrize("suite", SHARED, ids=lambda s: s.__name__)
def test_measurement_is_empty_without_cuda_so_asv_skips_saying_why(suite):
    public = [v for k, v in vars(suite).items() if isinstance(v, type) and not k.startswith("_")]
    anchor = next(c for c in public if hasattr(c, "track_latency_ms"))
    results = anchor.setup_cache()
    assert results == {}
    with pytest.raises(NotImplementedError, match="no CUDA device here"):
        anchor().setup(results, suite.LABELS[0], suite.VARIANTS[0], suite.MODES[0])
    speedup = next(c for c in public if hasattr(c, "track_speedup"))
    with pytest.raises(NotImplementedError, match="no CUDA device here"):
        speedup().setup(results, suite.LABELS[0], suite.MODES[0], suite.RATIO_PEERS[0])
    with pytest.raises(NotImplementedError):  # a plain dict (an older cache) still skips
        anchor().setup({}, suite.LABELS[0], suite.VARIANTS[0], suite.MODES[0])


class _FakeVariant:
    def __init__(self, missing=None):
        self.missing = missing

    def unavailable_reason(self, device):
        return self.missing


class _FakeOp:
    """An operator as the measuring pass looks it up (attnbench.get): two cases, a peer whose package is missing,
    one mode of two."""
    name = "fake"
    modes = ["fwd"]

    def __init__(self):
        self.variants = {"triton": _FakeVariant(), "peer": _FakeVariant("package peer-attn is not installed"),
                         "split": _FakeVariant()}

    def cases(self, set_name):
        from types import SimpleNamespace

        return [SimpleNamespace(label="small"), SimpleNamespace(label="large")]

    def variant(self, name):
        return self.variants[name]


def test_each_skip_says_why(monkeypatch):
    """On a GPU the pass's _Points name the reason of each point without numbers: a peer that cannot run here, a mode
    or variant the installed attnbench lacks (an older commit), a point the run left out or the runner skipped; the
    suites' setup raises it for asv (a skip it prints with --show-stderr). The pass itself is not in any benchmark's
    version (asv hashes the suite's stub, setup and the track_ method)."""
    from types import SimpleNamespace

    import torch

    import attnbench
    import attnbench.bench.runner
    from suites import _anchor

    calls = []

    def fake_bench(op, cases, device, variants=None, modes=None, progress=True):
        calls.append(([c.label for c in cases], variants, modes))
        rows = []
        for case in cases:
            for name in variants:
                timed = not (case.label == "large" and name == "split")
                row = {"timing": {"median_ms": 2.0, "iqr_ms": 0.1}, "tflops": 1.0, "gbps": 2.0, "roofline_pct": 3.0,
                       "peak_mem_bytes": 2**20, "eager": {"median_ms": 2.5}}
                rows.append(SimpleNamespace(case=case.label, variant=name, mode="fwd", timing=timed or None,
                                            skipped="" if timed else "out of memory", as_dict=lambda row=row: row))
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attnbench, "get", lambda name: _FakeOp())
    monkeypatch.setattr(attnbench.bench.runner, "bench", fake_bench)
    monkeypatch.setenv("ATTNBENCH_ASV_CASES", "^small$|^large$")
    points = _anchor._measure("fake", "anchor", None, ["fwd", "bwd"])
    assert calls == [(["small", "large"], ["triton", "split"], ["fwd"])]
    assert points["small", "triton", "fwd"]["latency_ms"] == 2.0 and points["small", "triton", "fwd"]["eager_ms"] == 2.5
    assert ("huge", "triton", "fwd") in points  # every point reads as present; reading it raises its reason

    def why(key):
        with pytest.raises(NotImplementedError) as info:
            points[key]
        return str(info.value)

    assert why(("small", "peer", "fwd")) == "peer cannot run here: package peer-attn is not installed"
    assert why(("small", "flex", "fwd")) == "fake at this commit has no variant 'flex'"
    assert why(("huge", "triton", "fwd")) == "fake at this commit has no case 'huge'"
    assert why(("large", "split", "fwd")) == "split skipped fwd on large: out of memory"
    assert why(("small", "triton", "bwd")) == "fake at this commit has no mode 'bwd'"
    with pytest.raises(NotImplementedError, match="peer-attn"):  # _Speedup.setup reads the peer with get
        _anchor._Speedup().setup(points, "small", "fwd", "peer")

    def unknown(name):  # an operator newer than the installed commit
        raise KeyError(f"unknown operator {name!r}")

    with monkeypatch.context() as m:
        m.setattr(attnbench, "get", unknown)
        with pytest.raises(NotImplementedError, match="attnbench at this commit cannot measure fake's anchor set: "
                                                      "KeyError"):
            _anchor._Latency().setup(_anchor._measure("fake", "anchor", None, None), "small", "triton", "fwd")

    monkeypatch.setenv("ATTNBENCH_ASV_VARIANTS", "triton")
    monkeypatch.setenv("ATTNBENCH_ASV_CASES", "small")
    points = _anchor._measure("fake", "anchor", None, None)
    assert calls[-1] == (["small"], ["triton"], ["fwd"])
    with pytest.raises(NotImplementedError, match=r"not timed in this run \(ATTNBENCH_ASV_VARIANTS=triton\)"):
        _anchor._Latency().setup(points, "small", "split", "fwd")
    with pytest.raises(NotImplementedError, match=r"not timed in this run \(ATTNBENCH_ASV_CASES=small\)"):
        _anchor._Latency().setup(points, "large", "triton", "fwd")


def test_the_measuring_pass_is_in_no_benchmarks_version():
    """asv's version of a benchmark hashes the source of its method, its setup and its setup_cache (which
    functools.wraps points at the suite's stub): the measuring pass and _Points may change without dropping the
    recorded results from the dashboard; setup and the track_ methods may not."""
    base = pytest.importorskip("asv_runner.benchmarks._base")
    from suites import flash

    cls = flash.FlashAnchor
    code = base.get_source_code([cls.track_latency_ms, cls.setup, cls.setup_cache])
    assert "def measure_flash" in code and "def setup" in code
    assert "bench(" not in code and "_Points" not in code and "ATTNBENCH_ASV" not in code


def test_the_made_track_methods_and_stubs_keep_their_asv_versions():
    """asv hashes a benchmark's source into its version, and the dashboard draws only results of today's version:
    the track_ methods _anchor._track makes and the stubs _anchor.measurement makes give asv the text they had when
    each was a def of its own, and carry the names asv and scripts/asv_backfill.py read."""
    import math

    base = pytest.importorskip("asv_runner.benchmarks._base")
    from suites import _anchor, flash

    anchor = flash.FlashAnchor()
    assert base.get_source_code([anchor.track_tflops]) == (
        'class _Anchor:\n    def track_tflops(self, results, case, variant, mode):\n'
        '        return self.result["tflops"]')
    assert base.get_source_code([anchor.track_eager_ms]) == (
        'class _Latency:\n    def track_eager_ms(self, results, case, variant, mode):\n'
        '        return self.result.get("eager_ms", math.nan)')
    assert base.get_source_code([flash.FlashSweep().setup_cache]) == (
        '@measurement(OP, "sweep", SWEEP_VARIANTS, SWEEP_MODES)\ndef measure_flash_sweep():\n'
        '    """asv\'s setup_cache of the flash sweep suites: a cache of its own (see suites/_anchor.measurement)."""')
    anchor.result = {"tflops": 2.0, "peak_mem_mb": 3.0}
    assert anchor.track_tflops(None, "c", "v", "m") == 2.0
    assert anchor.track_peak_gpu_memory_mb(None, "c", "v", "m") == 3.0
    assert math.isnan(anchor.track_eager_ms(None, "c", "v", "m"))
    for cls in (_anchor._Latency, _anchor._Anchor):
        for name, track in vars(cls).items():
            if name.startswith("track_"):
                assert (track.__name__, track.__qualname__) == (name, f"{cls.__name__}.{name}") and track.unit
    for suite in SHARED:
        for cls in vars(suite).values():
            if isinstance(cls, type) and getattr(cls, "setup_cache", None) is not None:
                assert getattr(suite, cls.setup_cache.__name__) is cls.setup_cache  # asv_backfill: suite.measure_<part>


def test_the_points_survive_asvs_pickle():
    """asv pickles a setup_cache's value and reads it in each benchmark's process."""
    import pickle

    from suites._anchor import _Points

    points = _Points({("c", "triton", "fwd"): {"latency_ms": 1.0}}, why="elsewhere", op="op", variants=["triton"],
                     modes=["fwd"], cases=["c"])
    points.left_out["variant"]["split"] = "left out"
    again = pickle.loads(pickle.dumps(points))
    assert again == points and again["c", "triton", "fwd"] == {"latency_ms": 1.0}
    assert again.reason(("c", "peer", "fwd")) == "op at this commit has no variant 'peer'"
    assert again.reason(("c", "triton", "bwd")) == "op at this commit has no mode 'bwd'"


def test_asv_reads_run_reports_split_in_parts_and_only_their_cuda_event_rows(tmp_path, monkeypatch):
    """ASV_REPORTS: a run split over several files (one per mode) is read as one; a --graphs run of
    the same rows times GPU time alone and must not replace the events numbers; partial runs and
    other GPUs are ignored."""
    import json

    import attnbench.bench.roofline
    from suites._anchor import from_report

    monkeypatch.setattr(attnbench.bench.roofline, "machine_info", lambda device: {"device_name": "GPU X"})

    def row(mode, ms, method="cuda-events"):
        return {"op": "jvp_attention", "case": "c", "variant": "triton", "mode": mode, "tflops": 1.0, "gbps": 1.0,
                "roofline_pct": 1.0, "timing": {"median_ms": ms, "iqr_ms": 0.0, "method": method}}

    def write(name, rows, device="GPU X", status="complete"):
        (tmp_path / name).write_text(json.dumps({"status": status, "machine": {"device_name": device}, "bench": rows}))

    write("jvp_attention-fwd-gpu-x.json", [row("fwd_jvp", 1.0)])
    write("jvp_attention-hvp-gpu-x.json", [row("hvp_rev_rev", 2.0)])
    write("jvp_attention-graphs-gpu-x.json", [row("fwd_jvp", 0.5, "cuda-graph"), row("hvp_rev_rev", 0.7, "cuda-graph")])
    write("jvp_attention-partial-gpu-x.json", [row("vjp_of_jvp", 3.0)], status="interrupted")
    write("jvp_attention-other-gpu.json", [row("vjp_of_jvp", 4.0)], device="GPU Y")
    got = {key[2]: entry["latency_ms"] for key, entry in from_report("jvp_attention", str(tmp_path)).items()}
    assert got == {"fwd_jvp": 1.0, "hvp_rev_rev": 2.0}
