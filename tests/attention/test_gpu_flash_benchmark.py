"""Quick per-change timings with pytest-benchmark (GPU only; asv keeps the history).

    pytest -m gpu tests/attention/test_gpu_flash_benchmark.py --benchmark-json out.json

pytest-benchmark's own rounds use a host clock that synchronizes the GPU first
(``attnbench.bench.timing.cuda_synchronized_clock``); each entry also carries the timing core's
CUDA-event median and IQR (L2 flushed), TF/s and the case, in ``extra_info``.
"""
import functools

import pytest

import attnbench
from attnbench.bench import verify
from attnbench.bench.roofline import achieved, ceilings
from attnbench.bench.timing import cuda_synchronized_clock, measure

pytestmark = [pytest.mark.gpu, pytest.mark.perf]

OP = attnbench.get("flash")
CASES = OP.cases("anchor")[:2]


@functools.lru_cache(maxsize=1)
def inputs_and_oracle(case):
    x = OP.make_inputs(case, "cuda", 0)
    return x, OP.oracle(case, x)


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
@pytest.mark.parametrize("variant", ["triton", "sdpa_flash"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_flash_latency(benchmark, tuned_kernels, case, variant, mode):
    x, oracle = inputs_and_oracle(case)
    fn = OP.variants[variant].prepare(case, x, mode)
    out = fn()
    assert max(verify.relative_error(out[k], oracle[k]) for k in out) < verify.BOUNDS[case.torch_dtype]
    timing = measure(fn, "cuda")  # also the warm-up: compilation and autotuning happen here
    perf = achieved(OP.flops(case, mode), OP.bytes(case, mode), timing, ceilings("cuda"))
    benchmark.extra_info.update(case=case.label, cuda_event_median_ms=timing.median_ms,
                                cuda_event_iqr_ms=timing.iqr_ms, tflops=perf.tflops, roofline_pct=perf.roofline_pct)
    benchmark._timer = cuda_synchronized_clock
    benchmark.pedantic(fn, rounds=20, warmup_rounds=3)
