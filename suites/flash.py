"""asv benchmarks for the flash operator: every variant, every mode, on the anchor cases.

asv's spawn launcher starts a fresh interpreter for every parameter combination (~500 here), so
this module must not import torch: the case labels and variant names are spelled out below, and
tests/test_suites.py fails if they drift from the operator's own. Only ``measure_flash`` imports
attnbench.

One measuring pass (``measure_flash``, asv's ``setup_cache``) compiles, autotunes, verifies and
times everything once through attnbench's timing core (CUDA events, L2 flushed, median of many);
the ``track_`` benchmarks then read their number from it. asv treats every number as
lower-is-better, so latency is the regression signal; TF/s, GB/s, % of roofline and peak GPU
memory are tracked for display. Without CUDA, or where a variant cannot run a case, setup raises
NotImplementedError and asv records the benchmark as skipped.
"""
import math

LABELS = ["B4 H16 N4096 D64 bf16", "B4 H16 N4096 D64 causal bf16",
          "B2 H16 N8192 D128 bf16", "B2 H16 N8192 D128 causal bf16"]  # flash's "anchor" set
VARIANTS = ["reference", "split", "triton", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"]
MODES = ["fwd", "bwd", "fwd_bwd"]
RATIO_PEERS = ["sdpa_flash", "sdpa_cudnn", "flex"]


def measure_flash(*_bound_instance):
    """Measure every (case, variant, mode) once; asv shares this between the classes below."""
    import torch

    if not torch.cuda.is_available():
        return {}
    import attnbench
    from attnbench.runner import bench

    op = attnbench.get("flash")
    rows = bench(op, op.cases("anchor"), "cuda", progress=True)
    return {(r.case, r.variant, r.mode): {
        "latency_ms": r.timing.median_ms, "iqr_ms": r.timing.iqr_ms, "tflops": r.tflops, "gbps": r.gbps,
        "roofline_pct": r.roofline_pct, "peak_mem_mb": (r.peak_mem_bytes or 0) / 2**20,
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
