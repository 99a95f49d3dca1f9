"""Fixtures of the shared_context tests."""
import pytest

import attnbench

from ..helpers import HAS_CUDA, oracle_cache


@pytest.fixture(scope="module")
def oracles():
    """get(case, seed=0) -> (inputs, float64 oracle, reference in the case dtype) of shared_context, computed once
    per module. On the CPU (the interpreter tests) every case is kept; on a GPU (the GPU gate) inputs live there and
    only the latest case is kept."""
    return oracle_cache(attnbench.get("shared_context"), "cuda" if HAS_CUDA else "cpu", latest_only=HAS_CUDA)
