"""Output allocation shared by every launcher, with a NaN-poisoning switch for verification.

A kernel that forgets to write an element leaves whatever ``torch.empty`` held, often zeros that
look like a plausible answer. Under ``poisoned_outputs()`` every output starts as NaN instead,
so an unwritten element fails any comparison.
"""
import contextlib
import threading

import torch

_state = threading.local()


def _poisoning() -> bool:
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    """Within this block, launchers fill new outputs with NaN before the kernel writes them."""
    before = _poisoning()
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = before


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if _poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
