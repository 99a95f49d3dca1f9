"""The timing core on a GPU (skipped without CUDA; scripts/gpu_gate.sh runs it): CUDA events read the GPU's time,
not the host's (the CPU side of the timing core: tests/bench/test_timing.py)."""
import time

import pytest
import torch
import triton
import triton.testing

from attnbench.bench.timing import measure

pytestmark = [pytest.mark.gpu, pytest.mark.perf]


def test_gpu_time_keeps_the_host_out_and_the_gpu_in():
    """A call that spends 2 ms on the host and ~0.2 ms on the GPU reads its GPU time. With
    triton's do_bench, the timing core before attnbench/kernels/gpu_time.py, the same call reads >= 2 ms."""
    cycles_200us = 200 * 1000  # at most 2 GHz: at least 0.1 ms even at the top clock

    def host_heavy():
        time.sleep(0.002)
        torch.cuda._sleep(cycles_200us)

    t = measure(host_heavy, "cuda", warmup_ms=5, rep_ms=40)
    assert t.method == "cuda-events"
    assert 0.09 < t.median_ms < 0.6, t
    assert triton.testing.do_bench(host_heavy, warmup=5, rep=40, return_mode="median") > 1.5
