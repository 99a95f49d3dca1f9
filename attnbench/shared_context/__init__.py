"""The Triton shared_context operator's public API (forward only: the decode step is a forward).

    o, lse = shared_context_attention(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal=False)
        the shipped path: one fused launch (context, buffer and the split-K merge)
    o, lse = shared_context_attention_composed(...)
        path (a): context kernel (+ split reduction), buffer kernel, merge_states kernel
    o, lse = context_attention(q, k_ctx, v_ctx)         the shared context alone
    o, lse = buffer_attention(q, k_buf, v_buf, buf_lens) each sample's buffer alone

Shapes and the mask are those of spec.py; lse is float32 (float64 for float64 inputs), natural
log, -inf for rows that see no key. Every argument is checked here, before any kernel launches.
There is no backward: inputs that require grad under grad mode are refused, never silently
detached. ``reference`` (the per-batch cache, the float64 oracle) and ``split`` (the seed's
PyTorch: context einsum, buffer matmul, merge) compute the same function in plain PyTorch.
"""
from typing import Optional

import torch

from ..attention.ops import interpreter_upcasts
from ..autocast import autocast_inputs
from ..checks import refuse_derivatives, require_tensor
from ..kernels import unavailable_reason as kernels_unavailable_reason
from ..kernels.launch import readable, tensor_signature
from ..kernels.offsets import slice_needs_copy
from ..kernels.precision import lse_dtype
from ..kernels.shared_context import buffer_launch, composed_launch, context_launch, fused_launch
from .spec import check_inputs


def unavailable_reason(device) -> str | None:
    """Why the kernels cannot run on ``device`` in this process, or None."""
    return kernels_unavailable_reason(device, "shared_context")


def unsupported_on_cuda(dtype, head_dim):
    """fp64 tiles take 8 bytes a value: past head_dim 128 no configuration fits shared memory."""
    if dtype == torch.float64 and head_dim > 128:
        return f"float64 on CUDA supports head_dim <= 128 (got {head_dim}); use float32 or run on CPU"
    return None


def _needs_copy(name, t) -> bool:
    """Whether ``t`` must be copied: the kernels take a contiguous head dimension and int32-safe
    offsets inside one head (row x row stride); the batch and head offsets are int64 in them."""
    return t is not None and slice_needs_copy(t, name, "head", unit_last=True)


def _unit_stride(name, t):
    return t.contiguous() if _needs_copy(name, t) else t


NO_DERIVATIVES = "shared_context's Triton kernels"
DERIVATIVES_ELSEWHERE = ("use the reference or split implementation (attnbench.shared_context.reference, .split) for "
                         "derivatives")
_CHECKED = {}  # call signature -> (Shapes, which tensors to copy to unit stride): see _checked
MAX_REMEMBERED = 4096  # signatures; past this the memo starts over (a sweep of shapes, not a decode loop)


def _signature(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale):
    """Everything check_inputs reads, when it reads no values (None: not memoizable, check in full)."""
    if not (isinstance(causal, bool) and (scale is None or type(scale) in (float, int))):
        return None
    tensors = (q, k_ctx, v_ctx, k_buf, v_buf, buf_lens)
    dense = (t is None or (type(t) is torch.Tensor and t.layout is torch.strided and not t.is_nested) for t in tensors)
    if not all(dense):
        return None
    return (*(tensor_signature(t) for t in tensors), causal, scale)


def _checked(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths):
    """Check a call and bring its tensors to what the kernels take. A decode loop repeats one call
    signature every step; the checks that read only shapes, strides, dtypes and devices passed for
    it once and are not repeated (host time is the decode step's bound at small sizes). Inside
    torch.autocast the inputs are cast as SDPA's are (attnbench/autocast.py)."""
    q, k_ctx, v_ctx, k_buf, v_buf = autocast_inputs(q, k_ctx, v_ctx, k_buf, v_buf)
    refuse_derivatives(NO_DERIVATIVES, (q, k_ctx, v_ctx, k_buf, v_buf), DERIVATIVES_ELSEWHERE)
    reads_values = check_lengths and buf_lens is not None
    key = None if reads_values else _signature(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale)
    known = _CHECKED.get(key) if key is not None else None
    if known is None:
        require_tensor("q", q)
        if reason := unavailable_reason(q.device):  # before check_inputs reads the lengths (a meta tensor has none)
            raise ValueError(reason)
        shapes = check_inputs(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal=causal, scale=scale,
                              check_lengths=check_lengths)
        if q.device.type == "cuda" and (reason := unsupported_on_cuda(q.dtype, shapes.head_dim)):
            raise ValueError(reason)
        copies = tuple(_needs_copy(n, t) for n, t in
                       (("q", q), ("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_buf", k_buf), ("v_buf", v_buf)))
        known = shapes, copies
        if key is not None:
            if len(_CHECKED) >= MAX_REMEMBERED:
                _CHECKED.clear()
            _CHECKED[key] = known
    shapes, copies = known
    if reason := unavailable_reason(q.device):
        raise ValueError(reason)
    if shapes.n_buf == 0:
        k_buf = v_buf = buf_lens = None
    elif buf_lens is not None and not buf_lens.is_contiguous():
        buf_lens = buf_lens.contiguous()
    tensors = [None if t is None else readable(t.contiguous() if copy else t)
               for t, copy in zip((q, k_ctx, v_ctx, k_buf, v_buf), copies)]
    if interpreter_upcasts(q.dtype):  # numpy has no bfloat16: the interpreter runs it as float32
        tensors = [None if t is None else t.float() for t in tensors]
    return shapes, (*tensors, buf_lens), key


def _in_dtype(out, shapes):
    """(o, lse) with o in the inputs' dtype (bfloat16 results of the interpreter's float32 run)."""
    o, lse = out
    return (o if o.dtype == shapes.dtype else o.to(shapes.dtype)), lse


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_NB", "num_warps", "num_stages")


def _check_config(name, config):
    """A forced launch configuration: None, or a dict of CONFIG_KEYS to positive ints (a kernel
    ignores the blocks it has none of, so a misspelt key would otherwise pass unnoticed)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise TypeError(f"{name} must be a dict of {', '.join(CONFIG_KEYS)} or None, got {type(config).__name__}")
    for key, value in config.items():
        if key not in CONFIG_KEYS:
            raise ValueError(f"{name}: unknown key {key!r}; known: {', '.join(CONFIG_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}[{key!r}] must be a positive int, got {value!r}")
        # blocks are tl.arange extents (powers of two) and tl.dot operands (16 on a GPU; the interpreter's buffer
        # config takes 8 keys); the merge tickets are sized for BLOCK_M >= 16; Triton takes warps in powers of two
        least = 16 if key == "BLOCK_M" else 8
        if key.startswith("BLOCK_") and (value < least or value & (value - 1)):
            raise ValueError(f"{name}[{key!r}] must be a power of two >= {least}, got {value}")
        if key == "num_warps" and value & (value - 1):
            raise ValueError(f"{name}['num_warps'] must be a power of two, got {value}")


def _num_splits(num_splits):
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (automatic), got {num_splits!r}")
    return num_splits


def shared_context_attention(q, k_ctx, v_ctx, k_buf=None, v_buf=None, buf_lens=None, *, causal=False, scale=None,
                             check_lengths=True, num_splits=None, config=None):
    """The shipped path: context, buffer and merge in one fused launch. ``num_splits`` forces the
    split-K count (None: measured once per shape on CUDA, else ``choose_splits``; see
    attnbench/kernels/shared_context/split_count.py); ``config`` forces one launch configuration."""
    if torch.compiler.is_compiling():
        return _compiled("fused", q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits,
                         config)
    return _fused(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, config)


def _fused(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, config):
    num_splits = _num_splits(num_splits)
    _check_config("config", config)
    shapes, (q, k_ctx, v_ctx, k_buf, v_buf, buf_lens), signature = _checked(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens,
                                                                            causal, scale, check_lengths)
    return _in_dtype(fused_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, shapes.causal, shapes.scale,
                                  num_splits=num_splits, config=config, signature=signature), shapes)


def shared_context_attention_composed(q, k_ctx, v_ctx, k_buf=None, v_buf=None, buf_lens=None, *, causal=False,
                                      scale=None, check_lengths=True, num_splits=None, context_config=None,
                                      buffer_config=None):
    """Path (a): the context kernel (and its split reduction), the buffer kernel, then merge_states."""
    if torch.compiler.is_compiling():
        return _compiled("composed", q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits,
                         context_config, buffer_config)
    return _composed(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, context_config,
                     buffer_config)


def _composed(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, context_config,
              buffer_config):
    num_splits = _num_splits(num_splits)
    _check_config("context_config", context_config)
    _check_config("buffer_config", buffer_config)
    shapes, (q, k_ctx, v_ctx, k_buf, v_buf, buf_lens), _ = _checked(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal,
                                                                    scale, check_lengths)
    return _in_dtype(composed_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, shapes.causal, shapes.scale,
                                     num_splits=num_splits, context_config=context_config,
                                     buffer_config=buffer_config), shapes)


def context_attention(q, k_ctx, v_ctx, *, scale=None, num_splits=None, config=None):
    """Every sample's queries against the shared context alone (e.g. batched point prediction)."""
    if torch.compiler.is_compiling():
        return _compiled("context", q, k_ctx, v_ctx, None, None, None, False, scale, False, num_splits, config)
    return _context(q, k_ctx, v_ctx, scale, num_splits, config)


def _context(q, k_ctx, v_ctx, scale, num_splits, config):
    num_splits = _num_splits(num_splits)
    _check_config("config", config)
    shapes, (q, k_ctx, v_ctx, *_), _ = _checked(q, k_ctx, v_ctx, None, None, None, False, scale, False)
    _require_context(shapes)
    return _in_dtype(context_launch(q, k_ctx, v_ctx, shapes.scale, num_splits=num_splits, config=config), shapes)


def buffer_attention(q, k_buf, v_buf, buf_lens=None, *, causal=False, scale=None, check_lengths=True, config=None):
    """Each sample's queries against its own buffer alone."""
    if torch.compiler.is_compiling():
        return _compiled("buffer", q, None, None, k_buf, v_buf, buf_lens, causal, scale, check_lengths, None, config)
    return _buffer(q, k_buf, v_buf, buf_lens, causal, scale, check_lengths, config)


def _require_context(shapes):
    if shapes.n_ctx == 0:
        raise ValueError("context_attention needs n_ctx >= 1")


def _buffer(q, k_buf, v_buf, buf_lens, causal, scale, check_lengths, config):
    _check_config("config", config)
    require_tensor("k_buf", k_buf)
    if k_buf.dim() != 4:
        raise ValueError(f"k_buf must have 4 dimensions [batch, heads_kv, n_buf, head_dim]; got shape "
                         f"{tuple(k_buf.shape)}")
    empty_ctx = k_buf.new_empty((k_buf.shape[1], 0, k_buf.shape[3]))
    shapes, (q, _, _, k_buf, v_buf, buf_lens), _ = _checked(q, empty_ctx, empty_ctx, k_buf, v_buf, buf_lens, causal,
                                                            scale, check_lengths)
    return _in_dtype(buffer_launch(q, k_buf, v_buf, buf_lens, shapes.causal, shapes.scale, config=config), shapes)


# ----------------------------------------------------------------------------- torch.compile

def _compiled(path, q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, config,
              config2=None):
    """A call under torch.compile: one custom op (attnbench::shared_context), which runs the eager path, every
    check included, when the compiled code runs. Dynamo cannot trace that path (functorch queries, data
    pointers, launch plans) and Inductor must not see inside it. The checks that read no tensor data run
    here too, so that a bad call fails while compiling, with the eager message."""
    q, k_ctx, v_ctx, k_buf, v_buf = autocast_inputs(q, k_ctx, v_ctx, k_buf, v_buf)
    _num_splits(num_splits)
    for name, c in (("config", config), ("buffer_config", config2)):
        _check_config(name, c)
    refuse_derivatives(NO_DERIVATIVES, (q, k_ctx, v_ctx, k_buf, v_buf), DERIVATIVES_ELSEWHERE)
    if path != "buffer":
        shapes = check_inputs(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal=causal, scale=scale, check_lengths=False)
        if path == "context":
            _require_context(shapes)
    if scale is not None and not isinstance(scale, (int, float)):
        scale = float(scale)  # a numpy scalar: the op's schema takes a float
    return _shared_context_op(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, path, causal, scale, check_lengths,
                              num_splits, _config_list(config), _config_list(config2))


def _config_list(config):
    return None if config is None else [config.get(key, 0) for key in CONFIG_KEYS]


def _config_dict(values):
    return None if values is None else {key: v for key, v in zip(CONFIG_KEYS, values) if v}


@torch.library.custom_op("attnbench::shared_context", mutates_args=())
def _shared_context_op(q: torch.Tensor, k_ctx: Optional[torch.Tensor], v_ctx: Optional[torch.Tensor],
                       k_buf: Optional[torch.Tensor], v_buf: Optional[torch.Tensor], buf_lens: Optional[torch.Tensor],
                       path: str, causal: bool, scale: Optional[float], check_lengths: bool, num_splits: Optional[int],
                       config: Optional[list[int]], config2: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    config, config2 = _config_dict(config), _config_dict(config2)
    if path == "fused":
        return _fused(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, config)
    if path == "composed":
        return _composed(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, scale, check_lengths, num_splits, config,
                         config2)
    if path == "context":
        return _context(q, k_ctx, v_ctx, scale, num_splits, config)
    return _buffer(q, k_buf, v_buf, buf_lens, causal, scale, check_lengths, config)


@_shared_context_op.register_fake
def _(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, path, causal, scale, check_lengths, num_splits, config, config2):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
