"""Test gate wiring: GPU-marked tests skip without CUDA; interpreter tests skip on a GPU machine.

The CPU gate (CI) runs Triton kernels through TRITON_INTERPRET=1, which ``import attnbench``
switches on by itself when torch sees no CUDA device. The GPU gate runs ``pytest -m gpu``.
"""
import pytest
import torch

import attnbench  # noqa: F401  first: sets the interpreter switch before triton is imported
from attnbench.kernels import interpreting

HAS_CUDA = torch.cuda.is_available()


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


@pytest.fixture(scope="module")
def oracles():
    """get(case, seed=0) -> (inputs, float64 oracle, eager reference in the case dtype), computed
    once per module for every variant and mode. Inputs live on the GPU when there is one, where
    only the latest case is kept: a float64 oracle at real sizes is large."""
    op = attnbench.get("flash")
    device = "cuda" if HAS_CUDA else "cpu"
    cache = {}

    def get(case, seed=0):
        if (case, seed) not in cache:
            if HAS_CUDA:
                cache.clear()
            x = op.make_inputs(case, device, seed)
            cache[case, seed] = (x, op.oracle(case, x), op.oracle(case, x, dtype=case.torch_dtype))
        return cache[case, seed]

    return get


@pytest.fixture(scope="module")
def tuned_kernels():
    """Kernels autotuned as shipped. The GPU gate runs with ATTNBENCH_AUTOTUNE=0 (one default
    config per shape keeps tens of correctness shapes fast), and Triton's autotuner remembers its
    pick per key, so performance tests clear those picks and tune again."""
    from attnbench.kernels.attention import attention_bwd_jvp
    from attnbench.kernels.attention import attention_jvp
    from attnbench.kernels.attention import flash_bwd
    from attnbench.kernels.attention import flash_decode
    from attnbench.kernels.attention import flash_fwd

    kernels = (flash_fwd.flash_fwd_kernel, flash_decode.flash_decode_kernel, flash_bwd.flash_bwd_dkdv_kernel,
               flash_bwd.flash_bwd_dq_kernel,
               attention_jvp.attention_jvp_kernel, attention_bwd_jvp.bwd_jvp_dkdv_kernel,
               attention_bwd_jvp.bwd_jvp_dq_kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNBENCH_AUTOTUNE", "1")
        for kernel in kernels:
            kernel.cache.clear()
        yield
        for kernel in kernels:
            kernel.cache.clear()


@pytest.fixture
def triton_only(monkeypatch):
    """The sparse Functions on Triton, forced, and their split implementation made to fail: every forward, every
    derivative's included (autograd runs the backward after the test's own calls return), must run on the
    kernels. test_gpu_sparse.py has its own (CUDA by default, outputs NaN-poisoned)."""
    from attnbench.sparse import functional, use_implementation

    def refuse(*args, **kwargs):
        raise AssertionError("the split implementation ran under use_implementation('triton')")

    monkeypatch.setattr(functional, "sparse_product_split", refuse)
    monkeypatch.setattr(functional, "sparse_scale_split", refuse)
    with use_implementation("triton"):
        yield


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
        return launches

    return spy


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
