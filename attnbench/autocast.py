"""torch.autocast for the attention operators: inside a region they take their inputs as SDPA does.

SDPA is one of autocast's lower-precision ops: its floating inputs other than float64 arrive in the
region's dtype. Our functions do the same, so that swapping SDPA for them inside a mixed-precision
training or inference loop keeps its dtypes (the kernels had run in float32 there and returned float32).
"""
import torch

AUTOCAST_DEVICES = ("cpu", "cuda")  # where the kernels run (the interpreter, a GPU)


def autocast_inputs(*tensors):
    """``tensors`` as an autocast region on the first one's device hands them to SDPA: floating
    tensors other than float64 cast to the region's dtype (differentiably: gradients come back in
    the caller's dtype). Outside a region, and non-tensors (left for the checks to refuse), as given."""
    # one argument-free query first: outside every region (the usual call) nothing else is read (host time)
    if not torch._C._is_any_autocast_enabled():
        return tensors
    first = tensors[0]
    # (autocast knows no 'meta' device, where is_autocast_enabled raises; the device checks refuse it by name)
    if not isinstance(first, torch.Tensor) or first.device.type not in AUTOCAST_DEVICES \
            or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype not in (dtype, torch.float64) else t for t in tensors)
