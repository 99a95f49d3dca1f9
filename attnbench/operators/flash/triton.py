"""The Triton flash operator's public API: manual-gradient calls and the autograd-integrated one.

``flash_fwd(q, k, v) -> (o, lse)`` and ``flash_bwd(do, q, k, v, o, lse) -> (dq, dk, dv)`` let a
training loop stitch gradients by hand; ``flash_attention(q, k, v)`` plugs the same kernels into
autograd. All three are the one differentiable op of ``attnbench.attention`` (every AD mode,
torch.func, torch.compile); every argument is checked there before any kernel launches.
"""
from ...attention import flash_attention, flash_bwd, flash_fwd, unavailable_reason, unsupported_on_cuda

__all__ = ["flash_attention", "flash_bwd", "flash_fwd", "unavailable_reason", "unsupported_on_cuda"]
