"""32-bit address arithmetic inside one slice: the kernels compute a tensor's batch and head offsets in int64
but the offsets inside one [rows, cols] slice (row x row stride + column x column stride) in int32, which is
faster; a slice spread wider than that (a long sequence in a [B, N, H, D] view, a batch-innermost layout) is
copied compact before launch, and a slice too large even then is refused."""

INT32_MAX = 2**31 - 1


def offset_span(t, dims: int) -> int:
    """The largest offset inside one slice of ``t``'s last ``dims`` dims: sum of (size - 1) x |stride|."""
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in range(t.dim() - dims, t.dim()))


def slice_needs_copy(t, what: str, per: str, unit_last: bool = False) -> bool:
    """Whether ``t`` must be copied compact (``t.contiguous()``) for such a kernel: its last two dims' offsets
    pass INT32_MAX, or (``unit_last``, kernels that take a contiguous last dim) its last dim is strided.
    Raises ValueError, naming ``what`` and the slice (``per``: "head", "sample"), when a compact slice would
    pass 2**31 - 1 elements too."""
    rows, cols = t.shape[-2], t.shape[-1]
    if offset_span(t, 2) <= INT32_MAX and (t.stride(-1) == 1 or not unit_last):
        return False
    if rows * cols > INT32_MAX:
        raise ValueError(f"{what}: {rows} x {cols} = {rows * cols} exceeds 2**31 - 1 elements per {per}")
    return True


def sample_int32(t, shared: bool):
    """``t``, or its compact copy where offsets inside one sample (int32 in the kernels) would overflow: the per-sample
    kernels (sparse/fused_dense.py, sparse/channelwise.py) hold a few rows of channels a sample, so a compact one fits.
    ``shared``: ``t`` has no batch dim."""
    return t.contiguous() if offset_span(t, t.dim() - (0 if shared else 1)) > INT32_MAX else t


def sample_strides(t, shared: bool) -> tuple:
    """The batch stride (0 when ``t`` is shared: no batch dim) and the in-sample strides of an operand."""
    return (0,) + t.stride() if shared else t.stride()
