"""asv benchmarks for the flash operator: every variant, every mode, on the anchor cases.

The shared measuring pass and benchmark bodies are in suites/_anchor.py; this module spells out
the operator's parameters (no torch import: asv spawns ~500 interpreters) and
tests/test_suites.py keeps them equal to the operator's own.
"""
from ._anchor import _Anchor, _Speedup, measurement

OP = "flash"
LABELS = ["B4 H16 N4096 D64 bf16", "B4 H16 N4096 D64 causal bf16",
          "B2 H16 N8192 D128 bf16", "B2 H16 N8192 D128 causal bf16"]  # flash's "anchor" set
VARIANTS = ["reference", "split", "triton", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"]
MODES = ["fwd", "bwd", "fwd_bwd"]
RATIO_PEERS = ["sdpa_flash", "sdpa_cudnn", "flex"]

measure_flash = measurement(OP)


class FlashAnchor(_Anchor):
    params = (LABELS, VARIANTS, MODES)
    setup_cache = measure_flash


class FlashTritonSpeedup(_Speedup):
    """Triton's speed as a multiple of each peer's (peer latency / Triton latency), same run."""

    params = (LABELS, MODES, RATIO_PEERS)
    setup_cache = measure_flash
