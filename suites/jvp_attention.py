"""asv benchmarks for jvp_attention: fwd+JVP and both Hessian-vector routes (and the gradient of a
tangent output) for every variant on the anchor cases, with peak GPU memory.

The shared measuring pass and benchmark bodies are in suites/_anchor.py; this module spells out
the operator's parameters (no torch import) and tests/bench/test_suites.py keeps them equal.
"""
from ._anchor import operator_suites, speedup_suite

OP = "jvp_attention"
LABELS = ["B4 H16 N2048 D64 bf16", "B4 H16 N4096 D64 causal bf16", "B2 H16 N4096 D128 bf16",
          "B2 H8 N2048 D64 bf16"]  # jvp_attention's "anchor" set
VARIANTS = ["reference", "split", "triton", "triton_fused", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
            "flex", "jvp_flash"]
MODES = ["fwd_jvp", "hvp_fwd_rev", "hvp_rev_rev", "vjp_of_jvp", "hvp_func"]
RATIO_PEERS = ["sdpa_math", "jvp_flash"]
# the lambda: this module's own function, which asv keys the measuring pass's cache by (_anchor.measurement)
measure_jvp_attention, JvpAttentionAnchor, JvpAttentionSpeedup = operator_suites(lambda: None, OP, LABELS, VARIANTS,
    MODES, RATIO_PEERS, "JvpAttentionAnchor", "JvpAttentionSpeedup",
    "Our route's speed as a multiple of SDPA MATH's and jvp-flash-attention's, same run.")
JvpAttentionFusedSpeedup = speedup_suite(
    "JvpAttentionFusedSpeedup", measure_jvp_attention, LABELS, MODES, RATIO_PEERS,
    "The kernels called directly, as a multiple of each peer.", subject="triton_fused")
