"""Triton kernels and their thin launchers, installed as ``attnbench.kernels``.

Only ``@triton.jit`` code and the launchers that size grids and allocate outputs live here;
argument checking, autograd wiring and everything else live in ``attnbench``.
"""
import os

import torch

# Triton runs on a CPU only through its interpreter, and it reads that switch when a kernel is
# decorated: set it before any kernel module below is imported, so the CPU gate needs no flag.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .outputs import new_output, poisoned_outputs  # noqa: E402

__all__ = ["new_output", "poisoned_outputs", "interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (numpy), not on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
