"""The asv suites spell out their parameters (so asv's ~500 spawned interpreters skip importing
torch): they must stay equal to the operators' own, or the dashboard would silently lose variants."""
import importlib
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


def test_asv_collects_the_suites_not_their_shared_bases():
    """asv collects public classes with benchmark methods (inherited ones too) from every module."""
    from suites import _anchor

    for suite in SHARED:
        classes = [v for k, v in vars(suite).items() if isinstance(v, type) and not k.startswith("_")]
        assert classes and all(hasattr(c, "track_latency_ms") or hasattr(c, "track_speedup") for c in classes)
    assert not [k for k, v in vars(_anchor).items() if isinstance(v, type) and not k.startswith("_")]


@pytest.mark.interpreter  # the CPU gate: no CUDA there
@pytest.mark.parametrize("suite", SHARED, ids=lambda s: s.__name__)
def test_measurement_is_empty_without_cuda_so_asv_skips(suite):
    public = [v for k, v in vars(suite).items() if isinstance(v, type) and not k.startswith("_")]
    anchor = next(c for c in public if hasattr(c, "track_latency_ms"))
    assert anchor.setup_cache() == {}
    with pytest.raises(NotImplementedError):
        anchor().setup({}, suite.LABELS[0], suite.VARIANTS[0], suite.MODES[0])
    speedup = next(c for c in public if hasattr(c, "track_speedup"))
    with pytest.raises(NotImplementedError):
        speedup().setup({}, suite.LABELS[0], suite.MODES[0], suite.RATIO_PEERS[0])
