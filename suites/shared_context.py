"""asv benchmarks for the shared_context operator: every variant on the anchor decode cases, and the
fused Triton kernel's speed over each peer (per-batch SDPA, split, stride-0 expand, Hydragen folding).

The shared measuring pass and benchmark bodies are in suites/_anchor.py; this module spells out the
operator's parameters (no torch import: asv runs one process per combination) and
tests/bench/test_suites.py keeps them equal to the operator's own. GB/s and % of roofline are against the
operator's minimum bytes (context read once): for these memory-bound decode steps, % of the copy
bandwidth. A per-batch cache that does not fit, or a peer without a feature, is skipped with its reason.
"""
from ._anchor import operator_suites

OP = "shared_context"
LABELS = ["B1024 H4 Lq2 ctx2048 buf32 D32 bf16", "B256 H4 Lq1 ctx512 buf0 D32 bf16",
          "B4096 H4 Lq1 ctx10000 buf0 D32 bf16", "B4096 H4 Lq2 ctx512 buf32 D32 bf16",
          "B256 H4 Lq2 ctx10000 buf32 D32 bf16", "B256 H32/8 Lq1 ctx4096 buf512 D128 bf16",
          "B512 H32/8 Lq1 ctx8192 buf256 D128 bf16", "B1024 H32/8 Lq1 ctx16384 buf128 D128 bf16"]  # "anchor"
VARIANTS = ["reference", "split", "triton", "triton_composed", "per_batch_math", "per_batch_flash",
            "per_batch_cudnn", "expand0_flash", "fold_flash", "fold_cudnn", "flashinfer_cascade"]
MODES = ["fwd"]
RATIO_PEERS = ["per_batch_flash", "per_batch_cudnn", "split", "expand0_flash", "fold_flash", "fold_cudnn",
               "flashinfer_cascade"]
# the lambda: this module's own function, which asv keys the measuring pass's cache by (_anchor.measurement)
measure_shared_context, SharedContextAnchor, SharedContextTritonSpeedup = operator_suites(lambda: None, OP, LABELS,
    VARIANTS, MODES, RATIO_PEERS, "SharedContextAnchor", "SharedContextTritonSpeedup",
    "The fused kernel's speed as a multiple of each peer's (peer latency / Triton latency), same run.")
