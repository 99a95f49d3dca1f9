"""Output allocation shared by every launcher, with a NaN-poisoning switch for verification.

A kernel that forgets to write an element leaves whatever ``torch.empty`` held, often zeros that
look like a plausible answer. Under ``poisoned_outputs()`` every output starts as NaN instead,
so an unwritten element fails any comparison.
"""
import contextlib

import torch

# Process-wide, not thread-local: autograd runs the backward of CUDA tensors on a thread of its own per
# device, and the backward kernels' outputs must be poisoned too (verification is single-threaded).
_poison = False


def _poisoning() -> bool:
    return _poison


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    """Within this block, launchers fill new outputs with NaN before the kernel writes them."""
    global _poison
    before = _poison
    _poison = enabled
    try:
        yield
    finally:
        _poison = before


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if _poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
