"""Test gate wiring shared by every family: GPU-marked tests skip without CUDA; interpreter tests skip on a GPU
machine. The fixtures here serve more than one family (``flash``: the attention and bench tests; ``spy_kernel``:
the attention and sparse tests); a family's own fixtures live in its folder's conftest.py.

The CPU gate (CI) runs Triton kernels through TRITON_INTERPRET=1, which ``import attnbench``
switches on by itself when torch sees no CUDA device. The GPU gate runs ``pytest -m gpu``.

Layout: tests/<family>/ (attention, shared_context, sparse, bench, models), each a package (an __init__.py), so
that modules of the same basename in two folders import as tests.<family>.<name> and never clash; GPU tests live in
test_gpu_<topic>.py files marked ``gpu`` as a whole.
"""
import pytest

import attnbench  # noqa: F401  first: sets the interpreter switch before triton is imported
from attnbench.kernels import interpreting, launch

from .helpers import HAS_CUDA


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_gate.sh on one")
    no_interp = pytest.mark.skip(reason="interpreter test: runs where Triton uses TRITON_INTERPRET=1 (the CPU gate)")
    for item in items:
        # markers, not keywords: a parameter id such as "gpu" also lands in item.keywords
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(no_gpu)
        if item.get_closest_marker("interpreter") and not interpreting():
            item.add_marker(no_interp)


@pytest.fixture
def flash():
    return attnbench.get("flash")


class LaunchSpy:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``), keeps their positional and keyword arguments,
    passes them on."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.args, self.kwargs = kernel, 0, [], []

    def __getitem__(self, grid):
        self.launches += 1

        def launch(*args, **kwargs):
            self.args.append(args)
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def spy_kernel(monkeypatch):
    """``spy_kernel(module, name)``: the module's kernel replaced by a LaunchSpy for the test; returns the spy."""

    def spy(module, name):
        launches = LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, launches)
        launch.forget_plans()  # a plan or a host replay made before would launch past the spy
        return launches

    yield spy
    launch.forget_plans()
