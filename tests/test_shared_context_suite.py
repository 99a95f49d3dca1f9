"""The shared_context asv suite spells out its parameters (no torch import at module level): they
must stay equal to the operator's own, or the dashboard would silently lose variants or cases."""
import ast
from pathlib import Path

import pytest

import attnbench
from suites import shared_context as suite


def test_suite_parameters_match_the_operator():
    op = attnbench.get("shared_context")
    assert suite.LABELS == [c.label for c in op.cases("anchor")]
    assert suite.VARIANTS == list(op.variants)
    assert suite.MODES == list(op.modes)
    assert suite.RATIO_PEERS == list(op.ratio_peers)


def test_suite_module_does_not_import_torch_at_top_level():
    tree = ast.parse(Path(suite.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(name and name.split(".")[0] in ("torch", "attnbench", "triton") for name in names), names


@pytest.mark.interpreter  # the CPU gate: no CUDA there
def test_measurement_is_empty_without_cuda_so_asv_skips():
    assert suite.measure_shared_context() == {}


@pytest.mark.interpreter
def test_setup_raises_not_implemented_for_a_missing_measurement():
    with pytest.raises(NotImplementedError):
        suite.SharedContextAnchor().setup({}, suite.LABELS[0], "triton", "fwd")
    with pytest.raises(NotImplementedError):
        suite.SharedContextTritonSpeedup().setup({}, suite.LABELS[0], "fwd", "fold_flash")
