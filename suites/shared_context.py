"""asv benchmarks for the shared_context operator: every variant on the anchor decode cases.

Like suites/flash.py, this module never imports torch at module level (asv spawns one interpreter
per parameter combination): the case labels, variant names and ratio peers are spelled out below
and tests/test_shared_context_suite.py fails if they drift from the operator's own. One measuring
pass (``measure_shared_context``, asv's ``setup_cache``) verifies and times everything through
attnbench's timing core; the ``track_`` benchmarks read their number from it. Latency is the
regression signal; GB/s and % of roofline (for these memory-bound decode steps: of the measured
copy bandwidth) and peak GPU memory are tracked for display. Without CUDA, or where a variant
cannot run a case (a per-batch cache that does not fit, a peer without the feature), setup
raises NotImplementedError and asv records the benchmark as skipped.
"""
import math

LABELS = ["B1024 H4 Lq2 ctx2048 buf32 D32 bf16", "B256 H4 Lq1 ctx512 buf0 D32 bf16",
          "B4096 H4 Lq1 ctx10000 buf0 D32 bf16", "B4096 H4 Lq2 ctx512 buf32 D32 bf16",
          "B256 H4 Lq2 ctx10000 buf32 D32 bf16", "B256 H32/8 Lq1 ctx4096 buf512 D128 bf16",
          "B512 H32/8 Lq1 ctx8192 buf256 D128 bf16", "B1024 H32/8 Lq1 ctx16384 buf128 D128 bf16"]  # "anchor"
VARIANTS = ["reference", "split", "triton", "triton_composed", "per_batch_math", "per_batch_flash",
            "per_batch_cudnn", "expand0_flash", "fold_flash", "fold_cudnn"]
MODES = ["fwd"]
RATIO_PEERS = ["per_batch_flash", "per_batch_cudnn", "split", "expand0_flash", "fold_flash", "fold_cudnn"]


def measure_shared_context(*_bound_instance):
    """Measure every (case, variant) once; asv shares this between the classes below."""
    import torch

    if not torch.cuda.is_available():
        return {}
    import attnbench
    from attnbench.runner import bench

    op = attnbench.get("shared_context")
    rows = bench(op, op.cases("anchor"), "cuda", progress=True)
    return {(r.case, r.variant, r.mode): {
        "latency_ms": r.timing.median_ms, "iqr_ms": r.timing.iqr_ms, "tflops": r.tflops, "gbps": r.gbps,
        "roofline_pct": r.roofline_pct, "peak_mem_mb": (r.peak_mem_bytes or 0) / 2**20,
    } for r in rows if r.timing}


measure_shared_context.timeout = 3000


class SharedContextAnchor:
    params = (LABELS, VARIANTS, MODES)
    param_names = ["case", "variant", "mode"]
    setup_cache = measure_shared_context
    timeout = 600

    def setup(self, results, case, variant, mode):
        if (case, variant, mode) not in results:
            raise NotImplementedError(f"{variant} did not run {mode} on {case} here (no CUDA, or unsupported)")
        self.result = results[case, variant, mode]

    def track_latency_ms(self, results, case, variant, mode):
        return self.result["latency_ms"]

    track_latency_ms.unit = "ms"

    def track_gbps(self, results, case, variant, mode):
        return self.result["gbps"]

    track_gbps.unit = "GB/s"

    def track_tflops(self, results, case, variant, mode):
        return self.result["tflops"]

    track_tflops.unit = "TF/s"

    def track_roofline_pct(self, results, case, variant, mode):
        return self.result["roofline_pct"]

    track_roofline_pct.unit = "%"

    def track_peak_gpu_memory_mb(self, results, case, variant, mode):
        return self.result["peak_mem_mb"]

    track_peak_gpu_memory_mb.unit = "MiB"


class SharedContextTritonSpeedup:
    """The fused Triton kernel's speed as a multiple of each peer's (peer latency / Triton's)."""

    params = (LABELS, MODES, RATIO_PEERS)
    param_names = ["case", "mode", "peer"]
    setup_cache = measure_shared_context
    timeout = 600

    def setup(self, results, case, mode, peer):
        ours, theirs = results.get((case, "triton", mode)), results.get((case, peer, mode))
        if not ours or not theirs:
            raise NotImplementedError(f"triton or {peer} did not run {mode} on {case} here")
        self.ratio = theirs["latency_ms"] / ours["latency_ms"]

    def track_speedup(self, results, case, mode, peer):
        return self.ratio if math.isfinite(self.ratio) else math.nan

    track_speedup.unit = "x"
