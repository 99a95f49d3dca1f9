"""Timing core shared by pytest, the CLI and asv.

On a GPU: one untimed call first (compilation and autotuning happen there), then
``triton.testing.do_bench``: CUDA events around each call, the L2 cache flushed between calls,
all samples returned so that we report the median and the interquartile range ourselves.
``cuda_graph=True`` replays a captured graph instead, for launch-bound cases.

On a CPU the same call returns wall-clock samples labelled "cpu-wall"; the CLI says that Triton
variants there run in the interpreter, so CPU numbers check that code runs, never how fast.
"""
import statistics
import time
from dataclasses import asdict, dataclass

import torch



@dataclass
class Timing:
    median_ms: float
    q1_ms: float
    q3_ms: float
    samples: int
    method: str  # "cuda-events", "cuda-graph", "cpu-wall", or "interpreter" (Triton on a CPU)

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    @property
    def is_gpu(self) -> bool:
        return self.method.startswith("cuda")

    def as_dict(self):
        return {**asdict(self), "iqr_ms": self.iqr_ms}


def not_graph_capturable(fn):
    """Mark a timed callable that cannot be captured in a CUDA graph. Autograd's backward is one:
    on an H200 (torch 2.11) capturing it failed with 'operation would make the legacy stream depend
    on a capturing blocking stream', the engine's work being on the legacy stream."""
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


def measure(fn, device, *, warmup_ms: float = 25, rep_ms: float = 100, cuda_graph: bool = False,
            cpu_reps: int = 3, cpu_budget_s: float = 2.0) -> Timing:
    """Median and IQR of ``fn()`` on ``device``, compilation and autotuning kept out of the samples."""
    device = torch.device(device)
    if cuda_graph and device.type == "cuda" and not getattr(fn, "graph_capturable", True):
        from .registry import Unsupported

        raise Unsupported("autograd backward cannot be captured in a CUDA graph; time it without --graphs")
    fn()  # untimed: compile, autotune, allocate
    synchronize(device)
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            samples = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="all")
            return summarize(samples, "cuda-graph")
        samples = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        return summarize(samples, "cuda-events")
    samples = []
    start = time.perf_counter()
    while len(samples) < cpu_reps and (not samples or time.perf_counter() - start < cpu_budget_s):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, "cpu-wall")


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
