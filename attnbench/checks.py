"""Argument checks the public functions share: a clear error naming the argument before anything
runs, and a refusal, rather than a silent drop, where a function has no derivatives."""
import torch
import torch.autograd.forward_ad as fwAD

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def require_tensor(name: str, value) -> None:
    """TypeError naming ``name`` unless ``value`` is a dense tensor (checked before any attribute is read): a
    sparse one passed every later check and failed inside the launch, naming a memory format."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout} (call .to_dense())")
    if value.is_nested:  # a strided nested tensor: reading its shape is PyTorch's internal error
        raise TypeError(f"{name} must be a dense tensor, got a nested one (pad it: .to_padded_tensor(0))")


def require_dtype(name: str, value) -> None:
    """TypeError naming ``name`` unless ``value`` is a torch.dtype (or None)."""
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype or None, got {value!r}")


def require_float_dtype(name: str, dtype) -> None:
    """TypeError naming ``name`` unless ``dtype`` is one of FLOAT_DTYPES."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; supported: float16, bfloat16, float32, float64")


def require_float_tensor(name: str, value, dims: int, layout: str) -> None:
    """A tensor (``require_tensor``) with ``dims`` dimensions (a ValueError naming them as ``layout`` otherwise)
    and a dtype of FLOAT_DTYPES (``require_float_dtype``)."""
    require_tensor(name, value)
    if value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions {layout}; got shape {tuple(value.shape)}")
    require_float_dtype(name, value.dtype)


def require_size(name: str, size: int, other: str, expected: int) -> None:
    """ValueError unless ``size`` equals ``expected``, naming both: "k batch (2) must equal q batch (1)"."""
    if size != expected:
        raise ValueError(f"{name} ({size}) must equal {other} ({expected})")


def require_head_groups(heads_q: int, heads_kv: int, kv_name: str) -> None:
    """ValueError unless the query heads are a whole number of groups of ``kv_name``'s heads (GQA/MQA)."""
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"q heads ({heads_q}) must be a multiple of {kv_name} heads ({heads_kv}) (GQA/MQA)")


def require_head_dim(head_dim: int, low: int, high: int, what: str) -> None:
    """ValueError unless ``low <= head_dim <= high``, the head dims ``what`` (the kernels' name) supports."""
    if not low <= head_dim <= high:
        raise ValueError(f"head_dim {head_dim} is unsupported: {what} needs {low} <= head_dim <= {high}")


def refuse_derivatives(what: str, tensors, alternative: str) -> None:
    """``what`` has no derivatives: refuse every way one could be asked for rather than drop it (a
    forward-AD tangent would vanish silently, a gradient would be zero) or fail inside a launch
    (torch.func's wrapped tensors have no storage). Non-tensors are left to the argument checks."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    # (Dynamo cannot trace the functorch query; a compiled region's torch.func transforms meet the op's own refusal)
    if not torch.compiler.is_compiling() and any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise NotImplementedError(f"{what}: no derivatives and no batching rule, so not under torch.func transforms "
                                  f"(grad, jvp, vmap, ...); {alternative}")
    if fwAD._current_level >= 0 and any(fwAD.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"{what}: no forward-mode derivative (a dual input's tangent would be dropped); "
                                  f"{alternative}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{what}: no backward (inputs that require grad are refused, not detached); call it "
                           f"under torch.no_grad(), or {alternative}")
