"""asv benchmarks for the flash operator: every variant, every mode, on the anchor cases.

One measuring pass (``measure_flash``, asv's ``setup_cache``) compiles, autotunes, verifies and
times everything once through attnbench's timing core (CUDA events, L2 flushed, median of many);
the ``track_`` benchmarks then read their number from it. asv treats every number as
lower-is-better, so latency is the regression signal; TF/s, GB/s, % of roofline and peak GPU
memory are tracked for display. Without CUDA, or where a variant cannot run a case, setup raises
NotImplementedError and asv records the benchmark as skipped.
"""
import math

import attnbench
from attnbench.runner import bench

OP = attnbench.get("flash")
CASES = OP.cases("anchor")
LABELS = [c.label for c in CASES]
VARIANTS = list(OP.variants)
MODES = list(OP.modes)
RATIO_PEERS = ["sdpa_flash", "sdpa_cudnn", "flex"]


def measure_flash(*_bound_instance):
    """Measure every (case, variant, mode) once; asv shares this between the classes below."""
    import torch

    if not torch.cuda.is_available():
        return {}
    rows = bench(OP, CASES, "cuda", progress=True)
    return {(r.case, r.variant, r.mode): {
        "latency_ms": r.timing.median_ms, "iqr_ms": r.timing.iqr_ms, "tflops": r.tflops, "gbps": r.gbps,
        "roofline_pct": r.roofline_pct, "peak_mem_mb": (r.peak_mem_bytes or 0) / 2**20, "max_error": r.max_error,
    } for r in rows if r.timing}


measure_flash.timeout = 3000


class FlashAnchor:
    params = (LABELS, VARIANTS, MODES)
    param_names = ["case", "variant", "mode"]
    setup_cache = measure_flash
    timeout = 600

    def setup(self, results, case, variant, mode):
        if (case, variant, mode) not in results:
            raise NotImplementedError(f"{variant} did not run {mode} on {case} here (no CUDA, or unsupported)")
        self.result = results[case, variant, mode]

    def track_latency_ms(self, results, case, variant, mode):
        return self.result["latency_ms"]

    track_latency_ms.unit = "ms"

    def track_tflops(self, results, case, variant, mode):
        return self.result["tflops"]

    track_tflops.unit = "TF/s"

    def track_gbps(self, results, case, variant, mode):
        return self.result["gbps"]

    track_gbps.unit = "GB/s"

    def track_roofline_pct(self, results, case, variant, mode):
        return self.result["roofline_pct"]

    track_roofline_pct.unit = "%"

    def track_peak_gpu_memory_mb(self, results, case, variant, mode):
        return self.result["peak_mem_mb"]

    track_peak_gpu_memory_mb.unit = "MiB"

    def track_max_relative_error(self, results, case, variant, mode):
        return self.result["max_error"]

    track_max_relative_error.unit = "relative"


class FlashTritonSpeedup:
    """Triton's speed as a multiple of each peer's (peer latency / Triton latency), same run."""

    params = (LABELS, MODES, RATIO_PEERS)
    param_names = ["case", "mode", "peer"]
    setup_cache = measure_flash
    timeout = 600

    def setup(self, results, case, mode, peer):
        ours, theirs = results.get((case, "triton", mode)), results.get((case, peer, mode))
        if not ours or not theirs:
            raise NotImplementedError(f"triton or {peer} did not run {mode} on {case} here")
        self.ratio = theirs["latency_ms"] / ours["latency_ms"]

    def track_speedup(self, results, case, mode, peer):
        return self.ratio if math.isfinite(self.ratio) else math.nan

    track_speedup.unit = "x"
