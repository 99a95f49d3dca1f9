"""Fixtures of the attention tests (flash and jvp_attention)."""
import pytest

import attnbench

from ..helpers import HAS_CUDA, oracle_cache


@pytest.fixture(scope="module")
def oracles():
    """get(case, seed=0) -> (inputs, float64 oracle, eager reference in the case dtype) of flash, computed
    once per module for every variant and mode. Inputs live on the GPU when there is one, where
    only the latest case is kept: a float64 oracle at real sizes is large."""
    return oracle_cache(attnbench.get("flash"), "cuda" if HAS_CUDA else "cpu", latest_only=HAS_CUDA)


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
