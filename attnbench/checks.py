"""Argument checks the public functions share: a clear error naming the argument before anything
runs, and a refusal, rather than a silent drop, where a function has no derivatives."""
import torch
import torch.autograd.forward_ad as fwAD


def require_tensor(name: str, value) -> None:
    """TypeError naming ``name`` unless ``value`` is a tensor (checked before any attribute is read)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def require_dtype(name: str, value) -> None:
    """TypeError naming ``name`` unless ``value`` is a torch.dtype (or None)."""
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or None, got {value!r}")


def refuse_derivatives(what: str, tensors, alternative: str) -> None:
    """``what`` has no derivatives: refuse every way one could be asked for rather than drop it (a
    forward-AD tangent would vanish silently, a gradient would be zero) or fail inside a launch
    (torch.func's wrapped tensors have no storage). Non-tensors are left to the argument checks."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise NotImplementedError(f"{what}: no derivatives and no batching rule, so not under torch.func transforms "
                                  f"(grad, jvp, vmap, ...); {alternative}")
    if fwAD._current_level >= 0 and any(fwAD.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"{what}: no forward-mode derivative (a dual input's tangent would be dropped); "
                                  f"{alternative}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{what}: no backward (inputs that require grad are refused, not detached); call it "
                           f"under torch.no_grad(), or {alternative}")
