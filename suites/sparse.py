"""asv benchmarks for the sparse operator: fwd, bwd and double backward of every variant on the anchor cases (the
issue's grid for the fully connected layer's vecsca and vecmat and the message-passing segment sum), with peak
GPU memory.

The shared measuring pass and benchmark bodies are in suites/_anchor.py; this module spells out the operator's
parameters (no torch import: the labels are built by plain string formatting, in the order of the operator's
"anchor" set) and tests/bench/test_suites.py keeps them equal.
"""
from ._anchor import operator_suites

OP = "sparse"
LABELS = [f"{op} L{l} N{n} C{c}{' shared-y' if op == 'vecmat' else ''} {dtype}"
          for dtype in ("fp32", "bf16") for op in ("vecsca", "vecmat", "scale")
          for l in (2, 3, 4, 6) for c in (32, 128) for n in (10000, 100000)]  # sparse's "anchor" set (96 cases)
VARIANTS = ["reference", "split", "triton", "torch_csr", "e3nn", "cuequivariance"]
MODES = ["fwd", "bwd", "double_bwd"]
RATIO_PEERS = ["split", "reference", "torch_csr", "e3nn", "cuequivariance"]
# the lambda: this module's own function, which asv keys the measuring pass's cache by (_anchor.measurement)
measure_sparse, SparseAnchor, SparseSpeedup = operator_suites(lambda: None, OP, LABELS, VARIANTS, MODES,
    RATIO_PEERS, "SparseAnchor", "SparseSpeedup",
    "The Triton Functions' speed as a multiple of split-PyTorch's, the einsum reference's, torch CSR's and "
    "e3nn's, same run (the issue's bars: >= 1.5x split, >= 1.0x e3nn).")
