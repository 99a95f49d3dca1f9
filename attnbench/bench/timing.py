"""Timing core shared by pytest, the CLI and asv.

On a GPU: one untimed call first (compilation and autotuning happen there), then CUDA events
around each call, the L2 cache flushed before each, and each call queued behind a GPU sleep longer
than its host time (``attnbench/kernels/gpu_time.py``: with ``triton.testing.do_bench`` the small calls' samples
read their host time, not the GPU's); all samples returned so that we report the median and the
interquartile range ourselves. ``cuda_graph=True`` replays a captured graph instead.

On a CPU the same call returns wall-clock samples labelled "cpu-wall" (``CPU_SAMPLING`` says how
many); the CLI says that Triton variants there run in the interpreter, so CPU numbers check that
code runs, never how fast.

Two more clocks on a GPU, for what a user who calls an op from Python pays:
- **eager** (``measure_eager``): wall time per call, calls back to back, host included, between
  synchronizations (the L2 is not flushed: a loop of calls is what it times). A fast kernel behind a
  slow launch path loses here and not in GPU time.
- **host** (``measure_host``): the host's time to issue one call, the calls queued behind a GPU
  sleep so that none waits for the GPU: the launch path's cost alone.
"""
import gc
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..kernels.gpu_time import gpu_time_samples

# CPU sampling rule: after the untimed first call, warm up until ``warmup_ms`` has passed, then
# sample until at least ``cpu_reps`` samples AND ``rep_ms`` of sampling (the same budget do_bench
# gets on a GPU), or until the hard cap ``cpu_budget_s`` (at least one sample). Python's garbage
# collector is off while sampling, as in ``timeit``: a collection inside one sample is an outlier
# that belongs to no variant. torch runs on ONE intra-op thread while sampling: with its default two
# threads on a shared 2-core VM, the eager reference's forward on the first tiny case read 32 ms
# instead of 0.098 ms (an OpenMP worker waits for a core that someone else holds), and the same 102
# tiny-set rows timed three times differed between runs by 25x at the median and 350x at worst
# (the likely cause of the run that read 500x high); on one thread: 1.3x and 2.1x.
CPU_MIN_SAMPLES = 5
CPU_BUDGET_S = 2.0
CPU_MAX_SAMPLES = 10_000
# A timing whose IQR exceeds this fraction of its median is flagged as noisy (``Timing.noisy``): at
# 25% the quartiles cannot separate the decision rules' 1.30 "prioritize" step, while GPU rows and
# quiet CPU rows stay far below it and a CPU shared with other jobs often does not
# (docs/methodology.md has the measured spreads).
NOISY_IQR_FRACTION = 0.25


@dataclass
class Timing:
    median_ms: float
    q1_ms: float
    q3_ms: float
    samples: int
    method: str  # "cuda-events", "cuda-graph", "cpu-wall", "interpreter" (Triton on a CPU), "eager-wall", "host"

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    @property
    def is_gpu(self) -> bool:
        return self.method.startswith("cuda")

    @property
    def noisy(self) -> bool:
        """The spread is wide: IQR above ``NOISY_IQR_FRACTION`` of the median."""
        return self.samples > 1 and self.iqr_ms > NOISY_IQR_FRACTION * self.median_ms

    def as_dict(self):
        return {**asdict(self), "iqr_ms": self.iqr_ms}


def comparable(a: Timing, b: Timing) -> bool:
    """Two timings can be divided: the same clock, and not the interpreter's (it times numpy
    emulating a GPU, not the kernel)."""
    return a.method == b.method and a.method != "interpreter"


def not_graph_capturable(fn):
    """Mark a timed callable that cannot be captured in a CUDA graph. Autograd's backward is one:
    capturing it fails ('operation would make the legacy stream depend on a capturing blocking
    stream', torch 2.11), the engine's work being on the legacy stream."""
    fn.graph_capturable = False
    return fn


def summarize(samples_ms, method: str) -> Timing:
    samples = sorted(float(s) for s in samples_ms)
    if not samples:
        raise ValueError("no timing samples")
    if len(samples) == 1:
        return Timing(samples[0], samples[0], samples[0], 1, method)
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return Timing(med, q1, q3, len(samples), method)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cuda_synchronized_clock() -> float:
    """A host clock that first waits for the GPU: for pytest-benchmark's ``--benchmark-timer``."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# One graph replay holds this many milliseconds of back-to-back calls (do_bench_cudagraph times 10 replays, a
# sync between them). Longer replays of a power-hungry kernel hold the card at its power limit, and the SM clock
# falls: so the replay would time a throttled clock that the events samples (a flush and a sleep before every
# call) never see, and the two clocks would disagree for that reason alone (docs/measurements/gate.md).
GRAPH_REPLAY_MS = 10


def measure(fn, device, *, warmup_ms: float = 25, rep_ms: float = 100, cuda_graph: bool = False,
            cpu_reps: int = CPU_MIN_SAMPLES, cpu_budget_s: float = CPU_BUDGET_S,
            cpu_max_samples: int = CPU_MAX_SAMPLES) -> Timing:
    """Median and IQR of ``fn()`` on ``device``, compilation and autotuning kept out of the samples."""
    device = torch.device(device)
    if cuda_graph and device.type == "cuda" and not getattr(fn, "graph_capturable", True):
        from .registry import Unsupported

        raise Unsupported("autograd backward cannot be captured in a CUDA graph; time it without --graphs")
    start = time.perf_counter()
    fn()  # untimed: compile, autotune, allocate
    synchronize(device)
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            try:
                samples = triton.testing.do_bench_cudagraph(fn, rep=min(rep_ms, GRAPH_REPLAY_MS), return_mode="all")
            except RuntimeError as exc:  # a capture PyTorch refuses is a property of the route: report it
                from .registry import Unsupported

                torch.cuda.synchronize(device)
                raise Unsupported(f"CUDA-graph capture failed: {str(exc).strip().splitlines()[0][:160]}") from None
            return summarize(samples, "cuda-graph")
        with torch.cuda.device(device):
            samples = gpu_time_samples(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
        return summarize(samples, "cuda-events")
    return summarize(_cpu_samples(fn, start, warmup_ms, rep_ms, cpu_reps, cpu_budget_s, cpu_max_samples), "cpu-wall")


# Eager and host samples are rounds of back-to-back calls, each round about this long, so that the
# host clock's resolution and one synchronization are small beside it.
ROUND_MS = 2.0
MAX_ROUND_CALLS = 1000  # also bounds the launches queued behind the host clock's sleep


def _round_calls(per_call_ms: float) -> int:
    return max(1, min(MAX_ROUND_CALLS, int(ROUND_MS / max(per_call_ms, 1e-4))))


def measure_eager(fn, device, *, warmup_ms: float = 10, rep_ms: float = 50, min_samples: int = 5) -> Timing:
    """Eager latency: wall ms per call of ``fn`` called back to back, host and GPU together, each
    sample a round of calls between two synchronizations (``fn`` has run once: compiled, tuned)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("measure_eager times CUDA calls; on a CPU measure's cpu-wall clock is the eager latency")

    def one_round(calls):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3 / calls

    with torch.cuda.device(device):
        per_call = one_round(1)
        calls = _round_calls(per_call)
        begin = time.perf_counter()
        while (time.perf_counter() - begin) * 1e3 < warmup_ms:
            one_round(calls)
        samples, begin = [], time.perf_counter()
        while len(samples) < min_samples or (time.perf_counter() - begin) * 1e3 < rep_ms:
            samples.append(one_round(calls))
    return summarize(samples, "eager-wall")


def measure_host(fn, device, *, rep_ms: float = 50, min_samples: int = 5) -> Timing:
    """Host ms to issue one call of ``fn``: rounds of calls submitted while the GPU sleeps (longer
    than the round's host time), so that no launch waits for the GPU. A call that synchronizes
    inside (an ``.item()``) waits out the sleep, and reads as slow as it is for a user."""
    from ..kernels.gpu_time import SLEEP_CYCLES_PER_US

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("measure_host times CUDA calls")

    def one_round(calls, sleep_us):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(sleep_us * SLEEP_CYCLES_PER_US))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize(device)
        return elapsed / calls

    with torch.cuda.device(device):
        per_call = one_round(1, 1000)
        calls = _round_calls(per_call)
        sleep_us = 2e3 * per_call * calls + 50
        samples, begin = [], time.perf_counter()
        while len(samples) < min_samples or (time.perf_counter() - begin) * 1e3 < rep_ms:
            samples.append(one_round(calls, sleep_us))
    return summarize(samples, "host")


def _cpu_samples(fn, start, warmup_ms, rep_ms, min_samples, budget_s, max_samples):
    """Wall-clock samples by the CPU sampling rule (see ``CPU_MIN_SAMPLES``)."""
    samples = []
    gc_was_enabled, threads = gc.isenabled(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while (time.perf_counter() - start) * 1e3 < warmup_ms:  # a slow first call is warm-up enough
            fn()
        gc.disable()
        begin = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            samples.append((t1 - t0) * 1e3)
            elapsed = t1 - begin
            if elapsed >= budget_s or len(samples) >= max_samples:
                return samples
            if len(samples) >= min_samples and elapsed * 1e3 >= rep_ms:
                return samples
    finally:
        torch.set_num_threads(threads)
        if gc_was_enabled:
            gc.enable()


def peak_memory_bytes(fn, device) -> int | None:
    """GPU memory high-water mark of one ``fn()`` above what was allocated before it (None on CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
