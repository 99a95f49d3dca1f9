"""asv benchmarks for the flash operator: every variant, every mode, on the anchor cases; and the
Hopper issue's sweep (D 64-256, N 512-32K, causal and not, GQA, decode) for ours, SDPA FLASH and cuDNN.

The shared measuring pass and benchmark bodies are in suites/_anchor.py; this module spells out
the operator's parameters (no torch import: asv runs ~500 processes) and
tests/bench/test_suites.py keeps them equal to the operator's own.
"""
from ._anchor import latency_suite, measurement, operator_suites, speedup_suite

OP = "flash"
LABELS = ["B4 H16 N4096 D64 bf16", "B4 H16 N4096 D64 causal bf16",
          "B2 H16 N8192 D128 bf16", "B2 H16 N8192 D128 causal bf16"]  # flash's "anchor" set
VARIANTS = ["reference", "split", "triton", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex",
            "fa4", "fa4_deterministic", "flashinfer"]
MODES = ["fwd", "bwd", "fwd_bwd"]
RATIO_PEERS = ["sdpa_flash", "sdpa_cudnn", "flex", "fa4", "fa4_deterministic", "flashinfer"]
# the lambda: this module's own function, which asv keys the measuring pass's cache by (_anchor.measurement)
measure_flash, FlashAnchor, FlashTritonSpeedup = operator_suites(lambda: None, OP, LABELS, VARIANTS, MODES,
    RATIO_PEERS, "FlashAnchor", "FlashTritonSpeedup",
    "Triton's speed as a multiple of each peer's (peer latency / Triton latency), same run.")

# flash's "sweep" set
SWEEP_LABELS = ["B64 H16 N512 D64 bf16", "B64 H16 N512 D64 causal bf16", "B32 H16 N1024 D64 bf16",
                "B32 H16 N1024 D64 causal bf16", "B16 H16 N2048 D64 bf16", "B16 H16 N2048 D64 causal bf16",
                "B8 H16 N4096 D64 bf16", "B8 H16 N4096 D64 causal bf16", "B4 H16 N8192 D64 bf16",
                "B4 H16 N8192 D64 causal bf16", "B2 H16 N16384 D64 bf16", "B2 H16 N16384 D64 causal bf16",
                "B1 H16 N32768 D64 bf16", "B1 H16 N32768 D64 causal bf16", "B64 H16 N512 D96 bf16",
                "B64 H16 N512 D96 causal bf16", "B32 H16 N1024 D96 bf16", "B32 H16 N1024 D96 causal bf16",
                "B16 H16 N2048 D96 bf16", "B16 H16 N2048 D96 causal bf16", "B8 H16 N4096 D96 bf16",
                "B8 H16 N4096 D96 causal bf16", "B4 H16 N8192 D96 bf16", "B4 H16 N8192 D96 causal bf16",
                "B2 H16 N16384 D96 bf16", "B2 H16 N16384 D96 causal bf16", "B1 H16 N32768 D96 bf16",
                "B1 H16 N32768 D96 causal bf16", "B64 H16/4 N512 D128 bf16", "B64 H16/4 N512 D128 causal bf16",
                "B32 H16/4 N1024 D128 bf16", "B32 H16/4 N1024 D128 causal bf16", "B16 H16/4 N2048 D128 bf16",
                "B16 H16/4 N2048 D128 causal bf16", "B8 H16/4 N4096 D128 bf16", "B8 H16/4 N4096 D128 causal bf16",
                "B4 H16/4 N8192 D128 bf16", "B4 H16/4 N8192 D128 causal bf16", "B2 H16/4 N16384 D128 bf16",
                "B2 H16/4 N16384 D128 causal bf16", "B1 H16/4 N32768 D128 bf16", "B1 H16/4 N32768 D128 causal bf16",
                "B64 H8 N512 D256 bf16", "B64 H8 N512 D256 causal bf16", "B32 H8 N1024 D256 bf16",
                "B32 H8 N1024 D256 causal bf16", "B16 H8 N2048 D256 bf16", "B16 H8 N2048 D256 causal bf16",
                "B8 H8 N4096 D256 bf16", "B8 H8 N4096 D256 causal bf16", "B4 H8 N8192 D256 bf16",
                "B4 H8 N8192 D256 causal bf16", "B2 H8 N16384 D256 bf16", "B2 H8 N16384 D256 causal bf16",
                "B1 H8 N32768 D256 bf16", "B1 H8 N32768 D256 causal bf16", "B32 H32/8 N1x8192 D64 bf16",
                "B32 H32/8 N16x8192 D64 causal-br bf16", "B32 H32/8 N1x8192 D96 bf16",
                "B32 H32/8 N16x8192 D96 causal-br bf16", "B32 H32/8 N1x8192 D128 bf16",
                "B32 H32/8 N16x8192 D128 causal-br bf16", "B16 H32/8 N1x8192 D256 bf16",
                "B16 H32/8 N16x8192 D256 causal-br bf16"]
SWEEP_VARIANTS = ["triton", "sdpa_flash", "sdpa_cudnn"]
SWEEP_MODES = ["fwd", "bwd"]
SWEEP_PEERS = ["sdpa_flash", "sdpa_cudnn"]

measure_flash_sweep = measurement(lambda: None, OP, "sweep", SWEEP_VARIANTS, SWEEP_MODES)  # a cache of its own
FlashSweep = latency_suite(
    "FlashSweep", measure_flash_sweep, SWEEP_LABELS, SWEEP_VARIANTS, SWEEP_MODES,
    "The sweep's latencies (the plot's TF/s are in the run's report); the ratios below.")
FlashSweepSpeedup = speedup_suite("FlashSweepSpeedup", measure_flash_sweep, SWEEP_LABELS, SWEEP_MODES, SWEEP_PEERS)
