"""The shared_context asv suite (on suites/_anchor.py; tests/bench/test_suites.py checks its parameters
against the operator with every other suite): no torch import at module level, and its classes are
the ones asv collects."""
import ast
from pathlib import Path

import attnbench
from suites import shared_context as suite


def test_suite_is_built_on_the_shared_base_with_the_operators_parameters():
    op = attnbench.get(suite.OP)
    assert suite.OP == "shared_context"
    assert suite.LABELS == [c.label for c in op.cases("anchor")]
    assert suite.VARIANTS == list(op.variants) and suite.MODES == list(op.modes)
    assert suite.RATIO_PEERS == list(op.ratio_peers)


def test_suite_module_does_not_import_torch_at_top_level():
    tree = ast.parse(Path(suite.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(name and name.split(".")[0] in ("torch", "attnbench", "triton") for name in names), names
