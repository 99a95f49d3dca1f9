"""GPU time of a call, the host's time kept out of it.

``triton.testing.do_bench`` records an event, calls ``fn``, records another, with an L2 flush (a
256 MB memset, tens of microseconds) queued before each call. The flush is the only GPU work ahead
of the call: when the call's host time (argument checks, Triton's launcher) is near it or longer,
the GPU reaches the start event first and waits for the host inside the timed interval, and the
sample reads the host: a launch-bound call's time, and its ratio over a peer, then vary from run
to run of the same code (docs/measurements/shared_context.md).

Here each call is queued behind the flush and a GPU sleep longer than the call's host time
(measured in the warm-up), so the whole call is submitted before the GPU reaches its start event:
a sample is the GPU's time on the call, from its first launch to its last kernel's end, gaps
between its kernels included, the host's Python not. Host time is a property of its own (the
decode model's end-to-end throughput shows it); a kernel comparison should not depend on it.
"""
import time

import torch

FLUSH_BYTES = 256 << 20  # larger than the L2 of the GPUs it runs on (Hopper's: 50 MB)
# The sleep is given in GPU cycles; counting them at 2 GHz (above Hopper's clocks) makes it at
# least as long as asked.
SLEEP_CYCLES_PER_US = 2000
ESTIMATE_CALLS = 5

_flush_buffers = {}


def _flush_buffer(device_index):
    buf = _flush_buffers.get(device_index)
    if buf is None:
        buf = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=torch.device("cuda", device_index))
        _flush_buffers[device_index] = buf
    return buf


def host_and_gpu_ms(fn, flush):
    """(host ms, GPU ms) of one flush-and-call, from ESTIMATE_CALLS back-to-back: host time is the
    submission loop's wall time (launches do not wait for the GPU), GPU time the events around it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(ESTIMATE_CALLS):
        flush.zero_()
        fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / ESTIMATE_CALLS
    torch.cuda.synchronize()
    return host_ms, start.elapsed_time(end) / ESTIMATE_CALLS


def gpu_time_samples(fn, *, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_samples: int = 5):
    """GPU milliseconds of ``fn()`` per call on the current CUDA device, one sample per call, the L2
    flushed before each: warm-up calls for ``warmup_ms``, then samples for ``rep_ms`` (at least
    ``min_samples``). ``fn`` has run once already (compiled, tuned)."""
    flush = _flush_buffer(torch.cuda.current_device())
    host_ms, gpu_ms = host_and_gpu_ms(fn, flush)
    # Sleep long enough that the start event, fn's launches and the end event are all submitted
    # while the GPU still sleeps: twice the measured host time of a flush-and-call, plus 20 us.
    sleep_us = 2 * host_ms * 1e3 + 20
    per_call_ms = max(gpu_ms + sleep_us * 1e-3, 1e-3)
    n_warmup = max(1, int(warmup_ms / per_call_ms))
    n_samples = max(min_samples, int(rep_ms / per_call_ms))
    cycles = int(sleep_us * SLEEP_CYCLES_PER_US)
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_samples)]
    for start, end in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def gpu_time_quantiles(fn, quantiles, *, warmup_ms: float = 10.0, rep_ms: float = 40.0):
    """``gpu_time_samples``' quantiles (a list, ``quantiles`` in [0, 1]): the signature of
    ``triton.autotune``'s ``do_bench`` hook, so that configs are compared by GPU time too. The
    autotuner calls it with a launch that has not run yet: the first call compiles."""
    fn()
    samples = sorted(gpu_time_samples(fn, warmup_ms=warmup_ms, rep_ms=rep_ms))
    return [samples[min(len(samples) - 1, int(round(q * (len(samples) - 1))))] for q in quantiles]


def gpu_time_median_ms(fn, *, warmup_ms: float = 5.0, rep_ms: float = 25.0) -> float:
    """The median of ``gpu_time_samples`` (for launchers that time candidates, e.g. split counts)."""
    return gpu_time_quantiles(fn, (0.5,), warmup_ms=warmup_ms, rep_ms=rep_ms)[0]
