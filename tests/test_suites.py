"""The asv suite spells out its parameters (so its ~500 spawned interpreters skip importing torch):
they must stay equal to the operator's own, or the dashboard would silently lose variants."""
import pytest

import attnbench
from suites import flash as flash_suite


def test_flash_suite_parameters_match_the_operator():
    op = attnbench.get("flash")
    assert flash_suite.LABELS == [c.label for c in op.cases("anchor")]
    assert flash_suite.VARIANTS == list(op.variants)
    assert flash_suite.MODES == list(op.modes)
    assert set(flash_suite.RATIO_PEERS) <= set(op.variants)
    assert flash_suite.RATIO_PEERS == list(op.ratio_peers)  # the dashboard states the CLI's claim


@pytest.mark.interpreter  # the CPU gate: no CUDA there
def test_measurement_is_empty_without_cuda_so_asv_skips():
    assert flash_suite.measure_flash() == {}


@pytest.mark.interpreter
def test_setup_raises_not_implemented_for_a_missing_measurement():
    with pytest.raises(NotImplementedError):
        flash_suite.FlashAnchor().setup({}, flash_suite.LABELS[0], "triton", "fwd")
    with pytest.raises(NotImplementedError):
        flash_suite.FlashTritonSpeedup().setup({}, flash_suite.LABELS[0], "fwd", "sdpa_flash")
