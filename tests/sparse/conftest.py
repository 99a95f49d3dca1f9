"""Fixtures of the sparse tests. ``triton_only`` and ``all_rows_launches`` serve the interpreter tests; the GPU
files (test_gpu_*.py, whose cases and bounds live in gpu_cases.py) use ``gpu_triton_only`` and
``default_launch_configs``."""
import pytest


@pytest.fixture
def triton_only(monkeypatch):
    """The sparse Functions on Triton, forced, and their split implementation made to fail: every forward, every
    derivative's included (autograd runs the backward after the test's own calls return), must run on the
    kernels. The GPU files use ``gpu_triton_only`` (CUDA's default implementation, outputs NaN-poisoned)."""
    from attnbench.sparse import functional, use_implementation

    def refuse(*args, **kwargs):
        raise AssertionError("the split implementation ran under use_implementation('triton')")

    monkeypatch.setattr(functional, "sparse_product_split", refuse)
    monkeypatch.setattr(functional, "sparse_scale_split", refuse)
    with use_implementation("triton"):
        yield


@pytest.fixture
def all_rows_launches(monkeypatch, spy_kernel):
    """ALL_ROWS of the sparse product kernel (attnbench/kernels/sparse/segment.py) allowed for every op at every batch, mul's
    bilinear route off (mul on the segment kernel), and the kernel's launches recorded: a list of each launch's
    constexpr keywords (ALL_ROWS, ACCUMULATE, DOT, ...)."""
    from attnbench.kernels.sparse import segment as sparse_segment
    from attnbench.sparse import CHANNEL_RANKS, triton_ops

    monkeypatch.setitem(triton_ops.BILINEAR_ROUTE, "enabled", False)

    monkeypatch.setitem(sparse_segment.ALL_ROWS, "min_batch", 0)
    monkeypatch.setitem(sparse_segment.ALL_ROWS, "ops", frozenset(CHANNEL_RANKS))
    return spy_kernel(sparse_segment, "sparse_product_kernel").kwargs


@pytest.fixture(scope="module")
def default_launch_configs():
    """One launch config per kernel key, as scripts/gpu_gate.sh runs the correctness gate (ATTNBENCH_AUTOTUNE=0):
    a tuning sweep per shape would dominate the sparse GPU files' runtime, and every config must be correct anyway.
    Every test of those files uses it (gpu_cases.GPU_MARKS)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNBENCH_AUTOTUNE", "0")
        yield


@pytest.fixture
def gpu_triton_only(monkeypatch):
    """``triton_only`` of the GPU files: the default implementation for CUDA tensors (the dry run forces Triton: CPU
    tensors default to split), with the split implementation made to fail, so every forward, those of every
    derivative included, runs on the kernels; and every kernel output NaN-poisoned, so an element a kernel forgets
    fails. Poisoning is patched at module level: ``poisoned_outputs()`` is thread-local, and autograd runs CUDA
    backward nodes on its own device thread."""
    from attnbench.kernels import outputs as kernel_outputs
    from attnbench.sparse import functional, use_implementation

    from .gpu_cases import DRYRUN

    def refuse(*args, **kwargs):
        raise AssertionError("the split implementation ran: sparse forwards on CUDA tensors must run on Triton")

    monkeypatch.setattr(functional, "sparse_product_split", refuse)
    monkeypatch.setattr(functional, "sparse_scale_split", refuse)
    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    with use_implementation("triton" if DRYRUN else None):
        yield
