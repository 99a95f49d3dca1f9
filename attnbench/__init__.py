"""attnbench: verification and benchmarking of attention-family GPU operators.

    op = attnbench.get("flash")
    case = op.cases("anchor")[0]
    x = op.make_inputs(case, device="cuda", seed=0)
    outputs = op.variants["triton"].prepare(case, x, "bwd")()
"""
from . import kernels  # noqa: F401  first: it sets Triton's CPU-interpreter switch before triton loads
from .bench.registry import Operator, Unsupported, Variant, all_operators, get, register

__version__ = "0.1.0"
__all__ = ["Operator", "Unsupported", "Variant", "all_operators", "get", "register", "__version__"]
