"""Triton kernels and their thin launchers, installed as ``attnbench.kernels``.

Only ``@triton.jit`` code and the launchers that size grids and allocate outputs live here;
argument checking, autograd wiring and everything else live in ``attnbench``.
"""
import os
import sys

import torch

# Triton runs on a CPU only through its interpreter, and it reads that switch when a function is
# decorated, its own ``tl.zeros`` and friends included: the switch must be set before triton is
# first imported (``torch.nn.attention`` imports it too), which is why attnbench imports this first.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton.language" in sys.modules:
        raise ImportError(
            "triton was imported before attnbench on a machine without CUDA, so its kernels cannot run "
            "in the interpreter: import attnbench first, or set TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"

from .outputs import new_output, poisoned_outputs  # noqa: E402

__all__ = ["new_output", "poisoned_outputs", "interpreting", "unavailable_reason"]


# os.environ's own store (CPython, POSIX: encoded keys and values), which os.environ's setters and
# monkeypatch.setenv update: a lookup there costs 30 ns against os.environ.get's 1.2 us, and every
# launch asks a few such questions (host time is what small eager calls pay for).
_ENVIRON = os.environ._data if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None
_ENVIRON_OWNER = os.environ  # a test that replaces os.environ itself (mock.patch.object) is read the slow way


def env_value(name: str, default: str) -> str:
    """os.environ.get(name, default), read fast where the platform allows."""
    if _ENVIRON is None or os.environ is not _ENVIRON_OWNER:
        return os.environ.get(name, default)
    value = _ENVIRON.get(name.encode())
    return default if value is None else os.fsdecode(value)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (numpy), not on a GPU."""
    return env_value("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device, kernels: str) -> str | None:
    """Why the Triton ``kernels`` (a name for the message) cannot run on ``device`` in this process, or
    None: they run on CUDA, or on the CPU through the interpreter, never both in one process."""
    device = torch.device(device)
    if device.type == "cuda":
        return "TRITON_INTERPRET=1 runs kernels on the CPU; move the tensors to the CPU or unset it" \
            if interpreting() else None
    if device.type == "cpu" and interpreting():
        return None
    return f"the Triton {kernels} kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); got {device}"
